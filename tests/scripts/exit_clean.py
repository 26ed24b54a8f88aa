"""Send arrays to spawn children as queue items and as Process arguments, then exit normally.

Regression script: children used to print "Exception ignored in _root_died" at exit (weakref
callbacks on half-torn-down modules) and could hang starting a thread at shutdown. Usage:
``exit_clean.py STRATEGY``; prints one JSON line.
"""

import json
import sys

import numpy as np

import tensormp as mp


def worker(q, done):
    a = q.get()
    a += 1
    done.put(a.sum())


def with_args(a, b, r):
    r.put(float(a.sum() + b.sum()))
    a[0, 0] = 99


def main():
    mp.set_sharing_strategy(sys.argv[1])
    ctx = mp.get_context("spawn")
    q, done, r = ctx.Queue(), ctx.Queue(), ctx.Queue()
    a = mp.zeros((300, 1000))  # 2.3 MiB: a segment of its own
    p = ctx.Process(target=worker, args=(q, done))
    p.start()
    q.put(a)
    first = float(done.get(timeout=60))
    p.join(30)
    p2 = ctx.Process(target=with_args, args=(a, np.arange(10.0), r))
    p2.start()
    second = r.get(timeout=60)
    p2.join(30)
    print(json.dumps({"first": first, "second": second, "exitcodes": [p.exitcode, p2.exitcode],
                      "a00": float(a[0, 0])}), flush=True)


if __name__ == "__main__":
    main()
