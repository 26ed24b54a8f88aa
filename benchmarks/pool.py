"""Pools and process start-up: tensormp against the stdlib, concurrent.futures and loky.

Three groups of workloads, every contender with the spawn start method (``--start-method``)
and 2 workers (``--workers``), each pool or executor started and warmed up before timing:

``tiny``: per-task cost. ``inc(x) = x + 1`` on ints, so the work is nothing and what is measured
is the pool itself: ``apply_async`` x N then ``get()``; ``apply`` one after the other;
``imap`` and ``imap_unordered`` with ``chunksize=1``; ``map(inc, range(200_000))`` with the
default chunksize. Executors run the same through their API (``submit``, ``submit().result()``,
``map(chunksize=1)``, ``map`` with the Pool's chunksize); they have no ``imap_unordered``.
Contenders run in turns, trial by trial (the order rotates), so a burst of load from elsewhere
hits all of them; the ratio is the median of the per-trial ratios to the stdlib ``Pool``.
Target: tensormp.Pool <= 1x the stdlib Pool on each.

``arrays``: ``map(work, 64 float32 arrays of 4 MiB)``, ``work(a) = a + 1`` (results of the
same size), and ``map(colsum, 256 float32 arrays of 1 MiB)`` (small results). Arrays are
ordinary numpy arrays, not shared yet, as a program has them. Medians of ``--repeats`` maps.
Target: the stdlib Pool at least 5x slower than tensormp.Pool.

``startup``: ``tensormp.spawn(trivial, nprocs=2)`` against two stdlib spawn ``Process``es
started and joined, two tensormp ``Process``es against two stdlib ones, and one
``Process.start()`` + ``join()`` against the stdlib's. Each side
runs in its own interpreter whose main module imports only its library (a spawn child imports
the main module again), alternately. tensormp's modules are compiled to bytecode first, as
``pip install`` does (with ``PYTHONDONTWRITEBYTECODE`` set and a source checkout, every child
would compile them again; the stdlib's are compiled at installation). Target: <= 1.2x.

    python benchmarks/pool.py                     # everything, about 3 minutes on 2 cores
    python benchmarks/pool.py --quick             # fewer trials, about 1 minute
    python benchmarks/pool.py --only tiny,startup
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")

# The start-up drivers (this file run as ``python pool.py --driver std|tensormp ...``) import
# only their own library, and so do their spawn children (which import this module again):
# the other imports are in the functions that use them.
_DRIVER = len(sys.argv) > 2 and sys.argv[1] == "--driver"
if not _DRIVER or sys.argv[2] == "tensormp":
    sys.path.insert(0, SRC)
    import tensormp
if not _DRIVER:
    import argparse
    import statistics

    import numpy as np

N_ARRAYS = 64
ARRAY_BYTES = 4 << 20
N_COLSUM = 256
COLSUM_BYTES = 1 << 20
MAP_ITEMS = 200_000


def inc(x: int) -> int:
    return x + 1


def work(a: Any) -> Any:
    return a + np.float32(1)


def colsum(a: Any) -> float:
    return float(a.sum())


def trivial(*args: object) -> None:
    return None


# -- contenders ---------------------------------------------------------------------------------
class Contender:
    """One pool or executor, and how it runs each workload (None: it has no such call)."""

    def __init__(self, name: str, pool: Any, stop: Callable[[], None], kind: str,
                 short: str) -> None:
        self.name, self.pool, self.stop, self.kind, self.short = name, pool, stop, kind, short

    def run(self, workload: str, n: int) -> int | None:
        """Run ``workload`` with ``n`` tasks; the number of tasks timed, or None."""
        p = self.pool
        if self.kind == "pool":
            if workload == "apply_async":
                results = [p.apply_async(inc, (i,)) for i in range(n)]
                out = [r.get() for r in results]
            elif workload == "apply":
                n //= 5
                out = [p.apply(inc, (i,)) for i in range(n)]
            elif workload == "imap":
                out = list(p.imap(inc, range(n)))
            elif workload == "imap_unordered":
                out = sorted(p.imap_unordered(inc, range(n)))
            else:
                out = p.map(inc, range(MAP_ITEMS))
        else:
            if workload == "apply_async":
                futures = [p.submit(inc, i) for i in range(n)]
                out = [f.result() for f in futures]
            elif workload == "apply":
                n //= 5
                out = [p.submit(inc, i).result() for i in range(n)]
            elif workload == "imap":
                out = list(p.map(inc, range(n)))
            elif workload == "imap_unordered":
                return None
            else:
                chunk = -(-MAP_ITEMS // (4 * 2))  # the Pool's default for 2 workers
                out = list(p.map(inc, range(MAP_ITEMS), chunksize=chunk))
        if workload == "map":
            n = MAP_ITEMS
        if out[0] != 1 or out[-1] != n or len(out) != n:
            raise AssertionError(f"{self.name} {workload}: wrong results")
        return 1 if workload == "map" else n


def _contenders(method: str, workers: int, executors: bool) -> list[Contender]:
    import concurrent.futures

    out = [
        Contender("stdlib multiprocessing.Pool", multiprocessing.get_context(method).Pool(workers),
                  lambda: None, "pool", "stdlib Pool"),
        Contender("tensormp.Pool", tensormp.get_context(method).Pool(workers), lambda: None,
                  "pool", "tensormp.Pool"),
    ]
    for c in out:
        c.stop = c.pool.terminate
    if executors:
        cf = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(method)
        )
        out.append(Contender("concurrent.futures.ProcessPoolExecutor", cf, cf.shutdown, "ex",
                             "concurrent.futures"))
        tex = tensormp.ProcessPoolExecutor(workers, mp_context=tensormp.get_context(method))
        out.append(Contender("tensormp.ProcessPoolExecutor", tex, tex.shutdown, "ex",
                             "tensormp executor"))
        try:
            import loky
        except ImportError:
            pass
        else:
            lk = loky.ProcessPoolExecutor(workers)
            out.append(Contender(f"loky {loky.__version__} ProcessPoolExecutor", lk,
                                 lk.shutdown, "ex", f"loky {loky.__version__}"))
    return out


# -- tiny tasks ---------------------------------------------------------------------------------
TINY = ["apply_async", "apply", "imap", "imap_unordered", "map"]


def bench_tiny(args: Any, summary: list[tuple[str, str, float, str, bool]]) -> None:
    n = 1000 if args.quick else 2000
    trials = 5 if args.quick else 9
    contenders = _contenders(args.start_method, args.workers, not args.no_executors)
    try:
        for c in contenders:
            c.run("apply_async", 50)  # workers started, functions loaded
        print(f"\nTiny tasks: per-task time, median of {trials} trials in turns "
              f"({n} tasks; apply: {n // 5}; map: {MAP_ITEMS:,} items)")
        head = "".join(f"{c.short:>22s}" for c in contenders)
        print(f"  {'':16s}{head}")
        for workload in TINY:
            times: dict[str, list[float]] = {c.name: [] for c in contenders}
            ratios: dict[str, list[float]] = {c.name: [] for c in contenders}
            for c in contenders:
                c.run(workload, n // 4)
            for t in range(trials):
                order = contenders[t % len(contenders):] + contenders[: t % len(contenders)]
                for c in order:
                    t0 = time.perf_counter()
                    done = c.run(workload, n)
                    if done is not None:
                        times[c.name].append((time.perf_counter() - t0) / done)
                base = times[contenders[0].name][-1]
                for c in contenders:
                    if times[c.name]:
                        ratios[c.name].append(times[c.name][-1] / base)
            cells = []
            for c in contenders:
                if times[c.name]:
                    med = statistics.median(times[c.name])
                    unit = f"{med * 1e3:6.1f} ms" if workload == "map" else f"{med * 1e6:6.1f} us"
                    cells.append(f"{unit} {statistics.median(ratios[c.name]):5.2f}x")
                else:
                    cells.append("n/a")
            print(f"  {workload:16s}" + "".join(f"{cell:>22s}" for cell in cells))
            ours = statistics.median(ratios["tensormp.Pool"])
            what = "map (200k items)" if workload == "map" else f"{workload} (chunksize 1)" if \
                workload.startswith("imap") else workload
            summary.append((f"tiny: {what}", "tensormp.Pool / stdlib Pool", ours, "<= 1", ours <= 1))
    finally:
        for c in contenders:
            c.stop()
    print("  (per task, map: per map; x: the median of the ratios to the stdlib Pool's time in "
          "the same trial)")


# -- arrays -------------------------------------------------------------------------------------
def _check_work(results: list[Any], arrays: list[Any]) -> None:
    assert len(results) == len(arrays)
    for i in (0, len(arrays) // 2, len(arrays) - 1):
        r, a = results[i], arrays[i]
        assert r.shape == a.shape and r.dtype == a.dtype
        assert r[0] == a[0] + 1 and r[-1] == a[-1] + 1, f"wrong result for array {i}"


def _check_colsum(results: list[float], arrays: list[Any]) -> None:
    assert len(results) == len(arrays)
    for i in (0, len(arrays) - 1):
        assert abs(results[i] - float(arrays[i].sum())) <= 1e-3 * abs(results[i]) + 1e-3


def _map_runner(c: Contender, fn: Callable[[Any], Any], arrays: list[Any]) -> Callable[[], Any]:
    if c.kind == "pool":
        return lambda: c.pool.map(fn, arrays)
    return lambda: list(c.pool.map(fn, arrays))


def bench_arrays(args: Any, summary: list[tuple[str, str, float, str, bool]]) -> None:
    repeats = args.repeats or (3 if args.quick else 7)
    rng = np.random.default_rng(0)
    big = [rng.random(ARRAY_BYTES // 4, dtype=np.float32) for _ in range(N_ARRAYS)]
    small = [rng.random(COLSUM_BYTES // 4, dtype=np.float32) for _ in range(N_COLSUM)]
    loads = [
        (f"map(work, {N_ARRAYS} x {ARRAY_BYTES >> 20} MiB) -> arrays", work, big, _check_work),
        (f"map(colsum, {N_COLSUM} x {COLSUM_BYTES >> 20} MiB) -> floats", colsum, small,
         _check_colsum),
    ]
    print(f"\nArrays: median of {repeats} maps (each API's default chunksize)")
    for title, fn, arrays, check in loads:
        print(f"  {title}")
        t0 = time.perf_counter()
        for _ in range(3):
            [fn(a) for a in arrays]
        single = (time.perf_counter() - t0) / 3
        medians: dict[str, float] = {}
        for c in _contenders(args.start_method, args.workers, not args.no_executors):
            run = _map_runner(c, fn, arrays)
            try:
                t0 = time.perf_counter()
                out = run()
                first = time.perf_counter() - t0
                check(out, arrays)
                del out
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    out = run()
                    times.append(time.perf_counter() - t0)
                    check(out, arrays)
                    del out
            finally:
                c.stop()
            medians[c.name] = statistics.median(times)
            print(f"    {c.name:44s} first {first * 1e3:8.1f} ms   median "
                  f"{medians[c.name] * 1e3:8.1f} ms")
        print(f"    {'the same compute in this process':44s} {'':17s}   median "
              f"{single * 1e3:8.1f} ms")
        ours = medians["tensormp.Pool"]
        print("    against tensormp.Pool: " + ", ".join(
            f"{name} {m / ours:.1f}x" for name, m in medians.items() if name != "tensormp.Pool"
        ))
        speedup = medians["stdlib multiprocessing.Pool"] / ours
        summary.append((f"arrays: {title.split(')')[0]})", "stdlib Pool / tensormp.Pool", speedup,
                        ">= 5", speedup >= 5))


# -- start-up -----------------------------------------------------------------------------------
def _cpu_seconds() -> float:
    """CPU time of this process and its waited-for children (the ones joined so far)."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _driver(lib: str, what: str, n: int) -> None:
    """``pool.py --driver LIB WHAT N``: time N start-ups, print ``wall,cpu`` seconds of each."""
    out = []
    for _ in range(n):
        c0 = _cpu_seconds()
        t0 = time.perf_counter()
        if lib == "tensormp" and what == "spawn":
            tensormp.spawn(trivial, nprocs=2)
        else:
            ctx = (tensormp if lib == "tensormp" else multiprocessing).get_context("spawn")
            count = 1 if what == "process" else 2
            ps = [ctx.Process(target=trivial, args=(i,)) for i in range(count)]
            for p in ps:
                p.start()
            for p in ps:
                p.join()
            assert all(p.exitcode == 0 for p in ps)
        out.append(f"{time.perf_counter() - t0:.6f},{_cpu_seconds() - c0:.6f}")
    print(" ".join(out))


