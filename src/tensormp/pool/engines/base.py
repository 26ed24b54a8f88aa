"""What every engine shares (:class:`QueueEngine`): the deque of tasks no worker has yet, the
state (RUN, CLOSE, TERMINATE), broken-ness, imap feeders and their flow control, and the
manager thread's frame.

Callers' threads (and imap feeders) touch only the deque and the state, under ``_lock``, and
wake the manager thread (``_wake_locked``, written by the engine). The manager thread owns the
rest: an engine writes ``_step`` (one turn: dispatch, wait, handle what happened; False once it
is done) and ``_shutdown`` (stop the workers, fail what is unfinished, free what it holds). A
bug in ``_step`` breaks the engine with a message saying so instead of hanging its callers.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import threading
from typing import Any

from ..errors import BrokenPoolError, WorkerLostError
from ..tasks import _describe, _Task
from . import EngineConfig

_RUN, _CLOSE, _TERMINATE = "RUN", "CLOSE", "TERMINATE"  # the engine's states


class QueueEngine:
    """The task deque, the state, and the manager thread's frame (see the module notes)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.processes is None:
            from ..._cpus import cpu_count as _cpu_count

            config = dataclasses.replace(config, processes=_cpu_count())
        assert config.processes is not None
        self.processes: int = config.processes
        self.owner = config.owner
        self._initializer = config.initializer
        self._initargs = tuple(config.initargs)
        self._maxtasks = config.maxtasks
        self._lost_error: type[WorkerLostError] = config.lost_error
        self._broken_error: type[BrokenPoolError] = config.broken_error
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # feeders wait here for the deque to drain
        self._room_limit = 4 * self.processes + 4
        self._room_waiters = 0  # feeders waiting in wait_room (an engine may notify only then)
        self._pending: collections.deque[_Task] = collections.deque()
        self._state = _RUN
        self._broken_msg: str | None = None
        self._broken_cause: BaseException | None = None
        self._feeders = 0
        self._seq = itertools.count(1)
        self._thread: threading.Thread | None = None

    # -- the engine's part ------------------------------------------------------------------
    def _wake_locked(self) -> None:
        """Wake the manager thread (called with ``_lock`` held)."""
        raise NotImplementedError

    def _step(self) -> bool:
        raise NotImplementedError

    def _shutdown(self) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def worker_processes(self) -> list[Any]:
        return []

    # -- called from any thread -------------------------------------------------------------
    @property
    def state(self) -> str:
        return self._state

    @property
    def is_broken(self) -> bool:
        return self._broken_msg is not None

    def broken_error(self, msg: str) -> BrokenPoolError:
        return self._broken_error(msg)

    def broken(self) -> BrokenPoolError:
        error = self._broken_error(self._broken_msg or f"{self.owner} is broken")
        error.__cause__ = self._broken_cause
        return error

    def _not_running(self) -> ValueError:
        return ValueError(
            f"Pool not running: this {self.owner} was closed or terminated; create a new one"
        )

    def check_running(self) -> None:
        """Raises: BrokenPoolError (broken), ValueError (closed or terminated, as the stdlib)."""
        if self._broken_msg is not None:
            raise self.broken()
        if self._state != _RUN:
            raise self._not_running()

    def submit(self, tasks: list[_Task], *, feeder: bool = False) -> None:
        with self._lock:
            if self._broken_msg is not None:
                raise self.broken()
            if self._state != _RUN and not (feeder and self._state == _CLOSE):
                raise self._not_running()
            for task in tasks:
                task.seq = next(self._seq)
            self._pending.extend(tasks)
            self._wake_locked()

    def feeder_started(self) -> None:
        """Raises: as :meth:`check_running` (checked under the lock, so the manager cannot
        finish a close() between the check and the feeder's first task)."""
        with self._lock:
            if self._broken_msg is not None:
                raise self.broken()
            if self._state != _RUN:
                raise self._not_running()
            self._feeders += 1

    def feeder_done(self) -> None:
        with self._lock:
            self._feeders -= 1
            self._wake_locked()

    def wait_room(self) -> int:
        """A feeder waits until few tasks are queued: how many more it may queue now (at least
        1), or 0 when the pool was terminated."""
        with self._room:
            while (
                len(self._pending) >= self._room_limit
                and self._state != _TERMINATE
                and self._broken_msg is None
            ):
                self._room_waiters += 1
                try:
                    self._room.wait()
                finally:
                    self._room_waiters -= 1
            if self._state == _TERMINATE:
                return 0
            return max(1, self._room_limit - len(self._pending))

    def take_pending(self) -> list[_Task]:
        """Remove and return every task not sent yet (``shutdown(cancel_futures=True)``)."""
        with self._lock:
            tasks = self._pop_pending_locked()
        for task in tasks:
            _abandon(task)
        return tasks

    def _pop_pending_locked(self) -> list[_Task]:
        tasks = list(self._pending)
        self._pending.clear()
        self._room.notify_all()
        return tasks

    def close(self) -> None:
        with self._lock:
            if self._state == _RUN:
                self._state = _CLOSE
                self._wake_locked()

    def terminate(self) -> None:
        """Stop the workers now; unfinished tasks fail. Waits for it unless called from the
        manager thread itself (a callback)."""
        with self._lock:
            if self._state != _TERMINATE:
                self._state = _TERMINATE
                self._wake_locked()
                self._room.notify_all()
        thread = self._thread
        if thread is not None and threading.current_thread() is not thread and thread.is_alive():
            thread.join()

    def join(self) -> None:
        thread = self._thread
        if thread is not None and threading.current_thread() is not thread:
            thread.join()

    # -- the manager thread -----------------------------------------------------------------
    def _start_manager(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"{self.owner} manager", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            while self._step():
                pass
        except BaseException as e:  # noqa: BLE001 - a bug here must not hang the callers
            import traceback

            print(f"{self.owner}: internal error in the manager thread:", file=sys.stderr)
            traceback.print_exception(type(e), e, e.__traceback__)
            self._break(
                f"{self.owner}: internal error in its manager thread ({type(e).__name__}: "
                f"{e}); this is a bug in tensormp, please report it",
                e,
            )
            with self._lock:
                self._state = _TERMINATE
        finally:
            self._shutdown()

    def _has_work(self) -> bool:
        """Tasks queued, or a feeder that may queue more."""
        with self._lock:
            return bool(self._pending) or self._feeders > 0

    def _deliver(self, task: _Task, ok: bool, value: Any) -> None:
        task.msg = None  # the argument blocks can be recycled once the worker released them
        task.args = None
        try:
            task.sink(ok, value)
        except BaseException as e:  # noqa: BLE001 - a user callback raised
            import traceback

            print(f"{self.owner}: exception in a result callback (ignored):", file=sys.stderr)
            traceback.print_exception(type(e), e, e.__traceback__)

    def _break(self, msg: str, cause: BaseException | None) -> None:
        with self._lock:
            if self._broken_msg is not None:
                return
            self._broken_msg = msg
            self._broken_cause = cause
            tasks = self._pop_pending_locked()
        for task in tasks:
            _abandon(task)
            self._deliver(task, False, self.broken())

    def _fail_unfinished(self, unfinished: list[_Task]) -> None:
        """Terminated: the tasks given, and every task still queued, fail."""
        with self._lock:
            unfinished.extend(self._pending)
            self._pending.clear()
            self._room.notify_all()
        for task in unfinished:
            if task.msg is not None:
                task.msg.abandon()  # no-op for messages already sent
            error = self._broken_error(
                f"{self.owner} was terminated (terminate(), shutdown, or the end of its `with` "
                f"block) before {_describe_task(task)} finished"
            )
            self._deliver(task, False, error)

    def _end_state(self) -> None:
        with self._lock:
            if self._state != _TERMINATE:
                self._state = _TERMINATE if self._state == _RUN else self._state


def _describe_task(task: _Task) -> str:
    return _describe(task.label)


def _abandon(task: _Task) -> None:
    """A task that will never be sent gives back what pickling it reserved."""
    if task.msg is not None:
        task.msg.abandon()
        task.msg = None
