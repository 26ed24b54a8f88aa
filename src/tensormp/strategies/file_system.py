"""The ``file_system`` strategy's named segments: names, files, and when one is an orphan.

Files and names
---------------
A named segment is a file in the *shm directory* (``$TENSORMP_SHM_DIR``, default
``/dev/shm``), created ``O_EXCL`` with mode 0600 and reserved with ``posix_fallocate`` (a full
tmpfs fails there with ``ENOSPC``, in the caller, never with a later ``SIGBUS``). Its name
carries everything needed to decide, with no daemon state, whether anyone can still need it::

    tensormp-<uid>-<creator pid>-<creator start>-<program pid>-<program start>-<32 hex>

``start`` is a process's start time in clock ticks since boot: a (pid, start) pair names a
process for good, a pid alone does not (pids are reused). The *program* is the process tree a
segment belongs to: the process that first used tensormp without having been started by a
tensormp context is its root, and every process a tensormp context starts (fork, spawn,
forkserver; ``Pool`` and ``spawn()`` workers included) inherits the root's id. The 128 random
bits make names unguessable. No fd is kept: a process maps the file and closes it at once, so
thousands of live segments cost no fds.

Who may remove a file
---------------------
* Its *creator*, while it lives: when its allocator lets the segment go (every block back,
  none held by another process), and at exit for segments none of whose blocks ever left it.
* Once the creator is dead: the cleanup daemon (``_daemon.py``) or ``tensormp gc``, and only
  when :func:`is_orphan` says so: **no live process maps the file** (``/proc/<pid>/maps``), and
  **no message carrying it can still be read**. The daemon knows the second from its clients'
  records (sent minus received handles, see ``_client.py``); without that knowledge (a daemon
  restarted after a crash, or ``gc`` with no daemon) a handle may sit unread in a queue for as
  long as any process of the program lives, so the file is kept until the program's root and
  every process of it are gone.

A mapping keeps the memory valid after the name is removed, so removing a name never breaks a
process that holds the segment; the name is only needed by a process that has not opened it
yet (a handle in flight), which is what the rules above protect.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import FdLimitError, HandleError, SharedMemoryError
from ..liveness import process_alive, process_start_time
from ..memory.segment import Segment, available_memory, format_bytes
from .base import Strategy, TakeFd

if TYPE_CHECKING:
    from ..reducers import Message

__all__ = [
    "PREFIX",
    "SegmentFile",
    "shm_dir",
    "program",
    "set_program",
    "new_name",
    "parse_name",
    "create",
    "open_named",
    "unlink",
    "list_segment_files",
    "mapped_names",
    "is_orphan",
    "process_alive",
    "process_start_time",
    "FileSystem",
]

PREFIX = "tensormp-"
_HEX = set("0123456789abcdef")


def shm_dir() -> str:
    """The directory named segments live in: ``$TENSORMP_SHM_DIR`` or ``/dev/shm``."""
    return os.environ.get("TENSORMP_SHM_DIR") or "/dev/shm"


# The program id lives in the package (strategies/__init__.py), so that the fork hook that
# passes it on is registered whatever the strategy, and without importing this module.
from . import program, set_program  # noqa: E402

_self: tuple[int, int] | None = None


def _self_id() -> tuple[int, int]:
    global _self
    pid = os.getpid()
    if _self is None or _self[0] != pid:
        _self = (pid, process_start_time(pid) or 0)
    return _self


def new_name() -> str:
    """A fresh, unguessable segment name for this process and program."""
    pid, start = _self_id()
    ppid, pstart = program()
    return f"{PREFIX}{os.getuid()}-{pid}-{start}-{ppid}-{pstart}-{os.urandom(16).hex()}"


@dataclass(frozen=True)
class SegmentFile:
    """A named segment as found in the shm directory.

    Attributes:
        name: file name (no directory).
        uid: uid of the creator (from the name).
        creator: ``(pid, start time)`` of the process that created it.
        program: ``(pid, start time)`` of the root of the creator's program.
        size: bytes (0 when unknown).
    """

    name: str
    uid: int
    creator: tuple[int, int]
    program: tuple[int, int]
    size: int = 0


def parse_name(name: str, size: int = 0) -> SegmentFile | None:
    """The fields of a named segment's file name, or None when it is not one of ours."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split("-")
    if len(parts) != 6 or len(parts[5]) != 32 or not set(parts[5]) <= _HEX:
        return None
    try:
        uid, cpid, cstart, ppid, pstart = (int(p) for p in parts[:5])
    except ValueError:
        return None
    return SegmentFile(name, uid, (cpid, cstart), (ppid, pstart), size)


