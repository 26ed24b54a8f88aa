"""The release channel: how other processes tell a segment's creator what they hold.

Protocol
--------
The creator of a segment (the only process that recycles its blocks) binds a Unix datagram
socket in the abstract namespace, ``\\0tensormp-<pid>-<16 random hex>``, the first time one of
its blocks leaves the process, and a daemon thread reads it. The address travels in every handle
(``Segment.owner_addr``); it is unguessable, and the server drops datagrams whose sender's uid
(``SO_PASSCRED``) is not its own.

A datagram holds records ``(op, segment id, block offset, count)``; the sender's pid comes
from the kernel (``SCM_CREDENTIALS``), never from the record:

* ``H`` hold: the sender holds ``count`` handles to the block (rebuilt, and not released yet).
* ``R`` release: the sender's last view of the block died; ``count`` of the handles it had
  rebuilt were announced with ``H``. Sent from the weakref callback of the receiver's block
  root, and for every held block when a tensormp process exits normally.
* ``D`` drop: as ``R``, for ``count`` handles the sender never announced with ``H`` (it let go of
  them before it told anyone it held them): the creator only lowers its count.
* ``A`` acquire: a process that is not the creator pickled a handle to the block (it forwards
  an array it received). Sent *blocking* before the message leaves, so the creator counts that
  handle before the forwarded receiver can ever release it (datagrams from one sender arrive in
  order, and the forward's receiver only releases after the forwarder's acquire was queued).
  It goes in one datagram with everything else the forwarder has for that creator, in order:
  the records queued before it, then ``H`` for the holds it has not announced yet (the block
  it forwards was usually just received), then the ``A``. A ping-pong thus costs the
  forwarder one datagram per round trip, and the creator's thread at most one wake-up.
  The acquire carries a *token* that the forwarded handle carries too (unique among the tokens
  a creator sees: each process steps a random odd 64-bit start by 2, so no ``getrandom`` per
  forward; a fork child starts afresh with its new allocator state): when the creator
  itself receives that handle, its main thread may get there before its release thread has
  read the acquire. It then consumes the handle only once the acquire with that token has
  been counted (an early arrival is remembered and cancels the acquire when it comes), so the
  count can never reach zero while the forwarder's view is out.

Holds are announced lazily: a rebuild only notes the block (``MemoryState.unannounced``); the
``H`` records go out when this process sends a message, exits, or at the latest
``_OUTBOX_AGE`` (50 ms) after the rebuild, sent by the *flush thread*: one long-lived daemon
thread per process, parked on a lock while nothing is queued and armed by the first record
queued (an attribute test per record), so no thread is started per flush. A handle dropped
before that costs one ``D`` record and no ``H`` at all. What a receiver SIGKILLed before
announcing loses is the same as for a record still queued: those blocks stay pinned in their
creator. The flush thread also ends the grace of recently received roots (``holds.py``).

``H``, ``R`` and ``D`` never block the caller: they are queued and batched (see ``post``); records
that find the creator's buffer full stay queued and are sent again, blocking for at most 2 s
when the process exits. A blocking send (an ``A``, the flush at exit) first tries without
blocking, and only waits (``poll`` then ``sendto``, up to 2 s) when the creator's buffer is
full; a batch of more than ``_MAX_RECORDS`` records goes as several datagrams, in order, so the
reader's fixed-size buffer never truncates one. A record that cannot be delivered at all leaves its block pinned in
the creator: memory held longer, never reused too early.

The creator counts, per block, handles it pickled plus acquires minus released counts; it
recycles a block when that count is zero and its own last view is dead. It also records which
live process holds how many (``H``), and its server thread checks about once a second that
those processes still live (pid plus start time, so a reused pid is not mistaken for the
holder): a SIGKILLed receiver cannot pin memory. What it cannot learn: a handle that is never
rebuilt (a message dropped unread, a receiver killed before ``get``) pins its block until the
creator exits. Bounded, visible in ``memory_stats()`` (``remote_held_bytes``), never unsafe.

The creator processes records strictly in arrival order (one reader of its socket at a time)
but not necessarily at once: its server thread, woken by a datagram, drains everything waiting,
then sleeps 1 ms so that the next records arrive as a batch (at most one wake-up per
millisecond). Delay is safe because of the order: an ``A`` always precedes, in the same socket,
every release of the handle it covers, so a count that has reached zero never has an unread
``A`` for that block behind it; unread records only postpone a recycling. Before a large
allocation, the allocating thread drains the socket itself, so a block released just before is
reused instead of a new segment being made. Measured (issue #25): the server thread reads a
ping-pong's acquire while the creator's main thread waits for the echo, so its work overlaps the
round trip; reading it in the main thread when the handle comes back made the round trip slower
(+15 us), and so did a wake-up per datagram without the 1 ms batching (+35 us).

SIGKILL of the creator: senders get ``ECONNREFUSED`` and stop caring; receivers keep valid
memory (the kernel frees a memfd only when the last fd and mapping are gone). SIGKILL of a
receiver: its releases never come; see above.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable

# A (pid, start time) pair names a process for good: pids are reused, start times are not.
from ..liveness import process_start_time

__all__ = [
    "ReleaseServer", "send_records", "pack", "post", "post_flush", "maybe_flush", "take_queued",
    "schedule_flush",
    "has_queued", "set_flusher", "flush", "process_start_time", "reset_after_fork",
    "close_clients",
]

_RECORD = struct.Struct("<c16sQIQ")  # op, segment id, block offset, count, acquire token
_UCRED = struct.Struct("iII")  # pid, uid, gid
_MAX_RECORDS = 256
_DATAGRAM = _RECORD.size * _MAX_RECORDS
_ANC = socket.CMSG_SPACE(_UCRED.size)
_BATCH_DELAY = 0.001  # seconds the server thread lets records accumulate after a batch
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)


# ``pack(op, segment id, block offset, count, token)`` (token 0 but for an acquire): one
# record's bytes. The struct's own method, not a wrapper: it runs several times per array.
pack = _RECORD.pack


class ReleaseServer:
    """The creator's end: a bound datagram socket and the thread that reads it.

    ``handler(pid, records)`` runs once per datagram with its records, a list of ``(op,
    seg_id, offset, count, token)`` in order (``pid``: the sender, from ``SO_PASSCRED``);
    ``sweep()`` runs about every ``sweep_interval`` seconds.
    """

    def __init__(
        self,
        handler: Callable[[int, list[tuple[bytes, bytes, int, int, int]]], None],
        sweep: Callable[[], None],
        sweep_interval: float = 1.0,
    ) -> None:
        self.address = f"\0tensormp-{os.getpid()}-{os.urandom(8).hex()}".encode()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind(self.address)
        self._interval = sweep_interval  # the socket stays blocking: drain() uses MSG_DONTWAIT
        self._handler = handler
        self._sweep = sweep
        self._read_lock = threading.Lock()  # one reader at a time keeps records in order
        self._uid = os.getuid()
        self._thread = threading.Thread(target=self._serve, name="tensormp release", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        interval = self._interval
        next_sweep = time.monotonic() + interval
        poller = select.poll()
        poller.register(self._sock.fileno(), select.POLLIN)
        while True:
            now = time.monotonic()
            if now >= next_sweep:  # also under steady traffic, not only when idle
                self._safely(self._sweep)
                next_sweep = now + interval
            try:
                ready = poller.poll(max(0.0, next_sweep - time.monotonic()) * 1000)
            except InterruptedError:
                continue
            if not ready:
                continue
            if ready[0][1] & (select.POLLNVAL | select.POLLERR):
                return  # closed (fork child, interpreter exit)
            with self._read_lock:
                if not self._drain_locked():
                    return
            # Let records pile up for a moment: one wake-up per batch instead of one per record
            # (a ping-pong sends two datagrams per round trip). Records only ever delay a
            # recycling, and a large allocation drains the socket first (drain()).
            time.sleep(_BATCH_DELAY)

    def drain(self) -> None:
        """Process every record waiting in the socket now, in this thread. Records are
        processed in arrival order whoever reads them (one reader at a time). The caller
        must not hold the allocator's lock (the handler takes it)."""
        with self._read_lock:
            self._drain_locked()

    def _drain_locked(self) -> bool:
        while True:
            try:
                data, anc, _flags, _addr = self._sock.recvmsg(_DATAGRAM, _ANC, _MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return True
            except OSError:
                return False
            self._process(data, anc)

    def _process(self, data: bytes, anc: list[tuple[int, int, bytes]]) -> None:
        pid = uid = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, uid, _gid = _UCRED.unpack(payload[: _UCRED.size])
        if uid != self._uid or pid is None:
            return  # not one of ours: ignore
        usable = len(data) - len(data) % _RECORD.size
        if usable:
            self._safely(self._handler, pid, list(_RECORD.iter_unpack(data[:usable])))

    @staticmethod
    def _safely(fn: Callable[..., None], *args: object) -> None:
        try:
            fn(*args)
        except Exception:  # pragma: no cover - a bug; keep serving
            import traceback

            traceback.print_exc()

    def detach_after_fork(self) -> None:
        """In a forked child: drop the inherited socket without touching the parent's thread."""
        try:
            self._sock.close()
        except OSError:
            pass


_clients: dict[bool, socket.socket] = {}  # blocking (with a timeout) -> socket
_BLOCKING_TIMEOUT = 2.0


def _client_socket(blocking: bool = False) -> socket.socket:
    sock = _clients.get(blocking)
    if sock is None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        if blocking:
            sock.settimeout(_BLOCKING_TIMEOUT)
        else:
            sock.setblocking(False)
        _clients[blocking] = sock
    return sock


def close_clients() -> None:
    """Close the sending sockets (at exit: left to the interpreter they would each raise a
    ``ResourceWarning``); a later send opens new ones."""
    for sock in _clients.values():
        sock.close()
    _clients.clear()


def _sendto(address: bytes, data: bytes, blocking: bool) -> bool | None:
    """True: sent; False: the creator is gone; None: its buffer is full (or timed out).

    A blocking send first tries the non-blocking socket: the usual case (room in the buffer)
    then costs one ``sendto``, without the ``poll`` that a socket with a timeout makes first."""
    for waiting in (False, True) if blocking else (False,):
        try:
            _client_socket(waiting).sendto(data, address)
            return True
        except (BlockingIOError, TimeoutError):
            continue
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EMFILE, errno.ENFILE):
                continue  # full, or we are out of fds for the client socket: try again later
            raise
    return None


