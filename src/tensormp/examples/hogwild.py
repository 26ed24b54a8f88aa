"""Hogwild training with numpy or torch: N processes update one MLP in shared memory, without
locks.

Run it::

    python -m tensormp.examples.hogwild --workers 2 --epochs 20 --lr 0.05 --seed 0
    python -m tensormp.examples.hogwild --framework torch          # the same MLP in torch
    python -m tensormp.examples.hogwild --framework torch --optimizer adam --lr 0.002

What happens
------------
* The parent loads scikit-learn's bundled ``load_digits`` (1797 images of 8x8 pixels, no
  download), splits it 80/20 into train/test with a fixed seed (stratified), adds copies of
  the training images shifted by one pixel in each direction (5x: 7185 samples, so an epoch is
  long enough to time), standardises the pixels and copies the training set into shared
  memory once (:func:`tensormp.share`).
* The model is an MLP ``64 -> hidden (ReLU) -> 10 (softmax)``. Its parameters ``W1 (64, H)``,
  ``b1 (H,)``, ``W2 (H, 10)``, ``b2 (10,)`` (float32) are allocated with :func:`tensormp.zeros`
  and initialised in place by the parent; they are the only copy of the model.
* :func:`tensormp.spawn` starts the workers. Each receives the parameters and the data as
  shared-memory handles (no copy), takes its own shard of the training set (every N-th sample
  of a seeded permutation, the ``DistributedSampler`` idea), reshuffles it every epoch and
  runs mini-batch SGD with hand-written gradients, writing each update into the shared
  parameters in place, without a lock (Hogwild!, Niu et al. 2011: an update that races with
  another may be partly lost, which SGD with a small step tolerates).

With torch (``--framework torch``)
----------------------------------
The same data, shards, batches, step sizes and initial weights, with a
``torch.nn.Sequential(Linear, ReLU, Linear)`` trained by autograd and ``torch.optim``. The
parent moves the model into shared memory in place with :func:`tensormp.share` (like
``Module.share_memory()``) and the workers receive it as spawn arguments: each parameter
arrives as a ``Parameter`` over the same memory. Gradients are *not* shared: each worker's
first ``backward()`` allocates its own, as Hogwild wants. With ``--optimizer adam`` the parent
also shares the optimizer (:func:`tensormp.share` creates Adam's moments and step counts in
shared memory) and sends it in the same arguments as the model, so every worker's ``step()``
updates one shared Adam state; with ``sgd`` (the default) each worker steps with its own
stateless ``torch.optim.SGD``. Workers read the training set through ``torch.from_numpy`` over
the shared arrays (no copy) and run one intra-op thread each.

Epoch protocol
--------------
One duplex tensormp ``Pipe`` per worker; the worker holds one end, the parent the other::

    worker -> parent   ("ready",)                         once, data mapped, before the clock
    parent -> worker   ("go", lr) | ("stop",)             run one epoch with step lr, or return
    worker -> parent   ("done", epoch, loss_sum, samples) after each epoch

The parent waits for every worker's ``done``, then evaluates held-out accuracy by reading the
shared parameters directly (the workers are waiting, so the numbers belong to exactly that
epoch), then sends the next ``go`` (the step size follows a cosine from ``lr`` to ``lr/10``).
While it waits it polls the spawn ``ProcessContext``: a worker that raised ends the run with
:class:`tensormp.ProcessRaisedException` carrying the worker's traceback, and on every exit
path (Ctrl-C included) the workers still running are stopped before the exception leaves.

Measuring the speed-up fairly
-----------------------------
* 1 and N workers run the identical code path: spawned processes, the same samples per epoch
  in total (N shards of ``n_train / N``), batch size, step sizes and initial weights.
* Every worker, and the parent while it trains, limits its BLAS/OpenMP pools to one thread
  (``threadpoolctl``). Otherwise 1 worker would quietly use both cores through BLAS threads,
  and the parent's evaluation would leave OpenBLAS threads busy-waiting on a core the workers
  need (that alone turned a 1.8x speed-up into 1.0x here).
* Each worker works in preallocated buffers (:func:`make_workspace`): a step allocates nothing
  large. With numpy temporaries of 128 KiB and more, glibc maps each one afresh and the
  kernel zeroes and faults in its pages every step, which halved a fresh worker's speed.
* Mini-batches of 64: every step rewrites all of ``W1`` (256 KiB with 1024 hidden units) and
  the cache lines then move between the cores; the larger the batch, the more arithmetic per
  moved byte (with batches of 32 this cost about 15%).
* The clock runs only while workers train (from ``go`` to the last ``done`` of each epoch, the
  per-epoch synchronisation included); process start-up and evaluation are excluded for both
  and show in the wall time. :attr:`HogwildResult.median_samples_per_s` (median over epochs)
  is what the demo compares: on a machine shared with other work it is steadier than the
  total, and on an idle machine the two agree.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, cast

import numpy as np

import tensormp

from . import check_processes, interrupted, stop_processes

if TYPE_CHECKING:
    from tensormp.connection import Connection

__all__ = [
    "Dataset",
    "HogwildResult",
    "load_data",
    "nudge",
    "init_params",
    "make_workspace",
    "sgd_step",
    "predict",
    "init_torch_model",
    "torch_accuracy",
    "train",
    "main",
]

FRAMEWORKS = ("numpy", "torch")
OPTIMIZERS = ("sgd", "adam")
_POLL_S = 0.05  # how often the parent checks the workers while it waits
_STEP_TIMEOUT_S = 300.0  # the longest the parent waits for one epoch or for start-up
_GONE_TIMEOUT_S = 5.0  # how long a broken pipe may wait for spawn to report the failure


@dataclass
class Dataset:
    """Digits split into train/test, pixels standardised (float32), labels int64.

    Attributes:
        x_train: ``(n_train, 64)`` float32.
        y_train: ``(n_train,)`` int64 in ``0..9``.
        x_test: ``(n_test, 64)`` float32.
        y_test: ``(n_test,)`` int64.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass
