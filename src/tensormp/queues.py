"""``Queue``, ``JoinableQueue`` and ``SimpleQueue`` that move arrays as shared-memory handles
and that no process's death can wedge.

Same API and semantics as the stdlib's (``multiprocessing.queues``), with these differences:

* ``put()`` pickles in the calling thread. An object that cannot be pickled or shared raises
  there, and nothing is half-sent; the stdlib and torch pickle in the feeder thread, print the
  error from there and leave the consumer blocked forever. It also means the queue captures
  the object's state at ``put()`` time.
* The pipe underneath is a Unix ``SOCK_SEQPACKET`` socket pair (``connection.py``): each
  message is one record, carrying the fds of shared-memory segments, and a consumer can
  rebuild arrays whose producer has exited.
* No lock that a dead process can keep. The stdlib guards the pipe with a read lock and a
  write lock (POSIX semaphores), and counts slots and unfinished tasks in semaphores: a
  process killed while holding one of them, or half-way through writing a message, wedges the
  queue for every other process. Here the kernel keeps records whole (concurrent writers and
  readers need no lock), counts a bounded queue's items (the records in the socket; producers
  write holding an OFD lock, which the kernel drops when its holder dies), and holds tasks as
  tokens that it gives back when their holder dies (``_ledger.py``).
* ``put_many(items)``/``get_many(max_messages_to_get=...)`` (faster-fifo's names): the items of
  one ``put_many`` are one record (one pickle of a private list type, ``_Batch``, one
  ``sendmsg`` with the fds of all their arrays): a batch costs one item's syscalls. A bounded
  queue counts it as ``k`` slots (a batch larger than ``maxsize`` is refused), a
  ``JoinableQueue`` as ``k`` tasks under one token. The process that takes the record takes
  all ``k`` items; those its ``get``/``get_many`` did not return yet wait in ``_pending``, are
  returned first by its next ``get``/``get_many``, and are not in ``qsize()`` (a fork child
  starts without them).

Delivery rule (what survivors see when any process is SIGKILLed at any instant)
---------------------------------------------------------------------------------
Every message is delivered whole, at most once, to one consumer, in each producer's order (a
``put_many`` batch is one message). The only messages lost are:

* a producer's message not yet written to the socket: the one its ``put()`` was writing, and
  those its ``put()`` left to its feeder thread because the socket was full (the stdlib's
  behaviour; ``put()`` writes the message itself whenever the socket has room and nothing of
  this process is waiting, which is the usual case);
* a consumer's message already taken from the socket by the ``get()`` it was in, and the
  items of batches it took that its ``get()``/``get_many()`` had not returned yet.

A bounded queue's slot is free once its record is taken from the socket (a consumer holds
none); a producer killed while writing has its record counted if and only if it was written;
the slots of messages a dead producer left to its feeder come back within a blocked
``put()``'s back-off (250 ms at most) and at ``qsize()``. A task of a ``JoinableQueue`` held by
a process that died is given back; an item whose taker died before ``task_done()`` counts as
done: ``join()`` never waits for the dead. ``qsize()`` of a bounded queue is exact (records in
the socket, by their numbers, plus messages left to feeders of live producers); of an
unbounded queue it is approximate (as the stdlib's): it counts what was put, so a producer
killed with items left to its feeder leaves it too high by those items, and a process killed in
the middle of a ``get()`` by one.

How put() writes
----------------
``put()`` writes the record itself, without blocking, when the feeder's buffer is empty and
the socket has room (a large pickle goes into a memfd first, so a record is always small):
one thread hop and one wake-up less per item. It first writes what the feeder's buffer still
holds, so order is kept; whatever the socket does not take at once goes to the feeder, as in
the stdlib, and ``put()`` never waits for a consumer. The feeder takes a message from its
buffer and writes it while holding the same thread lock (``_direct``) that ``put()`` needs,
and waits for room with ``poll()`` *without* holding it. Measured: a producer whose writes
were all left to the feeder spent about twice the CPU per 4 KiB array (two threads taking
turns on the GIL for every message) as one that writes itself.

A message in the feeder's buffer keeps the memory it refers to (and its tokens) alive until
the feeder has written it; from then on the kernel holds the fds in flight.

A bounded queue's ``put()`` takes the ledger's write lock ``W`` first (room check, write, count;
``_ledger.py``), then ``_direct``; so does the feeder: one order, no deadlock. Holding ``W``
keeps the feeder's buffer as it is, so a bounded ``put()`` that finds it empty writes through
``_write`` at once, without an ``_Outgoing``.

Every queue's socket asks for a 4 MiB send buffer (``connection.SNDBUF``; the kernel caps it at
``net.core.wmem_max``), so that ``maxsize`` small records fit and ``put()`` rarely leaves one to
the feeder; small arrays sent by value (``reducers/numpy.py``) may fill half of it, and the
messages after that carry them as handles (about 1 KiB of buffer each, against 8 KiB by value),
so that a producer can still put thousands and exit before anyone reads.
"""

