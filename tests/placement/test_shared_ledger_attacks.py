"""The shared budget's ledger under attack and under load (issue 39 points 3-7, issue 41 point 9):
fork, exec, forged slots, squatted folders, a watcher racing its manager's miss, late answers,
clean-up, and a random walk of six members with SIGKILLs.

Level: **real** (the real Cython pool and MemoryManager on gpumem_sim cards shared through the
ledger, real processes started with multiprocessing's spawn context, real fork, exec and
signals; the cross-user case as two real users, where the tests run as root). Every wait has a
timeout, so a broken run fails instead of hanging; no test asserts a speed, only generous bounds.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import shared_workers
from gpumem import MemoryManager
from gpumem.config import SEGMENT_POLICIES
from gpumem.errors import OutOfMemoryError
from gpumem.placement.ledger import CARD as CARD_SLOT
from gpumem.placement.ledger import MEMBER, Ledger, process_start_time
from gpumem.placement.shared_budget import group_members
from shared_workers import MiB, shared_config
from test_shared_budget import (CARD, JOIN, forge_slot, ledger_file, lingering_ledger,
                                malloc_once_gone, spawn, stop_child)


@pytest.fixture
def shared_dir(monkeypatch):
    """A private ledger folder (short, for the sockets' path limit) for this test only."""
    path = tempfile.mkdtemp(prefix="gmla", dir="/tmp")
    monkeypatch.setenv("GPUMEM_SHARED_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_forked_child_does_not_keep_a_killed_members_lock_or_slot(shared_dir):
    """A member forks a child (a DataLoader worker), then is SIGKILLed while it holds the
    ledger's lock: the child, still sleeping, keeps neither the lock nor the member's slot, so
    a new member joins and gets the dead member's 200 MiB of the 256 MiB card at once."""
    ctx = spawn()
    here, there = ctx.Pipe()
    member = ctx.Process(target=shared_workers.fork_then_die_holding_lock,
                         args=(CARD, "fork", 200 * MiB, there, shared_dir))
    member.start()
    assert here.poll(JOIN)
    child = here.recv()
    try:
        deadline = time.monotonic() + JOIN       # (not join(): the child holds its sentinel)
        while member.exitcode is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert member.exitcode == -signal.SIGKILL
        assert process_start_time(child) is not None          # the child lives on
        with MemoryManager(CARD, shared_config("fork")) as mm:  # the lock is free
            buf = malloc_once_gone(mm, 200 * MiB)   # its slot and card reaped
            assert [m.pid for m in mm._growth.shared.members()] == [os.getpid()]
            buf.free()
    finally:
        os.kill(child, signal.SIGKILL)
        member.join(JOIN)


def test_forked_child_is_not_a_member_and_the_parent_stays_one(shared_dir):
    """After fork, the parent's slot stays alive (the child dropped only its own copy of the
    ledger), and the child sees the group as an outsider: it reads the parent's slot, holds
    none, and leaving in the child changes nothing."""
    with MemoryManager(CARD, shared_config("forkread")) as mm:
        buf = mm.malloc(64 * MiB)
        shared = mm._growth.shared
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:                              # the child: report, never raise
            try:
                members = shared.members()
                shared.leave()
                out = json.dumps([[m.pid, m.alive, m.reserved] for m in members])
            except BaseException as exc:          # noqa: BLE001 - reported to the parent
                out = json.dumps(repr(exc))
            os.write(write_end, out.encode())
            os._exit(0)
        os.close(write_end)
        os.waitpid(pid, 0)
        got = json.loads(os.read(read_end, 65536).decode())
        os.close(read_end)
        assert got == [[os.getpid(), True, 64 * MiB]], got
        (me,) = shared.members()
        assert me.alive and me.reserved == 64 * MiB
        buf.free()


def test_an_execd_member_is_reaped_like_a_dead_one(shared_dir):
    """A member holding 200 MiB of a 256 MiB card execs another program (same pid, same start
    time): its share, in the budget and on the card, is free for the growths that need it, as
    a SIGKILLed member's is (it never was: the pid and start time still match)."""
    ctx = spawn()
    ready = ctx.Event()
    member = ctx.Process(target=shared_workers.exec_after_join,
                         args=(CARD, "exec", 200 * MiB, ready, shared_dir))
    member.start()
    try:
        assert ready.wait(JOIN)
        deadline = time.monotonic() + JOIN        # until the exec has happened
        while b"time.sleep" not in open(f"/proc/{member.pid}/cmdline", "rb").read():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert process_start_time(member.pid) is not None
        with MemoryManager(CARD, shared_config("exec")) as mm:
            buf = malloc_once_gone(mm, 200 * MiB)
            assert [m.pid for m in mm._growth.shared.members()] == [os.getpid()]
            buf.free()
    finally:
        member.kill()
        member.join(JOIN)


def test_a_forged_slot_naming_a_live_process_is_reaped(shared_dir):
    """A slot written by hand naming pid 1 with its true start time and 200 MiB (it never
    joined: it holds no liveness lock) does not keep a share: a 200 MiB allocation on the
    256 MiB budget succeeds and the slot is gone."""
    with MemoryManager(CARD, shared_config("forged")) as mm:
        probe = Ledger(ledger_file(shared_dir))
        try:
            forge_slot(probe, 1, process_start_time(1) or 0, 200 * MiB)
            buf = mm.malloc(200 * MiB)
            assert [m.pid for m in group_members(probe)] == [os.getpid()]
        finally:
            probe.close()
        buf.free()


def slot_of(shared_dir: str, member: MemoryManager):
    probe = Ledger(ledger_file(shared_dir))
    try:
        with probe.locked() as ledger:
            return ledger.slot(member._growth.shared._index)
    finally:
        probe.close()


def test_the_watcher_never_overwrites_a_claim_made_mid_miss(shared_dir):
    """Member a is mid-miss (its slow-path lock held, 100 MiB claimed in its slot, 60 MiB
    held) when member b asks it for cache: a's watcher cannot take the lock and answers busy,
    leaving the claim; so b's 60 MiB past the 128 MiB budget is refused, and the members'
    slots never sum past the budget."""
    cfg = shared_config("claim", budget="128MiB")
    with MemoryManager(CARD, cfg) as a, MemoryManager(CARD, cfg) as b:
        a.malloc(60 * MiB).free()
        shared = a._growth.shared
        with a._growth.lock:
            shared.begin_miss()
            assert shared.allow(40 * MiB, 60 * MiB, 256 * MiB, 0, lambda: 256 * MiB)
            assert slot_of(shared_dir, a).reserved == 100 * MiB
            with pytest.raises(OutOfMemoryError):
                b.malloc(60 * MiB)
            deadline = time.monotonic() + JOIN
            while shared.requests_answered < 1:   # a's watcher has answered
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert slot_of(shared_dir, a).reserved == 100 * MiB
            assert slot_of(shared_dir, a).reserved + slot_of(shared_dir, b).reserved <= 128 * MiB
            shared.sync()                         # the end of a's miss
        assert slot_of(shared_dir, a).reserved == 60 * MiB


def test_a_miss_that_raises_drops_its_claim_at_once(shared_dir, monkeypatch):
    """A growth whose driver call raises (not an out-of-memory) after the budget claimed
    100 MiB for it: the error reaches the caller and the slot is back to what the member holds
    before malloc returns, not a second later."""
    cfg = shared_config("raise").replace(expandable_segments=False)
    with MemoryManager(CARD, cfg) as mm:
        def broken(size):
            raise RuntimeError("driver fell over")
        monkeypatch.setattr(mm.device, "alloc_segment", broken)
        with pytest.raises(RuntimeError, match="fell over"):
            mm.malloc(100 * MiB)
        assert slot_of(shared_dir, mm).reserved == mm.pool.reserved_bytes == 0


def test_a_late_but_running_member_still_hands_back(shared_dir):
    """A member caching 200 MiB of a 256 MiB card whose watcher gets to each request 0.5 s
    late (as on a loaded machine), its process running all along: another member's 200 MiB
    request waits for its answer and succeeds (it used to give up after 0.1 s)."""
    ctx = spawn()
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=shared_workers.hold_with_late_watcher,
                        args=(CARD, "late", 200 * MiB, 0.5, ready, stop, shared_dir))
    child.start()
    try:
        assert ready.wait(JOIN)
        with MemoryManager(CARD, shared_config("late")) as mm:
            mm.malloc(200 * MiB).free()
            (other,) = [m for m in mm._growth.shared.members() if m.pid == child.pid]
            assert other.answered >= 1 and other.released >= 200 * MiB
    finally:
        stop_child(child, stop)


# --- clean-up (issue 41 point 9) ------------------------------------------------------------

def test_prune_removes_dead_and_refused_ledgers_and_info_lists_live_groups(shared_dir, capsys):
    """`gpumem groups --prune` removes a ledger no process uses, a ledger of this user that is
    not trusted and the wake-up socket of a gone member, and keeps a live group; before it,
    `gpumem info` lists the live group only, plus one line for the other two."""
    from gpumem.cli import main
    dead = lingering_ledger("dead")
    refused = os.path.join(shared_dir, "junk.sim_1-1.ledger")
    with open(refused, "wb") as f:
        f.write(b"not a ledger")
    os.chmod(refused, 0o600)
    stale_socket = os.path.join(shared_dir, f"w999999-{12345:016x}.sock")
    open(stale_socket, "w").close()
    with MemoryManager(CARD, shared_config("alive")) as mm:
        assert main(["info"]) == 0
        out = capsys.readouterr().out
        assert "alive on sim_256MiB" in out and "dead on" not in out and "junk" not in out
        assert "2 ledger(s) of groups no process uses or that are not trusted" in out
        assert main(["groups"]) == 0
        out = capsys.readouterr().out
        assert f"ledger folder {shared_dir} (GPUMEM_SHARED_DIR)" in out
        assert "dead on" in out and "junk on" in out
        assert main(["groups", "--prune"]) == 0
        out = capsys.readouterr().out
        for path in (dead, refused, stale_socket):
            assert f"removed {path}" in out and not os.path.exists(path)
        live = mm._growth.shared
        assert os.path.exists(live.path) and os.path.exists(live._sock.getsockname())
        assert [m.pid for m in live.members()] == [os.getpid()]
    assert not [n for n in os.listdir(shared_dir) if n.endswith(".ledger")]


def test_the_last_member_removes_the_ledger_even_after_a_sigkill(shared_dir):
    """A member SIGKILLed while another lives: the survivor reaps it and, leaving last,
    removes the ledger file; a new member then starts a fresh ledger."""
    ctx = spawn()
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=shared_workers.hold_and_spin,
                        args=(CARD, "last", 64 * MiB, False, ready, stop, shared_dir))
    child.start()
    try:
        assert ready.wait(JOIN)
        mm = MemoryManager(CARD, shared_config("last"))
        path = mm._growth.shared.path
        os.kill(child.pid, signal.SIGKILL)
        child.join(JOIN)
        mm.close()
        assert not os.path.exists(path)
        with MemoryManager(CARD, shared_config("last")) as again:
            assert [m.pid for m in again._growth.shared.members()] == [os.getpid()]
    finally:
        stop_child(child, stop)


