"""Arrays through every tensormp channel, under every start method.

Each test body that takes ``ctx`` runs under spawn, fork and forkserver (the transfer paths),
with each sharing strategy.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import threading

import numpy as np
import pytest

import tensormp as mp
from helpers import START_METHODS, STRATEGIES, wait_for

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(
    params=[(m, s) for s in STRATEGIES for m in START_METHODS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def ctx(request):
    """A context of each start method, under each sharing strategy (the parent's strategy
    applies in its children)."""
    method, strategy = request.param
    mp.set_sharing_strategy(strategy)
    return mp.get_context(method)


# -- children (module level so spawn can import them) -----------------------------------------
def _double_and_return_view(q, done):
    a = q.get()
    a *= 2
    done.put(a[::2])


def _echo(inq, outq, n):
    for _ in range(n):
        outq.put(inq.get())


def _describe(q, out):
    """Receive objects until None; report how each arrived."""
    while True:
        obj = q.get()
        if obj is None:
            return
        if isinstance(obj, np.ndarray) and type(obj) is np.ndarray and not obj.dtype.hasobject:
            out.put((mp.is_shared(obj), obj.copy(), obj.flags.writeable, obj.strides))
        else:
            out.put((False, obj, None, None))


def _write_arg(a, value, done):
    a[...] = value
    done.put(mp.is_shared(a))


def _produce_and_exit(q, n):
    for i in range(n):
        q.put(np.full((1000,), i, dtype=np.int64))
    q.close()
    q.join_thread()


def _pipe_child(conn):
    a = conn.recv()
    a += 1
    conn.send(a)
    conn.send(np.arange(10.0))
    conn.close()


def _keep_and_count_fds(q, out, n):
    kept = [q.get() for _ in range(n)]
    out.put((len(os.listdir("/proc/self/fd")), int(sum(int(k[0]) for k in kept))))


# -- the README example -------------------------------------------------------------------------
def test_readme_example(ctx):
    q, done = ctx.Queue(), ctx.Queue()
    a = mp.ones((1024, 1024), dtype=np.float32)
    p = ctx.Process(target=_double_and_return_view, args=(q, done))
    p.start()
    q.put(a)
    v = done.get()
    p.join(30)
    assert p.exitcode == 0
    assert a[0, 0] == 2 and mp.is_shared(v)
    assert v.shape == (512, 1024)
    v[0, 0] = 7
    assert a[0, 0] == 7


# -- every kind of array, through every queue kind ----------------------------------------------
def _cases(k=1):
    """Arrays of every kind; ``k`` scales them (k=1: all small enough to cross by value; k=40:
    all but the empty ones over 16 KiB, so they cross as handles to the sender's copy)."""
    m = 8 * k * k  # repeats of the 1-D ones
    base = np.arange(24 * k * k, dtype=np.float64).reshape(4 * k, 6 * k)
    rec = np.zeros(3 * m, dtype=[("x", "<i4"), ("y", ">f8"), ("s", "S5")])
    rec["x"] = np.arange(rec.size)
    rec["y"] = np.arange(rec.size) + 0.5
    rec["s"] = [b"a", b"bb", b"ccc"] * m
    ro = np.arange(5 * m, dtype=np.int16)
    ro.flags.writeable = False
    return {
        "float64": base,
        "strided-view": base[::2, 1::3],
        "transposed": base.T,
        "negative-strides": base[::-1, ::-2],
        "fortran": np.asfortranarray(base),
        "zero-size": np.empty((0, 5), dtype=np.float32),
        "0-d": np.array(3.5),
        "bool": np.array([True, False, True] * m),
        "complex": np.arange(4 * m) * (1 + 2j),
        "big-endian": np.arange(6 * m, dtype=">i8"),
        "float16": np.arange(6 * m, dtype=np.float16),
        "datetime64": np.array(["2024-01-01", "2026-11-29"] * m, dtype="datetime64[D]"),
        # no buffer format: copied element-wise, in Fortran order all the same
        "datetime64-fortran": np.asfortranarray(
            np.arange(12 * k * k).astype("datetime64[D]").reshape(3 * k, 4 * k)),
        "structured": rec,
        "read-only": ro,
        "unicode": np.array(["héllo", "wörld"] * m),
        "broadcast": np.broadcast_to(np.arange(6 * k, dtype=np.int32), (4 * k, 6 * k)),
    }


@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "JoinableQueue"])
@pytest.mark.parametrize("scale", [1, 40], ids=["by-value", "handle"])
def test_every_dtype_and_layout(ctx, kind, scale):
    if scale > 1 and kind != "Queue":
        pytest.skip("the handle path is the same for every queue kind: Queue covers it")
    cases = _cases(scale)
    for name, arr in cases.items():
        assert scale == 1 or arr.size == 0 or arr.ndim == 0 or arr.nbytes > 16 << 10, name
    q, out = getattr(ctx, kind)(), ctx.Queue()
    p = ctx.Process(target=_describe, args=(q, out))
    p.start()
    for name, arr in cases.items():
        q.put(arr)
        shared, got, writeable, strides = out.get(timeout=30)
        assert shared, name
        assert got.dtype == arr.dtype, name
        assert got.shape == arr.shape, name
        np.testing.assert_array_equal(got, arr, err_msg=name)
        assert writeable, name  # a copy, the receiver's own: writable, as the stdlib's
        if arr.ndim > 1 and arr.flags.f_contiguous and not arr.flags.c_contiguous:
            assert strides == arr.strides, name  # Fortran order kept
    q.put(None)
    p.join(30)
    assert p.exitcode == 0


