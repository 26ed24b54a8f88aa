"""What unchanged programs get from the stdlib, they get from tensormp (issue 22, parts 2-5).

* Read-only arrays sent by value arrive writable (the receiver's own copy), with the sender's
  values and shape, also when their strides are zero or overlap; read-only views of shared
  memory stay shared and read-only.
* A receiver at a low ``RLIMIT_NOFILE`` loses no message to its own cache of idle mappings;
  when arrays it keeps really fill the table, the error says so, with the counts, and only the
  message that met the full table is lost. ``tensormp doctor`` names the fix that applies.
* A process that received arrays exits without a ``ResourceWarning`` (``-X dev``).
* The documented differences (docs/differences.md): byte order is kept; a queue made in a
  ``fork`` context works in a ``spawn`` child.

Real processes throughout; the lowered fd limits are set inside the child that receives.
"""

from __future__ import annotations

import json
import multiprocessing
import pickle
import resource
import subprocess
import sys

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

import tensormp as mp
from helpers import START_METHODS


# -- read-only inputs --------------------------------------------------------------------------
def _add_one(a):
    a += 1
    return a


def _read_only_arrays() -> dict[str, np.ndarray]:
    from PIL import Image

    flagged = np.arange(6.0).reshape(2, 3)
    fortran = np.asfortranarray(flagged)
    flagged.flags.writeable = fortran.flags.writeable = False
    image = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    return {
        "frombuffer": np.frombuffer(np.arange(8.0).tobytes()),
        "PIL image": np.asarray(image),
        "broadcast_to": np.broadcast_to(np.arange(3, dtype=np.int32), (4, 3)),  # zero strides
        "sliding_window_view": sliding_window_view(np.arange(10.0), 3),  # overlapping
        "flag cleared": flagged,
        "Fortran, flag cleared": fortran,
    }


def _check_writable(q, out):
    got = {}
    while (item := q.get(timeout=60)) is not None:
        name, a = item
        writable = a.flags.writeable
        a += 1
        got[name] = (writable, a.shape, a.tolist())
    out.put(got)


@pytest.mark.timeout(120)
def test_read_only_arrays_sent_by_value_arrive_writable():
    """``Pool.apply(add_one, (a,))`` and a ``Queue`` to a ``Process``: the receiver may write
    its argument, as with the stdlib; the values and shape are the sender's, and the sender's
    array is untouched."""
    arrays = _read_only_arrays()
    before = {name: a.copy() for name, a in arrays.items()}
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        for name, a in arrays.items():
            result = pool.apply(_add_one, (a,))
            assert result.shape == a.shape and np.array_equal(result, a + 1), name
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_check_writable, args=(q, out))
    p.start()
    for item in arrays.items():
        q.put(item)
    q.put(None)
    got = out.get(timeout=60)
    p.join(30)
    for name, a in arrays.items():
        assert got[name] == (True, a.shape, (a + 1).tolist()), name
        assert not a.flags.writeable and np.array_equal(a, before[name]), name


def _read_only_view_child(q, out):
    view, bcast = q.get(timeout=60)
    out.put((view.flags.writeable, bcast.flags.writeable, bcast.strides, mp.is_shared(view)))
    q.get(timeout=60)  # the parent wrote meanwhile
    out.put((view.tolist(), bcast.tolist()))


@pytest.mark.timeout(60)
def test_read_only_view_of_shared_memory_stays_shared_and_read_only():
    """A view of shared memory crosses as a handle: the receiver sees the same bytes, so it
    keeps the sender's flag (a broadcast view written through would alias its rows)."""
    ctx = mp.get_context("spawn")
    base = mp.zeros(3, dtype=np.int64)
    view = base[:]
    view.flags.writeable = False
    bcast = np.broadcast_to(base, (2, 3))
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_read_only_view_child, args=(q, out))
    p.start()
    q.put((view, bcast))
    assert out.get(timeout=60) == (False, False, (0, 8), True)
    base[:] = [7, 8, 9]
    q.put("look")
    assert out.get(timeout=60) == ([7, 8, 9], [[7, 8, 9], [7, 8, 9]])
    p.join(30)


# -- fd pressure -------------------------------------------------------------------------------
_FD_LIMIT = 64
_MESSAGES = 100


