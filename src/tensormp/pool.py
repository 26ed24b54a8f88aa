"""``Pool``: the stdlib's process pool, with arrays (arguments *and* results) moving through
shared memory, dead workers reported instead of hangs, and progress bars.

Design note
-----------
**Channels.** Each worker has its own duplex tensormp ``Connection`` (a Unix socket pair that
carries fds). There is no task queue shared by the workers and no lock shared between
processes, so a worker killed at any instant cannot wedge the others (in the stdlib, a worker
SIGKILLed while it holds the task queue's read lock blocks every other worker forever). One
*manager thread* in the parent owns the workers: it starts them, sends them tasks, reads their
results, reaps the dead and starts replacements. The caller's threads only append tasks to a
deque and wake the manager (a pipe). ``imap`` pulls from its iterable in a *feeder thread*,
which waits while many tasks are already queued, so a huge generator of arrays is never
materialised.

**Tasks.** A task is one call (``apply``) or one chunk of a map. The manager pickles it just
before sending it, with tensormp's reducers: a numpy argument not yet in shared memory is copied
once into a block of the parent's and the pickle holds a handle (~200 bytes). A worker holds at
most two tasks: the one it runs and, while more tasks wait than there are workers and the
message is small, the next one, queued in its socket so it need not wait for a round trip. A
worker runs its tasks one at a time, in the order sent. The function goes by reference when the
workers can import it by name (as the stdlib); lambdas, local functions, functions defined under
``if __name__ == "__main__":`` and callables that plain pickle refuses go by value with
cloudpickle (as ``tensormp.spawn``), unpickled once per worker.

**Results.** The worker answers ``(seq, ok, value)``: the value, or the exception with its
traceback (``multiprocessing.pool``'s ``RemoteTraceback`` as ``__cause__``, as the stdlib).
Arrays in the value are copied once into the worker's shared memory (no copy when already
shared) and the parent maps them: a 64 MiB result costs one ``memcpy``, not a pickle. The
answer belongs to the oldest task outstanding on that worker (checked by ``seq``).

**Dead workers.** The manager polls every worker's socket and process sentinel (plus a
``waitpid`` once a second, for a sentinel that a grandchild keeps open). When a worker ends, it
first reads what the socket still holds (a result sent just before death is delivered), then
the exit status. Since a worker runs its tasks in order, the oldest task still outstanding is
the one it was running: its result fails with :class:`WorkerLostError` (pid, exit code or signal
name, task; chained with the worker's traceback when a task called ``sys.exit()``, or its
faulthandler stack after SIGSEGV/SIGBUS/SIGABRT...). A younger task was never read: it is
pickled anew for another worker. The pool starts a replacement and stays usable. A worker
that dies before it is ready (the initializer raised, the main module failed to import) makes
the pool *broken* (:class:`BrokenPoolError` for every task not yet running and every new call)
instead of respawning forever as the stdlib does.

What each party sees when a worker is SIGKILLed (the OOM killer sends SIGKILL):

* before it reported ready: no task is assigned to it; a replacement starts (three such deaths
  in a row, or one with an exit code, break the pool);
* while idle: nothing is lost; a replacement starts;
* between reading a task and sending its result: that task fails with ``WorkerLostError``;
  a task queued behind it goes to another worker;
* while sending a result: the parent reads a partial message, gets EOF, and fails that task;
* after sending a result: the result is delivered; only the replacement is visible.

The parent SIGKILLed: every worker dies with it (``_child.py``: ``PR_SET_PDEATHSIG`` plus a
watchdog pipe; workers that the manager thread replaced rely on the watchdog alone).

**Who frees shared memory.** Arguments: blocks the parent created when it pickled the task.
Before sending, the parent registers the worker as the holder of each (``register_holder``, as
for ``Process`` arguments) and the worker rebuilds them without hold records
(``reducers.process_args_parent``), so the count is exact. The worker drops its views when the
task is done and tells the parent (a release record, sent before it waits for the next task);
the parent recycles the block for a later argument. A worker killed while holding them: the
parent's liveness check (about once a second) drops its holds. Results: blocks the worker
created; the parent's views keep them alive; when the caller drops a result, the parent tells
the worker, which recycles the block for a later result. When the worker is gone
(``maxtasksperchild``, killed), its blocks live on in the parent's mapping until the parent lets
go, then the kernel frees them. ``terminate()`` leaves nothing pinned either: tasks not yet sent
give their handles back, and the holds of killed workers go with the liveness check.

This module imports nothing heavy: a worker imports numpy only if its tasks carry arrays.
"""

from __future__ import annotations

import collections
import faulthandler
import functools
import itertools
import os
import pickle
import reprlib
import select
import signal
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from multiprocessing import TimeoutError as _PoolTimeoutError
from multiprocessing import util as _mputil
from typing import Any

from . import _child, reducers
from .connection import Pipe
from .errors import FdLimitError, TensormpError

__all__ = [
    "Pool",
    "AsyncResult",
    "ApplyResult",
    "MapResult",
    "IMapIterator",
    "WorkerLostError",
    "BrokenPoolError",
]

