#!/usr/bin/env python3
"""DataLoader benchmark: a torch ``DataLoader`` with tensormp's context against torch's own.

Run ``python benchmarks/dataloader.py`` (about 1 minute on a quiet 2-core machine, most of it
spawn workers importing torch; several times that under load), ``--quick`` (fewer batches, 2
epochs per contender), ``--only small`` or ``--only large``, ``--methods spawn``.

Method
------
One ``DataLoader`` per epoch, 2 workers, ``batch_size`` samples, sequential sampler, no
``pin_memory``, workers not persistent (each epoch starts and joins its own, as by default).
Contenders, same code but for one argument:

* ``torch``: ``multiprocessing_context=<method>`` (torch's own context; batches cross through
  torch's shared memory: a new segment and fd per batch, ``file_descriptor`` strategy);
* ``tensormp``: ``multiprocessing_context=tensormp.get_context(<method>)`` (batches are
  collated into tensormp memory, recycled by the workers, and cross as handles).

Workloads: ``small``, 32 samples of 3x32x32 float32 a batch (0.4 MiB, CIFAR-sized), and
``large``, 64 samples of 3x224x224 float32 (36.8 MiB, ImageNet-sized). A sample is a view of
one of 8 tensors made once in the dataset (sample ``i`` is filled with ``i % 8 + 1``), so a
worker's work is torch's collate (one copy of the batch into the memory the batch crosses in)
plus the transfer. The main process touches every page of each batch (one float32 per 4 KiB
page, summed) and checks the sum.

Timed, per epoch, in the main process: ``start`` (``iter()`` to the first batch: the workers
start; not in the ratios), then after ``warm`` batches: ``steady``, the time per batch over
the next batches but the last; ``epoch``, the time per batch from there to the end of the
epoch, which includes the workers' shutdown (the ``DataLoader`` joins them). Epochs run in
turns (torch, tensormp; reversed every other repetition), ``--reps`` times; medians. Ratio =
torch's time per batch / tensormp's (> 1: tensormp faster). Target: >= 2x in every row.

The main process imports both libraries; each contender's workers are started by its own
context (under ``spawn`` both import this file, hence tensormp, before the first batch).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from typing import Any

import torch

import tensormp

MiB = 1 << 20
_POOL = 8  # distinct samples in a dataset
SIZES = {  # name -> (batch size, sample shape, batches timed, batches timed with --quick)
    "small": (32, (3, 32, 32), 500, 250),
    "large": (64, (3, 224, 224), 40, 16),
}
TARGET = 2.0  # tensormp's throughput / torch's, every row


class _Images(torch.utils.data.Dataset[torch.Tensor]):
    """``n`` samples of ``shape`` float32; sample ``i`` is filled with ``i % 8 + 1``."""

    def __init__(self, n: int, shape: tuple[int, ...]) -> None:
        self.n = n
        self.pool = torch.stack([torch.full(shape, float(k + 1)) for k in range(_POOL)])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.pool[i % _POOL]


def _expected(first: int, batch: int, per_sample: int) -> float:
    """The checked sum of a batch: one float32 of every 1024 (per_sample is a multiple)."""
    return float(sum(i % _POOL + 1 for i in range(first, first + batch)) * (per_sample // 1024))


def _epoch(who: str, method: str, size: str, timed: int, warm: int) -> dict[str, float]:
    """One epoch; seconds: start, steady (per batch), epoch (per batch, shutdown included)."""
    batch, shape, _, _ = SIZES[size]
    per_sample = math.prod(shape)
    n = warm + timed
    ctx: Any = tensormp.get_context(method) if who == "tensormp" else method
    loader = torch.utils.data.DataLoader(
        _Images(batch * n, shape), batch_size=batch, num_workers=2, multiprocessing_context=ctx
    )

    def check(j: int, x: torch.Tensor) -> None:
        got = float(x.view(-1)[::1024].sum())
        if got != _expected(j * batch, batch, per_sample):
            raise AssertionError(f"{who} {method} {size}: batch {j} holds wrong values")

    t0 = time.perf_counter()
    it = iter(loader)
    check(0, next(it))
    t1 = time.perf_counter()
    for j in range(1, warm):
        check(j, next(it))
    t2 = time.perf_counter()
    for j in range(warm, n - 1):
        check(j, next(it))
    t3 = time.perf_counter()
    check(n - 1, next(it))
    for _ in it:  # StopIteration: the loader joins its workers
        raise AssertionError("more batches than asked for")
    t4 = time.perf_counter()
    return {"start": t1 - t0, "steady": (t3 - t2) / (timed - 1), "epoch": (t4 - t2) / timed}


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches and repetitions")
    parser.add_argument("--only", default="small,large", help="small, large or both")
    parser.add_argument("--methods", default="fork,spawn", help="start methods, comma-separated")
    parser.add_argument("--reps", type=int, default=0, help="epochs per contender (3; quick: 2)")
    args = parser.parse_args(argv)
    sizes = [s for s in args.only.split(",") if s]
    methods = [m for m in args.methods.split(",") if m]
    for s in sizes:
        if s not in SIZES:
            parser.error(f"unknown workload {s!r}; choose from {list(SIZES)}")
    reps = args.reps or (2 if args.quick else 3)
    warm = 5
    print(f"tensormp {tensormp.__version__}, torch {torch.__version__}, Python "
          f"{sys.version.split()[0]}, {os.cpu_count()} CPUs; 2 workers; {reps} epochs per "
          f"contender; load average before: {os.getloadavg()[0]:.2f}", flush=True)

    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for rep in range(reps):
        for method in methods:
            for size in sizes:
                timed = SIZES[size][3 if args.quick else 2]
                order = ("torch", "tensormp") if rep % 2 == 0 else ("tensormp", "torch")
                for who in order:
                    r = _epoch(who, method, size, timed, warm)
                    runs.setdefault((size, method, who), []).append(r)
                    print(f"  rep {rep + 1} {size:5s} {method:5s} {who:8s} steady "
                          f"{_ms(r['steady'])}/batch, epoch {_ms(r['epoch'])}/batch, start "
                          f"{r['start']:.2f} s", flush=True)

    print("\n== summary: time per batch (medians); ratio = torch / tensormp, same run ==")
    head = (f"{'workload':32s} {'tensormp':>10s} {'torch':>10s} {'ratio':>6s}  "
            f"{'target':8s} result")
    print(head)
    print("-" * len(head))
    for size in sizes:
        batch, shape, _, _ = SIZES[size]
        mib = batch * 4 * math.prod(shape) / MiB
        for method in methods:
            for key, what in (("steady", "steady"), ("epoch", "epoch+join")):
                med = {who: statistics.median(r[key] for r in runs[(size, method, who)])
                       for who in ("tensormp", "torch")}
                ratio = med["torch"] / med["tensormp"]
                ok = ratio >= TARGET
                print(f"{f'{size} {mib:.1f} MiB {method} {what}':32s} "
                      f"{_ms(med['tensormp']):>10s} {_ms(med['torch']):>10s} {ratio:5.2f}x  "
                      f">= {TARGET:.0f}x    {'PASS' if ok else 'MISS'}")
    print("\nsteady: per batch within an epoch; epoch+join: per batch from the same point to "
          "the end of the epoch, the loader joining its workers included (start excluded).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
