"""tensormp.Pool: the stdlib API, arrays both ways as shared memory, dead workers reported (real
processes, real signals), maxtasksperchild with array results, progress bars, lambdas."""

from __future__ import annotations

import ctypes
import functools
import itertools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import tensormp as mp
from helpers import START_METHODS, wait_for
from tensormp.pool import BrokenPoolError, Pool, WorkerLostError

# The one start method of every test but the transfer matrix: forkserver is as strict as spawn
# (everything pickled, nothing inherited) and its children start 2x faster (preload, conftest.py).
METHOD = "forkserver"


def _pool(processes: int = 2, **kwargs) -> Pool:
    return mp.get_context(METHOD).Pool(processes, **kwargs)


# -- functions the workers run (top level: importable by spawn children) ----------------------


def _square(x):
    return x * x


def _add(a, b):
    return a + b


def _negate(a):
    return -a


def _touch(shared, private):
    shared += 1  # the parent sees this write
    return shared[::2], private * 2, bool(mp.is_shared(private))


def _negate_with_pid(a):
    return os.getpid(), -a


def _raise_value_error(message):
    raise ValueError(message)


def _hang_on(x, bad, path):
    if x == bad:
        Path(path).write_text(str(os.getpid()))
        time.sleep(60)
    return x * x


def _sleep_and_report(path, seconds=60.0):
    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)
    return "finished"


def _os_exit(code):
    os._exit(code)


def _sys_exit(code):
    sys.exit(code)


def _segfault():
    ctypes.string_at(0)  # a real SIGSEGV


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _lock():
    return threading.Lock()


def _full(n, value):
    return np.full(n, value, dtype=np.float32)


_STATE = None


def _init_state(tag, shared, private):
    global _STATE
    _STATE = (tag, shared, private)


def _read_state(_):
    tag, shared, private = _STATE
    shared[os.getpid() % shared.size] = 1  # visible to the parent
    return tag, float(private.sum()), bool(mp.is_shared(shared)), bool(mp.is_shared(private))


def _failing_initializer():
    raise RuntimeError("no GPU in this worker")


def _wait_for_pid(path: Path, timeout: float = 30.0) -> int:
    assert wait_for(lambda: path.exists() and path.read_text(), timeout), "the task never started"
    return int(path.read_text())


# -- the seed's examples, as written ----------------------------------------------------------


@pytest.mark.timeout(30)
def test_seed_example_apply_twice_and_apply_async_with_callback():
    pool = _pool()
    assert pool.apply(_square, (3,)) == 9  # blocking apply, twice
    assert pool.apply(_square, (4,)) == 16
    got = []
    result = pool.apply_async(_add, (2, 3), callback=got.append)
    assert result.get(timeout=30) == 5
    assert got == [5] and result.ready() and result.successful()
    pool.close()
    pool.join()


@pytest.mark.timeout(30)
def test_seed_example_map_with_automatic_and_explicit_chunksize_and_map_async():
    with _pool() as pool:
        assert pool.map(_square, range(10)) == [x * x for x in range(10)]
        assert pool.map(_square, range(100), chunksize=7) == [x * x for x in range(100)]
        assert pool.map(_square, []) == []
        result = pool.map_async(_square, range(20))
        assert result.get(timeout=30) == [x * x for x in range(20)]


@pytest.mark.timeout(30)
def test_seed_example_starmap_and_context_manager():
    with _pool() as pool:
        assert pool.starmap(_add, [(1, 2), (3, 4), (5, 6)]) == [3, 7, 11]
        assert pool.starmap_async(_add, [(1, 1)] * 5, chunksize=2).get(30) == [2] * 5
        assert pool.starmap(pow, zip(range(5), itertools.repeat(2))) == [0, 1, 4, 9, 16]
    with pytest.raises(ValueError, match="Pool not running"):
        pool.apply(_square, (1,))


