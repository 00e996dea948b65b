"""A memory budget shared by processes of one user on one device, cached memory handed back
across process lines (gpumem.placement.shared_budget, .ledger, .sim_card; issue 32).

Level: **real** (the real Cython pool and MemoryManager on gpumem_sim cards shared through the
ledger, real processes started with multiprocessing's spawn context, real signals). No test
asserts a time except the generous bound of the SIGKILL test; every join and barrier has a
timeout, so a broken run fails instead of hanging.
"""
from __future__ import annotations

import fcntl
import gc
import multiprocessing
import os
import shutil
import signal
import struct
import tempfile
import time

import pytest

import shared_workers
from gpumem import MemoryConfig, MemoryManager
from gpumem.errors import InvalidInputError, OutOfMemoryError
from gpumem.placement import ledger as ledger_mod
from gpumem.placement.ledger import FILE_SIZE, MEMBER, Ledger, SharedLedgerError
from gpumem.placement.shared_budget import group_members
from shared_workers import MiB, shared_config

JOIN = 60.0
CARD = "sim:256MiB"


def stop_child(child, stop) -> None:
    """Tell a spinning member to stop and join it (killed if it does not end in time)."""
    stop.set()
    child.join(JOIN)
    if child.is_alive():
        child.kill()
        child.join(JOIN)


@pytest.fixture
def shared_dir(monkeypatch):
    """A private ledger folder (short, for the sockets' path limit) for this test only."""
    path = tempfile.mkdtemp(prefix="gmsb", dir="/tmp")
    monkeypatch.setenv("GPUMEM_SHARED_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def spawn():
    return multiprocessing.get_context("spawn")


def ledger_file(shared_dir: str) -> str:
    (name,) = [n for n in os.listdir(shared_dir) if n.endswith(".ledger")]
    return os.path.join(shared_dir, name)


def malloc_once_gone(mm: MemoryManager, nbytes: int):
    """mm.malloc(nbytes) once a SIGKILLed or exec'd member has let go of its files:
    retried on out-of-memory while the kernel ends it (its threads close the files after the
    leader shows as a zombie), for JOIN seconds at most."""
    deadline = time.monotonic() + JOIN
    while True:
        try:
            return mm.malloc(nbytes)
        except OutOfMemoryError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def lingering_ledger(group: str) -> str:
    """A ledger file of ``group`` with no member that stays (its last member would remove it:
    a slot taken by another open file keeps it while that member leaves)."""
    with MemoryManager(CARD, shared_config(group)) as mm:
        path = mm._growth.shared.path
        probe = Ledger(path)
        with probe.locked() as lg:
            index = lg.claim(MEMBER, os.getpid(), 0, 1).index
    with probe.locked() as lg:
        lg.free_slot(index)
    probe.close()
    assert os.path.exists(path)
    return path


def forge_slot(probe: Ledger, pid: int, start: int, reserved: int) -> int:
    """Write a member slot naming (pid, start) that holds ``reserved`` bytes, as a process that
    never joined would (no liveness lock); its index."""
    from gpumem.placement.ledger import FREE, SLOT_COUNT, Slot
    with probe.locked() as ledger:
        index = next(i for i in range(SLOT_COUNT) if ledger.slot(i).kind == FREE)
        ledger.write(Slot(index, MEMBER, 0, pid, start, 42, reserved, 0, 0, 0, 0, 0, 0))
    return index


def run_alternating(shared_dir: str, hand_back: bool, count: int = 8) -> list[tuple]:
    ctx = spawn()
    barrier, results = ctx.Barrier(count), ctx.Queue()
    group = f"alt{int(hand_back)}"
    procs = [ctx.Process(target=shared_workers.alternating_peaks,
                         args=(i, count, CARD, group, hand_back, 8 * MiB, 100 * MiB, barrier,
                               results, shared_dir)) for i in range(count)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=JOIN * 2) for _ in procs]
    finally:
        for p in procs:
            p.join(JOIN)
            if p.is_alive():
                p.kill()
                p.join(JOIN)
    return sorted(got)