def _consume_at_fd_limit(q, out, keep_until_error):
    """Set RLIMIT_NOFILE to 64 (soft and hard), take every message; with
    ``keep_until_error``, keep each array until the first error, then drop them all."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (_FD_LIMIT, _FD_LIMIT))
    kept, values, errors = [], [], []
    for _ in range(_MESSAGES):
        try:
            a = q.get(timeout=60)
        except mp.FdLimitError as e:
            errors.append((len(kept), str(e)))
            kept.clear()
            continue
        values.append(int(a[0]))
        if keep_until_error and not errors:
            kept.append(a)
        del a
    stats = mp.memory_stats()
    out.put((values, errors, stats["fds"], stats["segments"]))


def _produce_and_keep(q, done):
    kept = []  # each a distinct 2 MiB segment, kept (so its creator lives) until told
    for i in range(_MESSAGES):
        a = mp.share(np.full(2 << 20, i, np.uint8))
        kept.append(a)
        q.put(a)
    done.get(timeout=150)


def _send_kept_arrays(keep_until_error: bool) -> tuple[list[int], list, int, int]:
    # The producer is a child too: a message the consumer drops leaves its block pinned in
    # the producer until the producer exits (as any handle never received), not in this test.
    ctx = mp.get_context("spawn")
    q, out, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_consume_at_fd_limit, args=(q, out, keep_until_error))
    producer = ctx.Process(target=_produce_and_keep, args=(q, done))
    consumer.start()
    producer.start()
    try:
        result = out.get(timeout=120)
    finally:
        done.put(None)
        consumer.join(30)
        producer.join(30)
    assert consumer.exitcode == 0 and producer.exitcode == 0
    return result


@pytest.mark.timeout(180)
def test_no_message_lost_to_idle_mappings_at_fd_limit_64():
    """A consumer that keeps no array gives back idle mappings instead of dropping messages:
    all 100 arrive, and the cache of idle mappings stays at an eighth of the limit."""
    values, errors, fds, segments = _send_kept_arrays(keep_until_error=False)
    assert errors == []
    assert values == list(range(_MESSAGES))
    assert fds <= _FD_LIMIT // 8 and segments <= _FD_LIMIT // 8


@pytest.mark.timeout(180)
def test_fd_error_is_true_and_loses_only_the_message_that_met_a_full_table():
    """Arrays kept alive fill the table: the one message that finds no fd free is dropped with
    an error that says so (the limit, the fds open, how many hold shared memory in use); once
    the consumer lets its arrays go, every later message arrives."""
    values, errors, _fds, _segments = _send_kept_arrays(keep_until_error=True)
    assert len(errors) == 1, errors
    kept_then, text = errors[0]
    assert kept_then > _FD_LIMIT // 2  # the table was full of arrays in use, not of the cache
    assert "out of fds" in text and f"soft RLIMIT_NOFILE {_FD_LIMIT}" in text, text
    in_use = int(text.split(" of them for shared memory in use")[0].rsplit(" ", 1)[1])
    assert in_use >= kept_then and "keep fewer arrays alive" in text, text
    # the fix that applies to fds held by arrays in use: the strategy without fds
    assert "set_sharing_strategy('file_system')" in text, text
    assert len(values) == _MESSAGES - 1
    missing = sorted(set(range(_MESSAGES)) - set(values))
    assert missing == [kept_then] and values == sorted(values)


_DOCTOR = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2])))
from tensormp.cli import doctor
c = doctor._check_nofile()
print(json.dumps([c.status, c.fix]))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("soft,hard", [(64, 64), (64, 4096)])
def test_doctor_fd_limit_fix_names_what_can_raise_it(soft, hard):
    """soft == hard: no ``ulimit -n`` can raise it from inside; say who can, or name the
    file_system strategy. soft < hard: raise the soft limit to the hard one."""
    res = subprocess.run([sys.executable, "-c", _DOCTOR, str(soft), str(hard)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    status, fix = json.loads(res.stdout)
    assert status == "WARN"
    if soft == hard:
        assert "ulimit -n" not in fix, fix
        for where in ("limits.conf", "--ulimit", "LimitNOFILE=", "file_system"):
            assert where in fix, fix
    else:
        assert f"ulimit -n {hard}" in fix, fix


# -- quiet at exit -----------------------------------------------------------------------------
_RECEIVER = """
import sys
import numpy as np
import tensormp as mp

