"""Connections that carry file descriptors with every message (``SCM_RIGHTS``).

Wire format (Unix stream socket, one writer at a time per direction):

    sendmsg( header = struct "<IQ" (nfds, payload length) + payload,
             ancillary = SCM_RIGHTS [fd_0 .. fd_252] )
    then, only when nfds > 253: sendmsg(b"F", SCM_RIGHTS [next <= 253 fds]) per batch

The kernel attaches the fds to the first byte of the ``sendmsg`` that carried them and holds
them while the message is in flight: a receiver gets them even if the sender has exited since,
and no listener thread or fetch at unpickle time is needed. A receiver reads the header with
``recvmsg`` (``MSG_CMSG_CLOEXEC``), any extra fd batches, then the payload.

For non-root users the kernel caps the fds a user may have in flight (``ETOOMANYREFS``, the
``RLIMIT_NOFILE`` of the sender); a send that hits the cap waits for receivers to drain and
retries, as a write to a full pipe waits, up to ``_INFLIGHT_TIMEOUT`` seconds.

:class:`Connection` is a drop-in for ``multiprocessing.connection.Connection``: ``send``/
``recv`` move arrays as shared-memory handles, ``send_bytes``/``recv_bytes`` are plain bytes,
``poll``/``fileno``/``close`` and ``multiprocessing.connection.wait`` work as in the stdlib.
"""

from __future__ import annotations

import errno
import io
import math
import os
import select
import socket
import struct
import sys
import time
from multiprocessing import connection as _mpc
from multiprocessing import reduction as _mpr
from typing import Any

from . import reducers
from .errors import FdLimitError

__all__ = ["Connection", "Pipe"]

_HEADER = struct.Struct("<IQ")
_MAX_FDS = 253  # SCM_MAX_FD
_ANC_SPACE = socket.CMSG_SPACE(_MAX_FDS * 4)
# Plain ints: the socket module's IntFlag members cost an enum operation (~2 us) per message.
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SCM_RIGHTS = int(socket.SCM_RIGHTS)
_FD_SIZE = struct.calcsize("i")
_ONE_FD = struct.Struct("i")
_INFLIGHT_TIMEOUT = 60.0


def _fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
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


