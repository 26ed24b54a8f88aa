"""The Pool engine seam: a third engine is one module plus one entry in the engines table.

``InlineEngine`` below runs every task in its manager thread, in this process, and is plugged in
as ``engine="inline"``; the front ends (``Pool``, ``ProcessPoolExecutor``: chunking, result
objects, callbacks, ``progress=``, imap's feeder, futures, error types) must work on it through
the interface of ``tensormp/pool/engines/__init__.py`` alone.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

import tensormp
from tensormp.pool import engines
from tensormp.pool.engines import EngineConfig
from tensormp.pool.engines.base import _CLOSE, _TERMINATE, QueueEngine
from tensormp.pool.worker import _CALL, _MAP, _load_fn, _wrap

OPTIONS: tuple[str, ...] = ("label",)


class Engine(QueueEngine):
    """One worker: the manager thread itself."""

    def __init__(self, config: EngineConfig, label: str | None = None) -> None:
        super().__init__(config)
        self.label = label
        self._wake = threading.Event()
        self.ran = 0
        self._start_manager()

    def _wake_locked(self) -> None:
        self._wake.set()

    def describe(self) -> str:
        return f"engine=inline label={self.label} ran={self.ran}"

    def _step(self) -> bool:
        with self._lock:
            state = self._state
            task = self._pending.popleft() if self._pending else None
            self._room.notify_all()
            if task is None:
                self._wake.clear()
        if state == _TERMINATE:
            if task is not None:
                self._pending.appendleft(task)
            return False
        if task is None:
            if state == _CLOSE and not self._has_work():
                return False
            self._wake.wait(1.0)
            return True
        if task.start is not None and not task.start():
            return True
        f = _load_fn(task.fn.wire, {})
        try:
            if task.kind == _CALL:
                value: Any = f(*task.args[0], **task.args[1])
            elif task.kind == _MAP:
                value = [f(x) for x in task.args]
            else:
                value = [f(*x) for x in task.args]
        except Exception as e:
            rebuild, args = _wrap(e).__reduce__()
            self._deliver(task, False, rebuild(*args))
        else:
            self.ran += 1
            self._deliver(task, True, value)
        return True

    def _shutdown(self) -> None:
        self._fail_unfinished([])
        self._end_state()


@pytest.fixture
def inline_engine():
    engines._ENGINES["inline"] = __name__  # this module: its Engine and OPTIONS
    try:
        yield
    finally:
        del engines._ENGINES["inline"]


def square(x):
    return x * x


def test_pool_front_end_on_a_third_engine(inline_engine):
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


def test_executor_front_end_on_a_third_engine(inline_engine):
    with tensormp.ProcessPoolExecutor(2, engine="inline", engine_options={"label": "x"}) as ex:
        assert ex.submit(square, 5).result(10) == 25
        assert list(ex.map(square, range(4), chunksize=3)) == [0, 1, 4, 9]
        assert "engine=inline" in repr(ex)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(square, 1)


def test_options_go_to_the_engine_that_takes_them(inline_engine):
    with pytest.raises(ValueError, match="address= is an option of engine='ray'"):
        tensormp.Pool(1, engine="inline", address="127.0.0.1:6379")
    with pytest.raises(ValueError, match="unknown engine=.*'inline'"):
        tensormp.Pool(1, engine="nope")
    with pytest.raises(ValueError, match=r"engine='ray' has no option colour= \(its options: address, ray_remote_args, task_retries\)"):
        tensormp.Pool(1, engine="ray", engine_options={"colour": "red"})