class HogwildResult:
    """What one training run measured.

    Attributes:
        workers: number of worker processes.
        accuracy: held-out accuracy after each epoch (fraction in ``[0, 1]``).
        loss: mean training cross-entropy of each epoch.
        epoch_seconds: seconds each epoch's training took (``go`` to the last ``done``).
        samples: training samples processed, all workers and epochs.
        wall_seconds: the whole run: process start, training, evaluation and shutdown.
        framework: ``"numpy"`` or ``"torch"``.
        model: the trained model, in shared memory: the numpy parameter dict of
            :func:`init_params`, or the ``torch.nn.Module`` of :func:`init_torch_model`.
        optimizer: the shared ``torch.optim.Optimizer`` (torch with ``optimizer="adam"``),
            else None.
    """

    workers: int
    accuracy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    epoch_seconds: list[float] = field(default_factory=list)
    samples: int = 0
    wall_seconds: float = 0.0
    framework: str = "numpy"
    model: Any = field(default=None, repr=False)
    optimizer: Any = field(default=None, repr=False)

    @property
    def train_seconds(self) -> float:
        """Seconds the workers spent training (sum of :attr:`epoch_seconds`)."""
        return float(sum(self.epoch_seconds))

    @property
    def samples_per_s(self) -> float:
        """Training throughput: :attr:`samples` / :attr:`train_seconds`."""
        return self.samples / self.train_seconds if self.train_seconds > 0 else 0.0

    @property
    def median_samples_per_s(self) -> float:
        """Median over epochs of each epoch's samples/s: robust to a burst of other load."""
        if not self.epoch_seconds:
            return 0.0
        per_epoch = self.samples / len(self.epoch_seconds)
        return float(statistics.median(per_epoch / t for t in self.epoch_seconds))


# -- data and model ------------------------------------------------------------------------------
def nudge(images: np.ndarray) -> np.ndarray:
    """The images and their copies shifted by one pixel up, down, left and right (zero fill).

    The augmentation of scikit-learn's RBM digits example: 5x the data, same labels order
    ``[originals, up, down, left, right]``.

    Args:
        images: ``(n, 64)`` flattened 8x8 images.

    Returns:
        ``(5 n, 64)`` array of the same dtype.
    """
    img = images.reshape(-1, 8, 8)
    out = [img]
    for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        shifted = np.zeros_like(img)
        src_y, dst_y = slice(max(dy, 0), 8 + min(dy, 0)), slice(max(-dy, 0), 8 + min(-dy, 0))
        src_x, dst_x = slice(max(dx, 0), 8 + min(dx, 0)), slice(max(-dx, 0), 8 + min(-dx, 0))
        shifted[:, dst_y, dst_x] = img[:, src_y, src_x]
        out.append(shifted)
    return np.concatenate(out).reshape(-1, 64)


