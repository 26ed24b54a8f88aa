"""Reduce/rebuild pairs for torch tensors and storages: CPU through tensormp memory, CUDA
through CUDA IPC.

Design note
===========

Where a shared CPU storage lives
--------------------------------
A CPU tensor crosses a tensormp channel as its *storage* plus the view's metadata (dtype,
storage offset, sizes, strides, ``requires_grad``, ``Parameter``, ``.grad``, conjugate and
negative bits). A storage in tensormp memory is an ordinary ``torch.UntypedStorage`` whose
memory is a tensormp block (``memory/allocator.py``): the same memfd segments, caching
sub-allocator, release protocol and fd-inside-the-message transport as numpy arrays. Its data
pointer comes from ``torch.frombuffer`` over a ``uint8`` ndarray *view* of exactly the storage's
bytes inside the block's root. The storage's deleter holds the view, the view holds the root, so
in each process the block lives exactly as long as the storage does. The storage is exactly
``nbytes`` long (not the block's capacity, not the 4 MiB arena), so ``torch.save`` writes the
tensor's own bytes, and it is not resizable: ``resize_`` past its size raises torch's
``RuntimeError: Trying to resize storage that is not resizable`` (torch 2.13's own shared
storages keep ``resizable() == True`` and segfault there).

Sending: the reducer of ``UntypedStorage`` (a tensor reaches it through its storage)
----------------------------------------------------------------------------------
1. A storage already in tensormp memory (sent or received before, :func:`tensormp.share`,
   ``_new_shared`` in a tensormp child) is found in a registry keyed by data pointer, whose
   entries are weak (they die with the view, so with the storage). Nothing is copied.
2. A storage torch itself put in shared memory (``share_memory_()`` through torch, or received
   through torch) crosses by its own fd (``_share_fd_cpu_`` returns it without moving), as
   torch does, but inside the tensormp message (``SCM_RIGHTS``), so the producer may exit
   before the consumer reads. Moving it would silently cut it off from the processes that
   already map it. Under torch's ``file_system`` strategy, torch's own reducer is used.
3. Any other storage is *moved in place*, as torch's ``share_memory_()`` does: a block of
   ``nbytes`` is allocated, the bytes are copied once, and ``UntypedStorage._swap_data_ptr_``
   swaps the two storages' data pointers together with their size, ``resizable`` flag and
   allocator (c10 ``StorageImpl::swap_data_ptr``). The sender's storage object, and so every
   tensor and view on it, now uses the block; the old private memory leaves with the temporary
   storage. This is torch's own ``set_data_ptr_noswap`` move, done from Python. In a message
   marked :func:`~tensormp.reducers.copy_private`, such a storage crosses as a copy instead,
   as a numpy array does: the sender's storage is left where it was.
The handle is the numpy handle of the ``uint8`` view (``reducers/numpy.py``): the segment's fd
rides in the message, the block's creator counts the handle and the receiver releases it,
exactly as for arrays. A storage of 0 bytes crosses as a new empty storage (as in torch).

Receiving
---------
The numpy rebuild maps the segment (once per segment: no fd per tensor, so a receiver that keeps
5,000 small tensors holds a handful of fds) and returns the view. The storage is looked up in a
per-process cache of weak storage references keyed by (segment id, block offset, byte offset,
nbytes): the same storage sent twice, or sent back to its sender, arrives as the same storage.
Otherwise a new storage wraps the view. The tensor is ``set_`` on it; then the conjugate and
negative bits (torch drops them), ``Parameter``, ``requires_grad`` and ``.grad`` (itself a
tensor that crossed the same way, so it is shared too; torch drops it) are restored.

Who owns the memory, who frees it
---------------------------------
The block's creator owns it, as for arrays: it recycles the block once its own storage is gone
and every receiver has released its handle. A receiver's storage keeps its view, hence the
root, alive; when the storage dies (with its last tensor) the root dies and the receiver's
release goes to the creator. This module owns nothing beyond those storages; its registry
and cache hold only weak references.

What each side sees if the other is SIGKILLed
---------------------------------------------
As for arrays: nothing to clean up (no names, no files). A receiver keeps valid memory if the
sender dies, even before ``get()`` (the kernel holds the fds in flight); a sender whose
receiver died reclaims the block after its liveness sweep. Storages torch shared (case 2) keep
torch's lifetime rules: the kernel frees them when the last fd and mapping are gone.

CUDA
----
CUDA tensors use torch's CUDA IPC (``storage._share_cuda_()`` through
``torch.multiprocessing.reductions``): the handle names the producer's ``cudaMalloc`` block and
torch's reference counter keeps that block alive in the producer until every consumer's storage
is gone. The memory lives in the producer's CUDA context, so it cannot outlive the producer:
the handle also carries the producer's (pid, start time), and a consumer that rebuilds it after
the producer exited gets :class:`~tensormp.HandleError` (naming the producer and the fix), not a
CUDA error or a crash. ``.grad`` and the conjugate/negative bits travel as for CPU tensors.

What this module changes in torch
---------------------------------
Five wrapped methods of ``torch.UntypedStorage`` (``reducers/torch_storage.py``, with the
registry and the receivers' cache this module and ``reducers/torch_stdlib.py`` share).

Registration: ``reducers/__init__.py`` imports this module when it pickles and ``torch`` is in
``sys.modules`` (never importing torch itself); a rebuild function imports it in a receiver.
Inside tensormp's channels these reducers win over torch's, whichever was imported first. On
the global stdlib ``ForkingPickler`` (plain ``multiprocessing``/``torch.multiprocessing``
channels, ``DataLoader`` workers under torch's contexts) torch's reducers stay, except for the
one of ``UntypedStorage``, which ``reducers/torch_stdlib.py`` wraps: a storage in tensormp
memory crosses there as a handle to its block, shared with every holder (its protocol note);
any other storage goes to torch's reducer unchanged.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, cast

import numpy as np
import torch
from torch.multiprocessing import reductions as _torch_reductions

from ..errors import HandleError
from ..memory.release import process_start_time
from . import current_message, mark_loaded, register, take_fd
from . import numpy as _numpy_reducers  # noqa: F401 - the storage handle is an ndarray handle
from . import torch_storage as _ts
from .torch_storage import (
    _CAN_SWAP,
    _cache_put,
    _cached,
    _entry,
    _move,
    _orig_is_shared,
    _orig_share_fd,
    _rebuild_storage,
    _view_key,
    in_tensormp_memory,
    is_shared_storage,
    new_storage,
    share_storage,
)

__all__ = [
    "reduce_tensor",
    "reduce_storage",
    "share_storage",
    "new_storage",
    "in_tensormp_memory",
    "is_shared_storage",
]

_Parameter = torch.nn.parameter.Parameter

# -- storages -------------------------------------------------------------------------------------
def reduce_storage(storage: Any) -> Any:
    """Reducer of ``torch.UntypedStorage`` in tensormp channels (see the module notes)."""
    msg = current_message()
    if msg is None or storage.device.type != "cpu":
        # CUDA and meta storages: torch's reducer, which refuses them with its own message.
        return _torch_reductions.reduce_storage(storage)
    if storage.nbytes() == 0:
        return _rebuild_empty_storage, ()
    with _ts._lock:
        entry = _entry(storage)
        if entry is None:
            view = _ts.foreign_view(storage)  # a from_numpy() of a tensormp array
            if view is not None:
                return _rebuild_storage, (view,)
            if msg.copy_private and not _orig_is_shared(storage):
                # A copy for the receiver, as a numpy array's (reducers.copy_private): the
                # numpy reducer copies these bytes into a block only the receiver views.
                return _rebuild_storage, (_bytes_of(storage),)
            if _orig_is_shared(storage) or not _CAN_SWAP:
                return _reduce_torch_shared(storage, msg)
            _move(storage)
            entry = _entry(storage)
            assert entry is not None
        view = entry.ref()  # alive: the storage's deleter holds it
        if not entry.exported:  # once per storage (the cast stays off the repeat sends)
            entry.exported = True
            # It may come back: as the same storage.
            _cache_put(_view_key(cast(np.ndarray, view)), storage)
    return _rebuild_storage, (view,)


def _bytes_of(storage: Any) -> np.ndarray:
    """A ``uint8`` array over a CPU storage's own memory (it keeps the storage alive)."""
    return cast(np.ndarray, torch.empty(0, dtype=torch.uint8).set_(storage).numpy())


