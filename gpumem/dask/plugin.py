"""GpumemPlugin: gpumem's shared manager on every Dask worker, its counters in the worker's
heartbeat, and memory pressure turned into Dask's own pause.

Thread safety: a plug-in object lives on one worker. Its state (the manager, the pause flag,
the counters) has one owner, the worker's event-loop thread: ``setup``, ``teardown``, the
periodic pressure check and the heartbeat metric all run there. The one thing that happens on
other threads, a task's allocation raising the pressure level, only schedules a check on that
loop (``IOLoop.add_callback``, which is thread-safe); it never touches the state itself.
"""
from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from distributed import WorkerPlugin
from distributed.core import Status

from gpumem.config import MemoryConfig
from gpumem.dask.report import METRIC_NAME
from gpumem.errors import BackendUnavailableError, InvalidInputError
from gpumem.manager.pressure import MemoryPressure
from gpumem.units import format_bytes, parse_size

if TYPE_CHECKING:
    from distributed import Worker

    from gpumem.manager.memory_manager import MemoryManager

__all__ = ["PLUGIN_NAME", "GpumemPlugin", "worker_manager", "wire_frameworks", "device_from_env"]

log = logging.getLogger("gpumem.dask")

#: The name the plug-in registers under (``client.unregister_worker_plugin(PLUGIN_NAME)``).
PLUGIN_NAME = "gpumem"
#: The integration module each framework flag loads (built on the frameworks issue).
FRAMEWORK_MODULES = {"cupy": "gpumem.integrations.cupy", "numba": "gpumem.integrations.numba",
                     "torch": "gpumem.integrations.torch"}

def _level(value: Any, what: str) -> MemoryPressure | None:
    if value is None or isinstance(value, MemoryPressure):
        return value
    if isinstance(value, str) and value.upper() in MemoryPressure.__members__:
        return MemoryPressure[value.upper()]
    raise InvalidInputError(f"{what} must be a MemoryPressure, one of "
                            f"{', '.join(MemoryPressure.__members__)}, or None to turn it off; "
                            f"got {value!r}")


def device_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The device a worker's environment names: ``GPUMEM_DEVICE``; else ``cuda:0`` when
    ``CUDA_VISIBLE_DEVICES`` is set (dask-cuda gives each worker its own GPU that way, first in
    the list); else ``sim:0`` when ``GPUMEM_SIM_DEVICES`` describes simulated devices; else None
    (gpumem's default device)."""
    env = os.environ if environ is None else environ
    if env.get("GPUMEM_DEVICE", "").strip():
        return env["GPUMEM_DEVICE"].strip()
    if env.get("CUDA_VISIBLE_DEVICES", "").strip():
        return "cuda:0"
    if env.get("GPUMEM_SIM_DEVICES", "").strip():
        return "sim:0"
    return None


def wire_frameworks(manager: "MemoryManager", *, cupy: bool = False, numba: bool = False,
                    torch: bool = False) -> list[Callable[[], None]]:
    """Route CuPy / Numba / torch allocations through ``manager`` with gpumem's integrations
    (``gpumem.integrations.<framework>.use_gpumem``); returns the undo functions of those that
    give one. A missing integration or framework raises BackendUnavailableError naming it."""
    undo: list[Callable[[], None]] = []
    for name, wanted in (("cupy", cupy), ("numba", numba), ("torch", torch)):
        if not wanted:
            continue
        module_name = FRAMEWORK_MODULES[name]
        try:
            module = importlib.import_module(module_name)
            use = getattr(module, "use_gpumem", None)
            if use is not None:
                result = use(manager)
            else:                                   # Numba's EMM plug-in is set by class
                import numba.cuda
                result = numba.cuda.set_memory_manager(module.GpumemNumbaManager)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"GpumemPlugin({name}=True): {module_name} cannot be used on this worker "
                f"({exc}); it needs {name} installed there and a gpumem with the framework "
                f"integrations") from None
        exit_ = getattr(result, "__exit__", None)
        if exit_ is not None:
            undo.append(lambda exit_=exit_: exit_(None, None, None))
    return undo


