"""The allocator's public functions: allocation, handles, the receive path, exit and fork.

Design (read this before changing anything below)
--------------------------------------------------
Memory comes in *segments* (``segment.py``: one shared-memory file, one mapping per process,
made by the current sharing strategy). Arrays live in *blocks* of segments, seen through one
*root* per process (``blocks.py``). Small requests are carved from size-class *arenas*, larger
ones get a segment of their own (``arenas.py``). The state of all this is one object,
``MemoryState`` (``state.py``), kept in :data:`_state`; every function below takes its lock.

Who owns what, who frees what (details in ``holds.py`` and ``release.py``):
* The *creator* of a segment (the process whose allocator made it) is the only process that
  ever reuses its blocks. It recycles a block when its own root is dead and no handle to it is
  held or in flight elsewhere. A copy made only to be sent (:func:`allocate_sent`) gets no root
  in its creator at all: a producer that sends fresh arrays pays no root, weakref or root death
  per array.
* A receiver's root on a foreign block counts the handles it rebuilt into it; when the root
  dies, it tells the creator. The receiver keeps the segment mapped in an LRU cache of idle
  foreign mappings (``foreign.py``), so the next array in the same segment costs no mmap and no
  page faults. ``empty_cache()`` unmaps them.
* Blocks alive when a process forks are *pinned*: the child can write them through memory it
  inherited without ever sending a release, so the parent never recycles them. Blocks the
  parent *received* are another matter (their creator recycles them once the parent lets go):
  before the fork, the parent acquires one handle per such block for the child (blocking
  ``A`` records, as a forward does), and the child releases it when its own views die.

What each party sees when another is SIGKILLed at any line: nothing to clean up. There is no
name and no shared counter; memory is held by fds and mappings, which the kernel drops with the
dead process. A receiver keeps a valid mapping after the creator died. A creator whose receiver
died keeps that block pinned (never reused too early) until the liveness sweep or its exit.

Threads and fork: all state is guarded by one lock (``state.py`` has how weakref callbacks
avoid waiting for it). ``os.register_at_fork`` pins every live block in the parent and gives
the child a fresh ``MemoryState`` that keeps only the inherited mappings and roots (empty free
lists, no release server): parent and child never hand out the same block.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import strategies
from ..errors import FdLimitError
from . import holds, release
from .arenas import SMALL_MAX, env_cache_limit
from .blocks import Block, RootRef
from .segment import WIRE_SIZE, unpack_wire
from .state import RECENT_MAX_BYTES, MemoryState

__all__ = [
    "Block",
    "allocate",
    "attach",
    "find_block",
    "root_at",
    "allocate_sent",
    "note_handle",
    "forget_handle",
    "forget_received",
    "release_all_received",
    "process_exiting",
    "register_holder",
    "held_elsewhere",
    "flush_records",
    "memory_stats",
    "empty_cache",
    "set_cache_limit",
    "get_cache_limit",
]


def _root_died(ref: RootRef, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
    st = _state
    if _finalizing() or st.exiting:
        # Roots dying while the interpreter shuts down: everything this process received was
        # released by process_exiting(), and the kernel unmaps the rest. Doing more here would
        # run on half-torn-down modules (or start a thread, which hangs at shutdown). This
        # module's globals may be cleared already (``_state`` is then None): that happens
        # only while finalizing, which is checked first.
        return
    st.pending.append(ref)
    while st.pending and st.lock.acquire(False):  # as st.drain(), without a call per root
        try:
            st.process_pending()
        finally:
            st.lock.release()


# The state of this process's allocator (replaced whole in a fork child: see the end).
_state: MemoryState = MemoryState(env_cache_limit(), _root_died)


def allocate(nbytes: int) -> np.ndarray:
    """Allocate ``nbytes`` of shared memory; returns the block's root (1-D ``uint8``).

    The root may be longer than ``nbytes`` (size classes). Its contents are undefined
    (zeros for fresh memory, old bytes for a recycled block).

    Raises:
        ValueError: ``nbytes`` is negative.
        SharedMemoryError: the memory could not be reserved (``ENOSPC``/``ENOMEM``).
    """
    if nbytes < 0:
        raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
    st = _state
    server = st.server
    if nbytes > SMALL_MAX and server is not None:
        # A large block is worth recycling: count every release already in our socket first
        # (the server thread batches them; see release.py).
        server.drain()
    with st:
        release.maybe_flush()
        try:
            block = st.arenas.allocate(nbytes)
        except FdLimitError:  # give back the fds kept only for reuse, and try once more
            st.trim_caches()
            block = st.arenas.allocate(nbytes)
        return st.make_root(block)


def allocate_sent(nbytes: int) -> Block:
    """A fresh block for a copy that is being sent now, and nothing else: its one handle is
    counted (as :func:`note_handle`) and this process keeps no view of it (the block is
    ``local_dead`` from the start), so it is recycled as soon as the receiver lets go. The
    caller copies into it through a temporary view and must keep the segment alive until
    the message is sent (``Message.add_fd`` does). This skips a root, its weakref and its
    death: the per-array cost of a producer that sends fresh arrays."""
    st = _state
    if nbytes > SMALL_MAX and st.server is not None:
        st.server.drain()  # as allocate()
    st.lock.acquire()
    try:
        arenas = st.arenas
        try:
            block = arenas.allocate(nbytes)
        except FdLimitError:  # as allocate()
            st.trim_caches()
            block = arenas.allocate(nbytes)
        seg = block.segment
        if not seg.owner_addr:
            seg.owner_addr = st.address()
        st.segments[seg.id] = seg
        arenas.remote_held[(seg.id, block.offset)] = block
        block.remote = 1
        block.local_dead = True
        arenas.remote_held_bytes += block.capacity
    finally:
        st.unlock()
    return block


# Objects of other array libraries that view memory (a torch tensor is the base of its
# ``.numpy()``): a function from such an object to the next one to follow towards a root (an
# array whose base chain reaches it), or None. Set by ``reducers/torch_storage.py``.
foreign_base: Callable[[object], object | None] | None = None


def find_block(obj: object) -> tuple[Block, np.ndarray] | None:
    """The block and root behind a view, or None when ``obj`` is not in tensormp memory."""
    root_blocks = _state.root_blocks
    while obj is not None:
        block = root_blocks.get(id(obj))
        if block is not None and block.ref is not None and block.ref() is obj:
            return block, obj  # type: ignore[return-value]
        if isinstance(obj, memoryview):
            obj = obj.obj
            continue
        base = getattr(obj, "base", None)  # ndarray.base; as_strided's DummyArray keeps one too
        if base is None and foreign_base is not None and not isinstance(obj, np.ndarray):
            base = foreign_base(obj)
        obj = base
    return None


def root_at(address: int, nbytes: int) -> np.ndarray | None:
    """The live root of this process whose memory holds ``[address, address + nbytes)``, or
    None: the segment mapped there (a scan of this process's segments, not of its blocks), then
    the root of the block that starts at ``address`` (O(1)), else each of that segment's roots
    (a view inside a block of an arena holding thousands: about 2 ms for 20,000). For memory
    another library wraps without a base chain (``torch.from_numpy`` of a tensormp array), not
    for the per-array path."""
    end = address + nbytes
    st = _state
    with st:
        for seg in st.segments.values():
            if seg.buffer is None or not seg.address <= address < seg.address + seg.size:
                continue
            ref = seg.roots.get(address - seg.address)  # a block's start (an mp.zeros array)
            refs = [ref] if ref is not None else list(seg.roots.values())
            for ref in refs:
                root = ref()
                if root is not None:
                    start = root.__array_interface__["data"][0]
                    if start <= address and end <= start + root.nbytes:
                        return root
            return None
    return None


def note_handle(block: Block) -> tuple[bytes, int]:
    """A handle to ``block`` is being pickled; returns ``(release address, acquire token)``.

    The creator counts the handle; a forwarding process first tells the creator (blocking
    ``acquire`` with a fresh token, which the handle carries) so the block cannot be recycled
    while the forwarded handle is out, in one datagram with its records queued for that
    creator and its holds not announced yet (release.py).
    """
    seg = block.segment
    st = _state
    st.lock.acquire()  # not ``with st``: two calls less on the per-array path
    try:
        arenas = st.arenas
        if block.owned and block.owner_pid == arenas.pid:
            if block.pinned:
                return b"", 0
            if seg.owner_addr == b"":
                seg.owner_addr = st.address()
            if block.remote == 0:
                arenas.remote_held[(seg.id, block.offset)] = block
            block.remote += 1
            return seg.owner_addr, 0
        addr = seg.owner_addr
        if not addr or seg.creator_pid == arenas.pid:
            return addr, 0
        token = st.new_token()
        # The acquire goes out now, blocking, in one datagram with everything this process has
        # for that creator: the records queued before it, and the holds not announced yet
        # (the block being forwarded was usually just received). Without them the holds would
        # follow in a second datagram, a second wake-up of the creator's release thread.
        if st.unannounced:
            holds.announce_holds(st)
        records = release.take_queued(addr) + release.pack(b"A", seg.id, block.offset, 1, token)
    finally:
        st.unlock()
    if not release.send_records(addr, records, block=True):
        # The creator is alive but did not take the acquire within 2 s (or is gone, in which
        # case nothing is recycled anyway). Never let it recycle early: keep our own view,
        # and so our hold, until this process exits.
        ref = block.ref
        root = ref() if ref is not None else None
        if root is not None:
            st.held_forever.append(root)
    return addr, token


def forget_handle(block: Block) -> None:
    """Undo :func:`note_handle` for a handle that was never sent (pickling or put failed, or
    the message was dropped unsent). Safe to call from a finalizer."""
    seg = block.segment
    st = _state
    if block.owned and block.owner_pid == st.arenas.pid:
        if not block.pinned and seg.owner_addr:
            st.pending.append(("forget", block))  # may run from a finalizer: never wait here
            st.drain()
    elif seg.owner_addr and seg.creator_pid != st.arenas.pid:
        st.pending.append(("forget", block))
        st.drain()


def forget_received(owner_addr: bytes, seg_id: bytes, offset: int, creator_pid: int) -> None:
    """A handle to another process's block arrived here but could not be rebuilt (its file is
    gone, no fd...): release the creator's count for it, as if it had been held and dropped."""
    if owner_addr and creator_pid != _state.arenas.pid:
        with _state:
            release.post(owner_addr, release.pack(b"D", seg_id, offset, 1, 0), urgent=True)