def send_records(address: bytes, data: bytes, block: bool) -> bool:
    """Send records (``pack`` results, joined) to a creator now, in order, in datagrams of at
    most ``_MAX_RECORDS``; False when it is gone or did not take them all."""
    step = _RECORD.size * _MAX_RECORDS
    for start in range(0, len(data), step):
        if not _sendto(address, data[start : start + step], block):
            return False
    return True


# Holds and releases are batched per creator: one datagram (and one wake-up of the creator's
# thread) per batch instead of one or two per array. A batch goes out when it reaches
# _OUTBOX_MAX records, before this process sends a message, with an acquire, and at the latest
# _OUTBOX_AGE seconds after its first record (the flush thread, so also when the process is busy
# elsewhere or idle), and at normal exit. A release of a large block goes at once (its creator
# may be waiting to reuse it). Records that find a creator's buffer full stay queued, in order,
# and are tried again by the same triggers. What a receiver SIGKILLed within _OUTBOX_AGE of a
# receive loses: those holds, so those blocks stay pinned in their creator. Callers hold the
# allocator lock.
_OUTBOX_MAX = 64
_OUTBOX_AGE = 0.05
_outbox: dict[bytes, list[bytes]] = {}
_outbox_count = 0
_outbox_since = 0.0
_flusher: Callable[[], None] | None = None  # takes the allocator lock and flushes
_ticker: Callable[[], None] | None = None  # what the flush thread runs (flushes too)


