"""No task waits behind a long one while a worker idles (issue 23, part 1): with 2 workers, one
task that blocks and nine instant ones submitted after it, the nine come back while the long
one still runs, as with the stdlib's Pool, concurrent.futures and loky; through the executor,
``Pool.imap_unordered``, ``Pool.apply_async`` and joblib's ``generator_unordered``.

The long task blocks until the test releases it (a file appears), so a passing test takes
milliseconds and a failing one fails at its deadline instead of after a fixed sleep. Two ways
of getting tasks queued behind it (each failed before the fix): the second worker starts late
(its initializer sleeps), so all the tasks go to the first one, as in the issue's repro; or both
workers are busy when the tasks arrive, the first with a task of 0.3 s."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
import time
from pathlib import Path

import pytest

import tensormp
from helpers import wait_for

pytestmark = pytest.mark.timeout(90)

METHOD = "forkserver"  # as strict as spawn (everything pickled), faster to start
DEADLINE = 5.0  # seconds the nine fast results may take (they take milliseconds)
SLOW = 1  # the index of the long task


def _task(i, release, first=0.0):
    """Instant, except task SLOW: it runs until ``release`` exists (at most 60 s); task 0
    sleeps ``first`` seconds."""
    if i == 0 and first:
        time.sleep(first)
    if i == SLOW:
        end = time.monotonic() + 60
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.005)
    return i


def _star(args):
    return _task(*args)


def _stagger(marker):
    """Initializer: the first worker to start is ready at once, the next one a second later."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        time.sleep(1.0)


def _staggered(tmp_path) -> dict:
    return {"initializer": _stagger, "initargs": (str(tmp_path / "first"),)}


def _check_fast_first(arrived, release: Path, what: str) -> None:
    """``arrived()``: the indices whose result has come so far. The nine fast ones must all
    come while the long one still runs; then it is released."""
    try:
        fast = set(range(10)) - {SLOW}
        ok = wait_for(lambda: fast <= set(arrived()), timeout=DEADLINE)
        got = sorted(arrived())
        assert ok, (
            f"{what}: after {DEADLINE} s only {got} of the nine fast tasks came back while "
            f"task {SLOW} still ran (they waited behind it while the other worker idled)"
        )
        assert SLOW not in got
    finally:
        release.write_text("go")


def test_executor_fast_tasks_do_not_wait_behind_a_long_one(tmp_path):
    release = tmp_path / "release"
    ctx = tensormp.get_context(METHOD)
    with tensormp.ProcessPoolExecutor(2, mp_context=ctx, **_staggered(tmp_path)) as ex:
        ex.submit(_task, 0, str(release)).result()  # a tiny task first: the repro
        futures = [ex.submit(_task, i, str(release)) for i in range(10)]
        _check_fast_first(
            lambda: [f.result() for f in futures if f.done()], release, "executor.submit"
        )
        order = [f.result() for f in concurrent.futures.as_completed(futures, timeout=60)]
    assert sorted(order) == list(range(10))


def test_imap_unordered_fast_tasks_do_not_wait_behind_a_long_one(tmp_path):
    release = tmp_path / "release"
    with tensormp.get_context(METHOD).Pool(2, **_staggered(tmp_path)) as pool:
        pool.apply(_task, (0, str(release)))
        got: list[int] = []
        it = pool.imap_unordered(_star, [(i, str(release)) for i in range(10)])

        def arrived():
            try:
                while True:
                    got.append(it.next(timeout=0.01))
            except (multiprocessing.TimeoutError, StopIteration):
                pass
            return got

        _check_fast_first(arrived, release, "Pool.imap_unordered")
        got.extend(it)
    assert got[-1] == SLOW and sorted(got) == list(range(10))


def test_apply_async_fast_tasks_do_not_wait_behind_a_long_one(tmp_path):
    release = tmp_path / "release"
    with tensormp.get_context(METHOD).Pool(2, **_staggered(tmp_path)) as pool:
        pool.apply(_task, (0, str(release)))
        done: list[int] = []
        results = [
            pool.apply_async(_task, (i, str(release)), callback=done.append) for i in range(10)
        ]
        _check_fast_first(lambda: list(done), release, "Pool.apply_async")
        assert [r.get(timeout=60) for r in results] == list(range(10))
    assert done[-1] == SLOW


def test_executor_both_workers_busy(tmp_path):
    """Both workers ready and busy (0.3 s, and the long task) when nine fast tasks come."""
    release = tmp_path / "release"
    ctx = tensormp.get_context(METHOD)
    with tensormp.ProcessPoolExecutor(2, mp_context=ctx) as ex:
        _both_ready(ex.submit)
        futures = [ex.submit(_task, i, str(release), 0.3) for i in range(10)]
        _check_fast_first(
            lambda: [f.result() for f in futures if f.done()], release, "executor.submit"
        )
        assert sorted(f.result() for f in futures) == list(range(10))


def _pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()


def _both_ready(submit) -> None:
    """Run two tasks at a time until both workers answered."""
    pids: set[int] = set()
    end = time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < end:
        pids |= {f.result() for f in [submit(_pid_after, 0.1) for _ in range(2)]}
    assert len(pids) == 2


def test_joblib_generator_unordered_fast_tasks_do_not_wait_behind_a_long_one(tmp_path):
    joblib = pytest.importorskip("joblib")
    import tensormp.joblib  # registers the backend

    release = tmp_path / "release"
    got: list[int] = []
    try:
        with joblib.parallel_config(backend="tensormp", n_jobs=2):
            pids: set[int] = set()
            end = time.monotonic() + 30
            while len(pids) < 2 and time.monotonic() < end:
                pids |= set(joblib.Parallel()(joblib.delayed(_pid_after)(0.1) for _ in range(2)))
            assert len(pids) == 2
            gen = joblib.Parallel(
                return_as="generator_unordered", pre_dispatch="all", batch_size=1
            )(joblib.delayed(_task)(i, str(release), 0.3) for i in range(10))
            # joblib's generator dispatches and collects as it is iterated: drain it in a
            # thread and watch what came.
            reader = threading.Thread(target=lambda: got.extend(gen), daemon=True)
            reader.start()
            _check_fast_first(lambda: list(got), release, "joblib generator_unordered")
            reader.join(60)
            assert not reader.is_alive()
    finally:
        tensormp.joblib.shutdown()
    assert got[-1] == SLOW and sorted(got) == list(range(10))