def attach(
    wire: bytes,
    take_fd: Callable[[int], int],
    fd_ref: int | str,
    offset: int,
    capacity: int,
    token: int = 0,
    announce: bool = True,
    keep: bool = False,
) -> np.ndarray:
    """Root of the block ``[offset, offset+capacity)`` of a segment sent by another process.

    ``wire`` describes the segment (``Segment.wire``). Reuses this process's mapping of the
    segment (and its live root of the block) when it has one; otherwise the segment's
    strategy (named by the wire) maps it from ``fd_ref``, calling ``take_fd`` for an fd that
    came with the message. Counts the handle (see ``holds.py``); ``announce`` False: the
    creator already knows this process holds it (a ``Process`` argument its parent
    registered); ``keep``: the block is shared memory that its sender may send again, so a new
    root of a small one is kept a while after its last view dies (``MemoryState.keep_recent``);
    else it is a copy the sender made for this process alone (``Block.copy``).

    Raises:
        HandleError: the segment cannot be mapped (its fd or file is missing).
    """
    seg_id = wire[:16]
    st = _state
    st.lock.acquire()
    try:
        seg = st.segments.get(seg_id)
        if seg is None or seg.buffer is None:
            seg_id, size, creator_pid, kind, code, owner_addr = unpack_wire(wire)
            seg = strategies.by_code(code).attach(seg_id, fd_ref, size, creator_pid, kind, take_fd)
            seg.owner_addr = owner_addr
            st.segments[seg_id] = seg
        else:
            foreign = st.foreign
            if foreign.idle and seg_id in foreign.idle:
                foreign.unidle(seg_id)
            if not seg.owner_addr and len(wire) > WIRE_SIZE:
                seg.owner_addr = bytes(wire[WIRE_SIZE:])
        pid = st.arenas.pid
        if seg.creator_pid == pid:
            held = st.arenas.remote_held.get((seg_id, offset))
            if held is not None:  # our own block came back: that handle is consumed here
                holds.take_back(st, held, token)
                root = held.ref() if held.ref is not None else None
                if root is not None:
                    return root
                if held.local_dead:  # it was counted as held remotely only
                    st.arenas.remote_held_bytes -= held.capacity
                return st.make_root(held)  # our block, alive again (a pending death of its
                # old root, if any, is now stale and ignored)
        ref = seg.roots.get(offset)
        root = ref() if ref is not None else None
        if root is not None and root.nbytes >= capacity:
            block = st.root_blocks[id(root)]
            if keep:
                block.copy = False
        else:
            block = Block(seg, offset, capacity, False, pid)
            root = st.make_root(block)
            if not keep:  # a first send's copy: nobody else views it
                block.copy = True
            elif capacity <= RECENT_MAX_BYTES and seg.creator_pid != pid:
                st.keep_recent(root)
        if not block.owned:
            # A hold (holds.py): told lazily (release.py), so a drop before the flush costs
            # one D record.
            block.received += 1
            if seg.owner_addr and seg.creator_pid != pid:
                if not announce:
                    block.announced += 1
                elif block not in st.unannounced:
                    if not st.unannounced:
                        release.schedule_flush()
                    st.unannounced.add(block)
        return root
    finally:
        st.unlock()