def load_data(seed: int = 0, test_fraction: float = 0.2, augment: bool = True) -> Dataset:
    """scikit-learn's ``load_digits``, split with ``seed``, augmented and standardised.

    The split is stratified (1437 train / 360 test images with the default fraction). With
    ``augment`` the training images are augmented with :func:`nudge` (5x: 7185 samples); the
    test set is left alone. Pixels (0..16) are scaled with the training set's per-pixel mean and
    ``std + 0.1`` (the 0.1 keeps always-blank pixels finite).

    Raises:
        ImportError: scikit-learn is missing (``pip install 'tensormp[examples]'``).
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the examples need scikit-learn and matplotlib: pip install 'tensormp[examples]'"
        ) from e
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    if augment:
        x_train, y_train = nudge(x_train), np.tile(y_train, 5)
    mean = x_train.mean(axis=0)
    scale = x_train.std(axis=0) + np.float32(0.1)
    return Dataset(
        ((x_train - mean) / scale).astype(np.float32),
        y_train,
        ((x_test - mean) / scale).astype(np.float32),
        y_test,
    )


def init_params(n_in: int, hidden: int, n_out: int, seed: int) -> dict[str, np.ndarray]:
    """MLP parameters in shared memory, initialised in place (He for ``W1``, 1/sqrt(H) for ``W2``).

    Returns:
        ``{"W1": (n_in, hidden), "b1": (hidden,), "W2": (hidden, n_out), "b2": (n_out,)}``,
        float32 arrays allocated with :func:`tensormp.zeros`: they cross to workers as handles
        and every process that holds them writes the same memory.
    """
    rng = np.random.default_rng(seed)
    params = {
        "W1": tensormp.zeros((n_in, hidden), np.float32),
        "b1": tensormp.zeros(hidden, np.float32),
        "W2": tensormp.zeros((hidden, n_out), np.float32),
        "b2": tensormp.zeros(n_out, np.float32),
    }
    params["W1"][...] = rng.standard_normal((n_in, hidden)) * np.sqrt(2.0 / n_in)
    params["W2"][...] = rng.standard_normal((hidden, n_out)) * np.sqrt(1.0 / hidden)
    return params


def predict(params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Class predictions ``(n,)`` int64 for inputs ``x`` of shape ``(n, 64)``."""
    h = np.maximum(x @ params["W1"] + params["b1"], 0)
    return np.asarray((h @ params["W2"] + params["b2"]).argmax(axis=1))


def accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Fraction of ``x`` classified as ``y``."""
    return float((predict(params, x) == y).mean())


def make_workspace(batch_size: int, n_in: int, hidden: int, n_out: int) -> dict[str, np.ndarray]:
    """Scratch buffers for :func:`sgd_step` (float32, private to the calling process).

    With them a step allocates nothing large: without them every ``(batch, hidden)``
    temporary of 128 KiB or more is a fresh ``mmap`` (glibc's threshold) whose pages the
    kernel must zero and fault in, which halves the speed of a freshly started worker.
    """
    f32 = np.float32
    return {
        "x": np.empty((batch_size, n_in), f32),
        "z": np.empty((batch_size, hidden), f32),
        "h": np.empty((batch_size, hidden), f32),
        "mask": np.empty((batch_size, hidden), bool),
        "g": np.empty((batch_size, n_out), f32),
        "dw1": np.empty((n_in, hidden), f32),
        "db1": np.empty(hidden, f32),
        "dw2": np.empty((hidden, n_out), f32),
        "db2": np.empty(n_out, f32),
    }


def sgd_step(
    params: dict[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    lr: float,
    ws: dict[str, np.ndarray] | None = None,
) -> float:
    """One SGD step on a mini-batch, written into ``params`` in place without a lock.

    Forward ``z = x W1 + b1``, ``h = relu(z)``, ``p = softmax(h W2 + b2)``; the loss is the
    mean cross-entropy. Gradients by hand: ``g = (p - onehot(y)) / n``, ``dW2 = h^T g``,
    ``db2 = sum(g)``, ``dz = (g W2^T) * (z > 0)``, ``dW1 = x^T dz``, ``db1 = sum(dz)``. Every
    gradient is computed before any parameter is written; other processes may write the
    parameters meanwhile (Hogwild).

    Args:
        params: as from :func:`init_params` (shared or not).
        x: ``(n, n_in)`` float32 batch.
        y: ``(n,)`` int labels.
        lr: step size.
        ws: buffers from :func:`make_workspace` for a batch size >= ``n`` (default: fresh).

    Returns:
        The batch's mean cross-entropy before the step.
    """
    w1, b1, w2, b2 = params["W1"], params["b1"], params["W2"], params["b2"]
    n = len(y)
    if ws is None:
        ws = make_workspace(n, w1.shape[0], w1.shape[1], w2.shape[1])
    rows = np.arange(n)
    z = np.matmul(x, w1, out=ws["z"][:n])
    z += b1
    h = np.maximum(z, 0, out=ws["h"][:n])
    g = np.matmul(h, w2, out=ws["g"][:n])
    g += b2
    g -= g.max(axis=1, keepdims=True)
    np.exp(g, out=g)
    g /= g.sum(axis=1, keepdims=True)  # softmax probabilities
    loss = float(-np.log(np.maximum(g[rows, y], 1e-12)).mean())
    g[rows, y] -= 1
    g *= np.float32(lr / n)  # lr * dLoss/dlogits: the products below are the steps
    dw2 = np.matmul(h.T, g, out=ws["dw2"])
    db2 = np.sum(g, axis=0, out=ws["db2"])
    dz = np.matmul(g, w2.T, out=h)  # h is no longer needed
    dz *= np.greater(z, 0, out=ws["mask"][:n])
    dw1 = np.matmul(x.T, dz, out=ws["dw1"])
    db1 = np.sum(dz, axis=0, out=ws["db1"])
    w1 -= dw1
    b1 -= db1
    w2 -= dw2
    b2 -= db2
    return loss


def step_size(lr: float, epoch: int, epochs: int) -> float:
    """The step size of ``epoch`` (0-based): cosine decay from ``lr`` to ``lr / 10``."""
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * epoch / epochs)))


# -- worker --------------------------------------------------------------------------------------
def _worker(
    rank: int,
    nworkers: int,
    params: dict[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    conn: Any,
    batch_size: int,
    seed: int,
    fail_at: tuple[int, int] | None,
) -> None:
    """Body of worker ``rank``: the protocol in the module notes (the step size comes with
    each ``go``)."""
    shard = np.random.default_rng(seed).permutation(len(y))[rank::nworkers]
    w1, w2 = params["W1"], params["W2"]
    ws = make_workspace(batch_size, w1.shape[0], w1.shape[1], w2.shape[1])
    conn.send(("ready",))
    epoch = 0
    while True:
        msg = conn.recv()
        if msg[0] != "go":
            break
        lr = msg[1]
        if fail_at is not None and fail_at == (rank, epoch):
            raise RuntimeError(f"injected failure in worker {rank} at epoch {epoch}")
        order = np.random.default_rng((seed, rank, epoch)).permutation(shard)
        loss_sum = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            xb = np.take(x, idx, axis=0, out=ws["x"][: len(idx)])
            loss_sum += sgd_step(params, xb, y[idx], lr, ws) * len(idx)
        conn.send(("done", epoch, loss_sum, len(order)))
        epoch += 1
    conn.close()


# -- torch ---------------------------------------------------------------------------------------
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


def _torch_worker(
    rank: int,
    nworkers: int,
    model: Any,
    optimizer: Any,
    x: np.ndarray,
    y: np.ndarray,
    conn: Any,
    batch_size: int,
    seed: int,
    fail_at: tuple[int, int] | None,
) -> None:
    """:func:`_worker` with torch: autograd, and ``optimizer`` (shared) or a local SGD."""
    import torch
    import torch.nn.functional as F

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
    shard = np.random.default_rng(seed).permutation(len(y))[rank::nworkers]
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)  # views of the shared arrays
    xb_buf = torch.empty((batch_size, x.shape[1]), dtype=xt.dtype)
    conn.send(("ready",))
    epoch = 0
    while True:
        msg = conn.recv()
        if msg[0] != "go":
            break
        if fail_at is not None and fail_at == (rank, epoch):
            raise RuntimeError(f"injected failure in worker {rank} at epoch {epoch}")
        for group in optimizer.param_groups:
            group["lr"] = msg[1]
        order = torch.from_numpy(np.random.default_rng((seed, rank, epoch)).permutation(shard))
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
        conn.send(("done", epoch, loss_sum, len(order)))
        epoch += 1
    conn.close()


def _torch_worker_entry(rank: int, nworkers: int, model: Any, optimizer: Any, x: Any, y: Any,
                        conns: list[Any], *rest: Any) -> None:
    """:func:`_worker_entry` for :func:`_torch_worker`."""
    conn = conns[rank]
    for i, other in enumerate(conns):
        if i != rank:
            other.close()
    with one_blas_thread():
        _torch_worker(rank, nworkers, model, optimizer, x, y, conn, *rest)


@contextlib.contextmanager
def _torch_threads(framework: str, n: int) -> Any:
    """Limit torch's intra-op threads in this process while the context is open (torch only)."""
    if framework != "torch":
        yield
        return
    torch = _import_torch()
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- parent --------------------------------------------------------------------------------------
def one_blas_thread() -> contextlib.AbstractContextManager[Any]:
    """Limit BLAS and OpenMP pools in this process to one thread while the context is open.

    Uses ``threadpoolctl`` (a scikit-learn dependency, so present with the ``examples``
    extra); without it, a no-op.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - depends on the environment
        return contextlib.nullcontext()
    limits: contextlib.AbstractContextManager[Any] = threadpool_limits(limits=1)
    return limits


def _worker_gone(procs: Any, rank: int, when: str) -> None:
    """Worker ``rank``'s pipe broke: raise spawn's account of why (with its traceback).

    Raises:
        tensormp.ProcessRaisedException, tensormp.ProcessExitedException: from the context.
        RuntimeError: the context has no failure to report within a few seconds.
    """
    deadline = time.monotonic() + _GONE_TIMEOUT_S
    while time.monotonic() < deadline:
        if procs.join(timeout=_POLL_S):
            break
    raise RuntimeError(f"hogwild worker {rank} closed its pipe {when}")


def _send_all(conns: list[Any], procs: Any, msg: tuple[Any, ...]) -> None:
    """Send ``msg`` to every worker; a broken pipe raises the worker's failure instead."""
    for rank, conn in enumerate(conns):
        try:
            conn.send(msg)
        except OSError:
            _worker_gone(procs, rank, f"before receiving {msg[0]!r}")


def _gather(conns: list[Any], procs: Any, expect: str) -> list[tuple[Any, ...]]:
    """One message from every worker (``expect`` is its tag), checking on the workers meanwhile.

    Raises:
        tensormp.ProcessRaisedException: a worker raised (its traceback is in the message).
        tensormp.ProcessExitedException: a worker died (signal or exit code).
        RuntimeError: workers exited or spoke out of turn.
        TimeoutError: nothing for ``_STEP_TIMEOUT_S`` seconds.
    """
    out: list[tuple[Any, ...] | None] = [None] * len(conns)
    pending = {conn: rank for rank, conn in enumerate(conns)}
    deadline = time.monotonic() + _STEP_TIMEOUT_S
    while pending:
        ready = cast("list[Connection]", wait(list(pending), timeout=_POLL_S))
        for conn in ready:
            rank = pending.pop(conn)
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                _worker_gone(procs, rank, f"before sending '{expect}'")
            if msg[0] != expect:
                raise RuntimeError(f"hogwild worker {rank} sent {msg!r}, expected '{expect}'")
            out[rank] = msg
        if not ready:
            check_processes(procs, f"'{expect}'")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"hogwild workers {sorted(pending.values())} sent no '{expect}' within "
                    f"{_STEP_TIMEOUT_S:.0f} s"
                )
    return out  # type: ignore[return-value]


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
    framework: str = "numpy",
    optimizer: str = "sgd",
) -> HogwildResult:
    """Train the MLP with ``workers`` Hogwild processes; the parent evaluates after each epoch.

    Args:
        workers: number of worker processes (>= 1).
        epochs: passes over the training set (all shards together make one pass).
        lr: SGD step size.
        seed: seeds the split (if ``data`` is None), the initial weights and the shards.
        hidden: width of the hidden layer.
        batch_size: mini-batch size of each worker.
        data: a :class:`Dataset` (default: ``load_data(seed)``).
        log: called with one line of text per epoch (e.g. ``print``), or None.
        fail_at: ``(rank, epoch)``: that worker raises ``RuntimeError`` at the start of that
            epoch (to see how a failing worker ends the run).
        framework: ``"numpy"`` (hand-written gradients) or ``"torch"`` (autograd).
        optimizer: torch only: ``"sgd"`` (each worker's own, stateless) or ``"adam"`` (one
            Adam state in shared memory, updated by every worker; try ``lr=0.002``).

    Returns:
        A :class:`HogwildResult`.

    Raises:
        ValueError: a bad argument.
        ImportError: ``framework="torch"`` without torch installed.
        tensormp.ProcessRaisedException: a worker raised; the message holds its traceback.
        KeyboardInterrupt: Ctrl-C; every worker has been stopped before it propagates.
    """
    if workers < 1 or epochs < 1 or batch_size < 1 or hidden < 1:
        raise ValueError(
            f"workers, epochs, batch_size and hidden must be >= 1 (got {workers}, {epochs}, "
            f"{batch_size}, {hidden})"
        )
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    if optimizer not in OPTIMIZERS or (framework == "numpy" and optimizer != "sgd"):
        raise ValueError(
            f"optimizer must be one of {OPTIMIZERS} (torch) or 'sgd' (numpy), got {optimizer!r} "
            f"with framework {framework!r}"
        )
    t_start = time.perf_counter()
    data = load_data(seed) if data is None else data
    if workers > len(data.y_train):
        raise ValueError(f"{workers} workers for {len(data.y_train)} training samples")
    x = tensormp.share(np.ascontiguousarray(data.x_train, np.float32))
    y = tensormp.share(np.ascontiguousarray(data.y_train, np.int64))
    n_out = int(data.y_train.max()) + 1
    result = HogwildResult(workers, framework=framework)
    entry: Callable[..., None]
    shared: tuple[Any, ...]
    if framework == "torch":
        model = init_torch_model(x.shape[1], hidden, n_out, seed)
        opt = None
        if optimizer == "adam":
            opt = tensormp.share(_import_torch().optim.Adam(model.parameters(), lr=lr))
        entry, shared = _torch_worker_entry, (model, opt)
        result.model, result.optimizer = model, opt

        def evaluate() -> float:
            return torch_accuracy(model, data.x_test, data.y_test)
    else:
        params = init_params(x.shape[1], hidden, n_out, seed)
        entry, shared = _worker_entry, (params,)
        result.model = params

        def evaluate() -> float:
            return accuracy(params, data.x_test, data.y_test)

    ctx = tensormp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(workers)]
    conns = [parent_end for parent_end, _ in pipes]
    # spawn() gives every worker the same arguments: the child ends go in a list, and each
    # worker keeps the one at its rank.
    args = (workers, *shared, x, y, [child for _, child in pipes], batch_size, seed, fail_at)
    procs = None
    try:
        # The parent's own BLAS calls (the evaluation) use one thread as well: OpenBLAS threads
        # busy-wait for a while after a parallel call, taking a core away from the workers.
        with one_blas_thread(), _torch_threads(framework, 1):
            procs = tensormp.spawn(entry, args=args, nprocs=workers, join=False)
            for _, child_end in pipes:
                child_end.close()  # the workers hold theirs; EOF now means "worker gone"
            _gather(conns, procs, "ready")
            for epoch in range(epochs):
                t0 = time.perf_counter()
                _send_all(conns, procs, ("go", step_size(lr, epoch, epochs)))
                done = _gather(conns, procs, "done")
                result.epoch_seconds.append(time.perf_counter() - t0)
                samples = sum(msg[3] for msg in done)
                result.samples += samples
                result.loss.append(sum(msg[2] for msg in done) / samples)
                result.accuracy.append(evaluate())
                if log is not None:
                    log(
                        f"  epoch {epoch + 1:2d}/{epochs}  test accuracy "
                        f"{result.accuracy[-1]:6.2%}  loss {result.loss[-1]:.4f}  "
                        f"{samples / result.epoch_seconds[-1]:9,.0f} samples/s"
                    )
            _send_all(conns, procs, ("stop",))
            deadline = time.monotonic() + _STEP_TIMEOUT_S
            while not procs.join(timeout=_POLL_S):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"hogwild workers did not exit within {_STEP_TIMEOUT_S:.0f} s"
                    )
    finally:
        if procs is not None:
            stop_processes(procs)
        for parent_end, child_end in pipes:
            parent_end.close()
            child_end.close()
    result.wall_seconds = time.perf_counter() - t_start
    return result


