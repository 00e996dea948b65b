"""gpumem on every Dask worker (extra ``dask``: ``pip install 'gpumem-pool[dask]'``).

``import gpumem`` never imports this package (nor ``distributed``); importing it does.

>>> from dask.distributed import Client, LocalCluster
>>> import gpumem.dask
>>> cluster = LocalCluster(n_workers=2, env={"GPUMEM_SIM_DEVICES": "4GiB"})
>>> client = Client(cluster)
>>> client.register_plugin(gpumem.dask.GpumemPlugin(pool_size="1GiB"))
>>> def work(n):
...     with gpumem.dask.worker_manager().malloc(n) as buf:
...         return buf.nbytes
>>> client.gather(client.map(work, [1 << 20, 2 << 20]))
>>> gpumem.dask.memory_report(client)          # one row per worker, printed and returned

- :class:`GpumemPlugin`: a ``distributed.WorkerPlugin`` that opens gpumem's shared manager for
  the worker's device, pre-warms a pool, wires CuPy/Numba/torch when asked, publishes gpumem's
  counters with each heartbeat, frees the cache and pauses the worker under memory pressure,
  and closes the manager (reporting leaks) at teardown;
- :func:`worker_manager`: the manager of the worker a task runs on;
- :func:`memory_report`: gpumem's counters asked of every worker, one row per worker (also the
  CLI's ``gpumem cluster SCHEDULER_ADDRESS``); "no GpumemPlugin" only for a worker without one.
"""
from __future__ import annotations

try:
    import distributed  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised where distributed is absent
    raise ImportError(f"gpumem.dask needs the 'distributed' package ({exc}); install it with "
                      f"pip install 'gpumem-pool[dask]'") from None

from gpumem.dask.plugin import PLUGIN_NAME, GpumemPlugin, worker_manager, wire_frameworks
from gpumem.dask.report import METRIC_NAME, format_report, memory_report

__all__ = ["GpumemPlugin", "worker_manager", "wire_frameworks", "memory_report",
           "format_report", "PLUGIN_NAME", "METRIC_NAME"]