def _path(name: str, directory: str | None = None) -> str:
    return os.path.join(directory or shm_dir(), name)


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def create(name: str, size: int) -> int:
    """Create the file ``name`` of ``size`` bytes in the shm directory, every byte reserved;
    returns an open fd (the caller maps it and closes it).

    Raises:
        SharedMemoryError: ``ENOSPC`` when the shm directory cannot hold ``size`` more bytes
            (with the numbers and the fixes), or another ``OSError`` from the file system.
    """
    directory = shm_dir()
    path = _path(name, directory)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise FdLimitError(
                e.errno,
                f"cannot create a shared-memory segment: this process is out of file descriptors "
                f"({e.strerror}); raise the limit (ulimit -n)",
            ) from None
        raise SharedMemoryError(
            e.errno,
            f"cannot create the shared-memory file {path}: {e.strerror}. Set TENSORMP_SHM_DIR "
            "to a writable tmpfs directory, or use the file_descriptor strategy "
            "(tensormp.set_sharing_strategy('file_descriptor')).",
        ) from None
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        _unlink_quietly(path)
        free = _free_bytes(directory)
        free_s = "unknown" if free is None else format_bytes(free)
        if e.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            hint = (
                " (the default size of /dev/shm in a Docker container: start it with a larger "
                "--shm-size)"
                if free is not None and directory == "/dev/shm" and free <= 64 << 20
                else ""
            )
            raise SharedMemoryError(
                errno.ENOSPC,
                f"cannot reserve {format_bytes(size)} of shared memory in {directory} ({free_s} "
                f"free){hint}; make {directory} larger, set TENSORMP_SHM_DIR to a larger tmpfs, "
                "or use the file_descriptor strategy (tensormp.set_sharing_strategy("
                "'file_descriptor')), whose memory does not count against it",
            ) from None
        raise SharedMemoryError(
            e.errno, f"cannot reserve {format_bytes(size)} in {path}: {e.strerror}"
        ) from None
    return fd


