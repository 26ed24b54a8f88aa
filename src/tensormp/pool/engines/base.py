"""What every engine shares: its configuration (:class:`EngineConfig`), its states (``RUN``,
``CLOSE``, ``TERMINATE``), and :class:`QueueEngine`: the deque of tasks no worker has yet, the
state, broken-ness, imap feeders and their flow control, the cancellation of tasks not started,
and the manager thread's loop. How an engine builds on it: ``docs/engines.md``.

Callers' threads (and imap feeders) touch only the deque and the state, under ``_lock``, and
wake the manager thread (``_wake_locked``, written by the engine). The manager thread owns the
rest. Its loop (``_run``): read the state; stop on ``TERMINATE``; ``_dispatch()`` (hand queued
tasks to workers); on ``CLOSE``, stop once ``_closing_done()``; ``_wait()`` (one round of
waiting for what happens, and handling it); and at the end, always, ``_shutdown()`` (stop the
workers, fail what is unfinished, free what it holds). A bug in any of these breaks the engine
with a message saying so instead of hanging its callers.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from ..errors import BrokenPoolError, WorkerLostError
from ..tasks import _describe, _Task

# An engine's states (``Engine.state``): running; closed (no new tasks, the workers exit once
# the queued ones are done); terminated (the workers are stopped, unfinished tasks fail).
RUN, CLOSE, TERMINATE = "RUN", "CLOSE", "TERMINATE"


@dataclass(frozen=True)
class EngineConfig:
    """What every engine gets from the front end.

    Attributes:
        processes: number of workers (>= 1); None: the engine's default (the CPUs of this
            machine, or of the cluster). Read the engine's ``processes`` for the number.
        initializer: the initializer as it travels (a callable, or a ``_by_value.FnByValue``
            for ``runner.load_fn``), or None.
        initargs: its arguments.
        maxtasks: tasks a worker runs before it is replaced (None: no limit).
        owner: the front end's name for messages (``"tensormp.Pool"``).
        lost_error: the exception type of a task whose worker died.
        broken_error: the exception type of a broken or terminated engine.
        ctx: the start-method context (the local engine's; others ignore it).
        pool_names: name worker processes as the stdlib ``Pool``'s (``ForkPoolWorker-<n>``);
            else they keep the ``Process``'s own name (``ForkProcess-<n>``, as
            ``concurrent.futures``'s).
    """

    processes: int | None
    initializer: Any
    initargs: tuple[Any, ...]
    maxtasks: int | None
    owner: str
    lost_error: type[WorkerLostError]
    broken_error: type[BrokenPoolError]
    ctx: Any = field(default=None)
    pool_names: bool = False


# The end of the message of a task whose worker was lost (every engine's).
LOST_TAIL = (
    " The pool replaced the worker and keeps running; only this task failed, resubmit it if it "
    "is safe to run again"
)


class QueueEngine:
    """The task deque, the state, and the manager thread's loop (see the module notes and
    ``docs/engines.md``)."""

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
        self._state = RUN
        # A submit wakes the manager only while this is set: it may be waiting with nothing
        # to do (an engine that looks at the deque after every event may clear it meanwhile).
        self._idle = True
        self._broken_msg: str | None = None
        self._broken_cause: BaseException | None = None
        self._feeders = 0
        self._seq = itertools.count(1)
        self._thread: threading.Thread | None = None

    # -- the engine's part ------------------------------------------------------------------
    def _wake_locked(self) -> None:
        """Wake the manager thread (called with ``_lock`` held)."""
        raise NotImplementedError

    def _dispatch(self) -> None:
        """Hand queued tasks to workers that can take them (``_pop_locked``, ``_claim``)."""
        raise NotImplementedError

    def _closing_done(self) -> bool:
        """Closed: once no task is left (``_has_work`` and the workers' own), stop the workers;
        True when they are gone."""
        raise NotImplementedError

    def _wait(self) -> None:
        """Wait (a second at most) for something to happen, and handle it: answers (deliver
        them), deaths, a wake-up."""
        raise NotImplementedError

    def _shutdown(self) -> None:
        """The manager's exit: stop what still runs, fail what is unfinished
        (``_fail_unfinished``), free what the engine holds, then ``_end_state()``."""
        raise NotImplementedError

    def _start_worker(self) -> None:
        """Start one worker (``_start`` calls it ``processes`` times). An engine whose workers
        are another system's has nothing to start."""

    def _send_now(self, task: _Task, feeder: bool) -> bool:
        """A lone task submitted while nothing is queued: True when the engine handed it to a
        worker from the caller's thread (the local engine's "Direct send"); False: queue it."""
        return False

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

    def _refusal(self, feeder: bool = False) -> Exception | None:
        """What a new task must raise now, or None when it may be queued: the engine is broken,
        or not running (an imap feeder that started before ``close()`` may still queue: its
        tasks are part of what the close waits for)."""
        if self._broken_msg is not None:
            return self.broken()
        state = self._state
        if state == RUN or (feeder and state == CLOSE):
            return None
        return self._not_running()

    def check_running(self) -> None:
        """Raises: BrokenPoolError (broken), ValueError (closed or terminated, as the stdlib)."""
        error = self._refusal()
        if error is not None:
            raise error

    def submit(self, tasks: list[_Task], *, feeder: bool = False) -> None:
        """Queue ``tasks`` (``feeder``: from an imap feeder thread).

        Raises: as :meth:`check_running`.
        """
        if len(tasks) == 1 and not self._pending and self._send_now(tasks[0], feeder):
            return
        with self._lock:
            error = self._refusal(feeder)
            if error is not None:
                raise error
            for task in tasks:
                if not task.seq:  # (set already when the engine tried to send it at once)
                    task.seq = next(self._seq)
            self._pending.extend(tasks)
            if self._idle:
                self._wake_locked()

    def feeder_started(self) -> None:
        """Raises: as :meth:`check_running` (checked under the lock, so the manager cannot
        finish a close() between the check and the feeder's first task)."""
        with self._lock:
            error = self._refusal()
            if error is not None:
                raise error
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
                and self._state != TERMINATE
                and self._broken_msg is None
            ):
                self._room_waiters += 1
                try:
                    self._room.wait()
                finally:
                    self._room_waiters -= 1
            if self._state == TERMINATE:
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
            if self._state == RUN:
                self._state = CLOSE
                self._wake_locked()

    def terminate(self) -> None:
        """Stop the workers now; unfinished tasks fail. Waits for it unless called from the
        manager thread itself (a callback)."""
        with self._lock:
            if self._state != TERMINATE:
                self._state = TERMINATE
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
    def _start(self) -> None:
        """Start the first workers, then the manager thread (the end of an engine's
        constructor). When a worker cannot start, nothing is left running, and the error is
        raised."""
        try:
            for _ in range(self.processes):
                self._start_worker()
        except BaseException:
            self._state = TERMINATE
            self._shutdown()
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"{self.owner} manager", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    state = self._state
                if state == TERMINATE:
                    break
                self._dispatch()
                if state == CLOSE and self._closing_done():
                    break
                self._wait()
        except BaseException as e:  # noqa: BLE001 - a bug here must not hang the callers
            import traceback

            print(f"{self.owner}: internal error in the manager thread:", file=sys.stderr)
            traceback.print_exception(type(e), e, e.__traceback__)
            cls = type(self)
            whose = (
                "tensormp" if cls.__module__.startswith("tensormp.")
                else f"the engine {cls.__module__}.{cls.__qualname__}"
            )
            self._break(
                f"{self.owner}: internal error in its manager thread ({type(e).__name__}: "
                f"{e}); this is a bug in {whose}, please report it",
                e,
            )
            with self._lock:
                self._state = TERMINATE
        finally:
            self._shutdown()

    def _has_work(self) -> bool:
        """Tasks queued, or a feeder that may queue more."""
        with self._lock:
            return bool(self._pending) or self._feeders > 0

    def _pop_locked(self) -> _Task:
        """The oldest queued task, taken off the deque (``_lock`` held, the deque not empty).
        Feeders waiting for room are woken once half of it is free (they refill it at once)."""
        task = self._pending.popleft()
        if self._room_waiters and len(self._pending) <= self._room_limit // 2:
            self._room.notify_all()
        return task

    def _take(self) -> _Task | None:
        """The oldest queued task, or None: ``_pop_locked`` for an engine that takes tasks one
        at a time."""
        with self._lock:
            return self._pop_locked() if self._pending else None

    @staticmethod
    def _claim(task: _Task) -> bool:
        """Call before a worker gets ``task``: False when its future was cancelled meanwhile
        (``task.start``, called once): drop the task, it is not delivered."""
        start = task.start
        if start is None:
            return True
        task.start = None
        if start():
            return True
        _abandon(task)
        return False

    def _wants_workers(self) -> bool:
        """Whether workers that died or retired are to be replaced: not once terminated or
        broken, nor once closed with no task left."""
        with self._lock:
            state = self._state
            broken = self._broken_msg is not None
            work = bool(self._pending) or self._feeders > 0
        return not (state == TERMINATE or broken or (state == CLOSE and not work))

    def _initializer_failed(self, where: str, error: BaseException) -> None:
        """The initializer raised in a worker (``where``: ``"worker 1234"``): the engine breaks
        (every worker runs it), chained to ``error``."""
        init = self._initializer
        name = getattr(init, "name", None) or getattr(init, "__qualname__", repr(init))
        self._break(
            f"{self.owner}: the initializer {name} raised in {where}: "
            f"{type(error).__name__}: {error}. The pool is broken (every worker runs it); "
            "fix the initializer and create a new pool",
            error,
        )

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
                f"block) before {describe_task(task)} finished"
            )
            self._deliver(task, False, error)

    def _end_state(self) -> None:
        """The manager ended: a running engine counts as terminated (``join()`` returns)."""
        with self._lock:
            if self._state == RUN:
                self._state = TERMINATE


def describe_task(task: _Task) -> str:
    """How messages name ``task``: ``map(work) chunk 3 of 8 (items 6-7)``,
    ``apply_async(work, 1, x=2)`` (the ``task`` of a ``lost_error``)."""
    return _describe(task.label)


def _abandon(task: _Task) -> None:
    """A task that will never be sent gives back what pickling it reserved."""
    if task.msg is not None:
        task.msg.abandon()
        task.msg = None
