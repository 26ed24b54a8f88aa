"""Hold accounting: the two ends of the release protocol (``release.py``) inside a process.

* The *creator* of a segment is the only process that ever reuses its blocks. Its count of
  *remote* holds on a block (``Block.remote``) is: handles it pickled, plus acquires from
  processes that forwarded the block, minus counts released by receivers. It recycles a block
  (free list, or cache of large segments, bounded by the cache limit: ``arenas.py``) when its
  own root is dead and the remote count is 0. It also records which live process holds how
  many (``Block.holders``, from ``H`` records) and drops the holds of processes that died
  (:func:`sweep_dead_holders`, about once a second on the release server thread): a
  SIGKILLed receiver cannot pin memory.
* A copy made only to be sent (``allocate_sent``: an array that was not shared yet, put on a
  queue) gets no root in its creator at all: it is counted as sent and "locally dead" from
  the start, and recycled as soon as the receiver's release comes back.
* A *receiver*'s root on a foreign block counts the handles it rebuilt into it
  (``Block.received``) and how many of those the creator was told about (``announced``:
  holds are announced lazily, see release.py; the others wait in ``MemoryState.unannounced``).
  When the root dies it sends ``R`` for the announced ones and ``D`` for the rest
  (:func:`post_release`).
* Acquire tokens: a forwarded handle carries the token of the forwarder's blocking ``A``
  record (``MemoryState.new_token``; the forwarder's unannounced holds ride in the same
  datagram, before the ``A``: ``allocator.note_handle``). When the creator itself receives that handle before its server thread has read the
  ``A``, the token waits in ``MemoryState.early`` and cancels the ``A`` when it comes; a counted
  ``A`` waits in its block's ``Block.acquired`` for its handle, which may never come back to the
  creator (a forward to a third process): a block's tokens are dropped when its remote count
  reaches zero, when every handle is back and none carrying them can still arrive.

* Recently received roots: a receiver keeps the root of an arena block (at most 1 MiB) that
  was shared memory in its sender (a re-send, not a fresh copy, which its creator never sends
  again) alive until the flush thread's next turn (at most 50 ms, at most 32 roots:
  ``MemoryState.keep_recent``), after the last view of it died. The same block received again
  meanwhile (a ping-pong, a block re-sent to a consumer) reuses that root: its hold grows by one
  (``received``), instead of a new root, an ``R`` for the old one and an ``H`` for the new one
  per round trip; one ``R`` covers them all when the root goes. The creator's recycling of such
  a block waits up to 50 ms more: what the outbox already does for every record. Blocks with a
  segment of their own are released at once (their creator may be waiting for them).

Every function here runs with ``MemoryState``'s lock held (the caller's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..liveness import process_start_time
from . import release
from .blocks import Block

if TYPE_CHECKING:
    from .arenas import SubAllocator

__all__ = [
    "HoldState", "holders_add", "holders_items", "holder_key", "drop_remote", "post_release",
    "announce_holds", "apply_records", "sweep_dead_holders", "take_back",
]


class HoldState(Protocol):
    """What the functions here read and change of the allocator's state: ``state.MemoryState``,
    which passes itself in (this module sits below ``state.py`` and does not import it)."""

    start_times: dict[int, int]
    early: set[int]
    unannounced: set[Block]
    arenas: SubAllocator


def holders_add(block: Block, key: tuple[int, int], delta: int) -> None:
    """Add ``delta`` (may be negative) to the handles ``key`` = ``(pid, start)`` holds."""
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
        assert isinstance(holders, dict)
        held = holders.get(key, 0) + delta
        if held:
            holders[key] = held
        else:
            holders.pop(key, None)
            if not holders:
                block.holders = None


def holders_items(block: Block) -> list[tuple[tuple[int, int], int]]:
    """``[((pid, start), count), ...]`` of ``block``'s holders."""
    holders = block.holders
    if holders is None:
        return []
    if type(holders) is tuple:
        return [holders]
    assert isinstance(holders, dict)
    return list(holders.items())


def holder_key(st: HoldState, pid: int) -> tuple[int, int]:
    """``(pid, start time)`` of a record's sender; start time 0: it has exited (pid 0: the
    kernel could not name it, e.g. another pid namespace; such holds are not tracked)."""
    if not pid:
        return (0, 0)
    start = st.start_times.get(pid)
    if start is None:
        start = process_start_time(pid)
        if start is None:
            return (pid, 0)
        st.start_times[pid] = start
    return (pid, start)