def _worker_entry(rank: int, nworkers: int, params: Any, x: Any, y: Any, conns: list[Any],
                  *rest: Any) -> None:
    """Picks this rank's pipe end and closes the others' copies, then runs :func:`_worker`."""
    conn = conns[rank]
    for i, other in enumerate(conns):
        if i != rank:
            other.close()
    with one_blas_thread():
        _worker(rank, nworkers, params, x, y, conn, *rest)


# -- command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command-line options (shared with the demo)."""
    p = argparse.ArgumentParser(
        prog="python -m tensormp.examples.hogwild",
        description="Hogwild training of an MLP on scikit-learn's digits: N processes update "
        "shared parameters in place without locks; prints test accuracy per epoch, samples/s "
        "and the speed-up over 1 worker.",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    p.add_argument("--lr", type=float, default=0.05, help="SGD step size (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="split, initial weights, shards")
    p.add_argument("--hidden", type=int, default=1024, help="hidden units (default 1024)")
    p.add_argument("--batch-size", type=int, default=64, help="mini-batch per worker")
    p.add_argument(
        "--framework", choices=FRAMEWORKS, default="numpy",
        help="numpy with hand-written gradients (default), or torch with autograd",
    )
    p.add_argument(
        "--optimizer", choices=OPTIMIZERS, default="sgd",
        help="torch only: sgd (default; each worker's own) or adam (one Adam state in shared "
        "memory; use a smaller --lr, e.g. 0.002)",
    )
    p.add_argument(
        "--no-baseline", action="store_true",
        help="skip the 1-worker run that the speed-up is measured against",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (130 after Ctrl-C)."""
    opts = build_parser().parse_args(argv)
    if opts.workers < 1:
        build_parser().error("--workers must be >= 1")
    if opts.framework == "numpy" and opts.optimizer != "sgd":
        build_parser().error("--optimizer adam needs --framework torch")
    try:
        data = load_data(opts.seed)
        kw = dict(epochs=opts.epochs, lr=opts.lr, seed=opts.seed, hidden=opts.hidden,
                  batch_size=opts.batch_size, data=data, log=print,
                  framework=opts.framework, optimizer=opts.optimizer)
        what = "" if opts.framework == "numpy" else f" (torch, {opts.optimizer})"
        print(f"Hogwild{what}, {opts.workers} worker(s): {len(data.y_train)} train / "
              f"{len(data.y_test)} test digits, MLP 64-{opts.hidden}-10, batch {opts.batch_size}")
        run = train(workers=opts.workers, **kw)
        base = None
        if opts.workers > 1 and not opts.no_baseline:
            print("Baseline, 1 worker:")
            base = train(workers=1, **kw)
    except (KeyboardInterrupt, tensormp.ProcessExitedException) as e:
        if not interrupted(e):
            raise
        print("\ninterrupted (Ctrl-C): all workers stopped", file=sys.stderr)
        return 130
    print(f"final test accuracy {run.accuracy[-1]:.2%} with {opts.workers} worker(s); "
          f"{run.median_samples_per_s:,.0f} samples/s (median epoch; "
          f"{run.samples_per_s:,.0f} over the whole run)")
    if base is not None:
        print(f"1 worker: {base.median_samples_per_s:,.0f} samples/s (median epoch; "
              f"{base.samples_per_s:,.0f} overall), accuracy {base.accuracy[-1]:.2%}")
        print(f"speed-up with {opts.workers} workers: "
              f"{run.median_samples_per_s / base.median_samples_per_s:.2f}x "
              f"(whole run: {run.samples_per_s / base.samples_per_s:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
