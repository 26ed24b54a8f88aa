"""``tensormp doctor``: check this machine's set-up (exit status 1 on a PROBLEM)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from .proc import scan_proc
from .segments import daemon_state, file_rows, fmt, memfd_rows

__all__ = ["Check", "run"]

_DOCKER_SHM = 64 << 20


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


def _check_shm(shm: str, where: str) -> list[Check]:
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
            f"{shm} holds only {fmt(total)} ({fmt(free)} free), no more than Docker's default of 64 MiB. "
            "Named segments (file_system strategy) live there"
            + (", and so do multiprocessing's locks" if os.path.realpath(shm) == "/dev/shm" else ""),
            "start the container with --shm-size=8g, or use the file_descriptor strategy "
            "(the default), whose memory does not count against it", sizes,
        ))
    elif total and free < _DOCKER_SHM:
        out.append(Check(
            "shm_size", "WARN", f"{shm} is nearly full: {fmt(free)} free of {fmt(total)}",
            "remove what fills it (`tensormp gc` for tensormp's orphans), or use the "
            "file_descriptor strategy (the default)", sizes,
        ))
    else:
        size_s = fmt(total) if total else "unlimited"
        out.append(Check("shm_size", "OK", f"{shm}: {size_s}, {fmt(free)} free", data=sizes))
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
        if soft < hard:
            to = min(hard, 65536)
            fix = (f"raise the soft limit up to the hard one, no privileges needed: `ulimit -n "
                   f"{to}` in the shell, or resource.setrlimit(resource.RLIMIT_NOFILE, ({to}, "
                   f"{hard_s if hard != resource.RLIM_INFINITY else 'resource.RLIM_INFINITY'}))"
                   " at start-up")
        else:
            fix = ("the hard limit is the same, so only whoever starts the process can raise it: "
                   "`nofile` in /etc/security/limits.conf, `docker run --ulimit nofile=65536:65536`"
                   ", `LimitNOFILE=65536` in a systemd unit; or use the file_system strategy "
                   "(tensormp.set_sharing_strategy('file_system')), which keeps no fd per "
                   "segment")
        return Check(
            "nofile", "WARN", f"RLIMIT_NOFILE soft limit {soft} (hard {hard_s}) is below the "
            f"usual 1024: {why}", fix, data,
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
    from ..memory.segment import available_memory

    avail = available_memory()
    if avail is None:
        return Check("memory", "INFO", "available memory unknown")
    return Check("memory", "INFO",
                 f"{fmt(avail)} of memory available to new memfd segments (MemAvailable, "
                 "capped by this process's memory cgroups)", data={"available_bytes": avail})


def _check_start_method() -> Check:
    import multiprocessing

    from .. import get_start_method

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
    if not os.path.isdir(shm):  # (the shm_dir check says so)
        return Check("daemon", "INFO", f"no cleanup daemon can serve {shm}: no such directory",
                     data={"running": False})
    state, error = daemon_state(shm)
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
    scan = scan_proc(shm)
    files = file_rows(shm, scan, None) if os.path.isdir(shm) else []
    orphans = [r for r in files if r.status == "orphan"]
    live = [r for r in files if r.status == "live"]
    memfds = memfd_rows(scan)
    out = []
    if not os.path.isdir(shm):
        pass  # no directory, no orphans in it (the shm_dir check says so)
    elif orphans:
        names = ", ".join(r.name for r in orphans[:3]) + (", ..." if len(orphans) > 3 else "")
        out.append(Check(
            "orphans", "PROBLEM",
            f"{len(orphans)} orphaned named segment(s) in {shm} hold "
            f"{fmt(sum(r.size for r in orphans))}: {names}",
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
        f"{len(live)} live named segment(s) ({fmt(sum(r.size for r in live))}); "
        f"{len(memfds)} memfd segment(s) ({fmt(sum(r.size for r in memfds))}) held by "
        f"{len(holders)} process(es)" + (f"; {scan.unreadable} process(es) unreadable"
                                          if scan.unreadable else ""),
        data={"named": len(live), "memfd": len(memfds), "unreadable": scan.unreadable},
    ))
    return out


def _doctor_checks(shm: str, where: str = "the default") -> list[Check]:
    steps: list[Callable[[], Check | list[Check]]] = [
        lambda: _check_shm(shm, where), _check_semaphores, _check_memfd, _check_nofile,
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


def run(args: argparse.Namespace) -> int:
    from .. import __version__

    checks = _doctor_checks(args.shm_dir, args.shm_origin)
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
