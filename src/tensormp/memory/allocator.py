"""Blocks, the per-process segment registry, and the caching sub-allocator.

Design (read this before changing anything below)
--------------------------------------------------
Memory comes in *segments* (``segment.py``: one memfd, one mapping per process). Arrays live
in *blocks*: a byte range ``[offset, offset + capacity)`` of one segment. Small requests
(<= ``SMALL_MAX``) are carved from *arenas*, segments that hold many blocks of one size class
(powers of two from 64 bytes), so one fd and one mapping serve thousands of arrays and an
allocation from a free list costs no syscall. Larger requests get a segment of their own.

Each process sees a block through one *root*: a 1-D ``uint8`` ndarray over the block's bytes.
Every array tensormp hands out is a view of a root, so numpy's ``base`` chain leads from any
view back to its root, and the root's lifetime is the block's lifetime in this process. A
weakref callback on the root tells the allocator when the last view is gone.

Who owns what:
* The *creator* of a segment (the process whose allocator made it) is the only process that
  ever reuses its blocks. Other processes (receivers, forked children) only map, read, write,
  forward and finally unmap; their roots on a foreign segment are never recycled.
* A block that has crossed to another process (a handle was pickled for it) or that was alive
  when this process forked is marked ``shared_out``. The creator never reuses a
  ``shared_out`` block: another process may still read it. When the creator's last view dies
  the block is *retired*; an arena whose blocks are all retired is unmapped, and a large
  segment is unmapped at once. The kernel frees the memory when the last process holding an fd
  or mapping lets go. (Cross-process release tracking, so that such blocks can be recycled,
  is the transfer-performance work and would plug in exactly here: ``_free_locked``.)
* A block that never left the process goes back to a free list (small) or to the cache of
  large segments, bounded by the cache limit (``TENSORMP_CACHE_BYTES``,
  :func:`set_cache_limit`); :func:`empty_cache` unmaps all of it.

What each party sees when another is SIGKILLed at any point: nothing to clean up. There is
no name and no shared counter; memory is held by fds and mappings, which the kernel drops
with the dead process. A receiver keeps its mapping valid after the creator died.

Threads and fork: all state is guarded by one lock. Weakref callbacks can run inside any
allocation (garbage collection), so they never take the lock themselves when it is held:
they queue the dead block and whoever holds the lock drains the queue before releasing it.
``os.register_at_fork`` marks every live block ``shared_out`` in the parent and gives the
child a fresh allocator (empty free lists): parent and child never hand out the same block.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from .segment import PAGE_SIZE, Segment, format_bytes

__all__ = [
    "Block",
    "allocate",
    "attach",
    "find_block",
    "memory_stats",
    "empty_cache",
    "set_cache_limit",
    "get_cache_limit",
]

SMALL_MAX = 1 << 20  # requests up to 1 MiB share arenas
MIN_CLASS = 64  # smallest size class and the alignment of every block
ARENA_MIN = 4 << 20  # arenas hold at least 16 blocks and at least 4 MiB
_DEFAULT_CACHE_LIMIT = 1 << 30


def _env_cache_limit() -> int:
    raw = os.environ.get("TENSORMP_CACHE_BYTES")
    if raw is None:
        return _DEFAULT_CACHE_LIMIT
    try:
        value = int(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"TENSORMP_CACHE_BYTES={raw!r} is not a byte count; set it to a non-negative integer"
        ) from None
    return value


class _RootRef(weakref.ref):
    """Weak reference to a block's root array; its callback frees the block."""

    __slots__ = ("block",)


