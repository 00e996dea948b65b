"""gpumem on Dask workers (gpumem.dask): GpumemPlugin, heartbeat metrics, memory_report, the
pressure pause, the OOM ladder seen from a client, teardown and ``gpumem cluster``.

Level: **real** - a real ``distributed.LocalCluster`` with 2 worker processes (1 thread each, no
dashboard), each worker on its own simulated GPU (``GPUMEM_SIM_DEVICES`` gives every worker
process its own 1 GiB devices; the plug-in maps worker 0 to sim:0 and worker 1 to sim:1). One
cluster serves the module; each test registers the plug-in it needs and unregisters it.
The framework wiring (cupy=True...) is tested in-process with monkeypatched stand-in modules
for gpumem.integrations.* (level: **real** Python, stand-in frameworks).
"""
from __future__ import annotations

import sys
import time
import types

import pytest

distributed = pytest.importorskip("distributed", reason="gpumem.dask needs distributed "
                                  "(pip install 'gpumem[dask]')")

import gpumem  # noqa: E402
import gpumem.dask as gdask  # noqa: E402
from gpumem.cli import main as cli_main  # noqa: E402
from gpumem.errors import BackendUnavailableError, InvalidInputError, OutOfMemoryError  # noqa: E402

pytestmark = pytest.mark.slow

DEVICES = {0: "sim:0", 1: "sim:1"}
#: the whole 1 GiB device usable, so pressure ratios are simple fractions of 1 GiB
WHOLE = dict(min_free_bytes=0, gpu_memory_fraction=1.0, reserve_bytes=0)
MiB = 1 << 20


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
        memory_limit=0, env={"GPUMEM_SIM_DEVICES": "1GiB,1GiB"})
    client = distributed.Client(cluster)
    yield client
    client.close()
    cluster.close()


@pytest.fixture
def plugin(client):
    """``plugin(**kwargs)`` registers a GpumemPlugin (DEVICES unless given); unregistered
    (torn down) after the test."""
    def register(**kwargs):
        kwargs.setdefault("device", DEVICES)
        client.register_plugin(gdask.GpumemPlugin(**kwargs))
        return workers(client)

    yield register
    client.run(_drop_held)
    present = client.run(lambda dask_worker: gdask.PLUGIN_NAME in dask_worker.plugins)
    if any(present.values()):
        client.unregister_worker_plugin(gdask.PLUGIN_NAME)


def workers(client) -> dict:
    """worker name -> address."""
    return {w["name"]: a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}


# --- functions run on the workers -------------------------------------------------------------
def _manager(dask_worker):
    return dask_worker.plugins[gdask.PLUGIN_NAME].manager


def _hold(nbytes, dask_worker=None):
    """Allocate on the worker's manager and keep the buffer on the worker object."""
    buf = _manager(dask_worker).malloc(nbytes, tag="held")
    dask_worker.__dict__.setdefault("gpumem_held", []).append(buf)
    return buf.nbytes


def _drop_held(dask_worker=None):
    held = dask_worker.__dict__.pop("gpumem_held", [])
    for buf in held:
        if buf.alive:
            buf.free()
    return len(held)


def _task(nbytes):
    """A task allocating through the worker's shared manager."""
    mm = gdask.worker_manager()
    assert mm is gpumem.get_manager(mm.device_string)
    with mm.malloc(nbytes, tag="task") as buf:
        return {"device": mm.device_string, "nbytes": buf.nbytes,
                "kind": type(buf).__name__, "pool_hits": mm.stats().pool_hits}


def _sim_live_bytes():
    import gpumem_sim
    return [d.live_bytes for d in gpumem_sim.installed()]


def _wait_for(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.1)


def _report(client):
    return {r["name"]: r for r in gdask.memory_report(client, show=False)}