def test_fallbacks_keep_type_and_value(ctx, tmp_path):
    """Object dtypes and numpy subclasses are pickled by value, never crash."""
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_describe, args=(q, out))
    p.start()
    mm = np.memmap(tmp_path / "m.bin", dtype=np.int32, mode="w+", shape=(4,))
    mm[:] = [1, 2, 3, 4]
    objects = {
        "object": np.array([{"a": 1}, None, "x"], dtype=object),
        "masked": np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]),
        "recarray": np.rec.fromrecords([(1, 2.0)], names="a,b"),
        "matrix": np.asmatrix(np.eye(2)),
        "memmap": mm,
    }
    for name, obj in objects.items():
        q.put(obj)
        shared, got, _, _ = out.get(timeout=30)
        assert not shared, name
        assert isinstance(got, type(obj)) or name == "memmap", name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(obj), err_msg=name)
    q.put(None)
    p.join(30)
    del mm
    assert p.exitcode == 0


def test_views_keep_offset_shape_strides(ctx):
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_describe, args=(q, out))
    p.start()
    a = mp.zeros((8, 10), dtype=np.int32)
    a[...] = np.arange(80).reshape(8, 10)
    v = a[1:7:2, ::-3]
    q.put(v)
    shared, got, _, strides = out.get(timeout=30)
    assert shared and strides == v.strides
    np.testing.assert_array_equal(got, v)
    q.put(None)
    p.join(30)


# -- Pipe and Process arguments ----------------------------------------------------------------
def test_pipe_both_ways(ctx):
    here, there = ctx.Pipe()
    p = ctx.Process(target=_pipe_child, args=(there,))
    p.start()
    there.close()
    a = mp.zeros(100)
    here.send(a)
    b = here.recv()
    assert b is not a and mp.is_shared(b)
    assert a[0] == 1 and b[0] == 1  # same memory
    c = here.recv()
    assert mp.is_shared(c)
    np.testing.assert_array_equal(c, np.arange(10.0))
    here.close()
    p.join(30)
    assert p.exitcode == 0


def test_process_argument_shared(ctx):
    done = ctx.Queue()
    a = mp.zeros((1000,))
    p = ctx.Process(target=_write_arg, args=(a[10:20], 5.0, done))
    p.start()
    assert done.get(timeout=30) is True
    p.join(30)
    assert (a[10:20] == 5).all() and a[9] == 0 and a[20] == 0


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_process_argument_not_shared_becomes_shared(method):
    ctx = mp.get_context(method)
    done = ctx.Queue()
    a = np.zeros(10)
    p = ctx.Process(target=_write_arg, args=(a, 5.0, done))
    p.start()
    assert done.get(timeout=30) is True  # the child got shared memory (one copy)
    p.join(30)
    assert (a == 0).all()  # the caller's own array was copied, not changed


def _keep_and_report(q, out, n):
    kept = [q.get(timeout=30) for _ in range(n)]
    out.put((all(mp.is_shared(a) for a in kept), [int(a[0]) for a in kept],
             mp.memory_stats()["blocks"]))
    q.get(timeout=30)  # keep them until told


def test_small_arrays_cross_by_value_and_the_sender_keeps_nothing():
    """A fresh array of at most 16 KiB rides in the record: the receiver copies it into its own
    shared memory; the sender allocates no block and waits for no release."""
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_keep_and_report, args=(q, out, 50))
    p.start()
    before = mp.memory_stats()
    for i in range(50):
        q.put(np.full(512, i, dtype=np.float64))  # 4 KiB each
    shared, firsts, blocks = out.get(timeout=30)
    assert shared and firsts == list(range(50)) and blocks >= 50
    after = mp.memory_stats()
    assert after["remote_held_bytes"] == before["remote_held_bytes"]
    assert after["blocks"] == before["blocks"]
    q.put(None)
    p.join(30)
    assert p.exitcode == 0


def _send_all_then_receive(conn, n):
    for i in range(n):
        conn.send(np.full(512, i, dtype=np.float64))
    return [int(conn.recv()[0]) for _ in range(n)]


def _peer(conn, n, out):
    out.put(_send_all_then_receive(conn, n))