class _FlushThread:
    """One long-lived daemon thread that runs the flusher ``_OUTBOX_AGE`` after it is armed.

    It sleeps on ``gate`` (a lock held while unarmed: waiting costs no wake-up) and runs at most
    once per ``_OUTBOX_AGE``, however many records were queued meanwhile. Arming is one
    attribute test when it is armed already (the common case: every array received arms it).
    Armed under the allocator lock; the thread clears ``armed`` before it flushes, so a record
    queued during a flush arms it again. A fork child starts its own (``reset_after_fork``)."""

    __slots__ = ("armed", "gate", "thread")

    def __init__(self) -> None:
        self.armed = False
        self.gate = threading.Lock()
        self.gate.acquire()
        self.thread: threading.Thread | None = None

    def arm(self) -> None:
        if self.armed:
            return
        self.armed = True
        if self.thread is None:
            if sys.is_finalizing():
                return  # a thread started at shutdown hangs it (the exit flush sends all)
            self.thread = threading.Thread(target=self._run, name="tensormp flush", daemon=True)
            self.thread.start()
        try:
            self.gate.release()
        except RuntimeError:  # pragma: no cover - released already: it runs soon all the same
            pass

    def _run(self) -> None:
        gate = self.gate
        while True:
            gate.acquire()
            time.sleep(_OUTBOX_AGE)
            self.armed = False
            tick = _ticker
            if tick is not None:
                try:
                    tick()
                except Exception:  # pragma: no cover - a bug; keep the thread
                    import traceback

                    traceback.print_exc()


