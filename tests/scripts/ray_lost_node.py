"""A 2-node Ray cluster (one CPU each) of its own; ``Pool(2, engine="ray")`` maps 40 tasks of
0.5 s, and 3 s in, every process of the worker node (its raylet, its actor...) is SIGKILLed, as
when a machine is lost. Prints one JSON line: what the map gave, and when, after the kill.

Run inside a private network namespace (tests/test_ray.py). argv: task_retries.
"""

import json
import signal
import sys
import threading
import time

import psutil
import ray
from ray.cluster_utils import Cluster

import tensormp

STORE = 100 << 20


def slow(x):
    time.sleep(0.5)
    return x


def node_id(_):
    time.sleep(0.05)
    return ray.get_runtime_context().get_node_id()


def kill_node(node, when: dict) -> None:
    procs = []
    for infos in node.all_processes.values():
        for info in infos:
            try:
                p = psutil.Process(info.process.pid)
                procs += [p, *p.children(recursive=True)]
            except psutil.Error:
                pass
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    when["killed"] = time.monotonic()


def main() -> None:
    retries = int(sys.argv[1])
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "object_store_memory": STORE, "include_dashboard": False},
    )
    try:
        victim = cluster.add_node(num_cpus=1, object_store_memory=STORE)
        cluster.wait_for_nodes()
        report: dict = {"victim": victim.node_id}
        with tensormp.Pool(
            2, engine="ray", address=cluster.address, engine_options={"task_retries": retries}
        ) as pool:
            deadline = time.monotonic() + 60  # both actors up, one on each node
            while len(set(pool.map(node_id, range(8), chunksize=1))) < 2:
                assert time.monotonic() < deadline, "the actors never spread over both nodes"
            when: dict = {}
            timer = threading.Timer(3.0, kill_node, (victim, when))
            timer.start()
            try:
                out = pool.map(slow, range(40))
                report["answers"] = out
            except Exception as e:  # noqa: BLE001 - reported
                report["error"] = type(e).__name__
                report["message"] = str(e)
                report["node"] = getattr(e, "node", None)
            report["after_kill"] = time.monotonic() - when["killed"]
            timer.join()
            if retries:
                report["then"] = pool.apply(slow, (7,))  # the pool goes on
        print(json.dumps(report))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