def child(q, back):
    a = q.get()
    a += 1
    back.put(a)

def double(a):
    return a * 2

if __name__ == "__main__":
    method, strategy = sys.argv[1], sys.argv[2]
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context(method)
    q, back = ctx.Queue(), ctx.Queue(maxsize=2)
    p = ctx.Process(target=child, args=(q, back))
    p.start()
    q.put(np.ones(1000))
    assert back.get(timeout=60).sum() == 2000
    p.join(60)
    with ctx.Pool(2) as pool:
        assert sum(r.sum() for r in pool.map(double, [np.ones(100)] * 4)) == 800
    print("ok")
"""


def _run_dev(tmp_path, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    path = tmp_path / "program.py"  # a file: spawn children import the main module by path
    path.write_text(script)
    return subprocess.run([sys.executable, "-X", "dev", str(path), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("method,strategy", [(m, "file_descriptor") for m in START_METHODS]
                         + [("spawn", "file_system")])
def test_a_process_that_received_arrays_exits_silently_under_dev_mode(tmp_path, method, strategy):
    """Parent, child and pool workers all receive arrays; nothing is printed at exit (each
    used to print ``ResourceWarning: unclosed <socket.socket ...>``)."""
    res = _run_dev(tmp_path, _RECEIVER, method, strategy)
    assert res.returncode == 0 and res.stdout == "ok\n", res.stderr
    assert res.stderr == ""


_LOADER = """
import torch
import tensormp as mp
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    ds = TensorDataset(torch.randn(64, 4), torch.arange(64))
    loader = DataLoader(ds, batch_size=8, num_workers=2,
                        multiprocessing_context=mp.get_context("spawn"))
    print(sum(len(x) for x, _ in loader))
"""


@pytest.mark.timeout(200)
def test_a_dataloader_with_a_tensormp_context_exits_silently_under_dev_mode(tmp_path):
    pytest.importorskip("torch")
    res = _run_dev(tmp_path, _LOADER, timeout=180)
    assert res.returncode == 0 and res.stdout == "64\n", res.stderr
    assert res.stderr == ""


# -- documented differences --------------------------------------------------------------------
def _dtype_and_values(q, out):
    a = q.get(timeout=60)
    out.put((a.dtype.str, a.tolist()))


@pytest.mark.timeout(60)
def test_byte_order_is_kept():
    """tensormp delivers the dtype as sent; the stdlib's pickle (protocol 4, the default up to
    Python 3.13) turns a big-endian array into a native one of the same values."""
    a = np.arange(5, dtype=">f8")
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_dtype_and_values, args=(q, out))
    p.start()
    q.put(a)
    assert out.get(timeout=60) == (">f8", a.tolist())
    p.join(30)
    from multiprocessing.reduction import ForkingPickler

    if pickle.DEFAULT_PROTOCOL < 5:
        assert pickle.loads(ForkingPickler.dumps(a)).dtype.str == "<f8"


def _put_hello(q):
    q.put("hello")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "JoinableQueue"])
def test_a_fork_context_queue_works_in_a_spawn_child(kind):
    """tensormp's queues hold no SemLock, so they cross to a child of another start method;
    the stdlib refuses (``RuntimeError``), as it still does for a ``Lock``."""
    q = getattr(mp.get_context("fork"), kind)()
    p = mp.get_context("spawn").Process(target=_put_hello, args=(q,))
    p.start()
    p.join(30)  # a SimpleQueue.get() has no timeout: the child is done first
    assert p.exitcode == 0 and q.get() == "hello"
    stdlib_q = getattr(multiprocessing.get_context("fork"), kind)()
    with pytest.raises(RuntimeError, match="fork context"):
        multiprocessing.get_context("spawn").Process(target=_put_hello, args=(stdlib_q,)).start()
    stdlib_q.close()


def test_fd_error_names_the_hard_limit_when_the_soft_one_is_below_it():
    """A soft limit below the hard one (soft 1024 is many distributions' default) can be raised
    by the program itself: the error says so, with the hard limit."""
    import resource

    from tensormp.memory import fdbudget

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"hard RLIMIT_NOFILE {hard}: no room below it")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        text = fdbudget.shortage(3, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    assert f"raise the soft limit up to the hard one ({shown})" in text, text
    assert "soft RLIMIT_NOFILE 256" in text and "resource.setrlimit" in text, text
