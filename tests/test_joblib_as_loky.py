"""The joblib backend "tensormp" where programs written for joblib's default (loky) rely on it:
the workers' initializer, an argument that cannot be pickled, each failure's own traceback, and
ordinary torch tensors left as the caller had them (issue 23, part 3)."""

from __future__ import annotations

import os
import pickle
import threading
import traceback

import joblib
import numpy as np
import pytest

import tensormp
import tensormp.joblib  # registers the backend

pytestmark = pytest.mark.timeout(120)

_STATE: dict[str, object] = {}


@pytest.fixture(autouse=True)
def _stop_workers():
    yield
    tensormp.joblib.shutdown()  # the kept workers would count as leaked children


def remember(value):
    """The initializer of these tests: what every task of the worker then reads."""
    _STATE["value"] = value
    _STATE["pid"] = os.getpid()


def recall(_i):
    return _STATE.get("value"), os.getpid()


def getenv(name):
    return os.environ.get(name)


def fail(k):
    raise ValueError(f"failure number {k}")


def first_arg_id(x):
    return 1


def scale_(t):
    t.mul_(2)


def scale_all_(ts):
    for t in ts:
        t.mul_(2)


def write_through_one_view(t, tail):
    """``tail`` is ``t[1:]`` in the caller: a write through ``t`` must show in ``tail``."""
    t.fill_(5)
    return tail.tolist()


# -- initializer= and initargs= ----------------------------------------------------------------
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_initializer_given_to_parallel_runs_in_every_worker(method):
    with joblib.parallel_config(backend="tensormp", start_method=method):
        out = joblib.Parallel(n_jobs=2, batch_size=1, initializer=remember, initargs=(42,))(
            joblib.delayed(recall)(i) for i in range(8)
        )
    assert [v for v, _ in out] == [42] * 8
    assert os.getpid() not in {pid for _, pid in out}


def test_the_initializer_given_to_parallel_config_runs_and_a_change_gets_fresh_workers():
    with joblib.parallel_config(backend="tensormp", n_jobs=2, initializer=remember,
                                initargs=("a",)):
        first = joblib.Parallel()(joblib.delayed(recall)(i) for i in range(6))
        again = joblib.Parallel()(joblib.delayed(recall)(i) for i in range(6))
        assert [v for v, _ in first] == [v for v, _ in again] == ["a"] * 6
        assert {p for _, p in again} & {p for _, p in first}  # the same workers, kept
        # Parallel's own arguments win over parallel_config's (as loky)
        other = joblib.Parallel(initargs=("b",))(joblib.delayed(recall)(i) for i in range(6))
        assert [v for v, _ in other] == ["b"] * 6
        assert not {p for _, p in other} & {p for _, p in again}  # a new initializer: new workers
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        plain = joblib.Parallel()(joblib.delayed(recall)(i) for i in range(6))
    assert [v for v, _ in plain] == [None] * 6  # workers without an initializer


def test_an_initializer_plain_pickle_refuses_runs_too():
    # A lambda goes by value (cloudpickle); what it sets in a module the task imports is seen.
    with joblib.parallel_config(backend="tensormp", n_jobs=2, start_method="spawn"):
        out = joblib.Parallel(
            initializer=lambda v: os.environ.__setitem__("TENSORMP_TEST_INIT", v),
            initargs=("set",),
        )(joblib.delayed(getenv)("TENSORMP_TEST_INIT") for _ in range(4))
    assert out == ["set"] * 4
    assert "TENSORMP_TEST_INIT" not in os.environ


def broken_init():
    raise ValueError("no configuration found")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_bad_or_failing_initializer_is_reported_clearly(method):
    with joblib.parallel_config(backend="tensormp", n_jobs=2, start_method=method):
        with pytest.raises(TypeError, match="initializer must be callable, got int"):
            joblib.Parallel(initializer=42)(joblib.delayed(abs)(-i) for i in range(2))
        with pytest.raises(TypeError, match="initargs must be a tuple"):
            joblib.Parallel(initializer=remember, initargs=5)(
                joblib.delayed(abs)(-i) for i in range(2)
            )
        with pytest.raises(tensormp.BrokenPoolError,
                           match="initializer broken_init raised .* no configuration found"):
            joblib.Parallel(initializer=broken_init)(joblib.delayed(abs)(-i) for i in range(2))
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(3)) == [0, 1, 2]


