"""Pools beyond one machine: tensormp's local engine, its Ray engine, and Ray's own
``ray.util.multiprocessing.Pool``, on the same two-node Ray cluster.

The cluster is two Ray nodes of one CPU each on this machine (``ray.cluster_utils.Cluster``,
the same code path as two machines: two raylets and object stores; objects move between them
through Ray's object manager). Run as root, the script first moves itself into a private
network namespace (``unshare -n``), where Ray cannot pick an external address; otherwise it runs
as it is.

Workloads, each contender with 2 workers:

* **tiny tasks**: ``map(inc, range(N), chunksize=1)``: the per-task cost of the machinery
  (dispatch, a round trip, result delivery), as microseconds per task;
* **arrays**: ``map(work, arrays)`` over 64 float32 arrays of 4 MiB, ``work(a) = a + 1``,
  the API's default chunksize: arguments out and results back.

Every contender's pool is created and warmed up first (one map of each workload), then each
repetition times one map of each contender in turn (alternating, so that a change in the
machine's load touches all of them alike); medians and ratios are from one run. Only one
contender runs at a time, so each has the cluster's two CPUs to itself.

    sudo python benchmarks/scaleout.py            # about 2 minutes on 2 cores
    sudo python benchmarks/scaleout.py --quick
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")
sys.path.insert(0, SRC)
# the Ray workers (started by the cluster's raylets, which inherit this environment) import the
# same tensormp as this process
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")]))

import tensormp  # noqa: E402

N_ARRAYS = 64
ARRAY_BYTES = 4 << 20


def inc(x: int) -> int:
    return x + 1


def work(a: np.ndarray) -> np.ndarray:
    return a + np.float32(1)


def _check_arrays(results: list[np.ndarray], arrays: list[np.ndarray]) -> None:
    assert len(results) == len(arrays)
    for i in (0, len(arrays) // 2, len(arrays) - 1):
        r, a = results[i], arrays[i]
        assert r.shape == a.shape and r.dtype == a.dtype
        assert r[0] == a[0] + 1 and r[-1] == a[-1] + 1, f"wrong result for array {i}"


def _timed(run: Callable[[], Any], check: Callable[[Any], None]) -> float:
    t0 = time.perf_counter()
    out = run()
    took = time.perf_counter() - t0
    check(out)
    return took


def _in_netns() -> bool:
    return os.environ.get("TENSORMP_SCALEOUT_NETNS") == "1"


def _reexec_in_netns() -> None:
    if _in_netns() or os.geteuid() != 0 or not shutil.which("unshare"):
        return
    env = dict(os.environ, TENSORMP_SCALEOUT_NETNS="1")
    script = 'ip link set lo up && exec "$@"'
    cmd = ["unshare", "-n", "sh", "-c", script, "sh", sys.executable, *sys.argv]
    sys.exit(subprocess.call(cmd, env=env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats, 500 tiny tasks")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--tasks", type=int, default=None, help="tiny tasks per map")
    parser.add_argument(
        "--object-store-mib", type=int, default=1024, help="object store of each node (MiB)"
    )
    args = parser.parse_args()
    _reexec_in_netns()
    repeats = args.repeats or (3 if args.quick else 5)
    ntasks = args.tasks or (500 if args.quick else 2000)

    import ray
    from ray.cluster_utils import Cluster
    from ray.util.multiprocessing import Pool as RayPool

    store = args.object_store_mib << 20
    t0 = time.perf_counter()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": store, "include_dashboard": False},
    )
    cluster.add_node(num_cpus=1, object_store_memory=store)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    started = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    arrays = [rng.random(ARRAY_BYTES // 4, dtype=np.float32) for _ in range(N_ARRAYS)]
    print(
        f"2 Ray nodes x 1 CPU on this machine ({os.cpu_count()} CPUs; cluster up in "
        f"{started:.1f} s; {'private network namespace' if _in_netns() else 'host network'}), "
        f"Ray {ray.__version__}, numpy {np.__version__}, Python {sys.version.split()[0]}; "
        f"{repeats} repeats; 2 workers each"
    )

    def local() -> Any:
        return tensormp.get_context("spawn").Pool(2)

    def ray_engine() -> Any:
        return tensormp.Pool(2, engine="ray")

    def ray_pool() -> Any:
        return RayPool(2, ray_address=cluster.address)

    contenders = [
        ("tensormp.Pool (local engine)", local),
        ("tensormp.Pool(engine='ray')", ray_engine),
        ("ray.util.multiprocessing.Pool", ray_pool),
    ]
    tiny: dict[str, float] = {}
    big: dict[str, float] = {}
    expect = list(range(1, ntasks + 1))

    def check_tiny(out: list[int]) -> None:
        assert list(out) == expect

    pools: dict[str, Any] = {}
    try:
        for name, make in contenders:
            pools[name] = make()
        tiny_times: dict[str, list[float]] = {name: [] for name in pools}
        big_times: dict[str, list[float]] = {name: [] for name in pools}
        for rep in range(repeats + 1):  # the first: warm-up (workers up, code loaded)
            for name, pool in pools.items():
                took = _timed(lambda p=pool: p.map(inc, range(ntasks), chunksize=1), check_tiny)
                if rep:
                    tiny_times[name].append(took)
            for name, pool in pools.items():
                took = _timed(lambda p=pool: p.map(work, arrays), lambda o: _check_arrays(o, arrays))
                if rep:
                    big_times[name].append(took)
        for name in pools:
            tiny[name] = statistics.median(tiny_times[name]) / ntasks
            big[name] = statistics.median(big_times[name])
            print(
                f"  {name:32s} tiny tasks {tiny[name] * 1e6:8.1f} us/task   "
                f"64 x 4 MiB map {big[name] * 1e3:8.1f} ms"
            )
    finally:
        for pool in pools.values():
            pool.terminate()
            pool.join()
        ray.shutdown()
        cluster.shutdown()

    ours = "tensormp.Pool(engine='ray')"
    theirs = "ray.util.multiprocessing.Pool"
    print("\nSummary (ratio = time / tensormp.Pool(engine='ray')'s time, same run)")
    print(f"  {'':32s} {'us/task':>9s} {'ratio':>7s} {'64x4MiB ms':>11s} {'ratio':>7s}")
    for name in tiny:
        print(
            f"  {name:32s} {tiny[name] * 1e6:9.1f} {tiny[name] / tiny[ours]:6.2f}x "
            f"{big[name] * 1e3:11.1f} {big[name] / big[ours]:6.2f}x"
        )
    verdict = "meets" if tiny[ours] <= tiny[theirs] else "MISSES"
    print(
        f"\nPer tiny task the Ray engine costs {tiny[ours] / tiny[theirs]:.2f}x Ray's own Pool "
        f"({verdict} the target <= 1x); the array map takes {big[ours] / big[theirs]:.2f}x its "
        f"time. The local engine's per-task cost is {tiny[ours] / tiny['tensormp.Pool (local engine)']:.0f}x "
        "below the Ray engine's: stay local while one machine is enough."
    )


if __name__ == "__main__":
    main()