# --- tests ----------------------------------------------------------------------------------------
def test_plugin_installs_on_every_worker_and_tasks_allocate_through_it(client, plugin):
    """Each worker opens its own device's manager, pre-warmed with pool_size; a task on each
    worker allocates through it (the pre-warmed pool serves it: a hit, no new segment)."""
    addresses = plugin(pool_size="64MiB", **WHOLE)
    assert sorted(addresses) == [0, 1]
    info = client.run(lambda dask_worker: (_manager(dask_worker).device_string,
                                           _manager(dask_worker).stats().reserved_bytes))
    by_name = {name: info[addr] for name, addr in addresses.items()}
    assert by_name == {0: ("sim:0", 80 * MiB), 1: ("sim:1", 80 * MiB)}   # 64 MiB in 20 MiB blocks
    same = client.run(lambda dask_worker: _manager(dask_worker) is gpumem.get_manager(
        DEVICES[dask_worker.name]))
    assert all(same.values())                        # the worker's shared manager
    for name, addr in addresses.items():
        result = client.submit(_task, 3 * MiB, workers=[addr], pure=False).result(timeout=20)
        assert result["device"] == DEVICES[name] and result["nbytes"] == 3 * MiB
        assert result["kind"] == "Buffer" and result["pool_hits"] >= 1
    reserved = client.run(lambda dask_worker: _manager(dask_worker).stats().reserved_bytes)
    assert set(reserved.values()) == {80 * MiB}      # served by the pool: no new segment


def test_metrics_reach_the_scheduler_and_the_report_is_right(client, plugin, capsys):
    """Counters travel with the heartbeats: after worker 0 holds 100 MiB and worker 1 holds
    10 MiB, the scheduler's rows show exactly that; memory_report prints one row per worker;
    `gpumem cluster ADDRESS` prints the same table (and --json the rows)."""
    addresses = plugin(**WHOLE)
    client.run(_hold, 100 * MiB, workers=[addresses[0]])
    client.run(_hold, 10 * MiB, workers=[addresses[1]])
    rows = _wait_for(lambda: (r := _report(client)) and r[0].get("in_use_bytes") == 100 * MiB
                     and r[1].get("in_use_bytes") == 10 * MiB and r,
                     "the held buffers in the scheduler's metrics")
    assert rows[0]["device"] == "sim:0" and rows[1]["device"] == "sim:1"
    assert rows[0]["active_buffers"] == 1 and rows[0]["usable_bytes"] == 1 << 30
    assert rows[0]["reserved_bytes"] >= 100 * MiB and rows[0]["peak_in_use_bytes"] >= 100 * MiB
    assert rows[0]["pressure"] == "LOW" and rows[0]["num_ooms"] == 0
    assert rows[0]["paused"] is False
    printed = gdask.memory_report(client)
    out = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and len(out) == 3                  # header + one line per worker
    assert out[1].split()[:2] == ["0", "sim:0"] and "100.00 MiB" in out[1]
    assert out[2].split()[:2] == ["1", "sim:1"] and "10.00 MiB" in out[2]

    assert cli_main(["cluster", client.scheduler.address]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == out[1:]
    assert cli_main(["cluster", client.scheduler.address, "--json"]) == 0
    import json
    rows_json = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["device"], r["in_use_bytes"]) for r in rows_json] == \
        [(0, "sim:0", 100 * MiB), (1, "sim:1", 10 * MiB)]


def test_report_right_after_register_plugin_asks_the_workers(client, plugin, capsys):
    """memory_report called the moment register_plugin returns, before any heartbeat could
    carry the plug-in's counters: every worker's row has them (the pool_size just reserved),
    and the table says "no GpumemPlugin" for no worker; before registration it says so for
    both, truthfully. `gpumem cluster` right after registration prints the same rows."""
    before = _report(client)
    assert [before[n]["plugin"] for n in (0, 1)] == [False, False]
    assert "no GpumemPlugin on this worker" in gdask.format_report(list(before.values()))
    plugin(pool_size="40MiB", **WHOLE)
    rows = gdask.memory_report(client)                 # no wait: asked of the workers
    table = capsys.readouterr().out
    assert [(r["plugin"], r["device"], r["reserved_bytes"], r["cached_bytes"]) for r in rows] \
        == [(True, "sim:0", 40 * MiB, 40 * MiB), (True, "sim:1", 40 * MiB, 40 * MiB)]
    assert "no GpumemPlugin" not in table and len(table.splitlines()) == 3
    client.run(_hold, 3 * MiB)
    assert [r["in_use_bytes"] for r in gdask.memory_report(client, show=False)] == [3 * MiB] * 2
    assert cli_main(["cluster", client.scheduler.address, "--json"]) == 0
    import json
    assert [(r["name"], r["plugin"], r["in_use_bytes"]) for r in
            json.loads(capsys.readouterr().out)] == [(0, True, 3 * MiB), (1, True, 3 * MiB)]


