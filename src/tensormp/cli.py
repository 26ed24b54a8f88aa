"""The ``tensormp`` command: ``doctor``, ``ls`` and ``gc`` (also ``python -m tensormp ...``).

Design note
-----------
**What it looks at.** Two kinds of segments exist (``memory/segment.py``):

* *memfd* segments (the default ``file_descriptor`` strategy) have no name in any directory.
  A process holds one as an fd (``/proc/<pid>/fd/<n>`` links to
  ``/memfd:tensormp-<creator pid>-<32 hex> (deleted)``) and/or a mapping (a line of
  ``/proc/<pid>/maps`` with that path and the memfd's inode). The kernel frees one when its last
  fd and mapping are gone, so a memfd can never leak: ``ls`` shows them (identity: the inode;
  size: ``st_size`` through a holder's fd, else the mapping's length) with the live processes
  holding them, ``gc`` never has anything to do with them. The creator is known by pid only
  (memfd names carry no start time), so "creator alive" means "that pid exists".
* *named* segments (the ``file_system`` strategy) are files in the shm directory
  (``$TENSORMP_SHM_DIR`` or ``--shm-dir``, default ``/dev/shm``) whose names carry their creator
  and program (``strategies/file_system.py``). Only these can be orphaned.

**Who decides what is an orphan.** When the cleanup daemon of the shm directory runs
(``strategies/_daemon.py``), ``gc`` asks it (``GC``): it alone knows which handles are still in
flight in queues and pipes, and it answers with what it removed. Otherwise, and for ``ls``,
``doctor`` and ``gc --dry-run`` always, the CLI applies the daemon's rule without the in-flight
knowledge (:func:`file_system.is_orphan` with ``in_flight=None``): a file of this uid is an
orphan when its creator is dead, no live process maps it *or holds an fd to it*, and its program
has ended (its root is dead and no live creator of another file of the same program is seen).
That rule is never less careful than the daemon's, so running it next to a daemon is safe. The
maps are read after the creators were seen dead (as the daemon does), so a process that maps a
file between the two reads is still seen.

**What it never does.** Remove a memfd (impossible), a file of another uid, a file whose name is
not a well-formed tensormp name, or a file a live process holds. It never starts the daemon (a
``request(..., start=False)``), and it only reads ``/proc``; what it cannot read (other users'
processes, when not root) is counted and reported.

**Speed.** Nothing here imports numpy except :func:`_fmt` (sizes in human form come from
``memory.segment.format_bytes``, whose package imports numpy: about 0.1 s) and the doctor's
available-memory check; ``--json`` output of ``ls`` and ``gc`` skips both.

Exit statuses: 0 success (``doctor``: no PROBLEM found), 1 ``doctor`` found a problem, 2 usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .strategies import file_system as fs

__all__ = ["main"]

_MEMFD_PREFIX = "/memfd:" + fs.PREFIX
_DELETED = " (deleted)"
_DOCKER_SHM = 64 << 20


def _fmt(n: float) -> str:
    from .memory.segment import format_bytes

    return format_bytes(n)


# -- reading /proc ---------------------------------------------------------------------------


@dataclass
class _Memfd:
    inode: int
    name: str
    creator_pid: int
    size: int = 0
    fd_holders: set[int] = field(default_factory=set)
    map_holders: set[int] = field(default_factory=set)
    path: str = ""  # /proc/<pid>/fd/<n> of one holder, when one holds an fd


@dataclass
class _Named:
    """A named segment seen held in /proc (the file may be gone from the directory)."""

    fd_holders: set[int] = field(default_factory=set)
    map_holders: set[int] = field(default_factory=set)
    deleted: bool = False
    size: int = 0


@dataclass
class _Scan:
    memfds: dict[int, _Memfd] = field(default_factory=dict)
    named: dict[str, _Named] = field(default_factory=dict)
    unreadable: int = 0


def _named_entry(scan: Any, path: str, prefix: str) -> Any:
    """The scan's entry for the named segment at ``path`` (under ``prefix``, the shm directory
    plus the name prefix; a ``(deleted)`` suffix is noted, not part of the name)."""
    deleted = path.endswith(_DELETED)
    name = path[len(prefix) - len(fs.PREFIX) :]
    entry = scan.named.setdefault(name[: -len(_DELETED)] if deleted else name, _Named())
    entry.deleted |= deleted
    return entry

def _parse_memfd(target: str) -> tuple[str, int] | None:
    """``'/memfd:tensormp-12-<hex> (deleted)'`` -> ``('tensormp-12-<hex>', 12)``."""
    if not target.startswith(_MEMFD_PREFIX):
        return None
    name = target[len("/memfd:") :]
    if name.endswith(_DELETED):
        name = name[: -len(_DELETED)]
    parts = name[len(fs.PREFIX) :].split("-")
    if len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != 32:
        return None
    return name, int(parts[0])


def _scan_proc(shm: str) -> _Scan:
    """Every tensormp memfd, and every named segment of ``shm``, held by a readable process."""
    prefix = os.path.realpath(shm).rstrip("/") + "/" + fs.PREFIX
    scan = _Scan()
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
            if fs.process_start_time(pid) is None:
                continue  # exited or a zombie meanwhile: it holds nothing any more
            scan.unreadable += 1
            fds = []
        for fd in fds:
            link = f"/proc/{pid}/fd/{fd}"
            try:
                target = os.readlink(link)
            except OSError:
                continue
            if target.startswith(_MEMFD_PREFIX):
                parsed = _parse_memfd(target)
                if parsed is None:
                    continue
                try:
                    st = os.stat(link)
                except OSError:
                    continue
                m = scan.memfds.setdefault(st.st_ino, _Memfd(st.st_ino, *parsed))
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
        if _MEMFD_PREFIX.encode() not in data and prefix.encode() not in data:
            continue
        for raw in data.decode(errors="replace").splitlines():
            cols = raw.split(None, 5)
            if len(cols) < 6:
                continue
            addr, _perms, offset, _dev, inode, path = cols
            start, _, end = addr.partition("-")
            length = int(end, 16) - int(start, 16) + int(offset, 16)
            if path.startswith(_MEMFD_PREFIX):
                parsed = _parse_memfd(path)
                if parsed is None:
                    continue
                m = scan.memfds.setdefault(int(inode), _Memfd(int(inode), *parsed))
                m.map_holders.add(pid)
                if not m.fd_holders:
                    m.size = max(m.size, length)
            elif path.startswith(prefix):
                n = _named_entry(scan, path, prefix)
                n.map_holders.add(pid)
                n.size = max(n.size, length)
    return scan


# -- segments, classified --------------------------------------------------------------------


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
        in_flight: messages carrying it not yet received, as the cleanup daemon counts them
            (files only; None when no daemon runs or for memfds).
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


def _holders_by_name(shm: str, scan: _Scan) -> dict[str, set[int]]:
    """Live processes mapping (``file_system.mapped_names``) or holding an fd to each file."""
    held = {name: set(pids) for name, pids in fs.mapped_names(shm).items()}
    for name, n in scan.named.items():
        held.setdefault(name, set()).update(n.fd_holders | n.map_holders)
    return held


def _program_alive(info: fs.SegmentFile, live_programs: set[tuple[int, int]]) -> bool:
    return info.program in live_programs or fs.process_alive(*info.program)


def _live_programs(files: list[fs.SegmentFile]) -> set[tuple[int, int]]:
    """Programs with a live creator among ``files``: alive even if their root has exited."""
    return {f.program for f in files if fs.process_alive(*f.creator)}


def _file_rows(shm: str, scan: _Scan, in_flight: dict[str, int] | None) -> list[SegmentRow]:
    files = fs.list_segment_files(shm)
    live = _live_programs(files)
    held = _holders_by_name(shm, scan)  # read after the creators' liveness, as the daemon does
    rows = []
    listed = set()
    for f in sorted(files, key=lambda f: f.name):
        listed.add(f.name)
        creator_alive = fs.process_alive(*f.creator)
        holders = sorted(held.get(f.name, ()))
        program_alive = _program_alive(f, live)
        if fs.is_orphan(f, held, None, program_alive):
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
        info = fs.parse_name(name, n.size)
        if name in listed or not n.deleted or info is None or info.uid != uid:
            continue
        holders = sorted(n.fd_holders | n.map_holders)
        rows.append(SegmentRow(
            "file", name, "", n.size, info.creator[0], fs.process_alive(*info.creator), holders,
            None, "live",
            f"name removed, memory held by {len(holders)} process(es) until they let go", None,
        ))
    return rows


def _memfd_rows(scan: _Scan) -> list[SegmentRow]:
    rows = []
    for m in sorted(scan.memfds.values(), key=lambda m: (m.creator_pid, m.name)):
        holders = sorted(m.fd_holders | m.map_holders)
        rows.append(SegmentRow(
            "memfd", m.name, m.path, m.size, m.creator_pid,
            fs.process_start_time(m.creator_pid) is not None, holders, None, "live",
            f"held by {len(holders)} process(es); freed by the kernel after the last",
            m.inode,
        ))
    return rows


def _daemon_state(shm: str) -> tuple[dict[str, Any] | None, str | None]:
    """The cleanup daemon's ``STATE`` answer (None if none runs), and an error in words."""
    try:
        from .strategies import _client

        return _client.request("STATE", shm, start=False), None
    except Exception as e:  # a dead, stuck or mismatched daemon must not break the CLI
        return None, f"{type(e).__name__}: {e}"


