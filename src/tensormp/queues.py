"""``Queue``, ``JoinableQueue`` and ``SimpleQueue`` that move arrays as shared-memory handles.

Same API and semantics as the stdlib's (``multiprocessing.queues``), with two differences:

* ``put()`` pickles in the calling thread. An object that cannot be pickled or shared raises
  there, and nothing is half-sent; the stdlib and torch pickle in the feeder thread, print the
  error from there and leave the consumer blocked forever. It also means the queue captures
  the object's state at ``put()`` time.
* The pipe underneath is a Unix socket pair carrying the fds of shared-memory segments beside
  each message (``connection.py``), so a consumer can rebuild arrays whose producer has exited.
* ``put()`` tries to write the message itself, without blocking (messages up to 32 KiB and
  253 fds, when no other thread or process is writing): one thread hop and one wake-up less
  per item. It first writes what the feeder's buffer still holds, so order is kept; whatever
  the socket does not take at once (it is full) goes to the feeder, as in the stdlib, and
  ``put()`` never waits for a consumer. The feeder takes a message from its buffer and
  writes it while holding the same thread lock (``_direct``) that ``put()`` needs, and waits
  for room with ``poll()`` *without* holding it. Measured: a producer whose writes were all
  left to the feeder spent about twice the CPU per 4 KiB array (two threads taking turns on
  the GIL for every message) as one that writes itself.

A message in a ``Queue`` (pickled, waiting in the feeder's buffer) keeps the memory it refers
to alive until the feeder has written it to the socket; from then on the kernel holds the
fds in flight.
"""

from __future__ import annotations

import collections
import errno
import os
import select
import sys
import threading
import time
import types
import weakref
from multiprocessing import context as _mpctx
from multiprocessing import util as _mputil
from queue import Empty, Full
from typing import Any

from . import reducers
from .connection import Pipe
from .errors import FdLimitError

__all__ = ["Queue", "JoinableQueue", "SimpleQueue"]

_SEM_VALUE_MAX = 2**31 - 1
_DIRECT_MAX = 32 << 10  # put() writes messages up to this size itself (see the module notes)
_DIRECT_MAX_FDS = 253  # and with at most this many fds (one SCM_RIGHTS message)
# put() waits this long (seconds) for _direct while the feeder holds it for a non-blocking
# write, instead of leaving its message to the feeder at once: waiting hands the GIL to the
# feeder, which then lets go of _direct, and put() writes itself again. Giving up at once made
# the two threads convoy (the feeder holds _direct while it waits for the GIL after each
# write): measured, the slowest round of 20,000 kept 4 KiB arrays went from 26 to 21 us/item.
# Never waited for while the feeder is in a blocking write (a large message on a full socket).
_DIRECT_WAIT = 0.001
_sentinel = object()


def _small(msg: reducers.Message) -> bool:
    """Whether ``msg`` may be written without blocking (see the module notes)."""
    return len(msg.data) <= _DIRECT_MAX and len(msg.fds) <= _DIRECT_MAX_FDS


def _send_blocking(writer: Any, msg: reducers.Message, blocked: list[bool]) -> None:
    """The feeder's blocking write; ``blocked[0]`` tells put() not to wait for it meanwhile."""
    blocked[0] = True
    try:
        writer.send_message(msg)
    finally:
        blocked[0] = False