_RUN, _CLOSE, _TERMINATE = "RUN", "CLOSE", "TERMINATE"
_CALL, _MAP, _STARMAP = 0, 1, 2  # task kinds
_READY, _INIT_ERROR, _RESULT, _DYING = 0, 1, 2, 3  # worker -> parent message tags
_WAKE, _CONN, _SENTINEL = 0, 1, 2  # what a polled fd is
_PREFETCH_MAX_BYTES = 64 << 10  # never queue a bigger message behind a running task
_TERM_GRACE = 2.0  # seconds from SIGTERM to SIGKILL in terminate()
_STOP_GRACE = 5.0  # seconds a worker told to stop (close()) may take to exit before SIGKILL
_REAP_TIMEOUT = 5.0  # seconds to wait for the exit status of a worker whose sentinel fired
_LIVENESS_INTERVAL = 1.0  # seconds between waitpid() checks of every worker
_MAX_CRASH_LOG = 64 << 10
_MAX_STARTUP_FAILURES = 3  # workers killed by a signal before ready, in a row, break the pool
_FN_CACHE = 16  # functions sent by value that a worker keeps unpickled


# -- exceptions -------------------------------------------------------------------------------


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class WorkerLostError(TensormpError, RuntimeError):
    """A pool worker died while it ran this task: killed by a signal (the OOM killer sends
    SIGKILL), ``os._exit()``, ``sys.exit()`` in the task, or a crash in native code.

    The stdlib ``Pool`` hangs forever in this case. The pool replaced the worker and keeps
    running; only this task failed. ``__cause__`` holds the worker's traceback when it is known
    (a ``sys.exit()`` in the task, or the faulthandler stack of a SIGSEGV/SIGBUS/SIGABRT).

    Attributes:
        pid: the worker's process id.
        exitcode: its exit status (negative: killed by signal ``-exitcode``).
        signal_name: ``"SIGKILL"`` etc. when killed by a signal, else None.
        task: what it was running, e.g. ``"map(work) chunk 3 of 8 (items 6-7)"``.
    """

    def __init__(
        self, msg: str, pid: int | None = None, exitcode: int | None = None, task: str = ""
    ) -> None:
        super().__init__(msg)
        self.msg = msg
        self.pid = pid
        self.exitcode = exitcode
        self.task = task

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        return _signal_name(self.exitcode)

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self) -> Any:
        return type(self), (self.msg, self.pid, self.exitcode, self.task)


class BrokenPoolError(TensormpError, RuntimeError):
    """The pool cannot run this task: its initializer raised, its workers cannot start, or it
    was terminated (``terminate()``, the end of its ``with`` block) before the task finished.

    ``__cause__`` holds the initializer's exception (with its remote traceback) when that is
    the reason. A broken pool raises this for every new call; create a new pool.
    """


# -- sending functions and fds ----------------------------------------------------------------

_top_level: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _needs_value(fn: Any) -> bool:
    """True when workers cannot import ``fn`` by name (see ``spawn._defined_at_top_level``)."""
    if getattr(fn, "__code__", None) is None:
        return False  # builtin, partial, bound method, callable object: by reference first
    if "<" in getattr(fn, "__qualname__", "<"):
        return True  # lambda or local function
    if getattr(fn, "__module__", None) != "__main__":
        return False
    try:
        top = _top_level.get(fn)
    except TypeError:
        top = None
    if top is None:
        from .spawn import _defined_at_top_level

        top = _defined_at_top_level(fn)
        try:
            _top_level[fn] = top
        except TypeError:
            pass
    return not top


class _Fn:
    """A job's callable as it travels: by reference, or by value (cloudpickle) once needed."""

    __slots__ = ("fn", "name", "wire", "what")

    def __init__(self, fn: Any, what: str) -> None:
        self.fn = fn
        self.what = what
        self.name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        if not isinstance(self.name, str):
            self.name = reprlib.repr(fn)
        self.wire: Any = fn

    @property
    def by_value(self) -> bool:
        return isinstance(self.wire, _child.FnByValue)

    def to_value(self) -> None:
        """Send the callable by value from now on.

        Raises:
            TypeError: cloudpickle is not installed.
        """
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(
                f"{self.what}={self.fn!r} cannot be imported by name in a worker (a lambda, a "
                "local function, a function defined under `if __name__ == \"__main__\":`, or "
                "an object plain pickle refuses); install cloudpickle (pip install "
                "'tensormp[cloudpickle]') so tensormp can send it by value, or define it at "
                "the top level of a module"
            ) from None
        module = getattr(self.fn, "__module__", None) or "?"
        self.wire = _child.FnByValue(cloudpickle.dumps(self.fn), f"{module}.{self.name}")


def _prepare(fn: Any, what: str = "func") -> _Fn:
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}: {reprlib.repr(fn)}")
    ref = _Fn(fn, what)
    if _needs_value(fn):
        ref.to_value()
    return ref


class _RawFd:
    """An fd handed to a worker as a ``Process`` argument (fork: inherited)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        msg = reducers.current_message()
        if msg is None:
            raise TypeError("a pool worker's crash log travels only as a tensormp Process argument")
        return _rebuild_raw_fd, (msg.add_fd(self.fd, ("pool-raw-fd", self.fd), self),)


def _rebuild_raw_fd(index: Any) -> _RawFd:
    return _RawFd(reducers.take_fd(index))


# -- the worker -------------------------------------------------------------------------------


class _Repr:
    """Shows a pre-computed (short) repr: for MaybeEncodingError of a huge value."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _wrap(exc: BaseException) -> Any:
    from multiprocessing.pool import ExceptionWithTraceback

    return ExceptionWithTraceback(exc, exc.__traceback__)


def _format(exc: BaseException) -> str:
    import traceback

    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # noqa: BLE001 - a broken __str__ must not lose the report
        return f"{type(exc).__name__}\n"


