"""The caching sub-allocator of one process: size-class arenas and cached large segments.

Small requests (<= ``SMALL_MAX``) are carved from *arenas*, segments that hold many blocks of
one size class (powers of two from 64 bytes), so one fd and one mapping serve thousands of
arrays and an allocation from a free list costs no syscall. Larger requests get a segment of
their own, and a large segment let go is cached for the next request that fits it (best fit
within 25% slack). Free memory kept for reuse is bounded by the cache limit (default 1 GiB,
``TENSORMP_CACHE_BYTES``); past it, cached large segments and idle arenas are unmapped.

Only the creator of a segment recycles its blocks (``state.py`` says when: its own root is dead
and no handle is out elsewhere). A *pinned* block (alive when the process forked: the child
may write it through inherited memory) is never recycled: its arena slot is retired, and an
arena whose slots are all retired is unmapped. New segments come from the current sharing
strategy (``strategies.current()``); the allocator never knows how they are made.

Not thread-safe by itself: ``MemoryState``'s lock guards every call.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from dataclasses import dataclass

from .. import strategies
from .blocks import Block
from .segment import PAGE_SIZE, Segment

__all__ = ["SMALL_MAX", "MIN_CLASS", "SubAllocator", "env_cache_limit"]

SMALL_MAX = 1 << 20  # requests up to 1 MiB share arenas
MIN_CLASS = 64  # smallest size class and the alignment of every block
ARENA_MIN = 4 << 20  # arenas hold at least 16 blocks and at least 4 MiB
ARENA_MAX = 64 << 20
_DEFAULT_CACHE_LIMIT = 1 << 30


def env_cache_limit() -> int:
    """The cache limit from ``TENSORMP_CACHE_BYTES`` (default 1 GiB).

    Raises:
        ValueError: the variable is set but is not a non-negative integer.
    """
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


def _new_segment(size: int, kind: str) -> Segment:
    """A new segment of at least ``size`` bytes, made by the current sharing strategy."""
    return strategies.current().create(max(PAGE_SIZE, -(-size // PAGE_SIZE) * PAGE_SIZE), kind)


@dataclass
class _Arena:
    segment: Segment
    block_size: int
    nslots: int
    bumped: int = 0  # slots handed out by bumping so far
    live: int = 0  # slots handed out and not yet back
    free: int = 0  # slots in the free list
    retired: int = 0  # pinned slots, never reused


class SubAllocator:
    """The sub-allocator of one process (a forked child gets a fresh one).

    Args:
        cache_limit: bytes of free memory kept for reuse.
        close: called with a segment this allocator lets go (unmaps it unless a root in it
            still lives: ``MemoryState.close_if_unused``).

    Attributes:
        remote_held: owned blocks with handles out in other processes (``remote > 0``), by
            ``(segment id, offset)``; ``holds.py`` counts them down.
        in_use_bytes, cached_bytes, remote_held_bytes: the counters of ``memory_stats()``.
    """

    def __init__(self, cache_limit: int, close: Callable[[Segment], None]) -> None:
        self.pid = os.getpid()
        self.cache_limit = cache_limit
        self.close = close
        self.free: dict[int, list[tuple[_Arena, int]]] = collections.defaultdict(list)
        self.current: dict[int, _Arena] = {}
        self.arenas: dict[bytes, _Arena] = {}
        self.large_cache: list[Segment] = []
        self.cached_bytes = 0
        self.in_use_bytes = 0
        self.remote_held_bytes = 0
        self.remote_held: dict[tuple[bytes, int], Block] = {}  # blocks with remote > 0

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
            arena_or_none = self.current.get(size)
            if arena_or_none is None or arena_or_none.bumped == arena_or_none.nslots:
                seg = _new_segment(self._next_arena_bytes(size), "arena")
                arena = _Arena(seg, size, seg.size // size)
                self.arenas[seg.id] = arena
                self.current[size] = arena
                self.cached_bytes += seg.size  # reserved, not yet handed out
            else:
                arena = arena_or_none
            offset = arena.bumped * size
            arena.bumped += 1
        self.cached_bytes -= size
        arena.live += 1
        self.in_use_bytes += size
        return Block(arena.segment, offset, size, True, self.pid)

    def _next_arena_bytes(self, size: int) -> int:
        # Arenas of a class grow (up to ARENA_MAX) as the class keeps more of them, so a
        # receiver keeping many arrays holds few fds.
        same = sum(1 for a in self.arenas.values() if a.block_size == size)
        return min(ARENA_MAX, max(ARENA_MIN, 16 * size) << min(4, same // 2))

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
            seg = _new_segment(size, "large")
        self.in_use_bytes += seg.size
        return Block(seg, 0, seg.size, owned=True)

    # -- release ------------------------------------------------------------------------------
    def root_died(self, block: Block) -> None:
        """The owned root of ``block`` died: recycle it now, or once remote holds are gone."""
        if block.remote > 0:  # pinned or not: a block sent before a fork is still counted
            self.remote_held_bytes += block.capacity
            return  # holds.drop_remote recycles (or retires) it when the count reaches zero
        self.recycle(block)

    def recycle(self, block: Block) -> None:
        seg = block.segment
        self.in_use_bytes -= block.capacity
        if seg.kind == "large":
            if block.pinned or block.capacity > self.cache_limit:
                self.close(seg)
            else:
                self.large_cache.append(seg)
                self.cached_bytes += seg.size
                self.trim()
            return
        arena = self.arenas[seg.id]
        arena.live -= 1
        if block.pinned:
            arena.retired += 1
        else:
            arena.free += 1
            self.free[arena.block_size].append((arena, block.offset))
            self.cached_bytes += arena.block_size
        if arena.live == 0 and arena.retired == arena.nslots:
            self._drop_arena(arena)
        elif self.cached_bytes > self.cache_limit:
            self.trim()

    def _drop_arena(self, arena: _Arena) -> None:
        del self.arenas[arena.segment.id]
        if self.current.get(arena.block_size) is arena:
            del self.current[arena.block_size]
        if arena.free:
            lst = self.free[arena.block_size]
            lst[:] = [entry for entry in lst if entry[0] is not arena]
        self.cached_bytes -= (arena.free + arena.nslots - arena.bumped) * arena.block_size
        self.close(arena.segment)

    def trim(self, limit: int | None = None) -> None:
        """Unmap cached memory until at most ``limit`` bytes (default: the cache limit) stay
        cached."""
        limit = self.cache_limit if limit is None else limit
        while self.cached_bytes > limit and self.large_cache:
            seg = self.large_cache.pop(0)
            self.cached_bytes -= seg.size
            self.close(seg)
        if self.cached_bytes > limit:
            idle = [a for a in self.arenas.values() if a.live == 0]
            for arena in sorted(idle, key=lambda a: -(a.free + a.nslots - a.bumped) * a.block_size):
                if self.cached_bytes <= limit:
                    break
                self._drop_arena(arena)

    def manages(self, seg: Segment) -> bool:
        """Whether ``seg`` is one of this allocator's arenas or cached large segments."""
        return seg.id in self.arenas or seg in self.large_cache
