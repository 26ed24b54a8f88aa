"""Reduce/rebuild pair for ``numpy.ndarray``.

A handle is ``(segment wire, fd index (or file name, for a named segment), block offset, block
capacity, byte offset of the first element in the block, dtype, shape, strides (None:
C-contiguous), read-only, acquire token, re-sent)``, where the *wire* is one bytes object per segment
(id, size, creator pid, kind, creator's release address: ``Segment.wire``): about 150 bytes of
pickle whatever the array's size. The bytes themselves never enter the pickle.

* An array whose memory is a tensormp block (allocated by tensormp, ``share()``d, or received)
  crosses as a handle to that block: both sides see each other's writes; views keep their
  offset, shape and strides.
  Such a handle is marked *re-sent* (the same block may come again: the receiver keeps the
  root of a small one a while, see ``memory/holds.py``).
* Any other array is copied once into a fresh block (keeping C or Fortran order; an array with
  zero or overlapping strides, such as ``np.broadcast_to`` or ``sliding_window_view`` of one,
  is copied element by element in C order) and that block crosses; the receiver gets a shared,
  writable array (even if the sender's was read-only: the copy is the receiver's own, as the
  stdlib's unpickled copy is), the sender's array is untouched.
* ... except one of at most ``COPY_INLINE_MAX`` bytes (16 KiB): its bytes ride in the record
  itself and the receiver copies them into a block of *its own* shared memory
  (``rebuild_ndarray_copy``), so it arrives exactly as above (shared, writable, same layout).
  No block, fd, hold or release message exists for it on the sender's side, and nothing of it
  is pinned by a message that is never received; copying 4 KiB twice more costs well under a
  microsecond, the handle's round of bookkeeping about 20 us of CPU (measured: a fresh 4 KiB
  array through a Queue, 44 -> 20 us of CPU for both sides). A receiver that cannot get shared
  memory for it (a full ``/dev/shm`` under ``file_system``, no fd left for a new arena) keeps a
  private copy and warns once: the item is delivered, never lost. At most ``BY_VALUE_MAX``
  bytes of a message and half of its channel's send buffer go so (``Message.take_by_value``);
  the rest cross as handles.
* ... except a small view of a copy made for this process alone (a block it received from a
  first send, which its sender does not view, and has not sent on as a handle): a view of at
  most a quarter of the block's bytes crosses as a copy, as above. Without this a worker that
  returns a crop of its input sends a handle to the whole input, and the receiver keeps it all
  (40 crops of 800 B from 32 MiB images kept 1.28 GB; the stdlib keeps 32 KB) and gets a
  non-contiguous view where the stdlib gives a C-contiguous array. The memory was not shared
  with anyone, so nothing else changes: no other process sees writes to it either way. Sending
  a larger view (or the whole array) crosses as a handle and makes the block shared from then on.
* A read-only view of shared memory arrives read-only (the receiver's view of the same bytes
  keeps the sender's flag).
* Arrays whose dtype holds Python objects, and numpy subclasses (``np.memmap``,
  ``np.recarray``, ``np.ma.MaskedArray``, ``np.matrix``...), are pickled the ordinary way
  (by value, keeping their type): the dispatch is on the exact type ``numpy.ndarray``.

Every handle carries its segment's fd, also when the array was shared before (a re-send, a
ping-pong), and a receiver that maps the segment already closes it: about 2 us a side here.
Sending it only to receivers that lack the segment is not sound: a queue has many readers and
the sender cannot know which one takes the message, nor whether it still maps the segment when
it does; the re-open that would replace the fd (``/proc/<pid>/fd/<n>``) fails once the sender
and the creator are dead, which the fd in flight survives (the consumer of a producer that was
SIGKILLed after its ``put`` still gets the array).

This is the per-array hot path of every transfer (a 4 KiB array costs a few microseconds
here): it takes the allocator's lock once per array, builds no dict, and skips strides and
offset for the common C-contiguous array.
"""

from __future__ import annotations

import ctypes
import pickle
import sys
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import FdLimitError, SharedMemoryError
from ..memory.allocator import (
    allocate,
    allocate_sent,
    attach,
    find_block,
    forget_handle,
    forget_received,
    note_handle,
)
from ..memory.segment import unpack_wire
from . import (
    NDARRAY_COPY_EXT,
    NDARRAY_EXT,
    current_message,
    current_process_args_parent,
    mark_loaded,
    register,
    register_extension,
    take_fd,
)

__all__ = ["reduce_ndarray", "rebuild_ndarray", "copy_to_shared", "handles", "share", "is_shared"]


