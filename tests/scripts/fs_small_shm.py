"""file_system strategy with a 64 MiB shm directory: a 256 MiB array fails in the caller.

Prints one JSON line. Run with TENSORMP_SHM_DIR on a 64 MiB tmpfs.
"""

import errno
import json
import os
import shutil

import numpy as np

import tensormp as mp


def consumer(q, out):
    out.put(float(q.get().sum()))


def main():
    mp.set_sharing_strategy("file_system")
    res = {"shm_total": shutil.disk_usage(os.environ["TENSORMP_SHM_DIR"]).total}
    try:
        mp.zeros(64 << 20, dtype=np.float32)  # 256 MiB
    except mp.SharedMemoryError as e:
        res["errno"] = errno.errorcode.get(e.errno, str(e.errno))
        res["message"] = str(e)
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(q, out))
    p.start()
    try:
        q.put(np.ones(64 << 20, dtype=np.float32))  # not yet shared: copied at put()
        res["put_raised"] = None
    except mp.SharedMemoryError as e:
        res["put_raised"] = type(e).__name__
    q.put(np.ones(1000))
    res["small_ok"] = out.get(timeout=60) == 1000.0
    p.join(30)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