def test_report_says_which_worker_failed_setup(client):
    """A plug-in whose setup failed on one worker (its device mapping names only worker 0):
    worker 0's row has the counters, worker 1's says its GpumemPlugin holds no manager,
    neither says "no GpumemPlugin"."""
    with pytest.raises(InvalidInputError):
        client.register_plugin(gdask.GpumemPlugin(device={0: "sim:0"}, name="gpumem-half"))
    try:
        rows = gdask.memory_report(client, show=False)
        assert [(r["plugin"], r.get("device")) for r in rows] == [(True, "sim:0"), (True, None)]
        table = gdask.format_report(rows)
        assert "no GpumemPlugin" not in table
        assert "GpumemPlugin without an open manager (its setup failed" in table
    finally:
        client.unregister_worker_plugin("gpumem-half")


def test_rows_for_workers_that_do_not_answer():
    """In-process (stand-in answers): a worker that timed out or failed is reported as not
    answering, with the reason, never as having no plug-in; bad timeouts are refused."""
    from gpumem.dask.report import rows_from_answers
    info = {"workers": {"tcp://a:1": {"name": 0}, "tcp://b:1": {"name": 1},
                        "tcp://c:1": {"name": 2}}}
    rows = rows_from_answers(info, {"tcp://a:1": TimeoutError("no answer within 2 s"),
                                    "tcp://b:1": None})
    assert [(r["name"], r["plugin"]) for r in rows] == [(0, None), (1, False), (2, None)]
    table = gdask.format_report(rows).splitlines()
    assert "no answer from this worker: TimeoutError: no answer within 2 s" in table[1]
    assert "no GpumemPlugin on this worker" in table[2]
    assert "no answer from this worker: LookupError" in table[3]
    for bad in (0, -1, "5", True):
        with pytest.raises(InvalidInputError, match="timeout must be seconds > 0"):
            gdask.memory_report(object(), timeout=bad)


def test_oom_ladder_seen_from_the_client(client, plugin):
    """A task that exhausts its device: with CPU fallback on it gets host memory (counted in
    the worker's metrics); with it off the client receives gpumem's OutOfMemoryError, fields
    intact."""
    addresses = plugin(**WHOLE)
    a0 = addresses[0]
    big = client.submit(_task, 2 << 30, workers=[a0], pure=False)   # > the 1 GiB device
    with pytest.raises(OutOfMemoryError) as err:
        big.result(timeout=20)
    assert err.value.device == "sim:0" and err.value.requested == 2 << 30
    assert "exceeds the device's total memory" in str(err.value)
    client.unregister_worker_plugin(gdask.PLUGIN_NAME)

    plugin(cpu_fallback_enabled=True, **WHOLE)
    client.run(lambda dask_worker: gpumem_sim_device(0).inject(fail_after=0), workers=[a0])
    try:
        result = client.submit(_task, 8 * MiB, workers=[a0], pure=False).result(timeout=20)
    finally:
        client.run(lambda: gpumem_sim_device(0).clear_faults(), workers=[a0])
    assert result["kind"] == "FallbackBuffer" and result["device"] == "sim:0"
    rows = _wait_for(lambda: (r := _report(client)) and r[0].get("cpu_fallbacks") == 1
                     and r[1]["plugin"] and r, "the fallback in the scheduler's metrics")
    assert rows[0]["num_ooms"] == 0 and rows[1]["cpu_fallbacks"] == 0