def test_alternating_peaks_fit_with_hand_back_and_fail_without(shared_dir):
    """8 processes on one 256 MiB card: each holds 8 MiB all along and 100 MiB in its own
    round, so live memory never passes 164 MiB, but the caches would sum to 864 MiB. With the
    shared group handing cached memory back there is no out-of-memory at all; on the same
    shared card with hand-back off, the same run fails (the card is full of others' caches)."""
    with_hand_back = run_alternating(shared_dir, hand_back=True)
    assert [err for _, _, err in with_hand_back] == [""] * 8, with_hand_back
    assert sum(ooms for _, ooms, _ in with_hand_back) == 0
    without = run_alternating(shared_dir, hand_back=False)
    assert [err for _, _, err in without] == [""] * 8, without
    assert sum(ooms for _, ooms, _ in without) >= 1


def test_cached_memory_of_a_spinning_process_is_handed_back(shared_dir):
    """Another process holds 200 MiB of a 256 MiB card in its cache and spins in pure Python
    (it never calls gpumem): its watcher thread still answers, so a 200 MiB allocation here
    succeeds; the ledger shows the other member's answer and release."""
    ctx = spawn()
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=shared_workers.hold_and_spin,
                        args=(CARD, "spin", 200 * MiB, True, ready, stop, shared_dir))
    child.start()
    try:
        assert ready.wait(JOIN)
        from gpumem.placement import shared_budget
        old, shared_budget.REPLY_WAIT = shared_budget.REPLY_WAIT, 5.0
        try:
            with MemoryManager(CARD, shared_config("spin")) as mm:
                buf = mm.malloc(200 * MiB)
                others = [m for m in mm._growth.shared.members() if m.pid == child.pid]
                assert others and others[0].answered >= 1 and others[0].released >= 200 * MiB
                buf.free()
        finally:
            shared_budget.REPLY_WAIT = old
    finally:
        stop_child(child, stop)


def test_sigkilled_member_share_is_free_at_the_next_growth(shared_dir):
    """A member killed with SIGKILL while it holds 200 MiB (live, not cached) of a 256 MiB card:
    once the kernel has ended it (an unreaped zombie still), its share, in the budget and on
    the card, is free for the growths that need it (its slot's liveness lock went with the
    process), and its wake-up socket is removed. (No wall-clock bound: the kill itself takes
    as long as the machine's load makes it.)"""
    ctx = spawn()
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=shared_workers.hold_and_spin,
                        args=(CARD, "kill", 200 * MiB, False, ready, stop, shared_dir))
    child.start()
    try:
        assert ready.wait(JOIN)
        with MemoryManager(CARD, shared_config("kill")) as mm:
            with pytest.raises(OutOfMemoryError):
                mm.malloc(200 * MiB)              # the live 200 MiB are not handed back
            os.kill(child.pid, signal.SIGKILL)
            buf = malloc_once_gone(mm, 200 * MiB)
            assert [m.pid for m in mm._growth.shared.members()] == [os.getpid()]
            assert not [n for n in os.listdir(shared_dir) if n.startswith(f"w{child.pid}-")]
            buf.free()
    finally:
        child.join(JOIN)


def test_one_card_seen_by_every_member_and_deterministic_without_a_group(shared_dir):
    """Two managers of one group on "sim:256MiB" (here in one process) are one card: each
    sees the other's bytes as taken. Without a group each "sim:256MiB" is a card of its own
    and reads nothing of the ledger."""
    cfg = shared_config("card")
    with MemoryManager(CARD, cfg) as a, MemoryManager(CARD, cfg) as b:
        buf = a.malloc(100 * MiB)
        free_b, total = b.device.mem_get_info()
        assert total == 256 * MiB and free_b <= 156 * MiB
        buf.free()
    plain = MemoryConfig(min_free_bytes=0, gpu_memory_fraction=1.0, cpu_fallback_enabled=False)
    with MemoryManager(CARD, plain) as a, MemoryManager(CARD, plain) as b:
        buf = a.malloc(100 * MiB)
        assert b.device.mem_get_info()[0] == 256 * MiB
        assert a.device.shared_card is None
        buf.free()