def test_both_ends_of_a_pipe_send_hundreds_of_small_arrays_before_reading():
    """Two peers that each send 300 fresh 4 KiB arrays, then read: the records (by value, then
    handles) fit in the sockets (the stdlib's 64 KiB pipe holds 15 such pickles)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    p = ctx.Process(target=_peer, args=(b, 300, out))
    p.start()
    assert _send_all_then_receive(a, 300) == list(range(300))
    assert out.get(timeout=30) == list(range(300))
    p.join(30)
    assert p.exitcode == 0


def test_small_arrays_become_handles_once_half_the_socket_buffer_waits():
    """By-value records never fill more than half a socket's buffer: past that, small arrays
    cross as handles again (about 1 KiB of buffer each, not 8), so a producer can still put
    many and exit before anyone reads; every array arrives whole, in order, shared."""
    from tensormp import reducers

    r, w = mp.Pipe(duplex=False)
    sent = 0
    while w.by_value_room() >= 4096:
        w.send(np.full(512, sent, dtype=np.float64))
        sent += 1
    assert sent >= 3
    msg = reducers.dumps(np.full(512, sent, dtype=np.float64), w.by_value_room)
    assert len(msg.fds) == 1 and not msg.by_value  # a handle now
    msg.abandon()
    for _ in range(20):
        w.send(np.full(512, sent, dtype=np.float64))
        sent += 1
    for i in range(sent):
        a = r.recv()
        assert mp.is_shared(a) and a.shape == (512,) and (a == i).all()
    msg = reducers.dumps(np.zeros(512), w.by_value_room)
    assert msg.by_value and not msg.fds  # the socket is empty again: by value
    r.close()
    w.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_small_array_received_without_shared_memory_arrives_private(tmp_path):
    """A receiver that cannot get shared memory for an array sent by value (file_system, a
    full shm directory) keeps a private copy and warns once: the item is never lost."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    small = tmp_path / "small"
    small.mkdir()
    code = (
        "import warnings, numpy as np, tensormp as mp\n"
        "mp.set_sharing_strategy('file_system')\n"
        "r, w = mp.Pipe(duplex=False)\n"
        "w.send(np.arange(100.0)); w.send(np.arange(100.0) * 2)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    a, b = r.recv(), r.recv()\n"
        "assert (a == np.arange(100.0)).all() and (b == 2 * a).all(), (a, b)\n"
        "assert not mp.is_shared(a) and a.flags.writeable\n"
        "assert len(caught) == 1 and 'private' in str(caught[0].message), caught\n"
        "try:\n"
        "    w.send(np.zeros(1 << 20))  # a large one still needs the sender's shared memory\n"
        "except mp.SharedMemoryError:\n"
        "    print('OK')\n"
    )
    script = f"mount -t tmpfs -o size=1m tmpfs {small} && {sys.executable} -c \"$CODE\""
    env = dict(os.environ, TENSORMP_SHM_DIR=str(small), CODE=code)
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, timeout=60,
                         text=True, env=env)
    if "mount" in out.stderr and out.returncode == 32:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stdout + out.stderr


# -- lifetime -----------------------------------------------------------------------------------
def test_consumer_receives_after_producer_exited(ctx):
    q = ctx.Queue()
    p = ctx.Process(target=_produce_and_exit, args=(q, 20))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    for i in range(20):
        a = q.get(timeout=10)
        assert mp.is_shared(a) and (a == i).all()


def test_memory_survives_sigkill_of_creator():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_produce_and_exit, args=(q, 3))
    p.start()
    first = q.get(timeout=30)
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    assert (first == 0).all()
    first[:] = 9  # still mapped and writable after the creator died
    assert first.sum() == 9 * 1000


# -- fds do not grow ----------------------------------------------------------------------------
def test_receiver_fds_flat_when_keeping_arrays(ctx):
    n = 3000
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_keep_and_count_fds, args=(q, out, n))
    p.start()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(n):
        q.put(np.full(512, i, dtype=np.float64))  # 4 KiB each, copied into shared memory
    fds, total = out.get(timeout=60)
    p.join(30)
    assert total == sum(range(n))
    assert fds < 40, f"receiver holds {fds} fds for {n} arrays"
    # the sender's: its release socket, an epoll, and an arena (4-64 MiB) per few thousand kept
    # arrays that crossed as handles (those past the socket's by-value half)
    assert len(os.listdir("/proc/self/fd")) <= before + 8


# -- errors raise in the caller ---------------------------------------------------------------
@pytest.mark.parametrize("kind", ["Queue", "SimpleQueue", "JoinableQueue", "Pipe"])
def test_unpicklable_put_raises_in_caller_and_sends_nothing(ctx, kind):
    if kind == "Pipe":
        reader, writer = ctx.Pipe(duplex=False)
        put, get = writer.send, reader.recv
    else:
        q = getattr(ctx, kind)()
        put, get = q.put, q.get
    with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
        put([np.ones(3), threading.Lock()])
    put("after")
    assert get() == "after"
    if kind == "Pipe":
        reader.close()
        writer.close()


def _plain_loads(data, out):
    try:
        pickle.loads(data)
    except Exception as e:
        out.put((type(e).__name__, str(e)))
    else:
        out.put(None)


def test_handle_outside_channel_is_a_clear_error():
    from tensormp import reducers

    ctx = mp.get_context("spawn")
    a = mp.ones(3)
    msg = reducers.dumps(a)  # bytes only: the fds stay behind
    out = ctx.SimpleQueue()
    p = ctx.Process(target=_plain_loads, args=(msg.data, out))
    p.start()
    name, text = out.get()
    p.join(30)
    assert name == "HandleError" and "outside a tensormp channel" in text