def bench_startup(args: Any, summary: list[tuple[str, str, float, str, bool]]) -> None:
    import compileall
    import subprocess

    rounds = 3 if args.quick else 6
    compileall.compile_dir(os.path.join(SRC, "tensormp"), quiet=1)
    print(f"\nStart-up (spawn; {rounds} rounds of 3, each side in its own interpreter, in turns)")
    rows = [("spawn", "tensormp.spawn(trivial, nprocs=2) vs 2 stdlib Processes"),
            ("processes", "2 Processes: start() both, join() both"),
            ("process", "Process.start() + join()")]
    for what, title in rows:
        times: dict[str, list[float]] = {"std": [], "tensormp": []}
        cpu: dict[str, list[float]] = {"std": [], "tensormp": []}
        for r in range(rounds):
            for lib in (("std", "tensormp") if r % 2 == 0 else ("tensormp", "std")):
                out = subprocess.run(
                    [sys.executable, os.path.abspath(__file__), "--driver", lib, what, "3"],
                    check=True, capture_output=True, text=True,
                ).stdout
                for pair in out.split():
                    wall, spent = pair.split(",")
                    times[lib].append(float(wall))
                    cpu[lib].append(float(spent))
        std, ours = statistics.median(times["std"]), statistics.median(times["tensormp"])
        std_cpu, our_cpu = statistics.median(cpu["std"]), statistics.median(cpu["tensormp"])
        # CPU time (parent and children) moves far less than wall time on a busy machine.
        print(f"  {title:58s} stdlib {std * 1e3:7.1f} ms  tensormp {ours * 1e3:7.1f} ms  "
              f"{ours / std:.2f}x  (CPU {std_cpu * 1e3:.1f} / {our_cpu * 1e3:.1f} ms, "
              f"{our_cpu / std_cpu:.2f}x)")
        summary.append((f"start-up: {title}", "tensormp / stdlib", ours / std, "<= 1.2",
                        ours / std <= 1.2))


def main() -> None:
    if _DRIVER:
        _driver(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials and repeats")
    parser.add_argument("--repeats", type=int, default=None, help="maps per array contender")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"])
    parser.add_argument("--only", default="tiny,arrays,startup",
                        help="comma-separated: tiny, arrays, startup")
    parser.add_argument("--no-executors", action="store_true",
                        help="only the two Pools (no concurrent.futures, tensormp or loky executor)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    print(f"{args.workers} workers, start method {args.start_method!r}, {os.cpu_count()} CPUs, "
          f"numpy {np.__version__}, Python {sys.version.split()[0]}")
    summary: list[tuple[str, str, float, str, bool]] = []
    if "tiny" in only:
        bench_tiny(args, summary)
    if "arrays" in only:
        bench_arrays(args, summary)
    if "startup" in only:
        bench_startup(args, summary)
    print("\nSummary")
    print(f"  {'workload':64s} {'ratio':>7s}  target")
    for title, what, ratio, target, ok in summary:
        print(f"  {title:64s} {ratio:6.2f}x  {target:5s} ({what})  {'PASS' if ok else 'MISS'}")


if __name__ == "__main__":
    main()