def test_budget_smaller_than_the_device_is_kept(shared_dir):
    """shared_budget="128MiB" on a 256 MiB card: two members together never hold more than
    128 MiB; the second member's growth past it fails when the first's memory is live."""
    cfg = shared_config("small", budget="128MiB")
    with MemoryManager(CARD, cfg) as a, MemoryManager(CARD, cfg) as b:
        live = a.malloc(100 * MiB)
        with pytest.raises(OutOfMemoryError):
            b.malloc(40 * MiB)
        live.free()
        b.malloc(40 * MiB).free()                 # a's cache handed back
        members = a._growth.shared.members()
        assert sum(m.reserved for m in members) <= 128 * MiB


def test_hit_path_never_touches_the_ledger(shared_dir, monkeypatch):
    """Once a block is cached, malloc and free of its size are served while another open file
    holds the ledger's lock (any ledger access would wait, then fail): the hit path costs
    nothing more with a group joined."""
    monkeypatch.setattr(ledger_mod, "LOCK_TIMEOUT", 0.2)
    with MemoryManager(CARD, shared_config("hit")) as mm:
        mm.malloc(MiB).free()
        fd = os.open(ledger_file(shared_dir), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            for _ in range(100):
                mm.malloc(MiB).free()
        finally:
            os.close(fd)


def test_close_and_drop_leave_the_group(shared_dir):
    """close() frees the member's slot and its card (the last member removes the file); a
    manager dropped without close() is gone from the ledger within a few seconds (its watcher
    leaves for it)."""
    cfg = shared_config("leave")
    mm = MemoryManager(CARD, cfg)
    path = ledger_file(shared_dir)
    mm.close()
    assert not os.path.exists(path)
    mm = MemoryManager(CARD, cfg)
    probe = Ledger(path)
    try:
        assert len(group_members(probe)) == 1
        del mm
        gc.collect()
        deadline = time.monotonic() + 5
        while group_members(probe) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert group_members(probe) == []
    finally:
        probe.close()


# --- bad input -----------------------------------------------------------------------------

def member_count(shared_dir: str) -> int:
    probe = Ledger(ledger_file(shared_dir))
    try:
        return len(list(probe.slots(MEMBER)))
    finally:
        probe.close()


def test_budget_larger_than_the_device_is_refused(shared_dir):
    """A budget in bytes above the device's total memory: an error naming the setting and both
    sizes; nothing is joined."""
    with pytest.raises(SharedLedgerError, match=r"shared_budget 512.00 MiB exceeds the 256.00 MiB of sim:256MiB"):
        MemoryManager(CARD, shared_config("big", budget="512MiB"))
    assert not [n for n in os.listdir(shared_dir) if n.endswith(".ledger")]


@pytest.mark.parametrize("budget, message", [
    (-1, "shared_budget must be >= 0"), ("-1GiB", "shared_budget: cannot parse"),
    ("lots", "shared_budget: cannot parse"), (1.5, r"in \(0, 1\]"), (0, "must be > 0"),
    (True, "shared_budget must be an int"),
])
def test_bad_budget_values_name_the_setting(budget, message):
    """A negative, malformed or out-of-range budget is refused with an error naming it."""
    with pytest.raises(InvalidInputError, match=message):
        MemoryConfig(shared_group="g", shared_budget=budget)


def test_bad_environment_budget_names_the_variable():
    """GPUMEM_SHARED_GROUP / GPUMEM_SHARED_BUDGET: a bad value names the variable; a good one
    is read as a fraction."""
    with pytest.raises(InvalidInputError, match="GPUMEM_SHARED_BUDGET"):
        MemoryConfig.from_env({"GPUMEM_SHARED_GROUP": "g", "GPUMEM_SHARED_BUDGET": "-5"})
    cfg = MemoryConfig.from_env({"GPUMEM_SHARED_GROUP": "g", "GPUMEM_SHARED_BUDGET": "0.5"})
    assert (cfg.shared_group, cfg.shared_budget) == ("g", 0.5)


def test_bad_group_name_is_refused():
    """The group name becomes part of a file name: a path in it is refused."""
    with pytest.raises(InvalidInputError, match="shared_group"):
        MemoryConfig(shared_group="../etc")


def test_members_that_disagree_on_the_budget_are_refused(shared_dir):
    """A process that asks for another budget than the group's live members: an error naming
    the ledger file and both budgets; the first member keeps its slot and its memory."""
    ctx = spawn()
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=shared_workers.hold_and_spin,
                        args=(CARD, "disagree", 64 * MiB, False, ready, stop, shared_dir, 0.5))
    child.start()
    try:
        assert ready.wait(JOIN)
        path = ledger_file(shared_dir)
        with pytest.raises(SharedLedgerError, match=f"{path}.*same shared_budget"):
            MemoryManager(CARD, shared_config("disagree", budget=1.0))
        probe = Ledger(path)
        try:
            (member,) = group_members(probe)
            assert member.pid == child.pid and member.reserved >= 64 * MiB
        finally:
            probe.close()
    finally:
        stop.set()
        child.join(JOIN)