# -- fork: child allocations never alias the parent's -------------------------------------------
def _fork_child_alloc(out):
    xs = [mp.full(16, 100 + i) for i in range(50)]  # would reuse the parent's free blocks
    out.put(all(int(x[0]) == 100 + i for i, x in enumerate(xs)))


def test_fork_child_has_own_allocator():
    ctx = mp.get_context("fork")
    parent = [mp.full(16, i) for i in range(50)]
    del parent[::2]  # free blocks in the parent before forking
    out = ctx.Queue()
    p = ctx.Process(target=_fork_child_alloc, args=(out,))
    p.start()
    mine = [mp.full(16, -1) for _ in range(50)]  # the parent allocates at the same time
    assert out.get(timeout=30) is True
    p.join(30)
    assert all(int(x[0]) == 2 * i + 1 for i, x in enumerate(parent))
    assert all(int(x[0]) == -1 for x in mine)


def _send_array_then_text(writer):
    writer.send(mp.empty(10))
    writer.send("next")
    writer.close()


def test_out_of_fds_drops_one_message_and_the_pipe_stays_usable():
    import resource

    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_send_array_then_text, args=(writer,))
    p.start()
    writer.close()
    p.join(30)  # both messages are in flight; the array's creator has exited
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (used + 16, hard))
    hog = []
    try:
        while True:
            hog.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    try:
        with pytest.raises(mp.FdLimitError, match="out of fds"):
            reader.recv()
    finally:
        for fd in hog:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert reader.recv() == "next"
    reader.close()


# -- recycling across processes (release tracking, memory/release.py) --------------------------
def _consume_and_ack(q, acks, n):
    for _ in range(n):
        a = q.get()
        acks.put(float(a[0]))
        del a


def _stats_after(predicate, timeout=10.0):
    from helpers import wait_for

    wait_for(lambda: predicate(mp.memory_stats()), timeout)
    return mp.memory_stats()


def test_sent_blocks_are_recycled_once_released():
    ctx = mp.get_context("spawn")
    q, acks = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_consume_and_ack, args=(q, acks, 8))
    p.start()
    src = np.ones(1 << 20)  # 8 MiB, not shared: copied into shared memory at each put
    mapped = []
    for i in range(8):
        src[0] = i
        q.put(src)
        assert acks.get(timeout=30) == i
        _stats_after(lambda s: s["remote_held_bytes"] == 0, 5.0)
        mapped.append(mp.memory_stats()["mapped_bytes"])
    p.join(30)
    assert max(mapped[2:]) == mapped[1], f"segments not recycled: mapped bytes {mapped}"


def _hold_forever(q, ready):
    kept = q.get()
    ready.put(float(kept.sum()))
    import time

    time.sleep(120)


def test_sigkilled_receiver_cannot_pin_memory():
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_hold_forever, args=(q, ready))
    p.start()
    a = mp.ones(1 << 20)
    q.put(a)
    assert ready.get(timeout=30) == float(1 << 20)
    del a
    assert mp.memory_stats()["remote_held_bytes"] >= 8 << 20
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    stats = _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)
    assert stats["remote_held_bytes"] == 0 and stats["cached_bytes"] >= 8 << 20


def _forward(q_in, q_out):
    a = q_in.get()
    q_out.put(a)  # forward, then drop our own view
    del a


def _check_later(q, result, go):
    a = q.get()
    expected = a.copy()
    go.get()  # the creator has reallocated and scribbled meanwhile
    result.put(bool((a == expected).all()))


def test_forwarded_block_is_not_recycled_while_held():
    ctx = mp.get_context("spawn")
    q1, q2, result, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    b = ctx.Process(target=_forward, args=(q1, q2))
    c = ctx.Process(target=_check_later, args=(q2, result, go))
    b.start()
    c.start()
    a = mp.full(1 << 20, 3.0)
    q1.put(a)
    del a
    b.join(30)  # b forwarded to c and exited (releasing its own hold)
    for _ in range(4):  # a recycled block would be handed out, and overwritten, here
        scratch = mp.empty(1 << 20)
        scratch[...] = -1
        del scratch
    go.put(None)
    assert result.get(timeout=30) is True
    c.join(30)
    _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)


def _forward_back(q_in, q_out):
    a = q_in.get()
    q_out.put(a)  # back to its creator, as a ping-pong does
    del a
    q_in.get()  # stay until told: no exit-time records in between


@contextlib.contextmanager
def _release_records():
    """The release records this process's release server handles meanwhile: a list of
    ``(sender pid, [op, ...])``, one entry per datagram."""
    from tensormp.memory import allocator

    st = allocator._allocator
    st.address()
    server = st.server
    handler = server._handler
    seen: list = []

    def spy(pid, records):
        seen.append((pid, [r[0] for r in records]))
        handler(pid, records)

    server._handler = spy
    try:
        yield seen
    finally:
        server._handler = handler


