#!/usr/bin/env python3
"""Transfer benchmark: tensormp against stdlib ``multiprocessing`` and ``torch.multiprocessing``.

Run ``python benchmarks/transfer.py`` (1.5 to 3 minutes on 2 cores, plus about 5 for ``bounded``
and ``fifo``), ``--quick`` (about 30 s, 2 minutes with those), ``--only big,pingpong`` to pick
workloads (``big``, ``pingpong``, ``small``, ``medium``, ``bounded``, ``fifo``),
``--no-torch`` to leave torch out, ``--strategy file_system`` for tensormp's named
segments, ``-v`` to see how long each pair of workers ran. Every
number is a median over repetitions measured in this run, warm-up excluded; every ratio compares
two numbers of this run, so the machine's speed cancels out (targets: DESIGN.md section 5).

Method
------
Every workload runs in freshly started worker processes (start method ``spawn`` for all three
libraries), one pair per library, so a library's first transfer is really the first of a
process. The parent only starts the workers, collects what they report and makes sure they are
gone (join with a timeout, then terminate, then kill; any of that is reported). Timing is done
inside one worker with ``time.perf_counter``, so one clock measures each interval. torch is
imported only in the torch workers (and in the parent when torch runs), never in the others.

Compared ways of moving an array (the "method" of a row):

* ``tensormp``: ``tensormp.get_context("spawn")`` queues; numpy arrays travel as handles to
  shared memory (an array that is not shared yet is copied once into a fresh segment).
* ``stdlib``: ``multiprocessing.get_context("spawn")`` queues; arrays are pickled by value.
* ``torch``: ``torch.multiprocessing.get_context("spawn")`` queues carrying
  ``torch.from_numpy(array)`` (default sharing strategy, ``file_descriptor``); the consumer
  reads the tensor through ``tensor.numpy()``.

Workloads
---------
``big``: 256 MiB steady state.
    The producer creates one 256 MiB float32 array of ones (not shared) once, outside any
    timing, and on each request puts it on a ``Queue`` and drops its own reference (what it sent
    is a fresh copy each step for all three methods: tensormp and torch copy it into new shared
    memory, the stdlib pickles it). The consumer times one step in lock step: send the request
    on a control pipe, ``get()``, touch the array by reading one float32 of every 4 KiB page
    (``a[::1024].sum()``, checked against the expected value: it maps and faults every page,
    which a real consumer pays for, while its arithmetic stays negligible), drop it. Lock step
    (no prefetching) is the conservative reading of a data-loader step. Step 0 of fresh
    processes is the *first transfer* (median over 3 fresh pairs of processes, 1 with
    ``--quick``); then warm-up steps; then timed steps.
    Baseline: one in-process ``numpy.copyto`` of 256 MiB between two already-faulted arrays,
    timed in the parent in this run. Targets: steady-state step <= 2x that copy; tensormp's
    first transfer no slower than torch's.
``pingpong``: already-shared arrays bounced between two processes.
    An int64 array from ``tensormp.empty`` (64 B, 4 KiB, 1 MiB, 64 MiB) goes back and forth through two
    ``SimpleQueue``; the echoing side increments element 0 (so one page is written and the
    sender checks that it sees the write: the memory really is shared). Timed: ``put`` + the
    ``get`` of the echo, median round trip. Baseline: the round trip of a 64-byte ``bytes``
    through two stdlib ``SimpleQueue``, measured first by the same two processes (so every
    library's ratio has its own baseline, taken under the same conditions). The two processes
    are pinned to two different CPUs (``--no-pin`` to let the scheduler place them): a round
    trip within one core and one across cores differ by 2-3x, and an unpinned pair lands on
    either, which would make the ratio a coin toss. torch bounces a
    ``share_memory_()`` tensor; the stdlib bounces an ordinary array pickled by value. Target:
    tensormp round trip <= 2x the baseline, at every size. faster-fifo, when installed, bounces
    a 4 KiB array pickled by value in the same harness: target tensormp <= 0.5x its round trip.
``small`` / ``medium``: 20,000 arrays of 4 KiB / 2,000 arrays of 64 KiB, one by one.
    The producer makes a new float32 array per item (filled with the item number, which the
    consumer checks), puts it on a ``Queue`` and drops it; the consumer times a round of items
    from its request to the last ``get()``; per item = round time / items (the two processes
    work in parallel, as a pipeline). Run twice in the same pair of processes: first the
    consumer drops each array, then it keeps every array it receives (warm-up and all rounds,
    until the end of that run). Open fds
    (``len(os.listdir('/proc/<pid>/fd'))``) of both processes are counted before and after each
    run (after: with every kept array still alive). Both workers run with a soft
    ``RLIMIT_NOFILE`` of ``--fd-limit`` (default 1024, the usual default) so that a per-array
    fd shows as the failure users meet; a failure is caught and reported, never a crash.
    torch runs fewer items (it is an order of magnitude slower per item): the output says how
    many. Targets: tensormp per item <= stdlib per item; fds flat (growth <= 1 per 100 items).
``bounded``: N producers -> M consumers through one ``Queue(maxsize=4096)`` (and unbounded).
    1, 2 and 4 producers to 1 consumer, 1 producer to 4 consumers; 64-byte ``bytes`` and fresh
    4 KiB float32 arrays; each item names its producer and number and the consumer checks it
    (whole, in its producer's order). All processes (spawn) start, pass a tenth more items as
    a warm-up, then begin together; per item = wall time from the start signal to the last
    consumer's last item / items. Methods in turns, 3 repetitions (1 with ``--quick``),
    medians. faster-fifo 1.5.2 (``pip install 'tensormp[bench]'``) runs as a third column
    when installed. Target: tensormp <= the stdlib's bounded queue per item, every pattern.
    Then a ``JoinableQueue`` (unbounded), 1 -> 4 and 4 -> 1, each item ``task_done()`` by its
    consumer and every producer in ``join()`` at the end, against the stdlib's (information).
``fifo``: the same harness, 1 producer -> 1 consumer, tensormp's ``Queue`` against faster-fifo
    (a C++ ring buffer in shared memory under a process-shared mutex), put/get one at a time
    and, where tensormp has them, ``put_many``/``get_many`` in batches of 100; and a tensormp
    ``Pipe``'s ``send``/``recv`` against faster-fifo's put/get. Target: tensormp <= faster-fifo
    per item.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import multiprocessing
import os
import queue
import resource
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import tensormp

KiB = 1 << 10
MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")
METHODS = ("tensormp", "stdlib", "torch")
WORKLOADS = ("big", "pingpong", "small", "medium", "bounded", "fifo")
GET_TIMEOUT = 30.0  # seconds a consumer waits for one item before giving up


# =============================================================================================
# Helpers shared by the parent and the workers
# =============================================================================================
def _context(method: str) -> Any:
    """The ``spawn`` context of ``method``'s library."""
    if method.startswith("tensormp"):
        return tensormp.get_context("spawn")
    if method == "torch":
        import torch.multiprocessing as tmp

        return tmp.get_context("spawn")
    return multiprocessing.get_context("spawn")


