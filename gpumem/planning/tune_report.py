"""The text of a :class:`~gpumem.planning.tune.TuneResult`: what was assumed, the table, the
recommendation and why it won.

Every label is printed whole (the column is as wide as the longest), and each row has a short
id (``g1``, ``t2``) that the legend below the table maps to the line to paste.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gpumem.units import format_bytes

if TYPE_CHECKING:
    from gpumem.planning.tune import TuneResult

__all__ = ["render", "OBJECTIVE", "margin_text", "why"]

OBJECTIVE = ("fits with margin, then least modeled driver time (the sim's CUDA driver cost "
             "model, docs/driver_costs.md), then least peak reserved")

_WHO = {"gpumem": "gpumem", "torch": "PyTorch"}


def margin_text(headroom: int) -> str:
    """How "fits with margin" is judged, in words."""
    return (f"fits with margin: no OOM even with {format_bytes(headroom)} less memory (room for "
            f"one more of the trace's largest request at its peak, or 5 % more live memory, "
            f"whichever is larger)")


def _ms(row: dict[str, Any]) -> float | None:
    s = row["modeled_driver_seconds"]
    return None if s is None else s * 1e3


def _fit_word(row: dict[str, Any]) -> str:
    return "margin" if row["fits_with_margin"] else ("yes" if row["fits"] else "NO")


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two rows with the same verdict and figures (the objective cannot tell them apart)."""
    return (_fit_word(a) == _fit_word(b) and a["peak_reserved_bytes"] == b["peak_reserved_bytes"]
            and a["modeled_driver_seconds"] == b["modeled_driver_seconds"])


def why(best: dict[str, Any], others: list[dict[str, Any]]) -> str:
    """One line: why ``best`` won over the rest of its allocator's rows (``others``, in
    objective order), and what the runner-up (the first with other figures) costs or saves."""
    tied = [r for r in others if _same(best, r)]
    runner = next((r for r in others if not _same(best, r)), None)
    tie = (f" ({', '.join(r['id'] for r in tied)} {'give' if len(tied) > 1 else 'gives'} the "
           f"same figures; the shortest line is shown)" if tied else "")
    if runner is None:
        return f"why: the only setting of its allocator with these figures{tie}"
    if best["fits_with_margin"] != runner["fits_with_margin"]:
        reason = "it fits with margin and the runner-up does not"
    elif best["fits"] != runner["fits"]:
        reason = "it fits and the runner-up does not"
    elif best["modeled_driver_seconds"] != runner["modeled_driver_seconds"]:
        reason = ("least modeled driver time among the rows that fit" +
                  (" with margin" if best["fits_with_margin"] else ""))
    else:
        reason = "same modeled driver time as the runner-up, less peak reserved"
    costs, saves = [], []
    if _ms(best) is not None and _ms(runner) is not None:
        d = _ms(runner) - _ms(best)
        (costs if d >= 0 else saves).append(f"{abs(d):.1f} ms of modeled driver time")
    dp = runner["peak_reserved_bytes"] - best["peak_reserved_bytes"]
    (costs if dp >= 0 else saves).append(f"{format_bytes(abs(dp))} of peak reserved")
    effect = " and ".join(x for x in (f"cost {' and '.join(costs)} more" if costs else "",
                                      f"save {' and '.join(saves)}" if saves else "") if x)
    fit = {"margin": "fits with margin", "yes": "fits without margin",
           "NO": "does not fit"}[_fit_word(runner)]
    return (f"why: {reason}{tie}; the runner-up, {runner['id']} ({runner['label']}, {fit}), "
            f"would {effect}")


def _table(rows: list[dict[str, Any]]) -> list[str]:
    fb = format_bytes
    lw = max([len("setting")] + [len(r["label"]) for r in rows])
    head = (f"{'id':<4} {'allocator':<9} {'setting':<{lw}} {'peak reserved':>13} "
            f"{'fits':>6} {'OOMs':>6} {'driver calls':>12} {'driver ms':>9} "
            f"{'smallest card':>13}  limited by")
    out = [head, "-" * len(head)]
    for r in rows:
        ms, card = _ms(r), r["min_capacity_bytes"]
        out.append(
            f"{r['id']:<4} {r['allocator']:<9} {r['label']:<{lw}} "
            f"{fb(r['peak_reserved_bytes']):>13} {_fit_word(r):>6} {r['num_ooms']:>6,} "
            f"{r['driver_calls']:>12,} {'-' if ms is None else f'{ms:.1f}':>9} "
            f"{'-' if card is None else fb(card):>13}  {r['limit'] or ''}".rstrip())
    return out


def _paste(row: dict[str, Any]) -> str:
    if row["allocator"] == "torch":
        return (f"PYTORCH_CUDA_ALLOC_CONF={row['config']}" if row["config"]
                else "(PyTorch's default: no PYTORCH_CUDA_ALLOC_CONF)")
    return row["config"]


def render(result: "TuneResult") -> str:
    """The whole report: assumptions, table, legend, recommendation."""
    card = result.card
    lines = [f"tune {result.trace} on {card.describe()}: {len(result.rows)} candidates in "
             f"{result.duration_s:.1f} s ({result.jobs} process(es))"]
    lines += [f"  {s}" for s in card.explain()]
    lines += ["  a request the device refuses counts as an OOM (with CPU fallback on, it would "
              "run from host memory)",
              f"  {margin_text(result.headroom)}",
              f"  recommended: {OBJECTIVE}", ""]
    lines += _table(result.rows)
    lines += ["", "settings (the line to paste):"]
    lines += [f"  {r['id']:<4} {_paste(r)}" for r in
              sorted(result.rows, key=lambda r: (r["id"][0], int(r["id"][1:])))]
    lines.append("")
    for alloc in ("gpumem", "torch"):
        best = result.best(alloc)
        if best is None:
            continue
        if not best["fits"]:
            small = result.smallest_card(alloc)
            lines.append(f"{_WHO[alloc]}: nothing fits on {card.describe()}" + (
                "" if small is None else
                f"; the smallest card that would: "
                f"{card.resized(small['min_capacity_bytes']).describe()} "
                f"({small['id']}: {_paste(small)})"))
            continue
        note = "" if best["fits_with_margin"] else " (fits, but NOT with margin)"
        lines.append(f"recommended for {_WHO[alloc]}{note}: {_paste(best)}")
        others = [r for r in result.rows if r["allocator"] == alloc and r is not best]
        lines.append(f"  {why(best, others)}")
    lines.append(f"smallest card: {MIN_CAPACITY}")
    return "\n".join(lines)


MIN_CAPACITY = ("bisection over the card's size between peak live bytes and a size that "
                "fits, to within 1/128 (docs/torch_model.md)")