def _free_held_into_cache(dask_worker=None):
    """Free the held buffers: their memory stays in the worker's cache."""
    return _drop_held(dask_worker)


def _ledger_path(dask_worker=None):
    return _manager(dask_worker)._growth.shared.path


def test_workers_on_one_device_share_a_budget_and_the_report_shows_each_share(client, plugin,
                                                                              capsys):
    """GpumemPlugin(shared_budget=1.0) with both workers on "sim:0" (one 1 GiB card for the
    two processes, through the group's ledger): worker 0 caches 600 MiB, and worker 1's 600 MiB
    still fits because worker 0 hands its cache back; memory_report shows each worker's share
    of the budget and the group."""
    import os
    addresses = plugin(device="sim:0", shared_budget=1.0, **WHOLE)
    client.run(_hold, 600 * MiB, workers=[addresses[0]])
    client.run(_free_held_into_cache, workers=[addresses[0]])
    assert client.run(_hold, 600 * MiB, workers=[addresses[1]])[addresses[1]] == 600 * MiB
    rows = _wait_for(lambda: (r := _report(client)) and r[1].get("in_use_bytes") == 600 * MiB
                     and r[0].get("shared_members") == 2 and r, "the shared group's counters")
    assert rows[0]["shared_group"] == rows[1]["shared_group"]
    assert rows[0]["shared_group"].startswith("dask-")
    assert rows[0]["shared_budget_bytes"] == 1 << 30
    assert rows[0]["shared_requests_answered"] >= 1 and rows[1]["shared_requests_sent"] >= 1
    assert rows[0]["reserved_bytes"] < 600 * MiB                 # handed back
    gdask.memory_report(client)
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-1] == "share" and out[2].split()[-1].endswith("%")
    assert out[-1].startswith(f"shared group {rows[0]['shared_group']} on sim:0: budget "
                              f"1.00 GiB, 2 member(s)")
    path = client.run(_ledger_path, workers=[addresses[0]])[addresses[0]]
    client.run(_drop_held)
    client.unregister_worker_plugin(gdask.PLUGIN_NAME)
    # the group's last member removes its ledger when it leaves (issue 41)
    _wait_for(lambda: not os.path.exists(path), "the ledger removed by its last member")


def test_shared_budget_argument_is_checked_on_the_client():
    """A bad shared_budget fails at construction, on the client, naming it; a size string
    becomes bytes."""
    with pytest.raises(InvalidInputError, match=r"shared_budget as a fraction .* got 1.5"):
        gdask.GpumemPlugin(shared_budget=1.5)
    with pytest.raises(InvalidInputError, match="shared_budget"):
        gdask.GpumemPlugin(shared_budget="-2GiB")
    assert gdask.GpumemPlugin(shared_budget="2GiB").knobs["shared_budget"] == 2 << 30


def gpumem_sim_device(i):
    import gpumem_sim
    return gpumem_sim.installed()[i]


