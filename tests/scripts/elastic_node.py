"""One node of a tensormp.spawn(nnodes=2) job (tests/test_elastic.py starts two of these).

Usage: elastic_node.py ENDPOINT RUN_ID MODE NPROCS [FLAG]; prints JSON lines: each worker's pid,
then the outcome on this node. FLAG: a file path for ranks to signal each other.
MODE: allreduce (gloo all_reduce over the job), raise (global rank 1 raises after rank 2 returned,
while ranks 0 and 3 block as in a collective op), crash (global rank 1 is killed by SIGKILL), timeout,
loop (gloo all_reduce in a loop until it fails: the test kills one node from outside).
"""

import json
import os
import signal
import sys
import time

import tensormp


def emit(**kw):
    os.write(1, (json.dumps(kw) + "\n").encode())


def allreduce(local_index, scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(dist.get_rank() + 1) * scale])
        dist.all_reduce(t)
        env = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
        return {"sum": t.item(), "local_index": local_index, "pid": os.getpid(), **env}
    finally:
        dist.destroy_process_group()


def raise_on_rank_1(local_index, flag):
    """Rank 1 raises once rank 2 has returned; ranks 0 and 3 sleep (as if in a collective op)."""
    rank = int(os.environ["RANK"])
    emit(worker=os.getpid(), rank=rank)
    open(f"{flag}.{rank}", "w").close()  # this rank runs
    if rank == 2:
        open(flag, "w").close()
        return "done"
    if rank == 1:  # once every rank runs (a busy machine starts them seconds apart)
        deadline = time.monotonic() + 60
        wanted = [flag] + [f"{flag}.{r}" for r in (0, 3)]
        while not all(map(os.path.exists, wanted)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # rank 2 is waiting for the job by now
        emit(raised_at=time.time())
        raise ValueError(f"bad batch on global rank 1 (local index {local_index})")
    time.sleep(120)


def crash_rank_1(local_index):
    emit(worker=os.getpid(), rank=int(os.environ["RANK"]))
    if os.environ["RANK"] == "1":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


def allreduce_loop(local_index):
    """All-reduce until it fails; says once that it runs (with its node), as a training loop."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(4)
    for step in range(10**9):
        try:
            dist.all_reduce(t)
        except Exception:
            emit(rank_error_at=time.time())
            raise
        if step == 0:
            emit(worker=os.getpid(), rank=int(os.environ["RANK"]),
                 group=int(os.environ["GROUP_RANK"]), launcher=os.getppid())
        time.sleep(0.01)


def sleep_long(local_index):
    emit(worker=os.getpid(), rank=int(os.environ["RANK"]))
    time.sleep(120)


if __name__ == "__main__":
    endpoint, run_id, mode, nprocs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    kw = dict(nprocs=nprocs, nnodes=2, rdzv_endpoint=endpoint, rdzv_id=run_id, rdzv_timeout=60)
    start = time.monotonic()
    if mode == "loop":  # when this process ends (after its threads stopped)
        import atexit
        atexit.register(lambda: emit(exit_at=time.time()))
    try:
        if mode == "allreduce":
            values = tensormp.spawn(allreduce, args=(2.0,), distributed=True, return_values=True,
                                    **kw)
            emit(ok=True, values=values, seconds=time.monotonic() - start)
        else:
            fn = {"raise": raise_on_rank_1, "crash": crash_rank_1, "timeout": sleep_long,
                  "loop": allreduce_loop}[mode]
            args = (sys.argv[5],) if mode == "raise" else ()
            tensormp.spawn(fn, args=args, timeout=3 if mode == "timeout" else None, **kw)
            emit(ok=True, seconds=time.monotonic() - start)
    except tensormp.ProcessException as e:
        emit(
            ok=False, type=type(e).__name__, error_index=e.error_index, node=e.node,
            host=getattr(e, "host", None), message=str(e), exc_type=getattr(e, "exc_type", ""),
            cause=type(e.__cause__).__name__ if e.__cause__ is not None else None,
            at=time.time(), seconds=time.monotonic() - start,
        )
    except Exception as e:  # noqa: BLE001 - reported: the test says what it should have been
        emit(ok=False, type=type(e).__name__, message=str(e)[:2000], at=time.time())