# -- arrays -------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", START_METHODS)
def test_arrays_cross_both_ways_as_shared_memory(method):
    shared = mp.zeros(8)
    private = np.arange(6.0)
    with mp.get_context(method).Pool(2, initializer=_init_state,
                                     initargs=("tag", mp.zeros(4), np.ones(3))) as pool:
        view, doubled, was_shared = pool.apply(_touch, (shared, private))
        assert (shared == 1).all(), "the worker's write to a shared argument is visible"
        assert was_shared, "a private argument arrives as a shared copy"
        np.testing.assert_array_equal(private, np.arange(6.0))  # the sender's copy untouched
        assert mp.is_shared(view) and mp.is_shared(doubled)
        view[0] = 42  # the returned view is a view of the parent's own memory
        assert shared[0] == 42
        np.testing.assert_array_equal(doubled, np.arange(6.0) * 2)

        arrays = [np.full(1000, i, np.float32) for i in range(6)]
        for out in (pool.map(_negate, arrays), list(pool.imap(_negate, arrays)),
                    pool.starmap(_add, zip(arrays, arrays))):
            assert all(mp.is_shared(o) for o in out)
        np.testing.assert_array_equal(pool.map(_negate, arrays)[5], -arrays[5])

        big = pool.apply(_full, (4 << 20, 3.0))  # a 16 MiB result: a handle, not a pickle
        assert mp.is_shared(big) and big.nbytes == 16 << 20 and big[-1] == 3.0
        tags = pool.map(_read_state, range(4))
        assert {t[0] for t in tags} == {"tag"} and all(t[1] == 3.0 and t[2] for t in tags)
        # Process arguments (initargs) under fork are inherited, not pickled (stdlib
        # semantics): a private array is the worker's copy-on-write copy.
        assert all(t[3] == (method != "fork") for t in tags)


@pytest.mark.timeout(60)
def test_maxtasksperchild_1_with_array_results():
    # torch.multiprocessing hangs here (pytorch#135705): the worker exits right after
    # sending its tensor. Our results travel with their fds, so they outlive the worker.
    arrays = [np.full(50_000, i, np.float64) for i in range(6)]
    with _pool(2, maxtasksperchild=1) as pool:
        out = pool.map(_negate_with_pid, arrays, chunksize=1)
        assert len({pid for pid, _ in out}) == 6, "every task ran in a fresh worker"
        for i, (_, a) in enumerate(out):
            assert mp.is_shared(a) and a[0] == -i
        again = [a for _, a in pool.imap(_negate_with_pid, arrays[:3])]
        assert [a[-1] for a in again] == [0, -1, -2]
        assert pool.apply(_square, (7,)) == 49
        assert wait_for(lambda: len(pool._pool) == 2), "retired workers are reaped"


# -- dead workers -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_sigkill_fails_the_running_task_and_the_pool_goes_on(tmp_path):
    path = tmp_path / "pid"
    with _pool() as pool:
        victim = pool.apply_async(_sleep_and_report, (str(path),))
        pid = _wait_for_pid(path)
        # Many small tasks: one may be queued on the victim behind its running task.
        squares = pool.map_async(_square, range(40), chunksize=1)
        os.kill(pid, signal.SIGKILL)  # what the OOM killer does
        with pytest.raises(WorkerLostError) as info:
            victim.get(timeout=30)
        e = info.value
        assert (e.pid, e.exitcode, e.signal_name) == (pid, -9, "SIGKILL")
        assert e.task.startswith("apply_async(_sleep_and_report, '/")
        assert f"worker {pid} was killed by signal SIGKILL" in str(e) and "out-of-memory" in str(e)
        assert isinstance(e, mp.TensormpError) and isinstance(e, RuntimeError)
        assert squares.get(timeout=30) == [x * x for x in range(40)], "queued tasks were rerun"
        assert pool.apply(_square, (5,)) == 25
        pids = [p.pid for p in pool._pool]
        assert len(pids) == 2 and pid not in pids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["map", "imap_unordered"])
def test_sigkill_during_a_map_names_the_chunk(tmp_path, how):
    path = tmp_path / "pid"
    with _pool() as pool:
        if how == "map":
            result = pool.starmap_async(_hang_on, [(x, 7, str(path)) for x in range(12)], 2)
        else:
            args = [(x, 7, str(path)) for x in range(12)]
            it = pool.imap_unordered(functools.partial(_star_hang), args)
        os.kill(_wait_for_pid(path), signal.SIGKILL)
        with pytest.raises(WorkerLostError) as info:
            if how == "map":
                result.get(timeout=30)
            else:
                got = [x for x in it]  # noqa: C416 - raises at the lost chunk
        if how == "map":
            assert info.value.task == "starmap(_hang_on) chunk 4 of 6 (items 6-7)"
        else:
            assert info.value.task.startswith("imap_unordered(") and "(item 7)" in info.value.task
            got = sorted(it)  # the iterator goes on after the failure
            assert len(got) <= 11
        assert pool.map(_square, range(3)) == [0, 1, 4]