def _setup_worker(method: str, fd_limit: int = 0) -> None:
    """Per-worker set-up, outside any timing: import torch if needed, lower the fd limit."""
    if method == "torch":
        import torch  # noqa: F401  (registers torch's reducers before the first get)
        import torch.multiprocessing  # noqa: F401
    if fd_limit:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        new = fd_limit if hard == resource.RLIM_INFINITY else min(fd_limit, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))


def _wrap(method: str, a: np.ndarray) -> Any:
    """What ``method`` sends for the numpy array ``a``."""
    if method == "torch":
        import torch

        return torch.from_numpy(a)
    return a


def _unwrap(method: str, obj: Any) -> np.ndarray:
    """A numpy view of a received object (no copy)."""
    return obj.numpy() if method == "torch" else obj


def _count_fds() -> int | None:
    """Open fds of this process; None when even listing them fails (at the fd limit)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/fd"))
    except OSError:
        return None


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _guard(body: Callable[[], dict[str, Any]], result: Any) -> None:
    """Run a worker body and send what it returns, or the traceback, to the parent."""
    try:
        out = body()
    except BaseException as exc:  # report everything, the parent decides
        out = {"error": _error_text(exc), "traceback": traceback.format_exc()}
    result.send(out)
    result.close()


# =============================================================================================
# Workload "big": 256 MiB steady state
# =============================================================================================
def _big_producer(method: str, nbytes: int, q: Any, ctrl: Any, result: Any) -> None:
    def body() -> dict[str, Any]:
        _setup_worker(method)
        src = np.ones(nbytes // 4, dtype=np.float32)  # made once, pages already faulted
        ctrl.send("ready")
        while True:
            cmd = ctrl.recv()
            if cmd == "stop":
                return {}
            if cmd == "abort":
                q.cancel_join_thread()  # the consumer stopped reading: do not wait on the pipe
                return {}
            obj = _wrap(method, src)  # torch: a new, not yet shared tensor over src's memory
            q.put(obj)
            del obj  # the producer drops what it sent, as a data-loader worker does

    _guard(body, result)


def _big_consumer(
    method: str, nbytes: int, steps: int, q: Any, ctrl: Any, result: Any
) -> None:
    def body() -> dict[str, Any]:
        _setup_worker(method)
        expected = float(nbytes // PAGE)  # one float32 1.0 read per page
        stride = PAGE // 4
        times: list[float] = []
        if ctrl.recv() != "ready":
            raise RuntimeError("producer did not start")
        try:
            for _ in range(steps):
                t0 = time.perf_counter()
                ctrl.send("send")
                obj = q.get(timeout=GET_TIMEOUT)
                a = _unwrap(method, obj)
                touched = float(a[::stride].sum())
                del a, obj  # the consumer drops the array inside the step
                times.append(time.perf_counter() - t0)
                if touched != expected:
                    raise AssertionError(f"read {touched}, expected {expected}: corrupt data")
        except BaseException:
            ctrl.send("abort")
            raise
        ctrl.send("stop")
        return {"times": times}

    _guard(body, result)


# =============================================================================================
# Workload "pingpong": already-shared arrays (and the 64-byte bytes baseline)
# =============================================================================================
def _make_pingpong_payload(method: str, nbytes: int) -> Any:
    """An int64 array of ``nbytes`` whose memory crosses as a handle (stdlib: by value)."""
    n = nbytes // 8
    if method == "tensormp":
        a = tensormp.empty(n, dtype=np.int64)
    elif method == "torch":
        import torch

        a = torch.empty(n, dtype=torch.int64).share_memory_()
    else:
        a = np.empty(n, dtype=np.int64)  # stdlib: an ordinary array, pickled by value
    _unwrap(method, a)[0] = 0
    return a


def _bounce(
    q_out: Any, q_in: Any, obj: Any, check: Callable[[Any, int], None], max_reps: int,
    budget_s: float,
) -> list[float]:
    """Round trips of ``obj`` (put, then get the echo); returns the timed ones.

    Warm-up: ``max_reps / 20`` round trips but no more than a quarter of the budget (at least
    one). Then up to ``max_reps`` timed round trips, or fewer once ``budget_s`` has passed (at
    least 5).
    """
    warmup, warm_end = max(2, max_reps // 20), time.perf_counter() + budget_s / 4
    times: list[float] = []
    count, warming, deadline = 0, True, 0.0
    while True:
        t0 = time.perf_counter()
        q_out.put(obj)
        obj = q_in.get()
        t1 = time.perf_counter()
        count += 1
        check(obj, count)
        if warming:  # this round trip was warm-up; decide whether the next one is
            warming = count < warmup and t1 < warm_end
            deadline = t1 + budget_s
            continue
        times.append(t1 - t0)
        if len(times) >= max_reps or (len(times) >= 5 and t1 > deadline):
            return times


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def _pinger(
    method: str, sizes: list[int], max_reps: int, budget_s: float, cpu: int | None,
    base_out: Any, base_in: Any, q_out: Any, q_in: Any, result: Any,
) -> None:
    """Times round trips: first the 64-byte baseline on the stdlib queues, then each size."""

    def body() -> dict[str, Any]:
        _setup_worker(method)
        _pin(cpu)

        def no_check(obj: Any, count: int) -> None:
            pass

        def check(obj: Any, count: int) -> None:
            seen = int(_unwrap(method, obj)[0])
            if seen != count:
                raise AssertionError(f"element 0 is {seen} after {count} round trips: the "
                                     "echo's write was lost")

        out: dict[str, Any] = {"baseline": _bounce(base_out, base_in, b"x" * 64, no_check,
                                                   max_reps, budget_s)}
        base_out.put(None)
        for nbytes in sizes:
            obj = _make_pingpong_payload(method, nbytes)
            out[str(nbytes)] = _bounce(q_out, q_in, obj, check, max_reps, budget_s)
            del obj
        q_out.put(None)
        return {"times": out}

    _guard(body, result)


def _ponger(
    method: str, cpu: int | None, base_in: Any, base_out: Any, q_in: Any, q_out: Any,
    result: Any,
) -> None:
    """Echoes the baseline's bytes, then every array (incrementing element 0: a one-page write)."""

    def body() -> dict[str, Any]:
        _setup_worker(method)
        _pin(cpu)
        while (obj := base_in.get()) is not None:
            base_out.put(obj)
        while (obj := q_in.get()) is not None:
            _unwrap(method, obj)[0] += 1
            q_out.put(obj)
            del obj
        return {}

    _guard(body, result)


