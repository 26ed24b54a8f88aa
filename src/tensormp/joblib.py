"""The joblib backend ``"tensormp"``: ``joblib.Parallel`` (and so scikit-learn's ``n_jobs``) on
tensormp worker processes, with numpy arrays in arguments *and* results crossing as shared
memory.

Usage:

    import joblib
    import tensormp.joblib  # registers the backend (or call tensormp.joblib.register())

    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        out = joblib.Parallel()(joblib.delayed(f)(a) for a in arrays)

Design note
-----------
**Engine.** The backend runs joblib's batches on a public :class:`tensormp.Pool`
(``apply_async`` with callbacks), and nothing below it. As loky's reusable executor, one pool
is kept between ``Parallel`` calls (sklearn makes many) and reused while ``n_jobs``, the start
method, the worker environment and the initializer are the same; it is closed once idle for
``idle_worker_timeout`` seconds (300, as loky), by :func:`shutdown`, or at interpreter exit. A
``Parallel`` call that needs another shape while the shared pool is busy with another call gets
a private pool, closed at the end of that call. A process forked from one that holds the
shared pool starts without one (``os.register_at_fork``): the parent's pool and its manager
thread are not the child's.

**What crosses how.** joblib hands the backend a ``BatchedCalls``: a list of
``(function, args, kwargs)``. The backend sends the list itself (not the ``BatchedCalls``
object) as the argument of a top-level function, so the whole message is pickled by tensormp's
reducers: every numpy array (and torch tensor) anywhere in ``args``/``kwargs`` crosses as a
handle to shared memory (one copy into a shared block for an array not yet shared, none for
one that is). What plain pickle refuses (lambdas, local functions, functions of ``__main__``,
objects holding them) is pickled *by value* with cloudpickle, one top-level argument at a time,
so a lambda next to an array does not drag the array into the by-value pickle. Which arguments
need that is found by a *probe* (``_by_value.pickles``): a plain pickle into a null sink that
skips the arrays and tensors of the reducer table, so its cost does not grow with their size;
which functions, by the rule of ``_by_value.needs_value`` for workers kept between calls. Results take the same path back: arrays in results
are copied once into the worker's shared memory, the parent maps them. Functions sent by value
are unpickled once per worker (cached by their bytes).

What differs from loky: arguments arrive as writable shared arrays (loky's default hands large
arrays over as read-only memory maps of a temporary file and small ones as copies); a write
into an argument that was not already shared memory changes the worker's shared copy, not the
caller's array, while a write into an argument made with ``tensormp.empty/zeros/...`` or
``tensormp.share`` is seen by the caller. ``max_nbytes``, ``mmap_mode`` and ``temp_folder`` are
ignored: nothing is written to disk. Tensors follow the arrays' rule, not torch's (which moves a
tensor's storage into shared memory when it is sent): the batch is sent marked
:func:`tensormp.reducers.copy_private`, so an ordinary tensor crosses as a copy, and the
caller's stays as it was (as under loky); only memory shared on purpose is written through.

**Workers.** ``initializer``/``initargs`` given to ``Parallel`` or ``parallel_config`` run in
each worker after the thread limits below (:class:`_WorkerInit`); they are part of what the
kept pool must match. A pool forked while this thread handles an exception (joblib's
``abort_everything`` runs in its ``except`` block) is started from a new thread, so its workers
do not inherit that exception as the ``__context__`` of their own.

**Failures.** A task that raises: the exception reaches the caller with the worker's traceback
as ``__cause__``, and joblib aborts the remaining batches. A batch that could not be pickled
fails with ``pickle.PicklingError`` (loky's message), its cause the object's own error. A
worker that dies (a signal, the OOM killer, ``os._exit``, a crash in native code, a task's
``KeyboardInterrupt``): its batch fails with
:class:`TerminatedWorkerError`, which is both loky's ``TerminatedWorkerError`` (what joblib's
default backend raises, a ``BrokenProcessPool``) and ``tensormp.TerminatedWorkerError`` (pid,
exit code, signal name, the task; ``__cause__``: the worker's Python stack when known). joblib
then calls :meth:`TensormpBackend.abort_everything`, which terminates the pool's workers (as
loky kills its workers) so the batches still running stop; the next call starts a fresh pool.

**Threads and nesting.** As loky, workers limit the thread pools of OpenMP, OpenBLAS, MKL...
to ``cpu_count() // n_jobs`` threads (environment variables set before the libraries load;
under ``fork``, where they are already loaded, through threadpoolctl when it is installed), and
a ``Parallel`` call inside a task runs in threads (joblib's nested backend); one naming a
process backend runs sequentially (the workers are daemonic, as the stdlib ``Pool``'s).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import reprlib
import sys
import threading
import warnings
from collections.abc import Callable
from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined]  # not in typeshed
from typing import Any

try:
    import joblib as _joblib
    from joblib.externals.loky.process_executor import (
        TerminatedWorkerError as _LokyTerminatedWorkerError,
    )
    from joblib.parallel import (
        AutoBatchingMixin,
        BatchedCalls,
        FallbackToBackend,
        ParallelBackendBase,
        SequentialBackend,
        parallel_config,
    )
except ImportError as _e:  # pragma: no cover - exercised without joblib only
    raise ImportError(
        "tensormp.joblib needs joblib: pip install 'tensormp[joblib]'"
    ) from _e

import tensormp
from tensormp._by_value import is_array, needs_value, pickles
from tensormp.futures import TerminatedWorkerError as _TensormpTerminatedWorkerError
from tensormp.pool import Pool, WorkerLostError
from tensormp.pool.tasks import _initargs
from tensormp.reducers import copy_private

__all__ = ["TensormpBackend", "TerminatedWorkerError", "register", "shutdown"]

#: The name the backend is registered under.
BACKEND_NAME = "tensormp"


# joblib ships no type information: its classes are Any to mypy.
class TerminatedWorkerError(_TensormpTerminatedWorkerError, _LokyTerminatedWorkerError):  # type: ignore[misc]
    """A worker died while it ran a batch of a ``joblib.Parallel`` call.

    Both joblib's ``joblib.externals.loky.process_executor.TerminatedWorkerError`` (what joblib's
    default loky backend raises; a ``concurrent.futures.process.BrokenProcessPool``) and
    :class:`tensormp.TerminatedWorkerError`, with its attributes ``pid``, ``exitcode``,
    ``signal_name`` and ``task``. ``__cause__`` holds the worker's Python stack when it is known
    (the faulthandler dump of a SIGSEGV, the traceback of a ``sys.exit()``).
    """

    __module__ = "tensormp.joblib"


# -- what crosses, and how -----------------------------------------------------------------
_FN_CACHE: dict[bytes, Any] = {}
_FN_CACHE_MAX = 64


def _loads(data: bytes, is_function: bool) -> Any:
    """Rebuild an object sent by value; functions are unpickled once per process."""
    if not is_function:
        return pickle.loads(data)
    fn = _FN_CACHE.get(data)
    if fn is None:
        if len(_FN_CACHE) >= _FN_CACHE_MAX:
            _FN_CACHE.clear()
        fn = _FN_CACHE[data] = pickle.loads(data)
    return fn


class _ByValue:
    """An object that travels pickled by cloudpickle inside tensormp's message."""

    __slots__ = ("data", "is_function")

    def __init__(self, data: bytes, is_function: bool) -> None:
        self.data = data
        self.is_function = is_function

    def __reduce__(self) -> tuple[Any, ...]:
        return _loads, (self.data, self.is_function)