# --- a squatted default folder ----------------------------------------------------------------

@pytest.fixture
def default_folder(monkeypatch):
    """No GPUMEM_SHARED_DIR nor XDG_RUNTIME_DIR; a world-writable sticky base in place of
    /dev/shm, no /run/user/<uid>, a private home (short: the sockets' path limit):
    (base, home)."""
    from gpumem.placement import ledger_folder
    base = tempfile.mkdtemp(prefix="gmshm", dir="/tmp")
    os.chmod(base, 0o1777)
    home = tempfile.mkdtemp(prefix="gmhome", dir="/tmp")
    monkeypatch.delenv("GPUMEM_SHARED_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("HOME", home)
    monkeypatch.setattr(ledger_folder, "SHM_BASE", base)
    monkeypatch.setattr(ledger_folder, "RUN_USER_BASE", os.path.join(home, "no-run-user"))
    yield base, home
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(home, ignore_errors=True)


def test_a_symlink_planted_at_the_default_folder_is_avoided(default_folder, capsys):
    """A symlink planted at <base>/gpumem-<uid> (to a folder its planter controls): the group
    is joined in a private folder under the home instead, and `gpumem groups` says which
    folder and why."""
    from gpumem.cli import main
    base, home = default_folder
    target = tempfile.mkdtemp(prefix="gmplant", dir="/tmp")
    os.symlink(target, os.path.join(base, f"gpumem-{os.getuid()}"))
    try:
        with MemoryManager(CARD, shared_config("squat")) as mm:
            path = mm._growth.shared.path
            assert path.startswith(os.path.join(home, ".cache", "gpumem", "shared-"))
            mm.malloc(MiB).free()
            assert main(["groups"]) == 0
            out = capsys.readouterr().out
            assert f"ledger folder {os.path.dirname(path)}" in out
            assert "is a symlink" in out and "squat on sim_256MiB" in out
        assert os.listdir(target) == []
    finally:
        shutil.rmtree(target, ignore_errors=True)


_AS_USER = """
import os, sys
uid = int(sys.argv[1])
{prepare}
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
{act}
"""

# the victim: gpumem imported (and a group-less manager made) as root, since this Python's own
# files may be closed to other users; then, as the victim, a group joined on the default folder
_VICTIM = _AS_USER.format(prepare="""
import json
from gpumem.placement import ledger_folder
ledger_folder.SHM_BASE, ledger_folder.RUN_USER_BASE = sys.argv[2], sys.argv[3]
from gpumem import MemoryManager
from shared_workers import shared_config
import gpumem.placement.shared_budget, gpumem.placement.sim_card  # noqa: E401
MemoryManager("sim:64MiB").close()
""", act="""
os.environ["HOME"] = sys.argv[4]
with MemoryManager("sim:64MiB", shared_config("victim")) as mm:
    mm.malloc(1 << 20).free()
    print(json.dumps({"path": mm._growth.shared.path,
                      "why": ledger_folder.folder_choice().why}))
""")


def run_as(uid: int, code: str, *args: str) -> subprocess.CompletedProcess:
    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPUMEM_SHARED_DIR", "XDG_RUNTIME_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([here, os.path.dirname(os.path.dirname(here))])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, "-c", code, str(uid), *args], env=env,
                          capture_output=True, text=True, timeout=JOIN)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users (CI runs as root)")