# =============================================================================================
# Workloads "small" and "medium": many arrays one by one, dropped then kept
# =============================================================================================
def _stream_producer(
    method: str, nbytes: int, fd_limit: int, q: Any, ctrl: Any, result: Any
) -> None:
    def body() -> dict[str, Any]:
        _setup_worker(method, fd_limit)
        elems = nbytes // 4
        fds: dict[str, Any] = {}
        while True:
            cmd = ctrl.recv()
            kind = cmd[0]
            if kind == "count":  # ("count", label): record the fds now
                fds[cmd[1]] = _count_fds()
                ctrl.send("counted")
            elif kind == "send":  # ("send", first item number, number of items)
                for i in range(cmd[1], cmd[1] + cmd[2]):
                    a = np.full(elems, i, dtype=np.float32)  # a new array per item
                    q.put(_wrap(method, a))
                    del a
            elif kind == "abort":
                q.cancel_join_thread()  # the consumer stopped reading: do not wait on the pipe
                return {"fds": fds}
            else:  # "stop"
                return {"fds": fds}

    _guard(body, result)


def _stream_consumer(
    method: str, nbytes: int, n: int, rounds: int, warmup: int, fd_limit: int,
    q: Any, ctrl: Any, result: Any,
) -> None:
    def body() -> dict[str, Any]:
        _setup_worker(method, fd_limit)
        report: dict[str, Any] = {"fd_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}
        next_item = 0

        def count_both(label: str, mine: dict[str, Any]) -> None:
            ctrl.send(("count", label))
            if ctrl.recv() != "counted":
                raise RuntimeError("producer did not answer")
            mine[label] = _count_fds()

        def receive(count: int, kept: list[Any] | None, state: dict[str, Any]) -> None:
            nonlocal next_item
            first, next_item = next_item, next_item + count  # item numbers are never reused
            ctrl.send(("send", first, count))
            for i in range(first, first + count):
                obj = q.get(timeout=GET_TIMEOUT)
                value = _unwrap(method, obj)[0]
                if value != i:
                    raise AssertionError(f"item {i} holds {value}: lost or reordered")
                if kept is not None:
                    kept.append(obj)
                del obj
                state["received"] += 1

        for mode in ("drop", "keep"):
            kept: list[Any] | None = [] if mode == "keep" else None
            state: dict[str, Any] = {"received": 0, "times": [], "fds": {}}
            report[mode] = state
            try:
                count_both(f"{mode}:before", state["fds"])
                receive(warmup, kept, state)
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    receive(n, kept, state)
                    state["times"].append((time.perf_counter() - t0) / n)
                gc.collect()
                count_both(f"{mode}:after", state["fds"])
            except BaseException as exc:
                state["error"] = _error_text(exc)
                state["fds"][f"{mode}:at_error"] = _count_fds()
                kept = None  # give the fds back, then take what is still queued, so that
                gc.collect()  # the producer's feeder can flush and the producer exit cleanly
                ctrl.send(("stop",) if _drain(q) else ("abort",))
                return report
            state["kept"] = len(kept) if kept is not None else 0
            kept = None
            gc.collect()
        ctrl.send(("stop",))
        return report

    _guard(body, result)


def _drain(q: Any, quiet_s: float = 0.5, limit_s: float = 10.0) -> bool:
    """Take and drop what is left in ``q`` (the producer has put all it was asked for).

    Returns True once ``q`` stayed empty for ``quiet_s`` seconds, False when that did not
    happen within ``limit_s`` seconds. ``get(timeout=...)`` bounds only the wait for data to
    arrive, not a read that blocks inside a corrupted message, so a timer signal bounds the
    whole drain.
    """

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"draining the queue took more than {limit_s} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        while True:
            try:
                q.get(timeout=quiet_s)
            except queue.Empty:
                return True
            except TimeoutError:
                return False
            except Exception:  # an item that cannot be rebuilt is still taken off the queue
                continue
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# =============================================================================================
# Workloads "bounded" and "fifo": many small items, several producers or consumers
# =============================================================================================
def _cpu_s() -> float:
    """CPU seconds (user + system) this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _PipeFlow:
    """A one-way tensormp ``Pipe`` with the queue methods the flow workers call (``put`` is
    ``send``, ``get`` is ``recv``): 1 producer -> 1 consumer only."""

    def __init__(self) -> None:
        self.reader, self.writer = tensormp.Pipe(duplex=False)

    def put(self, obj: Any) -> None:
        self.writer.send(obj)

    def get(self, timeout: float | None = None) -> Any:  # the parent's deadline bounds a hang
        return self.reader.recv()

    def close(self) -> None:
        self.writer.close()

    def join_thread(self) -> None:
        pass


def _flow_queue(method: str, maxsize: int) -> Any:
    """A queue of ``method`` holding at most ``maxsize`` items (0: unbounded); for
    ``tensormp Pipe``, a pipe (:class:`_PipeFlow`)."""
    if method == "faster-fifo":
        import faster_fifo

        return faster_fifo.Queue(max_size_bytes=64 * MiB, maxsize=maxsize or 10**9)
    if method == "tensormp Pipe":
        return _PipeFlow()
    if method.endswith(" JoinableQueue"):  # consumers call task_done(), producers join()
        return _context(method).JoinableQueue(maxsize)
    return _context(method).Queue(maxsize)


def _flow_item(payload: str, tag: int, i: int) -> Any:
    """Item ``i`` of producer ``tag``: 64 B of bytes, or a fresh 4 KiB float32 array."""
    if payload == "64 B":
        return bytes([tag]) + i.to_bytes(8, "little") + b"x" * 55
    a = np.full(KiB, i, dtype=np.float32)
    a[0] = tag
    return a


def _flow_check(payload: str, item: Any, last: dict[int, int]) -> None:
    """Check one item: whole, and after the previous one of its producer."""
    if payload == "64 B":
        tag, i = item[0], int.from_bytes(item[1:9], "little")
        ok = len(item) == 64
    else:
        tag, i = int(item[0]), int(item[1])
        ok = item.shape == (KiB,) and item[-1] == i
    if not ok or i <= last.get(tag, -1):
        raise AssertionError(f"item {i} of producer {tag} is corrupt or out of order")
    last[tag] = i


def _flow_producer(method: str, payload: str, n: int, warm: int, batch: int, tag: int, q: Any,
                   ready: Any, go: Any, result: Any) -> None:
    def body() -> dict[str, Any]:
        _setup_worker(method)
        timeout = {"timeout": GET_TIMEOUT} if method == "faster-fifo" else {}
        for i in range(warm):  # warm-up (caches, allocator), taken before the start signal
            q.put(_flow_item(payload, tag, i), **timeout)
        ready.release()
        go.wait()
        cpu = _cpu_s()
        if batch > 1:
            for first in range(warm, warm + n, batch):
                q.put_many([_flow_item(payload, tag, i)
                            for i in range(first, min(warm + n, first + batch))], **timeout)
        else:
            for i in range(warm, warm + n):
                q.put(_flow_item(payload, tag, i), **timeout)
        if method.endswith(" JoinableQueue"):
            q.join()  # every item put by anyone is done
        if method != "faster-fifo":
            q.close()
            q.join_thread()
        return {"cpu": _cpu_s() - cpu}

    _guard(body, result)


def _flow_consumer(method: str, payload: str, n: int, warm: int, batch: int, q: Any, ready: Any,
                   go: Any, result: Any) -> None:
    def body() -> dict[str, Any]:
        _setup_worker(method)
        last: dict[int, int] = {}
        done = q.task_done if method.endswith(" JoinableQueue") else None
        for _ in range(warm):  # this consumer's share of the warm-up items
            _flow_check(payload, q.get(timeout=GET_TIMEOUT), last)
            if done:
                done()
        ready.release()
        go.wait()
        cpu = _cpu_s()
        got = 0
        if batch > 1:
            while got < n:
                for item in q.get_many(timeout=GET_TIMEOUT, max_messages_to_get=min(batch, n - got)):
                    _flow_check(payload, item, last)
                    got += 1
        else:
            while got < n:
                _flow_check(payload, q.get(timeout=GET_TIMEOUT), last)
                if done:
                    done()
                got += 1
        return {"end": time.perf_counter(), "cpu": _cpu_s() - cpu}

    _guard(body, result)


# =============================================================================================
# The parent: start workers, collect results, clean up
# =============================================================================================
@dataclass
class Trial:
    """What one pair of workers reported, and how they ended."""

    results: list[dict[str, Any]]
    cleanup: list[str] = field(default_factory=list)  # exits that were not clean, in words

    @property
    def error(self) -> str | None:
        errs = [r["error"] for r in self.results if "error" in r]
        return "; ".join(errs) if errs else None



def _collect_results(
    procs: list[Any], readers: list[Any], deadline: float, timeout: float
) -> list[dict[str, Any]]:
    """Each worker's result dict from its pipe by ``deadline`` (monotonic), or ``{"error": ...}``
    saying why there is none."""
    results: list[dict[str, Any]] = []
    for proc, reader in zip(procs, readers):
        try:
            if reader.poll(max(0.0, deadline - time.monotonic())):
                results.append(reader.recv())
            else:
                results.append({"error": f"{proc.name}: no result within {timeout:.0f} s"})
        except (EOFError, OSError):
            results.append({"error": f"{proc.name}: exited ({proc.exitcode}) without a result"})
        reader.close()
    return results

def _run_trial(method: str, specs: list[tuple[Callable[..., None], tuple[Any, ...]]],
               timeout: float) -> Trial:
    """Start one ``spawn`` process per ``(target, args)``, collect each one's result dict.

    Each worker gets a one-way result pipe as its last argument. Every worker is joined with
    a timeout, then terminated, then killed; anything past a clean exit is recorded.
    """
    ctx = _context(method)
    procs, readers = [], []
    for target, args in specs:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, writer), daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)
    deadline = time.monotonic() + timeout
    results = _collect_results(procs, readers, deadline, timeout)
    cleanup = []
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
            cleanup.append(f"{method} pid {proc.pid} had to be terminated")
            if proc.is_alive():
                proc.kill()
                proc.join(5)
                cleanup.append(f"{method} pid {proc.pid} had to be killed")
        elif proc.exitcode != 0:
            cleanup.append(f"{method} pid {proc.pid} exited with code {proc.exitcode}")
    return Trial(results, cleanup)


def _run_flow(method: str, producers: int, consumers: int, maxsize: int, payload: str, n: int,
              batch: int, timeout: float) -> tuple[float | None, float, list[str], str | None]:
    """``producers`` -> ``consumers`` processes (spawn) through one queue of ``method``; every
    worker starts and passes a tenth of ``n`` items more as a warm-up, then all begin at once.
    Returns (seconds from the start signal to the last consumer's last item, CPU seconds of all
    workers meanwhile, clean-up notes, error)."""
    std = multiprocessing.get_context("spawn")
    ready, go = std.Semaphore(0), std.Event()
    q = _flow_queue(method, maxsize)
    per_producer, warm = n // producers, max(1, n // 10 // producers)
    total = per_producer * producers

    def split(count: int) -> list[int]:
        return [count // consumers + (k < count % consumers) for k in range(consumers)]
    ctx = std if method == "faster-fifo" else _context(method)
    procs, readers = [], []
    specs = [(_flow_producer, (method, payload, per_producer, warm, batch, tag, q))
             for tag in range(producers)]
    specs += [(_flow_consumer, (method, payload, share, w, batch, q))
              for share, w in zip(split(total), split(warm * producers))]
    for target, args in specs:
        reader, writer = std.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, ready, go, writer), daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)
    deadline = time.monotonic() + timeout
    error = None
    for _ in procs:
        if not ready.acquire(timeout=max(0.0, deadline - time.monotonic())):
            error = "the workers did not start in time"
            break
    start = time.perf_counter()
    go.set()
    results = _collect_results(procs, readers, deadline, timeout)
    cleanup = []
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
            cleanup.append(f"{method} pid {proc.pid} had to be killed")
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        error = "; ".join(errors)
    ends = [r["end"] for r in results if "end" in r]
    if error or len(ends) != consumers:
        return None, 0.0, cleanup, error or "missing results"
    return max(ends) - start, sum(r.get("cpu", 0.0) for r in results), cleanup, None


def _fmt_t(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass
class Row:
    """One line of the summary table."""

    workload: str
    cells: dict[str, str]  # method -> text
    ratio: float | None
    target: str
    limit: float | None  # PASS when ratio <= limit; None: a reference row, no target
    failed: bool = False  # tensormp itself failed this workload

    @property
    def verdict(self) -> str:
        if self.failed:
            return "FAIL"
        if self.ratio is None:
            return "n/a"
        if self.limit is None:
            return "info"
        return "PASS" if self.ratio <= self.limit else "MISS"


class Bench:
    """Runs the selected workloads one after the other and collects the summary rows."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.methods = [m for m in METHODS if m != "torch" or self.have_torch()]
        self.rows: list[Row] = []
        self.cleanup: list[str] = []

    def have_torch(self) -> bool:
        return not self.args.no_torch and importlib.util.find_spec("torch") is not None

    def trial(self, method: str, specs: list[tuple[Callable[..., None], tuple[Any, ...]]],
              timeout: float) -> Trial:
        t0 = time.perf_counter()
        t = _run_trial(method, specs, timeout)
        if self.args.verbose:
            wall = time.perf_counter() - t0
            print(f"    [{method} {specs[0][0].__name__}: the workers ran {wall:.1f} s, start-up "
                  "included]", flush=True)
        self.cleanup += t.cleanup
        for r in t.results:
            if "traceback" in r:
                print(f"    [{method}] worker failed:\n" + r["traceback"].rstrip(), flush=True)
        return t

    # -- big -----------------------------------------------------------------------------------
    def big(self) -> None:
        nbytes = 256 * MiB
        warm, timed = (1, 3) if self.quick else (2, 7)
        fresh = 1 if self.quick else 3  # pairs of fresh processes whose first step is timed
        print(f"\n== 256 MiB steady state: producer -> consumer, lock step, "
              f"{warm} warm-up + {timed} timed steps after the first; first transfer: median "
              f"over {fresh} fresh pair(s) of processes ==\n"
              "  targets: tensormp steady step <= 2x one numpy.copyto of 256 MiB; tensormp's "
              "first transfer <= torch's", flush=True)
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.zeros_like(src)  # faulted lazily by the first copies, which are not timed
        copies = []
        for i in range(12 if not self.quick else 6):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            if i >= 2:
                copies.append(time.perf_counter() - t0)
        del src, dst
        memcpy = statistics.median(copies)
        print(f"  in-process numpy.copyto of 256 MiB: {_fmt_t(memcpy)} "
              f"({nbytes / memcpy / 1e9:.1f} GB/s), median of {len(copies)}", flush=True)
        steady: dict[str, float | None] = {}
        first: dict[str, float | None] = {}
        failed = set()
        for method in self.methods:
            firsts: list[float] = []
            times: list[float] = []
            errors = []
            for pair in range(fresh):  # the first pair runs every step, the others only one
                ctx = _context(method)
                q = ctx.Queue()
                a, b = ctx.Pipe()
                steps = 1 + warm + timed if pair == 0 else 1
                t = self.trial(method, [
                    (_big_producer, (method, nbytes, q, a)),
                    (_big_consumer, (method, nbytes, steps, q, b)),
                ], timeout=120)
                got = t.results[1].get("times", [])
                firsts += got[:1]
                if pair == 0:
                    times = got
                if t.error:
                    errors.append(t.error)
            first[method] = _median(firsts)
            steady[method] = _median(times[1 + warm:])
            if errors:
                print(f"  {method:9s} FAILED: {'; '.join(errors)}", flush=True)
                failed.add(method)
            if steady[method] is not None:
                print(f"  {method:9s} first {_fmt_t(first[method]):>10s}   steady median "
                      f"{_fmt_t(steady[method]):>10s} = {steady[method] / memcpy:5.1f}x copyto\n"
                      f"            first steps of fresh pairs: "
                      f"{', '.join(_fmt_t(x) for x in firsts)}; steps of the first pair: "
                      f"{', '.join(_fmt_t(x) for x in times)}", flush=True)
        tm, tf, torch_first = steady.get("tensormp"), first.get("tensormp"), first.get("torch")
        row = Row("256 MiB steady step", {m: _fmt_t(steady.get(m)) for m in self.methods},
                  tm / memcpy if tm else None, "<= 2x copyto", 2.0, "tensormp" in failed)
        row.cells["ref"] = f"copyto {_fmt_t(memcpy)}"
        self.rows.append(row)
        self.rows.append(Row(
            "256 MiB first transfer", {m: _fmt_t(first.get(m)) for m in self.methods},
            tf / torch_first if tf and torch_first else None, "<= 1x torch", 1.0,
            "tensormp" in failed))

    # -- pingpong ------------------------------------------------------------------------------
    def pingpong(self) -> None:
        sizes = [64, 4 * KiB, 1 * MiB, 64 * MiB]
        max_reps, budget = (400, 0.2) if self.quick else (2000, 1.0)
        cpus = sorted(os.sched_getaffinity(0))
        pin = (cpus[0], cpus[1]) if len(cpus) >= 2 and not self.args.no_pin else (None, None)
        where = (f"pinned to CPUs {pin[0]} and {pin[1]}" if pin[0] is not None
                 else "not pinned")
        print(f"\n== ping-pong of already-shared arrays: SimpleQueue round trip, median of up "
              f"to {max_reps} or {budget:.2f} s per size; the two processes are {where} ==",
              flush=True)
        print("  baseline: 64-byte bytes through two multiprocessing.SimpleQueue, measured first "
              "by the same pair of processes\n  target: tensormp round trip <= 2x its pair's "
              "baseline, at every size", flush=True)
        notes = {"tensormp": "tensormp.empty", "stdlib": "np.empty, by value",
                 "torch": "share_memory_() tensor"}
        res: dict[str, dict[int, float | None]] = {}
        base: dict[str, float | None] = {}
        failed = set()
        std = multiprocessing.get_context("spawn")
        for m in self.methods:
            ctx = _context(m)
            b_ab, b_ba = std.SimpleQueue(), std.SimpleQueue()
            q_ab, q_ba = ctx.SimpleQueue(), ctx.SimpleQueue()
            t = self.trial(m, [
                (_pinger, (m, sizes, max_reps, budget, pin[0], b_ab, b_ba, q_ab, q_ba)),
                (_ponger, (m, pin[1], b_ab, b_ba, q_ab, q_ba)),
            ], timeout=120)
            if t.error:
                print(f"  {m:9s} FAILED: {t.error}", flush=True)
                failed.add(m)
            times = t.results[0].get("times", {})
            base[m] = _median(times.get("baseline", []))
            res[m] = {s: _median(times.get(str(s), [])) for s in sizes}
            b = base[m]
            cells = "  ".join(
                f"{self._size(s)}: {_fmt_t(res[m][s]):>9s} ({res[m][s] / b:6.1f}x)"
                if res[m][s] and b else f"{self._size(s)}: -" for s in sizes)
            print(f"  {m:9s} baseline {_fmt_t(b):>8s}  {cells}  [{notes[m]}]", flush=True)
        b = base.get("tensormp")
        for s in sizes:
            tm = res.get("tensormp", {}).get(s)
            row = Row(f"ping-pong {self._size(s)}",
                      {m: _fmt_t(res[m][s]) for m in self.methods},
                      tm / b if tm and b else None, "<= 2x 64B RT", 2.0, "tensormp" in failed)
            row.cells["ref"] = f"64B RT {_fmt_t(b)}"
            self.rows.append(row)
        if self.have_fifo():  # faster-fifo bounces a 4 KiB array pickled by value (DESIGN.md 5)
            f_ab, f_ba = _flow_queue("faster-fifo", 0), _flow_queue("faster-fifo", 0)
            b_ab, b_ba = std.SimpleQueue(), std.SimpleQueue()
            t = self.trial("faster-fifo", [
                (_pinger, ("faster-fifo", [4 * KiB], max_reps, budget, pin[0], b_ab, b_ba, f_ab,
                           f_ba)),
                (_ponger, ("faster-fifo", pin[1], b_ab, b_ba, f_ab, f_ba)),
            ], timeout=120)
            ff = _median(t.results[0].get("times", {}).get(str(4 * KiB), []))
            tm = res.get("tensormp", {}).get(4 * KiB)
            print(f"  {'faster-fifo':11s} 4 KiB: {_fmt_t(ff)} [np.empty, pickled]", flush=True)
            self.rows.append(Row("ping-pong 4 KiB / faster-fifo", {"tensormp": _fmt_t(tm),
                                 "ref": f"faster-fifo {_fmt_t(ff)}"}, tm / ff if tm and ff else None,
                                 "<= 0.5x faster-fifo", 0.5, "tensormp" in failed))

    @staticmethod
    def _size(n: int) -> str:
        return f"{n // MiB} MiB" if n >= MiB else (f"{n // KiB} KiB" if n >= KiB else f"{n} B")

    # -- small / medium ------------------------------------------------------------------------
    def stream(self, nbytes: int, n: int, rounds: int, torch_n: int) -> None:
        fd_limit = self.args.fd_limit
        label = f"{n:,} x {self._size(nbytes)}"
        print(f"\n== {label} one by one through a Queue ({rounds} timed rounds of {n:,}; "
              f"workers' soft fd limit: {fd_limit or 'inherited'}) ==\n"
              "  targets: tensormp per item <= stdlib per item; open fds flat (growth <= 1 per "
              "100 kept items)", flush=True)
        if "torch" in self.methods and torch_n < n:
            print(f"  note: torch runs {torch_n:,} items per round (it is much slower per item)",
                  flush=True)
        per_item: dict[str, dict[str, float | None]] = {"drop": {}, "keep": {}}
        failed: dict[str, set[str]] = {"drop": set(), "keep": set()}
        fd_growth: dict[str, tuple[int | None, int | None, int]] = {}
        for method in self.methods:
            items = torch_n if method == "torch" else n
            warmup = max(20, items // 20)
            ctx = _context(method)
            q = ctx.Queue()
            a, b = ctx.Pipe()
            t = self.trial(method, [
                (_stream_producer, (method, nbytes, fd_limit, q, a)),
                (_stream_consumer, (method, nbytes, items, rounds, warmup, fd_limit, q, b)),
            ], timeout=90)
            if t.error:
                print(f"  {method:9s} FAILED: {t.error}", flush=True)
                failed["drop"].add(method)
                failed["keep"].add(method)
                continue
            prod, cons = t.results
            for mode in ("drop", "keep"):
                st = cons.get(mode)
                if st is None:
                    print(f"  {method:9s} {mode}: not run (an earlier run failed)", flush=True)
                    failed[mode].add(method)
                    continue
                # fd counts by "<mode>:before" / "<mode>:after" / "<mode>:at_error"
                pf = {k.split(":")[1]: v for k, v in prod.get("fds", {}).items()
                      if k.startswith(mode + ":")}
                cf = {k.split(":")[1]: v for k, v in st["fds"].items()}
                med = _median(st["times"])
                per_item[mode][method] = med
                text = (f"  {method:9s} {mode}: per item {_fmt_t(med):>9s}"
                        f"  ({', '.join(_fmt_t(x) for x in st['times'])})"
                        f"\n            fds: consumer {_n(cf.get('before'))} -> "
                        f"{_n(cf.get('after', cf.get('at_error')))}, producer "
                        f"{_n(pf.get('before'))} -> {_n(pf.get('after'))}, "
                        f"arrays kept at the end: "
                        f"{st.get('kept', st['received'] if mode == 'keep' else 0)}")
                if mode == "keep" and "error" not in st:
                    fd_growth[method] = (
                        _delta(cf.get("before"), cf.get("after")),
                        _delta(pf.get("before"), pf.get("after")), st["kept"])
                if "error" in st:
                    text += (f"\n            FAILED after {st['received']} items of this run "
                             f"(fd limit {cons.get('fd_limit')}): {st['error']}")
                    per_item[mode][method] = None
                    failed[mode].add(method)
                print(text, flush=True)
        for mode in ("drop", "keep"):
            tm, sd = per_item[mode].get("tensormp"), per_item[mode].get("stdlib")
            cells = {m: "FAILED" if m in failed[mode] else _fmt_t(per_item[mode].get(m))
                     for m in self.methods}
            self.rows.append(Row(f"{label} {mode}, per item", cells,
                                 tm / sd if tm and sd else None, "<= 1x stdlib", 1.0,
                                 failed="tensormp" in failed[mode]))
        cells = {}
        for m in self.methods:
            g = fd_growth.get(m)
            cells[m] = f"+{g[0]}/+{g[1]}" if g else "FAILED"
        g = fd_growth.get("tensormp")
        worst = max(g[0] or 0, g[1] or 0) if g else None
        self.rows.append(Row(f"{label} keep, fds cons/prod", cells,
                             worst / g[2] if g and g[2] else None, "<= 0.01 per item", 0.01,
                             failed="tensormp" in failed["keep"]))

    # -- bounded / fifo ------------------------------------------------------------------------
    def have_fifo(self) -> bool:
        return importlib.util.find_spec("faster_fifo") is not None

    def _flows(self, title: str, cases: list[tuple[str, int, int, int, str, int]],
               methods: list[str], reference: str, targets: dict[str, float | None],
               subject: str = "tensormp") -> None:
        """Run each case (label, producers, consumers, maxsize, payload, batch) for every method,
        alternating the methods' order repetition by repetition; one row per case (the ratio:
        ``subject`` against ``reference``)."""
        reps = 1 if self.quick else 3
        print(f"\n== {title}: items/s (CPU of all workers per item), median of {reps} "
              "alternating repetition(s); fresh spawn processes each time, every item checked ==",
              flush=True)
        for label, producers, consumers, maxsize, payload, batch in cases:
            n = (5_000 if self.quick else 20_000) if payload == "64 B" else (
                3_000 if self.quick else 10_000)
            times: dict[str, list[float]] = {m: [] for m in methods}
            cpus: dict[str, list[float]] = {m: [] for m in methods}
            failed = set()
            for rep in range(reps):
                order = methods[rep % len(methods):] + methods[:rep % len(methods)]
                for m in order:
                    took, cpu, cleanup, error = _run_flow(m, producers, consumers, maxsize,
                                                          payload, n, batch, timeout=120)
                    self.cleanup += cleanup
                    if error:
                        print(f"  {label} {m} FAILED: {error}", flush=True)
                        failed.add(m)
                    elif took:
                        times[m].append(took / (n // producers * producers))
                        cpus[m].append(cpu / (n // producers * producers))
            per = {m: _median(times[m]) for m in methods}
            cpu_per = {m: _median(cpus[m]) for m in methods}
            text = "  ".join(f"{m} {1 / per[m]:>8,.0f}/s ({cpu_per[m] * 1e6:.1f} us CPU)"
                             if per[m] and cpu_per[m] else f"{m} -" for m in methods)
            print(f"  {label:38s} {text}", flush=True)
            tm, ref = per.get(subject), per.get(reference)
            target = targets.get(label.split(",")[0])
            cells = {m: ("FAILED" if m in failed else _fmt_t(per[m])) for m in methods}
            cells["tensormp"] = cells[subject]
            if reference.startswith("stdlib"):
                cells["stdlib"] = cells[reference]
            self.rows.append(Row(label, cells, tm / ref if tm and ref else None,
                                 f"<= 1x {reference}" if target else "(reference)", target,
                                 subject in failed))

    def bounded(self) -> None:
        methods = ["tensormp", "stdlib"] + (["faster-fifo"] if self.have_fifo() else [])
        cases = []
        for payload in ("64 B", "4 KiB"):
            for p, c, maxsize in ((1, 1, 4096), (2, 1, 4096), (4, 1, 4096), (1, 4, 4096),
                                  (1, 1, 0), (4, 1, 0)):
                kind = f"maxsize {maxsize}" if maxsize else "unbounded"
                cases.append((f"{p}p->{c}c {kind}, {payload}", p, c, maxsize, payload, 1))
        self._flows("producers -> consumers through one Queue (per item: wall time / items)",
                    cases, methods, "stdlib",
                    {f"{p}p->{c}c maxsize 4096": 1.0 for p, c in ((1, 1), (2, 1), (4, 1), (1, 4))})
        # JoinableQueue: consumers call task_done() after each item, producers join() at the end.
        self._flows("the same through one JoinableQueue (unbounded; task_done per item)",
                    [(f"{p}p->{c}c JoinableQueue, {payload}", p, c, 0, payload, 1)
                     for payload in ("64 B", "4 KiB") for p, c in ((1, 4), (4, 1))],
                    ["tensormp JoinableQueue", "stdlib JoinableQueue"], "stdlib JoinableQueue",
                    {}, subject="tensormp JoinableQueue")

    def fifo(self) -> None:
        if not self.have_fifo():
            print("\n== faster-fifo: not installed (pip install 'tensormp[bench]'): skipped ==")
            return
        from tensormp import queues

        batch_api = hasattr(queues.Queue, "put_many")
        cases = []
        for payload in ("64 B", "4 KiB"):
            cases.append((f"1p->1c put/get, {payload}", 1, 1, 0, payload, 1))
            if batch_api:
                cases.append((f"1p->1c put_many/get_many, {payload}", 1, 1, 0, payload, 100))
        self._flows("small messages against faster-fifo 1.5.2 (unbounded; batches of 100)",
                    cases, ["tensormp", "faster-fifo"], "faster-fifo",
                    {"1p->1c put/get": 1.0, "1p->1c put_many/get_many": 1.0})
        # A tensormp Pipe's send/recv against faster-fifo's put/get (it has no pipe).
        self._flows("a tensormp Pipe (send/recv) against faster-fifo's Queue (put/get)",
                    [(f"1p->1c Pipe send/recv, {payload}", 1, 1, 0, payload, 1)
                     for payload in ("64 B", "4 KiB")],
                    ["tensormp Pipe", "faster-fifo"], "faster-fifo",
                    {"1p->1c Pipe send/recv": 1.0}, subject="tensormp Pipe")
        if not batch_api:
            print("  (tensormp has no put_many/get_many: batch rows skipped)")

    # -- summary -------------------------------------------------------------------------------
    def summary(self) -> None:
        print("\n== summary (ratio = tensormp against the target's reference, same run) ==")
        head = f"{'workload':38s} {'tensormp':>10s} {'stdlib':>10s} {'torch':>10s} " \
               f"{'faster-fifo':>11s} {'ratio':>7s}  {'target':18s} result"
        print(head)
        print("-" * len(head))
        for r in self.rows:
            ratio = "-" if r.ratio is None else (
                f"{r.ratio:.4f}" if r.ratio < 0.1 else f"{r.ratio:.2f}x")
            print(f"{r.workload:38s} {r.cells.get('tensormp', '-'):>10s} "
                  f"{r.cells.get('stdlib', '-'):>10s} {r.cells.get('torch', '-'):>10s} "
                  f"{r.cells.get('faster-fifo', '-'):>11s} {ratio:>7s}  {r.target:18s} {r.verdict}"
                  + (f"   ({r.cells['ref']})" if "ref" in r.cells else ""))
        print("\ncells: medians per step / round trip / item; ping-pong stdlib column: an "
              "ordinary array pickled by value;\nfd rows: open-fd growth of consumer/producer "
              "over the keep run (ratio = growth per kept item).")


def _n(count: int | None) -> str:
    """An fd count for printing; None means it could not be listed or was not taken."""
    return "-" if count is None else str(count)


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def _leftover_children() -> list[str]:
    """Processes whose parent is this one, except the stdlib's resource tracker."""
    me, out = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat.rsplit(b")", 1)[1].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if "resource_tracker" not in cmd:
            out.append(f"{pid}: {cmd[:100]}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (about 30 s)")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help=f"run only these workloads ({', '.join(WORKLOADS)}); repeatable "
                             "or comma-separated")
    parser.add_argument("--no-torch", action="store_true", help="leave torch out")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print the wall time of every pair of workers")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin the two ping-pong processes to two different CPUs")
    parser.add_argument("--strategy", default="file_descriptor",
                        choices=sorted(tensormp.get_all_sharing_strategies()),
                        help="tensormp's sharing strategy (inherited by its workers)")
    parser.add_argument("--fd-limit", type=int, default=1024,
                        help="soft RLIMIT_NOFILE of the small/medium workers (0: inherit)")
    args = parser.parse_args(argv)
    only = [w for item in args.only for w in item.split(",") if w]
    unknown = [w for w in only if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    selected = [w for w in WORKLOADS if not only or w in only]

    tensormp.set_sharing_strategy(args.strategy)
    bench = Bench(args)
    started = time.perf_counter()
    torch_note = ""
    if "torch" in bench.methods:
        import torch
        import torch.multiprocessing as tmp

        torch_note = f"torch {torch.__version__} (sharing strategy {tmp.get_sharing_strategy()})"
    elif args.no_torch:
        torch_note = "torch left out (--no-torch)"
    else:
        torch_note = "torch is not importable: its column is skipped"
    print(f"tensormp {tensormp.__version__}, numpy {np.__version__}, Python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs, {torch_note}; "
          f"start method spawn; tensormp strategy {args.strategy}; "
          f"{'quick' if args.quick else 'full'} run: {', '.join(selected)}; "
          f"load average before: {os.getloadavg()[0]:.2f}", flush=True)

    for w in selected:
        if w == "big":
            bench.big()
        elif w == "pingpong":
            bench.pingpong()
        elif w == "small":
            n = 4_000 if args.quick else 20_000
            bench.stream(4 * KiB, n, 2 if args.quick else 5, 400 if args.quick else 2_000)
        elif w == "medium":
            n = 800 if args.quick else 2_000
            bench.stream(64 * KiB, n, 2 if args.quick else 5, 400 if args.quick else n)
        elif w == "bounded":
            bench.bounded()
        elif w == "fifo":
            bench.fifo()
    bench.summary()

    left = _leftover_children()
    bench.cleanup += [f"left running: {x}" for x in left]
    if bench.cleanup:
        print("\nworker clean-up problems:\n  " + "\n  ".join(bench.cleanup))
    else:
        print("\nall workers exited cleanly (joined, exit code 0, no child left).")
    print(f"total time {time.perf_counter() - started:.0f} s; load average now "
          f"{os.getloadavg()[0]:.2f} (other work on the machine makes the numbers noisier)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
