"""Connections whose messages are atomic records that carry file descriptors.

Wire format
-----------
A tensormp ``Pipe`` (and the socket under every queue) is an ``AF_UNIX`` ``SOCK_SEQPACKET``
socket pair. One message is **one record**: one ``sendmsg`` writes it, one ``recvmsg`` reads
it, whole or not at all, with its fds attached as ``SCM_RIGHTS`` in the same record::

    record  = header "<BBHIQI" (flags, ntokens, 0, nfds, length, slot) + inline pickle
    fds     = [tokens (ntokens)] [payload memfd, if LARGE] [the message's nfds fds, or one bag]

* A pickle of at most ``INLINE_MAX`` bytes travels inline. A larger one (flag ``LARGE``) is
  written into a memfd by the sender and only an fd of it travels: a record never exceeds
  the socket's send buffer, whatever the message's size, and ``put()`` never writes half a
  message. The receiver ``pread``s it and closes it. The fd that travels is a *reader token*
  (:class:`_Payloads`): the sender reuses the memfd (its pages already allocated) once no
  token of it is left, that is once the message was read, or its reader died after taking
  it, or the record was dropped unread with its socket; a sender that dies frees its memfds
  with its fds, and the kernel frees one still in flight once its reader is done with it.
  A sender with ``_POOL_COUNT`` (4) large messages unread on one end waits for the oldest to
  be read: the back-pressure a stream socket's buffer gives, and a bound on memory in flight.
* More fds than fit in one record (253 with the tokens and the payload) travel in a bag (flag
  ``BAG``, ``_fdpass.py``).
* Tokens (``_ledger.py``) are a ``JoinableQueue``'s task units; ``slot`` is the record's number
  in a bounded queue (``_ledger.py`` counts the records in the socket by it), ``0xFFFFFFFF``
  elsewhere.

Why this survives any death (no lock is held across a syscall, because none is needed): the
kernel queues and dequeues whole records, so concurrent writers and concurrent readers of the
same socket never interleave, and a process SIGKILLed at any instant has either written a
record or not, taken a record or not. A writer killed before its ``sendmsg`` loses only the
message it was writing (its memfd and bag die with it); a reader killed after its ``recvmsg``
loses only the message it took. Survivors never see a torn or a duplicated message.

The kernel holds fds in flight: a receiver gets them even if the sender has exited since, and
no listener thread or fetch at unpickle time is needed. For non-root users the kernel caps the
fds a user may have in flight (``ETOOMANYREFS``); a send that hits the cap waits for
receivers to drain (``_fdpass.sendmsg``).

``INLINE_MAX`` (64 KiB): measured, a record up to there costs what a stream write of the same
bytes costs, a receive buffer of that size costs nothing more per ``recvmsg`` than a 512-byte
one (a 140,000-byte one costs 5x: glibc maps it), and the 212,992-byte default send buffer
(``net.core.wmem_default``; a record may not exceed it) still holds three of the largest.

:class:`Connection` is a drop-in for ``multiprocessing.connection.Connection``: ``send``/
``recv`` move arrays as shared-memory handles, ``send_bytes``/``recv_bytes`` are plain bytes,
``poll``/``fileno``/``close`` and ``multiprocessing.connection.wait`` work as in the stdlib.
"""

from __future__ import annotations

import errno
import fcntl
import io
import math
import os
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from multiprocessing import connection as _mpc
from multiprocessing import reduction as _mpr
from typing import TYPE_CHECKING, Any, overload

from . import _fdpass, _spin, _testhooks, reducers
from .errors import FdLimitError
from .memory import fdbudget

__all__ = ["Connection", "Pipe"]

_STDLIB = ("wait", "Listener", "Client")  # the stdlib's, which work with tensormp's Connection