# Types that always pickle (array types are added as they are met: tensormp's reducers send
# them): no probe for them.
_PLAIN: set[type] = {int, float, complex, bool, str, bytes, type(None)}


def _by_value(obj: Any, is_function: bool) -> Any:
    import cloudpickle

    try:
        return _ByValue(cloudpickle.dumps(obj, pickle.HIGHEST_PROTOCOL), is_function)
    except Exception:  # noqa: BLE001 - tensormp's pickler then reports the object
        return obj


def _wire(obj: Any) -> Any:
    """``obj``, or a by-value wrapper when plain pickle (and so tensormp's) refuses it."""
    if type(obj) in _PLAIN:
        return obj
    if is_array(obj):
        _PLAIN.add(type(obj))
        return obj
    if pickles(obj, skip_arrays=True):
        return obj
    return _by_value(obj, False)


def _wire_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    plain = _PLAIN
    for a in args:
        if type(a) not in plain:
            return tuple([_wire(x) for x in args])
    return args


def _wire_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    plain = _PLAIN
    for v in kwargs.values():
        if type(v) not in plain:
            return {k: _wire(x) for k, x in kwargs.items()}
    return kwargs


def _wire_fn(fn: Any) -> Any:
    """``fn`` as it travels: itself, or by value when workers may not import it by name (the
    kept pool's workers may be older than the function: ``_by_value.needs_value``)."""
    if fn is not None and needs_value(fn, foreign_workers=True):
        return _by_value(fn, True)
    return fn


