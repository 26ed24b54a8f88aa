"""Blocks and roots: how a process sees a byte range of a segment.

Arrays live in *blocks*: a byte range ``[offset, offset + capacity)`` of one segment
(``segment.py``). Each process sees a block through one *root*: a 1-D ``uint8`` ndarray over
the block's bytes. Every array tensormp hands out is a view of a root, so numpy's ``base``
chain leads from any view back to its root, and the root's lifetime is the block's lifetime in
this process. A weakref (:class:`RootRef`) on the root tells the allocator when the last view
is gone (``state.py`` has what happens then).

A :class:`Block` records who may recycle it (``owned``: this process's allocator handed it
out) and the counts of the release protocol (``release.py``, ``holds.py``): handles held
elsewhere (``remote``, by holder in ``holders``), handles this process received and how many
of those the creator was told about (``received``, ``announced``).
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING

import numpy as np

from .segment import Segment, format_bytes

__all__ = ["Block", "RootRef", "Holders"]

if TYPE_CHECKING:
    _WeakRoot = weakref.ref[np.ndarray]
else:
    _WeakRoot = weakref.ref

Holders = tuple[tuple[int, int], int] | dict[tuple[int, int], int] | None
"""Who holds handles to a block (``holds.py``): None, one ``((pid, start), count)`` tuple (the
common case; a tuple of ints is not tracked by the garbage collector, which matters with
100,000 blocks out), or a dict ``(pid, start) -> count``."""


class RootRef(_WeakRoot):
    """Weak reference to a block's root array; its callback frees the block."""

    __slots__ = ("block", "root_id")
    block: Block
    root_id: int


class Block:
    """A byte range of a segment as held by this process.

    Attributes:
        segment: the :class:`~tensormp.memory.segment.Segment` it lies in.
        offset: byte offset of the block in the segment.
        capacity: bytes in the block (>= the bytes requested).
        owned: True when this process's allocator handed it out (and may recycle it).
        owner_pid: the pid of the process whose allocator handed it out (a fork child
            inherits blocks it does not own).
        remote: (owned blocks) handles held or in flight in other processes.
        received: (foreign blocks) handles this process rebuilt into this root.
        announced: (foreign blocks) how many of ``received`` the creator was told about with
            ``H`` records (or knows of otherwise); the rest wait in ``MemoryState.unannounced``.
        pinned: never recycle (it was alive at a fork).
        holders: who holds the ``remote`` handles (see :data:`Holders`).
        ref: the weakref of the current root in this process.
        local_dead: the death of this process's last root has been processed.
        copy: (foreign blocks) a copy made for this process alone: received from a first
            send (the sender kept no view) and not sent on as a handle since; a small view of
            it crosses as a copy (``reducers/numpy.py``).
        acquired: (owned blocks) tokens of counted acquires whose handle has not come back
            here (``holds.py``); None when there are none.
    """

    __slots__ = (
        "segment", "offset", "capacity", "owned", "owner_pid", "remote", "received", "pinned",
        "holders", "ref", "local_dead", "announced", "acquired", "copy",
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
        self.holders: Holders = None
        self.ref: RootRef | None = None
        self.local_dead = False
        self.acquired: set[int] | None = None
        self.copy = False

    def __repr__(self) -> str:
        live = self.ref is not None and self.ref() is not None
        return (
            f"<Block {format_bytes(self.capacity)} at +{self.offset} of {self.segment!r} "
            f"owned={self.owned} live={live} remote={self.remote} pinned={self.pinned}>"
        )
