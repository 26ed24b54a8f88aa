"""The public API: stdlib names, contexts, strategies, allocation and its errors."""

from __future__ import annotations

import errno
import multiprocessing
import threading

import numpy as np
import pytest

import tensormp as mp

pytestmark = pytest.mark.timeout(60)


def test_every_stdlib_name_is_exported():
    missing = [n for n in multiprocessing.__all__ if not hasattr(mp, n)]
    assert not missing
    assert set(multiprocessing.__all__) <= set(mp.__all__)


def test_stdlib_submodule_names_a_swapped_import_reaches():
    """``from tensormp import shared_memory`` (and managers, dummy...), ``ThreadPool`` from
    ``tensormp.pool``, ``wait``/``Listener``/``Client`` from ``tensormp.connection``: the
    stdlib's own, as a program whose ``multiprocessing`` was replaced by ``tensormp`` asks."""
    import multiprocessing.connection
    import multiprocessing.pool
    from multiprocessing import managers, shared_memory

    from tensormp import managers as tm_managers
    from tensormp import shared_memory as tm_shared_memory
    from tensormp.connection import Client, Listener, wait
    from tensormp.pool import ThreadPool

    assert tm_shared_memory is shared_memory and tm_managers is managers
    assert ThreadPool is multiprocessing.pool.ThreadPool
    assert (wait, Listener, Client) == (
        multiprocessing.connection.wait, multiprocessing.connection.Listener,
        multiprocessing.connection.Client,
    )
    a, b = mp.Pipe()
    b.send("x")
    assert wait([a], 5) == [a] and a.recv() == "x"  # it takes tensormp's connections
    a.close()
    b.close()
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        mp.connection.nothing  # noqa: B018


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_contexts_give_tensormp_channels(method):
    ctx = mp.get_context(method)
    assert ctx.get_start_method() == method
    q, sq, jq = ctx.Queue(), ctx.SimpleQueue(), ctx.JoinableQueue()
    a, b = ctx.Pipe()
    assert isinstance(a, mp.Connection)
    assert type(q).__module__ == "tensormp.queues"
    assert ctx.Process.__module__ == "tensormp.context"
    for conn in (a, b):
        conn.close()
    sq.close()
    for x in (q, jq):
        x.close()


def test_unknown_start_method():
    with pytest.raises(ValueError, match="cannot find context for 'nope'"):
        mp.get_context("nope")


def test_sharing_strategies():
    assert mp.get_sharing_strategy() == "file_descriptor"
    assert mp.get_all_sharing_strategies() == {"file_descriptor", "file_system"}
    mp.set_sharing_strategy("file_system")
    assert mp.get_sharing_strategy() == "file_system"
    mp.set_sharing_strategy("file_descriptor")
    with pytest.raises(ValueError, match="unknown sharing strategy"):
        mp.set_sharing_strategy("carrier_pigeon")
    assert mp.get_sharing_strategy() == "file_descriptor"


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: mp.empty((2, 3), np.int16), None),
        (lambda: mp.zeros(5), np.zeros(5)),
        (lambda: mp.ones((2, 2), dtype=np.uint8), np.ones((2, 2), np.uint8)),
        (lambda: mp.full((3,), 7), np.full((3,), 7)),
        (lambda: mp.zeros_like(np.ones((2, 5), order="F")), np.zeros((2, 5))),
        (lambda: mp.full_like(np.ones(4, np.float32), 2.5), np.full(4, 2.5, np.float32)),
    ],
)
def test_allocation_matches_numpy(make, expected):
    a = make()
    assert mp.is_shared(a) and mp.is_shared(a[1:])
    if expected is not None:
        np.testing.assert_array_equal(a, expected)
        assert a.dtype == expected.dtype


def test_fortran_order_and_zero_size():
    a = mp.empty((3, 4), order="F")
    assert a.flags.f_contiguous and not a.flags.c_contiguous
    z = mp.zeros((0, 3))
    assert z.size == 0 and mp.is_shared(z)


