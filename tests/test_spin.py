"""The reader's spin-then-block wait (``tensormp/_spin.py``, issue #25 ping-pong).

Invariants, not timings: a process that waits for an answer to what it wrote spins, and backs
off when the answers come slowly (few spins, little CPU); a process that only reads never
spins; a record already waiting is taken by the first poll; ``TENSORMP_SPIN_US=0`` never
spins; timed waits keep their deadline; a SIGKILLed writer still means EOF to a reader that
spins.
"""

from __future__ import annotations

import ast
import os
import queue
import signal
import subprocess
import sys
import time

import pytest

import tensormp as mp
from tensormp import _spin

pytestmark = pytest.mark.timeout(60)

GAP_S = 0.02  # before each answer of a slow server: far longer than any spin budget
SLOW_COUNT = 50


def _spin_anyway() -> None:
    """A fresh spin state that spins although the test machine is busy (the crowding check
    would otherwise turn spinning off, and these tests check what a spin does)."""
    _spin.state.__init__()
    _spin.state.next_check = 1 << 62
    _spin.state.crowded = False


def _client(requests, answers, out) -> None:
    """Asks SLOW_COUNT questions of a slow server; reports its spin outcomes and CPU."""
    _spin_anyway()
    c0 = time.process_time()
    for i in range(SLOW_COUNT):
        requests.send(i)
        assert answers.recv() == i
    out.send((_spin.stats(), time.process_time() - c0))


def test_waiting_for_a_slow_answer_backs_off():
    ctx = mp.get_context("fork")
    req_r, req_w = mp.Pipe(duplex=False)
    ans_r, ans_w = mp.Pipe(duplex=False)
    res_r, res_w = mp.Pipe(duplex=False)
    p = ctx.Process(target=_client, args=(req_w, ans_r, res_w))
    p.start()
    try:
        for _ in range(SLOW_COUNT):
            i = req_r.recv()
            time.sleep(GAP_S)
            ans_w.send(i)
        assert res_r.poll(30)
        stats, cpu = res_r.recv()
    finally:
        p.join(30)
        for c in (req_r, req_w, ans_r, ans_w, res_r, res_w):
            c.close()
    assert p.exitcode == 0
    assert stats["found"] + stats["empty"] + stats["plain"] == SLOW_COUNT
    # Spins that found nothing back off (1, 3, 7, 15, ... waits without a spin): about
    # log2(SLOW_COUNT) spins, not one per wait.
    assert 1 <= stats["empty"] <= 8, stats
    assert stats["plain"] >= SLOW_COUNT - 8, stats
    # A second of waiting costs little CPU (a reader that kept polling would use all of it).
    assert cpu < 0.5, cpu


def _reader(r, out, n, answer) -> None:
    _spin_anyway()
    other_r, other_w = mp.Pipe(duplex=False)
    for i in range(n):
        if answer:
            other_w.send(i)  # as if answering: the next wait may spin
        assert r.recv() == i
    out.send(_spin.stats())


@pytest.mark.parametrize("answer", [True, False], ids=["after-a-write", "reader-only"])
def test_who_spins(answer):
    """A record already waiting is taken by the first poll of a spin; a process that only
    reads never spins."""
    ctx = mp.get_context("fork")
    r, w = mp.Pipe(duplex=False)
    res_r, res_w = mp.Pipe(duplex=False)
    for i in range(20):
        w.send(i)
    p = ctx.Process(target=_reader, args=(r, res_w, 20, answer))
    p.start()
    try:
        assert res_r.poll(30)
        stats = res_r.recv()
    finally:
        p.join(30)
        for c in (r, w, res_r, res_w):
            c.close()
    assert p.exitcode == 0
    if answer:
        assert stats["found"] == 20 and stats["empty"] == 0 and stats["plain"] == 0, stats
    else:
        assert stats["found"] == 0 and stats["empty"] == 0, stats


def test_spin_off_by_environment():
    code = (
        "import tensormp as mp\n"
        "from tensormp import _spin\n"
        "_spin.state.next_check = 1 << 62\n"
        "_spin.state.crowded = False\n"
        "r, w = mp.Pipe()\n"
        "for i in range(5):\n"
        "    w.send(i)\n"
        "    assert r.recv() == i\n"
        "print(_spin.stats())\n"
    )
    env = dict(os.environ, TENSORMP_SPIN_US="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    stats = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert (stats["found"], stats["empty"], stats["plain"], stats["budget_ns"]) == (0, 0, 5, 0)
    env["TENSORMP_SPIN_US"] = "fast"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "TENSORMP_SPIN_US='fast'" in out.stderr


def test_timed_waits_keep_their_deadline():
    q = mp.Queue()
    r, w = mp.Pipe()
    try:
        w.send(0)  # this process wrote: its next wait could spin
        assert r.recv() == 0
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):
            q.get(timeout=0.05)
        assert 0.05 <= time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        assert not r.poll(0.05)
        assert 0.05 <= time.monotonic() - t0 < 1.0
    finally:
        q.close()
        q.join_thread()
        r.close()
        w.close()


