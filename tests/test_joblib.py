"""The joblib backend "tensormp": arrays both ways as shared memory, lambdas, failures as joblib
expects, scikit-learn's n_jobs, and the pool kept between calls."""

from __future__ import annotations

import os
import signal

import joblib
import numpy as np
import psutil
import pytest
from joblib.externals.loky.process_executor import (
    TerminatedWorkerError as LokyTerminatedWorkerError,
)

import tensormp
import tensormp.joblib  # registers the backend
from helpers import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _stop_workers():
    yield
    tensormp.joblib.shutdown()  # the kept workers would count as leaked children


def double_info(a):
    """2a, whether ``a`` arrived as shared memory, and the worker's pid."""
    return a * 2, tensormp.is_shared(a), os.getpid()


def fill(a, value):
    a[:] = value


def boom(i):
    if i == 3:
        raise ValueError(f"bad item {i}")
    return i


def die(i):
    if i == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return i


def segv(i):
    if i == 2:
        import ctypes

        ctypes.string_at(0)  # SIGSEGV in native code
    return i


def inner(i):
    return sum(joblib.Parallel(n_jobs=2)(joblib.delayed(abs)(-j) for j in range(i)))


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_arrays_cross_as_shared_memory_both_ways(method):
    arrays = [np.full((256, 256), i, dtype=np.float32) for i in range(6)]
    with joblib.parallel_config(backend="tensormp", n_jobs=2, start_method=method):
        out = joblib.Parallel()(joblib.delayed(double_info)(a) for a in arrays)
    for i, (result, arg_shared, _) in enumerate(out):
        assert arg_shared, "the argument did not arrive as shared memory"
        assert tensormp.is_shared(result), "the result did not come back as shared memory"
        assert result.dtype == np.float32 and result.shape == (256, 256)
        assert (result == 2 * i).all()
    assert len({pid for _, _, pid in out} - {os.getpid()}) >= 1


def test_writes_into_a_shared_argument_are_seen_by_the_caller():
    target = tensormp.zeros((4, 1000))
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        joblib.Parallel()(joblib.delayed(fill)(target[i], i + 1) for i in range(4))
    assert target[:, 0].tolist() == [1, 2, 3, 4] and (target[:, -1] == target[:, 0]).all()


def test_lambdas_and_local_functions_next_to_arrays():
    offset = 10.0

    def local(a, k):
        return a.sum() + k + offset

    a = np.ones(1000)
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        out = joblib.Parallel()(
            joblib.delayed(lambda x, f: (f(x), tensormp.is_shared(x)))(a, lambda y: y[0] * 3)
            for _ in range(4)
        )
        assert out == [(3.0, True)] * 4
        assert joblib.Parallel()(joblib.delayed(local)(a, k=i) for i in range(3)) == [
            1010.0, 1011.0, 1012.0
        ]
        # a result plain pickle refuses comes back by value
        fns = joblib.Parallel()(joblib.delayed(lambda i: (lambda: i))(i) for i in range(3))
        assert [f() for f in fns] == [0, 1, 2]


def test_an_exception_reaches_the_caller_and_the_backend_stays_usable():
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        with pytest.raises(ValueError, match="bad item 3") as info:
            joblib.Parallel(batch_size=1)(joblib.delayed(boom)(i) for i in range(8))
        assert "boom" in str(info.value.__cause__)  # the worker's traceback
        assert joblib.Parallel()(joblib.delayed(boom)(i) for i in range(3)) == [0, 1, 2]


def test_a_call_after_a_failed_one_in_a_with_block_gets_only_its_own_results():
    """joblib keeps batches split off but not dispatched on the Parallel object; after a failed
    call the next call of the same `with Parallel(...)` block must not return them (joblib 1.6
    does with loky too, less often)."""
    with joblib.Parallel(n_jobs=2, backend="tensormp") as par:
        for attempt in range(3):
            assert par(joblib.delayed(boom)(k) for k in range(3)) == [0, 1, 2]
            with pytest.raises(ValueError, match="bad item 3"):
                par(joblib.delayed(boom)(i) for i in range(12))
            assert par(joblib.delayed(str)(x) for x in "abcd") == list("abcd"), attempt