# -- ls --------------------------------------------------------------------------------------


def _short(row: SegmentRow, full: bool) -> str:
    if full:
        return row.name
    parts = row.name[len(fs.PREFIX) :].split("-")
    if row.kind == "memfd":  # tensormp-<pid>-<hex>
        return f"{fs.PREFIX}{parts[0]}-{parts[-1][:8]}…"
    return f"{fs.PREFIX}{parts[0]}-{parts[1]}-…-{parts[-1][:8]}"  # tensormp-<uid>-<pid>-…


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


def _cmd_ls(args: argparse.Namespace) -> int:
    shm = args.shm_dir
    state, error = _daemon_state(shm)
    in_flight = None if state is None else dict(state.get("in_flight", {}))
    scan = _scan_proc(shm)
    rows = _file_rows(shm, scan, in_flight) + _memfd_rows(scan)
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
                _short(r, args.full), r.kind, _fmt(r.size), str(r.creator_pid),
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
        f"\n{len(files)} named segment(s) in {shm} ({_fmt(sum(r.size for r in files))}), "
        f"{len(memfds)} memfd segment(s) ({_fmt(sum(r.size for r in memfds))})"
    )
    if orphans:
        how = ("the cleanup daemon removes them within about a second, or run `tensormp gc`"
               if state is not None else "run `tensormp gc` to remove them")
        print(f"{len(orphans)} orphaned ({_fmt(sum(r.size for r in orphans))}): {how}")
    if state is not None:
        print(f"cleanup daemon: pid {state.get('pid')}, {state.get('clients')} client(s)")
    elif error:
        print(f"cleanup daemon: cannot ask it ({error})")
    if scan.unreadable:
        why = ("permission denied" if os.getuid() == 0
               else "other users' processes; run as root to see their memfds")
        print(f"{scan.unreadable} process(es) could not be read ({why})")
    return 0


