"""torch tensors through tensormp (issue 8): CPU tensors, Parameters, grads, modules,
optimizers, DataLoader, import order, and the CUDA script (skipped without a GPU).

Every test runs under the autouse leak fixture (``conftest.py``). Children that need torch cost
about 1.5 s each to start (spawn, forkserver), so one child checks many cases.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tensormp as mp
from helpers import START_METHODS

torch = pytest.importorskip("torch")
from tensormp.reducers import torch as rt  # noqa: E402

pytestmark = pytest.mark.timeout(60)
SCRIPTS = Path(__file__).parent / "scripts"
IS_ROOT = os.geteuid() == 0

# Every dtype torch can share, with random bit patterns (NaNs included: bytes are compared).
DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
    torch.uint32, torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.complex32, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
]


def _random(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        return raw[:n] % 2 == 1
    return raw.view(dtype)


def _value_bytes(t: torch.Tensor | None) -> bytes | None:
    """The values of ``t`` as bytes, whatever its layout, conj/neg bits or quantization."""
    if t is None:
        return None
    t = t.detach()
    if t.is_quantized:
        t = t.int_repr()
    if t.layout is not torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).numpy()) if t.numel() else b""


def _describe(t: torch.Tensor) -> dict:
    strided = t.layout is torch.strided
    return {
        "type": type(t).__name__,
        "dtype": str(t.dtype),
        "shape": tuple(t.shape),
        "stride": t.stride() if strided else None,
        "offset": t.storage_offset() if strided else None,
        "requires_grad": t.requires_grad,
        "bytes": _value_bytes(t),
        "grad": _value_bytes(t.grad),
        "grad_shared": t.grad is not None and mp.is_shared(t.grad),
        "conj": t.is_conj(),
        "neg": t.is_neg(),
        "tensormp_shared": mp.is_shared(t),
        "torch_shared": t.is_shared() if strided else None,
        "storage": t.untyped_storage()._cdata if strided else None,
    }


# -- children (module level so spawn can import them) -----------------------------------------
def _one_thread() -> None:
    # A fork child inherits the parent's OpenMP state without its threads: its first parallel
    # region would hang (libgomp is not fork-safe, with torch.multiprocessing too).
    torch.set_num_threads(1)


WRITTEN = {"float32", "view", "torch-shared", "parameter"}  # the child adds 1 to these


def _tensor_child(inq, outq):
    """Describe each received dict of tensors; add 1 in place to the WRITTEN ones; keep them;
    then say whether a later tensor has the storage of an earlier one; echo a view back."""
    _one_thread()
    kept = []
    while True:
        cmd, payload = inq.get()
        if cmd == "describe":
            kept.append(payload)
            out = {name: _describe(t) for name, t in payload.items()}
            with torch.no_grad():
                for name in WRITTEN:
                    payload[name].add_(1)
                payload["parameter"].grad.add_(1)
            outq.put(out)
        elif cmd == "same":
            outq.put(payload.untyped_storage()._cdata == kept[0]["float32"].untyped_storage()._cdata)
        elif cmd == "echo":
            outq.put(kept[0]["float32"][1:])
        else:
            return


def _cases() -> dict[str, torch.Tensor]:
    cases: dict[str, torch.Tensor] = {f"dtype-{d}": _random(d) for d in DTYPES}
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    param = torch.nn.Parameter(torch.linspace(0, 1, 5))
    param.grad = torch.full((5,), 0.5)
    cplx = (torch.arange(4, dtype=torch.float32) * (1 + 2j)).to(torch.complex64)
    shared_by_torch = torch.arange(5.0)
    shared_by_torch.share_memory_()
    cases.update({
        "float32": torch.arange(10, dtype=torch.float32),
        "view": base[1:, ::2],  # offset 6, strides (6, 2)
        "same-storage": base[:1],  # a second view of `view`'s storage in the same message
        "transposed": base.T,
        "expanded": torch.arange(3.0).expand(4, 3),  # stride 0
        "zero-size": torch.empty((0, 3)),
        "0-d": torch.tensor(2.5),
        "parameter": param,
        "int-parameter": torch.nn.Parameter(torch.arange(3), requires_grad=False),
        "requires-grad": torch.ones(3, requires_grad=True),
        "conj": cplx.conj(),
        "neg": cplx.conj().imag,  # negative bit set
        "quantized": torch.quantize_per_tensor(torch.tensor([0.5, 1.0, 2.0]), 0.1, 3,
                                                torch.quint8),
        "sparse": torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,)),
        "torch-shared": shared_by_torch,
    })
    return cases


# -- the main transfer test, under every start method -------------------------------------------
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("method", START_METHODS)
def test_tensors_cross_like_torch_multiprocessing_and_better(method):
    ctx = mp.get_context(method)
    inq, outq = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_tensor_child, args=(inq, outq))
    p.start()
    try:
        cases = _cases()
        expected = {name: _value_bytes(t) for name, t in cases.items()}
        inq.put(("describe", cases))
        got = outq.get(timeout=40)

        for name, t in cases.items():
            d = got[name]
            assert d["bytes"] == expected[name], name
            assert (d["dtype"], d["shape"], d["requires_grad"]) == (
                str(t.dtype), tuple(t.shape), t.requires_grad), name
            if t.layout is torch.strided:
                assert (d["stride"], d["offset"]) == (t.stride(), t.storage_offset()), name
            assert d["tensormp_shared"], name
            if t.layout is torch.strided and t.untyped_storage().nbytes():
                # The sender's storage moved into shared memory in place (as torch).
                assert d["torch_shared"] and t.is_shared() and mp.is_shared(t), name
                assert name == "torch-shared" or rt.in_tensormp_memory(t.untyped_storage())

        assert got["parameter"]["type"] == "Parameter"
        assert got["int-parameter"]["type"] == "Parameter"
        assert got["requires-grad"]["type"] == "Tensor"
        assert got["conj"]["conj"] and got["neg"]["neg"]  # torch drops both bits
        assert got["same-storage"]["storage"] == got["view"]["storage"]
        assert got["transposed"]["storage"] == got["view"]["storage"]
        # .grad travels and is shared with the sender's grad (torch drops it).
        assert got["parameter"]["grad"] == _value_bytes(torch.full((5,), 0.5))
        assert got["parameter"]["grad_shared"]

        # The child's in-place writes are visible here.
        assert cases["float32"].tolist() == [float(i + 1) for i in range(10)]
        assert cases["view"][0, 0].item() == 7.0 and cases["transposed"][0, 1].item() == 7.0
        assert cases["torch-shared"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert cases["parameter"].grad.tolist() == [1.5] * 5
        assert torch.allclose(cases["parameter"].detach(), torch.linspace(0, 1, 5) + 1)

        # The same storage sent again arrives as the same storage; a view sent back arrives
        # as a view of the sender's own storage.
        inq.put(("same", cases["float32"][3:]))
        assert outq.get(timeout=20) is True
        inq.put(("echo", None))
        back = outq.get(timeout=20)
        assert back.untyped_storage()._cdata == cases["float32"].untyped_storage()._cdata
        assert back.data_ptr() == cases["float32"].data_ptr() + 4
    finally:
        inq.put(("stop", None))
        p.join(30)
    assert p.exitcode == 0


# -- the sender's side, in one process (a Pipe to itself) ---------------------------------------
def test_send_moves_the_storage_in_place_and_refuses_growth():
    a, b = mp.Pipe()
    try:
        t = torch.arange(10, dtype=torch.float32)
        v = t[2:5]  # made before the send: it moves with its storage
        assert not t.is_shared() and not mp.is_shared(t)
        a.send(t[::2])
        r = b.recv()
        assert t.is_shared() and mp.is_shared(t) and v.is_shared()
        assert v.data_ptr() == t.data_ptr() + 8 and v.tolist() == [2.0, 3.0, 4.0]
        assert r.untyped_storage()._cdata == t.untyped_storage()._cdata  # it came back
        assert r.stride() == (2,) and r.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
        v[0] = 100
        assert r[1].item() == 100

        # The storage is exactly the tensor's bytes: torch.save writes no more than for a
        # private tensor (not the block, not the 4 MiB arena).
        shared_file, private_file = io.BytesIO(), io.BytesIO()
        torch.save(t, shared_file)
        torch.save(t.clone(), private_file)
        assert len(shared_file.getvalue()) == len(private_file.getvalue())
        assert torch.equal(torch.load(io.BytesIO(shared_file.getvalue())), t)

        # Growing a shared tensor raises (torch 2.13 segfaults on its own shared tensors).
        for shared in (t, r):
            with pytest.raises(RuntimeError, match="not resizable"):
                shared.resize_(1000)
        t.resize_(5)  # shrinking keeps the storage
        assert t.is_shared()
    finally:
        a.close()
        b.close()


def _add_one_to_each(q, done, n):
    for _ in range(n):
        x = q.get(timeout=30)
        x += 1
    done.put("ok")


VIEWS_SCRIPT = """
import json, sys
import numpy as np, torch
import tensormp as mp
sys.path.insert(0, sys.argv[1])
from test_torch import _add_one_to_each

