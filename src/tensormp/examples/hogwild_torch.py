"""Hogwild with torch: the numpy example's MLP as a ``torch.nn.Module`` trained by autograd and
``torch.optim`` (``python -m tensormp.examples.hogwild --framework torch``).

The same data, shards, batches, step sizes and initial weights as
:mod:`tensormp.examples.hogwild_numpy`, with a ``torch.nn.Sequential(Linear, ReLU, Linear)``.
The parent moves the model into shared memory in place with :func:`tensormp.share` (like
``Module.share_memory()``) and the workers receive it as spawn arguments: each parameter
arrives as a ``Parameter`` over the same memory. Gradients are *not* shared: each worker's
first ``backward()`` allocates its own, as Hogwild wants. With ``optimizer="adam"`` the parent
also shares the optimizer (:func:`tensormp.share` creates Adam's moments and step counts in
shared memory) and sends it in the same arguments as the model, so every worker's ``step()``
updates one shared Adam state; with ``"sgd"`` (the default) each worker steps with its own
stateless ``torch.optim.SGD``. Workers read the training set through ``torch.from_numpy`` over
the shared arrays (no copy) and run one intra-op thread each.

torch is imported when a function here runs, not with the module.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

import tensormp

from .hogwild_data import Dataset
from .hogwild_loop import HogwildResult, Run, one_blas_thread, serve_epochs, worker_pipe

__all__ = ["OPTIMIZERS", "init_torch_model", "torch_accuracy", "train"]

OPTIMIZERS = ("sgd", "adam")


def init_torch_model(n_in: int, hidden: int, n_out: int, seed: int) -> Any:
    """The MLP as ``torch.nn.Sequential(Linear(n_in, hidden), ReLU(), Linear(hidden, n_out))``,
    float32, moved into shared memory with :func:`tensormp.share`.

    Its initial weights are those of :func:`init_params` with the same ``seed`` (``Linear``
    stores ``W^T``), so both frameworks start from the same point.

    Raises:
        ImportError: torch is missing (``pip install 'tensormp[torch]'``).
    """
    torch = _import_torch()
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((n_in, hidden)) * np.sqrt(2.0 / n_in)
    w2 = rng.standard_normal((hidden, n_out)) * np.sqrt(1.0 / hidden)
    model = torch.nn.Sequential(
        torch.nn.Linear(n_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, n_out)
    )
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(w1.T))
        model[2].weight.copy_(torch.from_numpy(w2.T))
        model[0].bias.zero_()
        model[2].bias.zero_()
    return tensormp.share(model)


def torch_accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of ``x`` (``(n, 64)`` float32) that the torch ``model`` classifies as ``y``."""
    torch = _import_torch()
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((pred == y).mean())


def _import_torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "--framework torch needs torch: pip install 'tensormp[torch]'"
        ) from e
    return torch


def _worker(rank: int, nworkers: int, model: Any, optimizer: Any, x: np.ndarray, y: np.ndarray,
            conns: list[Any], batch_size: int, seed: int,
            fail_at: tuple[int, int] | None) -> None:
    """Worker ``rank``: autograd steps on its shard, with ``optimizer`` (shared) or a local SGD."""
    import torch
    import torch.nn.functional as F

    conn = worker_pipe(conns, rank)
    torch.set_num_threads(1)
    params = list(model.parameters())
    if optimizer is None:
        optimizer = torch.optim.SGD(params, lr=0.0)  # stateless: nothing to share
    else:
        if any(p is not q for p, q in zip(params, optimizer.param_groups[0]["params"])):
            raise RuntimeError(
                "the shared optimizer's parameters are not the model's: send the model and the "
                "optimizer in the same message (the same spawn arguments)"
            )
        # In torch 2.13 the first step() of an unpickled optimizer imports torch._dynamo
        # (about 1 s): import it now, before the clock starts.
        import torch._dynamo  # noqa: F401
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)  # views of the shared arrays
    xb_buf = torch.empty((batch_size, x.shape[1]), dtype=xt.dtype)

    def run_epoch(order_np: np.ndarray, lr: float) -> float:
        for group in optimizer.param_groups:
            group["lr"] = lr
        order = torch.from_numpy(order_np)
        loss_sum = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            xb = torch.index_select(xt, 0, idx, out=xb_buf[: len(idx)])
            # Gradients stay local: the first backward() allocates them in this process, and
            # zero_grad(set_to_none=False) reuses them from then on.
            optimizer.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(xb), yt[idx])
            loss.backward()
            optimizer.step()  # in place, into the shared parameters (and Adam state)
            loss_sum += loss.item() * len(idx)
        return loss_sum

    with one_blas_thread():
        serve_epochs(conn, rank, nworkers, len(y), seed, fail_at, run_epoch)


@contextlib.contextmanager
def _one_torch_thread() -> Any:
    """Limit torch's intra-op threads in this process to one while the context is open."""
    torch = _import_torch()
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def train(
    workers: int = 2,
    epochs: int = 20,
    lr: float = 0.05,
    seed: int = 0,
    hidden: int = 1024,
    batch_size: int = 64,
    data: Dataset | None = None,
    log: Any = None,
    fail_at: tuple[int, int] | None = None,
    optimizer: str = "sgd",
) -> HogwildResult:
    """:func:`tensormp.examples.hogwild.train` with ``framework="torch"``.

    Raises:
        ValueError: ``optimizer`` is not one of :data:`OPTIMIZERS` (or a bad number).
        ImportError: torch is missing.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    run = Run("torch", workers, epochs, lr, seed, hidden, batch_size, data, log, fail_at)
    model = init_torch_model(run.x.shape[1], hidden, run.n_out, seed)
    opt = None
    if optimizer == "adam":
        opt = tensormp.share(_import_torch().optim.Adam(model.parameters(), lr=lr))
    run.result.model, run.result.optimizer = model, opt
    test = run.data

    def evaluate() -> float:
        return torch_accuracy(model, test.x_test, test.y_test)

    return run.train(_worker, (model, opt), evaluate, threads=_one_torch_thread)
