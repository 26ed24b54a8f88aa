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
weakref callback on the root tells us when the last view is gone.

Who owns what, who frees what:
* The *creator* of a segment (the process whose allocator made it) is the only process that
  ever reuses its blocks. Its count of *remote* holds on a block is: handles it pickled, plus
  acquires from processes that forwarded the block, minus counts released by receivers
  (``release.py`` has the protocol). It recycles a block (free list, or cache of large
  segments, bounded by the cache limit) when its own root is dead and the remote count is 0.
* A copy made only to be sent (``allocate_sent``: an array that was not shared yet, put on a
  queue) gets no root in its creator at all: it is counted as sent and "locally dead" from
  the start, and recycled as soon as the receiver's release comes back. A producer that sends
  fresh arrays thus pays no root, weakref or root death per array.
* A receiver's root on a foreign block counts the handles it rebuilt into it (``received``)
  and how many of those the creator was told about (``announced``: holds are announced
  lazily, see release.py); when the root dies, it sends ``R`` for the announced ones and ``D``
  for the rest. The receiver keeps the segment mapped in an LRU cache of idle foreign mappings
  (bounded in bytes and number), so the next array in the same segment costs no mmap and no
  page faults; a reaper thread drops idle mappings whose creator died. ``empty_cache()``
  unmaps them.
* Blocks alive when a process forks are *pinned*: the child can write them through memory it
  inherited without ever sending a release, so the parent never recycles them. Blocks the
  parent *received* are another matter (their creator recycles them once the parent lets go):
  before the fork, the parent acquires one handle per such block for the child (blocking
  ``A`` records, as a forward does), and the child releases it when its own views die.

What each party sees when another is SIGKILLed at any line: nothing to clean up. There is no
name and no shared counter; memory is held by fds and mappings, which the kernel drops with the
dead process. A receiver keeps a valid mapping after the creator died. A creator whose receiver
died keeps that block pinned (never reused too early) until it exits.

Threads and fork: all state is guarded by one lock. Weakref callbacks can run inside any
allocation (garbage collection), so they never wait for the lock: they queue the dead block
and whoever holds the lock drains the queue before releasing it. ``os.register_at_fork`` pins
every live block in the parent and gives the child a fresh allocator (empty free lists, no
release server): parent and child never hand out the same block.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import strategies
from . import release
from .segment import PAGE_SIZE, WIRE_SIZE, Segment, format_bytes, unpack_wire

__all__ = [
    "Block",
    "allocate",
    "attach",
    "find_block",
    "allocate_sent",
    "note_handle",
    "forget_handle",
    "forget_received",
    "release_all_received",
    "process_exiting",
    "register_holder",
    "memory_stats",
    "empty_cache",
    "set_cache_limit",
    "get_cache_limit",
]

SMALL_MAX = 1 << 20  # requests up to 1 MiB share arenas
MIN_CLASS = 64  # smallest size class and the alignment of every block
ARENA_MIN = 4 << 20  # arenas hold at least 16 blocks and at least 4 MiB
ARENA_MAX = 64 << 20
FOREIGN_CACHE_MAX = 64  # idle mappings of other processes' segments kept (fds)
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


