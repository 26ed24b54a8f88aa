"""The ``file_system`` strategy's named segments: their files, their tokens, and the strategy.

Files
-----
A named segment is a file in the *shm directory*, named as ``names.py`` says (its creator and
program, and 128 random bits), created ``O_EXCL`` with mode 0600 and reserved with
``posix_fallocate`` (a full tmpfs fails there with ``ENOSPC``, in the caller, never with a later
``SIGBUS``). A process maps the file and closes its fd at once, so thousands of live segments
cost no fds.

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
inherits that mapping and outlives the creator is seen by the maps check (``names.py``).

Who may remove a file: its creator, while it lives; once it is dead, the cleanup daemon
(``_daemon.py``) or ``tensormp gc``, when no live process maps it and no token of it exists
(``names.py`` has the rule).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import os
import stat
import threading
import weakref
from typing import Any

from ..errors import FdLimitError, HandleError, SharedMemoryError
from ..memory.segment import Segment, available_memory, format_bytes
from .base import FdList, Strategy, TakeFd
from .names import F_OFD_SETLK, TOKEN_LOCK, new_name, parse_name, shm_dir, unlink
from .names import path as _path

__all__ = ["create", "open_named", "FileSystem"]

_TOKEN_CACHE = 16  # segments whose token a sender keeps open


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
            fcntl.fcntl(fd, F_OFD_SETLK, TOKEN_LOCK)  # read locks never conflict
    except BaseException:
        os.close(fd)
        raise
    return fd

def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


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

    def reference(self, msg: FdList, seg: Segment) -> int | str:
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
