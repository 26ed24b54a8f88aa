"""File descriptors in socket records: the one implementation of ``SCM_RIGHTS`` batching.

A record of a Unix ``SOCK_SEQPACKET`` or ``SOCK_DGRAM`` socket is sent by one ``sendmsg`` and
received by one ``recvmsg``: it arrives whole or not at all, with its fds (``SCM_RIGHTS``) in
the same record. The kernel takes at most ``MAX_FDS`` (253, ``SCM_MAX_FD``) fds per
``sendmsg``, so a message with more cannot be one record by itself. Instead of a train of
records (which a sender killed half-way would leave torn), :func:`pack` puts all of them in a
*bag*: a fresh socket pair whose receive queue is filled with the fds in batches of 253 before
its other end is closed. The record then carries the bag, one fd. The receiver drains it
(:func:`unpack`) until EOF. Whoever dies, nothing is torn: a sender killed before its
``sendmsg`` leaves a bag nobody refers to (the kernel frees it and its fds with the sender); a
receiver killed after its ``recvmsg`` takes the bag with it; a record never read frees its
bag with the socket it sits in.

For non-root users the kernel caps the fds a user may have in flight (``ETOOMANYREFS``, the
sender's ``RLIMIT_NOFILE``); :func:`sendmsg` waits for receivers to drain and retries, as a
write to a full pipe waits, up to ``INFLIGHT_TIMEOUT`` seconds.

Users: ``connection.py`` (every tensormp channel) and ``_spawn_report.py`` (a spawn rank's return
value).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence

__all__ = ["MAX_FDS", "ANC_SPACE", "fds_of", "sendmsg", "pack", "unpack", "close_all"]

MAX_FDS = 253  # SCM_MAX_FD
ANC_SPACE = socket.CMSG_SPACE(MAX_FDS * 4)
INFLIGHT_TIMEOUT = 60.0
# Plain ints: the socket module's IntFlag members cost an enum operation (~2 us) per message.
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_FD_SIZE = struct.calcsize("i")
_ONE_FD = struct.Struct("i")
_BAG_SNDBUF = 4 << 20  # asked for; the kernel caps it at net.core.wmem_max


def fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds of ``SCM_RIGHTS`` ancillary data from ``recvmsg``."""
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == _SOL_SOCKET and kind == _SCM_RIGHTS:
            if len(payload) == _FD_SIZE:
                fds.append(int.from_bytes(payload, sys.byteorder, signed=True))
            else:
                usable = len(payload) - len(payload) % _FD_SIZE
                fds.extend(struct.unpack(f"{usable // _FD_SIZE}i", payload[:usable]))
    return fds


def _ancillary(fds: Sequence[int]) -> list[tuple[int, int, bytes]]:
    if not fds:
        return []
    if len(fds) == 1:
        return [(_SOL_SOCKET, _SCM_RIGHTS, _ONE_FD.pack(fds[0]))]
    return [(_SOL_SOCKET, _SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]


def sendmsg(sock: socket.socket, buffers: Sequence[bytes | bytearray | memoryview],
            fds: Sequence[int], flags: int = 0) -> int:
    """``sock.sendmsg(buffers, SCM_RIGHTS fds, flags)`` (at most ``MAX_FDS`` fds).

    Waits while the user has too many fds in flight (``ETOOMANYREFS``), up to
    ``INFLIGHT_TIMEOUT`` seconds, unless ``flags`` has ``MSG_DONTWAIT``.

    Raises:
        BlockingIOError: ``MSG_DONTWAIT`` and the socket is full (nothing was sent).
        OSError: the socket failed, or the fds in flight were not drained in time.
    """
    anc = _ancillary(fds)
    deadline = 0.0
    while True:
        try:
            return sock.sendmsg(buffers, anc, flags)
        except OSError as e:
            if e.errno != errno.ETOOMANYREFS or flags & _MSG_DONTWAIT:
                raise
            now = time.monotonic()
            deadline = deadline or now + INFLIGHT_TIMEOUT
            if now > deadline:
                raise OSError(
                    e.errno,
                    f"{e.strerror}: receivers have not taken the file descriptors already in "
                    f"flight for {INFLIGHT_TIMEOUT:.0f} s; read from the queue or pipe, or raise "
                    "RLIMIT_NOFILE (ulimit -n)",
                ) from None
            time.sleep(0.001)


def pack(fds: Sequence[int], room: int = MAX_FDS) -> tuple[list[int], int]:
    """The fds to attach to one record for ``fds``: ``fds`` itself when at most ``room``,
    else ``[bag]`` (see the module notes).

    Returns:
        ``(fds to attach, bag)``: ``bag`` is -1, or this process's fd of the bag, which the
        caller closes once the record is sent (or abandoned).

    Raises:
        OSError: the bag could not be made or filled (no fds left, too many fds in flight).
    """
    if len(fds) <= room:
        return list(fds), -1
    ours, bag = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        try:
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BAG_SNDBUF)
        except OSError:
            pass
        for start in range(0, len(fds), MAX_FDS):
            # A bag too full for the next batch would wait for a reader that does not exist
            # yet: fail instead.
            try:
                sendmsg(ours, [b"F"], fds[start : start + MAX_FDS], _MSG_DONTWAIT)
            except BlockingIOError:
                raise OSError(
                    errno.EMSGSIZE,
                    f"a message with {len(fds)} file descriptors does not fit in one bag "
                    f"({start} fit); send fewer distinct shared-memory segments at once",
                ) from None
    except BaseException:
        bag.close()
        raise
    finally:
        ours.close()
    fd = bag.detach()
    return [fd], fd


def unpack(fds: list[int], count: int, room: int = MAX_FDS) -> list[int]:
    """Inverse of :func:`pack` on the receiving side: ``count`` fds from the record's ``fds``
    (all of them, or the bag, which this closes). Owns ``fds``: on error every fd is closed.

    Raises:
        OSError: the record does not carry ``count`` fds (``errno`` ``EBADMSG``); a bag that
            holds fewer raises too.
    """
    if count <= room:
        if len(fds) != count:
            close_all(fds)
            raise OSError(errno.EBADMSG, f"a record announced {count} fds but carries {len(fds)}")
        return fds
    if len(fds) != 1:
        close_all(fds)
        raise OSError(errno.EBADMSG, f"a record announced a bag of {count} fds but carries {len(fds)} fds")
    out: list[int] = []
    lost = False
    bag = socket.socket(fileno=fds[0])
    try:
        while len(out) < count:
            try:
                data, anc, flags, _ = bag.recvmsg(1, ANC_SPACE, _MSG_CMSG_CLOEXEC | _MSG_DONTWAIT)
            except BlockingIOError:
                break  # the bag holds no more (its writer closed it before the record left)
            out.extend(fds_of(anc) if anc else [])
            if flags & _MSG_CTRUNC:
                lost = True
            if not data:
                break
    except BaseException:
        close_all(out)
        raise
    finally:
        bag.close()
    if len(out) != count:
        close_all(out)
        if lost:
            raise OSError(errno.EMFILE, f"out of fds: received {len(out)} of the {count} fds a bag held")
        raise OSError(errno.EBADMSG, f"a bag announced {count} fds but holds {len(out)}")
    return out


def close_all(fds: Sequence[int], _close: Callable[[int], None] = os.close) -> None:
    """Close every fd of ``fds``, ignoring those already closed. Safe from ``__del__`` at
    interpreter exit (``os.close`` is bound here: module globals may be None by then)."""
    for fd in fds:
        try:
            _close(fd)
        except OSError:
            pass