def _new_segment(size: int, kind: str) -> Segment:
    """A new segment of at least ``size`` bytes, made by the current sharing strategy."""
    return strategies.current().create(max(PAGE_SIZE, -(-size // PAGE_SIZE) * PAGE_SIZE), kind)


class _RootRef(weakref.ref):
    """Weak reference to a block's root array; its callback frees the block."""

    __slots__ = ("block", "root_id")


class Block:
    """A byte range of a segment as held by this process.

    Attributes:
        segment: the :class:`~tensormp.memory.segment.Segment` it lies in.
        offset: byte offset of the block in the segment.
        capacity: bytes in the block (>= the bytes requested).
        owned: True when this process's allocator handed it out (and may recycle it).
        remote: (owned blocks) handles held or in flight in other processes.
        received: (foreign blocks) handles this process rebuilt into this root.
        announced: (foreign blocks) how many of ``received`` the creator was told about with
            ``H`` records (or knows of otherwise); the rest are in ``_unannounced``.
        pinned: never recycle (it was alive at a fork).
    """

    __slots__ = (
        "segment", "offset", "capacity", "owned", "owner_pid", "remote", "received", "pinned",
        "holders", "ref", "local_dead", "announced",
    )

    def __init__(
        self, segment: Segment, offset: int, capacity: int, owned: bool, owner_pid: int = 0
    ) -> None:
        self.segment = segment
        self.offset = offset
        self.capacity = capacity
        self.owned = owned
        self.owner_pid = owner_pid or os.getpid()
        self.remote = 0
        self.received = 0
        self.announced = 0
        self.pinned = False
        # Who holds handles (see _holders_add): None, one ((pid, start), count) tuple (the
        # common case; a tuple of ints is not tracked by the garbage collector, which matters
        # with 100,000 blocks out), or a dict (pid, start) -> count.
        self.holders: tuple[tuple[int, int], int] | dict[tuple[int, int], int] | None = None
        self.ref: _RootRef | None = None  # the current root's weakref
        self.local_dead = False  # the death of this process's last root has been processed

    def __repr__(self) -> str:
        live = self.ref is not None and self.ref() is not None
        return (
            f"<Block {format_bytes(self.capacity)} at +{self.offset} of {self.segment!r} "
            f"owned={self.owned} live={live} remote={self.remote} pinned={self.pinned}>"
        )


@dataclass
class _Arena:
    segment: Segment
    block_size: int
    nslots: int
    bumped: int = 0  # slots handed out by bumping so far
    live: int = 0  # slots handed out and not yet back
    free: int = 0  # slots in the free list
    retired: int = 0  # pinned slots, never reused


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
        self.remote_held_bytes = 0
        self.remote_held: dict[tuple[bytes, int], Block] = {}  # blocks with remote > 0
        self.server: release.ReleaseServer | None = None

    def address(self) -> bytes:
        if self.server is None:
            self.server = release.ReleaseServer(_on_release_records, _sweep_dead_holders)
        return self.server.address

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
                seg = _new_segment(self._next_arena_bytes(size), "arena")
                arena = _Arena(seg, size, seg.size // size)
                self.arenas[seg.id] = arena
                self.current[size] = arena
                self.cached_bytes += seg.size  # reserved, not yet handed out
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
            return  # _drop_remote_locked recycles (or retires) it when the count reaches zero
        self.recycle(block)

    def recycle(self, block: Block) -> None:
        seg = block.segment
        self.in_use_bytes -= block.capacity
        if seg.kind == "large":
            if block.pinned or block.capacity > self.cache_limit:
                _close_if_unused(seg)
            else:
                self.large_cache.append(seg)
                self.cached_bytes += seg.size
                self._trim()
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

    def manages(self, seg: Segment) -> bool:
        return seg.id in self.arenas or seg in self.large_cache


# -- process-wide state (reset in a forked child) --------------------------------------------
_lock = threading.Lock()
# Blocks whose root died, and ("forget", block) for unsent handles: queued by callbacks that
# may run while this thread holds the lock (garbage collection), processed under the lock.
_pending: collections.deque[_RootRef | tuple[str, Block]] = collections.deque()
_segments: dict[bytes, Segment] = {}  # every segment mapped in this process, by id
_root_blocks: dict[int, Block] = {}  # id(root array) -> block (checked against block.ref)
_foreign_idle: collections.OrderedDict[bytes, Segment] = collections.OrderedDict()
_allocator = _Allocator(_env_cache_limit())


class _Locked:
    """``with _locked:`` holds the lock and drains blocks queued by weakref callbacks."""

    def __enter__(self) -> None:
        _lock.acquire()

    def __exit__(self, *exc: object) -> None:
        _unlock()


_locked = _Locked()


def _unlock() -> None:
    """Release ``_lock`` (taken with ``_lock.acquire()``), first processing the blocks that
    weakref callbacks queued meanwhile, then any queued after (as ``with _locked:``)."""
    try:
        if _pending:
            _process_pending_locked()
    finally:
        _lock.release()
    if _pending:
        _drain()


def _process_pending_locked() -> None:
    while _pending:
        item = _pending.popleft()
        if isinstance(item, _RootRef):
            _free_locked(item)
        else:  # ("forget", block): an unsent handle
            block = item[1]
            seg = block.segment
            if block.owned and block.owner_pid == _allocator.pid:
                if (seg.id, block.offset) in _allocator.remote_held:
                    _drop_remote_locked(block, 1)
            else:  # we had acquired it for a forward: give that back
                release.post(seg.owner_addr, release.pack(b"D", seg.id, block.offset, 1))


def _drain() -> None:
    while _pending and _lock.acquire(blocking=False):
        try:
            _process_pending_locked()
        finally:
            _lock.release()


def _root_died(ref: _RootRef, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
    if _exiting or _finalizing():
        # Roots dying while the interpreter shuts down: everything this process received was
        # released by process_exiting(), and the kernel unmaps the rest. Doing more here would
        # run on half-torn-down modules (or start a thread, which hangs at shutdown). This
        # module's globals may be cleared already (``_exiting`` is then None): the check
        # uses nothing else of them.
        return
    _pending.append(ref)
    while _pending and _lock.acquire(False):  # as _drain()
        try:
            _process_pending_locked()
        finally:
            _lock.release()


def _free_locked(ref: _RootRef) -> None:
    block = ref.block
    seg = block.segment
    if seg.roots.get(block.offset) is ref:
        del seg.roots[block.offset]
    if _root_blocks.get(ref.root_id) is block:
        del _root_blocks[ref.root_id]
    if block.ref is not ref:
        return  # stale: the block got a new root (its own block came back) before we ran
    block.local_dead = True
    pid = _allocator.pid
    if block.owned and block.owner_pid == pid:
        _allocator.root_died(block)
        return
    if block.received and seg.owner_addr and seg.creator_pid != pid:
        _post_release_locked(block, block.capacity > SMALL_MAX)
    if (
        not seg.roots
        and seg.buffer is not None
        and (seg.creator_pid != pid or not _allocator.manages(seg))
    ):
        _keep_idle_foreign(seg)


def _post_release_locked(block: Block, urgent: bool = False) -> None:
    """Queue the records that give back every handle ``block`` received here: ``R`` for the
    ones the creator was told about, ``D`` for the ones it was not (see release.py)."""
    seg = block.segment
    announced = min(block.announced, block.received)
    if announced < block.received:
        _unannounced.discard(block)
        release.post(
            seg.owner_addr, release.pack(b"D", seg.id, block.offset, block.received - announced),
            urgent,
        )
    if announced:
        release.post(seg.owner_addr, release.pack(b"R", seg.id, block.offset, announced), urgent)
    block.received = block.announced = 0


# Foreign blocks holding handles the creator has not been told about yet (H records are
# sent lazily: see release.py). Cleared in a fork child, which holds nothing of its own.
_unannounced: set[Block] = set()


def _announce_holds_locked() -> None:
    for block in _unannounced:
        count = block.received - block.announced
        if count > 0 and not block.local_dead:
            seg = block.segment
            release.post(seg.owner_addr, release.pack(b"H", seg.id, block.offset, count))
            block.announced = block.received
    _unannounced.clear()


def _creator_alive(seg: Segment, thorough: bool = False) -> bool:
    """Whether the segment's creator still runs. The quick check (``kill(pid, 0)``) takes a
    zombie for alive; the thorough one (``/proc/<pid>/stat``) does not."""
    if thorough:
        return release.process_start_time(seg.creator_pid) is not None
    try:
        os.kill(seg.creator_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


_foreign_idle_bytes = 0  # sum of the sizes in _foreign_idle


def _keep_idle_foreign(seg: Segment) -> None:
    """Keep an idle mapping of another process's segment for reuse (bounded LRU).

    Only while its creator lives: a dead creator never reuses the segment, so keeping it
    would only hold its memory. The reaper thread (running while idle mappings exist) drops
    idle mappings whose creator died, within about a second; a consumer that takes arrays one
    by one makes a segment idle and busy again for every array, so nothing slower than a
    dict update happens here.
    """
    global _foreign_idle_bytes
    if seg.id not in _foreign_idle:
        _foreign_idle_bytes += seg.size
        _foreign_idle[seg.id] = seg
        if _foreign_idle_bytes > _allocator.cache_limit or len(_foreign_idle) > FOREIGN_CACHE_MAX:
            _trim_foreign(_allocator.cache_limit)
    else:
        _foreign_idle.move_to_end(seg.id)
    if _reaper is None:
        _start_idle_reaper()


def _unidle_foreign(seg_id: bytes) -> None:
    global _foreign_idle_bytes
    seg = _foreign_idle.pop(seg_id, None)
    if seg is not None:
        _foreign_idle_bytes -= seg.size


def _close_idle_of_dead_creators() -> None:
    for other in [s for s in _foreign_idle.values() if not _creator_alive(s, thorough=True)]:
        _close_if_unused(other)


_reaper: threading.Thread | None = None


def _start_idle_reaper() -> None:
    """Check idle foreign mappings about once a second while there are any, so a process that
    sits idle does not keep a dead creator's memory mapped (and, for ``file_system``
    segments, does not keep the cleanup daemon from removing the file). Called under the
    lock; ``_reaper`` is None exactly while no reaper thread runs."""
    global _reaper
    if _exiting or sys.is_finalizing():
        return
    _reaper = threading.Thread(target=_reap_idle, name="tensormp-idle-mappings", daemon=True)
    _reaper.start()


def _reap_idle() -> None:
    global _reaper
    while True:
        time.sleep(1.0)
        with _locked:
            _close_idle_of_dead_creators()
            if not _foreign_idle:
                _reaper = None
                return


def _trim_foreign(limit_bytes: int) -> None:
    while _foreign_idle and (
        _foreign_idle_bytes > limit_bytes or len(_foreign_idle) > FOREIGN_CACHE_MAX
    ):
        seg = next(iter(_foreign_idle.values()))
        _unidle_foreign(seg.id)
        _close_if_unused(seg)


def _close_if_unused(seg: Segment) -> None:
    if seg.roots or seg.closed:
        return
    if _segments.get(seg.id) is seg:
        del _segments[seg.id]
    if _foreign_idle.get(seg.id) is seg:
        _unidle_foreign(seg.id)
    seg.close()


_start_times: dict[int, int | None] = {}  # pid -> start time, for holders we have seen


# Acquire tokens (see release.py): counted acquires whose handle has not come back to us yet,
# and handles that came back to us before their acquire was counted.
_acquired: set[int] = set()
_early: set[int] = set()


def _on_release_records(pid: int, records: list[tuple[bytes, bytes, int, int, int]]) -> None:
    """Release server thread: process ``pid`` acquired, holds, released or dropped our blocks
    (one datagram's records, in order; see release.py)."""
    with _locked:
        remote_held = _allocator.remote_held
        key: tuple[int, int] | None = None  # the sender as (pid, start time), once needed
        for op, seg_id, offset, count, token in records:
            if op == b"A" and token in _early:
                _early.discard(token)  # its handle already came back to us: nothing is out
                continue
            block = remote_held.get((seg_id, offset))
            if block is None:
                continue  # unknown (already recycled, pinned at a fork, or not ours)
            if op == b"D":  # handles never announced as held: only the count changes
                _drop_remote_locked(block, count)
            elif op == b"A":
                block.remote += count
                if token:
                    _acquired.add(token)
            elif op == b"H" or op == b"R":
                if key is None:
                    key = _holder_key(pid)
                if pid and key[1] == 0 and op == b"H":  # the holder has already exited
                    _drop_remote_locked(block, count)
                    continue
                if pid:
                    # A negative count is kept: a child's release of its Process arguments
                    # can arrive before the parent registers it as their holder
                    # (register_holder), which then brings it back to zero instead of
                    # leaving a stale hold for the sweep to drop.
                    _holders_add(block, key, count if op == b"H" else -count)
                if op == b"R":
                    _drop_remote_locked(block, count)


def _holders_add(block: Block, key: tuple[int, int], delta: int) -> None:
    holders = block.holders
    if holders is None:
        if delta:
            block.holders = (key, delta)
    elif type(holders) is tuple:
        if holders[0] == key:
            held = holders[1] + delta
            block.holders = (key, held) if held else None
        elif delta:
            block.holders = {holders[0]: holders[1], key: delta}
    else:
        held = holders.get(key, 0) + delta  # type: ignore[union-attr]
        if held:
            holders[key] = held  # type: ignore[index]
        else:
            holders.pop(key, None)  # type: ignore[union-attr]
            if not holders:
                block.holders = None


def _holders_items(block: Block) -> list[tuple[tuple[int, int], int]]:
    holders = block.holders
    if holders is None:
        return []
    if type(holders) is tuple:
        return [holders]  # type: ignore[list-item]
    return list(holders.items())  # type: ignore[union-attr]


def _holder_key(pid: int) -> tuple[int, int]:
    """``(pid, start time)`` of a record's sender; start time 0: it has exited (pid 0: the
    kernel could not name it, e.g. another pid namespace; such holds are not tracked)."""
    if not pid:
        return (0, 0)
    start = _start_times.get(pid)
    if start is None:
        start = release.process_start_time(pid)
        if start is None:
            return (pid, 0)
        _start_times[pid] = start
    return (pid, start)


def _drop_remote_locked(block: Block, count: int) -> None:
    block.remote -= count
    if block.remote > 0:
        return
    block.remote = 0
    block.holders = None
    del _allocator.remote_held[(block.segment.id, block.offset)]
    if block.local_dead:  # our own view is gone too
        _allocator.remote_held_bytes -= block.capacity
        _allocator.recycle(block)


def _sweep_dead_holders() -> None:
    """Release server thread, about once a second: forget holds of processes that died."""
    with _locked:
        blocks = [b for b in _allocator.remote_held.values() if b.holders]
        alive: dict[tuple[int, int], bool] = {}
        for block in blocks:
            for key, held in _holders_items(block):
                if key not in alive:
                    alive[key] = key[1] != 0 and release.process_start_time(key[0]) == key[1]
                if not alive[key] and block.holders is not None:
                    _holders_add(block, key, -held)  # forget it
                    if held > 0:  # a negative count is a release that came before its hold
                        _drop_remote_locked(block, held)
        for pid in [p for p, st in _start_times.items() if not alive.get((p, st), True)]:
            del _start_times[pid]


def release_all_received() -> None:
    """This process is exiting: tell every creator that it lets go of what it received.

    Called when a tensormp ``Process`` finishes (its arrays are never used again) and at
    interpreter exit, so creators can recycle at once instead of waiting for a liveness check.
    """
    with _locked:
        pid = os.getpid()
        for block in _root_blocks.values():
            seg = block.segment
            if block.received and seg.owner_addr and seg.creator_pid != pid:
                _post_release_locked(block)
        _unannounced.clear()
        release.post_flush(block=True)


_forked_segments: set[bytes] = set()  # segments alive when this process forked
_exiting = False


def process_exiting() -> None:
    """This process is exiting (interpreter exit, or the end of a tensormp ``Process``):
    release what it received, and remove the names of its ``file_system`` segments that no
    other process can need: none of their blocks is held or in flight elsewhere (every handle
    sent came back released, counted after reading every record already in our socket) and no
    fork child inherited them. The cleanup daemon takes the rest once nobody maps them."""
    global _exiting
    release_all_received()
    strategies.flush_pending()
    server = _allocator.server
    if server is not None and _allocator.pid == os.getpid():
        server.drain()
    with _locked:
        _exiting = True
        pid = os.getpid()
        held = {seg_id for seg_id, _offset in _allocator.remote_held}
        for seg in list(_segments.values()):
            if seg.creator_pid == pid and seg.id not in held and seg.id not in _forked_segments:
                seg.strategy.remove(seg)  # its name, if it has one


def _make_root_locked(block: Block) -> np.ndarray:
    seg = block.segment
    offset = block.offset
    # Over the segment's one memoryview (no object per root): the root's base is not an
    # ndarray, so numpy's base chain of every view of the root ends at the root.
    root = np.ndarray((block.capacity,), np.uint8, seg.view, offset)
    ref = _RootRef(root, _root_died)
    ref.block = block
    ref.root_id = id(root)
    block.ref = ref
    block.local_dead = False
    seg.roots[offset] = ref
    _root_blocks[ref.root_id] = block
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
    server = _allocator.server
    if nbytes > SMALL_MAX and server is not None:
        # A large block is worth recycling: count every release already in our socket first
        # (the server thread batches them; see release.py).
        server.drain()
    with _locked:
        release.maybe_flush()
        return _make_root_locked(_allocator.allocate(nbytes))


def allocate_sent(nbytes: int) -> Block:
    """A fresh block for a copy that is being sent now, and nothing else: its one handle is
    counted (as :func:`note_handle`) and this process keeps no view of it (the block is
    ``local_dead`` from the start), so it is recycled as soon as the receiver lets go. The
    caller copies into it through a temporary view and must keep the segment alive until
    the message is sent (``Message.add_fd`` does). This skips a root, its weakref and its
    death: the per-array cost of a producer that sends fresh arrays."""
    if nbytes > SMALL_MAX and _allocator.server is not None:
        _allocator.server.drain()  # as allocate()
    _lock.acquire()
    try:
        block = _allocator.allocate(nbytes)
        seg = block.segment
        if not seg.owner_addr:
            seg.owner_addr = _allocator.address()
        _segments[seg.id] = seg
        _allocator.remote_held[(seg.id, block.offset)] = block
        block.remote = 1
        block.local_dead = True
        _allocator.remote_held_bytes += block.capacity
    finally:
        _unlock()
    return block


def find_block(obj: object) -> tuple[Block, np.ndarray] | None:
    """The block and root behind a view, or None when ``obj`` is not in tensormp memory."""
    while obj is not None:
        block = _root_blocks.get(id(obj))
        if block is not None and block.ref is not None and block.ref() is obj:
            return block, obj  # type: ignore[return-value]
        if isinstance(obj, memoryview):
            obj = obj.obj
        else:  # ndarray.base, and objects such as as_strided's DummyArray that keep a base
            obj = getattr(obj, "base", None)
    return None


def note_handle(block: Block) -> tuple[bytes, int]:
    """A handle to ``block`` is being pickled; returns ``(release address, acquire token)``.

    The creator counts the handle; a forwarding process first tells the creator (blocking
    ``acquire`` with a fresh token, which the handle carries) so the block cannot be recycled
    while the forwarded handle is out.
    """
    seg = block.segment
    with _locked:
        if block.owned and block.owner_pid == _allocator.pid:
            if block.pinned:
                return b"", 0
            if seg.owner_addr == b"":
                seg.owner_addr = _allocator.address()
            if block.remote == 0:
                _allocator.remote_held[(seg.id, block.offset)] = block
            block.remote += 1
            return seg.owner_addr, 0
        addr = seg.owner_addr
        if not addr or seg.creator_pid == os.getpid():
            return addr, 0
        token = int.from_bytes(os.urandom(8), "little") | 1
        # The acquire goes out now, blocking, in one datagram with the records queued before it
        # (holds for this creator ride along for free).
        release.post(addr, release.pack(b"A", seg.id, block.offset, 1, token))
        records = release.take_queued(addr)
    if not release.send_records(addr, records, block=True):
        # The creator is alive but did not take the acquire within 2 s (or is gone, in which
        # case nothing is recycled anyway). Never let it recycle early: keep our own view,
        # and so our hold, until this process exits.
        ref = block.ref
        root = ref() if ref is not None else None
        if root is not None:
            _held_forever.append(root)
    return addr, token


_held_forever: list[np.ndarray] = []


def forget_handle(block: Block) -> None:
    """Undo :func:`note_handle` for a handle that was never sent (pickling or put failed, or
    the message was dropped unsent). Safe to call from a finalizer."""
    seg = block.segment
    if block.owned and block.owner_pid == _allocator.pid:
        if not block.pinned and seg.owner_addr:
            _pending.append(("forget", block))  # may run from a finalizer: never wait here
            _drain()
    elif seg.owner_addr and seg.creator_pid != os.getpid():
        _pending.append(("forget", block))
        _drain()


def forget_received(owner_addr: bytes, seg_id: bytes, offset: int, creator_pid: int) -> None:
    """A handle to another process's block arrived here but could not be rebuilt (its file is
    gone, no fd...): release the creator's count for it, as if it had been held and dropped."""
    if owner_addr and creator_pid != os.getpid():
        with _locked:
            release.post(owner_addr, release.pack(b"D", seg_id, offset, 1), urgent=True)


def attach(
    wire: bytes,
    take_fd: Callable[[int], int],
    fd_ref: int | str,
    offset: int,
    capacity: int,
    token: int = 0,
    announce: bool = True,
) -> np.ndarray:
    """Root of the block ``[offset, offset+capacity)`` of a segment sent by another process.

    ``wire`` describes the segment (``Segment.wire``). Reuses this process's mapping of the
    segment (and its live root of the block) when it has one; otherwise calls
    ``take_fd(fd_ref)`` for the fd that came with the message and maps it. Counts the handle
    (see the module notes); ``announce`` False: the creator already knows this process holds
    it (a ``Process`` argument its parent registered).
    """
    seg_id = wire[:16]
    _lock.acquire()
    try:
        seg = _segments.get(seg_id)
        if seg is None or seg.buffer is None:
            seg_id, size, creator_pid, kind, code, owner_addr = unpack_wire(wire)
            seg = strategies.by_code(code).attach(seg_id, fd_ref, size, creator_pid, kind, take_fd)
            seg.owner_addr = owner_addr
            _segments[seg_id] = seg
        else:
            if _foreign_idle and seg_id in _foreign_idle:
                _unidle_foreign(seg_id)
            if not seg.owner_addr and len(wire) > WIRE_SIZE:
                seg.owner_addr = bytes(wire[WIRE_SIZE:])
        pid = _allocator.pid
        if seg.creator_pid == pid:
            held = _allocator.remote_held.get((seg_id, offset))
            if held is not None:  # our own block came back: that handle is consumed here
                if token and token not in _acquired:
                    _early.add(token)  # its acquire is not counted yet: it will cancel out
                else:
                    _acquired.discard(token)
                    held.remote -= 1
                if held.remote == 0:
                    held.holders = None
                    del _allocator.remote_held[(seg_id, offset)]
                root = held.ref() if held.ref is not None else None
                if root is not None:
                    return root  # type: ignore[return-value]
                if held.local_dead:  # it was counted as held remotely only
                    _allocator.remote_held_bytes -= held.capacity
                return _make_root_locked(held)  # our block, alive again (a pending death
                # of its old root, if any, is now stale and ignored)
        ref = seg.roots.get(offset)
        root = ref() if ref is not None else None
        if root is not None and root.nbytes >= capacity:  # type: ignore[attr-defined]
            block = _root_blocks[id(root)]
        else:
            block = Block(seg, offset, capacity, False, _allocator.pid)
            root = _make_root_locked(block)
        if not block.owned:
            block.received += 1
            if seg.owner_addr and seg.creator_pid != pid:
                if not announce:
                    block.announced += 1
                elif block not in _unannounced:
                    # Told lazily (release.py): a drop before the flush costs one D record.
                    if not _unannounced:
                        release.schedule_flush()
                    _unannounced.add(block)
        return root  # type: ignore[return-value]
    finally:
        _unlock()


def register_holder(pid: int, blocks: list[Block]) -> None:
    """Process ``pid`` (a child just started) holds one handle to each of our ``blocks``.

    It sends no hold records for them; if it dies before releasing them, even during
    start-up, the liveness sweep drops its holds. Its release may already have come (a child
    that ran and exited before its parent got here): every record already in our socket is
    read first, and a release found for ``pid`` cancels the hold instead of adding one.
    """
    server = _allocator.server
    if server is not None:
        server.drain()
    start = release.process_start_time(pid)
    with _locked:
        for block in blocks:
            if _allocator.remote_held.get((block.segment.id, block.offset)) is not block:
                continue  # released already, down to zero (maybe recycled and sent again)
            early = next((k for k, n in _holders_items(block) if k[0] == pid and n < 0), None)
            if early is not None:  # its release came first
                _holders_add(block, early, 1)
            elif start is None:
                _drop_remote_locked(block, 1)  # gone without releasing: nothing holds it now
            else:
                _holders_add(block, (pid, start), 1)
        if start is not None:
            _start_times[pid] = start


def flush_records() -> None:
    """Send queued hold/release records now. Called before this process sends a message or
    blocks waiting for one, so creators learn promptly who holds and who dropped what."""
    if _unannounced or release.has_queued():
        with _locked:
            _announce_holds_locked()
            release.post_flush()
    strategies.flush_pending()


def memory_stats() -> dict[str, int]:
    """Counters of this process's shared memory, in bytes and counts.

    Keys: ``in_use_bytes`` (blocks this process allocated that are alive here or elsewhere),
    ``cached_bytes`` (reserved but not handed out: free blocks, unused arena space, cached
    large segments), ``remote_held_bytes`` (blocks dropped here but still held, or unreceived,
    in other processes), ``foreign_cached_bytes`` (idle mappings of other processes' segments
    kept for reuse), ``cache_limit_bytes``, ``segments`` and ``mapped_bytes`` (mapped in this
    process, own and received), ``fds`` (segment fds held), ``arenas``, ``blocks`` (live roots).
    """
    with _locked:
        segs = [s for s in _segments.values() if not s.closed]
        return {
            "in_use_bytes": _allocator.in_use_bytes,
            "cached_bytes": _allocator.cached_bytes,
            "remote_held_bytes": _allocator.remote_held_bytes,
            "foreign_cached_bytes": _foreign_idle_bytes,
            "cache_limit_bytes": _allocator.cache_limit,
            "segments": len(segs),
            "mapped_bytes": sum(s.size for s in segs),
            "fds": sum(1 for s in segs if s.fd >= 0),
            "arenas": len(_allocator.arenas),
            "blocks": len(_root_blocks),
        }


def empty_cache() -> None:
    """Unmap every cached block and idle mapping of this process (as
    ``torch.cuda.empty_cache``): free blocks, unused arenas, cached large segments, and idle
    mappings of other processes' segments. Memory in use is untouched."""
    with _locked:
        _allocator._trim(0)
        _trim_foreign(0)


def set_cache_limit(nbytes: int) -> None:
    """Cap the bytes of free shared memory this process keeps for reuse (default 1 GiB).

    The same cap applies separately to idle mappings of other processes' segments. Also
    settable with the ``TENSORMP_CACHE_BYTES`` environment variable.

    Raises:
        ValueError: ``nbytes`` is not a non-negative int.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"cache limit must be a non-negative int of bytes, got {nbytes!r}")
    with _locked:
        _allocator.cache_limit = nbytes
        _allocator._trim()
        _trim_foreign(nbytes)


def get_cache_limit() -> int:
    """The byte cap set by :func:`set_cache_limit` or ``TENSORMP_CACHE_BYTES``."""
    return _allocator.cache_limit


# -- fork --------------------------------------------------------------------------------------
# Received blocks the next fork child holds one handle to: acquired for it in _before_fork.
_fork_acquired: list[Block] = []


def _before_fork() -> None:
    _lock.acquire()
    try:
        _acquire_for_child_locked()
    except Exception:  # pragma: no cover - a fork hook must not fail the fork
        pass


def _acquire_for_child_locked() -> None:
    """A fork child inherits this process's views of blocks it received; it must hold handles
    of its own, or our release (when our views die) would let the creator recycle memory the
    child still reads. Before the fork, tell each creator, blocking (``A`` records, as a
    forward does), that one more handle is out per such block; the child then owns that
    handle (released when its views die, or at its exit). A creator that does not take the
    records within 2 s: we keep our views until we exit instead, so it never recycles early.
    If the fork itself fails, the counts stay: those blocks are pinned until their creators
    exit (held longer, never reused too early)."""
    _fork_acquired.clear()
    pid = _allocator.pid
    by_addr: dict[bytes, list[Block]] = {}
    for block in _root_blocks.values():
        seg = block.segment
        if (
            not block.owned
            and block.received > 0
            and seg.owner_addr
            and seg.creator_pid != pid
            and block.ref is not None
            and block.ref() is not None
        ):
            by_addr.setdefault(seg.owner_addr, []).append(block)
    if not by_addr:
        return
    for addr, blocks in by_addr.items():
        for block in blocks:
            release.post(addr, release.pack(b"A", block.segment.id, block.offset, 1))
    release.post_flush(block=True)
    for addr, blocks in by_addr.items():
        if release.is_pending(addr):  # not taken: protect the child with our own views
            _held_forever.extend(b.ref() for b in blocks if b.ref is not None)
        else:
            _fork_acquired.extend(blocks)


def _after_fork_in_parent() -> None:
    # The child inherits every live block: none of them may be recycled by the parent now.
    try:
        for block in _root_blocks.values():
            block.pinned = True
        _forked_segments.update(_segments)
        _fork_acquired.clear()
    finally:
        _lock.release()
    _drain()


def _after_fork_in_child() -> None:
    global _lock, _pending, _allocator
    _lock = threading.Lock()
    _acquired.clear()
    _early.clear()
    _forked_segments.clear()
    global _reaper, _exiting
    _reaper = None
    _exiting = False
    _pending = collections.deque()
    _unannounced.clear()
    ours = {id(b) for b in _fork_acquired}  # the handles the parent acquired for us
    _fork_acquired.clear()
    for block in _root_blocks.values():
        block.pinned = True
        # The parent releases what it received; we release the one handle it acquired for us
        # (told as a hold at our first send or at exit: no thread is started in a fork hook).
        block.received = block.announced = 0
        if id(block) in ours:
            block.received = 1
            _unannounced.add(block)
    if _allocator.server is not None:
        _allocator.server.detach_after_fork()
    release.reset_after_fork()
    # Inherited segments and roots stay valid (the mappings are inherited); none is owned here.
    _allocator = _Allocator(_allocator.cache_limit)
    _foreign_idle.clear()
    global _foreign_idle_bytes
    _foreign_idle_bytes = 0
    for seg in list(_segments.values()):
        if not seg.roots:
            _close_if_unused(seg)


release.set_flusher(flush_records)
atexit.register(process_exiting)
_ready = True  # set last: other modules find this one in sys.modules while it is imported
os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
