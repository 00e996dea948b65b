"""What gpumem holds on each worker of a Dask cluster, as rows and as a table.

:func:`memory_report` asks every worker (``client.run``, all at once, each answer awaited at
most ``timeout`` seconds) for its GpumemPlugin's counters, so a plug-in registered a moment ago
is reported, and "no GpumemPlugin" is said only of a worker that answers that it has none. The
same counters also travel with every heartbeat (``WorkerState.metrics["gpumem"]``, for
dashboards); :func:`rows_from_scheduler_info` reads those, as of each worker's last heartbeat.

Rows are keyed by gpumem.stats' vocabulary (docs/statistics.md); ``peak_bytes``, the name used
before for ``peak_in_use_bytes``, still reads from a row, with a DeprecationWarning.
"""
from __future__ import annotations

import asyncio
import sys
from typing import TYPE_CHECKING, Any, TextIO

from gpumem.errors import InvalidInputError
from gpumem.stats import StatsDict
from gpumem.units import format_bytes

if TYPE_CHECKING:
    from distributed import Client, Worker

__all__ = ["METRIC_NAME", "ReportRow", "memory_report", "format_report", "worker_counters",
           "rows_from_answers", "rows_from_scheduler_info"]

#: The key of gpumem's counters in a worker's heartbeat metrics.
METRIC_NAME = "gpumem"


class ReportRow(StatsDict):
    """One worker's row: ``worker`` (address), ``name``, ``plugin`` (True: the worker has a
    GpumemPlugin; False: it answered that it has none; None: it did not answer, ``error``
    says why) and, from a plug-in, its counters (``device``, ``reserved_bytes``,
    ``in_use_bytes``, ``cached_bytes``, ``peak_in_use_bytes``, ``pool_hits``, ``pressure``,
    ``num_ooms``, ``paused``...; ``device`` is None when the plug-in holds no open manager)."""
    what = "gpumem.dask memory_report() row"
    renamed = {"peak_bytes": "peak_in_use_bytes"}


def worker_counters(dask_worker: Worker) -> dict[str, Any] | None:
    """Run on a worker by :func:`memory_report`: the counters of its GpumemPlugin (the one with
    an open manager, if several), None when it has none. Runs on the worker's event loop, the
    thread that owns the plug-in's state."""
    from gpumem.dask.plugin import GpumemPlugin
    plugins = [p for p in dask_worker.plugins.values() if isinstance(p, GpumemPlugin)]
    if not plugins:
        return None
    live = [p for p in plugins if p.manager is not None and not p.manager.closed]
    return (live or plugins)[0]._metric(dask_worker)


async def _ask_workers(client: Client, addresses: list[str], timeout: float) -> dict[str, Any]:
    """``{address: counters, None, or the exception}``, every worker asked at once."""
    async def ask(address: str) -> Any:
        try:
            answers = await asyncio.wait_for(
                client.run(worker_counters, workers=[address], on_error="return",
                           asynchronous=True), timeout)
        except asyncio.TimeoutError:
            return TimeoutError(f"no answer within {timeout:g} s")
        except Exception as exc:                     # the worker left, a comm failed...
            return exc
        if address not in answers:
            return LookupError("the worker left the cluster")
        return answers[address]

    found = await asyncio.gather(*(ask(a) for a in addresses))
    return dict(zip(addresses, found))


def rows_from_answers(info: dict[str, Any], answers: dict[str, Any]) -> list[ReportRow]:
    """One row per worker of ``client.scheduler_info()``, ordered by worker name, from what
    each worker answered (see :class:`ReportRow`)."""
    rows = []
    for address, worker in info.get("workers", {}).items():
        row = ReportRow(worker=address, name=worker.get("name", address))
        answer = answers.get(address, LookupError("the worker was not asked"))
        if isinstance(answer, BaseException):
            row["plugin"] = None
            row["error"] = f"{type(answer).__name__}: {answer}" if str(answer) else \
                type(answer).__name__
        elif answer is None:
            row["plugin"] = False
        else:
            row["plugin"] = True
            row.update(answer)
        rows.append(row)
    rows.sort(key=lambda r: (str(r["name"]), r["worker"]))
    return rows