def test_forward_tells_holds_and_acquire_in_one_datagram():
    """A process that forwards an array it received tells the creator that it holds it and
    that one more handle is out in one datagram (one wake-up of the creator's release
    thread), the hold first."""
    ctx = mp.get_context("spawn")
    q1, q2 = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_forward_back, args=(q1, q2))
    with _release_records() as seen:
        p.start()
        try:
            a = mp.full(512, 1.0)
            q1.put(a)
            b = q2.get()
            b[1] = 5.0
            assert a[1] == 5.0  # the same memory came back
            del a, b
            assert wait_for(lambda: any(b"A" in ops for pid, ops in seen if pid == p.pid), 10.0)
            first = next(ops for pid, ops in seen if pid == p.pid)
            assert first == [b"H", b"A"], f"the forwarder's datagrams: {seen}"
        finally:
            q1.put(None)
            p.join(30)
    assert p.exitcode == 0
    _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)


def _echo_until_none(q_in, q_out):
    while (a := q_in.get()) is not None:
        a[0] += 1
        q_out.put(a)
        del a


def test_ping_pong_sends_no_release_per_round_trip():
    """An already-shared small block bounced back and forth: the echoer keeps its view of the
    block for a moment after dropping it, so the next round trip reuses it instead of
    releasing it (``R``) and announcing a new hold (``H``) every time; the block is still given
    back once the ping-pong stops."""
    ctx = mp.get_context("spawn")
    q1, q2 = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_echo_until_none, args=(q1, q2))
    n = 300
    with _release_records() as seen:
        p.start()
        try:
            a = mp.zeros(512, dtype=np.int64)
            for i in range(n):
                q1.put(a)
                a = q2.get()
                assert a[0] == i + 1
        finally:
            q1.put(None)
            p.join(30)
    ops = [op for _pid, pid_ops in seen for op in pid_ops]
    assert p.exitcode == 0
    assert ops.count(b"A") >= n - 1  # one acquire per forward, as before
    assert ops.count(b"R") + ops.count(b"D") <= n // 4, f"{ops.count(b'R')} releases"
    del a
    _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)


def _drop_then_empty_cache(q, out):
    a = q.get()
    kept = int(a[0])
    del a
    before = mp.memory_stats()["segments"]
    mp.empty_cache()
    out.put((kept, before, mp.memory_stats()["segments"]))


def test_empty_cache_unmaps_a_recently_received_block():
    """A receiver keeps the view of a re-sent small block a moment after dropping it (for the
    next round trip); ``empty_cache()`` still unmaps its segment at once."""
    ctx = mp.get_context("spawn")
    q, out = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_drop_then_empty_cache, args=(q, out))
    p.start()
    a = mp.full(512, 7, dtype=np.int64)
    q.put(a)
    assert out.get() == (7, 1, 0)
    p.join(30)
    assert p.exitcode == 0
    del a
    _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)


def _receive_and_count_threads(q, out, seconds):
    """Receive arrays for ``seconds``, noting every thread seen alive besides the main one
    (by kernel thread id: a new thread's ``ident`` may reuse an old one's)."""
    import time

    seen = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        a = q.get()
        del a
        seen.update(t.native_id for t in threading.enumerate() if t is not threading.main_thread())
    out.put(len(seen))
    while q.get() is not None:
        pass


def test_receiver_starts_no_thread_per_flush():
    """Holds and releases of received arrays are flushed at the latest 50 ms after they are
    queued, by one long-lived thread (it used to be a threading.Timer, a new thread every
    50 ms while arrays kept arriving)."""
    ctx = mp.get_context("spawn")
    q, out = ctx.SimpleQueue(), ctx.SimpleQueue()
    p = ctx.Process(target=_receive_and_count_threads, args=(q, out, 1.0))
    p.start()
    a = mp.zeros(512, dtype=np.int64)
    while out.empty() and p.is_alive():
        q.put(a)
        threading.Event().wait(0.002)
    q.put(None)
    threads = out.get()
    p.join(30)
    assert p.exitcode == 0
    # The flush thread and the idle-mapping reaper (restarted at most once a second).
    assert threads <= 3, f"the receiver ran {threads} threads in 1 s"
    del a
    _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)


def _survivor_still_protected(go, result, survivor):
    """A holder of a 1 MiB block was SIGKILLed: after the creator's liveness sweep dropped its
    hold, the block stays held for ``survivor`` (new blocks do not reuse it), whose content
    check (``go`` -> ``result``) passes, and is freed once ``survivor`` lets go."""
    import time

    time.sleep(2.5)  # the creator's sweep (about once a second) drops the victim's hold
    assert mp.memory_stats()["remote_held_bytes"] >= 1 << 20  # the survivor still holds it
    scratch = [mp.empty(1 << 17) for _ in range(4)]  # a recycled block would be reused here
    for s in scratch:
        s[...] = -1.0
    go.put(1)
    assert result.get(timeout=30) is True
    survivor.join(30)
    del scratch
    stats = _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)
    assert stats["remote_held_bytes"] == 0


def _forward_and_hold(q_in, q_out, ready, go, result):
    a = q_in.get()
    q_out.put(a)
    ready.put("forwarded")
    go.get()
    result.put(bool((a == 7.0).all()))
    del a


def _receive_and_hold(q, ready, go, result):
    a = q.get()
    ready.put("received")
    go.get()
    result.put(bool((a == 7.0).all()))
    del a