def register_holder(pid: int, blocks: list[Block]) -> None:
    """Process ``pid`` (a child just started) holds one handle to each of our ``blocks``.

    It sends no hold records for them; if it dies before releasing them, even during
    start-up, the liveness sweep drops its holds. Its release may already have come (a child
    that ran and exited before its parent got here): every record already in our socket is
    read first, and a release found for ``pid`` cancels the hold instead of adding one.

    Call it only once the message carrying the handles was sent (``Message.sent``): from then
    on ``pid`` gives them back (its release, or its death). A message that was not sent gives
    them back itself (``forget_handle``); registering it too would give one handle back twice,
    and the second time free the block's next use.
    """
    st = _state
    server = st.server
    if server is not None:
        server.drain()
    start = release.process_start_time(pid)
    with st:
        remote_held = st.arenas.remote_held
        for block in blocks:
            if remote_held.get((block.segment.id, block.offset)) is not block:
                continue  # released already, down to zero (maybe recycled and sent again)
            early = next(
                (k for k, n in holds.holders_items(block) if k[0] == pid and n < 0), None
            )
            if early is not None:  # its release came first
                holds.holders_add(block, early, 1)
            elif start is None:
                holds.drop_remote(st, block, 1)  # gone without releasing: nothing holds it now
            else:
                holds.holders_add(block, (pid, start), 1)
        if start is not None:
            st.start_times[pid] = start


