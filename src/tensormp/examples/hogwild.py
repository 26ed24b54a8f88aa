"""Hogwild training with numpy or torch: N processes update one MLP in shared memory, without
locks.

Run it::

    python -m tensormp.examples.hogwild --workers 2 --epochs 20 --lr 0.05 --seed 0
    python -m tensormp.examples.hogwild --framework torch          # the same MLP in torch
    python -m tensormp.examples.hogwild --framework torch --optimizer adam --lr 0.002

Four short modules, read in this order:

* :mod:`~tensormp.examples.hogwild_numpy`: the MLP in numpy with hand-written gradients; each
  worker writes its SGD steps into the shared parameters in place, without a lock.
* :mod:`~tensormp.examples.hogwild_torch`: the same MLP as a ``torch.nn.Module`` trained by
  autograd and ``torch.optim`` (optionally one Adam state shared by every worker).
* :mod:`~tensormp.examples.hogwild_loop`: what both share: the epochs between the parent and
  its workers (``ready``, ``go``, ``done`` over one ``Pipe`` per worker) and the result.
* :mod:`~tensormp.examples.hogwild_data`: scikit-learn's bundled ``load_digits`` (1797 images
  of 8x8 pixels, no download), split 80/20 with a fixed seed (stratified), the training images
  augmented with copies shifted by one pixel in each direction (5x: 7185 samples, so an epoch
  is long enough to time) and standardised; the parent copies the training set into shared
  memory once (:func:`tensormp.share`).

This module is the command line and :func:`train`, which runs either.

Measuring the speed-up fairly
-----------------------------
* 1 and N workers run the identical code path: spawned processes, the same samples per epoch
  in total (N shards of ``n_train / N``), batch size, step sizes and initial weights.
* Every worker, and the parent while it trains, limits its BLAS/OpenMP pools to one thread
  (``threadpoolctl``). Otherwise 1 worker would quietly use both cores through BLAS threads,
  and the parent's evaluation would leave OpenBLAS threads busy-waiting on a core the workers
  need (that alone turned a 1.8x speed-up into 1.0x here).
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
import sys
from typing import Any

import tensormp

from . import hogwild_numpy, hogwild_torch, interrupted
from .hogwild_data import Dataset, load_data, nudge
from .hogwild_loop import HogwildResult, check_args
from .hogwild_numpy import init_params, make_workspace, predict, sgd_step
from .hogwild_torch import OPTIMIZERS, init_torch_model, torch_accuracy

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
    check_args(workers, epochs, batch_size, hidden, lr)
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    if optimizer not in OPTIMIZERS or (framework == "numpy" and optimizer != "sgd"):
        raise ValueError(
            f"optimizer must be one of {OPTIMIZERS} (torch) or 'sgd' (numpy), got {optimizer!r} "
            f"with framework {framework!r}"
        )
    args = (workers, epochs, lr, seed, hidden, batch_size, data, log, fail_at)
    if framework == "torch":
        return hogwild_torch.train(*args, optimizer=optimizer)
    return hogwild_numpy.train(*args)


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
