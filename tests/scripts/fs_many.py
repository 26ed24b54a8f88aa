"""5,000 live arrays under RLIMIT_NOFILE=256 with the file_system strategy (no fd per segment).

The producer keeps every array it sends; the consumer keeps every array it receives. 300 of
them are larger than 1 MiB (a segment each), so both processes map more segments than they
could hold fds. Prints one JSON line.
"""

import json
import os
import resource

import tensormp as mp

N, LARGE = 5000, 300


def consumer(q, out):
    before = len(os.listdir("/proc/self/fd"))
    kept = [q.get() for _ in range(N)]
    ok = all(float(a[0]) == i and float(a[-1]) == i for i, a in enumerate(kept))
    out.put({"kept": len(kept), "ok": ok, "fds_consumer_before": before,
             "fds_consumer_after": len(os.listdir("/proc/self/fd")),
             "segments_consumer": mp.memory_stats()["segments"]})
    assert q.get() == "done"


def main():
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out))
    p.start()
    kept = []
    for i in range(N):
        n = (1 << 20) // 8 + 1 if i % (N // LARGE) == 0 else 512
        a = mp.full(n, float(i))
        kept.append(a)
        q.put(a)
    res = out.get(timeout=120)
    res["segments_producer"] = mp.memory_stats()["segments"]
    res["limit"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    q.put("done")
    p.join(60)
    del kept
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