def _rebuild_empty_storage() -> Any:
    return torch.UntypedStorage(0)


class _FdOwner:
    """Keeps a torch-shared storage (and so its fd) alive until the message is sent."""

    __slots__ = ("storage",)

    def __init__(self, storage: Any) -> None:
        self.storage = storage


def _reduce_torch_shared(storage: Any, msg: Any) -> Any:
    """A storage torch put in shared memory: its own fd rides in the message."""
    if torch.multiprocessing.get_sharing_strategy() == "file_system":
        return _torch_reductions.reduce_storage(storage)
    # Already shared: returns torch's fd and moves nothing (a private storage on torch < 2.13
    # is moved into torch's shared memory here first, in place).
    fd, size = _orig_share_fd(storage)
    st = os.fstat(fd)
    key = ("torch-shm", st.st_dev, st.st_ino)
    if _cached(key) is None:
        _cache_put(key, storage)  # it may come back: as the same storage
    index = msg.add_fd(fd, key, _FdOwner(storage))
    return _rebuild_torch_shared, (index, size, st.st_dev, st.st_ino)


def _rebuild_torch_shared(index: int, size: int, dev: int, ino: int) -> Any:
    fd = take_fd(index)
    try:
        key = ("torch-shm", dev, ino)
        with _ts._lock:
            storage = _cached(key)
            if storage is None:
                storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # dups the fd
                _cache_put(key, storage)
        return storage
    finally:
        os.close(fd)


