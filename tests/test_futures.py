"""tensormp.ProcessPoolExecutor: concurrent.futures semantics, arrays as shared memory, a dead
worker fails one future (TerminatedWorkerError, a BrokenProcessPool) and the executor goes on."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import multiprocessing.pool
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
import pytest

import tensormp as mp
from helpers import wait_for
from tensormp.futures import BrokenExecutorError, ProcessPoolExecutor, TerminatedWorkerError

# The start method of every test but the arrays' (spawn too): forkserver is as strict as spawn
# (everything pickled, nothing inherited) and its children start 2x faster (preload, conftest.py).
METHOD = "forkserver"


def _executor(workers: int = 2, method: str = METHOD, **kwargs) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=mp.get_context(method), **kwargs)


def _square(x):
    return x * x


def _scale(a, k=2.0):
    return a * k


def _negate_with_pid(a):
    return os.getpid(), -a


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _sleep_and_report(path):
    Path(path).write_text(str(os.getpid()))
    time.sleep(60)


def _raise(message):
    raise KeyError(message)


def _os_exit(code):
    os._exit(code)


def _failing_initializer():
    raise ValueError("cannot load the model")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", ["spawn", METHOD])
def test_submit_and_map_move_arrays_as_shared_memory(method):
    with _executor(method=method) as ex:
        future = ex.submit(_scale, np.arange(5.0), k=3.0)
        out = future.result(timeout=30)
        assert mp.is_shared(out) and out.tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]
        arrays = [np.full(100, i, np.float32) for i in range(10)]
        results = list(ex.map(_scale, arrays, [0.5] * 10, chunksize=3))
        assert [r[0] for r in results] == [i * 0.5 for i in range(10)]
        assert all(mp.is_shared(r) for r in results)
        assert list(ex.map(_square, range(7))) == [x * x for x in range(7)]
        assert list(ex.map(lambda a, b: a - b, range(3), range(3, 6))) == [-3, -3, -3]


@pytest.mark.timeout(60)
def test_sigkill_fails_one_future_and_the_executor_goes_on(tmp_path):
    path = tmp_path / "pid"
    with _executor() as ex:
        victim = ex.submit(_sleep_and_report, str(path))
        assert wait_for(lambda: path.exists() and path.read_text(), 30)
        pid = int(path.read_text())
        others = [ex.submit(_square, i) for i in range(20)]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TerminatedWorkerError) as info:
            victim.result(timeout=30)
        e = info.value
        assert isinstance(e, BrokenProcessPool) and isinstance(e, mp.WorkerLostError)
        assert (e.pid, e.signal_name) == (pid, "SIGKILL") and e.task.startswith("submit(")
        assert "tensormp.ProcessPoolExecutor: worker" in str(e)
        assert [f.result(timeout=30) for f in others] == [i * i for i in range(20)]
        assert ex.submit(_square, 9).result(timeout=30) == 81
        with pytest.raises(TerminatedWorkerError, match="exited with code 5"):
            ex.submit(_os_exit, 5).result(timeout=30)
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is TerminatedWorkerError and back.pid == pid


@pytest.mark.timeout(30)
def test_a_failing_initializer_breaks_the_executor():
    ex = _executor(initializer=_failing_initializer)
    try:
        with pytest.raises(BrokenProcessPool) as info:
            ex.submit(_square, 2).result(timeout=30)
        assert isinstance(info.value, BrokenExecutorError)
        assert "cannot load the model" in str(info.value.__cause__)
        with pytest.raises(BrokenExecutorError):
            ex.submit(_square, 3)
    finally:
        ex.shutdown(wait=True)


@pytest.mark.timeout(30)
def test_exceptions_timeouts_and_cancel():
    with _executor(1) as ex:
        with pytest.raises(KeyError, match="missing") as info:
            ex.submit(_raise, "missing").result(timeout=30)
        assert "_raise" in str(info.value.__cause__)  # the remote traceback
        it = ex.map(_sleep, [0.3, 0.3], timeout=0.05)
        with pytest.raises(concurrent.futures.TimeoutError):
            next(it)
        it.close()  # cancels what has not started (as concurrent.futures)
        blocker = ex.submit(_sleep, 0.5)
        queued = [ex.submit(_square, i) for i in range(8)]
        cancelled = [f for f in queued if f.cancel()]
        assert cancelled, "futures still waiting for a worker can be cancelled"
        blocker.result(timeout=30)
        for f in queued:
            assert f.cancelled() or f.result(timeout=30) in {i * i for i in range(8)}


@pytest.mark.timeout(30)
def test_shutdown_semantics():
    ex = _executor(1)
    slow = ex.submit(_sleep, 0.3)
    assert wait_for(slow.running, 30)
    pending = [ex.submit(_square, i) for i in range(10)]
    ex.shutdown(wait=True, cancel_futures=True)
    assert slow.result() == 0.3
    assert all(f.cancelled() or f.done() for f in pending) and any(f.cancelled() for f in pending)
    with pytest.raises(RuntimeError, match="after shutdown"):
        ex.submit(_square, 1)
    ex.shutdown()  # twice is fine

    ex = _executor(1)
    futures = [ex.submit(_square, i) for i in range(5)]
    ex.shutdown(wait=False)  # the submitted work still completes
    assert [f.result(timeout=30) for f in futures] == [0, 1, 4, 9, 16]


@pytest.mark.timeout(60)
def test_max_tasks_per_child_with_array_results():
    arrays = [np.full(1000, i, np.float64) for i in range(4)]
    with _executor(2, max_tasks_per_child=1) as ex:
        out = list(ex.map(_negate_with_pid, arrays))
    assert len({pid for pid, _ in out}) == 4
    assert [a[0] for _, a in out] == [0, -1, -2, -3] and all(mp.is_shared(a) for _, a in out)


@pytest.mark.timeout(30)
def test_progress_and_bad_input():
    seen = []
    with _executor() as ex:
        assert list(ex.map(_square, range(6), chunksize=2,
                           progress=lambda d, t: seen.append((d, t)))) == [x * x for x in range(6)]
        assert seen[0] == (0, 6) and seen[-1] == (6, 6)
        with pytest.raises(ValueError, match="chunksize"):
            ex.map(_square, range(3), chunksize=0)
        with pytest.raises(TypeError, match="fn must be callable"):
            ex.submit(3)
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        ProcessPoolExecutor(0)
    with pytest.raises(ValueError, match="max_tasks_per_child"):
        ProcessPoolExecutor(1, max_tasks_per_child=0)
    with pytest.raises(TypeError, match="initializer"):
        ProcessPoolExecutor(1, initializer="no")


def test_exported_names():
    assert mp.ProcessPoolExecutor is ProcessPoolExecutor
    assert mp.TerminatedWorkerError is TerminatedWorkerError
    assert mp.BrokenExecutorError is BrokenExecutorError
    for name in ("ProcessPoolExecutor", "WorkerLostError", "BrokenPoolError",
                 "TerminatedWorkerError", "BrokenExecutorError"):
        assert name in mp.__all__


def _make_lock(_):
    import threading

    return threading.Lock()


@pytest.mark.timeout(60)
def test_an_unpicklable_result_raises_what_concurrent_futures_raises():
    ctx = mp.get_context("spawn")
    std = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=std) as ref, \
            mp.ProcessPoolExecutor(1, mp_context=ctx) as ex:
        with pytest.raises(Exception) as theirs:
            ref.submit(_make_lock, 0).result(timeout=30)
        with pytest.raises(Exception) as ours:
            ex.submit(_make_lock, 0).result(timeout=30)
        assert type(ours.value) is type(theirs.value) is TypeError
        assert "lock" in str(ours.value)
        assert ex.submit(abs, -3).result(timeout=30) == 3  # the executor goes on
    with ctx.Pool(1) as pool:  # the Pool keeps the stdlib Pool's type
        with pytest.raises(multiprocessing.pool.MaybeEncodingError):
            pool.apply(_make_lock, (0,))


# -- as concurrent.futures: references, interpreter exit (issue 23, part 2) -----------------


class _Box:
    """A result the test can hold a weak reference to."""

    def __init__(self, i):
        self.i = i


def _box(i):
    return _Box(i)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunksize", [1, 3])
def test_map_keeps_no_reference_to_a_yielded_result(chunksize):
    import gc
    import weakref

    with _executor() as ex:
        alive = []
        for obj in ex.map(_box, range(10), chunksize=chunksize):
            ref = weakref.ref(obj)
            del obj
            gc.collect()
            alive.append(ref() is not None)
    assert not any(alive), f"{sum(alive)} of 10 results yielded and dropped are still alive"


def _run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    src = str(Path(mp.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", ["fork", METHOD])
def test_an_executor_dropped_just_before_exit_prints_nothing(tmp_path, method):
    body = f"""
        import multiprocessing.util
        import tensormp

        def f(x):
            return x

        def main():
            ex = tensormp.ProcessPoolExecutor(2, mp_context=tensormp.get_context({method!r}))
            print(ex.submit(f, 1).result())  # no shutdown(): collected on return

        if __name__ == "__main__":
            # multiprocessing's exit function runs this last, unless it stopped before
            multiprocessing.util.Finalize(None, print, ("last finalizer",), exitpriority=-100)
            main()
        """
    for _ in range(5):
        out = _run_script(tmp_path, body)
        assert (out.returncode, out.stderr) == (0, ""), out.stderr[-3000:]
        assert out.stdout.split() == ["1", "last", "finalizer"], out.stdout


@pytest.mark.timeout(60)
def test_submit_once_interpreter_shutdown_began_raises(tmp_path):
    body = f"""
        import atexit
        import tensormp

        def f(x):
            return x

        def hook():
            try:
                ex.submit(f, 2)
            except RuntimeError as e:
                print("RuntimeError:", e)
            else:
                print("submitted")

        if __name__ == "__main__":
            ex = tensormp.ProcessPoolExecutor(1, mp_context=tensormp.get_context({METHOD!r}))
            print(ex.submit(f, 1).result())
            atexit.register(hook)  # runs before tensormp's and multiprocessing's exit hooks
        """
    out = _run_script(tmp_path, body)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "1", "RuntimeError: cannot schedule new futures after interpreter shutdown"
    ], out.stdout + out.stderr[-3000:]
