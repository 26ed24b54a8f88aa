"""The control loop that the numpy and the torch Hogwild examples share: the epochs between the
parent and its workers, and what a run measured (:mod:`tensormp.examples.hogwild` has the
overview).

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

A worker trains on its own shard of the training set (every N-th sample of a seeded
permutation, the ``DistributedSampler`` idea), reshuffled every epoch (:func:`serve_epochs`).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import TYPE_CHECKING, Any, cast

import numpy as np

import tensormp

from . import check_processes, stop_processes
from .hogwild_data import Dataset, load_data

if TYPE_CHECKING:
    from tensormp.connection import Connection

__all__ = [
    "HogwildResult",
    "step_size",
    "one_blas_thread",
    "check_args",
    "serve_epochs",
    "worker_pipe",
    "Run",
]

_POLL_S = 0.05  # how often the parent checks the workers while it waits
_STEP_TIMEOUT_S = 300.0  # the longest the parent waits for one epoch or for start-up
_GONE_TIMEOUT_S = 5.0  # how long a broken pipe may wait for spawn to report the failure


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
            :func:`tensormp.examples.hogwild_numpy.init_params`, or the ``torch.nn.Module`` of
            :func:`tensormp.examples.hogwild_torch.init_torch_model`.
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


# -- shared by both sides ----------------------------------------------------------------------
def step_size(lr: float, epoch: int, epochs: int) -> float:
    """The step size of ``epoch`` (0-based): cosine decay from ``lr`` to ``lr / 10``."""
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * epoch / epochs)))


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


def check_args(workers: int, epochs: int, batch_size: int, hidden: int, lr: float) -> None:
    """Raises: ValueError: one of the numbers is out of range."""
    if workers < 1 or epochs < 1 or batch_size < 1 or hidden < 1:
        raise ValueError(
            f"workers, epochs, batch_size and hidden must be >= 1 (got {workers}, {epochs}, "
            f"{batch_size}, {hidden})"
        )
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")


# -- worker --------------------------------------------------------------------------------------
def worker_pipe(conns: list[Any], rank: int) -> Any:
    """Worker ``rank``'s end of its pipe; closes this process's copies of the others' ends.

    spawn() gives every worker the same arguments, so the workers' ends come as one list.
    """
    for i, other in enumerate(conns):
        if i != rank:
            other.close()
    return conns[rank]


def serve_epochs(
    conn: Any,
    rank: int,
    nworkers: int,
    n_train: int,
    seed: int,
    fail_at: tuple[int, int] | None,
    run_epoch: Callable[[np.ndarray, float], float],
) -> None:
    """The worker's side of the protocol: ``ready``, then one epoch per ``go`` until ``stop``.

    Args:
        conn: this worker's pipe end (closed on return).
        rank, nworkers: which shard of the ``n_train`` samples this worker trains on.
        seed: seeds the shards and each epoch's order.
        fail_at: ``(rank, epoch)`` at whose start this worker raises (a test of failures).
        run_epoch: ``run_epoch(order, lr)`` trains on the samples ``order`` (an int64 array)
            with step size ``lr`` and returns the sum of the batches' losses times their sizes.
    """
    shard = np.random.default_rng(seed).permutation(n_train)[rank::nworkers]
    conn.send(("ready",))
    epoch = 0
    while True:
        msg = conn.recv()
        if msg[0] != "go":
            break
        if fail_at is not None and fail_at == (rank, epoch):
            raise RuntimeError(f"injected failure in worker {rank} at epoch {epoch}")
        order = np.random.default_rng((seed, rank, epoch)).permutation(shard)
        loss_sum = run_epoch(order, msg[1])
        conn.send(("done", epoch, loss_sum, len(order)))
        epoch += 1
    conn.close()


# -- parent --------------------------------------------------------------------------------------
class Run:
    """One training run as the parent sees it: the data in shared memory, the result it fills.

    Args:
        framework: ``"numpy"`` or ``"torch"`` (recorded in the result).
        workers, epochs, lr, seed, hidden, batch_size, data, log, fail_at: as for
            :func:`tensormp.examples.hogwild.train`.

    Raises:
        ValueError: a bad argument, or more workers than training samples.
    """

    def __init__(
        self,
        framework: str,
        workers: int,
        epochs: int,
        lr: float,
        seed: int,
        hidden: int,
        batch_size: int,
        data: Dataset | None,
        log: Any,
        fail_at: tuple[int, int] | None,
    ) -> None:
        check_args(workers, epochs, batch_size, hidden, lr)
        self.t_start = time.perf_counter()
        self.data = data = load_data(seed) if data is None else data
        if workers > len(data.y_train):
            raise ValueError(f"{workers} workers for {len(data.y_train)} training samples")
        self.x = tensormp.share(np.ascontiguousarray(data.x_train, np.float32))
        self.y = tensormp.share(np.ascontiguousarray(data.y_train, np.int64))
        self.n_out = int(data.y_train.max()) + 1
        self.result = HogwildResult(workers, framework=framework)
        self.workers, self.epochs, self.lr, self.seed = workers, epochs, lr, seed
        self.batch_size, self.log, self.fail_at = batch_size, log, fail_at

    def train(
        self,
        entry: Callable[..., None],
        shared: tuple[Any, ...],
        evaluate: Callable[[], float],
        threads: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> HogwildResult:
        """Start the workers with ``spawn(entry, (nworkers, *shared, x, y, pipe ends,
        batch_size, seed, fail_at))``, run the epochs, stop the workers.

        Args:
            evaluate: held-out accuracy of the shared model, called after each epoch.
            threads: a context that limits the framework's own threads in this process.

        Raises:
            tensormp.ProcessRaisedException: a worker raised; the message holds its traceback.
            tensormp.ProcessExitedException: a worker died (signal or exit code).
            KeyboardInterrupt: Ctrl-C; every worker has been stopped before it propagates.
        """
        result, workers, epochs, lr = self.result, self.workers, self.epochs, self.lr
        ctx = tensormp.get_context("spawn")
        pipes = [ctx.Pipe() for _ in range(workers)]
        conns = [parent_end for parent_end, _ in pipes]
        args = (workers, *shared, self.x, self.y, [child for _, child in pipes],
                self.batch_size, self.seed, self.fail_at)
        procs = None
        try:
            # The parent's own BLAS calls (the evaluation) use one thread as well: OpenBLAS
            # threads busy-wait for a while after a parallel call, taking a core away from the
            # workers.
            with one_blas_thread(), threads():
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
                    if self.log is not None:
                        self.log(
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
        result.wall_seconds = time.perf_counter() - self.t_start
        return result


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