from __future__ import annotations

import collections
import errno
import operator
import os
import select
import socket
import sys
import threading
import time
import types
import weakref
from multiprocessing import context as _mpctx
from multiprocessing import util as _mputil
from queue import Empty, Full
from typing import Any

from . import _spin, _testhooks, reducers
from ._ledger import NO_SLOT, Ledger, Token
from .connection import Connection, Pipe, Record
from .errors import FdLimitError

__all__ = ["Queue", "JoinableQueue", "SimpleQueue"]

_SEM_VALUE_MAX = 2**31 - 1
# put() waits this long (seconds) for _direct while the feeder holds it for a non-blocking
# write, instead of leaving its message to the feeder at once: waiting hands the GIL to the
# feeder, which then lets go of _direct, and put() writes itself again. Giving up at once made
# the two threads convoy (the feeder holds _direct while it waits for the GIL after each
# write): measured, the slowest round of 20,000 kept 4 KiB arrays went from 26 to 21 us/item.
# Never waited for while the feeder is in a blocking write.
_DIRECT_WAIT = 0.001
_EPOLLEXCLUSIVE = getattr(select, "EPOLLEXCLUSIVE", 1 << 28)
# A writer whose every payload memfd is unread (connection.py) retries after this back-off
# (seconds, doubling), holding no lock.
_IDLE_FIRST = 0.001
_IDLE_MAX = 0.05
_sentinel = object()
_hooks = _testhooks.armed
_M32 = 0xFFFFFFFF  # record numbers wrap at 2**32 (_ledger.py)
# An unbounded queue's record number: a producer tag (pid % _TAGS, never all ones: not
# NO_SLOT) in the high bits, that producer's own count of its direct writes in the low ones.
_SEQ_BITS = 20
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_TAGS = (1 << (32 - _SEQ_BITS)) - 1
_TAG_MASK = _M32 ^ _SEQ_MASK
_may_yield = _spin.may_yield
_after_yield = _spin.after_yield
_sched_yield = _spin.sched_yield


class _Outgoing:
    """A message on its way: the pickle, its task token, the items it holds (``put_many``:
    ``count``), and for a bounded queue the ledger that counts it (written holding the ledger's
    ``W``; ``reserved`` while in the feeder's buffer)."""

    __slots__ = ("msg", "tokens", "ledger", "reserved", "count")

    def __init__(
        self, msg: reducers.Message, tokens: list[Token], ledger: Ledger | None, count: int = 1
    ) -> None:
        self.msg = msg
        self.tokens = tokens
        self.ledger = ledger
        self.reserved = False
        self.count = count

    def write(self, writer: Connection, block: bool) -> bool:
        """Write it (see :func:`_write`), and give back its reservation once written."""
        if not _write(writer, self.msg, self.tokens, self.ledger, self.count, block):
            return False
        if self.reserved and self.ledger is not None:
            self.reserved = False
            self.ledger.reserve(-self.count)
        return True

    def abandon(self, sock: Any = None) -> None:
        """It will not be sent: give back its tokens, its slots and what pickling reserved."""
        for t in self.tokens:
            t.close()
        self.msg.abandon()
        if self.reserved and self.ledger is not None and sock is not None:
            self.reserved = False
            self.ledger.enter_reserved(sock)
            try:
                self.ledger.reserve(-self.count)
            finally:
                self.ledger.leave()


def _write(
    writer: Connection, msg: reducers.Message, tokens: list[Token], ledger: Ledger | None,
    count: int, block: bool,
) -> bool:
    """Write a message of ``count`` items as one record (``Connection.write_record``; through
    ``ledger`` for a bounded queue, holding its ``W``). Once written, this process's fds of the
    tokens are closed (the kernel holds them in flight with the record). True when written."""
    reducers.flush_release_records()  # holds reach creators before our results do
    fds = [t.fd for t in tokens] if tokens else ()
    if ledger is not None:
        if not ledger.write(writer, msg.data, msg.fds, fds, block, count):
            return False
    elif not writer.write_record(msg.data, msg.fds, fds, NO_SLOT, block):
        return False
    for t in tokens:
        t.close()
    msg.sent()
    return True


def _send_blocking(writer: Connection, out: _Outgoing, blocked: list[bool]) -> None:
    """The feeder's blocking write; ``blocked[0]`` tells put() not to wait for it meanwhile."""
    blocked[0] = True
    try:
        out.write(writer, True)
    finally:
        blocked[0] = False


class _Batch(list):  # type: ignore[type-arg]
    """The items of one ``put_many`` record, as pickled; ``get``/``get_many`` unpack it, so no
    caller ever sees one."""

    __slots__ = ()


def _batch_of(items: Any, queue: object) -> list[Any] | tuple[Any, ...]:
    """``items`` of a ``put_many``: a list or a tuple (faster-fifo's rule; a generator or a
    string would be consumed or split by surprise)."""
    if not isinstance(items, (list, tuple)):
        raise TypeError(
            f"{queue!r}.put_many() takes a list or tuple of items, not "
            f"{type(items).__name__}; pass list(items)"
        )
    return items


