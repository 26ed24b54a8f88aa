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
Loading it wraps five methods of ``torch.UntypedStorage`` and (``reducers/torch_stdlib.py``)
torch's ``ForkingPickler`` reducer of ``UntypedStorage``, and nothing else:

* ``is_shared()``: also True for tensormp memory (so ``Tensor.is_shared()`` is).
* ``share_memory_()``: a no-op for tensormp memory (already shared; torch would move it).
* ``_share_fd_cpu_()``/``_share_filename_cpu_()``, which torch's reducers call to move a
  storage into torch's shared memory: for tensormp memory no other process holds (any more:
  ``memory.allocator.held_elsewhere``), torch moves it, as any private storage; otherwise they
  raise ``HandleError`` naming the fix, because moving it would silently stop it being
  shared. torch's reducers do not reach them for tensormp memory any more: see below.
* ``_new_shared()`` (``DataLoader`` workers collate each batch straight into it): in a process
  started by tensormp, it allocates tensormp memory, so batches cross as handles with no copy.

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

import multiprocessing
import os
import pickle
import threading
import weakref
from typing import Any, cast

import numpy as np
import torch
from torch.multiprocessing import reductions as _torch_reductions
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import HandleError
from ..memory import allocate, find_block
from ..memory.allocator import held_elsewhere
from ..memory.release import process_start_time
from . import current_message, mark_loaded, register, take_fd
from . import numpy as _numpy_reducers  # noqa: F401 - the storage handle is an ndarray handle

__all__ = [
    "reduce_tensor",
    "reduce_storage",
    "share_storage",
    "new_storage",
    "in_tensormp_memory",
    "is_shared_storage",
]

_Parameter = torch.nn.parameter.Parameter

# -- the registry of storages in tensormp memory ------------------------------------------------
_lock = threading.RLock()


class _Entry:
    """A storage in tensormp memory, as seen from its data pointer."""

    __slots__ = ("ref", "exported")

    def __init__(self, ref: weakref.ref[np.ndarray], exported: bool) -> None:
        self.ref = ref  # the uint8 view the storage's deleter holds
        self.exported = exported  # another process may hold this memory


_owned: dict[int, _Entry] = {}  # storage data pointer -> entry


def _forget(ptr: int, ref: weakref.ref[np.ndarray]) -> None:
    # Weakref callback (may run inside garbage collection while _lock is held): no locking;
    # the callback runs when the view dies, before its block can be reused.
    entry = _owned.get(ptr)
    if entry is not None and entry.ref is ref:
        _owned.pop(ptr, None)


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def _wrap(view: np.ndarray, exported: bool) -> torch.UntypedStorage:
    """A storage over ``view`` (a writable 1-D uint8 view of a block), registered."""
    storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
    ptr = storage.data_ptr()
    _owned[ptr] = _Entry(weakref.ref(view, lambda r: _forget(ptr, r)), exported)
    return storage


def _entry(storage: Any) -> _Entry | None:
    """The registry entry of ``storage`` if its memory is tensormp memory, else None."""
    if storage.device.type != "cpu":
        return None
    entry = _owned.get(storage.data_ptr())
    if entry is None:
        return None
    view = entry.ref()
    if view is None or view.nbytes != storage.nbytes():
        return None
    return entry


def in_tensormp_memory(storage: Any) -> bool:
    """True when ``storage`` (an ``UntypedStorage``) lives in tensormp shared memory."""
    return _entry(storage) is not None


def is_shared_storage(storage: Any) -> bool:
    """True when ``storage`` crosses processes by reference: tensormp memory, memory torch
    shared (``share_memory_()``), or a CUDA storage (as ``torch.UntypedStorage.is_shared``)."""
    return _entry(storage) is not None or bool(_orig_is_shared(storage))


def new_storage(nbytes: int) -> torch.UntypedStorage:
    """A new ``UntypedStorage`` of ``nbytes`` bytes in tensormp memory (contents undefined).

    Raises:
        SharedMemoryError: the memory could not be reserved (an ``OSError``).
    """
    root = allocate(nbytes)
    return _wrap(root[:nbytes], exported=False)