def test_another_user_squatting_the_default_folder_denies_nothing():
    """Two real users: the squatter (nobody) creates <base>/gpumem-<victim uid> first; the
    victim (a uid of its own, no XDG_RUNTIME_DIR) still joins a group, in a private folder under
    its home, told why; the squatter's folder stays empty."""
    victim, squatter = 61_039, 65_534
    base = tempfile.mkdtemp(prefix="gmshm", dir="/tmp")
    os.chmod(base, 0o1777)
    home = tempfile.mkdtemp(prefix="gmhome", dir="/tmp")
    os.chown(home, victim, victim)
    try:
        planted = os.path.join(base, f"gpumem-{victim}")
        made = run_as(squatter, _AS_USER.format(prepare="", act=f"os.mkdir({planted!r}, 0o777)"))
        assert made.returncode == 0, made.stderr
        assert os.stat(planted).st_uid == squatter
        got = run_as(victim, _VICTIM, base, os.path.join(home, "no-run-user"), home)
        assert got.returncode == 0, got.stderr
        report = json.loads(got.stdout.strip().splitlines()[-1])
        assert report["path"].startswith(os.path.join(home, ".cache", "gpumem", "shared-"))
        assert f"{planted} belongs to uid {squatter}" in report["why"]
        assert os.stat(os.path.dirname(report["path"])).st_uid == victim
        assert os.listdir(planted) == []
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


