"""A data pipeline that reuses shared batch buffers, against the stdlib queue pickling batches.

Run it::

    python -m tensormp.examples.pipeline --loaders 2 --batches 300

The data
--------
scikit-learn's ``load_digits`` images upscaled from 8x8 to ``size x size`` pixels (bilinear,
float32 in ``[0, 1]``) and zero-padded by ``pad`` pixels on each side, built once by the parent
and shared with the loaders (:func:`tensormp.share`, no copy per loader). Batch ``k`` is
``batch_size`` images drawn with replacement by a generator seeded with ``(seed, k)``, all
cropped at one random offset within the padding (a random translation, the augmentation a
loader typically does). With the defaults (64x64, 256 images) a batch is 4 MiB of images
plus 2 KiB of labels and 2 KiB of sample ids: the size of real image batches, where copying
is what a pipeline spends its time on.

Ring protocol (``shared``)
--------------------------
The parent allocates the ring once: ``images (slots, batch, size, size)`` float32, ``labels``
and ``ids`` ``(slots, batch)`` int64, with :func:`tensormp.empty`, and starts the loaders with
:func:`tensormp.spawn`, passing them the ring (shared-memory handles). Two tensormp queues::

    free   parent -> loaders   slot index                    (starts holding every slot)
    ready  loaders -> parent   (batch id, slot, images[slot], labels[slot], ids[slot], crc)
                               ... or ("end", rank, pickle bytes of one message) at the end

Loader ``r`` makes batches ``r, r + L, r + 2L, ...`` (``L`` loaders): it takes a free slot,
writes the batch straight into it (the one copy any loader makes), and puts the slot's views
on ``ready``: they travel as handles of about 150 bytes, and the parent, which created the
ring, gets back views of the memory it already maps (no ``mmap``, no page fault). After
using a batch the trainer puts the slot index back on ``free``. After warm-up no batch causes
an allocation, a copy or a page fault; at most ``slots`` batches are in flight, so a loader
never writes a slot the trainer still reads.

The stdlib baseline (``stdlib``)
--------------------------------
The same loaders and the same trainer loop, except that each batch is made in a fresh array
and put on a ``multiprocessing.Queue(maxsize=slots)`` (spawn context), which pickles it and
writes every byte through a pipe; the trainer unpickles a new copy. This is what a
``DataLoader``-style pipeline does without shared memory.

The trainer's work per batch is the same in both: it reads every byte (a float32 sum of the
images and a histogram of the labels: the least any training step does), so the comparison
measures the transport, not the model. Throughput is timed after ``warmup`` batches (process
start-up excluded) in both modes.

With ``verify``, each loader also sends the CRC-32 of what it wrote and the trainer checks it
on arrival (a slot overwritten in flight would not match) and records ``(batch id, CRC)``.
"""

from __future__ import annotations

import argparse
import queue
import sys
import time
import zlib
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

import tensormp

from . import check_processes, interrupted, stop_processes

__all__ = [
    "PipelineResult",
    "make_images",
    "fill_batch",
    "batch_crc",
    "run",
    "main",
]

MODES = ("shared", "stdlib")
_POLL_S = 0.05
_STALL_TIMEOUT_S = 120.0  # the longest the trainer waits for one batch


