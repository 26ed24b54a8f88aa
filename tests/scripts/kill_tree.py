"""A producer/consumer program that reports its pids and segment ids, then waits to be killed.

Prints one JSON line: {"pids": [...], "segments": [hex ids]} once every process holds memory.
"""

import json
import sys
import time

import numpy as np

import tensormp as mp
from tensormp.memory import allocator


def consumer(q, out):
    kept = [q.get() for _ in range(3)]
    out.put(sorted(s.hex() for s in allocator._segments))
    time.sleep(300)
    del kept


def main():
    ctx = mp.get_context(sys.argv[1] if len(sys.argv) > 1 else "spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out))
    p.start()
    for i in range(3):
        q.put(np.full(1 << 18 if i else 1 << 22, i, dtype=np.float32))
    child_segments = out.get(timeout=60)
    mine = sorted(s.hex() for s in allocator._segments)
    print(json.dumps({"pids": [mp.current_process().pid, p.pid],
                      "segments": sorted(set(mine) | set(child_segments))}), flush=True)
    time.sleep(300)


if __name__ == "__main__":
    main()
