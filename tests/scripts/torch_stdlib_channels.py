"""torch's own channels carrying tensors in tensormp memory (``reducers/torch_stdlib.py``).

Usage: ``torch_stdlib_channels.py CHANNEL METHOD STRATEGY``: CHANNEL ``stdlib``
(``multiprocessing``) or ``torch`` (``torch.multiprocessing``), METHOD the start method of its
context, STRATEGY tensormp's sharing strategy. A child of that context gets
a tensormp-shared tensor as a ``Process`` argument and another on a ``Queue``; writes must be
seen both ways, a tensor sent back must arrive as the parent's own storage, and once the child
has exited the parent must hold nothing for it. Prints one JSON line.
"""

import json
import os
import sys
import time

import torch

import tensormp as mp
from tensormp.reducers import torch as rt


def child(arg, q_in, q_out):
    t = q_in.get(timeout=60)
    arg += 1  # both are the parent's memory: the parent sees these writes
    t += 1
    q_out.put([arg.is_shared(), t.is_shared()])
    assert q_in.get(timeout=60) == "parent wrote"
    q_out.put([float(arg.sum()), float(t.sum())])
    q_out.put((arg, t))  # back home: the parent's own storages
    assert q_in.get(timeout=60) == "bye"


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def main(channel, method, strategy):
    import multiprocessing

    mp.set_sharing_strategy(strategy)
    ctx = (torch.multiprocessing if channel == "torch" else multiprocessing).get_context(method)
    res = {}
    arg = mp.share(torch.zeros(1000))  # tensormp memory: a large block, and ...
    t = torch.zeros(10)
    a, b = mp.Pipe()
    a.send(t)  # ... a small one, moved by a tensormp send (as the hogwild trainers' arguments)
    b.recv()
    a.close()
    b.close()
    assert rt.in_tensormp_memory(arg.untyped_storage()) and rt.in_tensormp_memory(t.untyped_storage())
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(arg, q_in, q_out))
    p.start()
    q_in.put(t)
    res["child_sees_shared"] = q_out.get(timeout=60)
    res["parent_sees_child_writes"] = [float(arg.sum()), float(t.sum())]
    arg += 1
    t += 1
    q_in.put("parent wrote")
    res["child_sees_parent_writes"] = q_out.get(timeout=60)
    back_arg, back_t = q_out.get(timeout=60)
    res["came_back_same"] = (
        back_arg.untyped_storage().data_ptr() == arg.untyped_storage().data_ptr()
        and back_t.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    )
    res["still_tensormp"] = rt.in_tensormp_memory(t.untyped_storage())
    del back_arg, back_t
    q_in.put("bye")
    p.join(60)
    res["exitcode"] = p.exitcode
    # The child released its holds when it exited: nothing stays pinned for it.
    deadline = time.monotonic() + 10
    while mp.memory_stats()["remote_held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    res["remote_held_bytes"] = mp.memory_stats()["remote_held_bytes"]
    # A private tensor still goes through torch's own reducer, into torch's shared memory.
    plain = torch.ones(3)
    q_in.put(plain)
    got = q_in.get(timeout=60)
    res["plain_by_torch"] = plain.is_shared() and not rt.in_tensormp_memory(plain.untyped_storage())
    res["plain_same"] = got.untyped_storage().data_ptr() == plain.untyped_storage().data_ptr()
    # Round trips through a queue in this process: no fd accumulates.
    q_in.put(t)
    q_in.get(timeout=60)
    before = fds()
    for _ in range(50):
        q_in.put(t)
        q_in.get(timeout=60)
    # The stdlib's resource sharer (its DupFd outside a spawning Popen) hands each fd over from a
    # thread of its own, which closes its copy and the connection a moment later: wait for that.
    deadline = time.monotonic() + 10
    while fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    res["fds_grew"] = fds() - before
    q_in.close()
    q_out.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:4])