def _max_items(max_messages_to_get: int) -> int:
    if type(max_messages_to_get) is int and max_messages_to_get >= 1:
        return max_messages_to_get
    if isinstance(max_messages_to_get, bool) or not hasattr(max_messages_to_get, "__index__"):
        raise TypeError(
            "max_messages_to_get must be an int >= 1, got "
            f"{type(max_messages_to_get).__name__} {max_messages_to_get!r}"
        )
    n = operator.index(max_messages_to_get)  # numpy integers too
    if n < 1:
        raise ValueError(f"max_messages_to_get must be an int >= 1, got {max_messages_to_get!r}")
    return n


_MANY = 1_000_000_000  # get_many()'s default max_messages_to_get (faster-fifo's)


class _Receiving:
    """What ``Queue`` and ``SimpleQueue`` share to get items: records that hold one item or a
    ``put_many`` batch, and ``_pending``, the items of a batch this process took and has not
    returned yet (they are returned first, in order; a fork child starts without them)."""

    _pending: collections.deque[Any]
    # A Queue's last record showed other consumers (Queue._load): a blocking get may give
    # the CPU away once before it sleeps (_spin.py). Never for a SimpleQueue.
    _shared = False

    def _read(self, wait: bool) -> Record | None:
        raise NotImplementedError

    def _load(self, record: Record) -> Any:
        raise NotImplementedError

    def _wait_readable(self, timeout: float) -> bool:
        raise NotImplementedError

    def _record(self, block: bool, timeout: float | None) -> Record:
        """The next record, waiting as ``get(block, timeout)`` does.

        Raises:
            queue.Empty: none arrived within ``timeout`` seconds (or at once).
        """
        if self._shared and block and (timeout is None or timeout > 0) and _may_yield():
            # A consumer among several: a record already there, else yield once, look again.
            record = self._read(False)
            if record is None:
                _sched_yield()
                record = self._read(False)
                _after_yield(record is not None)
            if record is not None:
                return record
        if block and timeout is None:
            record = self._read(True)
        else:
            deadline = time.monotonic() + (timeout or 0.0) if block else 0.0
            while True:
                record = self._read(False)  # no poll when one is waiting
                if record is not None:
                    break
                if not block:
                    raise Empty
                left = deadline - time.monotonic()
                if left <= 0 or not self._wait_readable(left):
                    raise Empty
        assert record is not None
        return record

    def _first(self, batch: _Batch) -> Any:
        """The first item of a batch; the others wait in ``_pending``."""
        self._pending.extend(batch[1:])
        return batch[0]

    def get_many(
        self, block: bool = True, timeout: float | None = None,
        max_messages_to_get: int = _MANY,
    ) -> list[Any]:
        """Remove and return up to ``max_messages_to_get`` items, in order: wait (as
        :meth:`get`) until at least one is there, then take what is already there without
        waiting. faster-fifo's name and arguments (its default ``timeout`` is 10 s; here, as
        for ``get``, None waits forever). The items of one ``put_many`` travel as one record:
        one process takes them all, and those beyond ``max_messages_to_get`` are returned by
        this process's next ``get``/``get_many``.

        Raises:
            queue.Empty: nothing arrived within ``timeout`` seconds (or at once).
            ValueError: the queue is closed, or ``max_messages_to_get < 1``.
            TypeError: ``max_messages_to_get`` is not an integer (numpy integers are).
            FdLimitError: this process is out of fds (that record's items were dropped; the
                items taken before it are returned by the next ``get``/``get_many``).
        """
        self._check_open()
        room = _max_items(max_messages_to_get)
        out: list[Any] = []
        pending = self._pending
        while pending and len(out) < room:
            try:
                out.append(pending.popleft())
            except IndexError:  # another thread took it
                break
        try:
            if not out:
                self._add(out, self._load(self._record(block, timeout)), room)
            while len(out) < room:
                record = self._read(False)
                if record is None:
                    break
                self._add(out, self._load(record), room)
        except BaseException:
            if out:  # nothing lost: returned first by the next get
                pending.extendleft(reversed(out))
            raise
        return out

    def _add(self, out: list[Any], obj: Any, room: int) -> None:
        if type(obj) is not _Batch:
            out.append(obj)
            return
        take = room - len(out)
        if take >= len(obj):
            out.extend(obj)
        else:
            out.extend(obj[:take])
            self._pending.extend(obj[take:])

    def get_many_nowait(self, max_messages_to_get: int = _MANY) -> list[Any]:
        """``get_many(block=False, ...)`` (faster-fifo's name)."""
        return self.get_many(False, None, max_messages_to_get)

    def _check_open(self) -> None:
        pass