def _reduce_legacy_storage(storage: Any) -> Any:
    """Reducer of the legacy typed storages (``torch.FloatStorage``...); the bytes cross
    through :func:`reduce_storage`."""
    return _rebuild_legacy_storage, (storage._untyped_storage, type(storage), storage.dtype)


def _rebuild_legacy_storage(untyped: Any, cls: type, dtype: torch.dtype) -> Any:
    try:
        return cls(wrap_storage=untyped, _internal=True)
    except RuntimeError:
        # The quantized legacy classes (torch.QUInt8Storage...) cannot wrap a storage
        # (torch.multiprocessing fails here): a TypedStorage of the same dtype can.
        return torch.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


# -- tensors ------------------------------------------------------------------------------------
def _describe(t: Any) -> str:
    return f"{type(t).__name__} of shape {tuple(t.shape)}, {t.dtype}, on {t.device}"


def reduce_tensor(t: Any) -> Any:
    """Reducer of ``torch.Tensor`` and ``torch.nn.Parameter`` in tensormp channels.

    Raises:
        RuntimeError: ``t`` is not a leaf and requires grad (autograd graphs do not cross
            processes), as in ``torch.multiprocessing``.
        SharedMemoryError: a private storage could not be moved into shared memory.
    """
    if t.requires_grad and not t.is_leaf:
        raise RuntimeError(
            f"cannot send a non-leaf tensor with requires_grad=True ({_describe(t)}, grad_fn="
            f"{type(t.grad_fn).__name__}): autograd graphs do not cross processes (torch."
            "multiprocessing refuses it too). Send t.detach() for the data, or a leaf tensor "
            "or Parameter."
        )
    if t.is_cuda:
        return _reduce_cuda_tensor(t)
    if (
        t.device.type != "cpu"
        or t.layout is not torch.strided
        or t.is_nested
        or current_message() is None
    ):
        # Sparse, nested, meta and other devices: torch's reducer. Their dense parts are
        # storages, which come back through reduce_storage (tensormp memory).
        return _torch_reductions.reduce_tensor(t)
    torch.utils.hooks.warn_if_has_hooks(t)  # hooks do not travel (as in torch)
    if t.is_quantized:
        # torch.multiprocessing loses the quantizer; plain pickling keeps it, and its storage
        # still crosses through reduce_storage.
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return _rebuild_tensor, (
        type(t) is _Parameter,
        t.untyped_storage(),
        t.dtype,
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.requires_grad,
        t.grad,
        t.is_conj(),
        t.is_neg(),
    )


