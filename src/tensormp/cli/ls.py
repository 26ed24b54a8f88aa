"""``tensormp ls``: list live and orphaned segments (see the package notes)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict

from ..strategies import names
from .proc import scan_proc
from .segments import SegmentRow, daemon_state, file_rows, fmt, memfd_rows

__all__ = ["run"]


def _short(row: SegmentRow, full: bool) -> str:
    if full:
        return row.name
    parts = row.name[len(names.PREFIX) :].split("-")
    if row.kind == "memfd":  # tensormp-<pid>-<hex>
        return f"{names.PREFIX}{parts[0]}-{parts[-1][:8]}…"
    return f"{names.PREFIX}{parts[0]}-{parts[1]}-…-{parts[-1][:8]}"  # tensormp-<uid>-<pid>-…


def _pids(pids: list[int], limit: int = 4) -> str:
    if not pids:
        return "-"
    text = ",".join(map(str, pids[:limit]))
    return text + (f",+{len(pids) - limit}" if len(pids) > limit else "")


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for r in [header, *rows]:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    shm = args.shm_dir
    state, error = daemon_state(shm)
    in_flight = None if state is None else dict(state.get("in_flight", {}))
    scan = scan_proc(shm)
    rows = file_rows(shm, scan, in_flight) + memfd_rows(scan)
    if args.json:
        print(json.dumps({
            "shm_dir": shm,
            "daemon": state,
            "daemon_error": error,
            "unreadable_processes": scan.unreadable,
            "segments": [asdict(r) for r in rows],
        }, indent=2))
        return 0
    if rows:
        table = [
            [
                _short(r, args.full), r.kind, fmt(r.size), str(r.creator_pid),
                "yes" if r.creator_alive else "no", _pids(r.holders),
                "-" if r.in_flight is None else str(r.in_flight), r.status, r.reason,
            ]
            for r in rows
        ]
        print(_table(
            ["NAME", "KIND", "SIZE", "CREATOR", "ALIVE", "HOLDERS", "IN FLIGHT", "STATUS", "WHY"],
            table, right={2, 3, 6},
        ))
    else:
        print(f"no tensormp segments (shm directory {shm}, and memfds of readable processes)")
    files = [r for r in rows if r.kind == "file"]
    memfds = [r for r in rows if r.kind == "memfd"]
    orphans = [r for r in files if r.status == "orphan"]
    print(
        f"\n{len(files)} named segment(s) in {shm} ({fmt(sum(r.size for r in files))}), "
        f"{len(memfds)} memfd segment(s) ({fmt(sum(r.size for r in memfds))})"
    )
    if orphans:
        how = ("the cleanup daemon removes them within about a second, or run `tensormp gc`"
               if state is not None else "run `tensormp gc` to remove them")
        print(f"{len(orphans)} orphaned ({fmt(sum(r.size for r in orphans))}): {how}")
    if state is not None:
        print(f"cleanup daemon: pid {state.get('pid')}, {state.get('clients')} client(s)")
    elif error:
        print(f"cleanup daemon: cannot ask it ({error})")
    if scan.unreadable:
        why = ("permission denied" if os.getuid() == 0
               else "other users' processes; run as root to see their memfds")
        print(f"{scan.unreadable} process(es) could not be read ({why})")
    return 0