if __name__ == "__main__":
    a = mp.zeros(8, dtype=np.float32)
    t = torch.from_numpy(a)
    u = mp.share(torch.zeros(8))  # (tensormp's reducers load: then torch's channels carry both)
    ctx = torch.multiprocessing.get_context("fork")
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_add_one_to_each, args=(q, done, 2))
    p.start()
    q.put(t)
    q.put(u)
    done.get(timeout=30)
    p.join(30)
    print(json.dumps([p.exitcode, t.data_ptr() == a.ctypes.data, a.tolist(), u.tolist()]))
"""


def test_numpy_and_torch_views_of_one_shared_memory_stay_one(tmp_path):
    """``torch.from_numpy()`` of a tensormp array and ``.numpy()`` of a tensor in tensormp
    memory are that shared memory: they cross as handles and every view sees the receiver's
    writes (before: the tensor was moved into new memory, cut off from its array, and the
    ``.numpy()`` array crossed as a copy). torch's own channels carry such tensors the same way
    (in a child interpreter: the stdlib's fd sharer it starts lives as long as its process)."""
    a = mp.zeros(8, dtype=np.float32)
    t = torch.from_numpy(a)
    u = mp.share(torch.zeros(8))
    w = u.numpy()
    assert mp.is_shared(t) and t.is_shared() and mp.is_shared(w) and mp.is_shared(w[2:])
    t.share_memory_()  # already shared: not moved
    mp.share(t)
    assert t.data_ptr() == a.ctypes.data
    assert not mp.is_shared(torch.zeros(3).numpy()) and not mp.is_shared(np.frombuffer(b"abcdefgh"))
    ctx = mp.get_context("fork")
    q, done = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_add_one_to_each, args=(q, done, 4))
    p.start()
    for x in (t, a, u, w):
        q.put(x)
    assert done.get(timeout=30) == "ok"
    p.join(30)
    assert p.exitcode == 0
    assert t.data_ptr() == a.ctypes.data and a.tolist() == [2.0] * 8
    assert u.tolist() == [2.0] * 8 and w.tolist() == [2.0] * 8
    q.close()
    done.close()

    script = tmp_path / "views.py"
    script.write_text(VIEWS_SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [0, True, [1.0] * 8, [1.0] * 8]

    # A fresh interpreter in which tensormp has handled no tensor yet: the allocation loads
    # tensormp's torch handling, so torch sees the array's memory as shared at once.
    cold = (
        "import numpy as np, torch, tensormp as mp\n"
        "a = mp.zeros(4, dtype=np.float32); t = torch.from_numpy(a); p = t.data_ptr()\n"
        "shared = t.is_shared(); t.share_memory_(); t[0] = 9\n"
        "print(shared, t.data_ptr() == p, float(a[0]))\n"
    )
    res = subprocess.run([sys.executable, "-c", cold], capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["True", "True", "9.0"]


def test_non_leaf_tensor_is_refused_in_the_caller():
    q = mp.get_context("spawn").Queue()
    try:
        x = torch.ones(3, requires_grad=True) * 2
        with pytest.raises(RuntimeError, match="non-leaf tensor with requires_grad=True.*detach"):
            q.put(x)
        q.put(x.detach())  # the queue is still usable
        assert q.get(timeout=10).tolist() == [2.0, 2.0, 2.0]
    finally:
        q.close()
        q.join_thread()


# -- fds, producer exit, small /dev/shm ---------------------------------------------------------
def _send_small_tensors(q, n):
    _one_thread()
    for i in range(n):
        q.put(torch.full((16,), float(i)))
    q.close()
    q.join_thread()


def test_receiver_fds_stay_flat_keeping_5000_tensors():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_send_small_tensors, args=(q, 5000))
    p.start()
    before = len(os.listdir("/proc/self/fd"))
    kept = [q.get(timeout=30) for _ in range(5000)]
    grown = len(os.listdir("/proc/self/fd")) - before
    p.join(30)
    assert p.exitcode == 0
    assert [k[0].item() for k in kept[::1000]] == [0.0, 1000.0, 2000.0, 3000.0, 4000.0]
    assert all(mp.is_shared(k) for k in kept[::500])
    assert grown < 32, f"{grown} fds for 5000 kept tensors"  # torch: one fd per tensor


def test_producer_may_exit_before_the_consumer_reads():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_send_small_tensors, args=(q, 3))
    p.start()
    p.join(30)  # gone before anything is read: the fds were in flight in the socket
    assert p.exitcode == 0
    got = [q.get(timeout=10) for _ in range(3)]
    assert [g[0].item() for g in got] == [0.0, 1.0, 2.0] and all(g.is_shared() for g in got)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not IS_ROOT or not shutil.which("unshare"), reason="needs root and unshare")