@dataclass
class PipelineResult:
    """What one pipeline run measured.

    Attributes:
        mode: ``"shared"`` (ring of tensormp buffers) or ``"stdlib"`` (pickled batches).
        loaders: number of loader processes.
        batches: batches the trainer received (all of them, warm-up included).
        batch_bytes: payload bytes of one batch (images + labels + ids).
        queue_bytes_per_batch: pickle bytes the queue carries for one batch (framing aside),
            measured by the loaders.
        seconds: time of the batches after warm-up.
        timed_batches: batches counted in :attr:`seconds`.
        wall_seconds: the whole run, process start and shutdown included.
        mapped_growth: bytes of shared memory this process mapped between the end of warm-up
            and the last batch (0 for the ring: no allocation, no new mapping per batch).
        received: ``(batch id, CRC-32)`` in arrival order (only with ``verify``).
    """

    mode: str
    loaders: int
    batches: int = 0
    batch_bytes: int = 0
    queue_bytes_per_batch: int = 0
    seconds: float = 0.0
    timed_batches: int = 0
    wall_seconds: float = 0.0
    mapped_growth: int = 0
    received: list[tuple[int, int]] = field(default_factory=list)

    @property
    def batches_per_s(self) -> float:
        """Batches per second after warm-up."""
        return self.timed_batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def gb_per_s(self) -> float:
        """Payload delivered to the trainer, in GB (1e9 bytes) per second after warm-up."""
        return self.batches_per_s * self.batch_bytes / 1e9

    @property
    def queue_bytes(self) -> int:
        """Bytes written to the queue over the whole run."""
        return self.batches * self.queue_bytes_per_batch


# -- data ----------------------------------------------------------------------------------------
def _upsample_matrix(n_out: int, n_in: int) -> np.ndarray:
    """``(n_out, n_in)`` bilinear interpolation weights (pixel centres aligned, edges clamped)."""
    pos = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
    lo = np.floor(pos).astype(int)
    hi = np.minimum(lo + 1, n_in - 1)
    frac = pos - lo
    m = np.zeros((n_out, n_in))
    m[np.arange(n_out), lo] += 1 - frac
    m[np.arange(n_out), hi] += frac
    return m