def rows_from_scheduler_info(info: dict[str, Any]) -> list[ReportRow]:
    """Rows as of each worker's last heartbeat (``client.scheduler_info()``): a worker whose
    plug-in has not sent a heartbeat since it was registered has ``plugin`` False here, so
    prefer :func:`memory_report`, which asks the workers."""
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


def memory_report(client: Client, *, timeout: float = 10.0, show: bool = True,
                  file: TextIO | None = None) -> list[ReportRow]:
    """gpumem's counters on every worker, asked of the workers now: returns one row per worker
    (see :class:`ReportRow`) and prints them as a table unless ``show=False``. A worker that
    does not answer within ``timeout`` seconds gets a row saying so (``plugin`` None).
    ``client`` is a synchronous ``distributed.Client``."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise InvalidInputError(f"timeout must be seconds > 0, got {timeout!r}")
    try:
        info = client.scheduler_info(n_workers=-1)   # distributed >= 2025: all workers
    except TypeError:
        info = client.scheduler_info()
    answers = client.sync(_ask_workers, client, list(info.get("workers", {})), float(timeout))
    rows = rows_from_answers(info, answers)
    if show:
        print(format_report(rows), file=file if file is not None else sys.stdout)
    return rows


_COLUMNS = (("name", "worker", 12), ("device", "device", 8), ("reserved_bytes", "reserved", 11),
            ("in_use_bytes", "in use", 11), ("cached_bytes", "cached", 11),
            ("peak_in_use_bytes", "peak in use", 11), ("pressure", "pressure", 8),
            ("num_ooms", "OOMs", 5), ("cpu_fallbacks", "fallbacks", 9), ("paused", "paused", 6))


def _status_line(row: dict[str, Any]) -> str | None:
    """The one line for a worker without counters, None for one with them."""
    where = f"{str(row['name']):<12} "
    if row.get("plugin") is None:
        return where + f"no answer from this worker: {row.get('error')} ({row['worker']})"
    if not row["plugin"]:
        return where + f"no GpumemPlugin on this worker ({row['worker']})"
    if not row.get("device"):
        return where + (f"GpumemPlugin without an open manager (its setup failed, or it was "
                        f"torn down) ({row['worker']})")
    return None


#: the column added when workers share a budget (GpumemPlugin(shared_budget=...)): each
#: worker's reserved bytes as a share of the group's budget
_SHARE_COLUMN = ("shared_share", "share", 6)


def format_report(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table (sizes in binary units), one line per worker; with a
    shared budget, each worker's share of it and one line per group."""
    groups = {(r["shared_group"], r.get("device")): r for r in rows if r.get("shared_group")}
    columns = _COLUMNS + ((_SHARE_COLUMN,) if groups else ())
    lines = [" ".join(f"{title:>{width}}" if i > 1 else f"{title:<{width}}"
                      for i, (_, title, width) in enumerate(columns))]
    for row in rows:
        status = _status_line(row)
        if status is not None:
            lines.append(status)
            continue
        cells = []
        for i, (key, _, width) in enumerate(columns):
            value = row.get(key)
            if key == "shared_share":
                budget = row.get("shared_budget_bytes")
                text = f"{row['reserved_bytes'] / budget:.0%}" if budget else "-"
            elif key.endswith("_bytes"):
                text = format_bytes(value)
            elif key == "paused":
                text = "yes" if value else "no"
            else:
                text = str(value)
            cells.append(f"{text:>{width}}" if i > 1 else f"{text:<{width}}")
        lines.append(" ".join(cells))
    if not rows:
        lines.append("(no workers)")
    for (group, device), row in sorted(groups.items(), key=lambda kv: str(kv[0])):
        lines.append(f"shared group {group} on {device}: budget "
                     f"{format_bytes(row['shared_budget_bytes'])}, {row['shared_members']} "
                     f"member(s) holding {format_bytes(row['shared_reserved_bytes'])}")
    return "\n".join(lines)
