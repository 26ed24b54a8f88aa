"""A one-machine tensormp.spawn script, run unchanged under torchrun (tests/test_elastic.py).

Usage: torchrun ... torchrun_spawn.py MODE NPROCS; prints one JSON line per process.
MODE: allreduce (gloo all_reduce over the whole torchrun job), raise (global rank 1 raises,
the others sleep as if blocked in a collective op), loop (gloo all_reduce until it fails).
"""

import json
import os
import sys
import time

import tensormp


def emit(**kw):
    os.write(1, (json.dumps(kw) + "\n").encode())


def helper(i):
    return os.getpid()


def train(local_index, scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(dist.get_rank() + 1) * scale])
        dist.all_reduce(t)
        # a spawn() that fn makes starts processes, as on one machine
        helpers = tensormp.spawn(helper, nprocs=2, return_values=True)
        return {"sum": t.item(), "local_index": local_index, "pid": os.getpid(),
                "rank": dist.get_rank(), "world": dist.get_world_size(), "helpers": helpers}
    finally:
        dist.destroy_process_group()


def fail_on_rank_1(local_index):
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        raise ValueError("bad batch on global rank 1")
    time.sleep(120)


def allreduce_loop(local_index):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(4)
    for step in range(10**9):
        dist.all_reduce(t)
        if step == 0:
            emit(worker=os.getpid(), rank=int(os.environ["RANK"]),
                 group=int(os.environ["GROUP_RANK"]), launcher=os.getppid())
        time.sleep(0.01)


if __name__ == "__main__":
    mode, nprocs = sys.argv[1], int(sys.argv[2])
    start = time.monotonic()
    try:
        if mode == "allreduce":
            values = tensormp.spawn(train, args=(2.0,), nprocs=nprocs, distributed=True,
                                    return_values=True)
            emit(ok=True, pid=os.getpid(), values=values)
        else:
            tensormp.spawn(allreduce_loop if mode == "loop" else fail_on_rank_1, nprocs=nprocs)
            emit(ok=True, pid=os.getpid())
    except tensormp.ProcessException as e:
        emit(ok=False, pid=os.getpid(), type=type(e).__name__, error_index=e.error_index,
             node=e.node, message=str(e), seconds=time.monotonic() - start)
        sys.exit(1)
    except ValueError as e:
        emit(ok=False, pid=os.getpid(), type="ValueError", message=str(e))
        sys.exit(1)