def _send_quietly(conn: Any, obj: Any) -> None:
    try:
        conn.send(obj)
    except Exception:  # noqa: BLE001 - the parent is gone, or obj cannot be pickled
        pass


def _load_fn(fn: Any, cache: dict[bytes, Any]) -> Any:
    if not isinstance(fn, _child.FnByValue):
        return fn
    loaded = cache.get(fn.data)
    if loaded is None:
        loaded = fn.load()
        if len(cache) >= _FN_CACHE:
            cache.pop(next(iter(cache)))
        cache[fn.data] = loaded
    return loaded


def _run_task(conn: Any, task: Any, cache: dict[bytes, Any]) -> tuple[Any, ...]:
    seq, fn, kind, args = task
    try:
        f = _load_fn(fn, cache)
        if kind == _CALL:
            value = f(*args[0], **args[1])
        elif kind == _MAP:
            value = [f(x) for x in args]
        else:
            value = [f(*x) for x in args]
    except Exception as e:
        return (_RESULT, seq, False, _wrap(e))
    except BaseException as e:  # SystemExit, KeyboardInterrupt...: this worker ends with it
        _send_quietly(conn, (_DYING, seq, _format(e)))
        raise
    return (_RESULT, seq, True, value)


def _worker_main(
    conn: Any,
    crash: _RawFd,
    initializer: Any,
    initargs: tuple[Any, ...],
    maxtasks: int | None,
    inherited: Any,
    parent_pid: int,
) -> None:
    """The target of every pool worker: run tasks from ``conn`` until told to stop.

    Exit status 0 after ``maxtasks`` tasks, a stop message, or EOF; 1 when the initializer
    raised (after reporting it).
    """
    if inherited is not None:  # fork: our copy of the parent's end; the parent's close is EOF
        inherited.close()
    # A Ctrl-C reaches the whole process group: the parent decides (terminate()), so that a
    # task is never half-interrupted with a traceback per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        faulthandler.enable(file=crash.fd, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        pass
    if initializer is not None:
        try:
            _load_fn(initializer, {})(*initargs)
        except BaseException as e:
            _send_quietly(conn, (_INIT_ERROR, _wrap(e)))
            sys.exit(1)
    try:
        conn.send((_READY, os.getpid()))
    except OSError:  # the pool is gone already
        return
    cache: dict[bytes, Any] = {}
    done = 0
    while maxtasks is None or done < maxtasks:
        reply: Any
        try:
            data, fds = conn.recv_message()
        except FdLimitError as e:  # that task was dropped; say so, and go on
            reply = (_RESULT, None, False, _wrap(e))
        except (EOFError, OSError):  # the parent closed our channel
            return
        else:
            # The parent registered us as the holder of its own blocks in this task before
            # sending it (as for Process arguments): no hold records for those.
            reducers.process_args_parent(parent_pid)
            try:
                task = reducers.loads(data, fds)
            except Exception as e:
                if hasattr(e, "add_note"):
                    e.add_note("(unpickling the task in the pool worker)")
                reply = (_RESULT, None, False, _wrap(e))
            else:
                if task is None:
                    return
                reply = None
            finally:
                reducers.process_args_parent(0)
            del data, fds
            if reply is None:
                reply = _run_task(conn, task, cache)
                del task
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionError, EOFError):
            return
        except Exception as e:  # the result cannot be pickled: say why (as the stdlib)
            from multiprocessing.pool import MaybeEncodingError

            short = _Repr(reprlib.repr(reply[3]))
            conn.send((_RESULT, reply[1], False, _wrap(MaybeEncodingError(e, short))))
        reply = None
        done += 1


# -- the manager ------------------------------------------------------------------------------


class _Task:
    """One call or one chunk: what the manager sends, and where the answer goes."""

    __slots__ = ("seq", "fn", "kind", "args", "sink", "start", "label", "msg", "owner")

    def __init__(
        self,
        fn: _Fn,
        kind: int,
        args: Any,
        sink: Callable[[bool, Any], None],
        label: tuple[Any, ...],
        start: Callable[[], bool] | None = None,
        owner: Any = None,
    ) -> None:
        self.seq = 0
        self.fn = fn
        self.kind = kind
        self.args = args
        self.sink = sink
        self.label = label
        self.start = start  # called once, before sending; False: cancelled (executor futures)
        self.msg: reducers.Message | None = None
        self.owner = owner


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80


def _describe(label: tuple[Any, ...]) -> str:
    """``map(work) chunk 3 of 8 (items 6-7)``, ``apply_async(work, 1, x=2)``."""
    what = label[0]
    if what in ("apply", "apply_async", "submit"):
        _, name, args, kwargs = label
        parts = [_repr.repr(a) for a in args[:6]] + ["..."] * (len(args) > 6)
        parts += [f"{k}={_repr.repr(v)}" for k, v in list(kwargs.items())[:6]]
        return f"{what}({', '.join([name, *parts])})"
    _, name, index, nchunks, first, count = label
    of = f" of {nchunks}" if nchunks else ""
    items = f"item {first}" if count == 1 else f"items {first}-{first + count - 1}"
    return f"{what}({name}) chunk {index + 1}{of} ({items})"