# -- gc --------------------------------------------------------------------------------------


def _collect_locally(shm: str, dry_run: bool) -> list[tuple[str, int]]:
    """Remove (or list, with ``dry_run``) the orphans of ``shm`` by the rule of the notes."""
    files = fs.list_segment_files(shm)
    candidates = [f for f in files if not fs.process_alive(*f.creator)]
    if not candidates:
        return []
    live = _live_programs(files)
    held = _holders_by_name(shm, _scan_proc(shm))  # after the creators were seen dead
    freed = []
    for f in candidates:
        if fs.is_orphan(f, held, None, _program_alive(f, live)):
            if dry_run or fs.unlink(f.name, shm):
                freed.append((f.name, f.size))
    return freed


def _cmd_gc(args: argparse.Namespace) -> int:
    shm = args.shm_dir
    via = "tensormp gc: no cleanup daemon serves the directory"
    answer = None
    note = None
    if args.dry_run:
        via = "tensormp gc's own rule, as without a daemon"
    else:
        try:
            from .strategies import _client

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
        print(f"{verb} {os.path.join(shm, name)}  {_fmt(size)}")
    if count > len(freed):
        print(f"... and {count - len(freed)} more")
    if count:
        print(f"{'would free' if args.dry_run else 'freed'} {count} orphaned segment(s), "
              f"{_fmt(total)}, in {shm} (by {via})")
    else:
        print(f"no orphaned segments in {shm} (checked by {via}); memfd segments are freed by "
              "the kernel and never need collecting")
    return 0