def _star_hang(args):
    return _hang_on(*args)


@pytest.mark.timeout(60)
def test_exit_code_sys_exit_and_crash_are_reported():
    with _pool() as pool:
        with pytest.raises(WorkerLostError, match="exited with code 3 while running apply"):
            pool.apply(_os_exit, (3,))
        with pytest.raises(WorkerLostError) as info:
            pool.apply(_sys_exit, (4,))
        assert info.value.exitcode == 4 and info.value.signal_name is None
        assert "SystemExit: 4" in str(info.value)
        assert "_sys_exit" in str(info.value.__cause__)  # the worker's traceback
        with pytest.raises(WorkerLostError) as info:
            pool.apply(_segfault)
        assert info.value.signal_name == "SIGSEGV"
        cause = str(info.value.__cause__)
        assert "faulthandler" in cause and "_segfault" in cause  # the worker's Python stack
        assert pool.starmap(_add, [(1, 1)]) == [2]


def test_worker_lost_error_pickles():
    e = WorkerLostError("worker 12 was killed", 12, -9, "map(f) chunk 1 of 2 (items 0-3)")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is WorkerLostError and str(back) == str(e)
    assert (back.pid, back.exitcode, back.signal_name, back.task) == (12, -9, "SIGKILL", e.task)
    b = pickle.loads(pickle.dumps(BrokenPoolError("broken")))
    assert isinstance(b, mp.TensormpError) and str(b) == "broken"


@pytest.mark.timeout(60)
def test_a_failing_initializer_breaks_the_pool_instead_of_respawning():
    pool = _pool(initializer=_failing_initializer)
    try:
        with pytest.raises(BrokenPoolError, match="initializer _failing_initializer raised") as info:
            pool.map(_square, range(10))
        assert isinstance(info.value.__cause__, RuntimeError)
        assert "no GPU" in str(info.value.__cause__)
        with pytest.raises(BrokenPoolError):
            pool.apply_async(_square, (1,))
    finally:
        pool.terminate()
        pool.join()


@pytest.mark.timeout(60)
def test_terminate_fails_unfinished_results_instead_of_hanging():
    pool = _pool()
    running = [pool.apply_async(_sleep, (30,)) for _ in range(4)]
    t0 = time.monotonic()
    pool.terminate()
    pool.join()
    for result in running:
        with pytest.raises(BrokenPoolError, match="was terminated"):
            result.get(timeout=5)
    assert time.monotonic() - t0 < 10


# -- functions, callbacks, errors ---------------------------------------------------------------


@pytest.mark.timeout(60)
def test_lambdas_closures_and_local_functions():
    k = 3

    def times_k(x):
        return x * k

    with _pool() as pool:
        assert pool.map(lambda x: x + 1, range(5)) == [1, 2, 3, 4, 5]
        assert pool.apply(times_k, (5,)) == 15
        assert pool.starmap(functools.partial(lambda a, b, c: a + b + c, c=100), [(1, 2)]) == [103]
        assert list(pool.imap(lambda a: a.sum(), [np.ones(4)] * 3)) == [4.0] * 3


@pytest.mark.timeout(30)
def test_task_errors_carry_the_remote_traceback():
    with _pool() as pool:
        with pytest.raises(ValueError, match="bad input 7") as info:
            pool.apply(_raise_value_error, ("bad input 7",))
        assert "_raise_value_error" in str(info.value.__cause__)
        result = pool.map_async(_raise_value_error, ["a", "b"], chunksize=1)
        with pytest.raises(ValueError):
            result.get(30)
        assert not result.successful()


def _fail_first(x):
    if x == 0:
        raise ValueError("chunk 0 failed")
    time.sleep(5)
    return x