# torch.UntypedStorage._swap_data_ptr_ appeared in torch 2.13 (pytorch/pytorch#177449). Without
# it a private storage cannot be moved into tensormp memory in place: torch's own
# share_memory_() moves it into torch's shared memory instead, and it crosses by its fd (case 2).
_CAN_SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def _move(storage: Any) -> np.ndarray:
    """Move a private CPU storage into a new block, in place; returns its view."""
    n = storage.nbytes()
    root = allocate(n)
    view = root[:n]
    tmp = _wrap(view, exported=False)
    tmp.copy_(storage)
    # Swaps data pointer, size, resizable flag and allocator (c10 StorageImpl::swap_data_ptr):
    # every tensor on `storage` now uses the block; `tmp` takes the old memory away with it.
    storage._swap_data_ptr_(tmp)
    del tmp
    return view


def share_storage(storage: Any) -> bool:
    """Move a CPU ``storage`` into tensormp memory in place, unless it is shared already.

    Every tensor and view on the storage moves with it (torch's ``share_memory_()`` semantics).
    Returns True if it was moved. Storages of 0 bytes, storages torch already shared, and
    non-CPU storages are left alone.

    Raises:
        SharedMemoryError: the memory could not be reserved (an ``OSError``).
    """
    if storage.device.type != "cpu" or storage.nbytes() == 0:
        return False
    with _lock:
        if _entry(storage) is not None or _orig_is_shared(storage):
            return False
        if _CAN_SWAP:
            _move(storage)
        else:  # pragma: no cover - torch < 2.13
            _orig_share_memory(storage)
        return True


# -- receiver-side cache: one storage per shared memory range --------------------------------
_cache: dict[tuple[Any, ...], StorageWeakRef] = {}
_cache_limit = 128


def _cached(key: tuple[Any, ...]) -> Any:
    ref = _cache.get(key)
    if ref is None:
        return None
    return torch.UntypedStorage._new_with_weak_ptr(ref.cdata)


def _cache_put(key: tuple[Any, ...], storage: Any) -> None:
    global _cache_limit
    _cache[key] = StorageWeakRef(storage)
    if len(_cache) > _cache_limit:
        for k in [k for k, ref in _cache.items() if ref.expired()]:
            del _cache[k]
        _cache_limit = max(128, 2 * len(_cache))


def _view_key(view: np.ndarray) -> tuple[Any, ...]:
    found = find_block(view)
    if found is None:  # pragma: no cover - every view here is a view of a block's root
        raise HandleError("a torch storage handle does not point into tensormp memory")
    block, root = found
    return (block.segment.id, block.offset, _address(view) - _address(root), view.nbytes)


# -- storages -------------------------------------------------------------------------------------
def reduce_storage(storage: Any) -> Any:
    """Reducer of ``torch.UntypedStorage`` in tensormp channels (see the module notes)."""
    msg = current_message()
    if msg is None or storage.device.type != "cpu":
        # CUDA and meta storages: torch's reducer, which refuses them with its own message.
        return _torch_reductions.reduce_storage(storage)
    if storage.nbytes() == 0:
        return _rebuild_empty_storage, ()
    with _lock:
        entry = _entry(storage)
        if entry is None:
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


def _rebuild_storage(view: np.ndarray) -> Any:
    key = _view_key(view)
    with _lock:
        storage = _cached(key)
        if storage is None:
            storage = _wrap(view, exported=True)
            _cache_put(key, storage)
    return storage


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
        with _lock:
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


# -- torch's own methods (see the module notes) ---------------------------------------------------
_US = torch.UntypedStorage
if not getattr(_US, "_tensormp_wrapped", False):
    _orig_is_shared = _US.is_shared
    _orig_share_memory = _US.share_memory_
    _orig_share_fd = _US._share_fd_cpu_
    _orig_share_filename = _US._share_filename_cpu_
    _orig_new_shared = _US._new_shared.__func__
else:  # pragma: no cover - the module was re-imported (importlib.reload)
    _orig_is_shared = _US._tensormp_originals["is_shared"]
    _orig_share_memory = _US._tensormp_originals["share_memory_"]
    _orig_share_fd = _US._tensormp_originals["_share_fd_cpu_"]
    _orig_share_filename = _US._tensormp_originals["_share_filename_cpu_"]
    _orig_new_shared = _US._tensormp_originals["_new_shared"]