@pytest.mark.parametrize("killed", ["forwarder", "receiver"])
def test_forwarded_block_is_freed_once_forwarder_and_receiver_are_gone(killed):
    """The creator keeps a forwarded block while either the forwarder or the receiver holds
    it, whichever of them is SIGKILLed (its liveness sweep drops only the dead one's hold),
    and frees it once the other lets go."""
    ctx = mp.get_context("spawn")
    q1, q2, ready, go_f, go_r, result = (ctx.Queue() for _ in range(6))
    fwd = ctx.Process(target=_forward_and_hold, args=(q1, q2, ready, go_f, result))
    rcv = ctx.Process(target=_receive_and_hold, args=(q2, ready, go_r, result))
    fwd.start()
    rcv.start()
    a = mp.full(1 << 17, 7.0)  # 1 MiB: its own block
    q1.put(a)
    assert sorted([ready.get(timeout=30), ready.get(timeout=30)]) == ["forwarded", "received"]
    del a
    victim, survivor, go = (fwd, rcv, go_r) if killed == "forwarder" else (rcv, fwd, go_f)
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    _survivor_still_protected(go, result, survivor)
    assert survivor.exitcode == 0


def _forward_all(q_in, q_out):
    while (a := q_in.get()) is not None:
        q_out.put(a)
        del a
    q_out.put(None)


def _drop_all(q):
    while (a := q.get()) is not None:
        del a


def test_forwards_to_a_third_process_leave_no_tokens_in_the_creator():
    """The creator keeps each counted acquire's token until the forwarded handle comes back to
    it, which never happens in a pipeline that forwards to a third process: the tokens must
    go once the block's remote count is back to zero (they used to pile up, one per array)."""
    from tensormp.memory import allocator

    ctx = mp.get_context("spawn")
    q1, q2 = ctx.SimpleQueue(), ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_forward_all, args=(q1, q2)),
        ctx.Process(target=_drop_all, args=(q2,)),
    ]
    for p in procs:
        p.start()
    a = mp.zeros(8)
    for _ in range(200):
        q1.put(a)
    q1.put(None)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    st = allocator._allocator
    assert wait_for(lambda: not st.arenas.remote_held, 10.0)  # every handle came back
    tokens = len(getattr(st, "acquired", ())) + sum(
        len(getattr(b, "acquired", None) or ()) for b in list(st.root_blocks.values())
    )
    assert tokens == 0
    del a


def _keep_and_echo_views(q, out, n):
    keep = []
    for _ in range(n):
        keep.append(q.get())
        out.put(keep[-1][::2])  # a view goes back to the creator, which drops it
    out.put("kept")
    q.get()
    out.put([i for i, x in enumerate(keep) if not (x == i % 250 + 1).all()])


def test_view_sent_back_to_creator_never_frees_memory_still_held(ctx):
    """Regression: the creator consumed the echoed handle before counting the echoer's
    acquire, recycled the block, and overwrote the echoer's array."""
    n = 150
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_keep_and_echo_views, args=(q, out, n))
    p.start()
    for i in range(n):
        q.put(mp.full(4096, i % 250 + 1, dtype=np.uint8))  # not kept here
        out.get(timeout=30)  # the view comes back and is dropped
    assert out.get(timeout=30) == "kept"
    junk = [mp.zeros(4096, dtype=np.uint8) for _ in range(2 * n)]  # reuses freed blocks
    q.put("check")
    assert out.get(timeout=30) == []
    p.join(30)
    del junk


def _sleep_with(a):
    import time

    time.sleep(60)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_child_killed_during_start_up_cannot_pin_its_arguments(method):
    ctx = mp.get_context(method)
    a = mp.ones(1 << 20)  # 8 MiB, its own segment
    p = ctx.Process(target=_sleep_with, args=(a,))
    p.start()
    os.kill(p.pid, signal.SIGKILL)  # most likely before it even unpickled its arguments
    p.join(30)
    del a
    stats = _stats_after(lambda s: s["remote_held_bytes"] == 0, 10.0)
    assert stats["remote_held_bytes"] == 0


def _hold_then_drop(q, done):
    a = q.get()
    done.get()  # wait until the parent has forked and dropped its own view
    del a


def _idle():
    pass


def test_block_sent_then_pinned_by_a_fork_is_counted_once():
    """Sent (counted), then pinned by a fork, then dropped here before the receiver releases:
    released exactly once (the counters used to go negative and the arena leaked)."""
    ctx = mp.get_context("fork")
    q, done = ctx.SimpleQueue(), ctx.SimpleQueue()
    c = ctx.Process(target=_hold_then_drop, args=(q, done))
    c.start()
    before = mp.memory_stats()
    a = mp.share(np.ones(10_000))
    q.put(a)
    f = ctx.Process(target=_idle)
    f.start()  # pins every live block, ours included
    f.join(30)
    del a
    done.put(1)
    c.join(30)
    assert wait_for(lambda: mp.memory_stats()["remote_held_bytes"] == before["remote_held_bytes"], 10)
    stats = mp.memory_stats()
    assert stats["in_use_bytes"] == before["in_use_bytes"] and stats["in_use_bytes"] >= 0