@pytest.mark.timeout(60)
def test_map_fails_as_soon_as_a_chunk_failed():
    # As the stdlib: map() raises at the first failed chunk, not once every chunk is done.
    errors: list = []
    with _pool() as pool:
        pool.apply(_square, (1,))  # the workers are up
        t0 = time.monotonic()
        result = pool.map_async(_fail_first, range(4), chunksize=1, error_callback=errors.append)
        with pytest.raises(ValueError, match="chunk 0 failed"):
            result.get(30)
        took = time.monotonic() - t0
        assert result.ready() and not result.successful()
        assert len(errors) == 1 and isinstance(errors[0], ValueError)
        assert took < 3, f"map raised after {took:.1f} s: it waited for the 5 s chunks"


@pytest.mark.timeout(30)
def test_unpicklable_arguments_and_results_fail_the_task_only():
    with _pool() as pool:
        with pytest.raises(TypeError, match="pickle"):
            pool.apply(_square, (threading.Lock(),))
        with pytest.raises(multiprocessing.pool.MaybeEncodingError, match="Error sending result"):
            pool.apply(_lock)
        assert pool.map(_square, range(4)) == [0, 1, 4, 9]


@pytest.mark.timeout(30)
def test_callbacks_and_a_raising_callback(capfd):
    good, bad = [], []
    with _pool() as pool:
        pool.apply_async(_square, (4,), callback=good.append).wait(30)
        pool.apply_async(_raise_value_error, ("x",), error_callback=bad.append).wait(30)
        pool.map_async(_square, range(3), callback=good.append).wait(30)

        def explode(_):
            raise KeyError("callback bug")

        pool.apply_async(_square, (1,), callback=explode).wait(30)
        assert pool.apply(_square, (6,)) == 36  # the pool survived the callback
    assert good == [16, [0, 1, 4]]
    assert len(bad) == 1 and isinstance(bad[0], ValueError)
    assert "exception in a result callback" in capfd.readouterr().err


@pytest.mark.timeout(30)
def test_get_timeout_and_not_ready():
    with _pool(1) as pool:
        result = pool.apply_async(_sleep, (5,))
        with pytest.raises(multiprocessing.TimeoutError):
            result.get(timeout=0.05)
        with pytest.raises(ValueError, match="not ready"):
            result.successful()


@pytest.mark.timeout(30)
def test_bad_input_raises_at_once():
    with pytest.raises(ValueError, match="at least 1"):
        Pool(0)
    with pytest.raises(ValueError, match="maxtasksperchild"):
        Pool(1, maxtasksperchild=0)
    with pytest.raises(TypeError, match="initializer must be callable"):
        Pool(1, initializer=3)
    with pytest.raises(TypeError, match="initargs must be a tuple"):
        Pool(1, initializer=print, initargs=5)
    with _pool(1) as pool:
        with pytest.raises(TypeError, match="func must be callable"):
            pool.map(42, range(3))
        with pytest.raises(ValueError, match="chunksize"):
            pool.map(_square, range(3), chunksize=0)
        with pytest.raises(ValueError, match="chunksize"):
            pool.imap(_square, range(3), chunksize=-1)
        with pytest.raises(TypeError, match=r"args=\(5,\)"):
            pool.apply_async(_square, 5)
        with pytest.raises(TypeError, match="kwds must be a mapping"):
            pool.apply_async(_square, (1,), [1])
        with pytest.raises(TypeError, match="callback must be callable"):
            pool.apply_async(_square, (1,), callback=1)
        with pytest.raises(TypeError, match="progress must be"):
            pool.map(_square, range(3), progress="yes")
        with pytest.raises(TypeError):
            pool.imap(_square, 3)
        with pytest.raises(ValueError, match="still running"):
            pool.join()
        with pytest.raises(NotImplementedError):
            pickle.dumps(pool)
        assert pool.map(_square, [2]) == [4]


@pytest.mark.timeout(30)
def test_pool_is_tensormp_pool_everywhere():
    for make in (mp.Pool, mp.get_context(METHOD).Pool, mp.get_context("fork").Pool):
        pool = make(1)
        try:
            assert isinstance(pool, Pool)
        finally:
            pool.terminate()
    stdlib_ctx = multiprocessing.get_context("fork")
    pool = Pool(1, context=stdlib_ctx)  # a stdlib context: tensormp's of the same method
    assert "start_method=fork" in repr(pool)
    pool.close()
    pool.join()