# -- doctor ----------------------------------------------------------------------------------


@dataclass
class Check:
    """One line of ``tensormp doctor``.

    Attributes:
        check: a short stable id (``"shm_size"``...).
        status: ``"OK"``, ``"INFO"``, ``"WARN"`` or ``"PROBLEM"`` (only PROBLEM makes the exit
            status 1).
        message: what was found, with the numbers.
        fix: what to do about a WARN or PROBLEM ("" otherwise).
        data: the raw values, for ``--json``.
    """

    check: str
    status: str
    message: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def _unescape_mount(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
        .replace("\\134", "\\")


def _mount_of(path: str) -> tuple[str, str] | None:
    """``(mount point, file system type)`` of the mount that holds ``path``."""
    real = os.path.realpath(path)
    best: tuple[str, str] | None = None
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, sep, right = line.partition(" - ")
        cols = left.split()
        if not sep or len(cols) < 5 or not right:
            continue
        point = _unescape_mount(cols[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, right.split()[0])
    return best


def _check_shm(shm: str) -> list[Check]:
    where = "TENSORMP_SHM_DIR" if os.environ.get("TENSORMP_SHM_DIR") else "the default"
    if not os.path.isdir(shm):
        return [Check(
            "shm_dir", "PROBLEM",
            f"shm directory {shm} ({where}) "
            + ("is not a directory" if os.path.exists(shm) else "does not exist"),
            f"create it (a tmpfs: mount -t tmpfs tmpfs {shm}) or set TENSORMP_SHM_DIR to one; "
            "the file_system strategy needs it (the default file_descriptor strategy does not)",
            {"path": shm},
        )]
    out = []
    st = os.statvfs(shm)
    readonly = bool(st.f_flag & os.ST_RDONLY)
    writable = os.access(shm, os.W_OK | os.X_OK) and not readonly
    mount = _mount_of(shm)
    fstype = mount[1] if mount else "unknown"
    data = {"path": shm, "writable": writable, "fstype": fstype,
            "mount_point": mount[0] if mount else None}
    if writable:
        out.append(Check("shm_dir", "OK", f"shm directory {shm} ({where}): {fstype}, writable",
                         data=data))
    else:
        out.append(Check(
            "shm_dir", "PROBLEM",
            f"shm directory {shm} ({where}) is not writable"
            + (" (read-only file system)" if readonly else ""),
            f"make it writable for uid {os.getuid()}, or set TENSORMP_SHM_DIR to a writable "
            "tmpfs directory", data,
        ))
    if fstype not in ("tmpfs", "ramfs", "unknown"):
        out.append(Check(
            "shm_fstype", "WARN",
            f"{shm} is on {fstype}, not tmpfs: named segments (file_system strategy) would be "
            "written back to disk",
            "set TENSORMP_SHM_DIR to a tmpfs directory (/dev/shm), or keep the default "
            "file_descriptor strategy, which does not use the directory", data,
        ))
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    sizes = {"total_bytes": total, "free_bytes": free}
    if 0 < total <= _DOCKER_SHM:
        out.append(Check(
            "shm_size", "WARN",
            f"{shm} holds only {_fmt(total)} ({_fmt(free)} free), no more than Docker's default of 64 MiB. "
            "Named segments (file_system strategy) live there"
            + (", and so do multiprocessing's locks" if os.path.realpath(shm) == "/dev/shm" else ""),
            "start the container with --shm-size=8g, or use the file_descriptor strategy "
            "(the default), whose memory does not count against it", sizes,
        ))
    elif total and free < _DOCKER_SHM:
        out.append(Check(
            "shm_size", "WARN", f"{shm} is nearly full: {_fmt(free)} free of {_fmt(total)}",
            "remove what fills it (`tensormp gc` for tensormp's orphans), or use the "
            "file_descriptor strategy (the default)", sizes,
        ))
    else:
        size_s = _fmt(total) if total else "unlimited"
        out.append(Check("shm_size", "OK", f"{shm}: {size_s}, {_fmt(free)} free", data=sizes))
    return out


def _check_semaphores() -> Check:
    import _multiprocessing

    name = f"/mp-doctor-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        lock = _multiprocessing.SemLock(1, 1, 1, name, True)  # unlinked at once
        del lock
    except OSError as e:
        return Check(
            "semaphores", "PROBLEM",
            f"POSIX semaphores do not work ({e.strerror}): multiprocessing's Lock, Queue and "
            "Pool need them", "give the process a writable tmpfs at /dev/shm (Docker: do not "
            "mount it read-only; --ipc=private or --shm-size)",
        )
    return Check("semaphores", "OK", "POSIX semaphores work (multiprocessing locks, queues)")


def _check_nofile() -> Check:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_s = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    data = {"soft": soft, "hard": hard}
    why = ("the default file_descriptor strategy keeps one fd per live segment in each process "
           "that maps it (small arrays share 4 MiB+ arenas; each large array is one segment), "
           "and for non-root users the kernel caps fds in flight per user at this limit")
    if soft < 1024:
        return Check(
            "nofile", "WARN", f"RLIMIT_NOFILE soft limit {soft} (hard {hard_s}) is below the "
            f"usual 1024: {why}",
            f"raise it: `ulimit -n {hard if hard != resource.RLIM_INFINITY else 65536}`, or "
            "resource.setrlimit(resource.RLIMIT_NOFILE, ...) at start-up", data,
        )
    raise_hint = f"; can be raised to {hard_s} without privileges (ulimit -n)" if soft < hard else ""
    return Check("nofile", "OK", f"RLIMIT_NOFILE {soft} (hard {hard_s}){raise_hint}", data=data)


def _check_memfd() -> list[Check]:
    import ctypes
    import mmap

    try:
        fd = os.memfd_create("tensormp-doctor-probe", os.MFD_CLOEXEC)
    except OSError as e:
        return [Check(
            "memfd", "PROBLEM",
            f"memfd_create fails ({e.strerror}): the default file_descriptor strategy needs it",
            "use a kernel >= 3.17 and allow memfd_create in the seccomp profile, or use "
            "tensormp.set_sharing_strategy('file_system')", {"errno": e.errno},
        )]
    kernel = platform.release()
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        buf = mmap.mmap(fd, mmap.PAGESIZE)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            anchor = ctypes.c_char.from_buffer(buf)
            rc = libc.madvise(ctypes.addressof(anchor), mmap.PAGESIZE, 23)  # POPULATE_WRITE
            err = ctypes.get_errno()
            del anchor  # the buffer export must end before the mapping closes
        finally:
            buf.close()
    except OSError as e:
        return [Check("memfd", "PROBLEM", f"a memfd cannot be sized or mapped ({e.strerror})",
                      "check the memory limits of this process (ulimit -v, cgroup)")]
    finally:
        os.close(fd)
    out = [Check("memfd", "OK", "memfd_create works (the default file_descriptor strategy)")]
    if rc == 0:
        out.append(Check("populate", "INFO",
                         f"kernel {kernel}: MADV_POPULATE_WRITE works (pages reserved up front in "
                         "one pass)", data={"kernel": kernel, "populate_write": True}))
    else:
        out.append(Check(
            "populate", "INFO",
            f"kernel {kernel}: MADV_POPULATE_WRITE unavailable ({os.strerror(err)}; needs Linux "
            ">= 5.14): posix_fallocate reserves the pages instead (first touch is slower)",
            data={"kernel": kernel, "populate_write": False},
        ))
    return out


def _check_map_count() -> Check:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            value = int(f.read())
    except (OSError, ValueError):
        return Check("max_map_count", "INFO", "vm.max_map_count unknown")
    if value < 65530:
        return Check(
            "max_map_count", "WARN",
            f"vm.max_map_count is {value}, below the kernel's default 65530: each mapped segment "
            "takes one mapping", "sysctl -w vm.max_map_count=262144", {"value": value},
        )
    return Check("max_map_count", "OK", f"vm.max_map_count {value} (one per mapped segment)",
                 data={"value": value})


def _check_memory() -> Check:
    from .memory.segment import available_memory

    avail = available_memory()
    if avail is None:
        return Check("memory", "INFO", "available memory unknown")
    return Check("memory", "INFO",
                 f"{_fmt(avail)} of memory available to new memfd segments (MemAvailable, "
                 "capped by this process's memory cgroups)", data={"available_bytes": avail})


def _check_start_method() -> Check:
    import multiprocessing

    from . import get_start_method

    default = get_start_method()
    methods = multiprocessing.get_all_start_methods()
    return Check("start_method", "INFO",
                 f"default start method {default} (available: {', '.join(methods)})",
                 data={"default": default, "available": methods})


def _check_torch() -> Check:
    if importlib.util.find_spec("torch") is None:
        return Check("torch", "INFO", "torch not installed (optional: pip install tensormp[torch])",
                     data={"installed": False})
    from importlib import metadata

    try:
        version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        version = "unknown version"
    return Check("torch", "INFO", f"torch {version} installed",
                 data={"installed": True, "version": version})


def _check_daemon(shm: str) -> Check:
    state, error = _daemon_state(shm)
    if error is not None:
        return Check("daemon", "WARN", f"cannot ask the cleanup daemon of {shm}: {error}",
                     "stop the daemon (its pid is in the message or its log in "
                     "/tmp/tensormp-<uid>); the next file_system "
                     "process starts a new one")
    if state is None:
        return Check("daemon", "INFO", f"no cleanup daemon serves {shm} (the file_system "
                     "strategy starts one on demand)", data={"running": False})
    up = time.time() - float(state.get("started", time.time()))
    return Check("daemon", "INFO",
                 f"cleanup daemon pid {state.get('pid')} serves {shm}: "
                 f"{state.get('clients')} client(s), up {up:.0f} s",
                 data={"running": True, **state})


def _check_segments(shm: str) -> list[Check]:
    scan = _scan_proc(shm)
    files = _file_rows(shm, scan, None) if os.path.isdir(shm) else []
    orphans = [r for r in files if r.status == "orphan"]
    live = [r for r in files if r.status == "live"]
    memfds = _memfd_rows(scan)
    out = []
    if orphans:
        names = ", ".join(r.name for r in orphans[:3]) + (", ..." if len(orphans) > 3 else "")
        out.append(Check(
            "orphans", "PROBLEM",
            f"{len(orphans)} orphaned named segment(s) in {shm} hold "
            f"{_fmt(sum(r.size for r in orphans))}: {names}",
            "run `tensormp gc` (or `python -m tensormp gc`)",
            {"count": len(orphans), "bytes": sum(r.size for r in orphans),
             "names": [r.name for r in orphans]},
        ))
    else:
        out.append(Check("orphans", "OK", f"no orphaned named segments in {shm}",
                         data={"count": 0}))
    holders = {p for r in memfds for p in r.holders}
    out.append(Check(
        "segments", "INFO",
        f"{len(live)} live named segment(s) ({_fmt(sum(r.size for r in live))}); "
        f"{len(memfds)} memfd segment(s) ({_fmt(sum(r.size for r in memfds))}) held by "
        f"{len(holders)} process(es)" + (f"; {scan.unreadable} process(es) unreadable"
                                          if scan.unreadable else ""),
        data={"named": len(live), "memfd": len(memfds), "unreadable": scan.unreadable},
    ))
    return out


def _doctor_checks(shm: str) -> list[Check]:
    steps = [
        lambda: _check_shm(shm), _check_semaphores, _check_memfd, _check_nofile,
        _check_map_count, _check_memory, _check_start_method, _check_torch,
        lambda: _check_daemon(shm), lambda: _check_segments(shm),
    ]
    checks: list[Check] = []
    for step in steps:
        try:
            got = step()
        except Exception as e:  # one broken check must not hide the others
            name = getattr(step, "__name__", "check").removeprefix("_check_")
            got = Check(name, "WARN", f"could not run this check: {type(e).__name__}: {e}",
                        "report it as a tensormp bug")
        checks.extend(got if isinstance(got, list) else [got])
    return checks


def _cmd_doctor(args: argparse.Namespace) -> int:
    from . import __version__

    checks = _doctor_checks(args.shm_dir)
    problems = sum(c.status == "PROBLEM" for c in checks)
    warnings = sum(c.status == "WARN" for c in checks)
    status = 1 if problems else 0
    if args.json:
        print(json.dumps({
            "tensormp": __version__, "python": platform.python_version(),
            "kernel": platform.release(), "uid": os.getuid(), "shm_dir": args.shm_dir,
            "checks": [asdict(c) for c in checks], "problems": problems,
            "warnings": warnings, "exit_status": status,
        }, indent=2))
        return status
    print(f"tensormp {__version__} doctor: Python {platform.python_version()}, Linux "
          f"{platform.release()}, uid {os.getuid()}")
    for c in checks:
        print(f"{c.status:<8} {c.message}")
        if c.fix and c.status in ("WARN", "PROBLEM"):
            print(f"{'':<8} fix: {c.fix}")
    print(f"\n{problems} problem(s), {warnings} warning(s)")
    return status


# -- entry point -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--shm-dir", default=None, metavar="DIR",
        help="directory of named segments (default: $TENSORMP_SHM_DIR or /dev/shm)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    parser = argparse.ArgumentParser(
        prog="tensormp",
        description="Inspect and clean up tensormp's shared memory.",
        epilog="Exit status: 0 success, 1 `doctor` found a problem, 2 bad usage.",
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"tensormp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "doctor", parents=[common], help="check this machine's set-up (exit 1 on a problem)",
        description="Check the shm directory, fd limits, memfd support, start methods, the "
        "cleanup daemon and leftover segments. Exit status 0 when no PROBLEM is found, 1 "
        "otherwise (WARN lines do not change it).",
    )
    p.set_defaults(run=_cmd_doctor)
    p = sub.add_parser(
        "ls", parents=[common], help="list live and orphaned segments",
        description="List tensormp's named segments in the shm directory and the memfd segments "
        "held by the processes this user can read, with size, creator, holders and status.",
    )
    p.add_argument("-l", "--full", action="store_true", help="full segment names")
    p.set_defaults(run=_cmd_ls)
    p = sub.add_parser(
        "gc", parents=[common], help="remove orphaned named segments",
        description="Remove the named segments nobody can need any more (asking the cleanup "
        "daemon when one runs): never one a live process holds or whose creator lives.",
    )
    p.add_argument("-n", "--dry-run", action="store_true",
                   help="only print what would be removed")
    p.set_defaults(run=_cmd_gc)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``tensormp COMMAND ...`` (the console script and ``python -m tensormp``).

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success; 1 when ``doctor`` found a PROBLEM; 2 bad usage (argparse
        raises ``SystemExit(2)`` itself).
    """
    args = _parser().parse_args(argv)
    args.shm_dir = args.shm_dir or fs.shm_dir()
    try:
        return int(args.run(args))
    except BrokenPipeError:  # `tensormp ls | head`: silence the flush at exit too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