class _Functions:
    """The wire form of each function of one ``Parallel`` call, decided once per function."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, Any]] = {}  # id -> (function kept alive, wire form)
        self._last: tuple[Any, Any] = (None, None)

    def wire(self, fn: Any) -> Any:
        last = self._last
        if last[0] is fn:
            return last[1]
        hit = self._seen.get(id(fn))
        if hit is not None and hit[0] is fn:
            self._last = hit
            return hit[1]
        wire = _wire_fn(fn)
        if len(self._seen) > 1024:
            self._seen.clear()
        self._seen[id(fn)] = self._last = (fn, wire)
        return wire


Item = tuple[Any, tuple[Any, ...], dict[str, Any]]


def _wire_item(item: Item, functions: _Functions) -> Item:
    """One ``(function, args, kwargs)`` of a batch as it travels (itself when nothing needs
    sending by value: the common case costs no copy)."""
    fn, args, kwargs = item
    w, a, k = functions.wire(fn), _wire_args(args), _wire_kwargs(kwargs) if kwargs else kwargs
    if w is fn and a is args and k is kwargs:
        return item
    return (w, a, k)


def _run_batch(items: list[Item], backend: Any, n_jobs: int | None) -> list[Any]:
    """Worker side: run a batch as ``BatchedCalls.__call__`` does (nested calls use the nested
    backend joblib chose), and send results plain pickle refuses by value."""
    with parallel_config(backend=backend, n_jobs=n_jobs):
        return [_wire(fn(*args, **kwargs)) for fn, args, kwargs in items]


def _run_call(fn: Callable[[], Any]) -> Any:
    """Worker side: a callable that is not a ``BatchedCalls``."""
    return _wire(fn())


class _WorkerInit:
    """The pool's initializer: limit native thread pools, as loky does for its workers, then
    run the user's ``initializer(*initargs)`` (given to ``Parallel`` or ``parallel_config``)."""

    __slots__ = ("env", "fn", "args", "name")

    def __init__(self, env: dict[str, str], fn: Any, args: tuple[Any, ...], name: str) -> None:
        self.env = env
        self.fn = fn  # the user's initializer as it travels (by value: a _ByValue), or None
        self.args = args
        self.name = name  # the pool names its initializer by this when it raises

    def __call__(self) -> None:
        os.environ.update(self.env)
        if "numpy" in sys.modules:  # fork: the libraries are loaded already
            try:
                from threadpoolctl import threadpool_limits
            except ImportError:
                pass
            else:
                threadpool_limits(int(self.env["OMP_NUM_THREADS"]))
        if self.fn is not None:
            self.fn(*self.args)


# -- the reusable pool -----------------------------------------------------------------------
# (n_jobs, start method, worker environment, (initializer, initargs) or None)
_PoolKey = tuple[int, str, tuple[tuple[str, str], ...], tuple[Any, tuple[Any, ...]] | None]


def _same_key(a: _PoolKey | None, b: _PoolKey) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - initargs holding arrays (== is elementwise): not equal
        return False


class _Reusable:
    """The pool kept between ``Parallel`` calls (as loky's reusable executor)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pool: Pool | None = None
        self.key: _PoolKey | None = None
        self.users = 0
        self.timer: threading.Timer | None = None

    def acquire(self, key: _PoolKey) -> tuple[Pool, bool]:
        """A pool for one ``Parallel`` call: (pool, whether it is the shared one)."""
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            if self.pool is not None and _same_key(self.key, key):
                self.users += 1
                return self.pool, True
            if self.pool is not None and self.users > 0:
                return _new_pool(key), False  # the shared pool is busy with another shape
            old, self.pool, self.key = self.pool, _new_pool(key), key
            self.users += 1
            pool = self.pool
        if old is not None:
            old.close()
            old.join()
        return pool, True

    def release(self, pool: Pool, idle_timeout: float | None) -> None:
        with self.lock:
            if pool is not self.pool:
                return
            self.users = max(0, self.users - 1)
            if self.users == 0 and idle_timeout is not None:
                self.timer = threading.Timer(idle_timeout, self._idle, (pool,))
                self.timer.daemon = True
                self.timer.start()

    def discard(self, pool: Pool) -> None:
        """``pool`` was terminated: do not hand it out again."""
        with self.lock:
            if pool is self.pool:
                self.pool = self.key = None
                self.users = 0

    def _idle(self, pool: Pool) -> None:
        with self.lock:
            if pool is not self.pool or self.users:
                return
            self.pool = self.key = None
            self.timer = None
        pool.close()
        pool.join()

    def shutdown(self) -> None:
        with self.lock:
            pool, self.pool, self.key, self.users = self.pool, None, None, 0
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
        if pool is not None:
            pool.terminate()
            pool.join()


    def forget(self) -> None:
        """In a forked child: the parent's pool and its threads are not ours."""
        self.__init__()  # type: ignore[misc]