def test_256_mib_tensor_with_64_mib_dev_shm(tmp_path):
    script = tmp_path / "big_tensor.py"
    script.write_text(textwrap.dedent("""
        import json, shutil, sys
        import torch
        import tensormp as mp

        def consumer(q, out):
            t = q.get()
            out.put((t.numel() * t.element_size(), float(t[::4096].sum())))

        if __name__ == "__main__":
            ctx = mp.get_context("fork")
            q, out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=consumer, args=(q, out))
            p.start()
            t = torch.ones(64 << 20)  # 256 MiB, private: moved into shared memory by put()
            q.put(t)
            nbytes, total = out.get(timeout=100)
            p.join(30)
            print(json.dumps({"nbytes": nbytes, "sum": total, "exitcode": p.exitcode,
                              "shared": t.is_shared(),
                              "shm_total": shutil.disk_usage("/dev/shm").total}))
    """))
    sh = f"mount -t tmpfs -o size=64m tmpfs /dev/shm && exec {sys.executable} {script}"
    res = subprocess.run(["unshare", "-m", "sh", "-c", sh], capture_output=True, text=True,
                         timeout=110, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["shm_total"] == 64 << 20  # it really ran with a 64 MiB /dev/shm
    assert out == {**out, "nbytes": 256 << 20, "sum": (64 << 20) / 4096, "exitcode": 0,
                   "shared": True}


# -- modules and optimizers -----------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


def test_share_module_and_torch_methods_keep_it_shared():
    m = _model()
    m(torch.randn(5, 4)).sum().backward()  # grads that exist at share() time are shared
    assert mp.share(m) is m and mp.is_shared(m)
    assert all(p.is_shared() and p.grad.is_shared() for p in m.parameters())
    assert all(b.is_shared() for b in m.buffers())  # running_mean, running_var, num_batches
    ptrs = [t.data_ptr() for t in m.state_dict().values()]
    grads = [p.grad.data_ptr() for p in m.parameters()]

    m.share_memory()  # torch's own: a no-op for tensormp memory
    torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(set_to_none=False)  # in place
    saved = io.BytesIO()
    torch.save(m.state_dict(), saved)
    m.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))  # copies in place
    assert [t.data_ptr() for t in m.state_dict().values()] == ptrs
    assert [p.grad.data_ptr() for p in m.parameters()] == grads
    assert all(p.grad.is_shared() and not p.grad.any() for p in m.parameters())
    private = io.BytesIO()
    torch.save(copy.deepcopy(m).state_dict(), private)
    assert len(saved.getvalue()) == len(private.getvalue())

    m.zero_grad()  # torch's default drops the grads: the next backward makes local ones
    m(torch.randn(5, 4)).sum().backward()
    assert all(not p.grad.is_shared() for p in m.parameters())
    assert all(p.is_shared() for p in m.parameters())