class _Worker:
    __slots__ = (
        "process", "conn", "crash_fd", "pid", "ready", "assigned", "outstanding", "eof",
        "retiring", "stopping", "dying", "init_error", "gone", "stop_deadline",
    )

    def __init__(self, process: Any, conn: Any, crash_fd: int) -> None:
        self.process = process
        self.conn = conn
        self.crash_fd = crash_fd
        self.pid: int = process.pid
        self.ready = False
        self.assigned = 0  # tasks sent, for maxtasksperchild
        self.outstanding: collections.deque[_Task] = collections.deque()
        self.eof = False  # its channel is closed: send nothing more
        self.retiring = False  # got its last task (maxtasksperchild): a replacement is started
        self.stopping = False  # told to stop (close())
        self.dying = ""  # traceback of a BaseException that ends it
        self.init_error: BaseException | None = None
        self.gone = False
        self.stop_deadline: float | None = None


class _Engine:
    """Workers, the manager thread, and the task deque: shared by Pool and the executor."""

    def __init__(
        self,
        *,
        ctx: Any,
        processes: int,
        initializer: Any,
        initargs: tuple[Any, ...],
        maxtasks: int | None,
        owner: str,
        lost_error: type[WorkerLostError],
        broken_error: type[BrokenPoolError],
    ) -> None:
        self.ctx = ctx
        self.method = ctx.get_start_method()
        self.processes = processes
        self.owner = owner
        self._initializer = initializer
        self._initargs = tuple(initargs)
        self._maxtasks = maxtasks
        self._lost_error = lost_error
        self._broken_error = broken_error
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # feeders wait here for the deque to drain
        self._room_limit = 4 * processes + 4
        self._pending: collections.deque[_Task] = collections.deque()
        self._state = _RUN
        self._broken_msg: str | None = None
        self._broken_cause: BaseException | None = None
        self._feeders = 0
        self._seq = itertools.count(1)
        self._serial = itertools.count(1)
        self.workers: list[_Worker] = []
        self._startup_failures = 0
        self._last_liveness = time.monotonic()
        self._poller = select.poll()
        self._fdmap: dict[int, tuple[int, _Worker | None]] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._woken = False
        self._register(self._wake_r, _WAKE, None)
        try:
            for _ in range(processes):
                self._start_worker()
        except BaseException:
            self._state = _TERMINATE
            self._shutdown()
            raise
        self._thread = threading.Thread(target=self._run, name=f"{owner} manager", daemon=True)
        self._thread.start()

    # -- called from any thread -------------------------------------------------------------
    def broken(self) -> BrokenPoolError:
        error = self._broken_error(self._broken_msg or f"{self.owner} is broken")
        error.__cause__ = self._broken_cause
        return error

    def check_running(self) -> None:
        """Raises: BrokenPoolError (broken), ValueError (closed or terminated, as the stdlib)."""
        if self._broken_msg is not None:
            raise self.broken()
        if self._state != _RUN:
            raise ValueError(
                f"Pool not running: this {self.owner} was closed or terminated; create a new one"
            )

    @property
    def state(self) -> str:
        return self._state

    def submit(self, tasks: list[_Task], *, feeder: bool = False) -> None:
        with self._lock:
            if self._broken_msg is not None:
                raise self.broken()
            if self._state != _RUN and not (feeder and self._state == _CLOSE):
                raise ValueError(
                    f"Pool not running: this {self.owner} was closed or terminated; "
                    "create a new one"
                )
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
                raise ValueError(
                    f"Pool not running: this {self.owner} was closed or terminated; "
                    "create a new one"
                )
            self._feeders += 1

    def feeder_done(self) -> None:
        with self._lock:
            self._feeders -= 1
            self._wake_locked()

    def wait_room(self) -> bool:
        """A feeder waits until few tasks are queued; False when the pool was terminated."""
        with self._room:
            while (
                len(self._pending) >= self._room_limit
                and self._state != _TERMINATE
                and self._broken_msg is None
            ):
                self._room.wait()
            return self._state != _TERMINATE

    def take_pending(self) -> list[_Task]:
        """Remove and return every task not sent yet (``shutdown(cancel_futures=True)``)."""
        with self._lock:
            tasks = list(self._pending)
            self._pending.clear()
            self._room.notify_all()
        for task in tasks:
            if task.msg is not None:
                task.msg.abandon()
                task.msg = None
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
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join()

    def join(self) -> None:
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _wake_locked(self) -> None:
        if not self._woken and self._wake_w >= 0:
            self._woken = True
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):
                pass

    # -- the manager thread -----------------------------------------------------------------
    def _register(self, fd: int, kind: int, worker: _Worker | None) -> None:
        self._poller.register(fd, select.POLLIN)
        self._fdmap[fd] = (kind, worker)

    def _unregister(self, fd: int) -> None:
        if self._fdmap.pop(fd, None) is not None:
            try:
                self._poller.unregister(fd)
            except (KeyError, ValueError):
                pass

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

    def _step(self) -> bool:
        with self._lock:
            state = self._state
        if state == _TERMINATE:
            return False
        self._dispatch()
        if state == _CLOSE and self._closing_done():
            return False
        allocator = sys.modules.get("tensormp.memory.allocator")
        if allocator is not None:
            allocator.flush_records()  # what we hold and dropped, before we wait
        events = self._poller.poll(_LIVENESS_INTERVAL * 1000)
        todo = [(self._fdmap.get(fd), fd) for fd, _ in events]
        for entry, fd in todo:
            if entry is None:
                continue
            kind, worker = entry
            if worker is not None and (worker.gone or self._fdmap.get(fd) != entry):
                continue
            if kind == _WAKE:
                self._drain_wake()
            elif kind == _CONN:
                self._on_readable(worker)  # type: ignore[arg-type]
            else:
                self._on_exit(worker)  # type: ignore[arg-type]
        now = time.monotonic()
        if now - self._last_liveness >= _LIVENESS_INTERVAL:
            self._last_liveness = now
            for worker in list(self.workers):
                if worker.gone:
                    continue
                if worker.process.exitcode is not None:
                    self._on_exit(worker)
                elif worker.stop_deadline is not None and now >= worker.stop_deadline:
                    # Told to stop, done with its tasks, yet alive: its exit is stuck (a slow
                    # atexit handler, a thread that never ends). Every wait is bounded.
                    worker.stop_deadline = None
                    worker.process.kill()
        return True

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        with self._lock:
            self._woken = False

    # -- workers ----------------------------------------------------------------------------
    def _start_worker(self) -> None:
        ours, theirs = Pipe(duplex=True)
        crash_fd = -1
        try:
            crash_fd = os.memfd_create("tensormp-pool-crash-log", os.MFD_CLOEXEC)
            process = self.ctx.Process(
                target=_worker_main,
                args=(
                    theirs, _RawFd(crash_fd), self._initializer, self._initargs,
                    self._maxtasks, ours if self.method == "fork" else None, os.getpid(),
                ),
                name=f"TensormpPoolWorker-{next(self._serial)}",
                daemon=True,
            )
            process.start()
        except BaseException:
            ours.close()
            if crash_fd >= 0:
                os.close(crash_fd)
            raise
        finally:
            theirs.close()
        worker = _Worker(process, ours, crash_fd)
        self.workers.append(worker)
        self._register(ours.fileno(), _CONN, worker)
        self._register(process.sentinel, _SENTINEL, worker)

    def _replenish(self) -> None:
        with self._lock:
            state = self._state
            broken = self._broken_msg is not None
            work = bool(self._pending) or self._feeders > 0
        if state == _TERMINATE or broken or (state == _CLOSE and not work):
            return
        active = sum(1 for w in self.workers if not (w.retiring or w.stopping or w.eof))
        for _ in range(self.processes - active):
            try:
                self._start_worker()
            except Exception as e:  # noqa: BLE001 - fds, memory, pickling initargs...
                self._break(
                    f"{self.owner}: could not start a replacement worker "
                    f"({type(e).__name__}: {e}); the pool is broken",
                    e,
                )
                return

    def _on_readable(self, w: _Worker) -> None:
        while not w.eof:
            try:
                reply = w.conn.recv()
            except FdLimitError as e:  # that message was dropped; the channel stays usable
                self._fail_oldest(w, e)
            except (EOFError, OSError):
                self._channel_closed(w)
                return
            except Exception as e:  # noqa: BLE001 - a result the parent cannot unpickle
                if hasattr(e, "add_note"):
                    e.add_note(f"({self.owner}: loading a task's result in the parent)")
                self._fail_oldest(w, e)
            else:
                self._handle(w, reply)
            try:
                if not w.conn.poll(0):
                    return
            except OSError:
                self._channel_closed(w)
                return

    def _channel_closed(self, w: _Worker) -> None:
        if not w.eof:
            w.eof = True
            self._unregister(w.conn.fileno())
            w.conn.close()  # a live worker then reads EOF and exits: its sentinel tells us

    def _handle(self, w: _Worker, reply: Any) -> None:
        tag = reply[0]
        if tag == _RESULT:
            _, seq, ok, value = reply
            if not w.outstanding or (seq is not None and w.outstanding[0].seq != seq):
                raise RuntimeError(
                    f"worker {w.pid} answered task #{seq}, expected "
                    f"{w.outstanding[0].seq if w.outstanding else 'none'}"
                )
            self._deliver(w.outstanding.popleft(), ok, value)
        elif tag == _READY:
            w.ready = True
            self._startup_failures = 0
        elif tag == _INIT_ERROR:
            w.init_error = reply[1]
        elif tag == _DYING:
            w.dying = reply[2]

    def _fail_oldest(self, w: _Worker, error: BaseException) -> None:
        if w.outstanding:
            self._deliver(w.outstanding.popleft(), False, error)

    def _on_exit(self, w: _Worker) -> None:
        if w.gone:
            return
        if not w.eof:
            try:
                if w.conn.poll(0):
                    self._on_readable(w)  # a result sent before it died is still delivered
            except OSError:
                pass
        code = self._reap(w)
        crash = self._crash_log(w) if code < 0 else ""
        self._forget(w)
        if w.outstanding:
            running = w.outstanding.popleft()
            rest = list(w.outstanding)
            w.outstanding.clear()
            if rest:  # never read by the dead worker: another one will run them
                for task in rest:
                    task.msg = None  # its handles were the dead worker's: pickle anew
                with self._lock:
                    self._pending.extendleft(reversed(rest))
            self._deliver(running, False, self._lost(w, code, running, crash))
        elif w.init_error is not None:
            name = getattr(self._initializer, "name", None) or getattr(
                self._initializer, "__qualname__", repr(self._initializer)
            )
            error = w.init_error
            self._break(
                f"{self.owner}: the initializer {name} raised in worker {w.pid}: "
                f"{type(error).__name__}: {error}. The pool is broken (every worker runs it); "
                "fix the initializer and create a new pool",
                error,
            )
        elif not w.ready and not w.stopping and self._state != _TERMINATE:
            self._startup_failures += 1
            how = _exit_text(code)
            if code >= 0:
                self._break(
                    f"{self.owner}: worker {w.pid} {how} while starting, before it could run "
                    "a task: importing the main module or unpickling the initializer or its "
                    "arguments failed (its traceback is on stderr). The pool is broken. If the "
                    "script creates the pool at import time, move that under "
                    "`if __name__ == \"__main__\":` (workers started with 'spawn' or "
                    "'forkserver' import the main module)",
                    None,
                )
            elif self._startup_failures >= _MAX_STARTUP_FAILURES:
                self._break(
                    f"{self.owner}: {self._startup_failures} workers in a row died while "
                    f"starting (the last, pid {w.pid}, {how}); the pool is broken",
                    None,
                )
        self._replenish()

    def _reap(self, w: _Worker) -> int:
        process = w.process
        process.join(_REAP_TIMEOUT)
        if process.exitcode is None:  # its sentinel closed, yet it lives: end it
            process.kill()
            process.join(_REAP_TIMEOUT)
        code = process.exitcode
        return -signal.SIGKILL if code is None else int(code)

    def _crash_log(self, w: _Worker) -> str:
        try:
            raw = os.pread(w.crash_fd, _MAX_CRASH_LOG, 0)
        except OSError:
            return ""
        return raw.decode("utf-8", "replace").strip()

    def _forget(self, w: _Worker) -> None:
        w.gone = True
        if w in self.workers:
            self.workers.remove(w)
        if not w.eof:
            w.eof = True
            self._unregister(w.conn.fileno())
            w.conn.close()
        self._unregister(w.process.sentinel)
        try:
            w.process.close()
        except ValueError:  # still running (a worker we could not kill): leave it
            pass
        if w.crash_fd >= 0:
            os.close(w.crash_fd)
            w.crash_fd = -1

    def _lost(self, w: _Worker, code: int, task: _Task, crash: str) -> WorkerLostError:
        from multiprocessing.pool import RemoteTraceback

        what = _describe(task.label)
        msg = f"{self.owner}: worker {w.pid} {_exit_text(code)} while running {what}"
        cause: BaseException | None = None
        if w.dying:
            first = w.dying.strip().splitlines()[-1] if w.dying.strip() else ""
            msg += f" (the task raised {first})"
            cause = RemoteTraceback(w.dying)
        elif code == -signal.SIGKILL:
            msg += (
                ". SIGKILL comes from the kernel's out-of-memory killer when memory runs out "
                "(see `dmesg`), or from a `kill -9`"
            )
        elif crash:
            msg += "; its Python stack at the crash is chained below"
            cause = RemoteTraceback(
                f"\n-- Python stack of worker {w.pid} when it received "
                f"{_signal_name(code)} (faulthandler):\n{crash}"
            )
        elif code >= 0:
            msg += " (the task called os._exit() or sys.exit(), or native code exited)"
        msg += (
            ". The pool replaced the worker and keeps running; only this task failed, resubmit "
            "it if it is safe to run again"
        )
        error = self._lost_error(msg, w.pid, code, what)
        error.__cause__ = cause
        return error

    # -- tasks ------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            with self._lock:
                npending = len(self._pending)
            if not npending:
                return
            idle = busy = None
            for w in self.workers:
                if not w.ready or w.eof or w.stopping or w.retiring:
                    continue
                if len(w.outstanding) == 0:
                    idle = w
                    break
                if busy is None and len(w.outstanding) == 1:
                    busy = w
            if idle is None and (busy is None or npending < len(self.workers)):
                return
            with self._lock:
                if not self._pending:
                    return
                task = self._pending.popleft()
                self._room.notify_all()
            if task.start is not None:
                start, task.start = task.start, None
                if not start():  # cancelled while it waited
                    if task.msg is not None:
                        task.msg.abandon()
                    continue
            msg = self._pickle(task)
            if msg is None:
                continue
            target = idle if idle is not None else busy
            if idle is None and len(msg.data) > _PREFETCH_MAX_BYTES:
                with self._lock:  # a big message waits for an idle worker (no deadlock)
                    self._pending.appendleft(task)
                return
            self._send(target, task)  # type: ignore[arg-type]

    def _pickle(self, task: _Task) -> reducers.Message | None:
        if task.msg is not None:
            return task.msg
        try:
            task.msg = reducers.dumps((task.seq, task.fn.wire, task.kind, task.args))
        except Exception as e:  # noqa: BLE001 - reported as this task's failure
            if not task.fn.by_value and not _pickles(task.fn.wire):
                try:
                    task.fn.to_value()  # plain pickle refused the callable: cloudpickle it
                except Exception as e2:  # noqa: BLE001
                    self._deliver(task, False, e2)
                    return None
                return self._pickle(task)
            if hasattr(e, "add_note"):
                e.add_note(f"({self.owner}: pickling {_describe(task.label)} for a worker)")
            self._deliver(task, False, e)
            return None
        return task.msg

    def _send(self, w: _Worker, task: _Task) -> None:
        msg = task.msg
        assert msg is not None
        if msg.noted:
            # The worker holds one handle to each of our blocks in the message (it sends no
            # hold records for them: see _worker_main). Registered before it can release them;
            # if it dies holding them, our liveness check frees them (as Process arguments).
            from .memory.allocator import register_holder

            register_holder(w.pid, msg.noted)
        try:
            w.conn.send_message(msg)
        except OSError:  # the worker is gone (its sentinel will say how)
            task.msg = None  # registered to that worker: pickle anew for another
            with self._lock:
                self._pending.appendleft(task)
            self._channel_closed(w)
            return
        w.outstanding.append(task)
        w.assigned += 1
        if self._maxtasks is not None and w.assigned >= self._maxtasks:
            w.retiring = True  # it exits after this task: start its successor now
            self._replenish()

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
            tasks = list(self._pending)
            self._pending.clear()
            self._room.notify_all()
        for task in tasks:
            if task.msg is not None:
                task.msg.abandon()
            self._deliver(task, False, self.broken())

    def _closing_done(self) -> bool:
        """close(): once every task is done, stop the workers; True when all have exited."""
        with self._lock:
            busy = bool(self._pending) or self._feeders > 0
        if busy or any(w.outstanding for w in self.workers):
            return False
        for w in self.workers:
            if not w.stopping and not w.eof:
                w.stopping = True
                w.stop_deadline = time.monotonic() + _STOP_GRACE
                try:
                    w.conn.send(None)
                except OSError:
                    self._channel_closed(w)
        return not self.workers

    def _shutdown(self) -> None:
        """Manager exit: stop what still runs, fail what is unfinished, close every fd."""
        alive = [w for w in self.workers if not w.gone]
        for w in alive:
            if w.process.exitcode is None:
                if w.ready and not w.outstanding and not w.eof and not w.stopping:
                    # Idle: a clean exit, which hands back what the worker received at once
                    # (a killed worker's holds wait for the creators' liveness checks).
                    try:
                        w.conn.send(None)
                        w.stopping = True
                        continue
                    except OSError:
                        pass
                try:
                    w.process.terminate()
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + _TERM_GRACE
        for w in alive:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join(_REAP_TIMEOUT)
        unfinished: list[_Task] = []
        for w in alive:
            unfinished.extend(w.outstanding)
            w.outstanding.clear()
            self._forget(w)
        with self._lock:
            unfinished.extend(self._pending)
            self._pending.clear()
            self._room.notify_all()
        for task in unfinished:
            if task.msg is not None:
                task.msg.abandon()  # no-op for messages already sent
            error = self._broken_error(
                f"{self.owner} was terminated (terminate(), shutdown, or the end of its `with` "
                f"block) before {_describe(task.label)} finished"
            )
            self._deliver(task, False, error)
        with self._lock:
            self._unregister(self._wake_r)
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
            if self._state != _TERMINATE:
                self._state = _TERMINATE if self._state == _RUN else self._state


