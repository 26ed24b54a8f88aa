"""``put_many``/``get_many`` (issue #25): a batch is one record, all or nothing.

Checks, with real processes: the batch API of ``Queue``, ``JoinableQueue`` and ``SimpleQueue``
(order, the items beyond ``max_messages_to_get`` kept for this process's next get, a fork child
starting without them), a bounded queue counting a batch of ``k`` as ``k`` slots, a
``JoinableQueue`` counting ``k`` tasks, errors in the caller, fds of many arrays and pipes in
one record; and SIGKILLs: a producer killed in the middle of a ``put_many`` leaves the queue
usable and every batch it was told was put arrives whole; a consumer killed in the middle of
a ``get_many`` loses only the batch it took, and a bounded queue has all its slots back.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
import time

import numpy as np
import pytest

import tensormp as mp
from helpers import START_METHODS
from tensormp import _testhooks
from tensormp.connection import INLINE_MAX
from test_channels import _dead, _recv_all

pytestmark = pytest.mark.timeout(120)

BATCH = 5


def _batch(tag: int, b: int, large: bool = False) -> list:
    """Batch ``b`` of producer ``tag``: BATCH items, each checkable on arrival; ``large``: its
    pickle is larger than a record holds (it travels in a memfd)."""
    n = INLINE_MAX // 2 if large else 1  # per item: pickled once each
    return [(tag, b, j, np.full(1024, b * 100 + j, dtype=np.float32), bytes([b]) * n)
            for j in range(BATCH)]


def _check(item: tuple) -> tuple[int, int, int]:
    tag, b, j, a, pad = item
    assert mp.is_shared(a) and a.shape == (1024,) and (a == b * 100 + j).all(), (tag, b, j)
    assert pad == bytes([b]) * len(pad)
    return tag, b, j


def _flat(batches: range, tag: int = 0) -> list[tuple[int, int, int]]:
    return [(tag, b, j) for b in batches for j in range(BATCH)]


def _make(ctx, kind: str, maxsize: int = 0):
    if kind == "SimpleQueue":
        return ctx.SimpleQueue()
    return getattr(ctx, kind)(maxsize)


# -- children (module level so spawn can import them) -----------------------------------------
def _producer(q, tag, batches, ack=None, point=None, nth=1, large=False):
    """put_many batches 0..batches-1; after each returns, tell ``ack`` its number."""
    if point:
        _testhooks.kill_at(point, nth)
    for b in range(batches):
        q.put_many(_batch(tag, b, large))
        if ack is not None:
            ack.send(b)
    if hasattr(q, "join_thread"):
        q.close()
        q.join_thread()


def _consumer(q, report, count, point=None, nth=1):
    """get_many until ``count`` items, reporting each batch it got."""
    if point:
        _testhooks.kill_at(point, nth)
    got = 0
    while got < count:
        items = q.get_many(max_messages_to_get=BATCH)  # one recvmsg per call: kill points count
        report.send([_check(i) for i in items])
        got += len(items)
    report.close()


def _drain(q) -> list[tuple[int, int, int]]:
    out = []
    while True:
        try:
            out += [_check(i) for i in q.get_many(timeout=0.3)]
        except queue.Empty:
            return out


# -- the transfer path, under every start method ----------------------------------------------
@pytest.mark.parametrize("kind", ["Queue", "JoinableQueue", "SimpleQueue"])
@pytest.mark.parametrize("method", START_METHODS)
def test_batches_cross_processes_in_order(method, kind):
    ctx = mp.get_context(method)
    q = _make(ctx, kind)
    p = ctx.Process(target=_producer, args=(q, 7, 6))
    p.start()
    got = []
    # 3 at a time from batches of 5: a batch's rest is returned first by the next call.
    while len(got) < 6 * BATCH:
        items = q.get_many(timeout=60, max_messages_to_get=3)
        assert 1 <= len(items) <= 3
        got += [_check(i) for i in items]
    p.join(60)
    assert p.exitcode == 0
    assert got == _flat(range(6), 7)
    assert q.empty()
    if kind == "JoinableQueue":
        for _ in got:
            q.task_done()
        q.join()
    q.close()


def test_get_returns_a_batch_one_item_at_a_time_and_get_many_takes_what_is_there():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    q.put_many(_batch(0, 0))
    q.put(_batch(0, 1)[0])  # one item
    q.put_many(_batch(0, 2)[:1])  # a batch of one
    q.put_many([])  # nothing
    q.put_many_nowait([])
    assert _check(q.get(timeout=10)) == (0, 0, 0)
    assert not q.empty()  # the batch's rest is this process's to get
    got = [_check(i) for i in q.get_many(timeout=10)]
    assert got == _flat(range(1))[1:] + [(0, 1, 0), (0, 2, 0)]
    with pytest.raises(queue.Empty):
        q.get_many(block=False)
    with pytest.raises(queue.Empty):
        q.get_many_nowait()
    with pytest.raises(queue.Empty):
        q.get_many(timeout=0.05)
    assert q.qsize() == 0 and q.empty()


def _get_many_nowait(q, report):
    try:
        report.send(len(q.get_many(block=False)))
    except queue.Empty:
        report.send("empty")


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue"])
def test_fork_child_does_not_get_its_parents_taken_items(kind):
    ctx = mp.get_context("fork")
    q = _make(ctx, kind)
    q.put_many(_batch(0, 0))
    assert _check(q.get()) == (0, 0, 0)  # the other 4 wait in this process
    report_r, report_w = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_get_many_nowait, args=(q, report_w))
    child.start()
    report_w.close()
    child.join(60)
    assert report_r.recv() == "empty"
    report_r.close()
    assert [_check(i) for i in q.get_many()] == _flat(range(1))[1:]
    q.close()


# -- bounded queues and JoinableQueue ------------------------------------------------------------
def test_bounded_queue_counts_a_batch_of_k_as_k_slots():
    ctx = mp.get_context("fork")
    q = ctx.Queue(8)
    q.put_many(_batch(0, 0))
    assert q.qsize() == BATCH and not q.full()
    with pytest.raises(queue.Full):
        q.put_many(_batch(0, 1), block=False)  # 5 more do not fit in 3 free slots
    with pytest.raises(queue.Full):
        q.put_many(_batch(0, 1), timeout=0.05)
    with pytest.raises(queue.Full):
        q.put_many_nowait(_batch(0, 1))
    assert q.qsize() == BATCH  # nothing of the refused batch
    q.put_many(_batch(0, 1)[:3])
    assert q.qsize() == 8 and q.full()
    with pytest.raises(queue.Full):
        q.put(1, block=False)
    with pytest.raises(ValueError, match="maxsize 8.*split"):
        q.put_many(list(range(9)))  # never fits: at once, even with block=True
    assert [_check(i) for i in q.get_many(max_messages_to_get=2)] == _flat(range(1))[:2]
    assert q.qsize() == 3  # the whole record left the socket: its 5 slots are free
    q.put_many(_batch(0, 2))
    assert q.qsize() == 8
    got = [_check(i) for i in q.get_many()]
    assert got == _flat(range(1))[2:] + [(0, 1, j) for j in range(3)] + _flat(range(2, 3))
    assert q.qsize() == 0


def test_blocked_put_many_waits_for_k_free_slots():
    ctx = mp.get_context("fork")
    q = ctx.Queue(6)
    for i in range(5):
        q.put(i)
    done = threading.Event()
    t = threading.Thread(target=lambda: (q.put_many(list(range(10, 14)), timeout=30), done.set()),
                         daemon=True)
    t.start()
    assert q.get(timeout=10) == 0
    assert q.get(timeout=10) == 1
    assert not done.wait(0.3), "put_many of 4 went in with 3 slots free"
    assert q.get(timeout=10) == 2
    assert done.wait(10)
    t.join(10)
    assert q.get_many(timeout=10) == [3, 4, 10, 11, 12, 13]


def _take_batch_and_finish(q, report, done):
    items = q.get_many(timeout=30)
    report.send(len(items))
    for _ in range(done):
        q.task_done()
    report.close()
    if done < len(items):
        os.kill(os.getpid(), signal.SIGKILL)  # dies holding the rest of its tasks


@pytest.mark.parametrize("maxsize", [0, 8])
def test_joinable_queue_counts_k_tasks(maxsize):
    ctx = mp.get_context("fork")
    q = ctx.JoinableQueue(maxsize)
    q.put_many(list(range(BATCH)))
    joined = threading.Event()
    waiter = threading.Thread(target=lambda: (q.join(), joined.set()), daemon=True)
    waiter.start()
    report_r, report_w = ctx.Pipe(duplex=False)
    taker = ctx.Process(target=_take_batch_and_finish, args=(q, report_w, BATCH - 1))
    taker.start()
    report_w.close()
    assert report_r.recv() == BATCH
    _dead(taker)  # done with 4 of its 5 items, then killed: the 5th counts as done
    report_r.close()
    assert joined.wait(10), "join() waits for the tasks of a dead taker"
    waiter.join(10)
    q.put_many(list(range(3)))
    assert q.get_many(timeout=10) == [0, 1, 2]
    q.task_done()
    q.task_done()
    t = threading.Thread(target=q.join, daemon=True)
    t.start()
    t.join(0.3)
    assert t.is_alive(), "join() returned with one task of the batch not done"
    q.task_done()
    t.join(10)
    assert not t.is_alive()
    with pytest.raises(ValueError, match="too many times"):
        q.task_done()


# -- errors in the caller -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["Queue", "JoinableQueue", "SimpleQueue"])
@pytest.mark.parametrize("maxsize", [0, 8])
def test_put_many_errors_raise_in_the_caller_and_put_nothing(kind, maxsize):
    if kind == "SimpleQueue" and maxsize:
        pytest.skip("SimpleQueue is unbounded")
    ctx = mp.get_context("fork")
    q = _make(ctx, kind, maxsize)
    with pytest.raises(TypeError, match="list or tuple.*list\\(items\\)"):
        q.put_many(i for i in range(3))
    with pytest.raises(TypeError, match="list or tuple"):
        q.put_many("abc")
    with pytest.raises((TypeError, pickle.PicklingError)):
        q.put_many([np.zeros(4), threading.Lock(), np.ones(4)])  # the array copies are given back
    with pytest.raises(ValueError, match="max_messages_to_get"):
        q.get_many(max_messages_to_get=0)
    for bad in (1.5, "3", None, True):
        with pytest.raises(TypeError, match="max_messages_to_get must be an int"):
            q.get_many(max_messages_to_get=bad)
    q.put(7)
    assert q.get_many(timeout=10, max_messages_to_get=np.int64(2)) == [7]  # a numpy integer
    with pytest.raises(queue.Empty):
        q.get_many(timeout=0.05)  # nothing of the refused batches
    if kind != "SimpleQueue":
        assert q.qsize() == 0
        q.put_many((1, 2))
        q.close()
        with pytest.raises(ValueError, match="closed"):
            q.put_many([3])
        with pytest.raises(ValueError, match="closed"):
            q.get_many()
        q.join_thread()
    else:
        q.close()


def test_a_batch_carries_more_fds_than_one_sendmsg():
    """130 pipes (260 fds) and arrays of two segments in one put_many: one record (a bag)."""
    ctx = mp.get_context("fork")
    q = ctx.SimpleQueue()
    big = mp.zeros(1 << 20, dtype=np.uint8)
    big[:] = 7
    pipes = [mp.Pipe(duplex=False) for _ in range(130)]
    q.put_many([big, *[end for pair in pipes for end in pair], np.arange(10)])
    for r, w in pipes:
        r.close()
        w.close()
    got = q.get_many(timeout=10)
    assert len(got) == 2 + 2 * len(pipes)
    assert got[0][-1] == 7 and mp.is_shared(got[0]) and (got[-1] == np.arange(10)).all()
    r, w = got[1], got[2]
    w.send("through")
    assert r.recv() == "through"
    for conn in got[1:-1]:
        conn.close()
    q.close()


# -- kills ----------------------------------------------------------------------------------------
# point of the 3rd put_many the producer dies at, batch size, batches written when it dies
PRODUCER_KILLS = [
    ("put.begin", "small", 2),     # pickled, nothing written
    ("put.tokens", "small", 2),    # slots (bounded) or tokens taken, nothing written
    ("send.payload", "large", 2),  # the pickle in its memfd (bounded: the intent written)
    ("send.sent", "small", 3),     # right after the record's sendmsg, before it is counted
]


@pytest.mark.parametrize("kind", ["Queue", "JoinableQueue"])
@pytest.mark.parametrize("maxsize", [0, 16], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("case", PRODUCER_KILLS, ids=lambda c: c[0])
def test_producer_killed_in_put_many(case, maxsize, kind):
    point, size, written = case
    if point == "put.tokens" and kind == "Queue" and not maxsize:
        point = "put.begin"  # no slot and no token: the same instant
    ctx = mp.get_context("fork")
    q = _make(ctx, kind, maxsize)
    ack_r, ack_w = multiprocessing.get_context("fork").Pipe(duplex=False)  # no send.sent point
    victim = ctx.Process(target=_producer, args=(q, 0, 10, ack_w, point, 3, size == "large"))
    victim.start()
    ack_w.close()
    _dead(victim)
    acked = _recv_all(ack_r)
    ack_r.close()
    assert acked == list(range(min(written, 2)))  # it never returned from the 3rd
    if maxsize:
        assert q.qsize() == written * BATCH  # the dead producer's unsent batch took no slot
    got = _drain(q)
    assert got == _flat(range(written))  # every acknowledged batch, whole, in order, once
    assert q.empty()
    # Exact when bounded; unbounded, a batch the victim counted but never wrote stays counted.
    assert q.qsize() == 0 if maxsize else q.qsize() <= BATCH
    if kind == "JoinableQueue":
        for _ in got:
            q.task_done()
        q.join()  # the dead producer's unsent batch left no task behind
    survivor = ctx.Process(target=_producer, args=(q, 1, 4))
    survivor.start()
    got = []
    while len(got) < 4 * BATCH:
        got += [_check(i) for i in q.get_many(timeout=30)]
    survivor.join(30)
    assert survivor.exitcode == 0 and got == _flat(range(4), 1)
    if kind == "JoinableQueue":
        for _ in got:
            q.task_done()
        q.join()


@pytest.mark.parametrize("maxsize", [0, 16], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("point,lost", [("recv.begin", 0), ("recv.got", 1), ("recv.done", 1)])
def test_consumer_killed_in_get_many(point, lost, maxsize):
    ctx = mp.get_context("fork")
    q = ctx.Queue(maxsize)
    producer = ctx.Process(target=_producer, args=(q, 0, 6))
    producer.start()  # first: it must not inherit the report pipe
    report_r, report_w = ctx.Pipe(duplex=False)
    victim = ctx.Process(target=_consumer, args=(q, report_w, 6 * BATCH, point, 3))
    victim.start()
    report_w.close()
    _dead(victim)
    reported = _recv_all(report_r)
    report_r.close()
    assert [x for batch in reported for x in batch] == _flat(range(2))
    rest = []
    while len(rest) < (4 - lost) * BATCH:  # the producer may still wait for free slots
        rest += [_check(i) for i in q.get_many(timeout=30)]
    producer.join(30)
    assert producer.exitcode == 0
    rest += _drain(q)
    assert rest == _flat(range(2 + lost, 6))  # the taken batch is lost whole, nothing else
    if maxsize:
        assert q.qsize() == 0  # every slot is back


# -- the feeder -----------------------------------------------------------------------------------
def test_feeder_waits_without_spinning_while_every_payload_memfd_is_unread():
    """Large pickles travel in memfds (4 per writer end); with all 4 unread, the feeder backs
    off instead of polling a socket that has room (a spin), and holds no lock meanwhile (a
    put() never waits for a reader: test_channels' feeder tests)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    q.put_many(_batch(0, 0, large=True))
    for b in range(1, 6):  # the 5th and 6th large records wait for a memfd: the feeder has them
        q.put(_batch(0, b, large=True))
    assert q._thread is not None  # the feeder holds the last two
    clock = time.pthread_getcpuclockid(q._thread.ident)
    cpu = time.clock_gettime(clock)
    time.sleep(1.0)
    cpu = time.clock_gettime(clock) - cpu
    got = [_check(i) for i in q.get_many(timeout=10, max_messages_to_get=BATCH)]
    for _ in range(5):
        got += [_check(i) for i in q.get(timeout=10)]
    assert got == _flat(range(6))
    assert cpu < 0.05, f"the feeder spun: {cpu:.2f} s of CPU in 1 s of waiting"
    q.close()
    q.join_thread()


def test_task_done_counts_only_items_returned_by_get():
    """Items of a batch this process took but no get returned yet are not "got": task_done()
    for them raises, as the stdlib's for items never got, and join() keeps waiting."""
    jq = mp.JoinableQueue()
    jq.put_many([1, 2, 3])
    assert jq.get_many(max_messages_to_get=1, timeout=10) == [1]
    jq.task_done()
    with pytest.raises(ValueError, match="too many times"):
        jq.task_done()  # 2 and 3 were taken with 1, not returned
    joined = threading.Event()
    threading.Thread(target=lambda: (jq.join(), joined.set()), daemon=True).start()
    assert not joined.wait(0.3)
    assert jq.get_many(timeout=10) == [2, 3]
    jq.task_done()
    jq.task_done()
    with pytest.raises(ValueError, match="too many times"):
        jq.task_done()
    assert joined.wait(10)
    jq.close()
    jq.join_thread()


def test_faster_fifo_max_size_bytes_is_a_clear_type_error():
    """Code moved from faster_fifo.Queue(max_size_bytes=..., maxsize=...) is told what to do."""
    for kind in ("Queue", "JoinableQueue"):
        with pytest.raises(TypeError, match=rf"{kind}\(\) has no max_size_bytes .*maxsize=N"):
            getattr(mp, kind)(maxsize=4, max_size_bytes=1 << 20)
        with pytest.raises(TypeError, match="unexpected keyword argument 'size'"):
            getattr(mp, kind)(size=4)
