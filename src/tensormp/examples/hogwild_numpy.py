"""Hogwild with numpy: N processes train one MLP in shared memory by SGD with hand-written
gradients, without locks (``python -m tensormp.examples.hogwild``).

* The model is an MLP ``64 -> hidden (ReLU) -> 10 (softmax)``. Its parameters ``W1 (64, H)``,
  ``b1 (H,)``, ``W2 (H, 10)``, ``b2 (10,)`` (float32) are allocated with :func:`tensormp.zeros`
  and initialised in place by the parent; they are the only copy of the model.
* :func:`tensormp.spawn` starts the workers. Each receives the parameters and the data as
  shared-memory handles (no copy), takes its own shard of the training set, reshuffles it every
  epoch and runs mini-batch SGD, writing each update into the shared parameters in place,
  without a lock (Hogwild!, Niu et al. 2011: an update that races with another may be partly
  lost, which SGD with a small step tolerates).
* Each worker works in preallocated buffers (:func:`make_workspace`): a step allocates nothing
  large. With numpy temporaries of 128 KiB and more, glibc maps each one afresh and the kernel
  zeroes and faults in its pages every step, which halved a fresh worker's speed.

The epochs between the parent and the workers are :mod:`tensormp.examples.hogwild_loop`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import tensormp

from .hogwild_data import Dataset
from .hogwild_loop import HogwildResult, Run, one_blas_thread, serve_epochs, worker_pipe

__all__ = ["init_params", "predict", "accuracy", "make_workspace", "sgd_step", "train"]


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


def _worker(rank: int, nworkers: int, params: dict[str, np.ndarray], x: np.ndarray,
            y: np.ndarray, conns: list[Any], batch_size: int, seed: int,
            fail_at: tuple[int, int] | None) -> None:
    """Worker ``rank``: SGD steps on its shard, into the shared ``params``."""
    conn = worker_pipe(conns, rank)
    w1, w2 = params["W1"], params["W2"]
    ws = make_workspace(batch_size, w1.shape[0], w1.shape[1], w2.shape[1])

    def run_epoch(order: np.ndarray, lr: float) -> float:
        loss_sum = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            xb = np.take(x, idx, axis=0, out=ws["x"][: len(idx)])
            loss_sum += sgd_step(params, xb, y[idx], lr, ws) * len(idx)
        return loss_sum

    with one_blas_thread():
        serve_epochs(conn, rank, nworkers, len(y), seed, fail_at, run_epoch)


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
) -> HogwildResult:
    """:func:`tensormp.examples.hogwild.train` with ``framework="numpy"``."""
    run = Run("numpy", workers, epochs, lr, seed, hidden, batch_size, data, log, fail_at)
    params = init_params(run.x.shape[1], hidden, run.n_out, seed)
    run.result.model = params
    test = run.data

    def evaluate() -> float:
        return accuracy(params, test.x_test, test.y_test)

    return run.train(_worker, (params,), evaluate)