def test_share_and_is_shared():
    x = np.arange(10.0)
    assert not mp.is_shared(x)
    s = mp.share(x)
    assert mp.is_shared(s) and s is not x
    np.testing.assert_array_equal(s, x)
    assert mp.share(s) is s  # already shared: no copy
    ro = np.arange(3)
    ro.flags.writeable = False
    assert not mp.share(ro).flags.writeable


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: mp.share([1, 2]), TypeError, "numpy.ndarray"),
        (lambda: mp.is_shared("x"), TypeError, "numpy.ndarray"),
        (lambda: mp.share(np.array([None])), TypeError, "Python object"),
        (lambda: mp.empty(3, dtype=object), TypeError, "Python objects"),
        (lambda: mp.empty((2, -1)), ValueError, "negative dimensions"),
        (lambda: mp.empty("abc"), TypeError, "shape must be"),
        (lambda: mp.empty(3, order="K"), ValueError, "order must be"),
        (lambda: mp.set_cache_limit(-1), ValueError, "non-negative"),
        (lambda: mp.set_cache_limit(True), ValueError, "non-negative"),
        (lambda: mp.spawn(print, timeout="x"), ValueError, "number of seconds"),
        (lambda: mp.spawn(print, args=5), TypeError, "args must be a tuple"),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_out_of_memory_is_an_oserror_at_allocation():
    with pytest.raises(OSError) as info:
        mp.empty(1 << 50, dtype=np.uint8)  # 1 PiB
    err = info.value
    assert isinstance(err, mp.SharedMemoryError)
    assert err.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG)
    assert "1024.0 TiB" in str(err) and "available" in str(err)


def test_memory_stats_and_empty_cache():
    arrays = [mp.empty(1000) for _ in range(100)]
    stats = mp.memory_stats()
    assert stats["in_use_bytes"] >= 100 * 8000
    assert stats["segments"] >= 1 and stats["fds"] >= 1
    assert stats["fds"] < 10  # small arrays share arenas
    del arrays
    mp.empty_cache()
    after = mp.memory_stats()
    assert after["in_use_bytes"] == 0 and after["cached_bytes"] == 0


def test_small_blocks_are_recycled_without_new_segments():
    a = mp.empty(1000)
    before = mp.memory_stats()["segments"]
    del a
    for _ in range(1000):
        b = mp.empty(1000)
        del b
    assert mp.memory_stats()["segments"] == before


def test_cache_limit():
    old = mp.get_cache_limit()
    try:
        mp.set_cache_limit(0)
        big = mp.empty(4 << 20, dtype=np.uint8)
        del big
        assert mp.memory_stats()["cached_bytes"] == 0
    finally:
        mp.set_cache_limit(old)


def test_threads_allocate_and_send_concurrently():
    q = mp.SimpleQueue()
    errors = []

    def work(k):
        try:
            for i in range(300):
                a = mp.full(int(50 + (i * 37 + k) % 3000), k * 1000 + i, dtype=np.int64)
                if i % 3 == 0:
                    q.put(a)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    got = []
    while len(got) < 4 * 100:
        a = q.get()
        assert (a == a[0]).all()
        got.append(int(a[0]))
    for t in threads:
        t.join()
    assert not errors
    assert sorted(got) == sorted(k * 1000 + i for k in range(4) for i in range(0, 300, 3))
    q.close()


def test_pool_moves_arrays_through_shared_memory():
    with mp.get_context("spawn").Pool(2) as pool:
        out = pool.map(np.negative, [np.arange(5.0), mp.ones(3)])
    assert all(mp.is_shared(o) for o in out)
    np.testing.assert_array_equal(out[0], -np.arange(5.0))


def test_stdlib_primitives_still_work():
    ctx = mp.get_context("spawn")
    ev, lock = ctx.Event(), ctx.Lock()
    with lock:
        ev.set()
    assert ev.is_set()
    v = ctx.Value("i", 3)
    assert v.value == 3


def test_message_dropped_unsent_does_not_pin_memory():
    import gc

    from tensormp import reducers

    a = mp.zeros(1000)
    msg = reducers.dumps(a[:10])  # a handle is counted as out...
    del msg  # ...and given back when the message is dropped without being sent
    del a
    gc.collect()
    assert mp.memory_stats()["remote_held_bytes"] == 0
    assert mp.memory_stats()["in_use_bytes"] == 0


def test_structured_padding_never_shows_old_bytes():
    dt = np.dtype([("a", "u1"), ("b", "<i8")], align=True)  # 7 padding bytes per item
    junk = mp.full(48, 0xAB, dtype=np.uint8)
    del junk  # a freed block with old bytes, recycled next
    assert mp.share(np.zeros(3, dtype=dt)).tobytes() == bytes(48)
    junk = mp.full(48, 0xAB, dtype=np.uint8)
    del junk
    assert mp.zeros(3, dtype=dt).tobytes() == bytes(48)