def _writer_then_die(w) -> None:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)


def test_sigkilled_writer_ends_a_spinning_read_with_eof():
    ctx = mp.get_context("fork")
    r, w = mp.Pipe(duplex=False)
    p = ctx.Process(target=_writer_then_die, args=(w,))
    p.start()
    w.close()  # the child holds the only writer
    saved = _spin.stats()
    _spin_anyway()
    _spin.state.sent = True
    try:
        t0 = time.monotonic()
        with pytest.raises(EOFError):
            r.recv()
        assert time.monotonic() - t0 < 30
        assert _spin.stats()["empty"] == 1  # it spun, found nothing, blocked, got EOF
    finally:
        _spin.state.__init__()
        p.join(30)
        r.close()
    assert p.exitcode == -signal.SIGKILL
    assert saved["budget_ns"] == _spin.state.budget_ns


def _take_one(q, out) -> None:
    out.send(q.get(timeout=30))


def _yields() -> tuple[int, int]:
    st = _spin.stats()
    return st["yield_found"], st["yield_slept"]


@pytest.mark.parametrize("maxsize", [16, 0], ids=["bounded", "unbounded"])
def test_only_consumers_among_several_yield(maxsize):
    """A queue's consumer gives the CPU away before it sleeps only once its records' numbers
    (the ledger's, bounded; each producer's own, unbounded) show another consumer; never for
    ``get(timeout=0)``/``get(block=False)``, never as the only consumer; a yield that found
    nothing backs off."""
    ctx = mp.get_context("fork")
    q = mp.Queue(maxsize)
    res_r, res_w = mp.Pipe(duplex=False)
    _spin.state.__init__()
    try:
        q.put(0)
        q.put(1)
        assert q.get(timeout=5) == 0 and q.get(timeout=5) == 1  # numbers follow: alone
        with pytest.raises(queue.Empty):
            q.get(timeout=0.01)
        assert _yields() == (0, 0)
        q.put(2)
        q.put(3)
        p = ctx.Process(target=_take_one, args=(q, res_w))
        p.start()
        assert res_r.recv() == 2  # another consumer took record 3
        p.join(30)
        assert p.exitcode == 0
        assert q.get(timeout=5) == 3  # its number skips one: not alone
        for t in (0, 0.0):
            with pytest.raises(queue.Empty):
                q.get(timeout=t)
        with pytest.raises(queue.Empty):
            q.get(block=False)
        assert _yields() == (0, 0)
        t0 = time.monotonic()
        with pytest.raises(queue.Empty):
            q.get(timeout=0.05)  # yields once, finds nothing, keeps its deadline
        assert 0.05 <= time.monotonic() - t0 < 1.0
        assert _yields() == (0, 1)
        for _ in range(14):  # backing off: 1, 3, 7 waits without a yield after each miss
            with pytest.raises(queue.Empty):
                q.get(timeout=0.001)
        assert _yields() == (0, 4)  # yields at the 2nd, 6th and 14th of those waits
        q.put(4)
        _spin.state.yield_skip = 0
        assert q.get() == 4  # a record already there: taken before any yield
        assert _yields() == (0, 4)
    finally:
        _spin.state.__init__()
        q.close()
        q.join_thread()
        res_r.close()
        res_w.close()


def _consume(q, out) -> None:
    got = []
    while (x := q.get(timeout=30)) is not None:
        got.append(x)
    out.send((got, _spin.stats()))


def test_several_consumers_get_every_item_once():
    """1 producer -> 3 consumers through a bounded queue, with pauses so that consumers wait:
    every item arrives once, in order per consumer, and waiting consumers yielded."""
    ctx = mp.get_context("fork")
    q = mp.Queue(64)
    res_r, res_w = mp.Pipe(duplex=False)
    procs = [ctx.Process(target=_consume, args=(q, res_w)) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        n = 600
        for i in range(n):
            q.put(i)
            if i % 20 == 19:
                time.sleep(0.002)
        for _ in procs:
            q.put(None)
        results = [res_r.recv() for _ in procs]
    finally:
        for p in procs:
            p.join(30)
        q.close()
        q.join_thread()
        res_r.close()
        res_w.close()
    assert all(p.exitcode == 0 for p in procs)
    everything = sorted(x for got, _ in results for x in got)
    assert everything == list(range(n))
    assert all(got == sorted(got) for got, _ in results)
    assert sum(st["yield_found"] + st["yield_slept"] for _, st in results) > 0