def __getattr__(name: str) -> Any:
    """``wait``, ``Listener`` and ``Client`` of ``multiprocessing.connection`` (``wait`` takes
    tensormp's connections too: it needs only ``fileno()``)."""
    if name in _STDLIB:
        import multiprocessing.connection as _mpc

        return getattr(_mpc, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

HEADER = struct.Struct("<BBHIQI")
_pack_header = HEADER.pack
_unpack_header = HEADER.unpack_from
_HEADER_SIZE = HEADER.size
LARGE = 1
BAG = 2
INLINE_MAX = 64 << 10
# What every Pipe() (so every queue) asks for as its send buffer: see Pipe().
SNDBUF = 4 << 20
_SIOCOUTQ = 0x5411  # ioctl: bytes sent on a socket and not read yet (linux/sockios.h, TIOCOUTQ)
_INT_ZERO = bytes(4)
_ioctl = fcntl.ioctl
_from_bytes = int.from_bytes
_ORDER = sys.byteorder
NO_SLOT = 0xFFFFFFFF
_RECORD_MAX = HEADER.size + INLINE_MAX
_MAX_FDS = _fdpass.MAX_FDS
_ANC_SPACE = _fdpass.ANC_SPACE
# Plain ints: the socket module's IntFlag members cost an enum operation (~2 us) per message.
_MSG_CMSG_CLOEXEC = int(socket.MSG_CMSG_CLOEXEC)
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_MSG_TRUNC = int(socket.MSG_TRUNC)
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
_hooks = _testhooks.armed
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (LP64 Linux): type, whence, start, len, pid
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
_POOL_COUNT = 4  # payload memfds per connection end and process (large messages unread)
_budget = fdbudget.budget
_loads = reducers.loads
_flush_release_records = reducers.flush_release_records
_spin_recvmsg = _spin.recvmsg
_spin_state = _spin.state


class Record:
    """One received message: pickle bytes, its fds (owned by the receiver from now on), the
    queue tokens that came with it, and the slot number in the header."""

    __slots__ = ("data", "fds", "tokens", "slot")

    def __init__(self, data: bytes, fds: list[int], tokens: list[int], slot: int) -> None:
        self.data = data
        self.fds = fds
        self.tokens = tokens
        self.slot = slot

    def close_tokens(self) -> None:
        _fdpass.close_all(self.tokens)
        self.tokens = []


class _Payloads:
    """The payload memfds of one connection end in this process (see the module notes).

    A payload is written into a memfd that this end keeps (its pages allocated and faulted
    after the first use: a large message costs one copy, not a page allocation per 4 KiB).
    What travels is not that fd but a *reader token*: a fresh open file description of the
    same memfd holding an OFD read lock on byte 0. The receiver reads through it and closes
    it; the kernel drops the lock with the last fd of the token, also when the receiver dies
    or when the record is dropped unread with its socket. A memfd is reused only once no
    token of it exists (``F_OFD_GETLK``), so a payload is never overwritten while anyone may
    still read it. At most ``_POOL_COUNT`` memfds per end: a writer with that many large
    messages unread waits for the oldest to be read (``F_OFD_SETLKW``, a kernel wait that a
    dying reader ends too), as a write to a full stream socket waits.
    """

    __slots__ = ("fds", "lock", "pid")

    def __init__(self) -> None:
        self.fds: list[int] = []  # oldest first
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def take(self, block: bool) -> int:
        """A memfd whose previous payload nobody reads any more (waiting for one if all
        ``_POOL_COUNT`` are being read and ``block``); -1 when not ``block`` and none is."""
        if self.pid != os.getpid():  # a fork child: those memfds are its parent's to reuse
            self.fds, inherited = [], self.fds
            self.pid = os.getpid()
            self.lock = threading.Lock()
            _fdpass.close_all(inherited)
        with self.lock:
            fds = self.fds
            for k, fd in enumerate(fds):
                got = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 1, 0))
                if _FLOCK.unpack(got)[0] == fcntl.F_UNLCK:
                    del fds[k]
                    return fd
            if len(fds) < _POOL_COUNT:
                return os.memfd_create("tensormp-message", os.MFD_CLOEXEC)
            if not block:
                return -1
            fd = fds.pop(0)
        try:  # the oldest: its reader is the next to be done
            fcntl.fcntl(fd, _F_OFD_SETLKW, _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 1, 0))
            fcntl.fcntl(fd, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, 0, 0, 1, 0))
        except BaseException:
            self.give_back(fd)
            raise
        return fd

    def give_back(self, fd: int) -> None:
        with self.lock:
            self.fds.append(fd)

    def write(self, data: bytes | bytearray | memoryview, block: bool) -> tuple[int, int]:
        """Write ``data`` into a memfd; ``(reader token to send, memfd)``, or ``(-1, -1)``
        when not ``block`` and every memfd is still being read."""
        fd = self.take(block)
        if fd < 0:
            return -1, -1
        try:
            view = memoryview(data).cast("B")
            if os.fstat(fd).st_size > len(view):
                os.ftruncate(fd, len(view))  # keep no more memory than the last payload
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            token = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
            try:
                fcntl.fcntl(token, _F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, 0, 0, 1, 0))
            except BaseException:
                os.close(token)
                raise
        except BaseException:
            self.give_back(fd)
            raise
        return token, fd

    def close(
        self,
        _getpid: Callable[[], int] = os.getpid,
        _close_all: Callable[[list[int]], None] = _fdpass.close_all,
    ) -> None:
        # Also runs from Connection.__del__ at interpreter exit, when module globals may
        # already be None: what it calls is bound at definition.
        fds, self.fds = self.fds, []
        if self.pid == _getpid():
            _close_all(fds)


