"""The public :class:`Pool`: the stdlib's API (argument checks, chunking, the ``imap`` feeder
thread, close/terminate/join) on top of an engine (``engines/__init__.py``: the interface;
``local`` or ``ray``).
"""

from __future__ import annotations

import functools
import itertools
import reprlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing import util as _mputil
from typing import Any

from .._cpus import cpu_count as _cpu_count
from .engines import RUN, Engine, EngineConfig, create
from .errors import BrokenPoolError, WorkerLostError
from .progress import _Progress
from .results import AsyncResult, IMapIterator, MapResult
from .tasks import _CALL, _MAP, _STARMAP, _Fn, _initargs, _prepare, _Task


def _check_chunksize(chunksize: Any) -> None:
    if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
        raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")


def _check_callbacks(callback: Any, error_callback: Any) -> None:
    for name, value in (("callback", callback), ("error_callback", error_callback)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")


def _feed(
    engine: Engine, fn: _Fn, items: Iterator[Any], chunksize: int, result: IMapIterator,
    what: str, at_hand: bool,
) -> None:
    """Feeder thread of imap: chunks from ``items`` into the engine, never many ahead.

    ``at_hand``: the iterable is a list, tuple or range, whose items are there already; then
    the chunks that fit go in together (one hand-off to the manager for many tiny tasks).
    Others are pulled one chunk at a time and each goes at once: a generator may take long to
    give the next item, and what it gave must not wait for it.
    """
    index = 0
    first = 0
    try:
        while True:
            room = engine.wait_room()
            if not room:
                raise engine.broken_error(
                    f"{engine.owner} was terminated before {what}() submitted every item "
                    f"(stopped after {first})"
                )
            tasks = []
            for _ in range(room if at_hand else 1):
                chunk = list(itertools.islice(items, chunksize))
                if not chunk:
                    break
                label = (what, fn.name, index, None, first, len(chunk))
                sink = functools.partial(result._set, index)
                tasks.append(_Task(fn, _MAP, chunk, sink, label))
                index += 1
                first += len(chunk)
            if not tasks:
                break
            engine.submit(tasks, feeder=True)
            del tasks, chunk
    except BaseException as e:  # noqa: BLE001 - the iterable raised, or the pool broke
        result._fail_feed(index, e)
        index += 1
    finally:
        result._set_length(index)
        engine.feeder_done()


class Pool:
    """A pool of worker processes: ``multiprocessing.Pool`` whose arguments and results
    travel through shared memory.

    Same signature and methods as the stdlib's ``multiprocessing.pool.Pool`` (whose
    documentation applies), with these differences:

    * numpy arrays in arguments and results cross as shared memory (one copy for an array not
      yet shared, none for one that is; a 64 MiB result costs one ``memcpy``, not a pickle);
    * a worker that dies (a signal, the OOM killer, ``os._exit``, a crash) fails the task it
      was running with :class:`WorkerLostError` instead of hanging; the pool replaces it;
    * a failing initializer makes the pool broken (:class:`BrokenPoolError`) instead of
      respawning workers forever; ``terminate()`` fails unfinished results instead of leaving
      them to hang;
    * ``map``, ``starmap``, ``imap`` and ``imap_unordered`` take ``progress=True`` (a tqdm bar,
      ``pip install 'tensormp[progress]'``) or ``progress=callable(done, total)``;
    * functions may be lambdas or closures (sent with cloudpickle);
    * ``imap`` pulls from its iterable only as workers need it (the stdlib reads it whole);
    * workers ignore SIGINT: a Ctrl-C interrupts the parent, which stops the workers.

    Args:
        processes: number of workers (default: the CPUs this process may run on; with
            ``engine="ray"``, the cluster's CPUs divided by each worker's ``num_cpus``).
        initializer: called as ``initializer(*initargs)`` in each worker when it starts.
        initargs: arguments for ``initializer``; arrays arrive as shared memory.
        maxtasksperchild: tasks (calls, or map chunks) a worker runs before it is replaced
            (None: no limit).
        context: a start-method context (tensormp's or the stdlib's; tensormp's of the same
            start method is used); default: tensormp's default context. The local engine's
            only.
        engine: ``"local"`` (worker processes of this machine, arrays as shared memory) or
            ``"ray"`` (workers are Ray actors on a Ray cluster, arrays travel through Ray's
            object store; ``pip install 'tensormp[ray]'``). See *Beyond one machine*
            (``docs/beyond-one-machine.md``) for what differs.
        address: ``engine="ray"``: the cluster's address (``"10.0.0.5:6379"``, ``"auto"``);
            default: ``$RAY_ADDRESS``, else the cluster this process is connected to, else a
            local Ray started for this pool and stopped with it.
        ray_remote_args: ``engine="ray"``: options for each worker actor
            (``actor.options(**ray_remote_args)``), e.g. ``{"num_cpus": 2}`` or
            ``{"resources": {...}}``; default ``{"num_cpus": 1}``.
        engine_options: further keywords for the engine (an engine added with
            ``tensormp.pool.engines.register_engine`` takes its own: ``docs/engines.md``).

    Raises:
        ValueError: ``processes < 1``, ``maxtasksperchild`` not a positive int, an unknown
            ``engine``, or ``address``/``ray_remote_args`` with ``engine="local"``.
        TypeError: ``initializer`` is not callable, or ``initargs`` is not a tuple.
        ImportError: ``engine="ray"`` and Ray is not installed.
        ConnectionError: ``engine="ray"`` and the cluster at ``address`` cannot be reached.
    """

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        context: Any = None,
        *,
        engine: str = "local",
        address: str | None = None,
        ray_remote_args: Mapping[str, Any] | None = None,
        engine_options: Mapping[str, Any] | None = None,
    ) -> None:
        from ..context import get_context

        ctx = get_context(None if context is None else context.get_start_method())
        if processes is None and engine == "local":
            processes = _cpu_count()
        if processes is not None and (isinstance(processes, bool) or not isinstance(processes, int)):
            raise TypeError(f"processes must be an int or None, got {type(processes).__name__}")
        if processes is not None and processes < 1:
            raise ValueError(f"Number of processes must be at least 1, got {processes}")
        if maxtasksperchild is not None and (
            isinstance(maxtasksperchild, bool)
            or not isinstance(maxtasksperchild, int)
            or maxtasksperchild <= 0
        ):
            raise ValueError(
                f"maxtasksperchild must be a positive int or None, got {maxtasksperchild!r}"
            )
        initargs = _initargs(initargs)
        # Workers forked from us (nothing pickled for them at start: their initializer is
        # inherited, whatever it is) know __main__: callables go by reference first.
        self._inherited = engine == "local" and ctx.get_start_method() == "fork"
        init = None if initializer is None else _prepare(
            initializer, "initializer", inherited=self._inherited
        ).wire
        config = EngineConfig(
            processes=processes, initializer=init, initargs=initargs,
            maxtasks=maxtasksperchild, owner="tensormp.Pool", lost_error=WorkerLostError,
            broken_error=BrokenPoolError, ctx=ctx, pool_names=True,
        )
        self._engine = create(
            engine, config,
            {"address": address, "ray_remote_args": ray_remote_args, **(engine_options or {})},
        )
        self._processes = self._engine.processes
        self._terminate = _mputil.Finalize(self, self._engine.terminate, exitpriority=15)

    # -- single calls -----------------------------------------------------------------------
    def apply(self, func: Callable[..., Any], args: Iterable[Any] = (),
              kwds: Mapping[str, Any] | None = None) -> Any:
        """``func(*args, **kwds)`` in a worker; blocks until it returns (as the stdlib).

        Raises:
            WorkerLostError: the worker died while running it.
            Exception: whatever ``func`` raised (``__cause__``: its remote traceback).
        """
        return self._apply_async(func, args, kwds, None, None, "apply").get()

    def apply_async(
        self, func: Callable[..., Any], args: Iterable[Any] = (),
        kwds: Mapping[str, Any] | None = None, callback: Callable[[Any], Any] | None = None,
        error_callback: Callable[[BaseException], Any] | None = None,
    ) -> AsyncResult:
        """``func(*args, **kwds)`` in a worker; returns an :class:`AsyncResult` at once.

        ``callback(result)`` or ``error_callback(exception)`` runs in the pool's manager thread
        when it completes (as the stdlib's result thread).

        Raises:
            ValueError: the pool is closed or terminated.
            BrokenPoolError: the pool is broken.
            TypeError: ``func`` or a callback is not callable, ``args`` is not a tuple or
                ``kwds`` not a mapping.
        """
        return self._apply_async(func, args, kwds, callback, error_callback, "apply_async")

    def _apply_async(
        self, func: Any, args: Any, kwds: Any, callback: Any, error_callback: Any, what: str
    ) -> AsyncResult:
        self._engine.check_running()
        fn = _prepare(func, inherited=self._inherited)
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                f"args must be a tuple of arguments for func(*args), got {type(args).__name__};"
                f" for one argument write args=({reprlib.repr(args)},)"
            )
        if kwds is None:
            kwds = {}
        if not isinstance(kwds, Mapping):
            raise TypeError(f"kwds must be a mapping, got {type(kwds).__name__}")
        _check_callbacks(callback, error_callback)
        args, kwds = tuple(args), dict(kwds)
        result = AsyncResult(self, callback, error_callback)
        sink = functools.partial(result._set, 0)
        task = _Task(fn, _CALL, (args, kwds), sink, (what, fn.name, args, kwds))
        self._engine.submit([task])
        return result

    # -- maps -------------------------------------------------------------------------------
    def map(self, func: Callable[[Any], Any], iterable: Iterable[Any],
            chunksize: int | None = None, *, progress: Any = False) -> list[Any]:
        """``[func(x) for x in iterable]`` in the workers, in order (as the stdlib).

        The iterable is split into chunks of ``chunksize`` items (default: about 4 chunks per
        worker); each chunk is one task.

        Args:
            progress: True for a tqdm progress bar on stderr (``pip install
                'tensormp[progress]'``), or a callable ``progress(done, total)`` called in the
                caller's thread as chunks complete (items done, items in all).

        Raises:
            WorkerLostError: a worker died while running a chunk.
            ImportError: ``progress=True`` and tqdm is not installed.
            Exception: the first exception a chunk raised.
        """
        return self._map_blocking(func, iterable, _MAP, chunksize, progress, "map")

    def starmap(self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]],
                chunksize: int | None = None, *, progress: Any = False) -> list[Any]:
        """``[func(*args) for args in iterable]`` in the workers, in order (as the stdlib).

        ``progress`` as in :meth:`map`.
        """
        return self._map_blocking(func, iterable, _STARMAP, chunksize, progress, "starmap")

    def map_async(
        self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int | None = None,
        callback: Callable[[Any], Any] | None = None,
        error_callback: Callable[[BaseException], Any] | None = None,
    ) -> MapResult:
        """:meth:`map` returning a :class:`MapResult` at once (callbacks as
        :meth:`apply_async`; an empty iterable calls ``callback([])``, unlike the stdlib)."""
        return self._map_async(func, iterable, _MAP, chunksize, callback, error_callback, "map")

    def starmap_async(
        self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]],
        chunksize: int | None = None, callback: Callable[[Any], Any] | None = None,
        error_callback: Callable[[BaseException], Any] | None = None,
    ) -> MapResult:
        """:meth:`starmap` returning a :class:`MapResult` at once."""
        return self._map_async(
            func, iterable, _STARMAP, chunksize, callback, error_callback, "starmap"
        )

    def _map_blocking(
        self, func: Any, iterable: Any, kind: int, chunksize: Any, progress: Any, what: str
    ) -> list[Any]:
        want = _Progress.check(progress)
        result = self._map_async(func, iterable, kind, chunksize, None, None, what)
        if want:
            result._follow(_Progress(progress, result._length, _Fn(func, "func").name))
        return result.get()  # type: ignore[no-any-return]

    def _map_async(
        self, func: Any, iterable: Any, kind: int, chunksize: Any, callback: Any,
        error_callback: Any, what: str,
    ) -> MapResult:
        self._engine.check_running()
        fn = _prepare(func, inherited=self._inherited)
        _check_callbacks(callback, error_callback)
        items = list(iterable)
        n = len(items)
        if chunksize is None:
            chunksize, extra = divmod(n, self._processes * 4)
            chunksize = max(1, chunksize + bool(extra))
        else:
            _check_chunksize(chunksize)
        result = MapResult(self, chunksize, n, callback, error_callback)
        nchunks = -(-n // chunksize)
        tasks = []
        for i in range(nchunks):
            chunk = items[i * chunksize : (i + 1) * chunksize]
            label = (what, fn.name, i, nchunks, i * chunksize, len(chunk))
            tasks.append(_Task(fn, kind, chunk, functools.partial(result._set, i), label))
        if tasks:
            self._engine.submit(tasks)
        return result

    def imap(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1,
             *, progress: Any = False) -> IMapIterator:
        """Lazy :meth:`map`: an iterator of the results, in order (as the stdlib).

        The iterable is read as workers need items (at most a few chunks per worker ahead),
        in a feeder thread. ``progress`` counts the items the caller has taken.

        Raises:
            ValueError: bad ``chunksize``; the pool is not running.
            TypeError: ``iterable`` is not iterable.
            ImportError: ``progress=True`` and tqdm is not installed.
        """
        return self._imap(func, iterable, chunksize, progress, True, "imap")

    def imap_unordered(self, func: Callable[[Any], Any], iterable: Iterable[Any],
                       chunksize: int = 1, *, progress: Any = False) -> IMapIterator:
        """:meth:`imap` yielding results as they complete (as the stdlib)."""
        return self._imap(func, iterable, chunksize, progress, False, "imap_unordered")

    def _imap(
        self, func: Any, iterable: Any, chunksize: Any, progress: Any, ordered: bool, what: str
    ) -> IMapIterator:
        self._engine.check_running()
        fn = _prepare(func, inherited=self._inherited)
        _check_chunksize(chunksize)
        want = _Progress.check(progress)
        items = iter(iterable)
        total = len(iterable) if hasattr(iterable, "__len__") else None
        reporter = _Progress(progress, total, fn.name) if want else None
        result = IMapIterator(self, ordered, reporter)
        self._engine.feeder_started()
        try:
            threading.Thread(
                target=_feed,
                args=(self._engine, fn, items, chunksize, result, what,
                      isinstance(iterable, (list, tuple, range))),
                name=f"tensormp.Pool {what} feeder", daemon=True,
            ).start()
        except BaseException:
            self._engine.feeder_done()
            raise
        return result

    # -- life cycle -------------------------------------------------------------------------
    def close(self) -> None:
        """No new tasks; the workers exit once every submitted task is done (as the stdlib)."""
        self._engine.close()

    def terminate(self) -> None:
        """Stop the workers now (SIGTERM, then SIGKILL after 2 s) and wait for them. Unfinished
        results fail with :class:`BrokenPoolError` (the stdlib leaves them to hang)."""
        self._terminate()

    def join(self) -> None:
        """Wait for the workers to exit, after :meth:`close` or :meth:`terminate`.

        Raises:
            ValueError: the pool is still running (as the stdlib).
        """
        if self._engine.state == RUN:
            raise ValueError("Pool is still running: call close() or terminate() before join()")
        self._engine.join()

    def __enter__(self) -> Pool:
        self._engine.check_running()
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()  # as the stdlib

    def __reduce__(self) -> Any:
        raise NotImplementedError(
            "pool objects cannot be passed between processes or pickled"
        )

    def __del__(self, _warn: Any = warnings.warn) -> None:
        engine = self.__dict__.get("_engine")
        if engine is not None and engine.state == RUN:
            _warn(f"unclosed running multiprocessing pool {self!r}", ResourceWarning, source=self)

    @property
    def _pool(self) -> list[Any]:
        """The current worker ``Process`` objects (the stdlib's attribute; the local engine's,
        Ray's actor handles with ``engine="ray"``)."""
        return self._engine.worker_processes()

    def __repr__(self) -> str:
        engine = self.__dict__.get("_engine")
        if engine is None:
            return f"<tensormp.Pool uninitialised at {id(self):#x}>"
        return (
            f"<tensormp.Pool state={engine.state} pool_size={self._processes} "
            f"{engine.describe()}>"
        )