def make_images(size: int = 64, pad: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """The digits upscaled to ``size x size`` and zero-padded by ``pad`` on every side.

    Returns:
        ``(images, labels)``: ``(1797, size + 2 pad, size + 2 pad)`` float32 in ``[0, 1]`` and
        ``(1797,)`` int64.

    Raises:
        ImportError: scikit-learn is missing (``pip install 'tensormp[examples]'``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the examples need scikit-learn and matplotlib: pip install 'tensormp[examples]'"
        ) from e
    digits = load_digits()
    m = _upsample_matrix(size, 8)
    up = m @ (digits.images / 16.0) @ m.T  # (n, size, size)
    out = np.zeros((len(up), size + 2 * pad, size + 2 * pad), np.float32)
    out[:, pad : pad + size, pad : pad + size] = up
    return out, digits.target.astype(np.int64)


def fill_batch(
    images: np.ndarray,
    labels: np.ndarray,
    batch_id: int,
    seed: int,
    out_images: np.ndarray,
    out_labels: np.ndarray,
    out_ids: np.ndarray,
) -> None:
    """Write batch ``batch_id`` into the ``out_*`` arrays (deterministic in ``seed, batch_id``).

    Args:
        images: ``(n, size + 2 pad, size + 2 pad)`` padded images (from :func:`make_images`).
        labels: ``(n,)`` labels.
        batch_id: which batch; the sample choice and crop come from ``(seed, batch_id)``.
        seed: the run's seed.
        out_images: ``(batch, size, size)`` float32, written in place.
        out_labels: ``(batch,)`` int64, written in place.
        out_ids: ``(batch,)`` int64: the indices of the samples in the data set.
    """
    batch: int
    size: int
    batch, size = out_images.shape[0], out_images.shape[1]
    span = images.shape[1] - size
    rng = np.random.default_rng((seed, batch_id))
    idx = rng.integers(0, len(labels), size=batch)
    dy, dx = rng.integers(0, span + 1, size=2)
    crops = images[:, dy : dy + size, dx : dx + size]
    # One slice copy per image straight into out: no temporary (np.take(axis=0) on this
    # strided view is about 6x slower, fancy indexing allocates a whole batch first).
    for j, i in enumerate(idx.tolist()):
        out_images[j] = crops[i]
    np.take(labels, idx, out=out_labels)
    out_ids[...] = idx


def batch_crc(images: np.ndarray, labels: np.ndarray, ids: np.ndarray) -> int:
    """CRC-32 of a batch's bytes (images, labels, ids; each C-contiguous)."""
    crc = zlib.crc32(images.data.cast("B"))
    crc = zlib.crc32(labels.data.cast("B"), crc)
    return zlib.crc32(ids.data.cast("B"), crc)


def _consume(images: np.ndarray, labels: np.ndarray, hist: np.ndarray) -> float:
    """The trainer's work: read every byte of the batch."""
    hist += np.bincount(labels, minlength=len(hist))[: len(hist)]
    return float(images.sum())


# -- loaders -------------------------------------------------------------------------------------
def _shared_loader(
    rank: int,
    nloaders: int,
    images: np.ndarray,
    labels: np.ndarray,
    ring: tuple[np.ndarray, np.ndarray, np.ndarray],
    free: Any,
    ready: Any,
    nbatches: int,
    seed: int,
    verify: bool,
) -> None:
    """Loader ``rank`` of the ring pipeline (started by :func:`tensormp.spawn`)."""
    ring_images, ring_labels, ring_ids = ring
    size = 0
    for batch_id in range(rank, nbatches, nloaders):
        slot = free.get()
        im, lab, ids = ring_images[slot], ring_labels[slot], ring_ids[slot]
        fill_batch(images, labels, batch_id, seed, im, lab, ids)
        crc = batch_crc(im, lab, ids) if verify else None
        msg = (batch_id, slot, im, lab, ids, crc)
        size = size or _shared_message_bytes(msg)
        ready.put(msg)
    ready.put(("end", rank, size))


def _shared_message_bytes(msg: tuple[Any, ...]) -> int:
    """Pickle bytes of a ring message, measured on look-alike arrays of this process.

    Pickling a handle without sending it would pin its block in the creator (the parent) until
    it exits (see ``memory/release.py``), so the look-alikes are this loader's own blocks,
    freed when it exits. Their handles have the same fields as the ring views'.
    """
    twins = tuple(tensormp.empty_like(a) for a in msg[2:5])
    return len(tensormp.reducers.dumps((*msg[:2], *twins, msg[5])).data)


def _stdlib_loader(
    rank: int,
    nloaders: int,
    images: np.ndarray,
    labels: np.ndarray,
    shapes: tuple[tuple[int, ...], int],
    ready: Any,
    nbatches: int,
    seed: int,
    verify: bool,
) -> None:
    """Loader ``rank`` of the stdlib pipeline: a fresh batch each time, pickled by the queue."""
    image_shape, batch = shapes
    size = 0
    for batch_id in range(rank, nbatches, nloaders):
        im = np.empty(image_shape, np.float32)
        lab = np.empty(batch, np.int64)
        ids = np.empty(batch, np.int64)
        fill_batch(images, labels, batch_id, seed, im, lab, ids)
        crc = batch_crc(im, lab, ids) if verify else None
        msg = (batch_id, None, im, lab, ids, crc)
        size = size or len(ForkingPickler.dumps(msg))  # what the queue's feeder thread writes
        ready.put(msg)
    ready.put(("end", rank, size))
    ready.close()
    ready.join_thread()  # flush the feeder thread before the process exits


# -- trainer -------------------------------------------------------------------------------------
def _get(ready: Any, procs: Any) -> Any:
    """The next message from ``ready``, checking the loaders while waiting."""
    deadline = time.monotonic() + _STALL_TIMEOUT_S
    while True:
        try:
            return ready.get(timeout=_POLL_S)
        except queue.Empty:
            check_processes(procs, "all their batches")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no batch arrived within {_STALL_TIMEOUT_S:.0f} s; the loaders seem stuck"
                ) from None