# -- an argument that cannot be pickled ----------------------------------------------------------
def test_an_argument_that_cannot_be_pickled_raises_picklingerror_as_loky():
    lock = threading.Lock()
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        with pytest.raises(pickle.PicklingError) as info:
            joblib.Parallel()(joblib.delayed(first_arg_id)(lock) for _ in range(4))
        e = info.value
        assert str(e).startswith("Could not pickle the task to send it to the workers.")
        assert "first_arg_id" in str(e)  # which call
        assert isinstance(e.__cause__, TypeError) and "_thread.lock" in str(e.__cause__)
        # a task that raises a pickling error itself is still its own error
        with pytest.raises(TypeError, match="_thread.lock") as own:
            joblib.Parallel()(joblib.delayed(_pickle_a_lock)(i) for i in range(2))
        assert "_pickle_a_lock" in str(own.value.__cause__)  # the worker's traceback
        assert joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(3)) == [0, 1, 2]


def _pickle_a_lock(_i):
    return pickle.dumps(threading.Lock())


# -- each failure's own traceback ------------------------------------------------------------------
def _chain(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


def test_each_failure_of_a_managed_parallel_carries_only_its_own_traceback():
    with joblib.Parallel(n_jobs=2, backend="tensormp") as parallel:
        for k in range(3):
            with pytest.raises(ValueError, match=f"failure number {k}") as info:
                parallel(joblib.delayed(fail)(k) for _ in range(1))
            text = _chain(info.value)
            others = [j for j in range(3) if j != k and f"failure number {j}" in text]
            assert not others, f"failure {k}'s traceback also holds failures {others}:\n{text}"


def test_workers_started_while_the_caller_handles_an_exception_do_not_inherit_it():
    try:
        raise KeyError("the caller's own exception")
    except KeyError:
        with pytest.raises(ValueError) as info:
            joblib.Parallel(n_jobs=2, backend="tensormp")(joblib.delayed(fail)(0) for _ in range(1))
    assert "the caller's own exception" not in str(info.value.__cause__)


# -- torch tensors: only memory shared on purpose is written through -------------------------------
def test_a_workers_write_into_an_ordinary_tensor_leaves_the_callers_tensor_alone():
    torch = pytest.importorskip("torch")
    tensors = [torch.ones(4) for _ in range(4)]
    nested = [torch.ones(3), torch.ones(2)]
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        joblib.Parallel()(joblib.delayed(scale_)(t) for t in tensors)
        joblib.Parallel()(joblib.delayed(scale_all_)(nested) for _ in range(2))
        base = torch.zeros(4)
        [tail] = joblib.Parallel()(joblib.delayed(write_through_one_view)(base, base[1:])
                                   for _ in range(1))
    assert [t.tolist() for t in tensors] == [[1.0] * 4] * 4
    assert [t.tolist() for t in nested] == [[1.0] * 3, [1.0] * 2]
    assert not any(t.is_shared() for t in tensors + nested + [base])  # not moved either
    assert tail == [5.0] * 3 and base.tolist() == [0.0] * 4  # views keep sharing in the worker


def test_a_workers_write_into_a_tensor_shared_on_purpose_is_seen_by_the_caller():
    torch = pytest.importorskip("torch")
    ours = tensormp.share(torch.ones(4))
    torchs = torch.ones(4).share_memory_()
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        joblib.Parallel()(joblib.delayed(scale_)(t) for t in (ours, torchs))
    assert ours.tolist() == torchs.tolist() == [2.0] * 4


def test_arrays_keep_their_rule():
    a = np.ones(4)
    shared = tensormp.share(np.ones(4))
    with joblib.parallel_config(backend="tensormp", n_jobs=2):
        joblib.Parallel()(joblib.delayed(np.multiply)(x, 2, out=x) for x in (a, shared))
    assert a.tolist() == [1.0] * 4 and shared.tolist() == [2.0] * 4


def test_a_message_marked_copy_private_leaves_the_senders_tensor_where_it_was():
    torch = pytest.importorskip("torch")
    from tensormp import reducers

    t = torch.arange(6, dtype=torch.float32)
    parent, child = tensormp.Pipe()
    try:
        parent.send(reducers.copy_private([t, t[2:]]))
        got, tail = child.recv()
    finally:
        parent.close()
        child.close()
    assert not t.is_shared() and got.is_shared()
    got.fill_(-1)
    assert t.tolist() == list(range(6)) and tail.tolist() == [-1.0] * 4
