"""Pictures of memory: a live/reserved timeline and a segment map (PNG, via matplotlib).

matplotlib is optional (``pip install gpumem-pool[plot]``): this module imports without it, and the
plot functions raise :class:`PlotDependencyError` (an ImportError and a GpuMemoryError) saying
what to install. Figures are drawn with matplotlib's object API on the Agg canvas, never through
pyplot, so plotting needs no display and touches no global figure state.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from gpumem.errors import GpuMemoryError, InvalidInputError
from gpumem.units import GiB, KiB, MiB, format_bytes

__all__ = ["plot_timeline", "plot_segments", "plot_reserved_comparison", "PlotDependencyError",
           "INSTALL_HINT"]

INSTALL_HINT = "pip install gpumem-pool[plot]"


class PlotDependencyError(GpuMemoryError, ImportError):
    """matplotlib is missing."""


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise PlotDependencyError(
            f"plotting needs matplotlib, which is not installed ({exc}): "
            f"{INSTALL_HINT}") from None
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _unit(max_bytes: float) -> tuple[float, str]:
    if max_bytes >= 2 * GiB:
        return GiB, "GiB"
    if max_bytes >= 2 * MiB:
        return MiB, "MiB"
    if max_bytes >= 2 * KiB:
        return KiB, "KiB"
    return 1, "B"


def _save(fig: Any, path: str | os.PathLike[str]) -> str:
    p = os.fspath(path)
    try:
        fig.savefig(p)
    except OSError as exc:
        raise InvalidInputError(f"cannot write {p}: {exc.strerror or exc}") from None
    return p


# --- timeline -----------------------------------------------------------------------------------------
def _series_of(source: Any, device: Any, config: Any, phase: Any) -> tuple[dict, str, Any]:
    """(series dict, title, ReplayResult or None) from a ReplayResult, a trace or a path."""
    from gpumem.observe.replay import ReplayResult, replay
    if isinstance(source, ReplayResult):
        if source.series is None:
            raise InvalidInputError("this ReplayResult has no series: replay with "
                                    "record_series=True to plot it")
        return source.series, source.trace, source
    res = replay(source, device if device is not None else "sim:80GiB", config, phase=phase,
                 record_series=True)
    return res.series, res.trace, res   # type: ignore[return-value]


def plot_timeline(source: Any, path: str | os.PathLike[str], *, x: str = "event",
                  title: str | None = None, device: Any = None, config: Any = None,
                  phase: str | None = None) -> str:
    """Plot live (requested) bytes and bytes reserved by the pool over the events of a replay.

    ``source`` is a :class:`~gpumem.observe.replay.ReplayResult` recorded with ``record_series=True``,
    or a trace (path, TraceData, HistoryRecorder), which is then replayed on ``device``
    (default ``"sim:80GiB"``) with ``config``. ``x`` is ``"event"`` (event index) or
    ``"time"`` (the trace's clock, seconds). Writes a PNG to ``path`` and returns the path.
    """
    if x not in ("event", "time"):
        raise InvalidInputError(f"x must be 'event' or 'time', got {x!r}")
    fig = _figure(10, 4.8)     # before the replay: fail fast without matplotlib
    series, name, res = _series_of(source, device, config, phase)
    live = np.asarray(series["live"], dtype=np.float64)
    reserved = np.asarray(series["reserved"], dtype=np.float64)
    n = len(live)
    if x == "time" and "t_ns" in series and len(series["t_ns"]) == n:
        xs = (np.asarray(series["t_ns"], dtype=np.float64) - float(series["t_ns"][0])) / 1e9 \
            if n else np.zeros(0)
        xlabel = "time in the trace (s)"
    else:
        xs = np.arange(n)
        xlabel = "event index (allocations and frees, in order)"
    scale, unit = _unit(max(reserved.max(initial=0), live.max(initial=0)))
    ax = fig.add_subplot(1, 1, 1)
    ax.fill_between(xs, 0, reserved / scale, step="post", color="#f4a259", alpha=0.35,
                    linewidth=0)
    ax.step(xs, reserved / scale, where="post", color="#d9782d", linewidth=1.2,
            label="reserved by the pool (segments)")
    ax.fill_between(xs, 0, live / scale, step="post", color="#3a7dc9", alpha=0.45, linewidth=0)
    ax.step(xs, live / scale, where="post", color="#1f4e8c", linewidth=1.0,
            label="live (requested by the program)")
    if n:
        k_live = int(np.argmax(live))
        k_res = int(np.argmax(reserved))
        ax.axhline(live[k_live] / scale, color="#1f4e8c", linestyle=":", linewidth=0.8)
        ax.axhline(reserved[k_res] / scale, color="#d9782d", linestyle=":", linewidth=0.8)
        ratio = reserved[k_res] / live[k_live] if live[k_live] else 0.0
        ax.annotate(f"peak reserved {format_bytes(reserved[k_res])}\n"
                    f"peak live {format_bytes(live[k_live])}\nreserved/live {ratio:.3f}",
                    xy=(0.99, 0.03), xycoords="axes fraction", ha="right", va="bottom",
                    fontsize=9, bbox={"boxstyle": "round", "fc": "white", "ec": "0.7"})
        ax.set_xlim(xs[0], xs[-1] if xs[-1] > xs[0] else xs[0] + 1)
    ax.set_ylim(0, None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"memory ({unit})")
    if title is None:
        title = f"Live vs reserved memory: {name}"
        if res is not None:
            title += f" on {res.device}"
    fig.suptitle(title, fontsize=12)
    if res is not None:
        sub = (f"{res.events:,} events, hit rate {res.hit_rate:.1%}, {res.segments_created} "
               f"segments created" + (f", {res.num_ooms} OOMs" if res.num_ooms else ""))
        ax.set_title(sub, fontsize=8, color="0.35", loc="left")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=9)
    return _save(fig, path)


def plot_reserved_comparison(series: Mapping[str, Mapping[str, Any]],
                             path: str | os.PathLike[str], *, title: str = "",
                             capacity: int | None = None) -> str:
    """Reserved bytes over the events of several replays of one trace (e.g. the best gpumem
    and the best PyTorch setting of :func:`gpumem.tune`), with the trace's live bytes and the
    device's capacity. ``series`` maps a label to a replay's ``series`` (``"live"`` and
    ``"reserved"`` arrays, one value per event). Writes a PNG and returns the path."""
    if not series or any("reserved" not in s or "live" not in s for s in series.values()):
        raise InvalidInputError("series must map each label to a replay series with 'live' and "
                                "'reserved' (replay with record_series=True)")
    fig = _figure(10, 4.8)
    top = max(float(np.max(s["reserved"], initial=0)) for s in series.values())
    live = np.asarray(next(iter(series.values()))["live"], dtype=np.float64)
    scale, unit = _unit(max(top, float(live.max(initial=0)), capacity or 0))
    ax = fig.add_subplot(1, 1, 1)
    xs = np.arange(len(live))
    ax.fill_between(xs, 0, live / scale, step="post", color="#3a7dc9", alpha=0.35, linewidth=0,
                    label=f"live (requested), peak {format_bytes(live.max(initial=0))}")
    for k, (label, s) in enumerate(series.items()):
        reserved = np.asarray(s["reserved"], dtype=np.float64)
        ax.step(np.arange(len(reserved)), reserved / scale, where="post",
                color=_PALETTE[(k + 1) % len(_PALETTE)], linewidth=1.3,
                label=f"reserved, {label}: peak {format_bytes(reserved.max(initial=0))}")
    if capacity:
        ax.axhline(capacity / scale, color="0.3", linestyle="--", linewidth=0.9,
                   label=f"device capacity {format_bytes(capacity)}")
    if len(xs):
        ax.set_xlim(0, max(len(xs) - 1, 1))
    ax.set_ylim(0, None)
    ax.set_xlabel("event index (allocations and frees, in order)")
    ax.set_ylabel(f"memory ({unit})")
    fig.suptitle(title or "Reserved memory over the trace", fontsize=12)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, path)


# --- segment map -----------------------------------------------------------------------------------------
_FREE_COLOR = "#e3e3e3"
_PALETTE = ["#3a7dc9", "#e07b39", "#4daf4a", "#984ea3", "#e41a1c", "#a6761d", "#17becf",
            "#f781bf", "#666666", "#bcbd22"]
_UNTAGGED = "#3a7dc9"


def plot_segments(snapshot: dict, path: str | os.PathLike[str], *, title: str | None = None,
                  max_segments: int = 40, normalize: bool = False) -> str:
    """Draw every segment of a snapshot as a horizontal bar, its blocks coloured by tag (free
    blocks grey, the rounding waste of an allocated block hatched). The x axis is the offset in
    the segment (MiB/GiB) or, with ``normalize``, the fraction of the segment, which makes small
    segments readable next to large ones. At most ``max_segments`` bars (the largest segments,
    in address order). Writes a PNG and returns the path."""
    from gpumem.observe.snapshot import _validate, summarize
    _validate(snapshot, "snapshot")
    segs = list(snapshot["segments"])
    total_segs = len(segs)
    if len(segs) > max_segments:
        keep = sorted(range(len(segs)), key=lambda k: -segs[k]["size"])[:max_segments]
        segs = [segs[k] for k in sorted(keep)]
    n = len(segs)
    fig = _figure(11, max(3.2, 1.6 + 0.32 * n))
    ax = fig.add_subplot(1, 1, 1)
    largest = max((s["size"] for s in segs), default=1)
    scale, unit = (1.0, "") if normalize else _unit(largest)

    tags: dict[str, str] = {}
    tagged = any(b.get("tag") is not None for s in segs for b in s["blocks"]
                 if b["state"] == "allocated")

    def color_of(tag: Any) -> str:
        if tag is None:
            return _UNTAGGED if not tagged else "#7f9fbf"
        key = str(tag)
        if key not in tags:
            tags[key] = _PALETTE[len(tags) % len(_PALETTE)]
        return tags[key]

    min_w = 0.0025 * (1.0 if normalize else largest / scale)
    labels = []
    for row, seg in enumerate(segs):
        y = n - 1 - row
        size = seg["size"] or 1
        div = size if normalize else scale
        free_x, alloc_x, alloc_c, waste_x, hole_x = [], [], [], [], []
        for b in seg["blocks"]:
            x0, w = b["offset"] / div, b["size"] / div
            if b["state"] == "free":
                free_x.append((x0, w))
            elif b["state"] == "unmapped":          # a hole inside an expandable segment
                hole_x.append((x0, w))
            else:
                req = min(b.get("requested", b["size"]), b["size"])
                # a tiny block stays visible: at least 0.25 % of the axis
                alloc_x.append((x0, max(req / div, min_w)))
                alloc_c.append(color_of(b.get("tag")))
                if b["size"] > req:
                    waste_x.append((x0 + req / div, (b["size"] - req) / div))
        if free_x:
            ax.broken_barh(free_x, (y - 0.38, 0.76), facecolors=_FREE_COLOR, edgecolor="none")
        if alloc_x:
            ax.broken_barh(alloc_x, (y - 0.38, 0.76), facecolors=alloc_c, edgecolor="white",
                           linewidth=0.3)
        if hole_x:
            ax.broken_barh(hole_x, (y - 0.38, 0.76), facecolors="white", edgecolor="0.6",
                           hatch="..", linewidth=0.0)
        if waste_x:
            ax.broken_barh(waste_x, (y - 0.38, 0.76), facecolors="white", edgecolor="#b04040",
                           hatch="////", linewidth=0.0)
        ax.broken_barh([(0, seg["size"] / div)], (y - 0.38, 0.76), facecolors="none",
                       edgecolor="0.4", linewidth=0.6)
        unmapped = seg.get("unmapped_bytes", 0)
        if unmapped:
            # reserved address space, drawn as a stub: it can be far larger than the axis
            stub = min(unmapped / div, 0.04 * (1.0 if normalize else largest / scale))
            ax.broken_barh([(seg["size"] / div, stub)], (y - 0.38, 0.76), facecolors="none",
                           edgecolor="0.6", hatch="..", linewidth=0.4, linestyle=":")
        used = sum(b["size"] for b in seg["blocks"] if b["state"] == "allocated")
        pct = used / size
        pct_s = "<1%" if 0 < pct < 0.01 else f"{pct:.0%}"
        more = (f", +{format_bytes(seg['unmapped_bytes'])} unmapped"
                if seg.get("unmapped_bytes") else "")
        labels.append((y, f"{format_bytes(seg['size'])} {seg['pool']} ({pct_s} used{more})"))
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=8)
    ax.set_ylabel("segments (by address)", fontsize=9)
    ax.set_ylim(-0.7, n - 0.3 if n else 0.5)
    if normalize:
        ax.set_xlim(0, 1)
        ax.set_xlabel("offset in the segment (fraction of its size)")
    else:
        ax.set_xlim(0, largest / scale * 1.01)
        ax.set_xlabel(f"offset in the segment ({unit})")
    s = summarize(snapshot)
    if title is None:
        title = f"Segments of {snapshot.get('device', '?')}"
        if snapshot.get("trace"):
            title += f" during {snapshot['trace']}"
            if snapshot.get("event_index") is not None:
                title += f" (after event {snapshot['event_index']:,})"
    fig.suptitle(title, fontsize=12)
    shown = "" if n == total_segs else f"; showing the {n} largest of {total_segs} segments"
    ax.set_title(f"{s['num_segments']} segments, {format_bytes(s['reserved_bytes'])} reserved, "
                 f"{format_bytes(s['in_use_bytes'])} allocated, largest free block "
                 f"{format_bytes(s['largest_free_block'])}, fragmentation of the free space "
                 f"{s['fragmentation_ratio']:.0%}{shown}", fontsize=8, color="0.35", loc="left")
    from matplotlib.patches import Patch
    handles = []
    if tags:
        handles += [Patch(facecolor=c, label=f"allocated: {t}") for t, c in tags.items()][:12]
        if any(b.get("tag") is None for sg in segs for b in sg["blocks"]
               if b["state"] == "allocated"):
            handles.append(Patch(facecolor="#7f9fbf", label="allocated (untagged)"))
    else:
        handles.append(Patch(facecolor=_UNTAGGED, label="allocated"))
    handles.append(Patch(facecolor="white", edgecolor="#b04040", hatch="////",
                         label="rounding (allocated, not requested)"))
    handles.append(Patch(facecolor=_FREE_COLOR, edgecolor="0.6", label="free (cached)"))
    if any(sg.get("unmapped_bytes") for sg in segs):
        handles.append(Patch(facecolor="none", edgecolor="0.6", hatch="..",
                             label="unmapped (holes to scale; reserved space after: not)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=min(4, len(handles)),
               fontsize=8, frameon=False)
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)
