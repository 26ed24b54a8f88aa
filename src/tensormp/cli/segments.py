"""Segments, classified: one :class:`SegmentRow` per named file and per memfd found, with its
status by the rule of the package notes (``cli/__init__.py``), and the cleanup daemon's view."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..liveness import process_alive, process_start_time
from ..memory.segment import format_bytes
from ..strategies import names
from .proc import Scan

__all__ = [
    "SegmentRow", "fmt", "holders_by_name", "program_alive", "live_programs", "file_rows",
    "memfd_rows", "daemon_state",
]

fmt = format_bytes  # sizes in human form


@dataclass
class SegmentRow:
    """One segment as ``ls`` shows it.

    Attributes:
        kind: ``"file"`` (a named segment of the ``file_system`` strategy) or ``"memfd"``.
        name: the file name, or the memfd's name (``tensormp-<creator pid>-<32 hex>``).
        path: the file's path, or ``/proc/<pid>/fd/<n>`` of a process holding the memfd
            ("" when only mappings hold it).
        size: bytes.
        creator_pid: pid of the process that created it.
        creator_alive: whether it lives (files: pid and start time; memfds: pid only).
        holders: pids of the live processes that map it or hold an fd to it.
        in_flight: 1 when a token of it exists (a message carrying it is unread, or a
            process maps it through one), else 0, as the cleanup daemon reports it (files only;
            None when no daemon runs or for memfds).
        status: ``"live"`` or ``"orphan"`` (nobody can need it: ``tensormp gc`` removes it).
        reason: why, in words.
        inode: the memfd's inode (its identity), or the file's.
    """

    kind: str
    name: str
    path: str
    size: int
    creator_pid: int
    creator_alive: bool
    holders: list[int]
    in_flight: int | None
    status: str
    reason: str
    inode: int | None


def holders_by_name(shm: str, scan: Scan) -> dict[str, set[int]]:
    """Live processes mapping (``names.mapped_names``) or holding an fd to each file."""
    held = {name: set(pids) for name, pids in names.mapped_names(shm).items()}
    for name, n in scan.named.items():
        held.setdefault(name, set()).update(n.fd_holders | n.map_holders)
    return held


def program_alive(info: names.SegmentFile, live_programs: set[tuple[int, int]]) -> bool:
    return info.program in live_programs or process_alive(*info.program)


def live_programs(files: list[names.SegmentFile]) -> set[tuple[int, int]]:
    """Programs with a live creator among ``files``: alive even if their root has exited."""
    return {f.program for f in files if process_alive(*f.creator)}


def file_rows(shm: str, scan: Scan, in_flight: dict[str, int] | None) -> list[SegmentRow]:
    files = names.list_segment_files(shm)
    live = live_programs(files)
    held = holders_by_name(shm, scan)  # read after the creators' liveness, as the daemon does
    rows = []
    listed = set()
    for f in sorted(files, key=lambda f: f.name):
        listed.add(f.name)
        creator_alive = process_alive(*f.creator)
        holders = sorted(held.get(f.name, ()))
        prog_alive = program_alive(f, live)
        if names.is_orphan(f, held, False, prog_alive, shm):
            status, reason = "orphan", "creator and program dead, no process holds it"
        elif creator_alive:
            status, reason = "live", "creator alive"
        elif holders:
            status, reason = "live", f"held by {len(holders)} process(es)"
        else:
            status = "live"
            reason = f"program {f.program[0]} alive: a message may still carry it"
        try:
            inode: int | None = os.lstat(os.path.join(shm, f.name)).st_ino
        except OSError:
            inode = None
        rows.append(SegmentRow(
            "file", f.name, os.path.join(shm, f.name), f.size, f.creator[0], creator_alive,
            holders, None if in_flight is None else in_flight.get(f.name, 0), status, reason,
            inode,
        ))
    uid = os.getuid()
    for name, n in sorted(scan.named.items()):
        info = names.parse_name(name, n.size)
        if name in listed or not n.deleted or info is None or info.uid != uid:
            continue
        holders = sorted(n.fd_holders | n.map_holders)
        rows.append(SegmentRow(
            "file", name, "", n.size, info.creator[0], process_alive(*info.creator), holders,
            None, "live",
            f"name removed, memory held by {len(holders)} process(es) until they let go", None,
        ))
    return rows


def memfd_rows(scan: Scan) -> list[SegmentRow]:
    rows = []
    for m in sorted(scan.memfds.values(), key=lambda m: (m.creator_pid, m.name)):
        holders = sorted(m.fd_holders | m.map_holders)
        rows.append(SegmentRow(
            "memfd", m.name, m.path, m.size, m.creator_pid,
            process_start_time(m.creator_pid) is not None, holders, None, "live",
            f"held by {len(holders)} process(es); freed by the kernel after the last",
            m.inode,
        ))
    return rows


def daemon_state(shm: str) -> tuple[dict[str, Any] | None, str | None]:
    """The cleanup daemon's ``STATE`` answer (None if none runs), and an error in words."""
    try:
        from ..strategies import _client

        return _client.request("STATE", shm, start=False), None
    except Exception as e:  # a dead, stuck or mismatched daemon must not break the CLI
        return None, f"{type(e).__name__}: {e}"
