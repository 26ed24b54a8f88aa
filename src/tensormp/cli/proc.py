"""Reading ``/proc``: every tensormp memfd, and every named segment of a shm directory, held
(as an fd or a mapping) by a process this user can read. See the package notes
(``cli/__init__.py``) for what is looked at and why."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..liveness import process_start_time
from ..strategies import names
from ..strategies.names import MEMFD_PREFIX, parse_memfd

__all__ = ["Memfd", "Named", "Scan", "scan_proc"]

_DELETED = " (deleted)"


@dataclass
class Memfd:
    inode: int
    name: str
    creator_pid: int
    size: int = 0
    fd_holders: set[int] = field(default_factory=set)
    map_holders: set[int] = field(default_factory=set)
    path: str = ""  # /proc/<pid>/fd/<n> of one holder, when one holds an fd


@dataclass
class Named:
    """A named segment seen held in /proc (the file may be gone from the directory)."""

    fd_holders: set[int] = field(default_factory=set)
    map_holders: set[int] = field(default_factory=set)
    deleted: bool = False
    size: int = 0


@dataclass
class Scan:
    memfds: dict[int, Memfd] = field(default_factory=dict)
    named: dict[str, Named] = field(default_factory=dict)
    unreadable: int = 0


def _named_entry(scan: Scan, path: str, prefix: str) -> Named:
    """The scan's entry for the named segment at ``path`` (under ``prefix``, the shm directory
    plus the name prefix; a ``(deleted)`` suffix is noted, not part of the name)."""
    deleted = path.endswith(_DELETED)
    name = path[len(prefix) - len(names.PREFIX) :]
    entry = scan.named.setdefault(name[: -len(_DELETED)] if deleted else name, Named())
    entry.deleted |= deleted
    return entry


def scan_proc(shm: str) -> Scan:
    """Every tensormp memfd, and every named segment of ``shm``, held by a readable process."""
    prefix = os.path.realpath(shm).rstrip("/") + "/" + names.PREFIX
    scan = Scan()
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        except OSError:
            if process_start_time(pid) is None:
                continue  # exited or a zombie meanwhile: it holds nothing any more
            scan.unreadable += 1
            fds = []
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith(MEMFD_PREFIX):
                parsed = parse_memfd(target)
                if parsed is None:
                    continue
                try:
                    st = os.stat(link)
                except OSError:
                    continue
                m = scan.memfds.setdefault(st.st_ino, Memfd(st.st_ino, *parsed))
                m.size = max(m.size, st.st_size)
                m.fd_holders.add(pid)
                if not m.path or pid != me:
                    m.path = link
            elif target.startswith(prefix):
                n = _named_entry(scan, target, prefix)
                n.fd_holders.add(pid)
                try:
                    n.size = max(n.size, os.stat(link).st_size)
                except OSError:
                    pass
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                data = f.read()
        except FileNotFoundError:
            continue
        except OSError:
            if fds:  # fds were readable but maps not: count the process once
                scan.unreadable += 1
            continue
        if MEMFD_PREFIX.encode() not in data and prefix.encode() not in data:
            continue
        for raw in data.decode(errors="replace").splitlines():
            cols = raw.split(None, 5)
            if len(cols) < 6:
                continue
            addr, _perms, offset, _dev, inode, path = cols
            start, _, end = addr.partition("-")
            length = int(end, 16) - int(start, 16) + int(offset, 16)
            if path.startswith(MEMFD_PREFIX):
                parsed = parse_memfd(path)
                if parsed is None:
                    continue
                m = scan.memfds.setdefault(int(inode), Memfd(int(inode), *parsed))
                m.map_holders.add(pid)
                if not m.fd_holders:
                    m.size = max(m.size, length)
            elif path.startswith(prefix):
                n = _named_entry(scan, path, prefix)
                n.map_holders.add(pid)
                n.size = max(n.size, length)
    return scan