def open_named(name: str) -> int:
    """Open the named segment ``name`` (received in a handle); returns an fd.

    Raises:
        HandleError: the name is malformed, or the file is gone or is not a private regular
            file of this user.
    """
    info = parse_name(name)
    if info is None:
        raise HandleError(f"{name!r} is not a tensormp segment name (corrupt message)")
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise HandleError(
            f"the shared-memory file {path} of a received array no longer exists: it was removed "
            "after every process that could hold it had exited (or by hand, or another "
            "TENSORMP_SHM_DIR is set here than in the sender)"
        ) from None
    except OSError as e:
        raise HandleError(f"cannot open the shared-memory file {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        os.close(fd)
        raise HandleError(
            f"refusing {path}: not a regular file private to uid {os.getuid()} "
            f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
        )
    return fd


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def unlink(name: str, directory: str | None = None) -> bool:
    """Remove a named segment's file; False if it was already gone."""
    return _unlink_quietly(_path(name, directory))


def list_segment_files(directory: str | None = None, all_users: bool = False) -> list[SegmentFile]:
    """The tensormp named segments in ``directory`` (default: the shm directory) of this uid
    (every uid with ``all_users``), with their sizes."""
    directory = directory or shm_dir()
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    uid = os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            st = os.lstat(os.path.join(directory, name))
        except OSError:
            continue
        info = parse_name(name, st.st_size)
        if info is not None and (all_users or (info.uid == uid and st.st_uid == uid)):
            out.append(info)
    return out


def mapped_names(directory: str | None = None) -> dict[str, set[int]]:
    """Named segments of ``directory`` mapped by live processes: ``{name: {pid, ...}}``.

    Reads ``/proc/<pid>/maps`` of every process this user may read (all of them as root).
    """
    real = os.path.realpath(directory or shm_dir()).rstrip("/") + "/" + PREFIX
    out: dict[str, set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if real.encode() not in data:
            continue
        pid = int(entry)
        for line in data.decode(errors="replace").splitlines():
            at = line.find(real)
            if at < 0:
                continue
            name = line[at + len(real) - len(PREFIX) :].split(" ", 1)[0]
            out.setdefault(name, set()).add(pid)
    return out


def is_orphan(
    info: SegmentFile,
    mapped: dict[str, set[int]],
    in_flight: int | None,
    program_alive: bool,
) -> bool:
    """True when nobody can need ``info`` any more (see the module notes).

    Args:
        mapped: the result of :func:`mapped_names` (taken after the creator was seen dead).
        in_flight: handles sent minus handles received, as the daemon counted them; None when
            unknown (the daemon did not see the segment created).
        program_alive: whether any process of the segment's program still lives.
    """
    if process_alive(*info.creator):
        return False
    if info.name in mapped:
        return False
    if in_flight is None or in_flight > 0:
        return not program_alive
    return True


class FileSystem(Strategy):
    """Named files in the shm directory; handles carry the name, and the cleanup daemon is
    told of every segment created and of every message carrying one (``_client.py``)."""

    name = "file_system"
    code = ord("n")
    keeps_fd = False
    counts_handles = True

    def create(self, size: int, kind: str) -> Segment:
        from . import _client

        directory = shm_dir()
        if not os.path.isdir(directory):
            raise SharedMemoryError(
                errno.ENOENT,
                f"the shm directory {directory} (TENSORMP_SHM_DIR) does not exist or is not a "
                "directory: create it (on a tmpfs), unset TENSORMP_SHM_DIR to use /dev/shm, or "
                "use the file_descriptor strategy",
            )
        avail = available_memory()
        if avail is not None and size > avail:  # a tmpfs larger than memory would OOM
            raise SharedMemoryError(
                errno.ENOMEM,
                f"cannot reserve {format_bytes(size)} of shared memory in {shm_dir()}: only "
                f"{format_bytes(avail)} of memory is available to this process. Free memory, "
                "raise the container's memory limit, or send smaller arrays.",
            )
        name = new_name()
        _client.created(name)  # before the file exists: the daemon then knows its history
        fd = create(name, size)  # reserved with posix_fallocate; ENOSPC raises here
        seg = Segment(bytes.fromhex(name[-32:]), fd, size, os.getpid(), kind, self, name)
        # The pages are reserved; map them now too, so the first copy runs at memory speed.
        seg.populate()
        return seg

    def reference(self, msg: Message, seg: Segment) -> int | str:
        return msg.add_counted(self, seg.name)

    def attach(
        self, seg_id: bytes, ref: int | str, size: int, creator_pid: int, kind: str,
        take_fd: TakeFd,
    ) -> Segment:
        if type(ref) is not str:
            raise HandleError(f"a file_system handle carries a file name, not {ref!r} (corrupt message)")
        return Segment(seg_id, open_named(ref), size, creator_pid, kind, self, ref)

    def remove(self, seg: Segment) -> None:
        unlink(seg.name)

    def sent(self, refs: Iterable[str]) -> None:
        from . import _client

        _client.sent(refs)

    def received(self, refs: Iterable[str]) -> None:
        from . import _client

        _client.received(refs)