# -- imap ---------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_imap_orders_and_unordered_does_not():
    with _pool() as pool:
        assert list(pool.imap(_square, range(50), chunksize=4)) == [x * x for x in range(50)]
        assert sorted(pool.imap_unordered(_square, range(50))) == [x * x for x in range(50)]
        it = pool.imap(_square, iter(range(3)))
        assert [it.next(timeout=30) for _ in range(3)] == [0, 1, 4]
        with pytest.raises(StopIteration):
            it.next(timeout=30)


@pytest.mark.timeout(30)
def test_imap_reads_its_iterable_only_as_workers_need_it():
    produced = []

    def source():
        for i in itertools.count():
            produced.append(i)
            yield i

    gate = mp.get_context(METHOD).Event()
    with _pool(initializer=_init_gate, initargs=(gate,)) as pool:
        it = pool.imap(_wait_for_gate, source())
        time.sleep(0.5)  # the workers are blocked: the feeder must stop soon
        # 2 running + 2 queued behind them + 4 * 2 + 4 waiting + 1 in the feeder's hand
        assert len(produced) <= 17, f"imap read {len(produced)} items ahead of its workers"
        gate.set()
        assert [next(it) for _ in range(40)] == [x * x for x in range(40)]


_GATE = None


def _init_gate(gate):
    global _GATE
    _GATE = gate


def _wait_for_gate(x):
    _GATE.wait(30)
    return x * x


@pytest.mark.timeout(30)
def test_imap_iterable_that_raises():
    def source():
        yield 1
        yield 2
        raise OSError("disk gone")

    with _pool() as pool:
        it = pool.imap(_square, source())
        assert next(it) == 1 and next(it) == 4
        with pytest.raises(OSError, match="disk gone"):
            next(it)


@pytest.mark.timeout(30)
def test_close_then_join_finishes_queued_work():
    pool = _pool()
    results = [pool.apply_async(_sleep, (0.05,)) for _ in range(6)]
    lazy = pool.imap(_square, range(30))
    pool.close()
    with pytest.raises(ValueError, match="Pool not running"):
        pool.map(_square, [1])
    pool.join()
    assert [r.get(0) for r in results] == [0.05] * 6
    assert list(lazy) == [x * x for x in range(30)]


# -- progress -----------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_progress_true_draws_a_tqdm_bar(capsys):
    with _pool() as pool:
        assert pool.map(_square, range(12), chunksize=3, progress=True) == [x * x for x in range(12)]
        err = capsys.readouterr().err
        assert "12/12" in err and "100%" in err and "_square" in err
        assert list(pool.imap(_square, range(5), progress=True)) == [0, 1, 4, 9, 16]
        assert "5/5" in capsys.readouterr().err
        assert pool.starmap(_add, [(1, 2)] * 4, progress=True) == [3] * 4
        assert "4/4" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_progress_callable():
    seen = []
    with _pool() as pool:
        pool.map(_square, range(20), chunksize=2, progress=lambda done, total: seen.append((done, total)))
        assert seen[0] == (0, 20) and seen[-1] == (20, 20)
        assert [d for d, _ in seen] == sorted({d for d, _ in seen})
        seen.clear()
        list(pool.imap_unordered(_square, iter(range(3)), progress=lambda d, t: seen.append((d, t))))
        assert seen == [(0, None), (1, None), (2, None), (3, None)]


@pytest.mark.timeout(30)
def test_progress_without_tqdm_says_how_to_get_it(monkeypatch):
    with _pool(1) as pool:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # as if it were not installed
        with pytest.raises(ImportError, match=r"tensormp\[progress\]"):
            pool.map(_square, range(3), progress=True)
        with pytest.raises(ImportError, match="tqdm"):
            pool.imap(_square, range(3), progress=True)
        assert pool.map(_square, range(3), progress=lambda d, t: None) == [0, 1, 4]


# -- slow: kill workers at random moments -------------------------------------------------------