_reusable = _Reusable()
os.register_at_fork(after_in_child=_reusable.forget)


def _new_pool(key: _PoolKey) -> Pool:
    n_jobs, method, env, init = key
    fn, args = init if init is not None else (None, ())
    name = _function_name(fn) if fn is not None else "tensormp.joblib's worker set-up"
    if method != "fork":  # (forked workers inherit them as they are)
        fn, args = _wire_fn(fn), _wire_args(args)
    ctx = tensormp.get_context(method)

    def start() -> Pool:
        initializer = _WorkerInit(dict(env), fn, args, name)
        return ctx.Pool(n_jobs, initializer=initializer)  # type: ignore[no-any-return]

    if method == "fork" and sys.exc_info()[1] is not None:
        # Forked in the middle of handling an exception (joblib's abort_everything, called in
        # its `except` block; a `Parallel` call in the user's), a worker would inherit it: a
        # task's exception would carry it as `__context__`, and its traceback the parent's
        # failure. A new thread handles no exception: fork from one.
        return _in_new_thread(start)
    return start()


def _in_new_thread(fn: Callable[[], Pool]) -> Pool:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out.append((False, e))

    thread = threading.Thread(target=run, name="tensormp.joblib pool start")
    thread.start()
    try:
        thread.join()
    except BaseException:  # Ctrl-C while the workers start: stop them, then give it back
        thread.join()
        if out and out[0][0]:
            out[0][1].terminate()
            out[0][1].join()
        raise
    ok, value = out[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


def shutdown() -> None:
    """Stop the workers the backend keeps between ``Parallel`` calls now (they also stop
    after ``idle_worker_timeout`` seconds without work, and at interpreter exit)."""
    _reusable.shutdown()


class _Outcome:
    __slots__ = ("ok", "value", "func")

    def __init__(self, ok: bool, value: Any, func: Any = None) -> None:
        self.ok = ok
        self.value = value
        self.func = func  # what was submitted, to name it in an error


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


def _function_name(fn: Any) -> str:
    fn = getattr(fn, "function", None) or fn  # scikit-learn's delayed wraps the function
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _describe(func: Any) -> str:
    """``work(array([...]), k=2) and 31 more calls``: a batch as a person reads it."""
    items = getattr(func, "items", None)
    if not items:
        return _repr.repr(func)
    fn, args, kwargs = items[0]
    name = _function_name(fn)
    parts = [_repr.repr(a) for a in args[:4]] + ["..."] * (len(args) > 4)
    parts += [f"{k}={_repr.repr(v)}" for k, v in list(kwargs.items())[:4]]
    more = f" and {len(items) - 1} more call(s)" if len(items) > 1 else ""
    return f"{name}({', '.join(parts)}){more}"


def _lost(error: WorkerLostError, func: Any) -> TerminatedWorkerError:
    how = (
        f"was killed by signal {error.signal_name}" if error.signal_name
        else f"exited with code {error.exitcode}"
    )
    hint = (
        " SIGKILL comes from the kernel's out-of-memory killer when memory runs out (see "
        "`dmesg`), or from a `kill -9`." if error.signal_name == "SIGKILL" else ""
    )
    task = _describe(func)
    lost = TerminatedWorkerError(
        f"a worker of the tensormp joblib backend (pid {error.pid}) {how} while running "
        f"{task}.{hint} The call's other batches were stopped; the next call starts fresh "
        "workers.",
        error.pid, error.exitcode, task,
    )
    lost.__cause__ = error.__cause__  # the worker's Python stack, when known
    return lost


def _initializer(fn: Any, args: Any) -> tuple[Any, tuple[Any, ...]] | None:
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(
            f"initializer must be callable, got {type(fn).__name__}: {_repr.repr(fn)}"
        )
    return fn, _initargs(args)


def _unpicklable(error: BaseException, func: Any) -> pickle.PicklingError:
    return pickle.PicklingError(
        # loky's words first: what programs and their tests match
        f"Could not pickle the task to send it to the workers. {_describe(func)} holds an "
        f"object that cannot be pickled ({type(error).__name__}: {error}); create it inside "
        "the task, or pass what it is made from."
    )


class TensormpBackend(AutoBatchingMixin, ParallelBackendBase):  # type: ignore[misc]
    """joblib backend running batches in tensormp worker processes (see the module notes).

    Selected with ``joblib.parallel_config(backend="tensormp", n_jobs=N)`` once registered
    (``import tensormp.joblib``); extra keyword arguments of ``parallel_config`` reach the
    constructor.

    Args:
        nesting_level: set by joblib.
        inner_max_num_threads: threads each worker's native thread pools may use (default:
            ``cpu_count() // n_jobs``, unless the variables are set in the environment).
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"`` (default: tensormp's default
            start method).
        idle_worker_timeout: seconds the workers are kept without work between calls (300,
            as loky); None keeps them until :func:`shutdown` or exit.

    Raises:
        ValueError: ``n_jobs == 0``, or an unknown ``start_method``.
    """

    supports_retrieve_callback = True
    supports_inner_max_num_threads = True
    supports_sharedmem = False
    uses_threads = False

    def __init__(
        self,
        nesting_level: int | None = None,
        inner_max_num_threads: int | None = None,
        start_method: str | None = None,
        idle_worker_timeout: float | None = 300.0,
        **backend_kwargs: Any,
    ) -> None:
        super().__init__(
            nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads,
            **backend_kwargs,
        )
        if start_method is not None and start_method not in ("fork", "spawn", "forkserver"):
            raise ValueError(
                f"start_method must be 'fork', 'spawn' or 'forkserver', got {start_method!r}"
            )
        self.start_method = start_method
        self.idle_worker_timeout = idle_worker_timeout
        self._pool: Pool | None = None
        self._shared = False
        self._functions = _Functions()

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        """Workers a call with ``n_jobs`` gets (as loky: -1 = every CPU, 1 inside a worker
        process or a thread of a nested call).

        Raises:
            ValueError: ``n_jobs == 0``.
        """
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        import multiprocessing

        if multiprocessing.current_process().daemon:
            if n_jobs != 1:
                warnings.warn(
                    "tensormp-backed parallel loops cannot be nested in a worker process, "
                    "setting n_jobs=1", stacklevel=3,
                )
            return 1
        if not (self.in_main_thread() or self.nesting_level == 0):
            if n_jobs != 1:
                warnings.warn(
                    "tensormp-backed parallel loops cannot be nested below threads, setting "
                    "n_jobs=1", stacklevel=3,
                )
            return 1
        if n_jobs < 0:
            n_jobs = max(_joblib.cpu_count() + 1 + n_jobs, 1)
        return int(n_jobs)

    def configure(
        self,
        n_jobs: int | None = 1,
        parallel: Any = None,
        prefer: str | None = None,
        require: str | None = None,
        idle_worker_timeout: float | None = None,
        **memmapping_kwargs: Any,
    ) -> int:
        """Get the workers for a ``Parallel`` call; returns their number.

        ``initializer``/``initargs`` (given to ``Parallel`` or, for every call,
        ``parallel_config``; ``Parallel``'s win) run ``initializer(*initargs)`` in each worker
        as it starts, as loky does; workers kept from a call with another initializer are not
        reused. ``max_nbytes``, ``mmap_mode`` and ``temp_folder`` (loky's memory-mapping
        settings) are ignored: arrays cross as shared memory.

        Raises:
            TypeError: ``initializer`` is not callable, or ``initargs`` is not a tuple.
        """
        n = self.effective_n_jobs(n_jobs)
        if n == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        if idle_worker_timeout is not None:
            self.idle_worker_timeout = idle_worker_timeout
        options = {**self.backend_kwargs, **memmapping_kwargs}
        method = self.start_method or tensormp.get_start_method()
        env = tuple(sorted(self._prepare_worker_env(n_jobs=n).items()))
        init = _initializer(options.get("initializer"), options.get("initargs", ()))
        self._release()
        self._pool, self._shared = _reusable.acquire((n, method, env, init))
        self._functions = _Functions()
        self.parallel = parallel
        return n

    def submit(self, func: Callable[[], Any], callback: Callable[[Any], Any] | None = None) -> Any:
        """Send one batch to a worker; ``callback`` gets its outcome in the pool's manager
        thread. Returns the pool's ``AsyncResult``."""
        if self._pool is None:
            raise RuntimeError("the tensormp joblib backend was terminated; configure it first")
        target: Callable[..., Any]
        args: tuple[Any, ...]
        # copy_private: an ordinary torch tensor crosses as a copy, as an ordinary array does
        # (torch's own rule moves its storage into shared memory, where the worker's writes
        # would reach the caller); only memory shared on purpose is written through, as loky.
        if isinstance(func, BatchedCalls):
            functions = self._functions
            items = [_wire_item(item, functions) for item in func.items]
            target, args = _run_batch, (copy_private(items), func._backend, func._n_jobs)
        else:
            target, args = _run_call, (copy_private(self._functions.wire(func)),)
        if callback is None:
            return self._pool.apply_async(target, args)

        def done(value: Any) -> None:
            callback(_Outcome(True, value))

        def failed(error: BaseException) -> None:
            callback(_Outcome(False, error, func))

        return self._pool.apply_async(target, args, callback=done, error_callback=failed)

    def retrieve_result_callback(self, out: _Outcome) -> Any:
        """The batch's results, or its exception (a dead worker: :class:`TerminatedWorkerError`).

        Raises:
            TerminatedWorkerError: the worker died while it ran the batch.
            BaseException: whatever the batch raised.
        """
        if out.ok:
            return out.value
        error = out.value
        if isinstance(error, WorkerLostError) and not isinstance(error, TerminatedWorkerError):
            raise _lost(error, out.func)
        if not isinstance(error.__cause__, RemoteTraceback) and not isinstance(
            error, tensormp.TensormpError
        ):
            # Not from a worker (whose errors carry its traceback) nor the pool: pickling the
            # batch failed here.
            raise _unpicklable(error, out.func) from error
        raise error

    def retrieve_result(self, out: Any, timeout: float | None = None) -> Any:
        """The result of an ``AsyncResult`` (joblib uses the callback path instead)."""
        return out.get(timeout=timeout)

    def terminate(self) -> None:
        """End of a ``Parallel`` call: keep the shared workers for the next call (as loky)."""
        self._release()
        self.reset_batch_stats()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        """Stop the batches still running (a task failed): terminate the workers, as loky
        kills its workers; with ``ensure_ready``, get fresh ones for the same call."""
        pool, self._pool = self._pool, None
        if pool is not None:
            _reusable.discard(pool)
            pool.terminate()
            pool.join()
        # joblib (1.6) keeps the batches it had split off but not yet dispatched in a queue that
        # lives as long as the Parallel object: inside `with Parallel(...) as par:` the next
        # call would dispatch the failed call's batches first and return their results in front
        # of its own. They belong to the aborted call: drop them.
        ready = getattr(self.parallel, "_ready_batches", None)
        if ready is not None:
            with contextlib.suppress(queue.Empty):
                while True:
                    ready.get_nowait()
        if ensure_ready and self.parallel is not None:
            self.configure(
                n_jobs=self.parallel.n_jobs, parallel=self.parallel,
                **self.parallel._backend_kwargs,
            )

    def _release(self) -> None:
        pool, self._pool = self._pool, None
        self._functions = _Functions()
        if pool is None:
            return
        if self._shared:
            _reusable.release(pool, self.idle_worker_timeout)
        else:
            pool.close()
            pool.join()

    def __repr__(self) -> str:
        return (
            f"<tensormp.joblib.TensormpBackend start_method={self.start_method} "
            f"pool={self._pool!r}>"
        )


def register() -> None:
    """Register the backend with joblib under the name ``"tensormp"`` (done by
    ``import tensormp.joblib``; call again after joblib's registry was reset)."""
    _joblib.register_parallel_backend(BACKEND_NAME, TensormpBackend)


register()