# --- the random walk ----------------------------------------------------------------------------

class CardSampler(threading.Thread):
    """Reads the ledger every few ms: the most the members' devices held together (CARD slots:
    each device's bytes, charged under the ledger's lock) and what the member slots summed."""

    def __init__(self, path: str) -> None:
        super().__init__(daemon=True)
        self.ledger = Ledger(path)
        self.stop = threading.Event()
        self.max_card = self.max_slots = self.samples = 0

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                with self.ledger.locked() as lg:
                    used = list(lg.slots())
                self.max_card = max(self.max_card,
                                    sum(s.card_bytes for s in used if s.kind == CARD_SLOT))
                self.max_slots = max(self.max_slots,
                                     sum(s.reserved for s in used if s.kind == MEMBER))
                self.samples += 1
                time.sleep(0.002)
        finally:
            self.ledger.close()


def test_random_walk_of_six_members_with_sigkills_keeps_the_budget(shared_dir):
    """Six processes, each policy in turn (auto, tight, fast, plain), walk randomly through
    mallocs and frees on one 256 MiB card with a 192 MiB budget, while one member per round is
    SIGKILLed mid-walk and replaced: sampled every few ms, the members' device bytes never
    pass the budget; at every quiescent point each member's slot equals its reserved bytes
    (pool + held pages) and its card slot its device's bytes."""
    ctx = spawn()
    budget, rng = "192MiB", random.Random(39)
    members: dict[int, tuple] = {}               # number -> (process, connection, policy)

    def start(number: int) -> None:
        here, there = ctx.Pipe()
        policy = SEGMENT_POLICIES[number % len(SEGMENT_POLICIES)]
        p = ctx.Process(target=shared_workers.walker,
                        args=(CARD, "walk", policy, number, there, shared_dir, budget))
        p.start()
        assert here.poll(JOIN), f"member {number} ({policy}) did not start"
        assert here.recv()[0] == "ready"
        members[number] = (p, here, policy)

    sampler = None
    try:
        for number in range(6):
            start(number)
        sampler = CardSampler(ledger_file(shared_dir))
        sampler.start()
        next_number, rounds = 6, 5
        for _ in range(rounds):
            for p, conn, _ in members.values():
                conn.send(("walk", 120))
            time.sleep(rng.uniform(0.05, 0.4))
            victim = rng.choice(sorted(members))
            p, conn, _ = members.pop(victim)
            os.kill(p.pid, signal.SIGKILL)
            p.join(JOIN)
            for number, (p, conn, policy) in members.items():
                assert conn.poll(JOIN * 2), f"member {number} ({policy}) did not finish"
                assert conn.recv()[0] == "done"
            start(next_number)
            next_number += 1
            for number, (p, conn, policy) in members.items():    # quiescent: all idle
                conn.send(("check",))
                assert conn.poll(JOIN)
                _, slot, reserved, card_slot, device = conn.recv()
                assert slot == reserved, (policy, slot, reserved)
                assert card_slot == device, (policy, card_slot, device)
        assert sampler.samples > 10
        assert sampler.max_slots <= 192 * MiB, sampler.max_slots
        assert sampler.max_card <= 192 * MiB, (sampler.max_card - 192 * MiB) / MiB
    finally:
        if sampler is not None:
            sampler.stop.set()
            sampler.join(JOIN)
        for p, conn, _ in members.values():
            try:
                conn.send(("quit",))
            except OSError:
                pass
            p.join(JOIN)
            if p.is_alive():
                p.kill()
                p.join(JOIN)