def test_pressure_frees_the_cache_and_pauses_the_worker(client, plugin):
    """At HIGH pressure the plug-in returns the worker's cached memory to the driver; still at
    HIGH it pauses the worker (Dask's pause: the scheduler sees it, a new task waits) and
    resumes it once the memory is freed, when the waiting task runs."""
    # plain segments: the 100 MiB stay cached beside the 850 MiB (expandable segments would
    # move their pages into the new allocation, leaving nothing cached to release)
    addresses = plugin(pause_at="HIGH", check_interval=0.05, auto_release_at_high=False,
                       auto_cleanup_at_critical=False, expandable_segments=False, **WHOLE)
    a0 = addresses[0]

    def fill(dask_worker):
        mm = _manager(dask_worker)
        mm.malloc(100 * MiB).free()                  # 100 MiB cached
        _hold(850 * MiB, dask_worker)                # 950 / 1024 reserved: HIGH
        return mm.stats().cached_bytes

    assert client.run(fill, workers=[a0])[a0] >= 100 * MiB
    status = lambda: client.scheduler_info(n_workers=-1)["workers"][a0]["status"]  # noqa: E731
    _wait_for(lambda: status() == "paused", "worker 0 paused")
    rows = _wait_for(lambda: (r := _report(client)) and r[0].get("paused") and r,
                     "the pause in the metrics")
    assert rows[0]["cache_releases"] >= 1 and rows[0]["cached_bytes"] < 100 * MiB
    assert rows[0]["pressure"] == "HIGH" and rows[0]["pauses"] == 1
    waiting = client.submit(_task, MiB, workers=[a0], pure=False)
    time.sleep(1.0)
    assert waiting.status == "pending"               # paused: the task has not started
    client.run(_drop_held, workers=[a0])
    assert waiting.result(timeout=20)["device"] == "sim:0"
    _wait_for(lambda: status() == "running", "worker 0 resumed")
    rows = _wait_for(lambda: (r := _report(client)) and r[1]["plugin"] and r, "worker 1's row")
    assert rows[1]["pauses"] == 0 and not rows[1]["paused"]      # worker 1 was never paused


def test_teardown_reports_leaks_and_leaves_no_byte_held(client, plugin):
    """Unregistering the plug-in (teardown) logs the buffers still alive and closes the
    manager: every worker's device then holds 0 bytes."""
    addresses = plugin(pool_size="40MiB", track_allocations=True, **WHOLE)
    client.run(_hold, 5 * MiB)
    client.run(lambda dask_worker: setattr(dask_worker, "gpumem_plugin",
                                           dask_worker.plugins[gdask.PLUGIN_NAME]))
    assert all(sum(v) == 40 * MiB for v in client.run(_sim_live_bytes).values())
    client.unregister_worker_plugin(gdask.PLUGIN_NAME)
    assert set(map(tuple, client.run(_sim_live_bytes).values())) == {(0, 0)}
    leaks = client.run(lambda dask_worker: dask_worker.__dict__.pop("gpumem_plugin")
                       .leaks_at_teardown)
    for name, addr in addresses.items():
        assert "1 buffer(s) still live on " + DEVICES[name] in leaks[addr]
        assert "held" in leaks[addr] and "5.00 MiB" in leaks[addr]
    client.run(lambda dask_worker: len(dask_worker.__dict__.pop("gpumem_held")))
    _wait_for(lambda: not any(r["plugin"] for r in _report(client).values()),
              "the metric gone from every worker's heartbeat after teardown")


def test_registration_errors_reach_the_client(client):
    """A worker the device mapping does not name, or a missing framework integration, fails
    registration with gpumem's error on the client."""
    with pytest.raises(InvalidInputError, match="names no device for worker 1"):
        client.register_plugin(gdask.GpumemPlugin(device={0: "sim:0"}, name="gpumem-bad"))
    client.unregister_worker_plugin("gpumem-bad")
    assert set(map(tuple, client.run(_sim_live_bytes).values())) == {(0, 0)}


# --- in-process: arguments, framework wiring, device choice ------------------------------------
def test_bad_arguments_are_refused_on_the_client():
    for kwargs, match in [({"device": 3}, "device must be"),
                          ({"config": {"x": 1}}, "config must be a MemoryConfig"),
                          ({"not_a_knob": 1}, "unknown MemoryConfig field"),
                          ({"release_at": "HUGE"}, "release_at must be"),
                          ({"pause_at": 2.5}, "pause_at must be"),
                          ({"check_interval": 0}, "check_interval"),
                          ({"pool_size": "lots"}, "pool_size"),
                          ({"cupy": "yes"}, "cupy must be True or False")]:
        with pytest.raises(InvalidInputError, match=match):
            gdask.GpumemPlugin(**kwargs)