def test_share_optimizer_creates_the_state_a_fresh_optimizer_would_have():
    shared_model, private_model = _model(), _model()
    x = torch.randn(5, 4)
    for optim in (torch.optim.Adam, torch.optim.SGD):
        kw = {"momentum": 0.9} if optim is torch.optim.SGD else {}
        shared_opt = optim(shared_model.parameters(), lr=0.01, weight_decay=0.1, **kw)
        private_opt = optim(private_model.parameters(), lr=0.01, weight_decay=0.1, **kw)
        mp.share(shared_model)
        assert mp.share(shared_opt) is shared_opt and mp.is_shared(shared_opt)
        state = shared_opt.state[shared_model[0].weight]
        assert state and all(v.is_shared() for v in state.values())
        for _ in range(3):
            for model, opt in ((shared_model, shared_opt), (private_model, private_opt)):
                opt.zero_grad()
                model(x).pow(2).sum().backward()
                opt.step()
        for p, q in zip(shared_model.parameters(), private_model.parameters()):
            assert torch.equal(p, q), optim.__name__
    with pytest.raises(TypeError, match="take one training step first"):
        mp.share(torch.optim.LBFGS(shared_model.parameters()))


@pytest.mark.timeout(90)
def test_hogwild_with_a_shared_adam_state():
    pytest.importorskip("sklearn")
    from tensormp.examples import hogwild

    data = hogwild.load_data(0)
    r = hogwild.train(workers=2, epochs=3, hidden=128, lr=0.003, data=data,
                      framework="torch", optimizer="adam")
    assert r.accuracy[-1] >= 0.90, r.accuracy
    steps = 3 * sum(-(-len(shard) // 64) for shard in np.array_split(data.y_train, 2))
    count = r.optimizer.state[r.model[0].weight]["step"].item()
    # Both workers stepped one shared Adam state (racy increments may be lost: Hogwild).
    assert 0.9 * steps <= count <= steps, (count, steps)
    assert mp.is_shared(r.optimizer) and r.optimizer.state[r.model[0].weight]["exp_avg"].any()


# -- DataLoader -----------------------------------------------------------------------------------
class _Squares(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.full((3, 4), float(i)), i * i


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dataloader_batches_arrive_in_tensormp_memory():
    loader = torch.utils.data.DataLoader(
        _Squares(), batch_size=8, num_workers=2,
        multiprocessing_context=mp.get_context("spawn"),
    )
    seen = []
    for x, y in loader:
        # Workers collate into tensormp memory (torch's _new_shared, in a tensormp process);
        # the batch crosses as a handle.
        assert rt.in_tensormp_memory(x.untyped_storage()) and x.is_shared()
        assert mp.is_shared(y)
        assert torch.equal(x[:, 0, 0] ** 2, y.to(x.dtype))
        seen += y.tolist()
    assert seen == [i * i for i in range(40)]


# -- import order, plain stdlib queues, children without torch -------------------------------------
ORDER_SCRIPT = """
import json, sys

def child(q, out):
    out.put("torch" in sys.modules)  # started and received an array: no torch yet
    t = q.get()
    out.put(("torch" in sys.modules, t.tolist()))

def main(order):
    if order == "torch-first":
        import torch
        import tensormp as mp
    else:
        import tensormp as mp
        import torch
    import multiprocessing
    import numpy as np
    from tensormp.reducers import torch as rt
    res = {}
    a, b = mp.Pipe()
    t = torch.ones(4)
    a.send(t)
    res["tensormp_reducer_won"] = rt.in_tensormp_memory(t.untyped_storage())
    res["came_back_same"] = b.recv().untyped_storage()._cdata == t.untyped_storage()._cdata
    # A plain stdlib pipe (the global ForkingPickler, torch's reducers) carries tensormp
    # memory as tensormp memory: the same storage comes back, nothing is moved.
    s, r = multiprocessing.Pipe()
    s.send(t)
    res["stdlib_same"] = r.recv().untyped_storage()._cdata == t.untyped_storage()._cdata
    fresh = mp.share(torch.zeros(3))
    s.send(fresh)
    res["stdlib_kept"] = (r.recv().untyped_storage()._cdata == fresh.untyped_storage()._cdata
                          and rt.in_tensormp_memory(fresh.untyped_storage()))
    # A private tensor still goes through torch's reducer, into torch's shared memory.
    plain = torch.ones(2)
    s.send(plain)
    r.recv()
    res["stdlib_torch_own"] = plain.is_shared() and not rt.in_tensormp_memory(
        plain.untyped_storage())
    if order == "tensormp-first":
        ctx = mp.get_context("spawn")
        q, out = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child, args=(q, out))
        p.start()
        res["child_torch_before"] = out.get(timeout=30)
        q.put(torch.arange(3))
        res["child_after"] = out.get(timeout=60)
        p.join(30)
    print(json.dumps(res))

if __name__ == "__main__":
    main(sys.argv[1])
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("order", ["torch-first", "tensormp-first"])
def test_import_order_and_plain_stdlib_channels(tmp_path, order):
    script = tmp_path / "order.py"
    script.write_text(ORDER_SCRIPT)
    res = subprocess.run([sys.executable, str(script), order], capture_output=True, text=True,
                         timeout=80, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["tensormp_reducer_won"] and out["came_back_same"]
    assert out["stdlib_same"] and out["stdlib_kept"] and out["stdlib_torch_own"], out
    if order == "tensormp-first":
        assert out["child_torch_before"] is False  # a child that never touches torch
        assert out["child_after"] == [True, [0, 1, 2]]


# -- CUDA ---------------------------------------------------------------------------------------
def test_cuda_handle_of_an_exited_producer_is_a_clear_error():
    """The consumer-side checks, without a GPU: nothing of CUDA is touched before them."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    never_called = ("torch.multiprocessing.reductions.rebuild_cuda_tensor is not reached",)
    with pytest.raises(mp.HandleError, match=f"process {gone.pid}: that process has exited.*"
                       "producer must stay alive"):
        rt._rebuild_cuda_tensor(gone.pid, 12345, print, never_called, None, False, False)
    if not torch.cuda.is_available():
        me = os.getpid()
        with pytest.raises(mp.HandleError, match="CUDA is not available in this process"):
            rt._rebuild_cuda_tensor(me, rt.process_start_time(me), print, never_called, None,
                                    False, False)


@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_check_script():
    res = subprocess.run([sys.executable, str(SCRIPTS / "cuda_check.py")], capture_output=True,
                         text=True, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "FAIL" not in res.stdout