def corrupt_and_join(shared_dir: str, corrupt) -> SharedLedgerError:
    cfg = shared_config("bad")
    path = lingering_ledger("bad")
    corrupt(path)
    with pytest.raises(SharedLedgerError) as info:
        MemoryManager(CARD, cfg)
    assert path in str(info.value) or shared_dir in str(info.value)
    return info.value


def test_truncated_ledger_is_refused(shared_dir):
    """A ledger cut short is refused with its size and the size it must have."""
    err = corrupt_and_join(shared_dir, lambda p: os.truncate(p, 100))
    assert f"100 bytes, not {FILE_SIZE}" in str(err)


def test_ledger_with_a_bad_magic_is_refused(shared_dir):
    """A file of the right size that is not a ledger (its magic number) is refused."""
    def corrupt(path):
        with open(path, "r+b") as f:
            f.write(b"NOTALEDG")
    assert "bad magic" in str(corrupt_and_join(shared_dir, corrupt))


def test_ledger_with_out_of_bounds_numbers_is_refused(shared_dir):
    """A slot with a pid of -5 or a reserved size of 2**63: corrupted, refused, never summed."""
    def corrupt(path):
        with open(path, "r+b") as f:
            f.seek(ledger_mod.HEADER_SIZE)
            f.write(struct.pack("<IIqQQQ", MEMBER, 0, 1, 0, 1, 1 << 63))
    assert "out of bounds" in str(corrupt_and_join(shared_dir, corrupt))


def test_group_writable_ledger_is_refused(shared_dir):
    """A ledger others could write is not trusted."""
    err = corrupt_and_join(shared_dir, lambda p: os.chmod(p, 0o660))
    assert "must be 0600" in str(err)


def test_ledger_of_another_user_is_refused(shared_dir):
    """A ledger owned by another user is not trusted (run as root: chown; otherwise the uid
    this process sees is changed instead)."""
    if os.getuid() == 0:
        err = corrupt_and_join(shared_dir, lambda p: os.chown(p, 65534, 65534))
        assert "not to this user" in str(err)
    else:
        pytest.skip("needs root to give a file to another user")


def test_open_folder_is_refused(shared_dir):
    """A ledger folder others could enter is not trusted."""
    os.chmod(shared_dir, 0o755)
    with pytest.raises(SharedLedgerError, match=f"{shared_dir} has mode 755"):
        MemoryManager(CARD, shared_config("folder"))


def test_a_held_lock_gives_an_error_not_a_hang(shared_dir, monkeypatch):
    """Another process holding the ledger's lock (here another open file of this one) makes
    joining fail after the bounded wait, with an error naming the file."""
    monkeypatch.setattr(ledger_mod, "LOCK_TIMEOUT", 0.2)
    path = lingering_ledger("locked")
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(SharedLedgerError, match=f"{path}: another process held its lock"):
            MemoryManager(CARD, shared_config("locked"))
        assert time.monotonic() - start < 10
    finally:
        os.close(fd)
    assert member_count(shared_dir) == 0


# --- gpumem groups / gpumem info ---------------------------------------------------------------