class Connection(_mpc.Connection):
    """A duplex or one-way connection over a Unix socket that can carry fds.

    Same API as ``multiprocessing.connection.Connection`` (the stdlib docs apply); ``send``
    pickles with tensormp's reducers and ``recv`` rebuilds shared arrays from the fds that
    came with the message.
    """

    def __init__(self, handle: int, readable: bool = True, writable: bool = True) -> None:
        super().__init__(handle, readable, writable)
        self._sock = socket.socket(fileno=handle)
        self._sock.setblocking(True)

    def _poll(self, timeout: float | None) -> bool:
        # One poll object per connection instead of the stdlib's selector per call (which
        # costs several microseconds: Queue.get(timeout=...) polls before every message).
        poller = self.__dict__.get("_poller")
        if poller is None:
            poller = self._poller = select.poll()
            poller.register(self._handle, select.POLLIN)
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        try:
            return bool(poller.poll(ms))
        except RuntimeError:  # another thread is polling this connection: use a fresh object
            poller = select.poll()
            poller.register(self._handle, select.POLLIN)
            return bool(poller.poll(ms))

    def _close(self, _close: Any = None) -> None:
        self.__dict__.pop("_poller", None)
        sock = self.__dict__.pop("_sock", None)
        if sock is not None:
            sock.close()

    # -- framing ------------------------------------------------------------------------------
    def _sendmsg(self, buffers: list[Any], fds: list[int]) -> int:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))] if fds else []
        deadline = None
        while True:
            try:
                return self._sock.sendmsg(buffers, anc)
            except OSError as e:
                if e.errno != errno.ETOOMANYREFS:
                    raise
                # Too many fds in flight for this user: wait for receivers to drain them.
                now = time.monotonic()
                deadline = deadline or now + _INFLIGHT_TIMEOUT
                if now > deadline:
                    raise OSError(
                        e.errno,
                        f"{e.strerror}: receivers have not taken the file descriptors already "
                        f"in flight for {_INFLIGHT_TIMEOUT:.0f} s; read from the queue or pipe, "
                        "or raise RLIMIT_NOFILE (ulimit -n)",
                    ) from None
                time.sleep(0.001)

    def _send_message(self, data: bytes | bytearray | memoryview, fds: list[int]) -> None:
        header = _HEADER.pack(len(fds), len(data))
        view = memoryview(data).cast("B")
        if len(fds) <= _MAX_FDS:
            sent = self._sendmsg([header, view], fds)
        else:  # header with the first batch, then 1-byte messages with the others
            sent = self._sendmsg([header], fds[:_MAX_FDS])
            if sent < len(header):
                self._sock.sendall(header[sent:])
            for start in range(_MAX_FDS, len(fds), _MAX_FDS):
                self._sendmsg([b"F"], fds[start : start + _MAX_FDS])
            sent = len(header)
        if sent < len(header):
            self._sock.sendall(header[sent:])
            sent = len(header)
        if sent - len(header) < len(view):
            self._sock.sendall(view[sent - len(header) :])

    def _recv_exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise EOFError
            got += k
        return buf

    def _recv_fds(self, nbytes: int) -> tuple[bytes, list[int], bool]:
        """``recvmsg``: (bytes, fds received, whether fds were lost to MSG_CTRUNC)."""
        data, anc, flags, _ = self._sock.recvmsg(nbytes, _ANC_SPACE, _MSG_CMSG_CLOEXEC)
        return data, _fds_of(anc), bool(flags & _MSG_CTRUNC)

    def _recv_message(self, wait: bool = True) -> Any:
        """One message's ``(bytes, fds)``; with ``wait`` False, None when none has arrived."""
        sock = self._sock
        # Nothing to flush before waiting: holds and releases go out within 50 ms on the
        # release timer (memory/release.py), blocked or not. So a blocking read goes straight
        # to the kernel (no MSG_DONTWAIT probe first: one syscall less per idle wait).
        try:
            head, anc, flags, _ = sock.recvmsg(
                _HEADER.size, _ANC_SPACE,
                _MSG_CMSG_CLOEXEC if wait else _MSG_CMSG_CLOEXEC | _MSG_DONTWAIT,
            )
        except BlockingIOError:
            return None
        lost = bool(flags & _MSG_CTRUNC)
        fds = _fds_of(anc) if anc else []
        try:
            if not head:
                raise EOFError
            if len(head) < _HEADER.size:
                head += self._recv_exact(_HEADER.size - len(head))
            nfds, length = _HEADER.unpack(head)
            batches = -(-max(0, nfds - _MAX_FDS) // _MAX_FDS)
            for _ in range(batches):
                marker, more, more_lost = self._recv_fds(1)
                fds.extend(more)
                lost |= more_lost
                if marker != b"F":
                    raise EOFError if not marker else OSError("corrupt tensormp message stream")
            # Read the whole message even when fds were lost.
            data = sock.recv(length) if length else b""
            if len(data) < length:
                if not data:
                    raise EOFError
                data += self._recv_exact(length - len(data))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        if lost or len(fds) != nfds:
            for fd in fds:
                os.close(fd)
            raise FdLimitError(
                errno.EMFILE,
                f"a message arrived with {nfds} file descriptors but only {len(fds)} could be "
                "received: this process is out of fds (RLIMIT_NOFILE). The message was "
                "dropped and the connection stays usable; raise the limit (ulimit -n) or keep "
                "fewer arrays alive",
            )
        return data, fds

    # -- the stdlib hooks ---------------------------------------------------------------------
    def _send_bytes(self, buf: Any) -> None:
        self._send_message(buf, [])

    def _recv_bytes(self, maxsize: int | None = None) -> Any:
        data, fds = self._recv_message()
        for fd in fds:
            os.close(fd)
        if maxsize is not None and len(data) > maxsize:
            raise OSError("bad message length")
        buf = io.BytesIO()
        buf.write(data)  # positioned at the end, as the stdlib's (recv_bytes_into reads tell())
        return buf

    # -- objects ------------------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Send a picklable object; arrays go as shared-memory handles.

        Pickling happens here, in the caller: an object that cannot be pickled raises
        (``TypeError``/``pickle.PicklingError``) before anything is written.
        """
        self._check_closed()
        self._check_writable()
        msg = reducers.dumps(obj)
        try:
            self.send_message(msg)
        except BaseException:
            msg.abandon()
            raise

    def send_message(self, msg: reducers.Message) -> None:
        """Send an already pickled :class:`~tensormp.reducers.Message`."""
        self._check_closed()
        self._check_writable()
        reducers.flush_release_records()  # holds reach creators before our results do
        self._send_message(msg.data, msg.fds)
        msg.sent()

    def try_send_message(self, msg: reducers.Message) -> bool:
        """Send ``msg`` only if the socket takes it now without blocking: True when sent,
        False when nothing was written because the socket is full.

        Used by ``Queue.put`` to skip its feeder thread. A small message on a Unix stream
        socket goes in whole or not at all; should the kernel take only part of it, the rest
        is written here, blocking (the fds went with the first byte). Only for messages with
        at most 253 fds (one ``SCM_RIGHTS``); use :meth:`send_message` for others.

        Raises:
            OSError: ``ETOOMANYREFS`` (too many fds in flight for this user: nothing was
                written; :meth:`send_message` waits for receivers), or the socket failed.
        """
        reducers.flush_release_records()  # holds reach creators before our results do
        data = msg.data
        fds = msg.fds
        header = _HEADER.pack(len(fds), len(data))
        if not fds:
            anc = []
        elif len(fds) == 1:
            anc = [(_SOL_SOCKET, _SCM_RIGHTS, _ONE_FD.pack(fds[0]))]
        else:
            anc = [(_SOL_SOCKET, _SCM_RIGHTS, struct.pack(f"{len(fds)}i", *fds))]
        try:
            sent = self._sock.sendmsg([header, data], anc, _MSG_DONTWAIT)
        except BlockingIOError:
            return False
        total = len(header) + len(data)
        if sent < total:
            self._sock.sendall((header + bytes(data))[sent:])
        msg.sent()
        return True

    def recv(self) -> Any:
        """Receive an object sent with :meth:`send` (blocks). Raises ``EOFError`` at EOF."""
        self._check_closed()
        self._check_readable()
        data, fds = self._recv_message()
        return reducers.loads(data, fds)

    def recv_message(self) -> tuple[bytearray | bytes, list[int]]:
        """Receive the raw ``(pickle bytes, fds)`` of one message; pass them to ``loads``."""
        self._check_closed()
        self._check_readable()
        return self._recv_message()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.fileno()}"
        mode = ("r" if self.readable else "") + ("w" if self.writable else "")
        return f"<tensormp.Connection {mode} {state}>"


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """A pair of connected :class:`Connection` objects, like ``multiprocessing.Pipe``.

    Both ends are Unix sockets (even for ``duplex=False``, which the stdlib builds from
    ``os.pipe``) so that fds can travel with messages. With ``duplex=False`` the first end
    only receives and the second only sends.
    """
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fa, fb = a.detach(), b.detach()
    if duplex:
        return Connection(fa), Connection(fb)
    return Connection(fa, writable=False), Connection(fb, readable=False)


# -- pickling a Connection --------------------------------------------------------------------
def _reduce_connection(conn: Connection) -> Any:
    msg = reducers.current_message()
    if msg is not None:  # inside a tensormp channel: the fd rides with the message
        return _rebuild_connection_from_message, (
            msg.add_fd(conn.fileno(), ("conn", conn.fileno()), conn),
            conn.readable,
            conn.writable,
        )
    df = _mpr.DupFd(conn.fileno())  # stdlib path: process start or resource_sharer
    return _rebuild_connection_dupfd, (df, conn.readable, conn.writable)


def _rebuild_connection_from_message(index: int, readable: bool, writable: bool) -> Connection:
    return Connection(reducers.take_fd(index), readable, writable)


def _rebuild_connection_dupfd(df: Any, readable: bool, writable: bool) -> Connection:
    return Connection(df.detach(), readable, writable)


reducers.register(Connection, _reduce_connection)
_mpr.register(Connection, _reduce_connection)  # our own type only: no effect on others