class Block:
    """A byte range of a segment as held by this process.

    Attributes:
        segment: the :class:`~tensormp.memory.segment.Segment` it lies in.
        offset: byte offset of the block in the segment.
        capacity: bytes in the block (>= the bytes requested).
        owned: True when this process's allocator handed it out (and may recycle it).
        shared_out: True once a handle to it left this process (or it was alive at a fork).
    """

    __slots__ = (
        "segment", "offset", "capacity", "owned", "owner_pid", "shared_out", "ref", "root_id"
    )

    def __init__(self, segment: Segment, offset: int, capacity: int, owned: bool) -> None:
        self.segment = segment
        self.offset = offset
        self.capacity = capacity
        self.owned = owned
        self.owner_pid = os.getpid()
        self.shared_out = False
        self.ref: _RootRef | None = None
        self.root_id = 0

    def __repr__(self) -> str:
        return (
            f"<Block {format_bytes(self.capacity)} at +{self.offset} of {self.segment!r} "
            f"owned={self.owned} shared_out={self.shared_out}>"
        )


@dataclass
class _Arena:
    segment: Segment
    block_size: int
    nslots: int
    bumped: int = 0  # slots handed out by bumping so far
    live: int = 0  # owned roots alive
    free: int = 0  # slots in the free list
    retired: int = 0  # slots that left the process and are never reused