def _work_slowly(a):
    time.sleep(0.002)
    return a * 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_random_sigkills_never_hang_and_never_corrupt():
    rng = np.random.default_rng(1)
    arrays = [np.full(10_000, i, np.float64) for i in range(200)]
    with mp.get_context("forkserver").Pool(2) as pool:  # replacements start in ms
        stop = threading.Event()

        def killer():
            while not stop.is_set():
                time.sleep(rng.uniform(0.005, 0.2))
                # Workers that are running tasks (killing every worker while it starts would,
                # three times in a row, rightly break the pool).
                pids = [w.pid for w in list(pool._engine.workers) if w.ready and not w.gone]
                if pids:
                    try:
                        os.kill(int(rng.choice(pids)), signal.SIGKILL)
                    except ProcessLookupError:
                        pass

        thread = threading.Thread(target=killer)
        thread.start()
        lost = ok = 0
        try:
            for _ in range(15):
                results = [pool.apply_async(_work_slowly, (a,)) for a in arrays[:40]]
                for i, r in enumerate(results):
                    try:
                        out = r.get(timeout=60)
                    except WorkerLostError as e:
                        assert e.signal_name == "SIGKILL"
                        lost += 1
                    else:
                        assert out[0] == 2 * i and mp.is_shared(out)
                        ok += 1
        finally:
            stop.set()
            thread.join()
        assert ok + lost == 15 * 40 and ok > 0 and lost > 0
        time.sleep(0.3)  # the killer's last victim is noticed and replaced
        assert wait_for(lambda: sum(w.ready for w in pool._engine.workers) == 2)
        assert pool.map(_square, range(10)) == [x * x for x in range(10)]


def _sum_of(a):
    return float(a.sum())


def test_task_arguments_are_given_back_exactly_once():
    """Each task's argument copy, and a shared array sent to every task, are given back once
    the tasks are done: the worker is registered as holder after the send (a release that came
    first cancels the hold), so nothing stays pinned and nothing is freed twice."""
    before = mp.memory_stats()["remote_held_bytes"]
    shared = mp.share(np.ones(10_000))
    with _pool() as pool:
        fresh = [pool.apply_async(_sum_of, (np.full(10_000, i, np.float64),)) for i in range(60)]
        same = [pool.apply_async(_sum_of, (shared,)) for _ in range(60)]
        assert [r.get(timeout=60) for r in fresh] == [10_000.0 * i for i in range(60)]
        assert [r.get(timeout=60) for r in same] == [10_000.0] * 60
        # The shared block stays counted while held; all of it is back once released.
        assert wait_for(lambda: mp.memory_stats()["remote_held_bytes"] == before, 10)
        del shared
        assert pool.apply(_sum_of, (np.ones(10),)) == 10.0
    assert wait_for(lambda: mp.memory_stats()["remote_held_bytes"] == before, 10)


def _process_name(_):
    return multiprocessing.current_process().name


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_are_named_as_the_stdlibs(method):
    """``ForkPoolWorker-<n>``/``SpawnPoolWorker-<n>`` for a Pool, the Process's own name for the
    executor (``ForkProcess-<n>``), as the stdlib names them: code may parse them."""
    kind = method.capitalize()
    with Pool(1, context=mp.get_context(method)) as pool:
        name = pool.apply(_process_name, (0,))
    assert name.startswith(f"{kind}PoolWorker-") and name.split("-")[1].isdigit(), name
    with mp.ProcessPoolExecutor(1, mp_context=mp.get_context(method)) as ex:
        name = ex.submit(_process_name, 0).result(30)
    assert name.startswith(f"{kind}Process-") and name.split("-")[1].isdigit(), name


def _register_exit_marker(path):
    import atexit

    atexit.register(lambda: Path(path, str(os.getpid())).write_text("bye"))


def test_spawn_workers_run_atexit_and_end_without_the_module_teardown(tmp_path):
    """A spawn worker ends as a forked one (context.py): its atexit handlers run, then
    os._exit; the end of ``with Pool(...)`` does not wait for the interpreter's teardown."""
    pool = Pool(2, context=mp.get_context("spawn"), initializer=_register_exit_marker,
                initargs=(str(tmp_path),))
    pids = set(pool.map(_pid, range(8)))
    pool.close()
    pool.join()
    assert {int(p.name) for p in tmp_path.iterdir()} >= pids
    assert all(p.read_text() == "bye" for p in tmp_path.iterdir())


def _pid(_):
    return os.getpid()