def test_framework_wiring_with_stand_ins(monkeypatch, make_manager):
    """cupy/torch flags call gpumem.integrations.<fw>.use_gpumem(manager) and undo it at
    teardown; numba without use_gpumem sets its EMM plug-in class; a missing integration is a
    BackendUnavailableError naming the framework. (Stand-in modules, not the frameworks.)"""
    mm = make_manager()
    calls = []

    class Undo:
        def __init__(self, name):
            self.name = name

        def __exit__(self, *exc):
            calls.append(("undo", self.name))

    for name in ("cupy", "torch"):
        mod = types.ModuleType(f"gpumem.integrations.{name}")
        mod.use_gpumem = lambda manager, name=name: calls.append((name, manager)) or Undo(name)
        monkeypatch.setitem(sys.modules, f"gpumem.integrations.{name}", mod)
    numba_int = types.ModuleType("gpumem.integrations.numba")
    numba_int.GpumemNumbaManager = object()
    numba_cuda = types.ModuleType("numba.cuda")
    numba_cuda.set_memory_manager = lambda cls: calls.append(("numba", cls))
    numba = types.ModuleType("numba")
    numba.cuda = numba_cuda
    monkeypatch.setitem(sys.modules, "gpumem.integrations.numba", numba_int)
    monkeypatch.setitem(sys.modules, "numba", numba)
    monkeypatch.setitem(sys.modules, "numba.cuda", numba_cuda)
    undo = gdask.wire_frameworks(mm, cupy=True, numba=True, torch=True)
    assert calls == [("cupy", mm), ("numba", numba_int.GpumemNumbaManager), ("torch", mm)]
    for u in reversed(undo):
        u()
    assert calls[3:] == [("undo", "torch"), ("undo", "cupy")]

    monkeypatch.setitem(sys.modules, "gpumem.integrations.cupy", None)   # import fails
    with pytest.raises(BackendUnavailableError, match=r"GpumemPlugin\(cupy=True\).*cupy"):
        gdask.wire_frameworks(mm, cupy=True)


def test_device_from_env():
    f = gdask.plugin.device_from_env
    assert f({"GPUMEM_DEVICE": "opencl:1", "CUDA_VISIBLE_DEVICES": "3"}) == "opencl:1"
    assert f({"CUDA_VISIBLE_DEVICES": "3,4", "GPUMEM_SIM_DEVICES": "1GiB"}) == "cuda:0"
    assert f({"GPUMEM_SIM_DEVICES": "1GiB"}) == "sim:0"
    assert f({"CUDA_VISIBLE_DEVICES": ""}) is None


def test_importing_gpumem_does_not_import_distributed():
    import subprocess
    code = "import sys, gpumem; sys.exit('distributed' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_docs_example_runs(tmp_path):
    """The example of docs/dask.md, run as it stands there as a script (its own LocalCluster
    of 2 worker processes on simulated devices): its assertions hold and it prints the table."""
    import os
    import re
    import subprocess
    from invariants import require_checkout
    root = str(require_checkout("docs/dask.md"))
    with open(os.path.join(root, "docs", "dask.md")) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("GPUMEM_SIM_DEVICES", None)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "['sim:0', 'sim:1']"
    assert [line.split()[:2] for line in lines[2:4]] == [["0", "sim:0"], ["1", "sim:1"]]


def test_cli_cluster_errors(capsys):
    """`gpumem cluster` with no scheduler at the address, or a bad timeout: one line on stderr,
    a non-zero status (the connection attempt is bounded by --timeout)."""
    start = time.monotonic()
    assert cli_main(["cluster", "tcp://127.0.0.1:9", "--timeout", "1"]) == 1
    assert time.monotonic() - start < 60          # bounded (the machine may be busy)
    err = capsys.readouterr().err
    assert err.startswith("gpumem: error: cannot reach the Dask scheduler at 'tcp://127.0.0.1:9'")
    assert cli_main(["cluster", "tcp://127.0.0.1:9", "--timeout", "0"]) == 2
    assert "--timeout must be > 0" in capsys.readouterr().err