class GpumemPlugin(WorkerPlugin):
    """Opens gpumem's shared manager for each worker's device when registered with
    ``client.register_plugin(GpumemPlugin(...))``.

    - ``device``: a device string for every worker, a mapping from worker name (or address) to
      device string, a callable ``device(worker) -> str``, or None: the worker's environment
      (:func:`device_from_env`).
    - ``config`` and ``**knobs`` (MemoryConfig fields): the manager's configuration, applied
      with ``gpumem.configure``; neither given: the shared manager as it is.
    - ``pool_size``: bytes (or ``"2GiB"``) to reserve and cache at start (like dask-cuda's
      ``rmm_pool_size``), rounded up to whole ``MemoryConfig.large_segment`` blocks. It is
      kept: with a pool size, ``release_before_grow`` is False unless a knob says otherwise.
    - ``shared_budget``: the workers on one device (one host) share this budget (a fraction of
      the device or a size) and hand cached memory to each other (docs/shared_budget.md);
      their group is named after the scheduler unless ``shared_group=`` is given.
      :func:`gpumem.dask.memory_report` then shows each worker's share.
    - ``cupy``, ``numba``, ``torch``: route that framework's allocations through the manager.
    - ``release_at`` (default HIGH): at this pressure level or above, the worker's cached device
      memory is given back to the driver. ``pause_at`` (default CRITICAL): at this level or
      above, even with the cache freed, the worker is paused (Dask's ``Status.paused``: running
      tasks go on, no new ones start) until the level falls below it. None turns either off.
      The level is checked every ``check_interval`` seconds and whenever it rises.

    Each heartbeat carries the manager's counters to the scheduler (``metrics["gpumem"]``);
    :func:`gpumem.dask.memory_report` asks the workers for the same counters directly. At teardown (worker closing, or
    ``client.unregister_worker_plugin("gpumem")``) live buffers are logged as leaks and the
    manager is closed, returning every byte to the driver.
    """

    idempotent = False

    def __init__(self, device: Any = None, config: MemoryConfig | None = None, *,
                 pool_size: int | str | None = None, cupy: bool = False, numba: bool = False,
                 torch: bool = False, release_at: MemoryPressure | str | None = "HIGH",
                 pause_at: MemoryPressure | str | None = "CRITICAL",
                 check_interval: float = 0.25, name: str = PLUGIN_NAME,
                 shared_budget: int | float | str | None = None, **knobs: Any) -> None:
        if not (device is None or isinstance(device, (str, Mapping)) or callable(device)):
            raise InvalidInputError(f"device must be a device string, a mapping from worker name "
                                    f"to device string, a callable(worker) or None; got "
                                    f"{type(device).__name__} {device!r}")
        if config is not None and not isinstance(config, MemoryConfig):
            raise InvalidInputError(f"config must be a MemoryConfig or None, got "
                                    f"{type(config).__name__}")
        if shared_budget is not None:
            if "shared_budget" in knobs:
                raise InvalidInputError("give shared_budget once (as GpumemPlugin's argument)")
            knobs["shared_budget"] = shared_budget
        if "shared_budget" in knobs:                # checked with a stand-in group: the
            checked = (config or MemoryConfig()).replace(      # real one is named on setup
                **{"shared_group": "check", **knobs})
            knobs["shared_budget"] = checked.shared_budget
        else:
            (config or MemoryConfig()).replace(**knobs)      # unknown or bad knobs fail here
        for flag, value in (("cupy", cupy), ("numba", numba), ("torch", torch)):
            if not isinstance(value, bool):
                raise InvalidInputError(f"{flag} must be True or False, got {value!r}")
        if isinstance(check_interval, bool) or not isinstance(check_interval, (int, float)) \
                or not 0 < check_interval <= 3600:
            raise InvalidInputError(f"check_interval must be seconds in (0, 3600], got "
                                    f"{check_interval!r}")
        if not isinstance(name, str) or not name:
            raise InvalidInputError(f"name must be a non-empty string, got {name!r}")
        self.device = device
        self.config = config
        self.knobs = dict(knobs)
        self.pool_size = None if pool_size is None else parse_size(pool_size, what="pool_size")
        self.frameworks = {"cupy": cupy, "numba": numba, "torch": torch}
        self.release_at = _level(release_at, "release_at")
        self.pause_at = _level(pause_at, "pause_at")
        self.check_interval = float(check_interval)
        self.name = name
        # set on the worker by setup()
        self.manager: MemoryManager | None = None
        self.leaks_at_teardown = ""
        self._worker: Worker | None = None
        self._callback: Any = None
        self._undo: list[Callable[[], None]] = []
        self._paused_by_us = False
        self.cache_releases = 0
        self.pauses = 0

    # --- lifecycle (worker event loop) ----------------------------------------------------
    def setup(self, worker: "Worker") -> None:
        from tornado.ioloop import PeriodicCallback

        device = self._device_for(worker)
        knobs = self.knobs
        if "shared_budget" in knobs and not knobs.get("shared_group"):
            knobs = {**knobs, "shared_group": _shared_group_for(worker)}
        if self.pool_size and "release_before_grow" not in knobs:
            # the pool is kept: otherwise the first growth past it would give it back
            knobs = {**knobs, "release_before_grow": False}
        manager = _open_manager(device, self.config, knobs)
        try:
            if self.pool_size:
                # reserved as blocks of the large pool's segment size (packed in as few segments
                # as the driver allows), which medium and large requests split; one block of
                # pool_size would be kept whole for requests of about that size
                chunk = manager.config.large_segment
                manager.warmup([chunk], -(-self.pool_size // chunk))
            self._undo = wire_frameworks(manager, **self.frameworks)
        except BaseException:
            manager.close()
            raise
        self.manager, self._worker = manager, worker
        worker.metrics[METRIC_NAME] = self._metric
        if self.release_at is not None or self.pause_at is not None:
            loop = worker.loop
            watch = min(x for x in (self.release_at, self.pause_at) if x is not None)

            def on_pressure(old: MemoryPressure, new: MemoryPressure, ratio: float) -> None:
                if new >= watch:                   # any thread: only schedule the check
                    loop.add_callback(self.check_pressure)

            manager.on_pressure(on_pressure)
            self._callback = PeriodicCallback(self.check_pressure, self.check_interval * 1000)
            worker.periodic_callbacks[f"{self.name}-pressure"] = self._callback
            self._callback.start()
        log.info("gpumem on worker %s: %s (%s reserved at start)", worker.name,
                 manager.device_string, format_bytes(manager.pool.reserved_bytes))

    def teardown(self, worker: "Worker") -> None:
        if self._callback is not None:
            self._callback.stop()
            worker.periodic_callbacks.pop(f"{self.name}-pressure", None)
        worker.metrics.pop(METRIC_NAME, None)
        if self._paused_by_us and worker.status == Status.paused:
            worker.status = Status.running
        self._paused_by_us = False
        for undo in reversed(self._undo):
            undo()
        manager, self.manager = self.manager, None
        if manager is None or manager.closed:
            return
        from gpumem.testing.leaks import leak_report
        self.leaks_at_teardown = leak_report(manager, at=f"teardown of worker {worker.name}")
        if self.leaks_at_teardown:
            log.warning("%s", self.leaks_at_teardown)
        if manager.tracker is not None:
            manager.tracker.clear()                 # reported above, not again by close()
        manager.close()

    # --- pressure -----------------------------------------------------------------------------
    def check_pressure(self) -> None:
        """Free the cache at ``release_at``, pause at ``pause_at``, resume below it (runs on the
        worker's event loop; also called periodically)."""
        manager, worker = self.manager, self._worker
        if manager is None or manager.closed or worker is None:
            return
        level = manager.pressure()
        if self.release_at is not None and level >= self.release_at:
            if manager.pool.reserved_bytes > manager.pool.in_use_bytes:
                released = manager.empty_cache()
                if released:
                    self.cache_releases += 1
                    log.warning("worker %s: %s pressure on %s, released %s of cached memory",
                                worker.name, level.name, manager.device_string,
                                format_bytes(released))
                level = manager.pressure()
        if self.pause_at is None:
            return
        if level >= self.pause_at and worker.status == Status.running:
            worker.status = Status.paused
            self._paused_by_us = True
            self.pauses += 1
            log.warning("worker %s paused: %s pressure on %s (%.0f%% of usable memory)",
                        worker.name, level.name, manager.device_string,
                        100 * manager.pressure_ratio())
        elif self._paused_by_us and level < self.pause_at:
            self._paused_by_us = False
            if worker.status == Status.paused:
                worker.status = Status.running
                log.warning("worker %s resumed: pressure on %s is %s", worker.name,
                            manager.device_string, level.name)

    # --- metrics (sent with each heartbeat) ---------------------------------------------------
    def _metric(self, worker: "Worker") -> dict[str, Any]:
        """The manager's counters, keyed by gpumem.stats' vocabulary (docs/statistics.md):
        sent with each heartbeat, and what :func:`gpumem.dask.memory_report` asks for."""
        manager = self.manager
        if manager is None or manager.closed:
            return {"device": None}
        s = manager.stats()
        return {
            "device": manager.device_string,
            "reserved_bytes": s.reserved_bytes,
            "in_use_bytes": s.in_use_bytes,
            "cached_bytes": s.cached_bytes,
            "held_bytes": s.held_bytes,
            "asleep_bytes": s.asleep_bytes,
            "backup_bytes": s.backup_bytes,
            "peak_reserved_bytes": s.peak_reserved_bytes,
            "peak_in_use_bytes": s.peak_in_use_bytes,
            "num_allocs": s.num_allocs,
            "num_frees": s.num_frees,
            "pool_hits": s.pool_hits,
            "pool_misses": s.pool_misses,
            "usable_bytes": manager.usable_memory,
            "active_buffers": s.active_buffers,
            "pressure": manager.pressure().name,
            "pressure_ratio": manager.pressure_ratio(),
            "num_ooms": s.num_ooms,
            "cpu_fallbacks": s.cpu_fallbacks,
            "fallback_bytes": s.fallback_bytes,
            "cache_releases": self.cache_releases,
            "pauses": self.pauses,
            "paused": self._paused_by_us,
            **_shared_counters(manager),
        }

    def _device_for(self, worker: "Worker") -> str | None:
        choice = self.device
        if choice is None:
            return device_from_env()
        if isinstance(choice, str):
            return choice
        if isinstance(choice, Mapping):
            for key in (worker.name, str(worker.name), worker.address):
                if key in choice:
                    return choice[key]
            raise InvalidInputError(f"GpumemPlugin(device=...) names no device for worker "
                                    f"{worker.name!r} ({worker.address}); its keys are "
                                    f"{sorted(map(str, choice))}")
        device = choice(worker)
        if device is not None and not isinstance(device, str):
            raise InvalidInputError(f"GpumemPlugin(device=callable) returned {device!r} for "
                                    f"worker {worker.name!r}; expected a device string or None")
        return device


def _shared_counters(manager: "MemoryManager") -> dict[str, Any]:
    """The worker's shared group, if it joined one: the group, its budget, its members and
    what they hold (the ledger's figures: each member's as of its last miss or release)."""
    shared = getattr(manager._growth, "shared", None)
    if shared is None or not shared.active:
        return {}
    members = [m for m in shared.members() if m.alive]
    return {"shared_group": shared.group, "shared_budget_bytes": shared.budget,
            "shared_members": len(members),
            "shared_reserved_bytes": sum(m.reserved for m in members),
            "shared_requests_sent": shared.requests_sent,
            "shared_requests_answered": shared.requests_answered}


def _shared_group_for(worker: "Worker") -> str:
    """The group of the workers of one cluster on one host: named after the scheduler."""
    import re
    address = str(getattr(worker.scheduler, "address", "") or "scheduler")
    return "dask-" + re.sub(r"[^A-Za-z0-9_.-]", "_", address)[:58]


def _open_manager(device: str | None, config: MemoryConfig | None,
                  knobs: dict[str, Any]) -> "MemoryManager":
    import gpumem
    if config is None and not knobs:
        return gpumem.get_manager(device)
    return gpumem.configure(device, config, **knobs)


def worker_manager() -> "MemoryManager":
    """The manager GpumemPlugin opened on the worker running this task."""
    from distributed import get_worker
    try:
        worker = get_worker()
    except ValueError:
        raise InvalidInputError("worker_manager() must be called inside a task running on a "
                                "Dask worker") from None
    for plugin in worker.plugins.values():
        if isinstance(plugin, GpumemPlugin) and plugin.manager is not None:
            return plugin.manager
    raise InvalidInputError(f"worker {worker.name!r} has no GpumemPlugin; register one with "
                            f"client.register_plugin(gpumem.dask.GpumemPlugin(...))")