def _is_shared(self: Any) -> bool:
    return bool(_orig_is_shared(self)) or _entry(self) is not None


def _share_memory_(self: Any, *args: Any, **kwargs: Any) -> Any:
    if _entry(self) is not None:
        return self  # already in (tensormp) shared memory
    return _orig_share_memory(self, *args, **kwargs)


def _refuse_torch_move(storage: Any, method: str) -> None:
    if not _owned or storage.data_ptr() not in _owned:
        return  # not tensormp memory (no lock: a miss is final, a hit is checked below)
    with _lock:
        entry = _entry(storage)
        view = entry.ref() if entry is not None else None
    if view is None:
        return  # not tensormp memory: torch's business
    found = find_block(view)
    if found is None or not held_elsewhere(found[0]):
        return  # no other process holds it (any more): torch may move it, as any private one
    block = found[0]
    if not block.owned or block.owner_pid != os.getpid():
        why = f"it was received from process {block.segment.creator_pid}"
    elif block.pinned:
        why = "a child forked since may map it"
    else:
        why = f"{block.remote} handle(s) to it are held or in flight in other processes"
    raise HandleError(
        f"torch's UntypedStorage.{method} cannot share this storage of {storage.nbytes()} "
        f"bytes: it is in tensormp shared memory that another process may still hold ({why}), "
        "and torch would move it into its own shared memory, silently cutting it off from those "
        "processes. tensormp's reducer on multiprocessing's ForkingPickler carries such "
        "storages through plain multiprocessing and torch.multiprocessing queues, pipes and "
        "DataLoaders; this call came from elsewhere (torch's reducer called directly). Use a "
        "tensormp channel: DataLoader(..., multiprocessing_context=tensormp.get_context("
        "'spawn')), a tensormp Queue, Pipe, Pool or Process; or send a copy (t.clone())"
    )


def _share_fd_cpu_(self: Any, *args: Any, **kwargs: Any) -> Any:
    _refuse_torch_move(self, "_share_fd_cpu_")
    return _orig_share_fd(self, *args, **kwargs)


def _share_filename_cpu_(self: Any, *args: Any, **kwargs: Any) -> Any:
    _refuse_torch_move(self, "_share_filename_cpu_")
    return _orig_share_filename(self, *args, **kwargs)


_started_by: dict[int, bool] = {}


def _started_by_tensormp() -> bool:
    pid = os.getpid()
    known = _started_by.get(pid)
    if known is None:
        from ..context import _ProcessMixin

        known = _started_by[pid] = isinstance(multiprocessing.current_process(), _ProcessMixin)
    return known


def _new_shared(cls: Any, size: int, *, device: Any = "cpu") -> Any:
    if size > 0 and torch.device(device).type == "cpu" and _started_by_tensormp():
        return new_storage(size)
    return _orig_new_shared(cls, size, device=device)


if not getattr(_US, "_tensormp_wrapped", False):
    _US._tensormp_originals = {
        "is_shared": _orig_is_shared,
        "share_memory_": _orig_share_memory,
        "_share_fd_cpu_": _orig_share_fd,
        "_share_filename_cpu_": _orig_share_filename,
        "_new_shared": _orig_new_shared,
    }
    for _name, _fn in (
        ("is_shared", _is_shared),
        ("share_memory_", _share_memory_),
        ("_share_fd_cpu_", _share_fd_cpu_),
        ("_share_filename_cpu_", _share_filename_cpu_),
    ):
        _fn.__doc__ = (getattr(_US, _name).__doc__ or "") + (
            "\n\n(Wrapped by tensormp: see tensormp.reducers.torch.)"
        )
        setattr(_US, _name, _fn)
    _US._new_shared = classmethod(_new_shared)
    _US._tensormp_wrapped = True


# -- fork ---------------------------------------------------------------------------------------
def _mark_all_exported() -> None:
    # A forked child inherits every mapping: from now on another process holds this memory.
    for entry in list(_owned.values()):
        entry.exported = True


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    _started_by.clear()
    _mark_all_exported()


os.register_at_fork(after_in_parent=_mark_all_exported, after_in_child=_after_fork_in_child)


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