def held_elsewhere(block: Block) -> bool:
    """Whether a process other than this one may hold ``block`` (or a handle to it in flight).

    Exact for a block this process created: every release already in its socket is counted and
    the holds of dead processes are dropped first, so a block whose other holders all exited is
    not held elsewhere. A block alive at a fork (a child may map it) or received from another
    process (its creator, and maybe others, may hold it) always is.
    """
    st = _state
    if not (block.owned and block.owner_pid == st.arenas.pid) or block.pinned:
        return True
    server = st.server
    if server is not None:
        server.drain()
    with st:
        if block.remote:
            holds.sweep_dead_holders(st)
        return block.remote > 0


def flush_records() -> None:
    """Send queued hold/release records now, and what the strategies queued. Called before
    this process sends a message or blocks waiting for one, so creators learn promptly who
    holds and who dropped what."""
    st = _state
    if st.unannounced or release.has_queued():
        with st:
            holds.announce_holds(st)
            release.post_flush()
    strategies.flush_pending()


def _tick() -> None:
    """The flush thread's turn (``_OUTBOX_AGE`` after it was armed): let the recently received
    roots go (``MemoryState.recent``), then send what is queued."""
    st = _state
    st.lock.acquire()
    try:
        recent, st.recent = st.recent, {}
    finally:
        st.unlock()
    del recent  # roots without other views die here: their releases are queued
    flush_records()


