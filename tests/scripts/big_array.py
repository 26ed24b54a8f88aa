"""Send a 256 MiB array to a consumer; print the result as JSON (run with a small /dev/shm)."""

import json
import shutil

import numpy as np

import tensormp as mp


def consumer(q, out):
    a = q.get()
    out.put((a.nbytes, float(a[::4096].sum())))


def main():
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out))
    p.start()
    a = np.ones(64 << 20, dtype=np.float32)  # 256 MiB, not yet shared
    q.put(a)
    nbytes, total = out.get(timeout=120)
    p.join(60)
    print(json.dumps({
        "nbytes": nbytes, "sum": total, "exitcode": p.exitcode,
        "shm_total": shutil.disk_usage("/dev/shm").total,
    }))


if __name__ == "__main__":
    main()
