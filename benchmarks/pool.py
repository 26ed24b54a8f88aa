"""Pool.map over arrays: tensormp against the stdlib Pool and concurrent.futures.

Workload: ``map(work, arrays)`` over 64 float32 arrays of 4 MiB each (not in shared memory:
ordinary numpy arrays, as a program has them), where ``work(a)`` returns ``a + 1`` (a new
array of the same size). Every contender uses the same start method and number of workers,
and its API's default chunksize (``Pool.map``: about 4 chunks per worker; executors: 1).

Each contender's pool is created and warmed up first (one map, reported as "first map": it
includes starting the workers), then timed over ``--repeats`` maps; the table shows medians and
ratios measured in the same run. Results are checked (values of a few elements) and dropped
before the next repeat, so a steady state with recycled memory is what is measured.

``single process`` is ``[work(a) for a in arrays]`` in this process: the compute alone.

    python benchmarks/pool.py            # 7 repeats, about 30 s on 2 cores
    python benchmarks/pool.py --quick    # 3 repeats, about 15 s
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import tensormp  # noqa: E402

N_ARRAYS = 64
ARRAY_BYTES = 4 << 20


def work(a: np.ndarray) -> np.ndarray:
    return a + np.float32(1)


def _check(results: list[np.ndarray], arrays: list[np.ndarray]) -> None:
    assert len(results) == len(arrays)
    for i in (0, len(arrays) // 2, len(arrays) - 1):
        r, a = results[i], arrays[i]
        assert r.shape == a.shape and r.dtype == a.dtype
        assert r[0] == a[0] + 1 and r[-1] == a[-1] + 1, f"wrong result for array {i}"


def _time_maps(run, arrays: list[np.ndarray], repeats: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    out = run(arrays)
    first = time.perf_counter() - t0
    _check(out, arrays)
    del out
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = run(arrays)
        times.append(time.perf_counter() - t0)
        _check(out, arrays)
        del out
    return first, times


def _contenders(method: str, workers: int) -> list[tuple[str, object]]:
    def tensormp_pool():
        pool = tensormp.get_context(method).Pool(workers)
        return pool, lambda arrays: pool.map(work, arrays), pool.terminate

    def stdlib_pool():
        pool = multiprocessing.get_context(method).Pool(workers)
        return pool, lambda arrays: pool.map(work, arrays), pool.terminate

    def stdlib_executor():
        ex = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context(method)
        )
        return ex, lambda arrays: list(ex.map(work, arrays)), ex.shutdown

    def tensormp_executor():
        ex = tensormp.ProcessPoolExecutor(workers, mp_context=tensormp.get_context(method))
        return ex, lambda arrays: list(ex.map(work, arrays)), ex.shutdown

    return [
        ("tensormp.Pool.map", tensormp_pool),
        ("tensormp.ProcessPoolExecutor.map", tensormp_executor),
        ("stdlib multiprocessing.Pool.map", stdlib_pool),
        ("concurrent.futures.ProcessPoolExecutor.map", stdlib_executor),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats instead of 7")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"])
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)

    rng = np.random.default_rng(0)
    arrays = [rng.random(ARRAY_BYTES // 4, dtype=np.float32) for _ in range(N_ARRAYS)]
    moved = 2 * N_ARRAYS * ARRAY_BYTES  # arguments out, results back
    print(
        f"map(work, {N_ARRAYS} arrays of {ARRAY_BYTES >> 20} MiB) -> arrays of the same size; "
        f"{args.workers} workers, start method {args.start_method!r}, {repeats} repeats, "
        f"{os.cpu_count()} CPUs, numpy {np.__version__}, Python {sys.version.split()[0]}"
    )

    t0 = time.perf_counter()
    for _ in range(3):
        [work(a) for a in arrays]
    single = (time.perf_counter() - t0) / 3

    rows: dict[str, tuple[float, float]] = {}
    for name, make in _contenders(args.start_method, args.workers):
        pool, run, stop = make()
        try:
            first, times = _time_maps(run, arrays, repeats)
        finally:
            stop()
        median = statistics.median(times)
        rows[name] = (first, median)
        print(
            f"  {name:45s} first map {_ms(first)}   median {_ms(median)}"
            f"   ({moved / median / 1e9:5.2f} GB/s of arguments + results)"
        )
    print(f"  {'single process (compute only)':45s} {'':19s}   median {_ms(single)}")

    ours = rows["tensormp.Pool.map"][1]
    print("\nSummary (median map time; ratio = the other's time / tensormp.Pool.map's)")
    print(f"  {'':45s} {'median':>11s} {'ratio':>8s}")
    for name, (_, median) in rows.items():
        print(f"  {name:45s} {_ms(median)} {median / ours:7.2f}x")
    std = rows["stdlib multiprocessing.Pool.map"][1] / ours
    cf = rows["concurrent.futures.ProcessPoolExecutor.map"][1] / ours
    print(
        f"\ntensormp.Pool.map is {std:.1f}x faster than the stdlib Pool.map and {cf:.1f}x "
        "faster than concurrent.futures.ProcessPoolExecutor.map on this workload."
    )


if __name__ == "__main__":
    main()