def release_all_received() -> None:
    """This process is exiting: tell every creator that it lets go of what it received.

    Called when a tensormp ``Process`` finishes (its arrays are never used again) and at
    interpreter exit, so creators can recycle at once instead of waiting for a liveness check.
    """
    st = _state
    with st:
        pid = os.getpid()
        for block in st.root_blocks.values():
            seg = block.segment
            if block.received and seg.owner_addr and seg.creator_pid != pid:
                holds.post_release(st, block)
        st.unannounced.clear()
        release.post_flush(block=True)


def process_exiting() -> None:
    """This process is exiting (interpreter exit, or the end of a tensormp ``Process``):
    release what it received, and let the strategies drop the names of its segments that no
    other process can need (``file_system``): none of their blocks is held or in flight
    elsewhere (every handle sent came back released, counted after reading every record
    already in our socket) and no fork child inherited them. The cleanup daemon takes the
    rest once nobody maps them."""
    release_all_received()
    strategies.flush_pending()
    st = _state
    server = st.server
    if server is not None and st.arenas.pid == os.getpid():
        server.drain()
    with st:
        st.exiting = True
        pid = os.getpid()
        held = {seg_id for seg_id, _offset in st.arenas.remote_held}
        for seg in list(st.segments.values()):
            if seg.creator_pid == pid and seg.id not in held and seg.id not in st.forked_segments:
                seg.strategy.remove(seg)  # its name, if it has one
    # Nothing more to tell anyone: close the sockets that told them, rather than leave them to
    # the interpreter's last collection (a ResourceWarning each under -X dev).
    release.close_clients()
    strategies.close_connections()


def memory_stats() -> dict[str, int]:
    """Counters of this process's shared memory, in bytes and counts.

    Keys: ``in_use_bytes`` (blocks this process allocated that are alive here or elsewhere),
    ``cached_bytes`` (reserved but not handed out: free blocks, unused arena space, cached
    large segments), ``remote_held_bytes`` (blocks dropped here but still held, or unreceived,
    in other processes), ``foreign_cached_bytes`` (idle mappings of other processes' segments
    kept for reuse), ``cache_limit_bytes``, ``segments`` and ``mapped_bytes`` (mapped in this
    process, own and received), ``fds`` (segment fds held), ``arenas``, ``blocks`` (live roots).
    """
    st = _state
    with st:
        arenas = st.arenas
        segs = [s for s in st.segments.values() if not s.closed]
        return {
            "in_use_bytes": arenas.in_use_bytes,
            "cached_bytes": arenas.cached_bytes,
            "remote_held_bytes": arenas.remote_held_bytes,
            "foreign_cached_bytes": st.foreign.idle_bytes,
            "cache_limit_bytes": arenas.cache_limit,
            "segments": len(segs),
            "mapped_bytes": sum(s.size for s in segs),
            "fds": sum(1 for s in segs if s.fd >= 0),
            "arenas": len(arenas.arenas),
            "blocks": len(st.root_blocks),
        }


def empty_cache() -> None:
    """Unmap every cached block and idle mapping of this process (as
    ``torch.cuda.empty_cache``): free blocks, unused arenas, cached large segments, and idle
    mappings of other processes' segments. Memory in use is untouched."""
    st = _state
    with st:
        st.trim_caches()