def _rebuild_tensor(
    is_parameter: bool,
    storage: Any,
    dtype: torch.dtype,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
    requires_grad: bool,
    grad: Any,
    conj: bool,
    neg: bool,
) -> Any:
    t = torch.empty((0,), dtype=dtype).set_(storage, offset, size, stride)
    return _finish(t, is_parameter, requires_grad, grad, conj, neg)


def _finish(t: Any, is_parameter: bool, requires_grad: bool, grad: Any, conj: bool,
            neg: bool) -> Any:
    if neg:
        torch._C._set_neg(t, True)
    if conj:
        torch._C._set_conj(t, True)
    if is_parameter and type(t) is not _Parameter:
        # requires_grad goes to the constructor: integer Parameters must get False there.
        t = _Parameter(t, requires_grad=requires_grad)
    elif t.requires_grad != requires_grad:
        t.requires_grad_(requires_grad)
    if grad is not None:
        t.grad = grad
    return t


# -- CUDA -----------------------------------------------------------------------------------------
def _reduce_cuda_tensor(t: Any) -> Any:
    # torch's CUDA IPC: the producer's reference counter keeps the block alive until every
    # consumer's storage is gone. We add who the producer is, .grad and the conj/neg bits.
    func, args = _torch_reductions.reduce_tensor(t)
    pid = os.getpid()
    return _rebuild_cuda_tensor, (
        pid, process_start_time(pid) or 0, func, args, t.grad, t.is_conj(), t.is_neg(),
    )


def _rebuild_cuda_tensor(
    pid: int, start: int, func: Any, args: tuple[Any, ...], grad: Any, conj: bool, neg: bool
) -> Any:
    def gone() -> bool:
        return pid != os.getpid() and process_start_time(pid) != start

    what = f"a CUDA tensor shared by process {pid}"
    fix = (
        "CUDA IPC memory lives in the producer's CUDA context, so the producer must stay alive "
        "until every consumer has received the tensor and dropped it (as in torch."
        "multiprocessing): keep it running (e.g. wait on an Event the consumer sets), or send "
        "a CPU copy (t.cpu()) instead"
    )
    if gone():
        raise HandleError(f"cannot open {what}: that process has exited. {fix}")
    if not torch.cuda.is_available():
        raise HandleError(
            f"cannot open {what}: CUDA is not available in this process (pid {os.getpid()}); "
            "send t.cpu() to a process without a GPU"
        )
    try:
        t = func(*args)
    except RuntimeError as e:
        state = "has exited" if gone() else "is alive"
        raise HandleError(f"cannot open {what} (the producer {state}): {e}. {fix}") from e
    is_parameter = type(t) is _Parameter
    return _finish(t, is_parameter, t.requires_grad, grad, conj, neg)


# -- registration (tensormp channels only; see reducers/__init__.py) -------------------------------
register(torch.Tensor, reduce_tensor)
register(_Parameter, reduce_tensor)
register(torch.UntypedStorage, reduce_storage)
register(torch.storage.TypedStorage, _torch_reductions.reduce_typed_storage)
for _cls in torch._storage_classes:  # the legacy typed storages (torch.FloatStorage...)
    if _cls is not torch.UntypedStorage:
        register(_cls, _reduce_legacy_storage)
# torch's own channels (ForkingPickler): tensormp storages cross as handles there too.
from . import torch_stdlib  # noqa: E402,F401

mark_loaded(__name__)