def test_gpumem_groups_shows_members_reserved_cached_and_budget(shared_dir, capsys):
    """`gpumem groups` (and its JSON) list the group on its device with its budget and each
    member's reserved and cached bytes; `gpumem info` shows the same lines; a ledger that cannot
    be trusted is listed with the reason instead of figures."""
    import json

    from gpumem.cli import main
    with MemoryManager(CARD, shared_config("report", budget=0.5)) as mm:
        live = mm.malloc(64 * MiB)
        mm.malloc(32 * MiB).free()
        mm._growth.shared.sync()                  # what the watcher does every second
        assert main(["groups", "--json"]) == 0
        (group,) = json.loads(capsys.readouterr().out)
        assert (group["group"], group["budget"], group["total"]) == ("report", 128 * MiB,
                                                                     256 * MiB)
        (member,) = group["members"]
        assert member["pid"] == os.getpid() and member["alive"]
        assert member["reserved"] >= 96 * MiB and member["cached"] >= 32 * MiB
        assert main(["info"]) == 0
        out = capsys.readouterr().out
        assert "report on sim_256MiB-268435456: budget 128.00 MiB of 256.00 MiB, 1 member" in out
        live.free()
    os.chmod(lingering_ledger("report"), 0o644)
    assert main(["groups"]) == 0
    assert "not trusted" in capsys.readouterr().out


def test_a_reused_pid_does_not_keep_a_share(shared_dir):
    """A slot whose pid is alive but belongs to another process now (its start time differs:
    the pid was reused) is reaped like a dead one: its 200 MiB claim on a 256 MiB budget does
    not stop this member's 200 MiB; the out-of-memory message of a real shortfall names the
    group and its budget."""
    from gpumem.placement.ledger import process_start_time
    cfg = shared_config("reuse")
    with MemoryManager(CARD, cfg) as mm:
        probe = Ledger(ledger_file(shared_dir))
        try:
            forge_slot(probe, os.getppid(), process_start_time(os.getppid()) + 1, 200 * MiB)
            buf = mm.malloc(200 * MiB)
            assert [m.pid for m in group_members(probe)] == [os.getpid()]
        finally:
            probe.close()
        with pytest.raises(OutOfMemoryError, match=r"shared group 'reuse': budget 256.00 MiB, "
                                                   r"1 member\(s\) hold"):
            mm.malloc(100 * MiB)
        buf.free()


def test_answering_restores_the_switch_interval(shared_dir):
    """The watcher lowers the interpreter's switch interval only while it answers: after an
    answer (here two members of one process, one asking the other) it is what it was."""
    import sys
    before = sys.getswitchinterval()
    cfg = shared_config("switch", budget="128MiB")
    with MemoryManager(CARD, cfg) as a, MemoryManager(CARD, cfg) as b:
        a.malloc(100 * MiB).free()
        buf = b.malloc(100 * MiB)                 # a's watcher answers
        assert a._growth.shared.requests_answered >= 1
        buf.free()
    assert sys.getswitchinterval() == before