def _pickles(obj: Any) -> bool:
    try:
        pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        return False
    return True


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by signal {_signal_name(code)}"
    return f"exited with code {code}"


# -- results ----------------------------------------------------------------------------------


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
        self._event = threading.Event()
        self._cond = threading.Condition(threading.Lock())
        self._callback = callback
        self._error_callback = error_callback
        self._success: bool | None = None
        self._value: Any = None

    def ready(self) -> bool:
        """Whether the call has completed."""
        return self._event.is_set()

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
        self._event.wait(timeout)

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
            self._event.set()
            self._pool = None
            with self._cond:
                self._cond.notify_all()

    def __repr__(self) -> str:
        state = "pending" if not self.ready() else ("ok" if self._success else "failed")
        return f"<{type(self).__name__} {state} at {id(self):#x}>"


ApplyResult = AsyncResult


class MapResult(AsyncResult):
    """The result of :meth:`Pool.map_async` / :meth:`Pool.starmap_async`: a list in order.

    As the stdlib: ready when every chunk is done; if any chunk raised, ``get()`` raises the
    first exception that arrived.
    """

    def __init__(
        self, pool: Any, chunksize: int, length: int, callback: Any, error_callback: Any
    ) -> None:
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
            if ok and self._success:
                self._value[index * cs : (index + 1) * cs] = value
            elif not ok and self._success:
                self._success = False
                self._value = value  # only the first exception is kept (as the stdlib)
            done = self._left == 0
            self._cond.notify_all()
        if done:
            self._finish()

    def _follow(self, reporter: _Progress) -> None:
        """Caller's thread: feed ``reporter`` until the map is done."""
        try:
            shown = -1
            while True:
                with self._cond:
                    if self.items_done == shown and not self._event.is_set():
                        self._cond.wait(1.0)
                    done, finished = self.items_done, self._event.is_set()
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
            self._cond.notify()

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


