"""``gpumem groups``: the shared memory budgets of this user's processes (docs/shared_budget.md);
``--prune`` removes what is left of groups no process uses."""
from __future__ import annotations

import argparse

from gpumem.cli.common import EXIT_OK, fmt_bytes, json_out, say


def _group_line(g) -> list[str]:
    if g.error is not None:
        return [f"{g.group} on {g.device}: not trusted: {g.error}"]
    state = "" if g.live else " (no live process: gpumem groups --prune removes it)"
    lines = [f"{g.group} on {g.device}: budget {fmt_bytes(g.budget)} of {fmt_bytes(g.total)}, "
             f"{len(g.members)} member(s), reserved {fmt_bytes(g.reserved)}, cached "
             f"{fmt_bytes(g.cached)}{state}"]
    for m in g.members:
        gone = "" if m.alive else "  (gone: reaped when its share is needed)"
        lines.append(f"  pid {m.pid:<8} reserved {fmt_bytes(m.reserved):>11}  cached "
                     f"{fmt_bytes(m.cached):>11}  requests {m.requests} answered "
                     f"{m.answered}  released {fmt_bytes(m.released)}{gone}")
    return lines


def group_lines(live_only: bool = False) -> list[str]:
    """The groups as text lines (none: an empty list). ``live_only``: the groups some process
    uses, then one line counting the others (dead or not trusted)."""
    from gpumem.placement.group_report import list_groups
    lines: list[str] = []
    rest = 0
    for g in list_groups():
        if live_only and not g.live:
            rest += 1
            continue
        lines.extend(_group_line(g))
    if rest:
        lines.append(f"{rest} ledger(s) of groups no process uses or that are not trusted "
                     f"(gpumem groups lists them, gpumem groups --prune removes them)")
    return lines


def cmd_groups(args: argparse.Namespace) -> int:
    from gpumem.placement.group_report import list_groups, prune
    from gpumem.placement.ledger_folder import folder_choice
    choice = folder_choice()
    if args.prune:
        result = prune()
        if args.json:
            json_out({"folder": choice.path, "why": choice.why, "removed": result.removed,
                      "kept": [{"path": p, "why": w} for p, w in result.kept]})
            return EXIT_OK
        say(f"ledger folder {choice.path} ({choice.why})")
        for path in result.removed:
            say(f"removed {path}")
        for path, why in result.kept:
            say(f"kept {path}: {why}")
        if not result.removed and not result.kept:
            say("nothing to remove")
        return EXIT_OK
    if args.json:
        json_out([g.as_dict() for g in list_groups()])
        return EXIT_OK
    say(f"ledger folder {choice.path} ({choice.why})")
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
    s.add_argument("--prune", action="store_true",
                   help="remove the ledgers of groups no process uses, ledgers of this user "
                   "that are not trusted, and wake-up sockets of members that are gone")
    s.set_defaults(func=cmd_groups)
