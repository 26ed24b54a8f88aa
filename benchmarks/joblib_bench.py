"""joblib.Parallel on the "tensormp" backend against joblib's default, loky, in the same run.

Workloads (2 workers, each backend's own batching; ordinary numpy arrays, as a program has
them, not arrays already in shared memory):

* ``arrays in and out``: ``f(a) = a + 1`` over 32 float32 arrays of 4 MiB (a result of the
  same size). loky memory-maps arguments over 1 MB to a temporary file (joblib's default
  ``max_nbytes="1M"``) and pickles results back; tensormp copies each argument once into shared
  memory and the worker's result once into its own.
* ``arrays in, scalar out``: ``a.sum()`` over the same arrays: the argument path alone.
* ``tiny tasks``: 20,000 calls of ``i + 1``: the per-call overhead, with joblib's auto-batching.
* ``sklearn cross_val_score``: a random forest (50 trees) on the digits data set, 5 folds
  (skipped without scikit-learn).

Each backend's workers are started first (one call, reported as ``first call``: it includes
starting them), then every workload runs ``--repeats`` times, alternating between the two
backends so that both see the same load; the table shows medians and the ratio
loky / tensormp (above 1: tensormp is faster). Results are checked.

    python benchmarks/joblib_bench.py            # 7 repeats, about 40 s on 2 cores
    python benchmarks/joblib_bench.py --quick    # 3 repeats
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import joblib  # noqa: E402

import tensormp.joblib  # noqa: E402

N_JOBS = 2
N_ARRAYS = 32
N_TINY = 20_000


def plus_one(a: np.ndarray) -> np.ndarray:
    return a + np.float32(1)


def total(a: np.ndarray) -> float:
    return float(a.sum())


def inc(i: int) -> int:
    return i + 1


def _arrays_out(arrays: list[np.ndarray]) -> Callable[[], None]:
    def run() -> None:
        out = joblib.Parallel()(joblib.delayed(plus_one)(a) for a in arrays)
        assert len(out) == len(arrays)
        for i in (0, len(arrays) - 1):
            assert out[i][0] == arrays[i][0] + 1 and out[i].shape == arrays[i].shape

    return run


def _scalars_out(arrays: list[np.ndarray]) -> Callable[[], None]:
    expect = [float(a.sum()) for a in arrays]

    def run() -> None:
        assert joblib.Parallel()(joblib.delayed(total)(a) for a in arrays) == expect

    return run


def _tiny() -> None:
    out = joblib.Parallel()(joblib.delayed(inc)(i) for i in range(N_TINY))
    assert out[0] == 1 and out[-1] == N_TINY and len(out) == N_TINY


def _sklearn() -> Callable[[], None] | None:
    try:
        from sklearn.datasets import load_digits
        from sklearn.ensemble import RandomForestClassifier
        from sklearn.model_selection import cross_val_score
    except ImportError:
        return None
    X, y = load_digits(return_X_y=True)

    def run() -> None:
        model = RandomForestClassifier(n_estimators=50, random_state=0)
        scores = cross_val_score(model, X, y, cv=5, n_jobs=N_JOBS)
        assert scores.mean() > 0.85

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats

    rng = np.random.default_rng(0)
    arrays = [rng.random(1 << 20, dtype=np.float32) for _ in range(N_ARRAYS)]
    workloads: list[tuple[str, Callable[[], None]]] = [
        (f"arrays in and out ({N_ARRAYS} x 4 MiB)", _arrays_out(arrays)),
        (f"arrays in, scalar out ({N_ARRAYS} x 4 MiB)", _scalars_out(arrays)),
        (f"tiny tasks ({N_TINY:,} calls)", _tiny),
    ]
    sk = _sklearn()
    if sk is not None:
        workloads.append(("sklearn cross_val_score (forest, 5 folds)", sk))

    backends = ("tensormp", "loky")
    results: dict[str, dict[str, float]] = {"first call (starts the workers)": {}}
    for backend in backends:
        with joblib.parallel_config(backend=backend, n_jobs=N_JOBS):
            t0 = time.perf_counter()
            _tiny()
            results["first call (starts the workers)"][backend] = (time.perf_counter() - t0) * 1e3
    # Both backends keep their workers between calls (idle workers cost no CPU). The repeats
    # alternate between them, so that both see the same load on a shared machine.
    for name, run in workloads:
        times: dict[str, list[float]] = {b: [] for b in backends}
        for backend in backends:
            with joblib.parallel_config(backend=backend, n_jobs=N_JOBS):
                run()  # warm-up: recycled shared memory, modules loaded in the workers
        for _ in range(repeats):
            for backend in backends:
                with joblib.parallel_config(backend=backend, n_jobs=N_JOBS):
                    t0 = time.perf_counter()
                    run()
                    times[backend].append((time.perf_counter() - t0) * 1e3)
        results[name] = {b: statistics.median(t) for b, t in times.items()}
        print(f"  {name}: " + ", ".join(f"{b} {v:.1f} ms" for b, v in results[name].items()),
              file=sys.stderr)
    tensormp.joblib.shutdown()

    print(f"\njoblib.Parallel, {N_JOBS} workers, median of {repeats} "
          f"(Python {sys.version.split()[0]}, joblib {joblib.__version__}, "
          f"{os.cpu_count()} CPUs)\n")
    print("| workload | tensormp | loky | loky / tensormp |")
    print("|---|---|---|---|")
    for name, row in results.items():
        t, lo = row["tensormp"], row["loky"]
        print(f"| {name} | {_fmt(t)} | {_fmt(lo)} | {lo / t:.2f}x |")
    return 0


def _fmt(ms: float) -> str:
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


if __name__ == "__main__":
    sys.exit(main())