# -- progress ---------------------------------------------------------------------------------


class _Progress:
    """``progress=True``: a tqdm bar; ``progress=callable``: ``callable(done, total)``."""

    def __init__(self, progress: Any, total: int | None, desc: str) -> None:
        self._fn: Callable[[int, int | None], Any] | None = None
        self._bar: Any = None
        self._total = total
        self._done = 0
        if progress is True:
            tqdm = _tqdm()
            self._bar = tqdm(total=total, desc=desc, unit="item")
        else:
            self._fn = progress
            progress(0, total)

    @staticmethod
    def check(progress: Any) -> bool:
        """Validate ``progress=``; True when a reporter is wanted.

        Raises:
            ImportError: ``progress=True`` and tqdm is not installed.
            TypeError: ``progress`` is neither a bool nor a callable.
        """
        if progress is None or progress is False:
            return False
        if progress is True:
            _tqdm()
            return True
        if callable(progress):
            return True
        raise TypeError(
            f"progress must be True (a tqdm bar), False, or a callable progress(done, total), "
            f"got {type(progress).__name__}: {reprlib.repr(progress)}"
        )

    def update(self, done: int) -> None:
        if done <= self._done:
            return
        if self._bar is not None:
            self._bar.update(done - self._done)
        elif self._fn is not None:
            self._fn(done, self._total)
        self._done = done

    def close(self) -> None:
        bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()


