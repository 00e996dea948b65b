"""``gpumem groups``: the shared memory budgets of this user's processes (docs/shared_budget.md)."""
from __future__ import annotations

import argparse

from gpumem.cli.common import EXIT_OK, fmt_bytes, json_out, say


def group_lines() -> list[str]:
    """The groups as text lines (none: an empty list)."""
    from gpumem.placement.group_report import list_groups
    lines = []
    for g in list_groups():
        if g.error is not None:
            lines.append(f"{g.group} on {g.device}: not trusted: {g.error}")
            continue
        lines.append(f"{g.group} on {g.device}: budget {fmt_bytes(g.budget)} of "
                     f"{fmt_bytes(g.total)}, {len(g.members)} member(s), reserved "
                     f"{fmt_bytes(g.reserved)}, cached {fmt_bytes(g.cached)}")
        for m in g.members:
            state = "" if m.alive else "  (gone: reaped when its share is needed)"
            lines.append(f"  pid {m.pid:<8} reserved {fmt_bytes(m.reserved):>11}  cached "
                         f"{fmt_bytes(m.cached):>11}  requests {m.requests} answered "
                         f"{m.answered}  released {fmt_bytes(m.released)}{state}")
    return lines


def cmd_groups(args: argparse.Namespace) -> int:
    from gpumem.placement.group_report import list_groups
    if args.json:
        json_out([g.as_dict() for g in list_groups()])
        return EXIT_OK
    lines = group_lines()
    for line in lines or ["no shared group (MemoryConfig(shared_group=...) / "
                          "GPUMEM_SHARED_GROUP)"]:
        say(line)
    return EXIT_OK


def register(sub: argparse._SubParsersAction) -> None:
    """Add the 'groups' command."""
    s = sub.add_parser("groups", help="shared memory budgets of this user's processes: "
                       "members, reserved, cached, budget")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=cmd_groups)