class _Allocator:
    """The sub-allocator of one process (a forked child gets a fresh one)."""

    def __init__(self, cache_limit: int) -> None:
        self.pid = os.getpid()
        self.cache_limit = cache_limit
        self.free: dict[int, list[tuple[_Arena, int]]] = collections.defaultdict(list)
        self.current: dict[int, _Arena] = {}
        self.arenas: dict[bytes, _Arena] = {}
        self.large_cache: list[Segment] = []
        self.cached_bytes = 0
        self.in_use_bytes = 0

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Block:
        if nbytes <= SMALL_MAX:
            return self._allocate_small(max(MIN_CLASS, 1 << (max(nbytes, 1) - 1).bit_length()))
        return self._allocate_large(nbytes)

    def _allocate_small(self, size: int) -> Block:
        free = self.free[size]
        if free:
            arena, offset = free.pop()
            arena.free -= 1
        else:
            arena = self.current.get(size)
            if arena is None or arena.bumped == arena.nslots:
                seg = Segment.create(max(ARENA_MIN, 16 * size), "arena")
                arena = _Arena(seg, size, seg.size // size)
                self.arenas[seg.id] = arena
                self.current[size] = arena
                self.cached_bytes += seg.size  # reserved, not yet handed out
            offset = arena.bumped * size
            arena.bumped += 1
        self.cached_bytes -= size
        arena.live += 1
        self.in_use_bytes += size
        return Block(arena.segment, offset, size, owned=True)

    def _allocate_large(self, nbytes: int) -> Block:
        size = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
        best = None
        for seg in self.large_cache:  # best fit within 25% slack
            if size <= seg.size <= size + size // 4 and (best is None or seg.size < best.size):
                best = seg
        if best is not None:
            self.large_cache.remove(best)
            self.cached_bytes -= best.size
            seg = best
        else:
            seg = Segment.create(size, "large")
        self.in_use_bytes += seg.size
        return Block(seg, 0, seg.size, owned=True)

    # -- release ------------------------------------------------------------------------------
    def release(self, block: Block) -> None:
        """The owned root of ``block`` died: recycle, cache, retire or unmap."""
        seg = block.segment
        self.in_use_bytes -= block.capacity
        if seg.kind == "large":
            if block.shared_out or block.capacity > self.cache_limit:
                _close_if_unused(seg)
            else:
                self.large_cache.append(seg)
                self.cached_bytes += seg.size
                self._trim()
            return
        arena = self.arenas[seg.id]
        arena.live -= 1
        if block.shared_out:
            arena.retired += 1
        else:
            arena.free += 1
            self.free[arena.block_size].append((arena, block.offset))
            self.cached_bytes += arena.block_size
        if arena.live == 0 and arena.retired == arena.nslots:
            self._drop_arena(arena)
        elif self.cached_bytes > self.cache_limit:
            self._trim()

    def _drop_arena(self, arena: _Arena) -> None:
        del self.arenas[arena.segment.id]
        if self.current.get(arena.block_size) is arena:
            del self.current[arena.block_size]
        if arena.free:
            lst = self.free[arena.block_size]
            lst[:] = [entry for entry in lst if entry[0] is not arena]
        self.cached_bytes -= (arena.free + arena.nslots - arena.bumped) * arena.block_size
        _close_if_unused(arena.segment)

    def _trim(self, limit: int | None = None) -> None:
        """Unmap cached memory until at most ``limit`` bytes stay cached."""
        limit = self.cache_limit if limit is None else limit
        while self.cached_bytes > limit and self.large_cache:
            seg = self.large_cache.pop(0)
            self.cached_bytes -= seg.size
            _close_if_unused(seg)
        if self.cached_bytes > limit:
            idle = [a for a in self.arenas.values() if a.live == 0]
            for arena in sorted(idle, key=lambda a: -(a.free + a.nslots - a.bumped) * a.block_size):
                if self.cached_bytes <= limit:
                    break
                self._drop_arena(arena)


# -- process-wide state (reset in a forked child) --------------------------------------------
_lock = threading.Lock()
_pending: collections.deque[Block] = collections.deque()
_segments: dict[bytes, Segment] = {}  # every segment mapped in this process, by id
_root_blocks: dict[int, Block] = {}  # id(root array) -> block (checked against block.ref)
_allocator = _Allocator(_env_cache_limit())


class _Locked:
    """``with _locked:`` holds the lock and drains blocks queued by weakref callbacks."""

    def __enter__(self) -> None:
        _lock.acquire()

    def __exit__(self, *exc: object) -> None:
        try:
            while _pending:
                _free_locked(_pending.popleft())
        finally:
            _lock.release()
        if _pending:
            _drain()


_locked = _Locked()


def _drain() -> None:
    while _pending and _lock.acquire(blocking=False):
        try:
            while _pending:
                _free_locked(_pending.popleft())
        finally:
            _lock.release()


def _root_died(ref: _RootRef) -> None:
    _pending.append(ref.block)
    _drain()


def _free_locked(block: Block) -> None:
    seg = block.segment
    if seg.roots.get(block.offset) is block.ref:
        del seg.roots[block.offset]
    if _root_blocks.get(block.root_id) is block:
        del _root_blocks[block.root_id]
    if block.owned and block.owner_pid == _allocator.pid:
        _allocator.release(block)
    elif not (seg.kind == "arena" and seg.id in _allocator.arenas) and not (
        seg in _allocator.large_cache
    ):
        _close_if_unused(seg)


def _close_if_unused(seg: Segment) -> None:
    if seg.roots or seg.closed:
        return
    if _segments.get(seg.id) is seg:
        del _segments[seg.id]
    seg.close()


def _make_root_locked(block: Block) -> np.ndarray:
    seg = block.segment
    root = np.frombuffer(seg.buffer, dtype=np.uint8, count=block.capacity, offset=block.offset)
    ref = _RootRef(root, _root_died)
    ref.block = block
    block.ref = ref
    block.root_id = id(root)
    seg.roots[block.offset] = ref
    _root_blocks[block.root_id] = block
    _segments[seg.id] = seg
    return root


def allocate(nbytes: int) -> np.ndarray:
    """Allocate ``nbytes`` of shared memory; returns the block's root (1-D ``uint8``).

    The root may be longer than ``nbytes`` (size classes). Its contents are undefined
    (zeros for fresh memory, old bytes for a recycled block).

    Raises:
        SharedMemoryError: the memory could not be reserved (``ENOSPC``/``ENOMEM``).
    """
    if nbytes < 0:
        raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
    with _locked:
        return _make_root_locked(_allocator.allocate(nbytes))


def find_block(obj: object) -> tuple[Block, np.ndarray] | None:
    """The block and root behind a view, or None when ``obj`` is not in tensormp memory."""
    while obj is not None:
        block = _root_blocks.get(id(obj))
        if block is not None and block.ref is not None and block.ref() is obj:
            return block, obj  # type: ignore[return-value]
        if isinstance(obj, np.ndarray):
            obj = obj.base
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            return None
    return None


def lookup_segment(seg_id: bytes) -> Segment | None:
    """The open segment with this id in this process, if any (used when rebuilding)."""
    return _segments.get(seg_id)


def attach(
    seg_id: bytes,
    take_fd: "collections.abc.Callable[[], int]",
    size: int,
    creator_pid: int,
    kind: str,
    offset: int,
    capacity: int,
) -> np.ndarray:
    """Root of the block ``[offset, offset+capacity)`` of a segment sent by another process.

    Reuses this process's mapping of the segment (and its live root of the block) when it
    has one; otherwise calls ``take_fd()`` for the fd that came with the message and maps it.
    """
    with _locked:
        seg = _segments.get(seg_id)
        if seg is None or seg.closed:
            seg = Segment.attach(seg_id, take_fd(), size, creator_pid, kind)
            _segments[seg_id] = seg
        ref = seg.roots.get(offset)
        root = ref() if ref is not None else None
        if root is not None and len(root) >= capacity:  # type: ignore[arg-type]
            return root  # type: ignore[return-value]
        return _make_root_locked(Block(seg, offset, capacity, owned=False))


def mark_shared_out(block: Block) -> None:
    """Record that a handle to ``block`` left this process: never recycle it."""
    block.shared_out = True


def memory_stats() -> dict[str, int]:
    """Counters of this process's shared memory, in bytes and counts.

    Keys: ``in_use_bytes`` (blocks handed out by this process and alive), ``cached_bytes``
    (reserved but not handed out: free blocks, unused arena space, cached segments), ``cache_limit_bytes``, ``segments`` (mapped
    in this process, own and received), ``mapped_bytes``, ``fds`` (segment fds held),
    ``arenas``, ``blocks`` (live roots).
    """
    with _locked:
        segs = [s for s in _segments.values() if not s.closed]
        return {
            "in_use_bytes": _allocator.in_use_bytes,
            "cached_bytes": _allocator.cached_bytes,
            "cache_limit_bytes": _allocator.cache_limit,
            "segments": len(segs),
            "mapped_bytes": sum(s.size for s in segs),
            "fds": sum(1 for s in segs if s.fd >= 0),
            "arenas": len(_allocator.arenas),
            "blocks": len(_root_blocks),
        }


def empty_cache() -> None:
    """Unmap every cached (free) block and segment of this process, as ``torch.cuda.empty_cache``."""
    with _locked:
        _allocator._trim(0)


def set_cache_limit(nbytes: int) -> None:
    """Cap the bytes of free shared memory this process keeps for reuse (default 1 GiB).

    Also settable with the ``TENSORMP_CACHE_BYTES`` environment variable.

    Raises:
        ValueError: ``nbytes`` is negative.
    """
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"cache limit must be a non-negative int of bytes, got {nbytes!r}")
    with _locked:
        _allocator.cache_limit = nbytes
        _allocator._trim()


def get_cache_limit() -> int:
    """The byte cap set by :func:`set_cache_limit` or ``TENSORMP_CACHE_BYTES``."""
    return _allocator.cache_limit


# -- fork --------------------------------------------------------------------------------------
def _before_fork() -> None:
    _lock.acquire()


def _after_fork_in_parent() -> None:
    # The child inherits every live block: none of them may be recycled by the parent now.
    try:
        for block in _root_blocks.values():
            block.shared_out = True
    finally:
        _lock.release()
    _drain()


def _after_fork_in_child() -> None:
    global _lock, _pending, _allocator
    _lock = threading.Lock()
    _pending = collections.deque()
    for block in _root_blocks.values():
        block.shared_out = True
    # Inherited segments and roots stay valid (the mappings are inherited); none is owned here.
    _allocator = _Allocator(_allocator.cache_limit)
    for seg in list(_segments.values()):
        if not seg.roots:
            _close_if_unused(seg)


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