def _tqdm() -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        raise ImportError(
            "progress=True draws a progress bar with tqdm, which is not installed: "
            "pip install 'tensormp[progress]' (or pip install tqdm), or pass "
            "progress=a callable progress(done, total) instead"
        ) from None
    return tqdm


# -- the pool ---------------------------------------------------------------------------------


def _cpu_count() -> int:
    count = getattr(os, "process_cpu_count", None)
    if count is not None:
        return count() or 1
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _check_chunksize(chunksize: Any) -> None:
    if isinstance(chunksize, bool) or not isinstance(chunksize, int) or chunksize < 1:
        raise ValueError(f"chunksize must be a positive int, got {chunksize!r}")


def _check_callbacks(callback: Any, error_callback: Any) -> None:
    for name, value in (("callback", callback), ("error_callback", error_callback)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be callable or None, got {type(value).__name__}")


def _feed(
    engine: _Engine, fn: _Fn, items: Iterator[Any], chunksize: int, result: IMapIterator,
    what: str,
) -> None:
    """Feeder thread of imap: chunks from ``items`` into the engine, never many ahead."""
    index = 0
    first = 0
    try:
        while True:
            chunk = list(itertools.islice(items, chunksize))
            if not chunk:
                break
            if not engine.wait_room():
                raise engine._broken_error(
                    f"{engine.owner} was terminated before {what}() submitted every item "
                    f"(stopped after {first})"
                )
            label = (what, fn.name, index, None, first, len(chunk))
            sink = functools.partial(result._set, index)
            engine.submit([_Task(fn, _MAP, chunk, sink, label)], feeder=True)
            index += 1
            first += len(chunk)
            del chunk
    except BaseException as e:  # noqa: BLE001 - the iterable raised, or the pool broke
        result._set(index, False, e)
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
        processes: number of workers (default: the CPUs this process may run on).
        initializer: called as ``initializer(*initargs)`` in each worker when it starts.
        initargs: arguments for ``initializer``; arrays arrive as shared memory.
        maxtasksperchild: tasks (calls, or map chunks) a worker runs before it is replaced
            (None: no limit).
        context: a start-method context (tensormp's or the stdlib's; tensormp's of the same
            start method is used); default: tensormp's default context.

    Raises:
        ValueError: ``processes < 1`` or ``maxtasksperchild`` not a positive int.
        TypeError: ``initializer`` is not callable, or ``initargs`` is not a tuple.
    """

    def __init__(
        self,
        processes: int | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: int | None = None,
        context: Any = None,
    ) -> None:
        from .context import get_context

        ctx = get_context(None if context is None else context.get_start_method())
        if processes is None:
            processes = _cpu_count()
        if isinstance(processes, bool) or not isinstance(processes, int):
            raise TypeError(f"processes must be an int or None, got {type(processes).__name__}")
        if processes < 1:
            raise ValueError(f"Number of processes must be at least 1, got {processes}")
        if maxtasksperchild is not None and (
            isinstance(maxtasksperchild, bool)
            or not isinstance(maxtasksperchild, int)
            or maxtasksperchild <= 0
        ):
            raise ValueError(
                f"maxtasksperchild must be a positive int or None, got {maxtasksperchild!r}"
            )
        if not isinstance(initargs, (tuple, list)):
            raise TypeError(
                f"initargs must be a tuple, got {type(initargs).__name__}; for one argument "
                "write initargs=(x,)"
            )
        init = None if initializer is None else _prepare(initializer, "initializer").wire
        self._processes = processes
        self._engine = _Engine(
            ctx=ctx, processes=processes, initializer=init, initargs=tuple(initargs),
            maxtasks=maxtasksperchild, owner="tensormp.Pool", lost_error=WorkerLostError,
            broken_error=BrokenPoolError,
        )
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
        fn = _prepare(func)
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
        fn = _prepare(func)
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
        fn = _prepare(func)
        _check_chunksize(chunksize)
        want = _Progress.check(progress)
        items = iter(iterable)
        total = len(iterable) if hasattr(iterable, "__len__") else None
        reporter = _Progress(progress, total, fn.name) if want else None
        result = IMapIterator(self, ordered, reporter)
        self._engine.feeder_started()
        try:
            threading.Thread(
                target=_feed, args=(self._engine, fn, items, chunksize, result, what),
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
        if self._engine.state == _RUN:
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
        if engine is not None and engine.state == _RUN:
            _warn(f"unclosed running tensormp.Pool {self!r}", ResourceWarning, source=self)

    @property
    def _pool(self) -> list[Any]:
        """The current worker ``Process`` objects (the stdlib's attribute)."""
        return [w.process for w in list(self._engine.workers) if not w.gone]

    def __repr__(self) -> str:
        engine = self.__dict__.get("_engine")
        if engine is None:
            return f"<tensormp.Pool uninitialised at {id(self):#x}>"
        pids = [w.pid for w in list(engine.workers) if not w.gone]
        return (
            f"<tensormp.Pool state={engine.state} pool_size={self._processes} "
            f"start_method={engine.method} pids={pids}>"
        )