def _copy_to_view(a: np.ndarray, view: memoryview, start: int) -> tuple[int, ...] | None:
    """Copy ``a`` to ``view[start:]`` (a segment's bytes); returns the strides of the copy,
    None for C order. A C- or F-contiguous array is copied as raw bytes (padding included),
    a strided one in C order."""
    try:
        if a.flags.c_contiguous:
            src = a.data.cast("B")
            strides = None
        elif a.flags.f_contiguous:
            src = a.T.data.cast("B")
            strides = a.strides
        else:
            src = None
    except (TypeError, ValueError, NotImplementedError):  # no buffer format (datetime64...)
        src = None
    if src is not None:
        view[start : start + len(src)] = src
        return strides
    root = np.frombuffer(view[start : start + a.nbytes], np.uint8)
    if root.size and a.dtype.fields is not None:
        root[:] = 0  # copyto copies fields only: clear the padding of a recycled block
    # (no buffer format, e.g. datetime64: an F-contiguous array keeps its order all the same)
    strides = a.strides if a.flags.f_contiguous and not a.flags.c_contiguous else None
    np.copyto(np.ndarray(a.shape, a.dtype, root, 0, strides), a, casting="no")
    return strides


def copy_to_shared(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One copy of ``a`` in a fresh block: returns ``(copy, root)``; keeps C/F order."""
    root = allocate(a.nbytes)
    strides = _copy_to_view(a, root.data, 0)  # the root's bytes (1-D uint8: format B)
    return np.ndarray(a.shape, a.dtype, root, 0, strides), root


def _interface_address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _struct_address(
    a: np.ndarray, _at: int = object.__basicsize__, _read: Any = ctypes.c_void_p.from_address
) -> int:
    return _read(id(a) + _at).value or 0


def _pick_address() -> Callable[[np.ndarray], int]:
    """The address of an array's first element, the fast way when it is right here.

    ``a.__array_interface__`` builds a dict per call (about 3 us here, once per array sent);
    numpy's array struct (``PyArrayObject_fields``, part of its ABI: the ``PyArray_DATA``
    function of compiled extensions reads it) holds the pointer right after the object header,
    which CPython's ``id()`` locates: 0.3 us. Checked against ``__array_interface__`` on a few
    arrays at import; on any other interpreter or layout, ``__array_interface__`` it is.
    """
    if sys.implementation.name != "cpython":
        return _interface_address
    base = np.arange(64, dtype=np.uint8)
    probes = [base, base[3:], base[::-2], base.reshape(8, 8).T[2:], np.empty(0)]
    if all(_struct_address(p) == _interface_address(p) for p in probes):
        return _struct_address
    return _interface_address  # pragma: no cover - another layout


_data_address = _pick_address()

# Arrays of at most this many bytes that are not shared yet cross by value (see the notes).
COPY_INLINE_MAX = 16 << 10
# A view of a copy made for this process alone crosses as a copy when the block is at least
# this many times its bytes (see the notes).
COMPACT_FRACTION = 4


def _dtype_token(dt: np.dtype) -> np.dtype | str:
    # A plain dtype travels as its short string ('<f4'): much cheaper to pickle than the object.
    return dt.str if dt.fields is None and dt.subdtype is None and dt.metadata is None else dt


# id(dtype) -> (dtype, its short string), for plain dtypes (the dtype is kept so its id stays
# its own). Equal dtypes can differ in metadata, so the key is identity, not equality.
_tokens: dict[int, tuple[np.dtype, str]] = {}


def _token(dt: np.dtype) -> np.dtype | str:
    cached = _tokens.get(id(dt))
    if cached is not None:
        return cached[1]
    token = _dtype_token(dt)
    if type(token) is str and len(_tokens) < 1024:
        _tokens[id(dt)] = (dt, token)
    return token


def reduce_ndarray(a: np.ndarray) -> str | tuple[Any, ...]:
    msg = current_message()
    if msg is None or a.dtype.hasobject:
        return a.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    found = find_block(a)
    if found is not None and found[0].copy:
        if a.nbytes * COMPACT_FRACTION <= found[0].capacity:
            found = None  # a small part of a copy made for us: a copy (see the notes)
        else:
            found[0].copy = False  # sent on as a handle: shared from now on
    if found is None and a.nbytes <= COPY_INLINE_MAX and msg.take_by_value(a.nbytes):
        # Small and not shared yet: its bytes ride in the record and the receiver copies them
        # into a block of its own (see the module notes).
        if a.flags.f_contiguous and not a.flags.c_contiguous:
            return rebuild_ndarray_copy, (a.tobytes("F"), _token(a.dtype), a.shape, a.strides)
        return rebuild_ndarray_copy, (a.tobytes(), _token(a.dtype), a.shape, None)
    if found is None:
        # Not shared yet: one copy into a fresh block that only the receiver will view (this
        # process keeps none: see allocate_sent); its handle is counted as it is made. The
        # copy is the receiver's own memory, so it arrives writable whatever ``a`` was
        # (read-only, broadcast, overlapping windows), as the stdlib's unpickled copy does.
        readonly = False
        block = allocate_sent(a.nbytes)
        msg.on_abandon(forget_handle, block)
        seg = block.segment
        strides = _copy_to_view(a, seg.view, block.offset)  # type: ignore[arg-type]
        offset = 0
        owner_addr = seg.owner_addr
        token = 0
        msg.noted.append(block)
    else:
        # Shared memory: the receiver sees the very bytes the sender's view sees, with its
        # flag (a read-only view stays read-only: a broadcast view's writes would alias).
        readonly = not a.flags.writeable
        block, root = found
        seg = block.segment
        owner_addr, token = note_handle(block)
        msg.on_abandon(forget_handle, block)
        if owner_addr and not token:
            msg.noted.append(block)
        offset = _data_address(a) - seg.address - block.offset
        strides = None if a.flags.c_contiguous else a.strides
        msg.keepalive.append(root)
    return rebuild_ndarray, (
        seg.wire(owner_addr),
        # A strategy that keeps the fd is referenced by the fd itself (Strategy.keeps_fd):
        # attached here without a call to its reference() (the per-array hot path).
        msg.add_fd(seg.fd, seg.id, seg) if seg.fd >= 0 else seg.strategy.reference(msg, seg),
        block.offset,
        block.capacity,
        offset,
        _token(a.dtype),
        a.shape,
        strides,
        readonly,
        token,
        found is not None,
    )


def rebuild_ndarray(
    wire: bytes,
    fd_ref: int | str,
    block_offset: int,
    capacity: int,
    offset: int,
    dtype: np.dtype | str,
    shape: tuple[int, ...],
    strides: tuple[int, ...] | None,
    readonly: bool,
    token: int = 0,
    keep: bool = False,
) -> np.ndarray:
    announce = True
    if not token:  # (a forwarded handle carries a token; a Process argument never does)
        # A Process argument from our parent's own memory: the parent registered us as holder.
        parent = current_process_args_parent()
        announce = not parent or unpack_wire(wire)[2] != parent
    try:
        root = attach(wire, take_fd, fd_ref, block_offset, capacity, token, announce, keep)
    except Exception:
        # This handle will never be held here: give the creator its count back, or the block
        # would stay pinned there until it exits.
        seg_id, _size, creator_pid, _kind, _code, owner_addr = unpack_wire(wire)
        forget_received(owner_addr, seg_id, block_offset, creator_pid)
        raise
    a: np.ndarray = np.ndarray(shape, dtype, root, offset, strides)
    if readonly:
        a.flags.writeable = False
    return a


def rebuild_ndarray_copy(
    data: bytes, dtype: np.dtype | str, shape: tuple[int, ...], strides: tuple[int, ...] | None
) -> np.ndarray:
    """A small array that crossed by value (``reduce_ndarray``): copied into a block of this
    process's shared memory, so that it arrives shared, as a large one does. Where that block
    cannot be had (no shared memory left, or no fd for a new arena), a private copy: the item
    is never lost on the receiving side; warns once.
    """
    n = len(data)
    try:
        root = allocate(n)
    except (SharedMemoryError, FdLimitError) as e:
        _warn_private(e)
        private: np.ndarray = np.ndarray(shape, dtype, bytearray(data), 0, strides)
        return private
    root.data[:n] = data  # (a memoryview's copy: a fifth of np.copyto's call here)
    a: np.ndarray = np.ndarray(shape, dtype, root, 0, strides)
    return a


_warned_private = False


def _warn_private(e: OSError) -> None:
    global _warned_private
    if not _warned_private:
        _warned_private = True
        warnings.warn(
            f"tensormp: a small array received by value could not be placed in shared memory "
            f"({e}); it and others like it arrive as private arrays (tensormp.is_shared() is "
            "False), which is all that differs",
            RuntimeWarning,
            stacklevel=2,
        )


# -- helpers of tensormp.share / is_shared (the reducer table's ``helpers`` for numpy) ---------
def handles(obj: object) -> bool:
    """True for numpy arrays (subclasses included)."""
    return isinstance(obj, np.ndarray)


def is_shared(a: np.ndarray) -> bool:
    """Whether ``a``'s memory is tensormp shared memory (see ``tensormp.is_shared``)."""
    return find_block(a) is not None


def share(a: np.ndarray) -> np.ndarray:
    """``a`` itself if shared, else a shared copy (see ``tensormp.share``).

    Raises:
        TypeError: ``a``'s dtype holds Python objects.
        SharedMemoryError: the memory could not be reserved (an ``OSError``).
    """
    if a.dtype.hasobject:
        raise TypeError(
            f"cannot share an array of dtype {a.dtype}: it holds Python object pointers, which "
            "mean nothing in another process; it is pickled by value when sent instead"
        )
    if find_block(a) is not None:
        return a
    out, _root = copy_to_shared(a)
    if not a.flags.writeable:
        out.flags.writeable = False
    return out


register(np.ndarray, reduce_ndarray)
register_extension(rebuild_ndarray, NDARRAY_EXT)
register_extension(rebuild_ndarray_copy, NDARRAY_COPY_EXT)
mark_loaded(__name__)