def test_a_stopped_member_delays_a_growth_by_a_bounded_time_only(shared_dir):
    """A member stopped with SIGSTOP while it caches 200 MiB cannot answer: a growth that needs
    its cache waits at most REPLY_WAIT (kept at its 100 ms default here) and then fails as out
    of memory, instead of hanging; once the member runs again (SIGCONT) it hands its cache
    back."""
    ctx = spawn()
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=shared_workers.hold_and_spin,
                        args=(CARD, "stopped", 200 * MiB, True, ready, stop, shared_dir))
    child.start()
    try:
        assert ready.wait(JOIN)
        with MemoryManager(CARD, shared_config("stopped")) as mm:
            os.kill(child.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(OutOfMemoryError):
                    mm.malloc(200 * MiB)
                assert time.monotonic() - start < 10       # generous: REPLY_WAIT is 0.1 s
            finally:
                os.kill(child.pid, signal.SIGCONT)
            from gpumem.placement import shared_budget
            old, shared_budget.REPLY_WAIT = shared_budget.REPLY_WAIT, 5.0
            try:
                mm.malloc(200 * MiB).free()
            finally:
                shared_budget.REPLY_WAIT = old
    finally:
        stop_child(child, stop)


@pytest.mark.parametrize("backend", ["sim", "cpu", "opencl", "cuda"])
def test_budget_and_hand_back_on_every_backend(shared_dir, clean_registry, backend):
    """The budget and the hand-back work on each backend of GPUMEM_TEST_BACKENDS (level: real
    on sim, cpu and opencl (PoCL); fake driver for cuda in ci/test.sh's cuda pass): with a
    256 MiB budget, a member caching 200 MiB hands it back (its watcher answers the ledger's
    request) when another member of the group needs 200 MiB."""
    from invariants import backend_device, selected_backends
    if backend not in selected_backends():
        pytest.skip(f"{backend} is not in GPUMEM_TEST_BACKENDS")
    device = backend_device(backend)
    cfg = shared_config("backends", budget="256MiB")
    with MemoryManager(device, cfg) as a, MemoryManager(device, cfg) as b:
        a.malloc(200 * MiB).free()
        buf = b.malloc(200 * MiB)
        assert a._growth.shared.requests_answered >= 1
        assert sum(m.reserved for m in a._growth.shared.members()) <= 256 * MiB
        buf.free()


@pytest.mark.filterwarnings("ignore:gpumem. sim.256MiB refused to free:RuntimeWarning")
def test_a_failing_release_is_answered_and_the_watcher_lives_on(shared_dir):
    """A member whose driver refuses a release still answers the request (with 0 bytes), the
    pages it could not free still count in the budget, and its watcher answers the next
    request once the driver frees again."""
    cfg = shared_config("refuse", budget="128MiB")
    with MemoryManager(CARD, cfg) as a, MemoryManager(CARD, cfg) as b:
        a.malloc(100 * MiB).free()
        a.device.inject(fail_free=True)
        with pytest.raises(OutOfMemoryError):
            b.malloc(100 * MiB)
        # the answer may come after b gave up waiting on a loaded machine: it must come
        deadline = time.monotonic() + 30
        while a._growth.shared.requests_answered < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a._growth.shared.requests_answered >= 1
        a.device.clear_faults()
        b.malloc(100 * MiB).free()                # the same watcher hands it back now
        assert a._growth.shared._watcher.is_alive()


def test_ledger_of_another_version_is_refused(shared_dir):
    """A ledger written by another layout version is refused, naming both versions."""
    def corrupt(path):
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", 99))
    assert "version 99" in str(corrupt_and_join(shared_dir, corrupt))


def _as_version_1(path: str, pid: int, start: int) -> None:
    """Rewrite ``path`` as gpumem's version-1 layout would leave it: version 1 in the header
    and one member slot naming (pid, start)."""
    from gpumem.placement.ledger import HEADER_SIZE
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 1))
        f.seek(HEADER_SIZE)
        f.write(struct.pack("<IIqQ", MEMBER, 0, pid, start))


def test_an_older_ledger_no_process_uses_is_laid_out_again(shared_dir):
    """Level real: a version-1 ledger (an older gpumem's) whose members are all gone is laid
    out anew when a manager joins, so an upgrade does not lock the user out of the group; one
    whose member still runs (this process, its start time) is refused, naming both versions."""
    path = lingering_ledger("bad")
    dead = multiprocessing.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    _as_version_1(path, dead.pid, 1)
    with MemoryManager(CARD, shared_config("bad")) as mm:
        assert mm._growth.shared.path == path
        mm.malloc(1 * MiB).free()
    path = lingering_ledger("bad")
    _as_version_1(path, os.getpid(), ledger_mod.process_start_time(os.getpid()))
    with pytest.raises(SharedLedgerError, match="version 1"):
        MemoryManager(CARD, shared_config("bad"))


def test_symlinked_ledger_is_refused(shared_dir):
    """A ledger that is a symlink (to a file the link's owner chose) is not followed."""
    def corrupt(path):
        target = path + ".elsewhere"
        os.rename(path, target)
        os.symlink(target, path)
    assert "symlink" in str(corrupt_and_join(shared_dir, corrupt))
