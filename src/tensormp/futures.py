"""``ProcessPoolExecutor``: ``concurrent.futures.ProcessPoolExecutor`` whose arguments and
results travel through shared memory, on the engines of :class:`tensormp.Pool` (``local``:
``pool/__init__.py`` has the design note: per-worker channels, one manager thread, dead-worker
attribution; ``ray``: workers are Ray actors). It talks to its engine through the interface in
``pool/engines/__init__.py`` only.

What differs from ``concurrent.futures``, and why:

* **A dead worker** (a signal, the OOM killer, ``os._exit``, a crash) fails only the future it
  was running, with :class:`TerminatedWorkerError` (loky's name; a ``BrokenProcessPool``, so
  ``except BrokenProcessPool`` still works) carrying its pid, exit code or signal name and the
  task. The executor replaces the worker and stays usable: since each worker has its own
  channel, the manager knows which task each one held (``concurrent.futures`` cannot tell,
  so it fails every pending future and breaks the executor).
* **An initializer that raises** breaks the executor, as in ``concurrent.futures``, with
  :class:`BrokenExecutorError` (a ``BrokenProcessPool``) chained to the initializer's
  exception.
* ``map`` takes ``progress=True`` (tqdm) or ``progress=callable(done, total)``.
* ``fn`` may be a lambda or a closure (cloudpickle).
* ``max_tasks_per_child`` works with every start method (``concurrent.futures`` refuses
  ``fork``); a worker's results outlive it.
* Futures move to RUNNING when their task is sent to a worker, which may be shortly before the
  worker starts it (as ``concurrent.futures``, whose call queue holds a few tasks ahead; here
  a worker holds up to 32 tasks when its calls are tiny, about 2 ms of work, so
  ``shutdown(cancel_futures=True)`` cancels those still waiting in the executor). A task that
  a busy worker gives back unstarted, for an idle one, stays RUNNING.
* ``shutdown(wait=True)``, at ``with`` exit or interpreter exit, waits for the submitted work,
  as ``concurrent.futures``; garbage collecting the executor lets the work finish without
  waiting.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Executor, Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import util as _mputil
from typing import Any

from ._cpus import cpu_count as _cpu_count
from .pool.engines import Engine, EngineConfig, create
from .pool.errors import BrokenPoolError, WorkerLostError
from .pool.progress import _Progress
from .pool.tasks import _CALL, _STARMAP, _prepare, _Task

__all__ = ["ProcessPoolExecutor", "TerminatedWorkerError", "BrokenExecutorError"]


class TerminatedWorkerError(WorkerLostError, BrokenProcessPool):
    """A worker died while running this future's task (see :class:`tensormp.WorkerLostError`
    for the attributes ``pid``, ``exitcode``, ``signal_name``, ``task``).

    Also a ``concurrent.futures.process.BrokenProcessPool``, for code written against the
    stdlib; unlike there, the executor is not broken: it replaced the worker.
    """


class BrokenExecutorError(BrokenPoolError, BrokenProcessPool):
    """The executor cannot run tasks (its initializer raised, workers cannot start), or it was
    shut down before this task finished. A ``BrokenProcessPool``, as in ``concurrent.futures``.
    """


def _future_sink(future: Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return  # cancelled
    original = getattr(value, "pickling_error", None) if not ok else None
    if isinstance(original, BaseException):
        # The result could not be pickled: concurrent.futures raises the pickling error itself
        # (a TypeError, ...), not the Pool's MaybeEncodingError.
        original.__cause__ = value.__cause__
        value = original
    try:
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)
    except InvalidStateError:  # cancelled meanwhile
        pass


# Interpreter exit, as concurrent.futures: threading's exit hooks (which run before atexit's)
# mark it, so that submit() raises from then on, and wait for the executors that were garbage
# collected without shutdown() to finish their work; else multiprocessing's exit function would
# terminate their workers while their manager threads close them (and print the ValueError of
# a closed process object).
_shutting_down = False
_closing: weakref.WeakSet[Engine] = weakref.WeakSet()  # those engines, until they are done


def _python_exit() -> None:
    global _shutting_down
    _shutting_down = True
    for engine in list(_closing):
        engine.join()


try:
    threading._register_atexit(_python_exit)  # type: ignore[attr-defined]  # private, as cf's
except RuntimeError:  # imported while the interpreter exits
    _shutting_down = True


def _close_at_gc(engine: Engine) -> None:
    engine.close()
    if _shutting_down or _mputil.is_exiting():  # finish the work, as concurrent.futures
        engine.join()
    else:
        _closing.add(engine)


class ProcessPoolExecutor(Executor):
    """A ``concurrent.futures`` executor running calls in worker processes; numpy arrays in
    arguments and results cross as shared memory.

    Same signature and semantics as ``concurrent.futures.ProcessPoolExecutor`` (Python 3.11),
    with the differences listed in the module notes (a dead worker fails one future with
    :class:`TerminatedWorkerError` and the executor stays usable; ``progress=`` on ``map``;
    lambdas).

    Args:
        max_workers: number of worker processes (default: the CPUs this process may run on;
            with ``engine="ray"``, the cluster's CPUs divided by each worker's ``num_cpus``).
        mp_context: a start-method context (tensormp's or the stdlib's; tensormp's of the same
            start method is used); default: tensormp's default context.
        initializer: called as ``initializer(*initargs)`` in each worker when it starts.
        initargs: arguments for ``initializer``; arrays arrive as shared memory.
        max_tasks_per_child: calls (or ``map`` chunks) a worker runs before it is replaced.
        engine, address, ray_remote_args, engine_options: as :class:`tensormp.Pool` (``engine="ray"`` runs the
            workers as Ray actors on a Ray cluster).

    Raises:
        ValueError: ``max_workers <= 0``, ``max_tasks_per_child < 1``, an unknown ``engine``,
            or ``address``/``ray_remote_args`` with ``engine="local"``.
        TypeError: ``initializer`` is not callable, or ``initargs`` is not a tuple.
        ImportError: ``engine="ray"`` and Ray is not installed.
        ConnectionError: ``engine="ray"`` and the cluster at ``address`` cannot be reached.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        mp_context: Any = None,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
        *,
        max_tasks_per_child: int | None = None,
        engine: str = "local",
        address: str | None = None,
        ray_remote_args: Mapping[str, Any] | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        from .context import get_context

        ctx = get_context(None if mp_context is None else mp_context.get_start_method())
        if max_workers is None and engine == "local":
            max_workers = _cpu_count()
        if max_workers is not None and (
            isinstance(max_workers, bool) or not isinstance(max_workers, int)
        ):
            raise TypeError(f"max_workers must be an int or None, got {type(max_workers).__name__}")
        if max_workers is not None and max_workers <= 0:
            raise ValueError(f"max_workers must be greater than 0, got {max_workers}")
        if max_tasks_per_child is not None and (
            isinstance(max_tasks_per_child, bool)
            or not isinstance(max_tasks_per_child, int)
            or max_tasks_per_child < 1
        ):
            raise ValueError(f"max_tasks_per_child must be >= 1, got {max_tasks_per_child!r}")
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be a callable, got {type(initializer).__name__}")
        if not isinstance(initargs, (tuple, list)):
            raise TypeError(
                f"initargs must be a tuple, got {type(initargs).__name__}; for one argument "
                "write initargs=(x,)"
            )
        # As tensormp.Pool: workers forked from us know __main__ (callables by reference first).
        self._inherited = engine == "local" and ctx.get_start_method() == "fork"
        init = None if initializer is None else _prepare(
            initializer, "initializer", inherited=self._inherited
        ).wire
        self._shutdown_lock = threading.Lock()
        self._shutdown_thread = False
        config = EngineConfig(
            processes=max_workers, initializer=init, initargs=tuple(initargs),
            maxtasks=max_tasks_per_child, owner="tensormp.ProcessPoolExecutor",
            lost_error=TerminatedWorkerError, broken_error=BrokenExecutorError, ctx=ctx,
        )
        self._engine = create(
            engine, config,
            {"address": address, "ray_remote_args": ray_remote_args, **(engine_options or {})},
        )
        self._max_workers = self._engine.processes
        _mputil.Finalize(self, _close_at_gc, (self._engine,), exitpriority=10)

    def _check(self) -> None:
        if self._engine.is_broken:
            raise self._engine.broken()
        if self._shutdown_thread:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if _shutting_down or _mputil.is_exiting():
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Schedule ``fn(*args, **kwargs)``; returns a ``Future``.

        Raises:
            RuntimeError: the executor was shut down.
            BrokenExecutorError: the executor is broken (a ``BrokenProcessPool``).
            TypeError: ``fn`` is not callable.
        """
        with self._shutdown_lock:
            self._check()
            ref = _prepare(fn, "fn", inherited=self._inherited)
            future: Future[Any] = Future()
            task = _Task(
                ref, _CALL, (args, kwargs), functools.partial(_future_sink, future),
                ("submit", ref.name, args, kwargs), start=future.set_running_or_notify_cancel,
                owner=future,
            )
            self._engine.submit([task])
            return future

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        progress: Any = False,
    ) -> Iterator[Any]:
        """``fn(*args)`` for ``args`` in ``zip(*iterables)``: an iterator of the results, in
        order (as ``concurrent.futures``: every task is submitted at once).

        Args:
            timeout: seconds from this call after which ``__next__`` raises ``TimeoutError``.
            chunksize: items per task.
            progress: True for a tqdm bar, or a callable ``progress(done, total)``; counts the
                items the caller has taken.

        Raises:
            ValueError: ``chunksize < 1``.
            ImportError: ``progress=True`` and tqdm is not installed.
            RuntimeError, BrokenExecutorError: as :meth:`submit`.
        """
        if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be >= 1, got {chunksize!r}")
        end_time = None if timeout is None else timeout + time.monotonic()
        want = _Progress.check(progress)
        items = zip(*iterables)
        with self._shutdown_lock:
            self._check()
            ref = _prepare(fn, "fn", inherited=self._inherited)
            futures: list[Future[Any]] = []
            tasks = []
            first = 0
            for index in itertools.count():
                chunk = list(itertools.islice(items, chunksize))
                if not chunk:
                    break
                future: Future[Any] = Future()
                tasks.append(_Task(
                    ref, _STARMAP, chunk, functools.partial(_future_sink, future),
                    ("map", ref.name, index, None, first, len(chunk)),
                    start=future.set_running_or_notify_cancel, owner=future,
                ))
                futures.append(future)
                first += len(chunk)
            if tasks:
                self._engine.submit(tasks)
        reporter = _Progress(progress, first, ref.name) if want else None
        return _results(futures, end_time, reporter)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks; the workers exit once the submitted ones are done (as
        ``concurrent.futures``).

        Args:
            wait: block until the work is done and the workers have exited.
            cancel_futures: cancel the futures whose task was not sent to a worker yet.
        """
        with self._shutdown_lock:
            self._shutdown_thread = True
            if cancel_futures:
                for task in self._engine.take_pending():
                    if task.owner is not None:
                        task.owner.cancel()
        self._engine.close()
        if wait:
            self._engine.join()

    def __repr__(self) -> str:
        engine = self._engine
        state = "broken" if engine.is_broken else ("shutdown" if self._shutdown_thread else "running")
        return (
            f"<tensormp.ProcessPoolExecutor {state} max_workers={self._max_workers} "
            f"{engine.describe()}>"
        )


def _results(
    futures: list[Future[Any]], end_time: float | None, reporter: _Progress | None
) -> Iterator[Any]:
    # Keeps no reference to a result it has yielded, as concurrent.futures: each is popped from
    # its chunk (the future's result list) as it goes out, and the future is dropped.
    done = 0
    try:
        futures.reverse()
        while futures:
            future = futures.pop()
            if end_time is None:
                chunk = future.result()
            else:
                chunk = future.result(end_time - time.monotonic())
            del future
            chunk.reverse()
            while chunk:
                done += 1
                if reporter is not None:
                    reporter.update(done)
                yield chunk.pop()
    finally:
        for future in futures:
            future.cancel()
        if reporter is not None:
            reporter.close()
