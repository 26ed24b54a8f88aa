"""torch's own channels meet tensormp memory (issue 22, part 1; ``reducers/torch_stdlib.py``).

Programs written for ``torch.multiprocessing`` with only the import swapped: a ``DataLoader``
with torch's contexts, plain ``multiprocessing`` and ``torch.multiprocessing`` queues carrying
tensors whose storage is tensormp memory, shared with every process that holds them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import tensormp as mp  # noqa: E402
from tensormp.reducers import torch as rt  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"


def _run(args: list[str], cwd: Path, timeout: float) -> dict:
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                         timeout=timeout, cwd=cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


# The program, plus what the parent holds for the loader's workers once they are gone.
REPRO = """
import json, time
import torch, tensormp as mp
def noop(ds): return len(ds)
if __name__ == "__main__":
    ds = torch.utils.data.TensorDataset(torch.randn(100, 4), torch.arange(100))
    p = mp.get_context("spawn").Process(target=noop, args=(ds,)); p.start(); p.join()
    loader = torch.utils.data.DataLoader(ds, batch_size=10, num_workers=2, multiprocessing_context="spawn")
    n = sum(len(x) for x, _ in loader)
    del loader
    deadline = time.monotonic() + 10
    while mp.memory_stats()["remote_held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"n": n, "exitcode": p.exitcode,
                      "remote_held_bytes": mp.memory_stats()["remote_held_bytes"],
                      "still_shared": mp.is_shared(ds.tensors[0])}))
"""


@pytest.mark.timeout(240)
def test_parent_dataloader_over_a_dataset_a_joined_process_had(tmp_path):
    script = tmp_path / "repro.py"
    script.write_text(REPRO)
    out = _run([str(script)], tmp_path, 230)
    assert out == {"n": 100, "exitcode": 0, "remote_held_bytes": 0, "still_shared": True}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("args", [
    ("stdlib", "spawn", "file_descriptor"),
    ("torch", "spawn", "file_descriptor"),
    ("stdlib", "forkserver", "file_system"),
    pytest.param(("torch", "fork", "file_descriptor"), marks=pytest.mark.slow),
], ids="-".join)
def test_plain_queues_carry_tensormp_tensors_shared_both_ways(tmp_path, args):
    out = _run([str(SCRIPTS / "torch_stdlib_channels.py"), *args], tmp_path, 230)
    # 50 round trips open no fd; one the process held before (e.g. the exited child's or the
    # forkserver's) may close meanwhile, so the count may drop (-3 seen under CI load).
    assert out.pop("fds_grew") <= 0, out
    assert out == {
        "child_sees_shared": [True, True],
        "parent_sees_child_writes": [1000.0, 10.0],
        "child_sees_parent_writes": [2000.0, 20.0],
        "came_back_same": True,
        "still_tensormp": True,
        "exitcode": 0,
        "remote_held_bytes": 0,  # the child's holds came back: no leak
        "plain_by_torch": True,
        "plain_same": True,
    }


KILLED = """
import json, multiprocessing, os, signal, time
import torch, tensormp as mp