def _pread_all(fd: int, length: int) -> bytes:
    if length <= 1 << 30:
        data = os.pread(fd, length, 0)
        if len(data) == length:
            return data
    chunks = []
    got = 0
    while got < length:
        chunk = os.pread(fd, min(length - got, 1 << 30), got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class Connection(_mpc.Connection):
    """A duplex or one-way connection over a Unix ``SOCK_SEQPACKET`` socket that carries fds.

    Same API as ``multiprocessing.connection.Connection`` (the stdlib docs apply); ``send``
    pickles with tensormp's reducers and ``recv`` rebuilds shared arrays from the fds that
    came with the message. Each message is one record (see the module notes): no lock is
    needed between processes that share an end, and a process killed at any point never
    leaves a torn message for the others.
    """

    if TYPE_CHECKING:  # private attributes of the stdlib's _ConnectionBase (not in typeshed)
        _handle: int
        _readable: bool
        _writable: bool

        def _check_closed(self) -> None: ...
        def _check_readable(self) -> None: ...
        def _check_writable(self) -> None: ...

    def __init__(self, handle: int, readable: bool = True, writable: bool = True) -> None:
        super().__init__(handle, readable, writable)
        self._sock = socket.socket(fileno=handle)
        self._sock.setblocking(True)
        self._payloads: _Payloads | None = None

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
        payloads = self.__dict__.pop("_payloads", None)
        if payloads is not None:
            payloads.close()

    # -- records ------------------------------------------------------------------------------
    def write_record(
        self,
        data: bytes | bytearray | memoryview,
        fds: Sequence[int],
        tokens: Sequence[int] = (),
        slot: int = NO_SLOT,
        block: bool = True,
    ) -> bool:
        """Write one message as one record (see the module notes).

        Args:
            data: the pickle (any size).
            fds: the message's fds (borrowed: the caller closes them, after this returns).
            tokens: queue tokens to attach (borrowed likewise).
            slot: the slot number to put in the header.
            block: False: write only if the socket has room now.

        Returns:
            True when written; False when ``block`` is False and the socket is full
            (nothing was written).

        Raises:
            OSError: the socket failed (``EPIPE`` when no reader is left), memory for a large
                payload could not be had, or too many fds are in flight (``ETOOMANYREFS``,
                at once when not ``block``).
        """
        n = len(data)
        ntok = len(tokens)
        flags = 0 if block else _MSG_DONTWAIT
        _spin_state.sent = True  # the next wait of this process may be for an answer (_spin.py)
        if n <= INLINE_MAX:
            try:
                if not fds and not ntok:  # a small message: no fds, so no ETOOMANYREFS wait
                    self._sock.sendmsg((_pack_header(0, 0, 0, 0, n, slot), data), (), flags)
                elif ntok + len(fds) <= _MAX_FDS:
                    header = _pack_header(0, ntok, 0, len(fds), n, slot)
                    _fdpass.sendmsg(self._sock, (header, data), [*tokens, *fds] if ntok else fds, flags)
                else:
                    return self._write_large(data, fds, tokens, slot, block)
            except BlockingIOError:
                return False
            if _hooks:
                _testhooks.reached("send.sent")
            return True
        return self._write_large(data, fds, tokens, slot, block)

    def _write_large(
        self,
        data: bytes | bytearray | memoryview,
        fds: Sequence[int],
        tokens: Sequence[int],
        slot: int,
        block: bool,
    ) -> bool:
        """:meth:`write_record` of a pickle over ``INLINE_MAX`` or of too many fds for one
        record (a payload memfd, a bag)."""
        n = len(data)
        ntok = len(tokens)
        flags = 0 if block else _MSG_DONTWAIT
        kind = 0
        payload = -1
        memfd = -1
        bag = -1
        try:
            record_fds = list(tokens)
            if n > INLINE_MAX:
                payloads = self._payloads
                if payloads is None:
                    payloads = self._payloads = _Payloads()
                payload, memfd = payloads.write(data, block)
                if payload < 0:
                    return False
                record_fds.append(payload)
                kind |= LARGE
                data = b""
                if _hooks:
                    _testhooks.reached("send.payload")
            attach, bag = _fdpass.pack(fds, _MAX_FDS - len(record_fds))
            if bag >= 0:
                kind |= BAG
                if _hooks:
                    _testhooks.reached("send.bag")
            record_fds.extend(attach)
            header = _pack_header(kind, ntok, 0, len(fds), n, slot)
            try:
                _fdpass.sendmsg(self._sock, (header, data), record_fds, flags)
            except BlockingIOError:
                return False
        finally:
            if payload >= 0:
                os.close(payload)  # the token: the kernel holds it in flight now, if sent
                self._payloads.give_back(memfd)  # type: ignore[union-attr]
            if bag >= 0:
                os.close(bag)
        if _hooks:
            _testhooks.reached("send.sent")
        return True

    def read_record(self, wait: bool = True) -> Record | None:
        """Read one record; with ``wait`` False, None when none has arrived.

        Raises:
            EOFError: every writer has closed its end.
            FdLimitError: this process is out of fds: the message (and its tokens) was
                dropped whole; the connection stays usable.
            OSError: a corrupt record (dropped).
        """
        if _hooks:
            _testhooks.reached("recv.begin")
        sock = self._sock
        budget = _budget
        if budget.taken >= budget.slack:  # room for the fds this record may carry (fdbudget.py)
            budget.make_room()
        # Nothing to flush before waiting: holds and releases go out within 50 ms on the
        # release timer (memory/release.py), blocked or not. A blocking read spins a little
        # first, then blocks in the kernel (_spin.py).
        if wait:
            if _spin_state.sent:  # this process wrote since its last wait: maybe for an answer
                data, anc, flags, _ = _spin_recvmsg(sock, _RECORD_MAX, _ANC_SPACE, _MSG_CMSG_CLOEXEC)
            else:
                data, anc, flags, _ = sock.recvmsg(_RECORD_MAX, _ANC_SPACE, _MSG_CMSG_CLOEXEC)
        else:
            try:
                data, anc, flags, _ = sock.recvmsg(
                    _RECORD_MAX, _ANC_SPACE, _MSG_CMSG_CLOEXEC | _MSG_DONTWAIT
                )
            except BlockingIOError:
                return None
        if anc:
            fds = _fdpass.fds_of(anc)
            budget.taken += len(fds)
        else:
            fds = []
        if _hooks:
            _testhooks.reached("recv.got")
        if not data:
            _fdpass.close_all(fds)
            raise EOFError
        if len(data) < _HEADER_SIZE or flags & _MSG_TRUNC:
            _fdpass.close_all(fds)
            raise OSError(errno.EBADMSG, f"corrupt tensormp record ({len(data)} bytes)")
        kind, ntok, _, nfds, length, slot = _unpack_header(data)
        if flags & _MSG_CTRUNC:
            _fdpass.close_all(fds)
            budget.slack = 0  # count again before the next record
            carried = ntok + (1 if kind & LARGE else 0) + (1 if kind & BAG else nfds)
            raise FdLimitError(errno.EMFILE, fdbudget.shortage(carried, len(fds)))
        if ntok:
            tokens = fds[:ntok]
            rest = fds[ntok:]
        else:
            tokens = []
            rest = fds
        if not kind:
            if len(rest) != nfds:
                _fdpass.close_all(fds)
                raise OSError(errno.EBADMSG, f"a record announced {nfds} fds but carries {len(rest)}")
            return Record(data[_HEADER_SIZE:], rest, tokens, slot)
        try:
            if kind & LARGE:
                if not rest:
                    raise OSError(errno.EBADMSG, "a large record carries no payload")
                payload = rest.pop(0)
                try:
                    body = _pread_all(payload, length)
                finally:
                    os.close(payload)
                if len(body) != length:
                    raise OSError(errno.EBADMSG, f"a payload of {length} bytes holds {len(body)}")
            else:
                body = data[_HEADER_SIZE:]
            if kind & BAG:  # its fds are installed from the bag now: room for them first
                budget.taken += nfds
                if budget.taken >= budget.slack:
                    budget.make_room()
            try:
                msg_fds = _fdpass.unpack(rest, nfds, nfds if kind & BAG == 0 else 0)
            except OSError as e:
                rest = []
                if e.errno == errno.EMFILE:
                    budget.slack = 0
                    raise FdLimitError(errno.EMFILE, fdbudget.shortage(nfds, None)) from None
                raise
        except BaseException:
            _fdpass.close_all(tokens)
            _fdpass.close_all(rest)
            raise
        if _hooks:
            _testhooks.reached("recv.payload")
        return Record(body, msg_fds, tokens, slot)

    # -- the stdlib hooks ---------------------------------------------------------------------
    def _send_bytes(self, buf: Any) -> None:
        self.write_record(buf, ())

    def _recv_bytes(self, maxsize: int | None = None) -> Any:
        record = self.read_record()
        assert record is not None
        _fdpass.close_all(record.fds)
        record.close_tokens()
        if maxsize is not None and len(record.data) > maxsize:
            raise OSError("bad message length")
        # Shares record.data (no copy; getvalue() returns it as is), positioned at the end as
        # the stdlib's buffer (recv_bytes_into reads tell()).
        buf = io.BytesIO(record.data)
        buf.seek(0, io.SEEK_END)
        return buf

    def by_value_room(self) -> int:
        """Bytes of arrays the next message may carry by value (``Message.take_by_value``): half
        of this socket's send buffer less what waits in it unread (``SIOCOUTQ``: the
        kernel's count for the socket, all writers' records together), 0 when it cannot tell."""
        try:
            room: int = self._room_max
            return room - _from_bytes(_ioctl(self._handle, _SIOCOUTQ, _INT_ZERO), _ORDER)
        except AttributeError:  # the first call: half the send buffer, once
            sock = self.__dict__.get("_sock")
            if sock is None:  # closed
                return 0
            self._room_max: int = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
            return self.by_value_room()
        except (OSError, TypeError):  # closed (TypeError: no handle any more)
            return 0

    # -- objects ------------------------------------------------------------------------------
    def send(self, obj: Any) -> None:
        """Send a picklable object; arrays go as shared-memory handles.

        Pickling happens here, in the caller: an object that cannot be pickled raises
        (``TypeError``/``pickle.PicklingError``) before anything is written.
        """
        if self._handle is None or not self._writable:  # the stdlib's checks, without 2 calls
            self._check_closed()
            self._check_writable()
        msg = reducers.dumps(obj, self.by_value_room)
        try:
            _flush_release_records()  # holds reach creators before our results do
            self.write_record(msg.data, msg.fds)
        except BaseException:
            msg.abandon()
            raise
        msg.sent()

    def try_send_message(self, msg: reducers.Message) -> bool:
        """Send ``msg`` only if the socket takes it now without blocking: True when sent, False
        when nothing was written because the socket is full (or, for a payload over
        ``INLINE_MAX``, every payload memfd of this end is still unread). Used by the Pool's
        callers to send a task without waking the manager thread.

        Raises:
            OSError: ``ETOOMANYREFS`` (too many fds in flight for this user: nothing was
                written; :meth:`send_message` waits for receivers), or the socket failed.
        """
        reducers.flush_release_records()  # holds reach creators before our results do
        if not self.write_record(msg.data, msg.fds, block=False):
            return False
        msg.sent()
        return True

    def send_message(self, msg: reducers.Message, slot: int = NO_SLOT) -> None:
        """Send an already pickled :class:`~tensormp.reducers.Message` (blocks while the
        socket is full); ``slot`` goes in the record's header (``Record.slot``: a queue's
        slot, the number of tasks a pool's batch carries)."""
        self._check_closed()
        self._check_writable()
        reducers.flush_release_records()  # holds reach creators before our results do
        self.write_record(msg.data, msg.fds, slot=slot)
        msg.sent()

    def recv(self) -> Any:
        """Receive an object sent with :meth:`send` (blocks). Raises ``EOFError`` at EOF."""
        if self._handle is None or not self._readable:
            self._check_closed()
            self._check_readable()
        record = self.read_record()
        assert record is not None
        if record.tokens:
            record.close_tokens()
        obj = _loads(record.data, record.fds)
        if _hooks:
            _testhooks.reached("recv.done")
        return obj

    @overload
    def recv_message(self) -> tuple[bytes, list[int]]: ...
    @overload
    def recv_message(self, wait: bool) -> tuple[bytes, list[int]] | None: ...

    def recv_message(self, wait: bool = True) -> tuple[bytes, list[int]] | None:
        """Receive the raw ``(pickle bytes, fds)`` of one message; pass them to ``loads``.
        With ``wait`` False: None at once when no message has arrived."""
        self._check_closed()
        self._check_readable()
        record = self.read_record(wait)
        if record is None:
            return None
        if record.tokens:
            record.close_tokens()
        return record.data, record.fds

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.fileno()}"
        mode = ("r" if self.readable else "") + ("w" if self.writable else "")
        return f"<tensormp.Connection {mode} {state}>"


def Pipe(duplex: bool = True) -> tuple[Connection, Connection]:
    """A pair of connected :class:`Connection` objects, like ``multiprocessing.Pipe``.

    Both ends are Unix ``SOCK_SEQPACKET`` sockets (even for ``duplex=False``, which the stdlib
    builds from ``os.pipe``) so that fds can travel with messages and every message is one
    atomic record. With ``duplex=False`` the first end only receives and the second only sends.
    A sending end asks for a send buffer of ``SNDBUF`` bytes (the kernel caps it at
    ``net.core.wmem_max``, 208 KiB by default; a limit, not memory taken): room for thousands of
    unread records of handles, of which small arrays sent by value may fill half
    (:meth:`Connection.by_value_room`).
    """
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for end in (a, b) if duplex else (b,):
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
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