def set_cache_limit(nbytes: int) -> None:
    """Cap the bytes of free shared memory this process keeps for reuse (default 1 GiB).

    The same cap applies separately to idle mappings of other processes' segments. Also
    settable with the ``TENSORMP_CACHE_BYTES`` environment variable.

    Raises:
        ValueError: ``nbytes`` is not a non-negative int.
    """
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise ValueError(f"cache limit must be a non-negative int of bytes, got {nbytes!r}")
    st = _state
    with st:
        st.arenas.cache_limit = nbytes
        st.arenas.trim()
        st.foreign.trim(nbytes)


def get_cache_limit() -> int:
    """The byte cap set by :func:`set_cache_limit` or ``TENSORMP_CACHE_BYTES``."""
    return _state.arenas.cache_limit


# -- fork --------------------------------------------------------------------------------------
def _before_fork() -> None:
    st = _state
    st.lock.acquire()
    try:
        _acquire_for_child_locked(st)
    except Exception:  # pragma: no cover - a fork hook must not fail the fork
        pass


def _acquire_for_child_locked(st: MemoryState) -> None:
    """A fork child inherits this process's views of blocks it received; it must hold handles
    of its own, or our release (when our views die) would let the creator recycle memory the
    child still reads. Before the fork, tell each creator, blocking (``A`` records, as a
    forward does), that one more handle is out per such block; the child then owns that
    handle (released when its views die, or at its exit). A creator that does not take the
    records within 2 s: we keep our views until we exit instead, so it never recycles early.
    If the fork itself fails, the counts stay: those blocks are pinned until their creators
    exit (held longer, never reused too early)."""
    st.fork_acquired.clear()
    pid = st.arenas.pid
    by_addr: dict[bytes, list[Block]] = {}
    for block in st.root_blocks.values():
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
            release.post(addr, release.pack(b"A", block.segment.id, block.offset, 1, 0))
    release.post_flush(block=True)
    for addr, blocks in by_addr.items():
        if release.is_pending(addr):  # not taken: protect the child with our own views
            st.held_forever.extend(
                root for b in blocks if b.ref is not None and (root := b.ref()) is not None
            )
        else:
            st.fork_acquired.extend(blocks)


def _after_fork_in_parent() -> None:
    # The child inherits every live block: none of them may be recycled by the parent now.
    st = _state
    try:
        for block in st.root_blocks.values():
            block.pinned = True
        st.forked_segments.update(st.segments)
        st.fork_acquired.clear()
    finally:
        st.lock.release()
    st.drain()


def _after_fork_in_child() -> None:
    """A new state: the inherited mappings and roots stay valid (the mappings are inherited),
    none is owned here, and nothing else of the parent's state is ours."""
    global _state
    parent = _state
    st = MemoryState(parent.arenas.cache_limit, _root_died)
    st.segments = parent.segments
    st.root_blocks = parent.root_blocks
    st.start_times = parent.start_times
    st.held_forever = parent.held_forever
    st.recent = parent.recent  # (dropped here, their roots would die in this fork hook)
    ours = {id(b) for b in parent.fork_acquired}  # the handles the parent acquired for us
    for block in st.root_blocks.values():
        block.pinned = True
        # The parent releases what it received; we release the one handle it acquired for us
        # (told as a hold at our first send or at exit: no thread is started in a fork hook).
        block.received = block.announced = 0
        if id(block) in ours:
            block.received = 1
            st.unannounced.add(block)
    if parent.server is not None:
        parent.server.detach_after_fork()
    release.reset_after_fork()
    _state = st
    for seg in list(st.segments.values()):
        if not seg.roots:
            st.close_if_unused(seg)


def __getattr__(name: str) -> Any:
    # Names of the module globals that became the state's fields, which tests read:
    # ``_allocator`` (they start the release server through it) and ``_segments``.
    if name == "_allocator":
        return _state
    if name == "_segments":
        return _state.segments
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


release.set_flusher(flush_records, _tick)
atexit.register(process_exiting)
os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
