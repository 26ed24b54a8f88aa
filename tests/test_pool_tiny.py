"""The per-task paths of the pool engine (pool/manager.py: "Direct send", "Prefetch"): callers
sending to workers themselves, batches of tiny tasks, deep queues in a worker's channel, and
what a worker's death or close() does to them. Real processes, real SIGKILLs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import tensormp as mp
from helpers import wait_for
from tensormp.pool import WorkerLostError


def _inc(x):
    return x + 1


def _log_and_inc(path, x):
    with open(path, "a") as f:  # one short O_APPEND write per run: a record of who ran
        f.write(f"{x}\n")
    return x + 1


def _block(path):
    Path(path).write_text(str(os.getpid()))
    time.sleep(60)


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _deep(pool) -> int:
    return max(w.depth for w in pool._engine.workers)


@pytest.mark.timeout(60)
def test_tiny_tasks_from_many_threads_all_arrive_once():
    with mp.get_context("spawn").Pool(2) as pool:
        errors = []

        def caller(k):
            try:
                for i in range(60):
                    assert pool.apply(_inc, (i,)) == i + 1
                got = [r.get(timeout=30) for r in [pool.apply_async(_inc, (i,)) for i in range(300)]]
                assert got == list(range(1, 301))
                assert list(pool.imap(_inc, range(300))) == list(range(1, 301))
                assert sorted(pool.imap_unordered(_inc, iter(range(300)))) == list(range(1, 301))
                assert pool.map(_inc, range(1000), chunksize=1) == list(range(1, 1001))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append((k, e))

        threads = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert _deep(pool) > 2, "tiny tasks queue deeper than one running and one waiting"
        # Several threads waiting on one result all wake.
        result = pool.apply_async(_sleep, (0.2,))
        seen = []
        waiters = [threading.Thread(target=lambda: seen.append(result.get(10))) for _ in range(4)]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join()
        assert seen == [0.2] * 4 and result.ready() and result.successful()


@pytest.mark.timeout(60)
def test_long_tasks_keep_the_queue_short():
    with mp.get_context("spawn").Pool(2) as pool:
        pool.map(_inc, range(2000), chunksize=1)
        assert _deep(pool) > 2
        assert pool.map(_sleep, [0.05] * 8, chunksize=1) == [0.05] * 8
        # Calls of 50 ms: the prefetch budget (2 ms of queued work) keeps "one running, one
        # queued", so a task never waits behind many long ones while another worker idles.
        assert _deep(pool) == 2


@pytest.mark.timeout(60)
def test_sigkill_with_a_deep_queue_fails_one_task_and_reruns_the_rest_once(tmp_path):
    log, pid_file = tmp_path / "ran", tmp_path / "pid"
    with mp.get_context("spawn").Pool(1) as pool:
        pool.map(_inc, range(2000), chunksize=1)  # the worker's queue gets deep
        assert _deep(pool) > 2
        victim = pool.apply_async(_block, (str(pid_file),))
        queued = [pool.apply_async(_log_and_inc, (str(log), i)) for i in range(40)]
        pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30))
        assert len(pool._engine.workers[0].outstanding) > 2, "tasks queued behind the victim"
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLostError) as info:
            victim.get(timeout=30)
        assert info.value.pid == pid and info.value.signal_name == "SIGKILL"
        assert [r.get(timeout=30) for r in queued] == list(range(1, 41))
        ran = sorted(int(x) for x in log.read_text().split())
        assert ran == list(range(40)), "each queued task ran exactly once"


@pytest.mark.timeout(60)
def test_close_while_threads_submit():
    pool = mp.get_context("spawn").Pool(2)
    pool.map(_inc, range(500), chunksize=1)
    accepted, refused, stop = [], [], threading.Event()

    def submitter():
        i = 0
        while not stop.is_set():
            try:
                accepted.append((i, pool.apply_async(_inc, (i,))))
            except ValueError:  # closed: as the stdlib
                refused.append(i)
                return
            i += 1

    threads = [threading.Thread(target=submitter) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    pool.close()
    stop.set()
    for t in threads:
        t.join()
    pool.join()  # returns: every accepted task ran, then the workers stopped
    assert accepted and len(refused) <= 3
    assert all(r.get(timeout=1) == i + 1 for i, r in accepted)


@pytest.mark.timeout(60)
def test_import_loads_only_what_is_used(tmp_path):
    script = tmp_path / "child_modules.py"
    script.write_text(
        "import sys\n"
        "import tensormp\n"
        "def report(path):\n"
        "    with open(path, 'w') as f:\n"
        "        f.write('\\n'.join(sorted(sys.modules)))\n"
        "if __name__ == '__main__':\n"
        "    assert 'tensormp.connection' not in sys.modules, sorted(sys.modules)\n"
        "    import tensormp.spawn\n"
        "    assert callable(tensormp.spawn) and tensormp.spawn.__module__ == 'tensormp.spawn'\n"
        "    p = tensormp.get_context('spawn').Process(target=report, args=(sys.argv[1],))\n"
        "    p.start(); p.join(); assert p.exitcode == 0\n"
    )
    out = tmp_path / "modules"
    subprocess.run([sys.executable, str(script), str(out)], check=True, timeout=50)
    loaded = set(out.read_text().split())
    assert "tensormp.context" in loaded  # its Process class
    # dataclasses pulls in inspect, ast, dis, tokenize: ~10 ms of every child's start-up
    for heavy in ("numpy", "tensormp.connection", "multiprocessing.connection", "tensormp.pool",
                  "tempfile", "dataclasses", "inspect"):
        assert heavy not in loaded, f"a Process child imported {heavy}"


def _work_briefly(x):
    time.sleep(0.0002)
    return x * 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_random_sigkills_with_tiny_tasks_from_threads_never_hang_or_mix_up():
    import random

    rng = random.Random(3)
    # fork: a replacement starts at once (a spawn or forkserver one imports pytest first, which
    # takes seconds on a loaded machine); the paths under test are the same.
    with mp.get_context("fork").Pool(2) as pool:
        stop = threading.Event()

        def killer():
            while not stop.is_set():
                time.sleep(rng.uniform(0.01, 0.3))
                pids = [w.pid for w in list(pool._engine.workers) if w.ready and not w.gone]
                if pids:
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                    except ProcessLookupError:
                        pass

        counts = {"ok": 0, "lost": 0}
        errors = []
        lock = threading.Lock()

        def caller(k):
            try:
                for round_ in range(8):
                    base = 1000 * (100 * k + round_)
                    results = [pool.apply_async(_work_briefly, (base + i,)) for i in range(150)]
                    results += [None] * 10
                    for i, r in enumerate(results):
                        try:
                            got = pool.apply(_work_briefly, (base + i,)) if r is None else \
                                r.get(timeout=60)
                        except WorkerLostError as e:
                            assert e.signal_name == "SIGKILL", e
                            n = "lost"
                        else:
                            if r is not None:
                                assert got == 2 * (base + i), (got, base + i)
                            n = "ok"
                        with lock:
                            counts[n] += 1
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        thread = threading.Thread(target=killer)
        thread.start()
        callers = [threading.Thread(target=caller, args=(k,)) for k in range(3)]
        try:
            for t in callers:
                t.start()
            for t in callers:
                t.join()
        finally:
            stop.set()
            thread.join()
        assert not errors, errors
        assert counts["ok"] + counts["lost"] == 3 * 8 * 160 and counts["lost"] > 0
        time.sleep(0.3)  # the killer's last victim is noticed and replaced
        assert wait_for(lambda: sum(w.ready for w in pool._engine.workers) == 2, 30)
        assert pool.map(_inc, range(100)) == list(range(1, 101))


def _prints_ok(script):
    """Run ``script`` as a main module (what goes by reference depends on __main__)."""
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=100)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _refuse_to_load():
    raise LookupError("this callable cannot be loaded in a worker")


class _LoadsNowhere:
    """Pickles in the parent; unpickling it raises (as a function a worker cannot import)."""

    def __call__(self, x):
        return x

    def __reduce__(self):
        return (_refuse_to_load, ())


@pytest.mark.timeout(60)
def test_light_batches_mix_kinds_and_fail_task_by_task():
    # Light tasks (scalar, str, bytes arguments) travel as tuples inside one pickle per batch,
    # their callables pickled once per batch; others as their own pickles in the same batch.
    with mp.get_context("spawn").Pool(2) as pool:
        words = [f"w{i}" * (i % 5) for i in range(400)]
        assert list(pool.imap(len, words)) == [len(w) for w in words]
        mixed = [i if i % 3 else (i,) for i in range(300)]  # a tuple is not light
        assert list(pool.imap(_echo, mixed)) == mixed
        got = [pool.apply_async(_inc, (i,)) for i in range(200)]
        got += [pool.apply_async(_echo, (b"x" * i,)) for i in range(200)]
        assert [r.get(timeout=30) for r in got] == [i + 1 for i in range(200)] + [
            b"x" * i for i in range(200)
        ]
        # A callable the workers cannot unpickle: every task fails on its own, none hangs,
        # and the pool goes on.
        results = [pool.apply_async(_LoadsNowhere(), (i,)) for i in range(100)]
        for r in results:
            with pytest.raises(LookupError, match="cannot be loaded"):
                r.get(timeout=30)
        it = pool.imap(_LoadsNowhere(), range(50))
        for _ in range(50):
            with pytest.raises(LookupError):
                next(it)
        assert pool.map(_inc, range(1000), chunksize=1) == list(range(1, 1001))


def _echo(x):
    return x


def _fill(out, i):
    out[i] = i + 1
    return i


class _Filler:
    def __init__(self, out):
        self.out = out
        self.calls = 0

    def __call__(self, i):
        self.out[i] = i + 1
        return i

    def count(self, i):
        self.calls += 1  # a copy per task, as the stdlib: never more than 1
        return self.calls


@pytest.mark.timeout(90)
def test_callables_holding_shared_arrays_with_light_arguments_write_through():
    import functools

    with mp.get_context("spawn").Pool(2) as pool:
        for make in (lambda out: functools.partial(_fill, out), _Filler,
                     lambda out: _Filler(out).__call__):
            out = mp.zeros(64)
            f = make(out)
            assert [r.get(timeout=30) for r in [pool.apply_async(f, (i,)) for i in range(32)]] \
                == list(range(32))
            assert list(pool.imap(f, range(32, 48))) == list(range(32, 48))
            assert pool.map(f, range(48, 64), chunksize=1) == list(range(48, 64))
            assert out.tolist() == [float(i + 1) for i in range(64)]
        # A callable's own state: a fresh copy for each task, as with the stdlib's Pool.
        counter = _Filler(mp.zeros(1))
        assert list(pool.imap(counter.count, range(40))) == [1] * 40
        assert set(pool.map(counter, range(1), chunksize=1)) == {0}
        assert [pool.apply(counter.count, (i,)) for i in range(5)] == [1] * 5


@pytest.mark.timeout(120)
def test_bound_methods_of_main_classes_keep_arrays_shared(tmp_path):
    script = tmp_path / "methods.py"
    script.write_text(
        "import sys\n"
        "import tensormp as mp\n"
        "class Acc:\n"
        "    def __init__(self):\n"
        "        self.buf = mp.zeros(4)\n"
        "    def fill(self, i, *rest):\n"
        "        self.buf[i] = 7\n"
        "        return mp.is_shared(self.buf)\n"
        "if __name__ == '__main__':\n"
        "    class Local:\n"  # not findable in a spawn child: goes by value (a copy)
        "        def get(self, x):\n"
        "            return x * 2\n"
        "    ctx = mp.get_context('spawn')\n"
        "    a = Acc()\n"
        "    with ctx.Pool(2) as pool:\n"
        "        assert pool.apply(a.fill, (0,))\n"
        "        assert pool.map(a.fill, [1], chunksize=1) == [True]\n"
        "        assert pool.apply(Local().get, (4,)) == 8\n"
        "    with mp.ProcessPoolExecutor(2, mp_context=ctx) as ex:\n"
        "        assert ex.submit(a.fill, 2).result(timeout=30)\n"
        "    mp.spawn(a.fill, nprocs=1, start_method='spawn')\n"  # fill(rank=0): buf[0]\n"
        "    p = ctx.Process(target=a.fill, args=(3,)); p.start(); p.join()\n"
        "    assert a.buf.tolist() == [7.0] * 4, a.buf\n"
        "    print('ok')\n"
    )
    _prints_ok(script)


def _gives_four_then_raises():
    yield from range(4)
    raise RuntimeError("the iterable broke")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["imap", "imap_unordered"])
def test_an_iterable_that_raises_comes_after_the_answers_before_it(what):
    with mp.get_context("spawn").Pool(2) as pool:
        got = []
        it = getattr(pool, what)(_sleep, (0.05 * (i % 2) for i in _gives_four_then_raises()))
        with pytest.raises(RuntimeError, match="the iterable broke"):
            for x in it:
                got.append(x)
        assert sorted(got) == [0, 0, 0.05, 0.05]  # the stdlib's order too: answers first
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.timeout(120)
def test_under_fork_callables_of_main_go_by_reference_and_keep_arrays_shared(tmp_path):
    # Workers forked from the parent know __main__ as it was: what the stdlib does works (no
    # copy by value of what the callable holds).
    script = tmp_path / "forked.py"
    script.write_text(
        "import tensormp as mp\n"
        "G = {}\n"
        "def setup(a):\n"
        "    G['a'] = a\n"
        "def use_global(i):\n"
        "    G['a'][i] += 1\n"
        "    return 0\n"
        "if __name__ == '__main__':\n"
        "    class Acc:\n"
        "        def __init__(self):\n"
        "            self.buf = mp.zeros(4)\n"
        "        def fill(self, i):\n"
        "            self.buf[i] = 7\n"
        "            return i\n"
        "    A = mp.zeros(4)\n"
        "    def inc(i):\n"
        "        A[i] += 1\n"
        "        return i\n"
        "    ctx = mp.get_context('fork')\n"
        "    acc, shared = Acc(), mp.zeros(4)\n"
        "    with ctx.Pool(2, initializer=lambda: setup(shared)) as pool:\n"
        "        assert pool.map(acc.fill, range(4)) == [0, 1, 2, 3]\n"
        "        assert sorted(pool.imap_unordered(inc, range(4))) == [0, 1, 2, 3]\n"
        "        assert pool.map(use_global, range(4)) == [0] * 4\n"
        "    with mp.ProcessPoolExecutor(2, mp_context=ctx) as ex:\n"
        "        assert list(ex.map(inc, range(4))) == [0, 1, 2, 3]\n"
        "    assert acc.buf.tolist() == [7.0] * 4, acc.buf\n"
        "    assert A.tolist() == [2.0] * 4, A\n"
        "    assert shared.tolist() == [1.0] * 4, shared\n"
        "    print('ok')\n"
    )
    _prints_ok(script)