def run(
    mode: str = "shared",
    loaders: int = 2,
    batches: int = 300,
    batch_size: int = 256,
    size: int = 64,
    slots: int = 8,
    warmup: int = 16,
    seed: int = 0,
    verify: bool = False,
    data: tuple[np.ndarray, np.ndarray] | None = None,
) -> PipelineResult:
    """Feed ``batches`` batches from ``loaders`` processes to this process, and time it.

    Args:
        mode: ``"shared"`` (ring of reused tensormp buffers, handles through a tensormp queue)
            or ``"stdlib"`` (a fresh array per batch through ``multiprocessing.Queue``).
        loaders: loader processes.
        batches: batches in the run (each is delivered exactly once).
        batch_size: images per batch.
        size: image side in pixels after upscaling.
        slots: buffers in the ring (``shared``); the queue's ``maxsize`` (``stdlib``).
        warmup: batches received before the clock starts (clamped to ``batches - 1``).
        seed: seeds the batches' contents.
        verify: loaders send a CRC-32 of each batch, the trainer checks it and records
            ``(batch id, CRC)`` in :attr:`PipelineResult.received`.
        data: ``(images, labels)`` from :func:`make_images` with padding (default:
            ``make_images(size)``).

    Returns:
        A :class:`PipelineResult`.

    Raises:
        ValueError: a bad argument.
        RuntimeError: a batch arrived twice or with the wrong CRC.
        tensormp.ProcessRaisedException: a loader raised; the message holds its traceback.
        KeyboardInterrupt: Ctrl-C; every loader has been stopped before it propagates.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if min(loaders, batches, batch_size, size, slots) < 1 or warmup < 0:
        raise ValueError(
            "loaders, batches, batch_size, size and slots must be >= 1 and warmup >= 0 (got "
            f"{loaders}, {batches}, {batch_size}, {size}, {slots}, {warmup})"
        )
    t_start = time.perf_counter()
    images, labels = make_images(size) if data is None else data
    if images.shape[1] < size:
        raise ValueError(f"images of {images.shape[1]} pixels cannot be cropped to {size}")
    images, labels = tensormp.share(images), tensormp.share(labels)
    warmup = min(warmup, batches - 1)
    result = PipelineResult(mode, loaders)
    ctx = tensormp.get_context("spawn")
    channels: list[Any] = []
    procs = None
    try:
        if mode == "shared":
            ring = (
                tensormp.empty((slots, batch_size, size, size), np.float32),
                tensormp.empty((slots, batch_size), np.int64),
                tensormp.empty((slots, batch_size), np.int64),
            )
            free, ready = ctx.SimpleQueue(), ctx.Queue()
            channels += [free, ready]
            for slot in range(slots):
                free.put(slot)
            args: tuple[Any, ...] = (loaders, images, labels, ring, free, ready, batches, seed,
                                     verify)
            procs = tensormp.spawn(_shared_loader, args=args, nprocs=loaders, join=False)
        else:
            import multiprocessing

            free = None
            ready = multiprocessing.get_context("spawn").Queue(maxsize=slots)
            channels.append(ready)
            shapes = ((batch_size, size, size), batch_size)
            args = (loaders, images, labels, shapes, ready, batches, seed, verify)
            procs = tensormp.spawn(_stdlib_loader, args=args, nprocs=loaders, join=False)
        result.batch_bytes = batch_size * (size * size * 4 + 2 * 8)  # images, labels, ids

        seen = np.zeros(batches, bool)
        hist = np.zeros(10, np.int64)
        ended = 0
        t0 = time.perf_counter()  # replaced after the warm-up batches
        mapped = tensormp.memory_stats()["mapped_bytes"]  # likewise
        while ended < loaders:
            msg = _get(ready, procs)
            if msg[0] == "end":
                ended += 1
                result.queue_bytes_per_batch = max(result.queue_bytes_per_batch, msg[2])
                continue
            batch_id, slot, im, lab, ids, crc = msg
            if seen[batch_id]:
                raise RuntimeError(f"batch {batch_id} arrived twice")
            seen[batch_id] = True
            _consume(im, lab, hist)
            if verify:
                got = batch_crc(im, lab, ids)
                if got != crc:
                    raise RuntimeError(
                        f"batch {batch_id} changed in flight: the loader wrote CRC {crc:#010x}, "
                        f"the trainer read {got:#010x}"
                    )
                result.received.append((batch_id, got))
            del im, lab, ids, msg
            if free is not None:
                free.put(slot)  # hand the buffer back to the loaders
            result.batches += 1
            if result.batches == warmup:
                t0 = time.perf_counter()
                mapped = tensormp.memory_stats()["mapped_bytes"]
        t1 = time.perf_counter()
        if warmup:
            result.mapped_growth = tensormp.memory_stats()["mapped_bytes"] - mapped
        result.seconds = t1 - t0
        result.timed_batches = result.batches - warmup
        while not procs.join(timeout=_POLL_S):
            if time.perf_counter() - t1 > _STALL_TIMEOUT_S:
                raise TimeoutError(f"loaders did not exit within {_STALL_TIMEOUT_S:.0f} s")
        if not seen.all():
            missing = np.flatnonzero(~seen)
            raise RuntimeError(f"{len(missing)} batches never arrived, e.g. {missing[:5].tolist()}")
    finally:
        if procs is not None:
            stop_processes(procs)
        for ch in channels:
            _close_channel(ch)
    result.wall_seconds = time.perf_counter() - t_start
    return result


def _close_channel(ch: Any) -> None:
    """Close a queue and, for one with a feeder thread, do not wait for it to flush."""
    if hasattr(ch, "cancel_join_thread"):
        ch.cancel_join_thread()
    ch.close()


# -- command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command-line options."""
    p = argparse.ArgumentParser(
        prog="python -m tensormp.examples.pipeline",
        description="Loader processes feed image batches to this process through a ring of "
        "reused shared buffers (tensormp), then through multiprocessing.Queue pickling each "
        "batch (stdlib); prints batches/s, GB/s and bytes through the queue for both.",
    )
    p.add_argument("--loaders", type=int, default=2, help="loader processes (default 2)")
    p.add_argument("--batches", type=int, default=300, help="batches per run (default 300)")
    p.add_argument("--batch-size", type=int, default=256, help="images per batch (default 256)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    p.add_argument("--slots", type=int, default=8, help="ring buffers / queue size (default 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verify", action="store_true", help="check every batch's CRC-32")
    return p


def describe(r: PipelineResult) -> str:
    """One line of text for a result."""
    return (
        f"{r.mode:>6}: {r.batches_per_s:8.1f} batches/s  {r.gb_per_s:6.2f} GB/s  "
        f"queue carried {_fmt_bytes(r.queue_bytes_per_batch)}/batch "
        f"({_fmt_bytes(r.queue_bytes)} in all)"
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (130 after Ctrl-C)."""
    opts = build_parser().parse_args(argv)
    kw = dict(loaders=opts.loaders, batches=opts.batches, batch_size=opts.batch_size,
              size=opts.size, slots=opts.slots, seed=opts.seed, verify=opts.verify)
    try:
        data = make_images(opts.size)
        print(f"{opts.batches} batches of {opts.batch_size} digits upscaled to "
              f"{opts.size}x{opts.size} ({_fmt_bytes(opts.batch_size * opts.size**2 * 4)} of "
              f"images each), {opts.loaders} loader process(es)")
        shared = run("shared", data=data, **kw)
        print(describe(shared))
        stdlib = run("stdlib", data=data, **kw)
        print(describe(stdlib))
    except (KeyboardInterrupt, tensormp.ProcessExitedException) as e:
        if not interrupted(e):
            raise
        print("\ninterrupted (Ctrl-C): all loaders stopped", file=sys.stderr)
        return 130
    print(f"shared buffers: {shared.batches_per_s / stdlib.batches_per_s:.1f}x the batches/s of "
          "the stdlib queue")
    return 0


if __name__ == "__main__":
    sys.exit(main())
