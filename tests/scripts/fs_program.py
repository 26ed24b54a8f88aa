"""A file_system-strategy program for kill -9 tests (run with TENSORMP_SHM_DIR set).

Processes: this root, a *producer* and a *consumer* (spawn children). The producer creates four
2 MiB arrays, each filled with its own value, as named segments:

* ``held``: sent to the consumer, which keeps it;
* ``dropped``: sent to the consumer, which drops it at once;
* ``private``: never sent (only the producer maps it);
* ``queued``: put on a queue nobody reads yet (a handle in flight).

The root prints one JSON line ``{"names": {...}, "pids": {...}}`` once all that is done, then
obeys commands on stdin, one per line, answering each with a JSON line:

* ``read``: the consumer reads ``queued`` and checks both arrays it holds;
* ``exit``: the consumer drops everything, the children are stopped, the root exits.
"""

import json
import os
import sys
import time

import tensormp as mp

VALUES = {"held": 1.0, "dropped": 2.0, "private": 3.0, "queued": 4.0}
N = (2 << 20) // 8


def name_of(a):
    from tensormp.memory.allocator import find_block

    return find_block(a)[0].segment.name


def producer(to_consumer, in_flight, report):
    arrays = {k: mp.full(N, v) for k, v in VALUES.items()}
    to_consumer.put(arrays["held"])
    to_consumer.put(arrays["dropped"])
    in_flight.put(arrays["queued"])
    in_flight.close()
    in_flight.join_thread()  # the handle is in the queue's socket now, not in our feeder
    report.put({k: name_of(a) for k, a in arrays.items()})
    while True:
        time.sleep(1)


def consumer(to_consumer, in_flight, commands, report):
    held = to_consumer.get()
    dropped = to_consumer.get()
    assert float(dropped[0]) == VALUES["dropped"]
    del dropped
    report.put("received")
    kept = [held]
    while True:
        cmd = commands.get()
        if cmd == "read":
            kept.append(in_flight.get(timeout=30))
            report.put({
                "held_ok": bool((kept[0] == VALUES["held"]).all()),
                "queued_ok": bool((kept[1] == VALUES["queued"]).all()),
            })
        elif cmd == "exit":
            del kept
            return


def main():
    ctx = mp.get_context("spawn")
    mp.set_sharing_strategy("file_system")
    to_consumer, in_flight, commands, report = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    prod = ctx.Process(target=producer, args=(to_consumer, in_flight, report), daemon=True)
    cons = ctx.Process(target=consumer, args=(to_consumer, in_flight, commands, report))
    prod.start()
    cons.start()
    first = report.get(timeout=60)
    second = report.get(timeout=60)
    names = first if isinstance(first, dict) else second
    print(json.dumps({"names": names, "pids": {"root": os.getpid(), "producer": prod.pid,
                                               "consumer": cons.pid}}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        commands.put(cmd)
        if cmd == "read":
            print(json.dumps(report.get(timeout=60)), flush=True)
        elif cmd == "exit":
            cons.join(30)
            prod.terminate()
            prod.join(30)
            print(json.dumps({"consumer_exit": cons.exitcode}), flush=True)
            return


if __name__ == "__main__":
    main()
