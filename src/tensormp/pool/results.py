"""What :class:`tensormp.Pool`'s calls return, as in ``multiprocessing.pool``:
:class:`AsyncResult` (alias ``ApplyResult``), :class:`MapResult` and :class:`IMapIterator`.

The manager thread fills them, one ``_set(index, ok, value)`` per task (a call or a map chunk),
and runs their callbacks; the imap feeder thread sets an :class:`IMapIterator`'s length, or an
error when its iterable raised or the pool broke. The caller's threads wait on them.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import TimeoutError as _PoolTimeoutError
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .progress import _Progress


class AsyncResult:
    """The result of :meth:`Pool.apply_async` (``multiprocessing.pool.AsyncResult``).

    Callbacks run in the pool's manager thread, before :meth:`ready` turns True (as the
    stdlib); they should return quickly. An exception in a callback is printed and ignored
    (the stdlib's result thread dies of it and the pool hangs).
    """

    def __init__(
        self, pool: Any, callback: Callable[[Any], Any] | None,
        error_callback: Callable[[BaseException], Any] | None,
    ) -> None:
        self._pool = pool  # keeps the pool alive until the result is in (as the stdlib)
        # Done: ``_done`` True and ``_latch`` released. A held lock instead of an Event: one
        # allocation instead of a Condition, a deque and a lock per call, and a waiter needs no
        # lock of its own (this is per task: thousands of tiny apply_async calls).
        self._done = False
        self._latch = threading.Lock()
        self._latch.acquire()
        self._callback = callback
        self._error_callback = error_callback
        self._success: bool | None = None
        self._value: Any = None

    def ready(self) -> bool:
        """Whether the call has completed."""
        return self._done

    def successful(self) -> bool:
        """Whether the call completed without raising.

        Raises:
            ValueError: the result is not ready.
        """
        if not self.ready():
            raise ValueError(f"{self!r} not ready")
        return bool(self._success)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the result is available or ``timeout`` seconds pass."""
        if self._done:
            return
        if timeout is None:
            got = self._latch.acquire()
        else:
            got = self._latch.acquire(timeout=max(0.0, timeout))
        if got:
            self._latch.release()  # the next waiter's turn

    def get(self, timeout: float | None = None) -> Any:
        """The result; raises the task's exception if it raised.

        Raises:
            multiprocessing.TimeoutError: not ready within ``timeout`` seconds.
            WorkerLostError: the worker running the task died.
            BrokenPoolError: the pool broke or was terminated before the task finished.
            Exception: whatever the task raised (``__cause__``: its remote traceback).
        """
        self.wait(timeout)
        if not self.ready():
            raise _PoolTimeoutError
        if self._success:
            return self._value
        raise self._value

    def _set(self, index: int, ok: bool, value: Any) -> None:
        self._success, self._value = ok, value
        self._finish()

    def _finish(self) -> None:
        try:
            if self._success and self._callback is not None:
                self._callback(self._value)
            elif not self._success and self._error_callback is not None:
                self._error_callback(self._value)
        finally:
            self._pool = None
            self._done = True
            self._latch.release()

    def __repr__(self) -> str:
        state = "pending" if not self.ready() else ("ok" if self._success else "failed")
        return f"<{type(self).__name__} {state} at {id(self):#x}>"


ApplyResult = AsyncResult


class MapResult(AsyncResult):
    """The result of :meth:`Pool.map_async` / :meth:`Pool.starmap_async`: a list in order.

    As the stdlib: ready when every chunk is done, or as soon as a chunk failed: ``get()``
    then raises the first exception that arrived (and ``error_callback`` runs) while the other
    chunks may still run; their answers are dropped.
    """

    def __init__(
        self, pool: Any, chunksize: int, length: int, callback: Any, error_callback: Any
    ) -> None:
        self._cond = threading.Condition(threading.Lock())  # progress: each chunk done
        super().__init__(pool, callback, error_callback)
        self._chunksize = chunksize
        self._length = length
        self._success = True
        self._value = [None] * length
        self._left = -(-length // chunksize) if length else 0
        self.items_done = 0
        if self._left == 0:
            self._finish()

    def _set(self, index: int, ok: bool, value: Any) -> None:
        cs = self._chunksize
        with self._cond:
            self._left -= 1
            self.items_done += min(cs, self._length - index * cs)
            failed_now = not ok and self._success
            if ok and self._success:
                self._value[index * cs : (index + 1) * cs] = value
            elif failed_now:
                self._success = False
                self._value = value  # only the first exception is kept (as the stdlib)
            done = failed_now or (self._success and self._left == 0)
            self._cond.notify_all()
        if done:
            self._finish()

    def _finish(self) -> None:
        try:
            super()._finish()
        finally:
            with self._cond:
                self._cond.notify_all()

    def _follow(self, reporter: _Progress) -> None:
        """Caller's thread: feed ``reporter`` until the map is done."""
        try:
            shown = -1
            while True:
                with self._cond:
                    if self.items_done == shown and not self._done:
                        self._cond.wait(1.0)
                    done, finished = self.items_done, self._done
                if done != shown:
                    reporter.update(done)
                    shown = done
                if finished:
                    return
        finally:
            reporter.close()


class IMapIterator:
    """The iterator of :meth:`Pool.imap` / :meth:`Pool.imap_unordered`.

    ``next(timeout)`` raises ``multiprocessing.TimeoutError`` after ``timeout`` seconds (as the
    stdlib). A chunk that raised raises its exception when reached; iteration can go on after.
    """

    def __init__(self, pool: Any, ordered: bool, reporter: _Progress | None) -> None:
        self._pool = pool
        self._ordered = ordered
        self._cond = threading.Condition(threading.Lock())
        self._ready: collections.deque[tuple[bool, Any]] = collections.deque()
        self._early: dict[int, tuple[bool, Any]] = {}
        self._next_chunk = 0
        self._length: int | None = None
        self._taken = 0
        self._current: Iterator[Any] | None = None
        self._reporter = reporter
        self._yielded = 0
        self._arrived = 0  # chunks whose answer came (imap_unordered)
        self._feed_error: tuple[int, BaseException] | None = None  # waits for those before it

    def __iter__(self) -> IMapIterator:
        return self

    def __next__(self) -> Any:
        return self.next()

    def next(self, timeout: float | None = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._current is not None:
                for item in self._current:
                    self._yielded += 1
                    if self._reporter is not None:
                        self._reporter.update(self._yielded)
                    return item
                self._current = None
            with self._cond:
                while not self._ready:
                    if self._length is not None and self._taken >= self._length:
                        self._pool = None
                        self._close_reporter()
                        raise StopIteration
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise _PoolTimeoutError
                    self._cond.wait(left)
                ok, value = self._ready.popleft()
                self._taken += 1
            if not ok:
                raise value
            self._current = iter(value)

    def _set(self, index: int, ok: bool, value: Any) -> None:
        with self._cond:
            if self._ordered:
                self._early[index] = (ok, value)
                while self._next_chunk in self._early:
                    self._ready.append(self._early.pop(self._next_chunk))
                    self._next_chunk += 1
            else:
                self._ready.append((ok, value))
                self._arrived += 1
                if self._feed_error is not None and self._arrived == self._feed_error[0]:
                    self._ready.append((False, self._feed_error[1]))
                    self._feed_error = None
            self._cond.notify()

    def _fail_feed(self, index: int, error: BaseException) -> None:
        """The iterable raised (or the pool broke) after ``index`` chunks were submitted. In
        order (imap) the error takes chunk ``index``'s place; unordered, it comes after the
        answers of the chunks submitted before it (as the stdlib's, whose feeder is ahead)."""
        if self._ordered:
            self._set(index, False, error)
            return
        with self._cond:
            if self._arrived >= index:
                self._ready.append((False, error))
                self._cond.notify()
            else:
                self._feed_error = (index, error)

    def _set_length(self, nchunks: int) -> None:
        with self._cond:
            self._length = nchunks
            self._cond.notify()

    def _close_reporter(self) -> None:
        reporter, self._reporter = self._reporter, None
        if reporter is not None:
            reporter.close()

    def __del__(self) -> None:
        try:
            self._close_reporter()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