# -- regressions found by a break-test of the direct-write queue (session 3) ------------------
def test_first_puts_from_many_threads_at_once():
    """Threads racing on the lazy import of the numpy reducer: none may see it half-imported
    (put() raised AttributeError, or arrays went by value)."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "scripts", "first_puts_race.py")
    for _ in range(3):
        out = subprocess.run(
            [sys.executable, script, "8"], capture_output=True, text=True, timeout=60, check=True
        ).stdout
        report = json.loads(out.strip().splitlines()[-1])
        assert report["errors"] == []
        assert report["received"] == list(range(8))
        assert all(report["shared"]) and report["qsize"] == 0


def test_empty_and_poll_while_another_thread_waits():
    """One poll object per connection must not make concurrent polls fail (the stdlib
    returns a bool from each)."""
    q = mp.Queue()
    a, b = mp.Pipe()
    results = {}

    def wait_get():
        try:
            q.get(timeout=0.5)
        except Exception as e:
            results["get"] = type(e).__name__

    def wait_poll():
        results["poll"] = a.poll(0.5)

    threads = [threading.Thread(target=wait_get), threading.Thread(target=wait_poll)]
    for t in threads:
        t.start()
    import time

    time.sleep(0.1)
    assert q.empty() is True
    assert a.poll() is False
    for t in threads:
        t.join()
    assert results == {"get": "Empty", "poll": False}
    q.close()
    q.join_thread()
    a.close()
    b.close()


def test_put_with_more_fds_than_one_scm_rights_message():
    """More than 253 fds in one small message: the queue sends it in batches (it used to be
    dropped with EINVAL by the non-blocking path)."""
    q = mp.Queue()
    pairs = [mp.Pipe() for _ in range(130)]
    ends = [w for _, w in pairs] + [r for r, _ in pairs]  # 260 connections
    q.put(ends)
    got = q.get(timeout=30)
    assert len(got) == 260
    got[0].send("through")  # the writer end of pair 0 is got[0]; its reader is pairs[0][0]
    assert pairs[0][0].recv() == "through"
    for c in got:
        c.close()
    for r, w in pairs:
        r.close()
        w.close()
    q.close()
    q.join_thread()


def _creator_of_arrays(q, ack, n):
    arrays = [mp.full(512, i + 1, dtype=np.int64) for i in range(n)]
    q.put(arrays)
    del arrays
    ack.get()  # the receiver forked its child and dropped its own views
    scribble = [mp.full(512, -7, dtype=np.int64) for _ in range(4 * n)]  # reuses freed blocks
    q.put("scribbled")
    ack.get()
    del scribble


def _check_inherited(arrays, result, go):
    go.get()
    result.put([i for i, a in enumerate(arrays) if not (a == i + 1).all()])


def test_fork_child_keeps_arrays_its_parent_received():
    """A fork child inherits arrays its parent received from another process; the parent
    dropping them must not let their creator recycle them (the parent acquires a handle for
    the child before forking)."""
    ctx = mp.get_context("fork")
    n = 100
    q, ack, result, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    creator = ctx.Process(target=_creator_of_arrays, args=(q, ack, n))
    creator.start()
    arrays = q.get(timeout=30)
    child = ctx.Process(target=_check_inherited, args=(arrays, result, go))
    child.start()
    del arrays
    import gc

    gc.collect()
    mp.reducers.flush_release_records()
    ack.put(1)
    assert q.get(timeout=30) == "scribbled"
    go.put(1)
    assert result.get(timeout=30) == []
    ack.put(1)
    child.join(30)
    creator.join(30)
    assert child.exitcode == 0 and creator.exitcode == 0


def _hold_until_told(q, ready, go, result):
    kept = q.get()
    ready.put(float(kept[0]))  # a send: our hold is announced to the creator before this
    go.get()
    result.put(bool((kept == 5.0).all()))
    del kept


def test_two_holders_one_sigkilled_the_other_still_protected():
    """Two processes hold the same block; the creator drops the SIGKILLed one's hold (its
    liveness sweep) and must keep the block for the other until it lets go."""
    ctx = mp.get_context("spawn")
    q1, q2, ready, go, result = (ctx.Queue() for _ in range(5))
    victim = ctx.Process(target=_hold_forever, args=(q1, ready))
    keeper = ctx.Process(target=_hold_until_told, args=(q2, ready, go, result))
    victim.start()
    keeper.start()
    a = mp.full(1 << 17, 5.0)  # 1 MiB: its own block
    q1.put(a)
    q2.put(a)
    assert sorted([ready.get(timeout=30), ready.get(timeout=30)]) == [5.0, float(1 << 20) * 5.0 / 8]
    del a
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(30)
    _survivor_still_protected(go, result, keeper)


# -- a handle given back twice (pool task to a worker that died: test_pool's random SIGKILLs) ---
def test_late_undo_of_an_unsent_handle_never_frees_the_blocks_next_use():
    """A pool task's argument copy whose worker died before the send: the dead holder gives
    the handle back (register_holder), the block is recycled and handed out again, and only
    then the unsent message is dropped. Its undo must not free the block's new use: it used
    to, so the next copy got the same memory as a copy still in flight (a worker then read the
    next task's argument and answered ``2 * (i + 1)``)."""
    from tensormp import reducers
    from tensormp.memory.allocator import register_holder

    dead = mp.get_context("fork").Process(target=_idle)
    dead.start()
    dead.join(30)
    before = mp.memory_stats()["remote_held_bytes"]
    first = reducers.dumps(np.full(10_000, 1.0))
    register_holder(dead.pid, first.noted)  # holder already dead: the block is free again
    second = reducers.dumps(np.full(10_000, 2.0))  # in flight: that block, reused
    first.abandon()  # the late undo
    third = reducers.dumps(np.full(10_000, 3.0))
    (b2,), (b3,) = second.noted, third.noted
    assert (b2.segment.id, b2.offset) != (b3.segment.id, b3.offset), "one block handed out twice"
    assert np.frombuffer(b2.segment.view, np.float64, 10_000, b2.offset)[0] == 2.0
    second.abandon()
    third.abandon()
    assert mp.memory_stats()["remote_held_bytes"] == before


def _release_before_registered(conn, parent_pid):
    from tensormp import reducers

    reducers.process_args_parent(parent_pid)  # as a pool worker: no hold records for these
    try:
        a = conn.recv()
    finally:
        reducers.process_args_parent(0)
    del a
    conn.send("released")  # (sends the release first)


def test_release_before_registration_survives_the_holders_death():
    """A holder registered after the send (pool tasks, Process arguments) may release, exit and
    be found dead by the liveness sweep before its registration: the registration must cancel
    that release, not give the handle back a second time while another is still out."""
    from tensormp import reducers
    from tensormp.memory import allocator
    from tensormp.memory.allocator import register_holder

    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_release_before_registered, args=(child_end, os.getpid()))
    p.start()
    shared = mp.share(np.ones(100))  # made after the fork: not pinned by it
    first, second = reducers.dumps(shared), reducers.dumps(shared)  # two handles out
    parent_end.send_message(first)
    assert parent_end.recv() == "released"
    p.join(30)
    st = allocator._allocator
    st.server.drain()  # its release is counted
    st._sweep()  # and it is dead
    register_holder(p.pid, first.noted)
    (block,) = second.noted
    assert block.remote == 1, "the handle still out was given back"
    second.abandon()
    assert block.remote == 0
    child_end.close()
    parent_end.close()


