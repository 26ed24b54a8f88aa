"""Send N arrays of 4 KiB to a consumer that keeps them all; print fd counts as JSON.

Usage: send_many.py N NOFILE_LIMIT [CONSUMER_DELAY_S]
Run by test_limits.py, also without CAP_SYS_RESOURCE/CAP_SYS_ADMIN (as a non-root user), where
the kernel caps the fds in flight per user at RLIMIT_NOFILE.
"""

import json
import os
import resource
import sys
import time

import numpy as np

import tensormp as mp


def consumer(q, out, n, delay):
    time.sleep(delay)  # let the producer run ahead: fds pile up in flight
    kept = [q.get() for _ in range(n)]
    ok = all(int(a[0]) == i and mp.is_shared(a) for i, a in enumerate(kept))
    out.put((ok, len(os.listdir("/proc/self/fd"))))


def main():
    n, limit = int(sys.argv[1]), int(sys.argv[2])
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out, n, delay))
    p.start()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(n):
        q.put(np.full(512, i, dtype=np.int64))
    ok, child_fds = out.get(timeout=120)
    p.join(60)
    with open("/proc/self/status") as f:
        cap_eff = next(line.split()[1] for line in f if line.startswith("CapEff"))
    print(json.dumps({
        "ok": ok, "child_fds": child_fds, "parent_fds_before": before,
        "parent_fds_after": len(os.listdir("/proc/self/fd")), "exitcode": p.exitcode,
        "uid": os.getuid(), "cap_eff": cap_eff,
    }))


if __name__ == "__main__":
    main()
