"""Several threads make their first put() at once, in a fresh interpreter where numpy is
imported but tensormp's numpy reducer is not yet: every item must arrive, shared, and put()
must not raise (the reducer module is imported by one thread while the others wait for it).
Prints one JSON line: {"errors": [...], "received": n, "shared": [...], "qsize": n}."""

import json
import sys
import threading

import numpy as np

import tensormp as mp

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    assert "tensormp.reducers.numpy" not in sys.modules
    q = mp.get_context("spawn").Queue()
    barrier = threading.Barrier(n)
    errors = []

    def first_put(i: int) -> None:
        barrier.wait()
        try:
            q.put(np.full(1024, i, np.float32))
        except Exception as e:  # reported, not raised: the test checks there is none
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=first_put, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = []
    for _ in range(n - len(errors)):
        got.append(q.get(timeout=10))
    print(json.dumps({
        "errors": errors,
        "received": sorted(int(a[0]) for a in got),
        "shared": [mp.is_shared(a) for a in got],
        "qsize": q.qsize(),
    }))
