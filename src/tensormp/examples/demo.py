"""``make demo``: Hogwild training and the shared-buffer pipeline on real data, with a picture.

Run it::

    python -m tensormp.examples.demo            # about 20 s on 2 cores
    python -m tensormp.examples.demo --quick    # a few seconds, smaller numbers

It runs, in order:

1. :mod:`tensormp.examples.hogwild` with 1 worker, then with ``--workers`` (default 2): test
   accuracy per epoch and training samples/s; the speed-up is the ratio of the two.
2. :mod:`tensormp.examples.pipeline` with the ring of shared buffers, then with the stdlib
   ``multiprocessing.Queue``: batches/s, GB/s and bytes through the queue.
3. A PNG (matplotlib, Agg backend) of accuracy per epoch, samples/s and pipeline throughput,
   written to ``demo_output/tensormp_demo.png`` (``--out`` to change the folder).

Ctrl-C stops every process (each example stops its workers before the interrupt propagates)
and exits with status 130; shared memory goes with the processes (memfds).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main", "run_demo", "plot"]

DEFAULT_OUT = Path("demo_output")
PNG_NAME = "tensormp_demo.png"
_BUSY_CORES = 0.15  # other programs' average load (in cores) above which the demo says so


def _print(*args: Any) -> None:
    print(*args, flush=True)


class CpuMeter:
    """CPU seconds used by the whole machine and by this process tree over a stretch of time.

    Reads ``/proc/stat`` (all CPUs) and :func:`os.times` (this process plus its reaped
    children), so :attr:`others` is the CPU time other programs took meanwhile: a speed-up
    measured while they kept a core busy is not the speed-up of an idle machine.
    """

    def __init__(self) -> None:
        self.machine = self.mine = self.wall = 0.0

    @staticmethod
    def _machine() -> float:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):  # pragma: no cover - not Linux /proc
            return 0.0
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
        return busy / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _mine() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def __enter__(self) -> CpuMeter:
        self._start = (self._machine(), self._mine(), time.perf_counter())
        return self

    def __exit__(self, *exc: object) -> None:
        m0, o0, w0 = self._start
        self.machine += self._machine() - m0
        self.mine += self._mine() - o0
        self.wall += time.perf_counter() - w0

    @property
    def others(self) -> float:
        """CPU seconds other programs used, in cores (average over the wall time)."""
        return max(0.0, self.machine - self.mine) / self.wall if self.wall > 0 else 0.0


def run_demo(opts: argparse.Namespace) -> dict[str, Any]:
    """Run both examples with ``opts`` (see :func:`build_parser`), printing as they go.

    Returns:
        ``{"hogwild": [1-worker HogwildResult, N-worker HogwildResult], "pipeline":
        [shared PipelineResult, stdlib PipelineResult], "busy_cores": float}``, the last
        being the cores other programs kept busy during the Hogwild runs (:class:`CpuMeter`).

    Raises:
        KeyboardInterrupt: Ctrl-C (the running example has stopped its processes).
        tensormp.ProcessRaisedException: a worker or loader raised.
    """
    from . import hogwild, pipeline

    data = hogwild.load_data(opts.seed)
    _print(
        f"[1/3] Hogwild: MLP 64-{opts.hidden}-10 on digits ({len(data.y_train)} train samples "
        f"with shifts, {len(data.y_test)} test), {opts.epochs} epochs, batch {opts.batch_size}, "
        f"lr {opts.lr}"
    )
    runs = []
    meter = CpuMeter()
    for workers in (1, opts.workers):
        with meter:
            r = hogwild.train(
                workers=workers, epochs=opts.epochs, lr=opts.lr, seed=opts.seed,
                hidden=opts.hidden, batch_size=opts.batch_size, data=data,
            )
        runs.append(r)
        _print(
            f"      {workers} worker(s): test accuracy {r.accuracy[-1]:.2%}, "
            f"{r.median_samples_per_s:,.0f} samples/s ({r.wall_seconds:.1f} s)"
        )

    if meter.others > _BUSY_CORES:
        _print(
            f"      note: other programs kept {meter.others:.1f} of the {os.cpu_count()} cores "
            "busy meanwhile, so the workers did not have the machine to themselves and the "
            "speed-up is lower than on an idle machine"
        )
    images = pipeline.make_images(opts.size)
    _print(
        f"[2/3] Pipeline: {opts.batches} batches of {opts.batch_size_pipeline} digits upscaled "
        f"to {opts.size}x{opts.size} ({opts.batch_size_pipeline * opts.size**2 * 4 / 2**20:.1f}"
        f" MiB each), {opts.loaders} loader processes, {opts.slots} buffers"
    )
    pipes = []
    for mode in pipeline.MODES:
        p = pipeline.run(
            mode, loaders=opts.loaders, batches=opts.batches,
            batch_size=opts.batch_size_pipeline, size=opts.size, slots=opts.slots,
            seed=opts.seed, data=images,
        )
        pipes.append(p)
        _print("      " + pipeline.describe(p))
    return {"hogwild": runs, "pipeline": pipes, "busy_cores": meter.others}


def plot(results: dict[str, Any], path: Path) -> Path:
    """Write the demo's PNG to ``path`` (parents created) and return it.

    Raises:
        ImportError: matplotlib is missing (``pip install 'tensormp[examples]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    one, many = results["hogwild"]
    shared, stdlib = results["pipeline"]
    fig, (ax_acc, ax_sps, ax_pipe) = plt.subplots(
        1, 3, figsize=(14, 4.2), gridspec_kw={"width_ratios": [2.2, 1, 1]}
    )
    for r, style in ((one, "o-"), (many, "s-")):
        epochs = range(1, len(r.accuracy) + 1)
        ax_acc.plot(epochs, [100 * a for a in r.accuracy], style,
                    label=f"{r.workers} worker{'s' if r.workers > 1 else ''}")
    ax_acc.axhline(90, color="grey", lw=0.8, ls="--")
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)",
               title="Hogwild MLP on digits: held-out accuracy")
    ax_acc.set_ylim(min(85, min(100 * a for a in one.accuracy + many.accuracy) - 1), 100)
    ax_acc.legend(loc="lower right")
    ax_acc.grid(alpha=0.3)

    sps = [one.median_samples_per_s / 1e3, many.median_samples_per_s / 1e3]
    bars = ax_sps.bar([f"{one.workers} worker", f"{many.workers} workers"], sps,
                      color=["tab:blue", "tab:orange"])
    ax_sps.bar_label(bars, fmt="%.0fk")
    ax_sps.set_ylim(0, max(sps) * 1.15)
    ax_sps.set(ylabel="training samples/s (thousands)",
               title=f"Hogwild speed-up {sps[1] / sps[0]:.2f}x")
    busy = results.get("busy_cores", 0.0)
    if busy > _BUSY_CORES:
        ax_sps.text(0.5, 0.5, f"other programs kept\n{busy:.1f} cores busy", ha="center",
                    transform=ax_sps.transAxes, color="dimgrey", fontsize=9,
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})

    gbs = [shared.gb_per_s, stdlib.gb_per_s]
    bars = ax_pipe.bar(["tensormp\nshared ring", "stdlib\nmp.Queue"], gbs,
                       color=["tab:green", "tab:grey"])
    ax_pipe.bar_label(bars, labels=[f"{g:.2f} GB/s\n{r.batches_per_s:.0f} batch/s"
                                    for g, r in zip(gbs, (shared, stdlib))])
    ax_pipe.set_ylim(0, max(gbs) * 1.3)
    ax_pipe.set(ylabel="batch payload delivered (GB/s)",
                title=f"Pipeline: {shared.batches_per_s / stdlib.batches_per_s:.1f}x the stdlib")
    fig.suptitle(f"tensormp demo ({os.cpu_count()} cores)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(results: dict[str, Any]) -> str:
    """The demo's closing summary as text."""
    one, many = results["hogwild"]
    shared, stdlib = results["pipeline"]
    lines = ["", "Summary", "-------",
             f"Test accuracy per epoch  {'1 worker':>9}  {f'{many.workers} workers':>9}"]
    n = len(one.accuracy)
    shown = range(1, n + 1) if n <= 20 else sorted({*range(1, n + 1, -(-n // 10)), n})
    for e in shown:
        lines.append(f"  epoch {e:3d}              {one.accuracy[e - 1]:9.2%}  "
                     f"{many.accuracy[e - 1]:9.2%}")
    s1, sn = one.median_samples_per_s, many.median_samples_per_s
    lines += [
        f"Hogwild samples/s        {s1:9,.0f}  {sn:9,.0f}   speed-up {sn / s1:.2f}x "
        f"(median epoch; total-time ratio {many.samples_per_s / one.samples_per_s:.2f}x)"
        + (f"\n  (other programs kept {results['busy_cores']:.1f} cores busy meanwhile)"
           if results.get("busy_cores", 0.0) > _BUSY_CORES else ""),
        f"Pipeline                 {'batches/s':>9}  {'GB/s':>9}   queue bytes/batch",
        f"  tensormp shared ring   {shared.batches_per_s:9.1f}  {shared.gb_per_s:9.2f}   "
        f"{shared.queue_bytes_per_batch:,}",
        f"  stdlib mp.Queue        {stdlib.batches_per_s:9.1f}  {stdlib.gb_per_s:9.2f}   "
        f"{stdlib.queue_bytes_per_batch:,}",
        f"  ratio                  {shared.batches_per_s / stdlib.batches_per_s:8.1f}x",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The demo's command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m tensormp.examples.demo",
        description="Hogwild training and a shared-buffer data pipeline on scikit-learn's "
        "digits, with a summary and a PNG.",
    )
    p.add_argument("--workers", type=int, default=2, help="Hogwild workers (default 2)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64, help="Hogwild mini-batch")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--loaders", type=int, default=2, help="pipeline loader processes")
    p.add_argument("--batches", type=int, default=500, help="pipeline batches per run")
    p.add_argument("--batch-size-pipeline", type=int, default=256, help="images per batch")
    p.add_argument("--size", type=int, default=64, help="pipeline image side (pixels)")
    p.add_argument("--slots", type=int, default=8, help="pipeline ring buffers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNG")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument(
        "--quick", action="store_true",
        help="a small configuration (for tests and a first look): 5 epochs, 256 hidden, "
        "60 batches of 32x32",
    )
    return p


_QUICK = {"epochs": 5, "hidden": 256, "batches": 60, "size": 32, "batch_size_pipeline": 128}


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (130 after Ctrl-C)."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.quick:
        for key, value in _QUICK.items():
            if getattr(opts, key) == parser.get_default(key):
                setattr(opts, key, value)
    if opts.workers < 1 or opts.loaders < 1:
        parser.error("--workers and --loaders must be >= 1")
    import numpy as np

    t0 = time.perf_counter()
    _print(
        f"tensormp demo on {os.cpu_count()} cores (Python {platform.python_version()}, "
        f"numpy {np.__version__}; pid {os.getpid()}; Ctrl-C stops everything)"
    )
    import tensormp

    from . import interrupted

    try:
        results = run_demo(opts)
        picture = None if opts.no_plot else plot(results, opts.out / PNG_NAME)
    except (KeyboardInterrupt, tensormp.ProcessExitedException) as e:
        if not interrupted(e):
            raise
        print("\ninterrupted (Ctrl-C): every worker and loader process has been stopped",
              file=sys.stderr, flush=True)
        return 130
    _print(summary(results))
    if picture is not None:
        _print(f"\n[3/3] Picture written to {picture.resolve()}")
    _print(f"Done in {time.perf_counter() - t0:.1f} s.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
