"""The Pool engine seam: a third engine is one module plus :func:`register_engine`.

``Engine`` below runs every task in its manager thread, in this process, and is plugged in as
``engine="inline"``. It uses only what ``docs/engines.md`` documents (the names of
``tensormp.pool.engines``); the front ends (``Pool``, ``ProcessPoolExecutor``: chunking, result
objects, callbacks, ``progress=``, imap's feeder, futures, error types) must work on it through
the interface alone.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined]  # not in typeshed

import pytest

import tensormp
from tensormp.pool.engines import (
    EngineConfig,
    QueueEngine,
    describe_task,
    format_exception,
    load_fn,
    register_engine,
    run_task,
    unwrap,
)

OPTIONS: tuple[str, ...] = ("label",)


class Engine(QueueEngine):
    """One worker: the manager thread itself, which runs each task as a worker process would."""

    def __init__(self, config: EngineConfig, label: str | None = None) -> None:
        super().__init__(config)
        self.label = label
        self._wake = threading.Event()
        self.ran = 0
        self._start()

    def _start_worker(self) -> None:
        if self._initializer is None:
            return
        try:
            load_fn(self._initializer)(*self._initargs)
        except Exception as e:  # every task would fail: the engine breaks
            self._initializer_failed("the inline worker", e)

    def _wake_locked(self) -> None:
        self._wake.set()

    def describe(self) -> str:
        return f"engine=inline label={self.label} ran={self.ran}"

    def _dispatch(self) -> None:
        if self.label == "bug":
            raise RuntimeError("engine bug in _dispatch")
        task = self._take()
        if task is None or not self._claim(task):
            return
        ok, value, _seconds = run_task(task.fn.wire, task.kind, task.args)
        if ok is None:  # SystemExit & co end a worker: its task is lost
            what = describe_task(task)
            error = self._lost_error(
                f"{self.owner}: the inline worker ended while running {what} (the task raised "
                f"{type(value).__name__})",
                None, None, what,
            )
            error.__cause__ = RemoteTraceback(format_exception(value))
            self._deliver(task, False, error)
            return
        self.ran += 1
        self._deliver(task, ok, value if ok else unwrap(value))

    def _closing_done(self) -> bool:
        return not self._has_work()  # no worker of its own to stop

    def _wait(self) -> None:
        with self._lock:
            if self._pending:
                return
            self._wake.clear()  # (a submit sets it under the same lock)
        self._wake.wait(1.0)

    def _shutdown(self) -> None:
        self._fail_unfinished([])
        self._end_state()


register_engine("inline", sys.modules[__name__])  # this module: its Engine and OPTIONS


def square(x):
    return x * x


def test_pool_front_end_on_a_third_engine():
    done = []
    progress = []
    with tensormp.Pool(3, engine="inline", engine_options={"label": "demo"}) as pool:
        assert "engine=inline label=demo" in repr(pool) and "pool_size=3" in repr(pool)
        assert pool.map(square, range(10), progress=lambda d, t: progress.append((d, t))) == [
            x * x for x in range(10)
        ]
        assert progress[-1] == (10, 10)
        assert pool.starmap(pow, [(2, 3), (3, 2)]) == [8, 9]
        assert list(pool.imap(lambda x: x + 1, iter(range(5)))) == [1, 2, 3, 4, 5]
        assert sorted(pool.imap_unordered(square, range(4), chunksize=3)) == [0, 1, 4, 9]
        r = pool.apply_async(square, (7,), callback=done.append)
        assert r.get(10) == 49 and done == [49]
        with pytest.raises(ZeroDivisionError):
            pool.apply(divmod, (1, 0))
        pool.close()
        pool.join()
        with pytest.raises(ValueError, match="Pool not running"):
            pool.map(square, [1])


def test_executor_front_end_on_a_third_engine():
    with tensormp.ProcessPoolExecutor(2, engine="inline", engine_options={"label": "x"}) as ex:
        assert ex.submit(square, 5).result(10) == 25
        assert list(ex.map(square, range(4), chunksize=3)) == [0, 1, 4, 9]
        assert "engine=inline" in repr(ex)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(square, 1)


def test_options_go_to_the_engine_that_takes_them():
    with pytest.raises(ValueError, match="address= is an option of engine='ray'"):
        tensormp.Pool(1, engine="inline", address="127.0.0.1:6379")
    with pytest.raises(ValueError, match="unknown engine=.*'inline'"):
        tensormp.Pool(1, engine="nope")
    with pytest.raises(ValueError, match=r"engine='ray' has no option colour= \(its options: address, ray_remote_args, task_retries\)"):
        tensormp.Pool(1, engine="ray", engine_options={"colour": "red"})


_seen: list[int] = []


def _remember(n):
    _seen.append(n)


def _exit_task():
    sys.exit(3)


def _bad_initializer():
    raise KeyError("no config")


def test_errors_initializer_and_lost_tasks_on_a_third_engine():
    with tensormp.Pool(1, engine="inline", initializer=_remember, initargs=(7,)) as pool:
        assert _seen[-1] == 7  # the initializer ran in the (inline) worker
        with pytest.raises(ZeroDivisionError) as raised:
            pool.apply(divmod, (1, 0))
        assert isinstance(raised.value.__cause__, RemoteTraceback)  # the worker's traceback
        with pytest.raises(tensormp.WorkerLostError, match=r"apply\(_exit_task\)") as lost:
            pool.apply(_exit_task)
        assert lost.value.task == "apply(_exit_task)"
        assert "SystemExit: 3" in str(lost.value.__cause__)
        assert pool.apply(pow, (2, 5)) == 32  # the engine keeps running
    with pytest.raises(tensormp.BrokenPoolError, match="initializer _bad_initializer raised"):
        with tensormp.Pool(1, engine="inline", initializer=_bad_initializer) as pool:
            pool.apply(pow, (2, 5))


_started = threading.Event()
_gate = threading.Event()


def _blocked():
    _started.set()
    return _gate.wait(10)


def test_terminate_fails_what_is_queued_on_a_third_engine():
    _started.clear()
    _gate.clear()
    with tensormp.Pool(1, engine="inline") as pool:
        first = pool.apply_async(_blocked)
        rest = [pool.apply_async(pow, (2, i)) for i in range(3)]
        assert _started.wait(10)
        threading.Timer(0.2, _gate.set).start()
        pool.terminate()
        assert first.get(10) is True
        for r in rest:
            with pytest.raises(tensormp.BrokenPoolError, match="was terminated"):
                r.get(10)


def test_a_bug_in_a_third_engine_is_named_as_the_engines():
    # The manager thread may run its first _dispatch before ``with`` enters: then __enter__
    # raises the same error (a pool broken before use), else the task's get does.
    with pytest.raises(tensormp.BrokenPoolError) as info:
        with tensormp.Pool(1, engine="inline", engine_options={"label": "bug"}) as pool:
            pool.apply_async(square, (3,)).get(10)
    text = str(info.value)
    assert "engine bug in _dispatch" in text and "this is a bug in the engine " in text
    assert "Engine, please report it" in text and "bug in tensormp" not in text


def test_register_engine_refuses_what_would_be_ambiguous():
    module = sys.modules[__name__]
    register_engine("inline", module)  # the same again: nothing happens
    register_engine("inline", __name__)
    with pytest.raises(ValueError, match="'local' is tensormp's own engine"):
        register_engine("local", module)
    with pytest.raises(ValueError, match="engine 'inline' is .* already, not 'json'"):
        register_engine("inline", "json")
    with pytest.raises(TypeError, match="module must be a module or its dotted name"):
        register_engine("other", Engine)
    with pytest.raises(TypeError, match="name must be a str"):
        register_engine(3, module)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must not be empty"):
        register_engine("", module)
    assert "inline" in tensormp.pool.engines.names()
