"""``tensormp gc``: remove orphaned named segments, through the cleanup daemon when one runs,
else by the conservative rule of the package notes."""

from __future__ import annotations

import argparse
import json
import os

from ..liveness import process_alive
from ..strategies import names
from .proc import scan_proc
from .segments import fmt, holders_by_name, live_programs, program_alive

__all__ = ["run"]


def _collect_locally(shm: str, dry_run: bool) -> list[tuple[str, int]]:
    """Remove (or list, with ``dry_run``) the orphans of ``shm`` by the rule of the notes."""
    files = names.list_segment_files(shm)
    candidates = [f for f in files if not process_alive(*f.creator)]
    if not candidates:
        return []
    live = live_programs(files)
    held = holders_by_name(shm, scan_proc(shm))  # after the creators were seen dead
    freed = []
    for f in candidates:
        if names.is_orphan(f, held, False, program_alive(f, live), shm):
            if dry_run or names.unlink(f.name, shm):
                freed.append((f.name, f.size))
    return freed


def run(args: argparse.Namespace) -> int:
    shm = args.shm_dir
    via = "tensormp gc: no cleanup daemon serves the directory"
    answer = None
    note = None
    if args.dry_run:
        via = "tensormp gc's own rule, as without a daemon"
    else:
        try:
            from ..strategies import _client

            answer = _client.request("GC", shm, start=False)
        except Exception as e:  # fall back to the local rule, which is always safe
            note = f"could not ask the cleanup daemon ({type(e).__name__}: {e})"
    if answer is not None:
        freed = [(str(n), int(s)) for n, s in answer.get("freed", [])]
        count, total = int(answer.get("count", len(freed))), int(answer.get("bytes", 0))
        via = "the cleanup daemon"
    else:
        freed = _collect_locally(shm, args.dry_run)
        count, total = len(freed), sum(s for _, s in freed)
    if args.json:
        print(json.dumps({
            "shm_dir": shm, "dry_run": args.dry_run, "by": "daemon" if answer else "cli",
            "freed": [{"name": n, "size": s} for n, s in freed], "count": count,
            "bytes": total, "note": note,
        }, indent=2))
        return 0
    if note:
        print(f"note: {note}; applying the conservative rule here")
    verb = "would remove" if args.dry_run else "removed"
    for name, size in freed:
        print(f"{verb} {os.path.join(shm, name)}  {fmt(size)}")
    if count > len(freed):
        print(f"... and {count - len(freed)} more")
    if count:
        print(f"{'would free' if args.dry_run else 'freed'} {count} orphaned segment(s), "
              f"{fmt(total)}, in {shm} (by {via})")
    else:
        print(f"no orphaned segments in {shm} (checked by {via}); memfd segments are freed by "
              "the kernel and never need collecting")
    return 0
