"""torch's own channels carrying tensormp memory: a reducer of tensormp-backed storages for the
stdlib's ``ForkingPickler`` (plain ``multiprocessing`` and ``torch.multiprocessing`` queues and
pipes, ``Process`` arguments under their contexts, a ``DataLoader``'s workers).

Protocol
--------
What crosses. ``import torch`` registers torch's reducers on the global ``ForkingPickler``; a
tensor reaches the reducer of its ``UntypedStorage``. Loading ``reducers/torch.py`` replaces
that one entry with :func:`reduce_storage_stdlib`, which passes every storage that is *not*
tensormp memory to the reducer it replaced (torch's, unchanged), and sends a tensormp storage
as a handle to its block: the segment's wire (id, size, creator, strategy, the creator's
release address), the block's offset and capacity, the storage's offset and length in it, an
acquire token, and the segment's reference. A memfd rides on the stdlib's own fd passing
(``multiprocessing.reduction.DupFd``): a child being started inherits it (one fd per segment
per child: :class:`_SegmentFd`), any other receiver fetches a dup that the sender's
``resource_sharer`` keeps until then, as torch's ``file_descriptor`` strategy does. A named
segment (``file_system``) crosses the same way: its fd is one of the segment's tokens
(``strategies/file_system.py``), never a bare name.

Who owns the block, who frees it: as for tensormp's own handles (``memory/release.py``,
``memory/holds.py``). Pickling counts the handle with the block's creator (``note_handle``: its
own count, or a blocking acquire from a process forwarding a block it received). The receiver
maps the segment, rebuilds the storage (the very storage it already holds for that range, if
any), and announces its hold at once (one datagram). Its release goes to the creator when the
storage dies, or when the receiver exits: a stdlib child ends with ``os._exit`` after running
``multiprocessing.util``'s finalizers, not ``atexit``, so its first receive registers the exit
release there. The creator recycles the block only when its own view is dead and every counted
handle has been released.

SIGKILL. Of a receiver whose hold was announced: the creator's liveness sweep drops it within
about a second. Between pickling and that announce (a message never read, a pickling that
failed after this storage, a receiver killed while unpickling): the block stays pinned in its
creator until the creator exits; held longer, never reused too early. Of the sender: a child
being started has inherited its fds already; a ``resource_sharer`` dup dies with the sender, so
a receiver that unpickles after the sender died gets ``HandleError`` (torch: a refused
connection), and its count goes back to the creator; a named segment follows the
``file_system`` rules. Of the creator: receivers keep valid memory.

What is refused: nothing that goes through ``ForkingPickler``. Only a direct call of torch's
``UntypedStorage._share_fd_cpu_``/``_share_filename_cpu_`` (``reducers/torch_storage.py``) would move a
tensormp storage into torch's memory; it is refused while another process may hold the block.

Imports: the registry, cache and wrapped methods of ``reducers/torch_storage.py``, never
``reducers/torch.py`` (which loads this module to install the reducer).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
from multiprocessing.reduction import DupFd, ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.multiprocessing import reductions as _torch_reductions

from .. import memory
from ..errors import HandleError
from ..memory.allocator import (
    find_block,
    flush_records,
    forget_received,
    note_handle,
    process_exiting,
)
from ..memory.segment import Segment, unpack_wire
from . import Message
from . import torch_storage as _ts

__all__ = ["reduce_storage_stdlib"]


class _SegmentFd:
    """A segment's fd on the stdlib's fd passing (``DupFd``), taken at most once.

    In a child being started, every storage of one segment refers to the same carrier (one
    per segment and child: the pickle memo makes them one object on the other side too), so
    the inherited fd is adopted by the first rebuild that maps the segment, or closed.
    """

    __slots__ = ("_df",)

    def __init__(self, df: Any) -> None:
        self._df = df

    def __reduce__(self) -> tuple[Any, ...]:
        return _SegmentFd, (self._df,)

    def take(self, _index: int) -> int:
        """The fd, owned by the caller from now on (``TakeFd`` for a strategy's ``attach``)."""
        df, self._df = self._df, None
        if df is None:
            raise HandleError("a tensormp segment's fd was taken twice (corrupt message)")
        try:
            return int(df.detach())
        except (OSError, EOFError) as e:
            raise HandleError(
                "cannot receive a tensor in tensormp shared memory from a plain multiprocessing "
                f"or torch.multiprocessing channel: its sender has exited ({e!r}), and such a "
                "channel fetches the memory's fd from the sender when the tensor is read (as "
                "torch's file_descriptor strategy does). Keep the sender alive until the tensor "
                "is read, or use a tensormp Queue or Pipe (the fd travels inside the message)"
            ) from e

    def discard(self) -> None:
        """Close the fd if no rebuild took it (the segment was mapped here already). It is
        fetched even so: the sender's ``resource_sharer`` keeps its dup until then."""
        df, self._df = self._df, None
        if df is not None:
            try:
                os.close(df.detach())
            except Exception:  # noqa: BLE001 - the sender has gone: nothing is kept there
                pass


def _carrier(seg: Segment, fd: int) -> _SegmentFd:
    popen = multiprocessing.context.get_spawning_popen()
    if popen is None:  # a queue, a pipe: one resource_sharer dup per storage sent
        return _SegmentFd(DupFd(fd))
    carriers: dict[bytes, _SegmentFd] = popen.__dict__.setdefault("_tensormp_fds", {})
    carrier = carriers.get(seg.id)
    if carrier is None:
        carrier = carriers[seg.id] = _SegmentFd(DupFd(fd))
    return carrier


def _reference(seg: Segment) -> _SegmentFd:
    msg = Message()  # the strategy attaches its fd (memfd or token), as in a tensormp message
    ref = seg.strategy.reference(msg, seg)
    if type(ref) is not int:  # pragma: no cover - every strategy attaches an fd
        raise HandleError(f"{seg.strategy!r} referred to a segment by {ref!r}, not by an fd")
    return _carrier(seg, msg.fds[ref])


def reduce_storage_stdlib(storage: Any) -> Any:
    """``ForkingPickler``'s reducer of ``torch.UntypedStorage`` (see the module notes)."""
    view = None
    owned = _ts._owned
    # Every other storage costs one dict look-up here (no lock: a miss is final, a hit is
    # checked again under the lock).
    if owned and storage.data_ptr() in owned:
        with _ts._lock:
            entry = _ts._entry(storage)
            if entry is not None:
                view = entry.ref()
                if view is not None and not entry.exported:
                    entry.exported = True
                    _ts._cache_put(_ts._view_key(view), storage)  # it may come back: as itself
    if view is None:
        view = _ts.foreign_view(storage)  # a from_numpy() of a tensormp array
    if view is None:
        return _previous(storage)
    found = find_block(view)
    if found is None:  # pragma: no cover - a registered view is a view of a block's root
        return _previous(storage)
    block, _root = found
    seg = block.segment
    owner_addr, token = note_handle(block)
    return _rebuild_storage_stdlib, (
        seg.wire(owner_addr),
        _reference(seg),
        block.offset,
        block.capacity,
        _ts._address(view) - seg.address - block.offset,
        view.nbytes,
        token,
    )


reduce_storage_stdlib._tensormp = True  # type: ignore[attr-defined]


def _rebuild_storage_stdlib(
    wire: bytes, carrier: _SegmentFd, block_offset: int, capacity: int, offset: int,
    nbytes: int, token: int,
) -> Any:
    try:
        root = memory.attach(wire, carrier.take, 0, block_offset, capacity, token, True)
    except Exception:
        # Never held here: give the creator its count back (as reducers/numpy.py).
        seg_id, _size, creator_pid, _kind, _code, owner_addr = unpack_wire(wire)
        forget_received(owner_addr, seg_id, block_offset, creator_pid)
        raise
    finally:
        carrier.discard()
    _release_at_exit()
    flush_records()  # announce the hold now: a receiver killed later cannot pin the block
    view: np.ndarray = root[offset : offset + nbytes]
    return _ts._rebuild_storage(view)


_exit_hook_pid = 0


def _release_at_exit() -> None:
    """In a child the stdlib (or torch) started: release what it received when it ends.

    Such a child ends with ``os._exit`` after ``multiprocessing.util``'s finalizers, so the
    ``atexit`` release never runs there. A tensormp child releases at the end of its own
    ``_bootstrap``, and the main process at ``atexit``."""
    global _exit_hook_pid
    pid = os.getpid()
    if _exit_hook_pid == pid:
        return
    _exit_hook_pid = pid
    if multiprocessing.parent_process() is not None and not _ts._started_by_tensormp():
        multiprocessing.util.Finalize(None, process_exiting, exitpriority=-100)


# -- registration ---------------------------------------------------------------------------------
_extra: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
_previous = _extra.get(torch.UntypedStorage, _torch_reductions.reduce_storage)
if getattr(_previous, "_tensormp", False):  # pragma: no cover - this module was re-imported
    _previous = _torch_reductions.reduce_storage
ForkingPickler.register(torch.UntypedStorage, reduce_storage_stdlib)