def child(q, out):
    t = q.get(timeout=60)
    out.put(os.getpid())
    time.sleep(120)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    t = mp.share(torch.zeros(1 << 20))
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, out))
    p.start()
    q.put(t)
    out.get(timeout=60)
    del t  # the child is the only holder now
    held = mp.memory_stats()["remote_held_bytes"]
    os.kill(p.pid, signal.SIGKILL)
    p.join(30)
    deadline = time.monotonic() + 10
    while mp.memory_stats()["remote_held_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
    print(json.dumps({"held_while_alive": held,
                      "held_after_kill": mp.memory_stats()["remote_held_bytes"]}))
"""


@pytest.mark.timeout(120)
def test_a_killed_receiver_of_a_plain_queue_does_not_pin_the_block(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    out = _run([str(script)], tmp_path, 110)
    assert out["held_while_alive"] >= 4 << 20  # counted while the child held it...
    assert out["held_after_kill"] == 0  # ...and given back once it was SIGKILLed


SENDER_GONE = """
import json, multiprocessing
import torch, tensormp as mp

def child(q):
    q.put(mp.share(torch.ones(8)))  # the feeder flushes it before the child exits

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    p.join(60)
    try:
        q.get(timeout=30)
        print(json.dumps({"error": None}))
    except mp.HandleError as e:
        print(json.dumps({"error": str(e)}))
"""


@pytest.mark.timeout(120)
def test_a_plain_queue_item_whose_sender_exited_is_a_clear_error(tmp_path):
    script = tmp_path / "gone.py"
    script.write_text(SENDER_GONE)
    out = _run([str(script)], tmp_path, 110)
    assert out["error"] is not None and "its sender has exited" in out["error"]
    assert "use a tensormp Queue or Pipe" in out["error"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("torch_workers", [
    # The reference run without loader workers, 4 processes fewer (which keeps this in the
    # default suite): workers only change which process collates the batches. Runs differ
    # by hogwild's races alone (about 1% of test accuracy here, over seeds), well within the
    # tolerance.
    pytest.param(("0", "0"), id="reference-without-workers"),
    pytest.param(("1", "2"), id="reference-same-settings", marks=pytest.mark.slow),
])
def test_mnist_hogwild_with_the_import_swapped_trains_as_with_torch(tmp_path, torch_workers):
    """pytorch/examples' mnist_hogwild on the digits data, run as written (torch.multiprocessing)
    and with ``import tensormp as mp``, both at once. The tensormp run uses both settings of
    the issue: trainers' DataLoaders with one worker (mnist_hogwild's accelerator setting) and,
    after the trainers were joined, a parent DataLoader with two workers over the training set
    they had."""
    source = (SCRIPTS / "hogwild_digits.py").read_text()
    line = "import torch.multiprocessing as mp\n"
    assert line in source
    (tmp_path / "hogwild_torch.py").write_text(source)
    (tmp_path / "hogwild_tensormp.py").write_text(source.replace(line, "import tensormp as mp\n"))
    args = {"torch": torch_workers, "tensormp": ("1", "2")}
    procs = {
        name: subprocess.Popen([sys.executable, f"hogwild_{name}.py", *args[name]], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("torch", "tensormp")
    }
    results = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=380)
            assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
            results[name] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ref, got = results["torch"], results["tensormp"]
    assert ref["trainers"] == got["trainers"] == [0, 0]
    assert ref["test_acc"] > 0.8  # the program learns at all
    for key in ("train_acc", "test_acc"):
        assert abs(got[key] - ref[key]) <= 0.05, results  # hogwild updates race: not bit-equal


def _hold(t, ready, go):
    ready.set()
    go.wait(60)


@pytest.mark.timeout(120)
def test_direct_torch_share_refused_only_while_another_process_holds_it():
    """torch's reducer called directly (not through ForkingPickler) would move the storage out
    of memory a live process holds: refused, naming the fix; once that process is gone, not."""
    ctx = mp.get_context("spawn")
    t = torch.zeros(100)
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(t, ready, go))
    p.start()
    try:
        assert ready.wait(60)
        assert rt.in_tensormp_memory(t.untyped_storage())
        with pytest.raises(mp.HandleError, match=r"multiprocessing_context=tensormp\.get_context"):
            t.untyped_storage()._share_fd_cpu_()
    finally:
        go.set()
        p.join(60)
    assert p.exitcode == 0
    t.untyped_storage()._share_fd_cpu_()  # its only other holder exited: torch moves it
    assert t.is_shared() and not rt.in_tensormp_memory(t.untyped_storage())


# Issue 25 (DataLoader with small batches): a spawn worker of a tensormp DataLoader ends as a
# forked one does (atexit handlers run, output flushed, no module teardown), so the loader's join
# at the end of every epoch no longer waits for the teardown of torch (0.4 s of CPU per worker).
# The same run guards the steady state (profiled while finding that: no segment, no fd a batch).
ENDINGS = """
import atexit, json, os, sys
import torch, tensormp as mp

class Mark:
    def __init__(self, name):
        self.path = os.path.join(os.environ["ENDINGS_DIR"], name + "-teardown")
    def __del__(self, _open=open):  # runs only in the module teardown of an ending interpreter
        _open(self.path, "w").close()

def mark(name):
    with open(os.path.join(os.environ["ENDINGS_DIR"], name), "w"):
        pass

def arm(name):
    global _kept
    _kept = Mark(name)
    atexit.register(mark, name + "-atexit")
    # buffered: the end of the process must flush it (one string: the two workers' outputs
    # may interleave between print's writes otherwise)
    print(f"{name} says hi")

def init(worker_id):
    arm(f"w{worker_id}")

def plain():
    arm("plain")

if __name__ == "__main__":
    os.environ["ENDINGS_DIR"] = sys.argv[1]
    # 300 batches of 96 KiB: in steady state the workers recycle their blocks, so the parent
    # maps no new segment and opens no fd per batch.
    ds = torch.utils.data.TensorDataset(torch.arange(2400.0)[:, None].expand(2400, 3072))
    ctx = mp.get_context("spawn")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, worker_init_fn=init,
                                         multiprocessing_context=ctx)
    it = iter(loader)
    total, growth = 0.0, None
    for i, (x,) in enumerate(it):
        total += float(x[:, 0].sum())
        if i == 50:
            before = (mp.memory_stats()["segments"], len(os.listdir("/proc/self/fd")))
        if i == 290:
            after = (mp.memory_stats()["segments"], len(os.listdir("/proc/self/fd")))
            growth = [b - a for a, b in zip(before, after)]
    codes = [w.exitcode for w in it._workers]
    p = ctx.Process(target=plain)
    p.start()
    p.join(60)
    print(json.dumps({"total": total, "growth": growth, "workers": codes, "plain": p.exitcode,
                      "marks": sorted(os.listdir(sys.argv[1]))}))
"""


@pytest.mark.timeout(240)
def test_spawn_loader_workers_end_without_module_teardown(tmp_path):
    script = tmp_path / "endings.py"
    script.write_text(ENDINGS)
    marks = tmp_path / "marks"
    marks.mkdir()
    res = subprocess.run([sys.executable, str(script), str(marks)], capture_output=True,
                         text=True, timeout=230, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["total"] == float(sum(range(2400)))
    segments, fds = out["growth"]  # batches 50 to 290
    assert segments <= 1 and fds <= 1, out
    assert out["workers"] == [0, 0] and out["plain"] == 0
    # Loader workers: atexit handlers ran, no teardown. Any other spawn child: unchanged.
    assert out["marks"] == ["plain-atexit", "plain-teardown", "w0-atexit", "w1-atexit"]
    for name in ("w0", "w1", "plain"):
        assert f"{name} says hi" in res.stdout, (res.stdout, res.stderr[-3000:])