def drop_remote(st: HoldState, block: Block, count: int) -> None:
    """``count`` remote handles to our ``block`` are gone; recycle it when none is left and
    our own view is dead too."""
    block.remote -= count
    if block.remote > 0:
        return
    block.remote = 0
    block.holders = None
    block.acquired = None  # no handle is out: none of these tokens can come back
    arenas = st.arenas
    del arenas.remote_held[(block.segment.id, block.offset)]
    if block.local_dead:  # our own view is gone too
        arenas.remote_held_bytes -= block.capacity
        arenas.recycle(block)


def take_back(st: HoldState, held: Block, token: int) -> None:
    """Our own block ``held`` came back to us in a handle (carrying acquire ``token``, or 0):
    that handle is consumed here."""
    acquired = held.acquired
    if token and (acquired is None or token not in acquired):
        st.early.add(token)  # its acquire is not counted yet: it will cancel out
    else:
        if acquired is not None:
            acquired.discard(token)
        held.remote -= 1
    if held.remote == 0:
        held.holders = None
        held.acquired = None
        del st.arenas.remote_held[(held.segment.id, held.offset)]


def post_release(st: HoldState, block: Block, urgent: bool = False) -> None:
    """Queue the records that give back every handle ``block`` received here: ``R`` for the
    ones the creator was told about, ``D`` for the ones it was not (see release.py)."""
    seg = block.segment
    announced = min(block.announced, block.received)
    if announced < block.received:
        st.unannounced.discard(block)
        release.post(
            seg.owner_addr, release.pack(b"D", seg.id, block.offset, block.received - announced, 0),
            urgent,
        )
    if announced:
        release.post(seg.owner_addr, release.pack(b"R", seg.id, block.offset, announced, 0), urgent)
    block.received = block.announced = 0


def announce_holds(st: HoldState) -> None:
    """Queue ``H`` records for every handle received here that its creator was not told of."""
    for block in st.unannounced:
        count = block.received - block.announced
        if count > 0 and not block.local_dead:
            seg = block.segment
            release.post(seg.owner_addr, release.pack(b"H", seg.id, block.offset, count, 0))
            block.announced = block.received
    st.unannounced.clear()


def apply_records(
    st: HoldState, pid: int, records: list[tuple[bytes, bytes, int, int, int]]
) -> None:
    """Process ``pid`` acquired, holds, released or dropped our blocks (one datagram's
    records, in order; see release.py)."""
    remote_held = st.arenas.remote_held
    early = st.early
    key: tuple[int, int] | None = None  # the sender as (pid, start time), once needed
    for op, seg_id, offset, count, token in records:
        if op == b"A" and token in early:
            early.discard(token)  # its handle already came back to us: nothing is out
            continue
        block = remote_held.get((seg_id, offset))
        if block is None:
            continue  # unknown (already recycled, pinned at a fork, or not ours)
        if op == b"D":  # handles never announced as held: only the count changes
            drop_remote(st, block, count)
        elif op == b"A":
            block.remote += count
            if token:
                if block.acquired is None:
                    block.acquired = set()
                block.acquired.add(token)
        elif op == b"H" or op == b"R":
            if key is None:
                key = holder_key(st, pid)
            if pid and key[1] == 0 and op == b"H":  # the holder has already exited
                drop_remote(st, block, count)
                continue
            if pid:
                # A negative count is kept: a child's release of its Process arguments
                # can arrive before the parent registers it as their holder
                # (register_holder), which then brings it back to zero instead of
                # leaving a stale hold for the sweep to drop.
                holders_add(block, key, count if op == b"H" else -count)
            if op == b"R":
                drop_remote(st, block, count)


def sweep_dead_holders(st: HoldState) -> None:
    """Forget the holds of processes that died (release server thread, about once a second)."""
    alive: dict[tuple[int, int], bool] = {}

    def is_alive(key: tuple[int, int]) -> bool:
        known = alive.get(key)
        if known is None:
            known = alive[key] = key[1] != 0 and process_start_time(key[0]) == key[1]
        return known

    # First forget the start time of every process that exited, holder or not: its pid may be
    # reused, and a new process's holds keyed with the old start time would be dropped as dead
    # below (their blocks recycled while held). Only a pid reused between two sweeps (about a
    # second) escapes this: the kernel's whole pid range would have to wrap meanwhile.
    start_times = st.start_times
    for pid, start in list(start_times.items()):
        if not is_alive((pid, start)):
            del start_times[pid]
    for block in [b for b in st.arenas.remote_held.values() if b.holders]:
        for key, held in holders_items(block):
            # A negative count is a release that came before its holder was registered
            # (register_holder): kept, even once that holder died, for the registration to
            # cancel; forgotten, it would make the registration give the handle back again.
            # It goes with the block's holders when its count reaches zero.
            if held > 0 and not is_alive(key) and block.holders is not None:
                holders_add(block, key, -held)  # forget it
                drop_remote(st, block, held)
