"""What the scheduler knows of gpumem on each worker: the counters GpumemPlugin puts in every
heartbeat (``WorkerState.metrics["gpumem"]``), as rows and as a table."""
from __future__ import annotations

import sys
from typing import Any, TextIO

from gpumem.stats import StatsDict
from gpumem.units import format_bytes

__all__ = ["METRIC_NAME", "ReportRow", "memory_report", "format_report",
           "rows_from_scheduler_info"]

#: The key of gpumem's counters in a worker's heartbeat metrics.
METRIC_NAME = "gpumem"


class ReportRow(StatsDict):
    """One worker's row, keyed by gpumem.stats' vocabulary (docs/statistics.md); ``peak_bytes``,
    the name used before for ``peak_in_use_bytes``, still reads, with a DeprecationWarning."""
    what = "gpumem.dask memory_report() row"
    renamed = {"peak_bytes": "peak_in_use_bytes"}


def rows_from_scheduler_info(info: dict[str, Any]) -> list[ReportRow]:
    """One row per worker of ``client.scheduler_info()``, ordered by worker name: ``worker``
    (address), ``name``, ``plugin`` (whether GpumemPlugin reports from it) and, when it does,
    the counters (``device``, ``reserved_bytes``, ``in_use_bytes``, ``cached_bytes``,
    ``peak_in_use_bytes``, ``pool_hits``, ``pressure``, ``num_ooms``, ``paused``...)."""
    rows = []
    for address, worker in info.get("workers", {}).items():
        metric = (worker.get("metrics") or {}).get(METRIC_NAME)
        row = ReportRow(worker=address, name=worker.get("name", address),
                        plugin=bool(metric and metric.get("device")))
        if row["plugin"]:
            row.update(metric)
        rows.append(row)
    rows.sort(key=lambda r: (str(r["name"]), r["worker"]))
    return rows


def memory_report(client: Any, *, show: bool = True, file: TextIO | None = None
                  ) -> list[ReportRow]:
    """gpumem's counters on every worker as the scheduler last heard them (with each
    heartbeat, every 0.5 s on a small cluster): returns one row per worker (see
    :func:`rows_from_scheduler_info`) and prints them as a table unless ``show=False``.
    ``client`` is a synchronous ``distributed.Client``."""
    try:
        info = client.scheduler_info(n_workers=-1)   # distributed >= 2025: all workers
    except TypeError:
        info = client.scheduler_info()
    rows = rows_from_scheduler_info(info)
    if show:
        print(format_report(rows), file=file if file is not None else sys.stdout)
    return rows


_COLUMNS = (("name", "worker", 12), ("device", "device", 8), ("reserved_bytes", "reserved", 11),
            ("in_use_bytes", "in use", 11), ("cached_bytes", "cached", 11),
            ("peak_in_use_bytes", "peak in use", 11), ("pressure", "pressure", 8),
            ("num_ooms", "OOMs", 5), ("cpu_fallbacks", "fallbacks", 9), ("paused", "paused", 6))


def format_report(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table (sizes in binary units), one line per worker."""
    lines = [" ".join(f"{title:>{width}}" if i > 1 else f"{title:<{width}}"
                      for i, (_, title, width) in enumerate(_COLUMNS))]
    for row in rows:
        if not row.get("plugin"):
            lines.append(f"{str(row['name']):<12} no GpumemPlugin on this worker ({row['worker']})")
            continue
        cells = []
        for i, (key, _, width) in enumerate(_COLUMNS):
            value = row.get(key)
            if key.endswith("_bytes"):
                text = format_bytes(value)
            elif key == "paused":
                text = "yes" if value else "no"
            else:
                text = str(value)
            cells.append(f"{text:>{width}}" if i > 1 else f"{text:<{width}}")
        lines.append(" ".join(cells))
    if not rows:
        lines.append("(no workers)")
    return "\n".join(lines)