class Queue(_Receiving):
    """A process-shared FIFO queue; see :class:`multiprocessing.Queue`.

    No process's death can wedge it: see the module notes for the delivery rule.

    Args:
        maxsize: maximum number of items (``<= 0``: unbounded).
        ctx: the tensormp context (kept for the stdlib's signature; no lock is needed).

    Raises (from ``put``):
        queue.Full: no room within ``timeout`` seconds (or at once with ``block=False``).
        ValueError: the queue is closed.
        TypeError, pickle.PicklingError: ``obj`` cannot be pickled (raised in the caller).
    """

    _joinable = False
    _notempty: threading.Condition

    def __init__(self, maxsize: int = 0, *, ctx: Any) -> None:
        if maxsize <= 0 or maxsize >= _SEM_VALUE_MAX:
            maxsize = 0
        self._maxsize = maxsize
        self._reader, self._writer = Pipe(duplex=False)
        self._ledger = Ledger(maxsize, self._joinable)
        self._opid = os.getpid()
        self._ignore_epipe = False
        self._reset()
        _forked.add(self)

    def __getstate__(self) -> tuple[Any, ...]:
        _mpctx.assert_spawning(self)
        return (self._ignore_epipe, self._maxsize, self._reader, self._writer, self._ledger, self._opid)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self._ignore_epipe, self._maxsize, self._reader, self._writer, self._ledger, self._opid) = state
        self._reset()
        _forked.add(self)

    def _after_fork(self) -> None:
        self._reset(after_fork=True)

    def _reset(self, after_fork: bool = False) -> None:
        if after_fork:
            self._notempty._at_fork_reinit()  # type: ignore[attr-defined]
        else:
            self._notempty = threading.Condition(threading.Lock())
        self._buffer: collections.deque[Any] = collections.deque()
        self._pending = collections.deque()  # see _Receiving (the parent's stay the parent's)
        self._direct = threading.Lock()  # held while writing a message (see the module notes)
        self._blocked = [False]  # [True] while the feeder is in a blocking write
        self._thread: threading.Thread | None = None
        self._jointhread: Any = None
        self._joincancelled = False
        self._closed = False
        self._close: Any = None
        self._poll = self._reader.poll
        self._epoll: select.epoll | None = None  # get(timeout=...)'s waits: _wait_readable
        self._plain = not self._maxsize and not self._joinable  # unbounded, no task tokens
        self._shared = False  # see _Receiving
        # Other consumers show in the numbers of the records this process takes (_load): a
        # bounded queue's records carry the ledger's numbers; an unbounded queue's producers
        # number the records they write themselves (_tag: from the pid; _stamp: the last one).
        self._expect = -1  # bounded: the number of the next record (-1: none taken yet)
        self._expects: dict[int, int] = {}  # unbounded: each producer tag's next record
        self._next = -1  # unbounded: the next record of the last one's producer
        self._tag = (os.getpid() % _TAGS) << _SEQ_BITS
        self._stamp = 0

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` on the queue; arrays travel as shared-memory handles."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        msg = reducers.dumps(obj, self._writer.by_value_room)  # errors raise here, in the caller
        if _hooks:
            _testhooks.reached("put.begin")
        if not self._plain:
            self._put(msg, 1, block, timeout)
            return
        # An unbounded Queue: count it, then write it now if nothing of ours is waiting.
        self._ledger.count(0)
        direct = self._direct
        if self._buffer or not direct.acquire(False):
            self._enqueue(_Outgoing(msg, [], None))
            return
        try:
            if not self._buffer:
                reducers.flush_release_records()  # holds reach creators before results do
                stamp = (self._stamp + 1) & _SEQ_MASK  # this producer's next (see _load)
                if self._writer.write_record(msg.data, msg.fds, (), self._tag | stamp, False):
                    self._stamp = stamp
                    msg.sent()
                    return
        except Exception:
            pass  # the feeder meets it again and reports it as the stdlib does
        finally:
            direct.release()
        self._to_feeder(_Outgoing(msg, [], None))

    def put_many(
        self, items: list[Any] | tuple[Any, ...], block: bool = True, timeout: float | None = None
    ) -> None:
        """Put the items of ``items`` (a list or tuple) as one record: one pickle, one
        ``sendmsg`` with the fds of all their arrays, all or nothing. faster-fifo's name and
        arguments (its default ``timeout`` is 10 s; here, as for ``put``, None waits forever).

        The items arrive in order, together, at one consumer process (``get`` returns them one
        by one). A bounded queue counts ``k`` items as ``k`` slots and waits until all ``k``
        are free; a ``JoinableQueue`` counts ``k`` unfinished tasks. An empty batch puts
        nothing.

        Raises:
            queue.Full: no room for all ``k`` items within ``timeout`` seconds (or at once
                with ``block=False``); nothing was put.
            ValueError: the queue is closed, or ``k`` exceeds a bounded queue's ``maxsize``
                (such a batch could never fit: split it).
            TypeError: ``items`` is not a list or tuple.
            TypeError, pickle.PicklingError: an item cannot be pickled (raised here, in the
                caller; nothing was put).
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        k = len(_batch_of(items, self))
        if not k:
            return
        if self._maxsize and k > self._maxsize:
            raise ValueError(
                f"put_many() of {k} items into {self!r} of maxsize {self._maxsize}: a batch "
                f"takes one slot per item and can never fit; split it into batches of at most "
                f"{self._maxsize}"
            )
        msg = reducers.dumps(  # errors raise here
            items[0] if k == 1 else _Batch(items), self._writer.by_value_room
        )
        if _hooks:
            _testhooks.reached("put.begin")
        if self._plain:
            self._ledger.count(0, k)
            self._enqueue(_Outgoing(msg, [], None, k))
        else:
            self._put(msg, k, block, timeout)

    def put_many_nowait(self, items: list[Any] | tuple[Any, ...]) -> None:
        """``put_many(items, block=False)`` (faster-fifo's name)."""
        self.put_many(items, False)

    def _put(self, msg: reducers.Message, k: int, block: bool, timeout: float | None) -> None:
        """Put a record of ``k`` items on a bounded or joinable queue."""
        ledger = self._ledger
        tokens: list[Token] = []
        if self._joinable:
            try:
                task = ledger.take_task()  # a use of our task writer, for the record's k items
            except BaseException:
                msg.abandon()
                raise
            if not self._maxsize:  # unbounded: the record and its writer's fd, as put() does
                self._put_task(msg, k, task)
                return
            tokens.append(ledger.token(task))
        try:
            if not ledger.enter(self._reader._sock, block, timeout, k):
                raise Full
        except BaseException:
            _Outgoing(msg, tokens, None).abandon()
            raise
        out = None
        try:  # holding the ledger's W: write now, or count it reserved and leave it to the feeder
            if _hooks:
                _testhooks.reached("put.tokens")
            direct = self._direct
            if not self._buffer and direct.acquire(False):
                try:  # nothing buffered (W keeps it so): what _write_now does, in fewer calls
                    if _write(self._writer, msg, tokens, ledger, k, False):
                        return
                except Exception:
                    pass  # the feeder meets it again and reports it as the stdlib does
                finally:
                    direct.release()
            out = _Outgoing(msg, tokens, ledger, k)
            ledger.reserve(k)
            out.reserved = True
            with self._notempty:
                if self._thread is None:
                    self._start_thread()
                self._buffer.append(out)
                self._notempty.notify()
        except BaseException:
            if out is None:
                out = _Outgoing(msg, tokens, None, k)
            elif out.reserved:
                out.reserved = False
                ledger.reserve(-k)
            out.abandon()
            raise
        finally:
            ledger.leave()
        if _hooks:
            _testhooks.reached("put.queued")

    def _put_task(self, msg: reducers.Message, k: int, task: int) -> None:
        """Put a record of ``k`` items on an unbounded ``JoinableQueue``, with the fd ``task``
        of this process's task writer (a use of it, which this ends or hands on)."""
        ledger = self._ledger
        ledger.count(0, k)
        if _hooks:
            _testhooks.reached("put.tokens")
        direct = self._direct
        if not self._buffer and direct.acquire(False):
            written = False
            stamp = (self._stamp + 1) & _SEQ_MASK  # this producer's next (see _load)
            try:
                reducers.flush_release_records()  # holds reach creators before results do
                written = self._writer.write_record(
                    msg.data, msg.fds, (task,), self._tag | stamp, False
                )
            except Exception:
                pass  # nothing was written: the feeder meets it again and reports it
            except BaseException:  # (KeyboardInterrupt): written or not, our use ends here
                ledger.drop_task()
                raise
            finally:
                direct.release()
            if written:
                self._stamp = stamp
                ledger.drop_task()  # the record in flight holds its own reference
                msg.sent()
                return
        self._enqueue(_Outgoing(msg, [ledger.token(task)], None, k))

    def _enqueue(self, out: _Outgoing) -> None:
        if self._direct.acquire(False) or (
            not self._blocked[0] and self._direct.acquire(True, _DIRECT_WAIT)
        ):
            try:
                if self._write_now(out):
                    return
            finally:
                self._direct.release()
        self._to_feeder(out)

    def _to_feeder(self, out: _Outgoing) -> None:
        with self._notempty:
            if self._thread is None:
                self._start_thread()
            self._buffer.append(out)
            self._notempty.notify()
        if _hooks:
            _testhooks.reached("put.queued")

    def _write_now(self, out: _Outgoing) -> bool:
        """Write what the feeder's buffer holds, then ``out``, as far as the socket takes them
        without blocking (holding ``_direct``). True when ``out`` was written; False leaves it
        (and what is still buffered) to the feeder."""
        buffer = self._buffer
        writer = self._writer
        try:
            while buffer:
                head = buffer[0]
                if head is _sentinel or not head.write(writer, False):
                    return False
                buffer.popleft()
            return out.write(writer, False)
        except Exception:
            return False  # the feeder meets it again and reports it as the stdlib does

    def _read(self, wait: bool) -> Record | None:
        """One record; counts it (unbounded) or wakes a producer waiting for a slot."""
        ledger = self._ledger
        try:
            record = self._reader.read_record(wait)
        except (FdLimitError, OSError):  # dropped whole: its tokens are closed already
            if not self._maxsize:
                ledger.count(1)
            elif ledger.waiters():
                ledger.ring()
            raise
        if record is None:
            return None
        if not self._maxsize:
            ledger.count(1)
        elif ledger.waiters():
            ledger.ring()
        return record

    def _load(self, record: Record) -> Any:
        """The record's object (a :class:`_Batch` for a ``put_many``); keeps its task token."""
        try:
            obj = reducers.loads(record.data, record.fds)
        except BaseException:
            record.close_tokens()
            raise
        if _hooks:
            _testhooks.reached("recv.loaded")
        n = len(obj) if type(obj) is _Batch else 1
        slot = record.slot
        if slot == self._next and n == 1:  # unbounded: the next of the last one's producer
            self._next = slot + 1  # (at a count's wrap, once in 2**20: one false "others")
            self._shared = False
        elif self._maxsize:  # a record number that does not follow ours: others take too
            expect = self._expect
            self._shared = slot != expect and expect >= 0
            self._expect = (slot + n) & _M32
        else:
            if n > 1:
                self._ledger.count(1, n - 1)  # _read counted one
            if slot != NO_SLOT:  # numbered by its producer (the feeder's are not)
                self._numbered(slot)
        if record.tokens:
            self._taken(record, n)
        if _hooks:
            _testhooks.reached("recv.done")
        return obj

    def _numbered(self, slot: int) -> None:
        """An unbounded queue's record ``slot`` (producer tag | its count) that is not the
        next of the last one's producer: others take too if that producer's count skipped."""
        expects, last = self._expects, self._next
        if last >= 0:  # where the run of the last one's producer got to
            expects[last & _TAG_MASK] = last
        tag = slot & _TAG_MASK
        expect = expects.get(tag, -1)
        self._shared = slot != expect and expect >= 0
        self._next = tag | ((slot + 1) & _SEQ_MASK)

    def _taken(self, record: Record, n: int) -> None:
        record.close_tokens()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return an item; see :meth:`multiprocessing.Queue.get`.

        Raises:
            queue.Empty: nothing arrived within ``timeout`` seconds (or at once).
            ValueError: the queue is closed.
            FdLimitError: this process is out of fds (that item was dropped).
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if self._pending:
            try:
                return self._pending.popleft()
            except IndexError:  # another thread took it
                pass
        obj = self._load(self._record(block, timeout))
        return self._first(obj) if type(obj) is _Batch else obj

    def _wait_readable(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a record, as one of the waiters the kernel wakes
        one at a time (``EPOLLEXCLUSIVE``): with several consumers in ``get(timeout=...)``, a
        plain ``poll()`` woke them all for every record, and all but one found nothing."""
        ep = self._epoll
        if ep is None:  # one per process (_reset forgets it in a fork child)
            ep = self._epoll = select.epoll()
            ep.register(self._reader.fileno(), select.EPOLLIN | _EPOLLEXCLUSIVE)
        return bool(ep.poll(max(timeout, 0.001), 1))

    def qsize(self) -> int:
        """Items put and not yet got: exact for a bounded queue (it counts the live slots),
        approximate for an unbounded one (see the module notes)."""
        if self._maxsize:
            return self._ledger.slots_taken(self._reader._sock)
        return self._ledger.size()

    def empty(self) -> bool:
        """True when a ``get`` now would find nothing: no record in the socket and no item of
        a batch this process took (``_pending``; those are not in ``qsize()``)."""
        return not self._pending and not self._poll()

    def full(self) -> bool:
        return bool(self._maxsize) and self.qsize() >= self._maxsize

    def get_nowait(self) -> Any:
        return self.get(False)

    def put_nowait(self, obj: Any) -> None:
        return self.put(obj, False)

    def close(self) -> None:
        """No more ``put`` from this process; the feeder flushes the buffer and stops."""
        self._closed = True
        close = self._close
        if close:
            self._close = None
            close()

    def join_thread(self) -> None:
        """Wait for the feeder thread (after :meth:`close`), as the stdlib's."""
        if not self._closed:
            raise ValueError(f"Queue {self!r} not closed")
        if self._jointhread:
            self._jointhread()

    def cancel_join_thread(self) -> None:
        self._joincancelled = True
        try:
            self._jointhread.cancel()
        except AttributeError:
            pass

    def _start_thread(self) -> None:
        self._thread = threading.Thread(
            target=Queue._feed,
            args=(
                self._buffer, self._notempty, self._writer, self._reader.close,
                self._writer.close, self._ignore_epipe, self._on_queue_feeder_error,
                self._direct, self._blocked, self._ledger if self._maxsize else None,
                self._reader._sock,
            ),
            name="tensormp QueueFeederThread",
            daemon=True,
        )
        try:
            self._thread.start()
        except BaseException:
            self._thread = None
            raise
        if not self._joincancelled:
            self._jointhread = _mputil.Finalize(
                self._thread, Queue._finalize_join, [weakref.ref(self._thread)], exitpriority=-5
            )
        self._close = _mputil.Finalize(
            self, Queue._finalize_close, [self._buffer, self._notempty], exitpriority=10
        )

    @staticmethod
    def _finalize_join(twr: Any) -> None:
        thread = twr()
        if thread is not None:
            thread.join()

    @staticmethod
    def _finalize_close(buffer: collections.deque[Any], notempty: threading.Condition) -> None:
        with notempty:
            buffer.append(_sentinel)
            notempty.notify()

    @staticmethod
    def _feed(
        buffer: collections.deque[Any], notempty: threading.Condition, writer: Connection,
        reader_close: Any, writer_close: Any, ignore_epipe: bool, onerror: Any,
        direct: threading.Lock, blocked: list[bool], ledger: Ledger | None, sock: socket.socket,
    ) -> None:
        room = select.poll()
        room.register(writer.fileno(), select.POLLOUT)
        idle = _IDLE_FIRST
        while True:
            out: Any = None
            try:
                with notempty:
                    if not buffer:
                        notempty.wait()
                while buffer:
                    if ledger is not None:  # a bounded queue's records are written holding W
                        ledger.enter_reserved(sock)
                    try:
                        with direct:  # take and write as one step: put() may not write between
                            if not buffer:  # put() wrote them all itself meanwhile
                                break
                            out = buffer.popleft()
                            if out is _sentinel:
                                reader_close()
                                writer_close()
                                return
                            try:
                                sent = out.write(writer, False)
                            except OSError as e:
                                if e.errno != errno.ETOOMANYREFS:
                                    raise
                                _send_blocking(writer, out, blocked)  # waits for fds in flight
                                sent = True
                            if not sent:
                                buffer.appendleft(out)  # still first: put() appends behind it
                    finally:
                        if ledger is not None:
                            ledger.leave()
                    out = None  # sent (the kernel holds the fds now), or back in the buffer
                    if sent:
                        idle = _IDLE_FIRST
                    elif room.poll(0):
                        # Room in the socket, yet not written: every payload memfd of this end
                        # is unread (connection.py). Back off holding neither W nor _direct
                        # (put() never waits for a reader); polling for room returns at once.
                        time.sleep(idle)
                        idle = min(2 * idle, _IDLE_MAX)
                    else:
                        # The socket is full: wait for room *without* holding _direct, so that
                        # put() can write itself once there is room (one thread doing the
                        # writes instead of two taking turns on the GIL for each message).
                        room.poll()
            except Exception as e:
                if out is not None:
                    out.abandon(sock)
                if ignore_epipe and getattr(e, "errno", 0) == errno.EPIPE:
                    return
                if _mputil.is_exiting():
                    _mputil.info("error in queue thread: %s", e)
                    return
                onerror(e, out.msg if out is not None else None)

    @staticmethod
    def _on_queue_feeder_error(e: BaseException, obj: Any) -> None:
        """Called in the feeder thread when writing a message failed (as the stdlib's)."""
        import traceback

        print(f"tensormp: failed to send a queued message ({obj!r}):", file=sys.stderr)
        traceback.print_exception(type(e), e, e.__traceback__)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"buffered={len(self._buffer)}"
        return f"<tensormp.{type(self).__name__} {state} at {id(self):#x}>"

    __class_getitem__: classmethod[Any, [Any], types.GenericAlias] = classmethod(types.GenericAlias)


class JoinableQueue(Queue):
    """A :class:`Queue` with ``task_done()`` and ``join()``; see
    :class:`multiprocessing.JoinableQueue`.

    Each item is a task from ``put()`` until the process that got it calls ``task_done()``,
    covered by a kernel-tracked reference to a writer of the queue's task pipe (one fd per
    process that has tasks, whatever their number; ``_ledger.py``). An item whose taker died
    first counts as done: ``join()`` never waits for a dead process. ``task_done()`` must be
    called in the process that got the item (the stdlib allows any process).
    """

    _joinable = True

    def _taken(self, record: Record, n: int) -> None:
        # The task token of the record's n items: held until their n-th task_done().
        self._ledger.keep_task(record.tokens[0], n)
        _fdpass_close(record.tokens[1:])
        record.tokens = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        obj = super().get(block, timeout)
        self._ledger.returned(1)
        return obj

    get.__doc__ = Queue.get.__doc__

    def get_many(
        self, block: bool = True, timeout: float | None = None,
        max_messages_to_get: int = _MANY,
    ) -> list[Any]:
        out = super().get_many(block, timeout, max_messages_to_get)
        self._ledger.returned(len(out))
        return out

    get_many.__doc__ = Queue.get_many.__doc__

    def task_done(self) -> None:
        """Mark one item this process got as processed (the items of a ``put_many`` count
        one each).

        Raises:
            ValueError: called more times than this process got items (items of a batch it
                took that no ``get``/``get_many`` returned yet are not got).
        """
        self._ledger.task_done()

    def join(self) -> None:
        """Block until every item put has been got and marked done with :meth:`task_done`
        (or its taker died)."""
        self._ledger.wait_all_done()


# Queues whose buffer, batch items and threads are the parent's in a fork child: reset at every
# fork (os.register_at_fork: a raw os.fork() too, which multiprocessing's after-fork hooks never
# see; a raw-fork child's put() would otherwise send the parent's buffered messages again).
_forked: weakref.WeakSet[Queue | SimpleQueue] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for q in list(_forked):
        q._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _fdpass_close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class SimpleQueue(_Receiving):
    """A simplified queue without a feeder thread; see :class:`multiprocessing.SimpleQueue`.

    ``put`` pickles and writes in the caller (blocking while the socket is full). No lock is
    shared between processes: each message is one record (``connection.py``), so a process
    killed at any point cannot wedge it.
    """

    def __init__(self, *, ctx: Any = None) -> None:
        self._reader, self._writer = Pipe(duplex=False)
        self._setup()

    def _setup(self) -> None:
        self._poll = self._reader.poll
        self._pending = collections.deque()  # see _Receiving
        _forked.add(self)

    def _after_fork(self) -> None:
        self._pending = collections.deque()  # the parent's items stay the parent's

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    def empty(self) -> bool:
        """True when a ``get`` now would find nothing (see :meth:`Queue.empty`)."""
        return not self._pending and not self._poll()

    def __getstate__(self) -> tuple[Any, ...]:
        _mpctx.assert_spawning(self)
        return (self._reader, self._writer)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self._reader, self._writer) = state
        self._setup()

    def get(self) -> Any:
        if self._pending:
            try:
                return self._pending.popleft()
            except IndexError:  # another thread took it
                pass
        obj = self._reader.recv()
        return self._first(obj) if type(obj) is _Batch else obj

    def put(self, obj: Any) -> None:
        msg = reducers.dumps(obj, self._writer.by_value_room)
        try:
            self._writer.send_message(msg)
        except BaseException:
            msg.abandon()
            raise

    def put_many(
        self, items: list[Any] | tuple[Any, ...], block: bool = True, timeout: float | None = None
    ) -> None:
        """Put the items of ``items`` as one record, as :meth:`Queue.put_many` does. The queue is
        unbounded: ``put_many`` waits only while the socket's buffer is full (as ``put``), and
        with ``block=False`` or a ``timeout`` gives up then.

        Raises:
            queue.Full: the socket's buffer stayed full for ``timeout`` seconds (or was full,
                with ``block=False``); nothing was put.
            TypeError: ``items`` is not a list or tuple.
            TypeError, pickle.PicklingError: an item cannot be pickled (nothing was put).
            OSError: the socket failed (``EPIPE``: every reader is gone).
        """
        k = len(_batch_of(items, self))
        if not k:
            return
        writer = self._writer
        msg = reducers.dumps(items[0] if k == 1 else _Batch(items), writer.by_value_room)
        try:
            if block and timeout is None:
                writer.send_message(msg)
                return
            deadline = time.monotonic() + (timeout or 0.0)
            room = select.poll()
            room.register(writer.fileno(), select.POLLOUT)
            idle = _IDLE_FIRST
            while not writer.try_send_message(msg):
                left = deadline - time.monotonic()
                if not block or left <= 0:
                    raise Full
                if room.poll(0):  # room, yet not sent: every payload memfd is unread (_feed)
                    time.sleep(min(idle, left))
                    idle = min(2 * idle, _IDLE_MAX)
                else:
                    room.poll(max(1, int(left * 1000)))
        except BaseException:
            msg.abandon()
            raise

    def _check_open(self) -> None:
        self._reader._check_closed()  # OSError, as get() after close()

    def put_many_nowait(self, items: list[Any] | tuple[Any, ...]) -> None:
        """``put_many(items, block=False)`` (faster-fifo's name)."""
        self.put_many(items, False)

    def _read(self, wait: bool) -> Record | None:
        return self._reader.read_record(wait)

    def _load(self, record: Record) -> Any:
        record.close_tokens()
        obj = reducers.loads(record.data, record.fds)
        if _hooks:
            _testhooks.reached("recv.done")
        return obj

    def _wait_readable(self, timeout: float) -> bool:
        return self._poll(timeout)

    def __repr__(self) -> str:
        return f"<tensormp.SimpleQueue at {id(self):#x}>"

    __class_getitem__: classmethod[Any, [Any], types.GenericAlias] = classmethod(types.GenericAlias)