def test_a_dead_worker_raises_terminated_worker_error_as_loky():
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        with pytest.raises(LokyTerminatedWorkerError) as info:
            joblib.Parallel(batch_size=1)(joblib.delayed(die)(i) for i in range(4))
        e = info.value
        assert isinstance(e, tensormp.TerminatedWorkerError)
        assert isinstance(e, tensormp.joblib.TerminatedWorkerError)
        assert e.signal_name == "SIGKILL" and e.pid > 0 and e.task == "die(1)"
        assert "die(1)" in str(e) and "SIGKILL" in str(e)
        # the next call gets fresh workers
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(5)) == [0, 1, 2, 3, 4]


def test_a_crash_in_native_code_carries_the_workers_python_stack():
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        with pytest.raises(tensormp.joblib.TerminatedWorkerError) as info:
            joblib.Parallel(batch_size=1)(joblib.delayed(segv)(i) for i in range(4))
    assert info.value.signal_name == "SIGSEGV"
    assert "segv" in str(info.value.__cause__)  # faulthandler's dump of the worker


def test_workers_are_kept_between_calls_and_nested_calls_use_threads():
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        first = {p for *_, p in joblib.Parallel()(
            joblib.delayed(double_info)(np.zeros(3)) for _ in range(6))}
        second = {p for *_, p in joblib.Parallel()(
            joblib.delayed(double_info)(np.zeros(3)) for _ in range(6))}
        assert first and second <= first | second and first & second
        assert joblib.Parallel()(joblib.delayed(inner)(i) for i in range(5)) == [
            0, 0, 1, 3, 6
        ]
        gen = joblib.Parallel(return_as="generator")(joblib.delayed(abs)(-i) for i in range(4))
        assert list(gen) == [0, 1, 2, 3]


def test_idle_workers_stop_after_idle_worker_timeout():
    with joblib.parallel_config(backend="tensormp", n_jobs=2, idle_worker_timeout=0.2):
        pids = {p for *_, p in joblib.Parallel()(
            joblib.delayed(double_info)(np.zeros(3)) for _ in range(4))}
    assert wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 10.0), pids


def test_scikit_learn_estimators_run_on_the_backend():
    sklearn = pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.model_selection import cross_val_score

    assert sklearn
    X, y = load_digits(return_X_y=True)
    model = RandomForestClassifier(n_estimators=20, random_state=0)
    serial = cross_val_score(model, X, y, cv=3, n_jobs=1)
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        parallel = cross_val_score(model, X, y, cv=3, n_jobs=2)
        forest = RandomForestClassifier(n_estimators=20, random_state=0, n_jobs=2).fit(X, y)
    assert parallel.tolist() == serial.tolist()
    assert forest.score(X, y) > 0.95 and len(forest.estimators_) == 20


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(ValueError, match="start_method must be"):
        with joblib.parallel_config(backend="tensormp", n_jobs=2, start_method="threads"):
            joblib.Parallel()(joblib.delayed(abs)(-1) for _ in range(2))
    with pytest.raises(ValueError, match="n_jobs == 0"):
        joblib.Parallel(backend="tensormp", n_jobs=0)(joblib.delayed(abs)(-1) for _ in range(2))


def _child_uses_backend(conn):
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        out = joblib.Parallel()(joblib.delayed(double_info)(np.ones(3)) for _ in range(4))
    tensormp.joblib.shutdown()
    conn.send([pid for *_, pid in out])
    conn.close()


def test_a_forked_child_gets_its_own_workers():
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        mine = {p for *_, p in joblib.Parallel()(
            joblib.delayed(double_info)(np.ones(3)) for _ in range(4))}
    ctx = tensormp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_uses_backend, args=(writer,))
    child.start()
    writer.close()
    assert reader.poll(60), "the forked child's Parallel call did not finish"
    theirs = set(reader.recv())
    child.join(30)
    reader.close()
    assert child.exitcode == 0 and theirs and not theirs & mine
