"""Reduce/rebuild pair for ``numpy.ndarray``.

A handle is ``(segment id, fd index (or file name, for a named segment), segment size, creator pid, segment kind, creator's release
address, block offset, block capacity, byte offset of the first element in the block, dtype,
shape, strides, read-only)``: about 200 bytes whatever the array's size. The bytes themselves never enter
the pickle.

* An array whose memory is a tensormp block (allocated by tensormp, ``share()``d, or received)
  crosses as a handle to that block: both sides see each other's writes; views keep their
  offset, shape and strides.
* Any other array is copied once into a fresh block (keeping C or Fortran order) and that block
  crosses; the receiver gets a shared array, the sender's array is untouched.
* Arrays whose dtype holds Python objects, and numpy subclasses (``np.memmap``,
  ``np.recarray``, ``np.ma.MaskedArray``, ``np.matrix``...), are pickled the ordinary way
  (by value, keeping their type): the dispatch is on the exact type ``numpy.ndarray``.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from .. import memory
from ..memory.allocator import find_block, forget_handle, forget_received, note_handle
from . import current_message, current_process_args_parent, note_named, register, take_fd

__all__ = ["reduce_ndarray", "rebuild_ndarray", "copy_to_shared"]


def copy_to_shared(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One copy of ``a`` in a fresh block: returns ``(copy, root)``; keeps C/F order."""
    order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    root = memory.allocate(a.nbytes)
    out = np.ndarray(a.shape, a.dtype, buffer=root, order=order)
    if a.dtype.fields is not None:
        # Structured: copy the bytes, padding included (copyto copies fields only, which
        # would leave a recycled block's old bytes in the padding).
        if a.flags.c_contiguous or a.flags.f_contiguous:
            root[: a.nbytes] = np.frombuffer(a.data.cast("B") if a.flags.c_contiguous else
                                             a.T.data.cast("B"), np.uint8)
            return out, root
        root[: a.nbytes] = 0
    np.copyto(out, a, casting="no")
    return out, root


def _dtype_token(dt: np.dtype) -> Any:
    # A plain dtype travels as its short string ('<f4'): much cheaper to pickle than the object.
    return dt.str if dt.fields is None and dt.subdtype is None and dt.metadata is None else dt


def reduce_ndarray(a: np.ndarray) -> Any:
    msg = current_message()
    if msg is None or a.dtype.hasobject:
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    readonly = not a.flags.writeable
    found = find_block(a)
    if found is None:
        a, root = copy_to_shared(a)
        found = find_block(root)
        assert found is not None
    block, root = found
    seg = block.segment
    owner_addr, token = note_handle(block)
    msg.on_abandon(lambda: forget_handle(block))
    if owner_addr and not token:
        msg.noted.append(block)
    index = msg.add_fd(seg.fd, seg.id, seg)
    msg.keepalive.append(root)
    return rebuild_ndarray, (
        seg.id,
        index,
        seg.size,
        seg.creator_pid,
        seg.kind,
        owner_addr,
        block.offset,
        block.capacity,
        a.__array_interface__["data"][0] - seg.address - block.offset,
        _dtype_token(a.dtype),
        a.shape,
        a.strides,
        readonly,
        token,
    )


def rebuild_ndarray(
    seg_id: bytes,
    fd_index: int | str,
    seg_size: int,
    creator_pid: int,
    kind: str,
    owner_addr: bytes,
    block_offset: int,
    capacity: int,
    offset: int,
    dtype: Any,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    readonly: bool,
    token: int = 0,
) -> np.ndarray:
    note_named(fd_index)
    # A Process argument from our parent's own memory: the parent registered us as holder.
    announce = token != 0 or creator_pid != current_process_args_parent()
    try:
        root = memory.attach(
            seg_id,
            lambda: take_fd(fd_index),
            seg_size,
            creator_pid,
            kind,
            owner_addr,
            block_offset,
            capacity,
            token,
            announce,
        )
    except Exception:
        # This handle will never be held here: give the creator its count back, or the block
        # would stay pinned there until it exits.
        forget_received(owner_addr, seg_id, block_offset, creator_pid)
        raise
    a = np.ndarray(shape, dtype, buffer=root, offset=offset, strides=strides)
    if readonly:
        a.flags.writeable = False
    return a


register(np.ndarray, reduce_ndarray)
