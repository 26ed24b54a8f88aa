"""file_system strategy, fork start method, and the parent has made no shared memory yet: a
child forked now sends arrays through a Queue, a SimpleQueue and a Pipe, and exits; the parent
reads them 3 s later (after the cleanup daemon had every chance to collect). The child belongs
to the parent's program, so its unread files must survive it.
Prints one JSON line: {"values": [...], "errors": [...]}."""

import json
import time

import numpy as np

import tensormp as mp


def child(q, sq, conn):
    q.put(np.arange(1000, dtype=np.float64) + 5)
    sq.put(np.arange(10, dtype=np.int32) + 7)
    conn.send(np.full(2000, 9.0))


if __name__ == "__main__":
    mp.set_sharing_strategy("file_system")
    ctx = mp.get_context("fork")
    q, sq = ctx.Queue(), ctx.SimpleQueue()
    reader, writer = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child, args=(q, sq, writer))
    p.start()
    p.join(30)
    time.sleep(3.0)
    values, errors = [], []
    for get in (lambda: q.get(timeout=10), sq.get, reader.recv):
        try:
            values.append(float(get()[0]))
        except Exception as e:  # reported: the test expects none
            errors.append(f"{type(e).__name__}: {e}")
    print(json.dumps({"values": values, "errors": errors, "exitcode": p.exitcode}))