def _hold_then_release(conn):
    a = conn.recv()
    assert a[0] == 1.0
    del a
    conn.send("released")
    conn.recv()  # alive until the parent looked (its sweep keeps a live holder's entry)


def test_the_sweep_forgets_the_start_time_of_an_exited_holder():
    """The creator caches each holder's start time by pid; once that process exited (after it
    released everything) the entry must go, or a new process given the same pid would have its
    holds keyed with the old start time and dropped as dead, its blocks recycled while held."""
    from tensormp.memory import allocator

    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    p = ctx.Process(target=_hold_then_release, args=(child_end,))
    p.start()
    shared = mp.share(np.ones(100))  # made after the fork: not pinned by it
    parent_end.send(shared)
    assert parent_end.recv() == "released"
    st = allocator._allocator
    assert wait_for(lambda: (st.server.drain(), p.pid in st.start_times)[1], 10.0), (
        "its hold and release were keyed by (pid, start time)"
    )
    parent_end.send("exit")
    p.join(30)
    st._sweep()  # (a sweep of the release thread may have come first: the same result)
    assert p.pid not in st.start_times
    child_end.close()
    parent_end.close()


def _crop_and_view(q, out):
    img = q.get()  # a copy made for this process alone
    out.put((img[:10, :10], img[:, 3]))  # small views: they cross as copies
    out.put(img[: 3 * len(img) // 4])  # most of it: a handle to the block, shared from now on
    out.put(img[:10, :10])  # the block is shared now: a handle too
    img[0, 0] = -1.0
    out.put("written")


def test_small_views_of_a_copy_made_for_the_sender_cross_as_copies():
    """A worker that returns a crop of its input keeps the stdlib's result (a C-contiguous
    array of the crop's bytes), not a handle that pins the whole input in the receiver; a
    larger view still crosses as a handle (reducers/numpy.py)."""
    ctx = mp.get_context("fork")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_crop_and_view, args=(q, out))
    p.start()
    img = np.arange(1024 * 1024, dtype=np.float64).reshape(1024, 1024)  # 8 MiB, private
    q.put(img)
    crop, column = out.get(timeout=30)
    assert crop.tolist() == img[:10, :10].tolist() and column.tolist() == img[:, 3].tolist()
    assert crop.flags.c_contiguous and column.flags.c_contiguous  # as the stdlib's
    for small in (crop, column):
        block, _root = mp.memory.find_block(small)
        assert block.capacity < 1 << 20  # its own block, not the 8 MiB input's
    most = out.get(timeout=30)
    again = out.get(timeout=30)
    assert mp.memory.find_block(most)[0].capacity >= 6 << 20
    assert out.get(timeout=30) == "written"
    p.join(30)
    assert p.exitcode == 0
    assert most[0, 0] == -1.0 and again[0, 0] == -1.0  # shared with the sender: its write shows
    q.close()
    out.close()