_flush_thread = _FlushThread()


def set_flusher(flush: Callable[[], None], tick: Callable[[], None]) -> None:
    """Register ``flush`` (sends what is queued, see :func:`flush`) and ``tick``, which the
    flush thread runs (it flushes too); both take the caller's lock."""
    global _flusher, _ticker
    _flusher = flush
    _ticker = tick


def flush() -> None:
    """Send queued hold/release records (and what the strategies queued) now, through the
    registered flusher; nothing before the allocator registered one (nothing is queued)."""
    flusher = _flusher
    if flusher is not None:
        flusher()


def post(address: bytes, record: bytes, urgent: bool = False) -> None:
    """Queue a hold or release record for the creator at ``address`` (see above)."""
    global _outbox_count, _outbox_since
    if not _outbox_count:
        _outbox_since = time.monotonic()
    _outbox.setdefault(address, []).append(record)
    _outbox_count += 1
    if urgent or _outbox_count >= _OUTBOX_MAX:
        post_flush()
    elif not _flush_thread.armed:
        _flush_thread.arm()  # the batch goes out at the latest _OUTBOX_AGE from now


def schedule_flush() -> None:
    """Make sure the flusher runs within ``_OUTBOX_AGE`` seconds (unannounced holds wait)."""
    if not _flush_thread.armed:
        _flush_thread.arm()


def take_queued(address: bytes) -> bytes:
    """Remove and return the records queued for ``address`` (to send them with another)."""
    global _outbox_count
    records = _outbox.pop(address, [])
    _outbox_count -= len(records)
    return b"".join(records)


def is_pending(address: bytes) -> bool:
    """Whether records for ``address`` are still queued (its buffer was full)."""
    return bool(_outbox.get(address))


def has_queued() -> bool:
    return _outbox_count > 0


def maybe_flush() -> None:
    if _outbox_count and time.monotonic() - _outbox_since > _OUTBOX_AGE:
        post_flush()


def post_flush(block: bool = False) -> None:
    """Send every queued record now (``block``: wait up to 2 s for a full creator)."""
    global _outbox_count, _outbox_since
    for address in list(_outbox):
        records = _outbox.pop(address)
        _outbox_count -= len(records)
        for start in range(0, len(records), _MAX_RECORDS):
            sent = _sendto(address, b"".join(records[start : start + _MAX_RECORDS]), block)
            if sent is None:  # its buffer is full: keep the rest, in order, for later
                rest = records[start:]
                _outbox[address] = rest
                _outbox_count += len(rest)
                break
            # False: the creator is gone and nothing of it can be recycled: drop the records.
    _outbox_since = time.monotonic()
    if _outbox_count:  # some creator's buffer was full: try again later
        _flush_thread.arm()


def reset_after_fork() -> None:
    global _outbox_count, _flush_thread
    _outbox.clear()
    _outbox_count = 0
    _flush_thread = _FlushThread()  # the parent's flush thread does not exist here
    for sock in _clients.values():
        try:
            sock.close()
        except OSError:
            pass
    _clients.clear()
