"""The ``file_system`` strategy's named segments: names, files, tokens, and when one is an orphan.

Files and names
---------------
A named segment is a file in the *shm directory* (``$TENSORMP_SHM_DIR``, default
``/dev/shm``), created ``O_EXCL`` with mode 0600 and reserved with ``posix_fallocate`` (a full
tmpfs fails there with ``ENOSPC``, in the caller, never with a later ``SIGBUS``). Its name
carries what is needed to find its creator, with no daemon state::

    tensormp-<uid>-<creator pid>-<creator start>-<program pid>-<program start>-<32 hex>

``start`` is a process's start time in clock ticks since boot: a (pid, start) pair names a
process for good, a pid alone does not (pids are reused). The *program* is the process tree a
segment belongs to (every process a tensormp context starts inherits its root's id); ``tensormp
ls`` shows it. The 128 random bits make names unguessable. A process maps the file and closes
its fd at once, so thousands of live segments cost no fds.

Tokens: who may still need a name
---------------------------------
A message never carries a bare name: with each segment it refers to, it carries a *token*, an
fd of the segment's file whose open file description (OFD) holds an OFD read lock on byte 0
(``F_OFD_SETLK``), attached to the message as ``SCM_RIGHTS`` like any fd. The sender opens the
token by name (it is the creator, or it maps the segment); the receiver maps the segment
*through the token* and closes it, so it never opens the name. The kernel keeps an OFD lock as
long as any reference to the OFD exists: an fd in a process, an fd in flight in a socket, or a
mapping made through it. So the lock exists exactly while a message carrying the segment can
still be read, or a process maps it through a token, and it goes with no help from anyone:

* a sender killed before its ``sendmsg``: its fds close, the token with them;
* a message in flight: the socket holds the token until the message is read, or until the
  socket itself goes (every process that had the queue or pipe is gone);
* a receiver killed after its ``recvmsg``: its fds and mappings close, the token with them.

A sender keeps the tokens of its last ``_TOKEN_CACHE`` segments open and attaches the same OFD
to every message for them (no syscall per message); at most that many fds, plus one per segment
of messages still waiting in a feeder thread. A forwarder (a receiver sending on an array it
got) maps through a token, so the lock protects the name it opens. The creator maps its file
through an OFD without the lock (its own liveness protects the name); a fork child that
inherits that mapping and outlives the creator is seen by the maps check below.

Who may remove a file
---------------------
* Its *creator*, while it lives: when its allocator lets the segment go (every block back,
  none held by another process), and at exit for segments none of whose blocks ever left it.
* Once the creator is dead: the cleanup daemon (``_daemon.py``) or ``tensormp gc``, when
  :func:`is_orphan` says so: **no live process maps the file** (``/proc/<pid>/maps``, for
  mappings made without a token, by hand) and **no token of it exists** (``F_OFD_GETLK``). One
  kernel call answers the second, atomically, with no record of who sent what, so a killed
  process's files go at the next collection (about a second) after its death.
* The token rule holds for files the daemon saw announced (``C``, sent before the file is
  created) by a client of its own protocol. For any other file (a daemon restarted after a
  crash, ``gc`` with no daemon, a file of an older tensormp whose messages carry bare names)
  the daemon cannot tell whether a bare name is in flight, so it keeps the file until the
  program's root and every process of it are gone, as before tokens.

A mapping keeps the memory valid after the name is removed, so removing a name never breaks a
process that holds the segment.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import stat
import struct
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
    "carried",
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

_FLOCK = struct.Struct("hhqqi4x")  # struct flock (LP64 Linux): type, whence, start, len, pid
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_TOKEN_LOCK = _FLOCK.pack(fcntl.F_RDLCK, 0, 0, 1, 0)  # what a token holds
_PROBE = _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 1, 0)  # conflicts with any token
_TOKEN_CACHE = 16  # segments whose token a sender keeps open

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


def open_named(name: str, token: bool = False) -> int:
    """Open the named segment ``name``; returns an fd (with the token lock if ``token``: see
    the module notes).

    Raises:
        HandleError: the name is malformed, or the file is gone or is not a private regular
            file of this user.
        FdLimitError: this process is out of fds.
    """
    info = parse_name(name)
    if info is None:
        raise HandleError(f"{name!r} is not a tensormp segment name (corrupt message)")
    path = _path(name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise HandleError(
            f"cannot send an array whose shared-memory file {path} no longer exists: it was "
            "removed by hand (or another TENSORMP_SHM_DIR is set here than where it was made); "
            "copy the array (a.copy()) to send its contents"
        ) from None
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            raise FdLimitError(
                e.errno, f"cannot open {path} to send it: this process is out of file "
                f"descriptors ({e.strerror}); raise the limit (ulimit -n)",
            ) from None
        raise HandleError(f"cannot open the shared-memory file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise HandleError(
                f"refusing {path}: not a regular file private to uid {os.getuid()} "
                f"(owner {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
            )
        if token:
            fcntl.fcntl(fd, _F_OFD_SETLK, _TOKEN_LOCK)  # read locks never conflict
    except BaseException:
        os.close(fd)
        raise
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


def carried(name: str, directory: str | None = None) -> bool:
    """Whether a token of the file ``name`` exists (see the module notes): a message carrying
    it can still be read, or a process maps it through one. False when the file is gone."""
    try:
        fd = os.open(_path(name, directory), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        got = fcntl.fcntl(fd, _F_OFD_GETLK, _PROBE)
    finally:
        os.close(fd)
    return bool(_FLOCK.unpack(got)[0] != fcntl.F_UNLCK)


def is_orphan(
    info: SegmentFile,
    mapped: dict[str, set[int]],
    known: bool,
    program_alive: bool,
    directory: str | None = None,
) -> bool:
    """True when nobody can need ``info`` any more (see the module notes).

    Args:
        mapped: the result of :func:`mapped_names` (taken after the creator was seen dead).
        known: the file was made by a process that sends tokens (the daemon saw it created);
            otherwise a message may carry its bare name, and only the program's end tells.
        program_alive: whether any process of the segment's program still lives.
        directory: the shm directory (default: the current one).
    """
    if process_alive(*info.creator):
        return False
    if info.name in mapped:
        return False
    if not known:
        return not program_alive
    return not carried(info.name, directory)


class _Token:
    """An fd of a segment's file holding the token lock (module notes); closed when the last
    message and cache entry referring to it are gone, and only by the process that opened it."""

    __slots__ = ("fd", "pid", "__weakref__")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()
        _live_tokens.add(self)

    def close(self, _close: Any = os.close, _getpid: Any = os.getpid) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0 and self.pid == _getpid():
            _close(fd)

    __del__ = close


_live_tokens: weakref.WeakSet[_Token] = weakref.WeakSet()
_tokens: collections.OrderedDict[bytes, _Token] = collections.OrderedDict()  # segment id ->
_tokens_lock = threading.Lock()


def _token_for(seg: Segment) -> _Token:
    """This process's token for ``seg``: the cached one, or a new one (the oldest of more than
    ``_TOKEN_CACHE`` is dropped from the cache; messages that carry it keep it open)."""
    with _tokens_lock:
        token = _tokens.get(seg.id)
        if token is not None and token.fd >= 0:
            _tokens.move_to_end(seg.id)
            return token
        token = _tokens[seg.id] = _Token(open_named(seg.name, token=True))
        if len(_tokens) > _TOKEN_CACHE:
            _tokens.popitem(last=False)
        return token


def _drop_token(seg: Segment) -> None:
    with _tokens_lock:
        _tokens.pop(seg.id, None)


def _name_of(fd: int) -> str:
    """The file name a received token was opened with (``/proc/self/fd``)."""
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as e:
        raise HandleError(f"cannot read the name of a received segment fd: {e.strerror}") from None
    name = os.path.basename(path.removesuffix(" (deleted)"))
    if parse_name(name) is None:
        raise HandleError(f"a file_system handle's fd is {path!r}, not a tensormp segment (corrupt message)")
    return name


def _after_fork_in_child() -> None:
    for token in list(_live_tokens):
        fd, token.fd = token.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
    _tokens.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class FileSystem(Strategy):
    """Named files in the shm directory; a handle carries a token of the file (module notes),
    and the cleanup daemon (``_daemon.py``) removes the files nobody can need any more."""

    name = "file_system"
    code = ord("n")
    keeps_fd = False

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
        _client.created(name)  # a daemon runs before the file exists
        fd = create(name, size)  # reserved with posix_fallocate; ENOSPC raises here
        seg = Segment(bytes.fromhex(name[-32:]), fd, size, os.getpid(), kind, self, name)
        # The pages are reserved; map them now too, so the first copy runs at memory speed.
        seg.populate()
        return seg

    def reference(self, msg: Message, seg: Segment) -> int | str:
        token = _token_for(seg)
        return msg.add_fd(token.fd, seg.id, token)

    def attach(
        self, seg_id: bytes, ref: int | str, size: int, creator_pid: int, kind: str,
        take_fd: TakeFd,
    ) -> Segment:
        if type(ref) is not int:
            raise HandleError(f"a file_system handle carries a token's fd index, not {ref!r} (corrupt message)")
        fd = take_fd(ref)
        try:
            name = _name_of(fd)
        except BaseException:
            os.close(fd)
            raise
        # Mapped through the token: the mapping keeps its lock (module notes).
        return Segment(seg_id, fd, size, creator_pid, kind, self, name)

    def remove(self, seg: Segment) -> None:
        unlink(seg.name)

    def unmapped(self, seg: Segment) -> None:
        _drop_token(seg)  # its file's memory must not outlive the last mapping in our cache