class Queue:
    """A process-shared FIFO queue; see :class:`multiprocessing.Queue`.

    Args:
        maxsize: maximum number of items (``<= 0``: unbounded).
        ctx: the tensormp context that makes its locks.

    Raises (from ``put``):
        queue.Full: no room within ``timeout`` seconds (or at once with ``block=False``).
        ValueError: the queue is closed.
        TypeError, pickle.PicklingError: ``obj`` cannot be pickled (raised in the caller).
    """

    def __init__(self, maxsize: int = 0, *, ctx: Any) -> None:
        if maxsize <= 0:
            maxsize = _SEM_VALUE_MAX
        self._maxsize = maxsize
        self._reader, self._writer = Pipe(duplex=False)
        self._rlock = ctx.Lock()
        self._opid = os.getpid()
        self._wlock = ctx.Lock()
        self._sem = ctx.BoundedSemaphore(maxsize)
        self._ignore_epipe = False
        self._reset()
        _mputil.register_after_fork(self, Queue._after_fork)

    def __getstate__(self) -> tuple[Any, ...]:
        _mpctx.assert_spawning(self)
        return (
            self._ignore_epipe, self._maxsize, self._reader, self._writer,
            self._rlock, self._wlock, self._sem, self._opid,
        )

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (
            self._ignore_epipe, self._maxsize, self._reader, self._writer,
            self._rlock, self._wlock, self._sem, self._opid,
        ) = state
        self._reset()

    def _after_fork(self) -> None:
        self._reset(after_fork=True)

    def _reset(self, after_fork: bool = False) -> None:
        if after_fork:
            self._notempty._at_fork_reinit()  # type: ignore[attr-defined]
        else:
            self._notempty = threading.Condition(threading.Lock())
        self._buffer: collections.deque[Any] = collections.deque()
        self._direct = threading.Lock()  # held while writing a message (see the module notes)
        self._blocked = [False]  # [True] while the feeder is in a blocking write
        self._thread: threading.Thread | None = None
        self._jointhread: Any = None
        self._joincancelled = False
        self._closed = False
        self._close: Any = None
        self._poll = self._reader.poll

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``obj`` on the queue; arrays travel as shared-memory handles."""
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        msg = reducers.dumps(obj)  # errors raise here, in the caller
        if not self._sem.acquire(block, timeout):
            msg.abandon()
            raise Full
        self._enqueue(msg)

    def _enqueue(self, msg: reducers.Message) -> None:
        if self._direct.acquire(False) or (
            not self._blocked[0] and self._direct.acquire(True, _DIRECT_WAIT)
        ):
            try:
                if self._wlock.acquire(False):
                    try:
                        if self._write_now(msg):
                            return
                    finally:
                        self._wlock.release()
            finally:
                self._direct.release()
        with self._notempty:
            if self._thread is None:
                self._start_thread()
            self._buffer.append(msg)
            self._notempty.notify()

    def _write_now(self, msg: reducers.Message) -> bool:
        """Write what the feeder's buffer holds, then ``msg``, as far as the socket takes them
        without blocking (holding ``_direct`` and the write lock). True when ``msg`` was
        written; False leaves it (and what is still buffered) to the feeder."""
        buffer = self._buffer
        writer = self._writer
        try:
            while buffer:
                head = buffer[0]
                if head is _sentinel or not _small(head) or not writer.try_send_message(head):
                    return False
                buffer.popleft()
            return _small(msg) and writer.try_send_message(msg)
        except Exception:
            return False  # the feeder meets it again and reports it as the stdlib does

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """Remove and return an item; see :meth:`multiprocessing.Queue.get`.

        Raises:
            queue.Empty: nothing arrived within ``timeout`` seconds (or at once).
            ValueError: the queue is closed.
        """
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        if block and timeout is None:
            with self._rlock:
                try:
                    data, fds = self._reader._recv_message()
                except FdLimitError:
                    self._sem.release()  # that message was consumed (and dropped)
                    raise
            self._sem.release()
        else:
            if block:
                deadline = time.monotonic() + (timeout or 0.0)
            if not self._rlock.acquire(block, timeout):
                raise Empty
            try:
                reader = self._reader
                try:
                    got = reader._recv_message(wait=False)  # no poll when one is waiting
                except BaseException:
                    self._sem.release()  # as below: a failed receive consumed its message
                    raise
                if got is None:
                    if not block or not self._poll(max(0.0, deadline - time.monotonic())):
                        raise Empty
                    try:
                        got = reader.recv_message()
                    finally:
                        self._sem.release()
                else:
                    self._sem.release()
                data, fds = got
            finally:
                self._rlock.release()
        return reducers.loads(data, fds)

    def qsize(self) -> int:
        return self._maxsize - self._sem._semlock._get_value()  # type: ignore[attr-defined]

    def empty(self) -> bool:
        return not self._poll()

    def full(self) -> bool:
        return bool(self._sem._semlock._is_zero())  # type: ignore[attr-defined]

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
                self._buffer, self._notempty, self._writer, self._wlock, self._reader.close,
                self._writer.close, self._ignore_epipe, self._on_queue_feeder_error, self._sem,
                self._direct, self._blocked,
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
        buffer: collections.deque[Any], notempty: threading.Condition, writer: Any,
        writelock: Any, reader_close: Any, writer_close: Any, ignore_epipe: bool,
        onerror: Any, queue_sem: Any, direct: threading.Lock, blocked: list[bool],
    ) -> None:
        room = select.poll()
        room.register(writer.fileno(), select.POLLOUT)
        while True:
            msg: Any = None
            try:
                with notempty:
                    if not buffer:
                        notempty.wait()
                while buffer:
                    with direct:  # take and write as one step: put() may not write between
                        if not buffer:  # put() wrote them all itself meanwhile
                            break
                        msg = buffer.popleft()
                        if msg is _sentinel:
                            reader_close()
                            writer_close()
                            return
                        with writelock:
                            sent = False
                            if _small(msg):
                                try:
                                    sent = writer.try_send_message(msg)
                                except OSError as e:
                                    if e.errno != errno.ETOOMANYREFS:
                                        raise
                                    _send_blocking(writer, msg, blocked)  # waits for fds in flight
                                    sent = True
                            else:
                                _send_blocking(writer, msg, blocked)  # large, as the stdlib's
                                sent = True
                        if not sent:
                            buffer.appendleft(msg)  # still first: put() appends behind it
                    msg = None  # sent (the kernel holds the fds now), or back in the buffer
                    if not sent:
                        # The socket is full: wait for room *without* holding _direct, so that
                        # put() can write itself once there is room (one thread doing the
                        # writes instead of two taking turns on the GIL for each message).
                        room.poll()
            except Exception as e:
                if msg is not None:
                    msg.abandon()
                if ignore_epipe and getattr(e, "errno", 0) == errno.EPIPE:
                    return
                if _mputil.is_exiting():
                    _mputil.info("error in queue thread: %s", e)
                    return
                queue_sem.release()
                onerror(e, msg)

    @staticmethod
    def _on_queue_feeder_error(e: BaseException, obj: Any) -> None:
        """Called in the feeder thread when writing a message failed (as the stdlib's)."""
        import traceback

        print(f"tensormp: failed to send a queued message ({obj!r}):", file=sys.stderr)
        traceback.print_exception(type(e), e, e.__traceback__)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"buffered={len(self._buffer)}"
        return f"<tensormp.Queue {state} at {id(self):#x}>"

    __class_getitem__ = classmethod(types.GenericAlias)


class JoinableQueue(Queue):
    """A :class:`Queue` with ``task_done()`` and ``join()``; see :class:`multiprocessing.JoinableQueue`."""

    def __init__(self, maxsize: int = 0, *, ctx: Any) -> None:
        super().__init__(maxsize, ctx=ctx)
        self._unfinished_tasks = ctx.Semaphore(0)
        self._cond = ctx.Condition()

    def __getstate__(self) -> tuple[Any, ...]:
        return Queue.__getstate__(self) + (self._cond, self._unfinished_tasks)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        Queue.__setstate__(self, state[:-2])
        self._cond, self._unfinished_tasks = state[-2:]

    def put(self, obj: Any, block: bool = True, timeout: float | None = None) -> None:
        if self._closed:
            raise ValueError(f"Queue {self!r} is closed")
        msg = reducers.dumps(obj)
        if not self._sem.acquire(block, timeout):
            msg.abandon()
            raise Full
        with self._cond:
            self._unfinished_tasks.release()  # before any consumer can see the item
        self._enqueue(msg)

    def task_done(self) -> None:
        """Mark one item as processed. Raises ``ValueError`` if called too many times."""
        with self._cond:
            if not self._unfinished_tasks.acquire(False):
                raise ValueError("task_done() called too many times")
            if self._unfinished_tasks._semlock._is_zero():  # type: ignore[attr-defined]
                self._cond.notify_all()

    def join(self) -> None:
        """Block until every item put has been marked done with :meth:`task_done`."""
        with self._cond:
            if not self._unfinished_tasks._semlock._is_zero():  # type: ignore[attr-defined]
                self._cond.wait()


class SimpleQueue:
    """A simplified queue without a feeder thread; see :class:`multiprocessing.SimpleQueue`.

    ``put`` pickles and writes in the caller (blocking while the socket is full).
    """

    def __init__(self, *, ctx: Any) -> None:
        self._reader, self._writer = Pipe(duplex=False)
        self._rlock = ctx.Lock()
        self._poll = self._reader.poll
        self._wlock = ctx.Lock()

    def close(self) -> None:
        self._reader.close()
        self._writer.close()

    def empty(self) -> bool:
        return not self._poll()

    def __getstate__(self) -> tuple[Any, ...]:
        _mpctx.assert_spawning(self)
        return (self._reader, self._writer, self._rlock, self._wlock)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self._reader, self._writer, self._rlock, self._wlock) = state
        self._poll = self._reader.poll

    def get(self) -> Any:
        with self._rlock:
            data, fds = self._reader.recv_message()
        return reducers.loads(data, fds)

    def put(self, obj: Any) -> None:
        msg = reducers.dumps(obj)
        try:
            with self._wlock:
                self._writer.send_message(msg)
        except BaseException:
            msg.abandon()
            raise

    def __repr__(self) -> str:
        return f"<tensormp.SimpleQueue at {id(self):#x}>"

    __class_getitem__ = classmethod(types.GenericAlias)
