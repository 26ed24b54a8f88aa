"""The allocator's state: one object per process, replaced whole in a fork child.

:class:`MemoryState` holds everything the allocator knows: the registry of mapped segments
(one :class:`~tensormp.memory.segment.Segment` per identity) and of live roots, the
sub-allocator (``arenas.py``), the cache of idle foreign mappings (``foreign.py``), the hold
accounting of the release protocol (``holds.py``), and the process's release server. The
allocator (``allocator.py``) keeps the current one in a module global; a fork child builds a
new one that keeps only the inherited mappings and roots (see ``allocator.py``, fork), so
parent and child never hand out the same block and the child never answers the parent's
release records.

Threads: all state is guarded by one lock (``with state:``). Weakref callbacks can run inside
any allocation (garbage collection), so they never wait for the lock: they queue the dead
root in :attr:`MemoryState.pending` and whoever holds the lock drains the queue before
releasing it (:meth:`MemoryState.unlock`).
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable

import numpy as np

from . import holds, release
from .arenas import SMALL_MAX, SubAllocator
from .blocks import Block, RootRef
from .foreign import ForeignCache
from .segment import Segment

__all__ = ["MemoryState", "RECENT_MAX", "RECENT_MAX_BYTES"]

RECENT_MAX = 32  # roots of received blocks kept after their last view died, at most
RECENT_MAX_BYTES = SMALL_MAX  # and only of arena blocks (1 MiB at most)


class MemoryState:
    """Everything this process's allocator knows (see the module notes).

    Args:
        cache_limit: bytes of free memory kept for reuse (and, separately, of idle foreign
            mappings).
        root_died: the weakref callback of every root (it queues the root in
            :attr:`pending` of the state current when it runs).

    Attributes:
        lock: guards everything below (``with state:`` takes it and drains ``pending``).
        pending: dead roots, and ``("forget", block)`` for unsent handles, queued by callbacks
            that may run while this thread holds the lock (garbage collection).
        segments: every segment mapped in this process, by id.
        root_blocks: ``id(root array) -> block`` (checked against ``block.ref``).
        arenas: the sub-allocator of this process's own blocks.
        foreign: idle mappings of other processes' segments.
        unannounced: foreign blocks holding handles the creator has not been told of yet.
        start_times: pid -> start time, for holders seen.
        early: acquire tokens whose handle came back before their ``A`` (``holds.py``).
        held_forever: roots kept until exit (a creator did not take an acquire in time).
        recent: roots of small blocks received lately, by ``id``, kept alive until the flush
            thread's next turn (see :meth:`keep_recent`).
        fork_acquired: received blocks the next fork child holds one handle to.
        forked_segments: ids of segments alive when this process forked.
        exiting: this process is exiting (``process_exiting`` ran).
        server: the release server (``release.py``), once a block of ours left.
    """

    __slots__ = (
        "lock", "pending", "segments", "root_blocks", "arenas", "foreign", "unannounced",
        "start_times", "early", "held_forever", "fork_acquired",
        "forked_segments", "exiting", "server", "root_died", "_token", "recent",
    )

    def __init__(self, cache_limit: int, root_died: Callable[[RootRef], None]) -> None:
        self.lock = threading.Lock()
        self.pending: collections.deque[RootRef | tuple[str, Block]] = collections.deque()
        self.segments: dict[bytes, Segment] = {}
        self.root_blocks: dict[int, Block] = {}
        self.arenas = SubAllocator(cache_limit, self.close_if_unused)
        self.foreign = ForeignCache(self.close_if_unused)
        self.unannounced: set[Block] = set()
        self.start_times: dict[int, int] = {}
        self.early: set[int] = set()
        self.held_forever: list[np.ndarray] = []
        self.fork_acquired: list[Block] = []
        self.forked_segments: set[bytes] = set()
        self.exiting = False
        self.server: release.ReleaseServer | None = None
        self.root_died = root_died
        self.recent: dict[int, np.ndarray] = {}
        # Acquire tokens (holds.py) only need to differ from the other tokens its creator may
        # see: a random odd start (a fresh one in each process: a fork child gets a new state)
        # stepped by 2, instead of a getrandom() call per forward.
        self._token = int.from_bytes(os.urandom(8), "little") | 1

    def new_token(self) -> int:
        """A fresh acquire token: odd, so never 0 (the lock is held)."""
        self._token = (self._token + 2) & 0xFFFF_FFFF_FFFF_FFFF
        return self._token

    # -- the lock -------------------------------------------------------------------------------
    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.unlock()

    def unlock(self) -> None:
        """Release the lock (taken with ``lock.acquire()``), first processing the roots that
        weakref callbacks queued meanwhile, then any queued after (as ``with state:``)."""
        try:
            if self.pending:
                self.process_pending()
        finally:
            self.lock.release()
        if self.pending:
            self.drain()

    def drain(self) -> None:
        """Process queued deaths if the lock is free (never waits for it)."""
        while self.pending and self.lock.acquire(blocking=False):
            try:
                self.process_pending()
            finally:
                self.lock.release()

    def process_pending(self) -> None:
        pending = self.pending
        while pending:
            item = pending.popleft()
            if isinstance(item, RootRef):
                self.free(item)
            else:  # ("forget", block): an unsent handle
                block = item[1]
                seg = block.segment
                if block.owned and block.owner_pid == self.arenas.pid:
                    # This very block, not whatever now lies at its place: if its count was
                    # given back already (its registered holder died), it may be recycled and
                    # handed out again, and that new use must not be freed (holds.py).
                    if self.arenas.remote_held.get((seg.id, block.offset)) is block:
                        holds.drop_remote(self, block, 1)
                else:  # we had acquired it for a forward: give that back
                    release.post(seg.owner_addr, release.pack(b"D", seg.id, block.offset, 1, 0))

    # -- roots ----------------------------------------------------------------------------------
    def make_root(self, block: Block) -> np.ndarray:
        """A new root for ``block`` (the lock is held)."""
        seg = block.segment
        offset = block.offset
        # Over the segment's one memoryview (no object per root): the root's base is not an
        # ndarray, so numpy's base chain of every view of the root ends at the root.
        root: np.ndarray = np.ndarray((block.capacity,), np.uint8, seg.view, offset)
        ref = RootRef(root, self.root_died)
        ref.block = block
        ref.root_id = id(root)
        block.ref = ref
        block.local_dead = False
        seg.roots[offset] = ref
        self.root_blocks[ref.root_id] = block
        self.segments[seg.id] = seg
        return root

    def keep_recent(self, root: np.ndarray) -> None:
        """Keep the new root of a small received block alive until the flush thread's next
        turn (at most ``_OUTBOX_AGE``, 50 ms; at most :data:`RECENT_MAX` of them). The same
        block received again meanwhile (a ping-pong, a consumer that sees a block often)
        reuses the root: no new root, no root death, no ``R`` then ``H`` per round trip, one
        ``R`` for all of them when it goes. The lock is held."""
        recent = self.recent
        if len(recent) >= RECENT_MAX:
            del recent[next(iter(recent))]  # its death, if any, waits in pending
        recent[id(root)] = root
        release.schedule_flush()

    def free(self, ref: RootRef) -> None:
        """The root behind ``ref`` died (the lock is held)."""
        block = ref.block
        seg = block.segment
        if seg.roots.get(block.offset) is ref:
            del seg.roots[block.offset]
        if self.root_blocks.get(ref.root_id) is block:
            del self.root_blocks[ref.root_id]
        if block.ref is not ref:
            return  # stale: the block got a new root (its own block came back) before we ran
        block.local_dead = True
        arenas = self.arenas
        pid = arenas.pid
        if block.owned and block.owner_pid == pid:
            arenas.root_died(block)
            return
        if block.received and seg.owner_addr and seg.creator_pid != pid:
            holds.post_release(self, block, block.capacity > SMALL_MAX)
        if (
            not seg.roots
            and seg.buffer is not None
            and (seg.creator_pid != pid or not arenas.manages(seg))
        ):
            self.foreign.keep(seg, arenas.cache_limit, self, self.exiting)

    def trim_caches(self) -> None:
        """Unmap what is kept only for reuse: free blocks, unused arenas, cached large segments
        and idle foreign mappings, closing their fds (the lock is held)."""
        if self.recent:
            self.recent.clear()
            self.process_pending()  # their roots died: their segments are idle now, trimmed next
        self.arenas.trim(0)
        self.foreign.trim(0)

    def close_if_unused(self, seg: Segment) -> None:
        """Unmap ``seg`` unless a root in it lives (or it is closed already)."""
        if seg.roots or seg.closed:
            return
        if self.segments.get(seg.id) is seg:
            del self.segments[seg.id]
        if self.foreign.idle.get(seg.id) is seg:
            self.foreign.unidle(seg.id)
        seg.close()

    # -- the release server ---------------------------------------------------------------------
    def address(self) -> bytes:
        """This process's release address (the server starts on first use)."""
        if self.server is None:
            self.server = release.ReleaseServer(self._on_records, self._sweep)
        return self.server.address

    def _on_records(self, pid: int, records: list[tuple[bytes, bytes, int, int, int]]) -> None:
        self.lock.acquire()
        try:
            holds.apply_records(self, pid, records)
        finally:
            self.unlock()

    def _sweep(self) -> None:
        with self:
            holds.sweep_dead_holders(self)

    def __repr__(self) -> str:
        return (
            f"<MemoryState pid={self.arenas.pid} segments={len(self.segments)} "
            f"roots={len(self.root_blocks)} arenas={len(self.arenas.arenas)}>"
        )
