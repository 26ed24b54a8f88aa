"""The storages in tensormp memory, as torch sees them: the registry, the receivers' cache, and
the five methods of ``torch.UntypedStorage`` that tensormp wraps.

Both pickling paths build on this module: ``reducers/torch.py`` (tensormp's channels) and
``reducers/torch_stdlib.py`` (the stdlib's ``ForkingPickler``: plain ``multiprocessing`` and
``torch.multiprocessing`` channels); it imports neither. Loading it installs the wrappers, so a
process that rebuilds a storage through either path sees ``is_shared()`` true for it.

Registry. A storage in tensormp memory wraps a ``uint8`` view of its block (``torch.frombuffer``);
``_owned`` maps the storage's data pointer to a weak reference to that view (the entry dies with
the view, so with the storage) and an ``exported`` flag (another process may hold the memory).
The storage's deleter holds the view, the view holds the block's root: in each process the block
lives exactly as long as the storage. ``_lock`` guards the registry and the cache; a forked child
gets a new lock (the parent's may have been held by another thread) and marks every entry
exported (the child maps the same memory).

Foreign storages. A storage torch made over memory it did not allocate (``torch.from_numpy``,
``as_tensor``, ``frombuffer`` of a tensormp array; such storages are not resizable) is not in the
registry: :func:`foreign_view` finds the block by address (``memory.allocator.root_at``, a scan
of this process's blocks, done only for non-resizable storages torch did not share). Such a
storage crosses as a handle of that view, is shared for ``is_shared()``/``share_memory_()``, and
is never moved (moving it would cut it off from the array it wraps). The other way, an array's
base chain that ends in a tensor (``t.numpy()``) continues through ``_tensor_base``
(``memory.allocator.foreign_base``).

Cache. A receiver keeps one storage per shared memory range, keyed by (segment id, block offset,
byte offset, nbytes), or ("torch-shm", st_dev, st_ino) for memory torch shared: the same storage
sent twice, or sent back to its sender, arrives as the same storage. Entries are weak
(``StorageWeakRef``); dead ones are dropped when the table doubles.

What this module changes in torch: it wraps five methods of ``torch.UntypedStorage``, and
nothing else:

* ``is_shared()``: also True for tensormp memory (so ``Tensor.is_shared()`` is).
* ``share_memory_()``: a no-op for tensormp memory (already shared; torch would move it).
* ``_share_fd_cpu_()``/``_share_filename_cpu_()``, which torch's reducers call to move a
  storage into torch's shared memory: for tensormp memory no other process holds (any more:
  ``memory.allocator.held_elsewhere``), torch moves it, as any private storage; otherwise they
  raise ``HandleError`` naming the fix, because moving it would silently stop it being
  shared. torch's reducers do not reach them for tensormp memory: ``reducers/torch_stdlib.py``
  sends it as a handle first.
* ``_new_shared()`` (``DataLoader`` workers collate each batch straight into it): in a process
  started by tensormp, it allocates tensormp memory, so batches cross as handles with no copy.

It owns nothing beyond the storages it wraps: the blocks are the allocator's (who frees them,
and what a SIGKILL leaves, is in ``memory/allocator.py`` and ``reducers/torch.py``).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import weakref
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..errors import HandleError
from ..memory import allocate, find_block
from ..memory import allocator as _allocator
from ..memory.allocator import held_elsewhere, root_at

__all__ = [
    "foreign_view", "in_tensormp_memory", "is_shared_storage", "new_storage", "share_storage",
]

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


def foreign_view(storage: Any) -> np.ndarray | None:
    """A ``uint8`` view of the tensormp memory that ``storage`` wraps without being registered
    (``torch.from_numpy``/``torch.as_tensor``/``torch.frombuffer`` of a tensormp array), or
    None. Only storages torch neither allocated itself (those are resizable) nor shared are
    looked up (``memory.allocator.root_at``). Such a storage holds the array it wraps, which
    holds the block: the block lives as long as the storage, as the registry's do."""
    if storage.device.type != "cpu" or storage.resizable() or _orig_is_shared(storage):
        return None
    n = storage.nbytes()
    if n == 0:
        return None
    ptr = storage.data_ptr()
    root = root_at(ptr, n)
    if root is None:
        return None
    start = _address(root)
    return root[ptr - start : ptr - start + n]


def _tensor_base(obj: object) -> object | None:
    """``memory.allocator.foreign_base`` for torch: the tensormp view behind a CPU tensor (the
    base of its ``.numpy()``), or None."""
    if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu" or obj.is_sparse:
        return None
    storage = obj.untyped_storage()
    entry = _entry(storage)
    if entry is not None:
        return entry.ref()
    return foreign_view(storage)


def in_tensormp_memory(storage: Any) -> bool:
    """True when ``storage`` (an ``UntypedStorage``) lives in tensormp shared memory."""
    return _entry(storage) is not None


def is_shared_storage(storage: Any) -> bool:
    """True when ``storage`` crosses processes by reference: tensormp memory, memory torch
    shared (``share_memory_()``), or a CUDA storage (as ``torch.UntypedStorage.is_shared``)."""
    return (
        _entry(storage) is not None
        or bool(_orig_is_shared(storage))
        or foreign_view(storage) is not None
    )


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
        if foreign_view(storage) is not None:  # a from_numpy() of a tensormp array: shared
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


def _rebuild_storage(view: np.ndarray) -> Any:
    key = _view_key(view)
    with _lock:
        storage = _cached(key)
        if storage is None:
            storage = _wrap(view, exported=True)
            _cache_put(key, storage)
    return storage


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
    return bool(_orig_is_shared(self)) or _entry(self) is not None or (
        foreign_view(self) is not None
    )


def _share_memory_(self: Any, *args: Any, **kwargs: Any) -> Any:
    if _entry(self) is not None or foreign_view(self) is not None:
        return self  # already in (tensormp) shared memory
    return _orig_share_memory(self, *args, **kwargs)


def _refuse_torch_move(storage: Any, method: str) -> None:
    view = None
    if _owned and storage.data_ptr() in _owned:  # (no lock: a miss is final, a hit is checked)
        with _lock:
            entry = _entry(storage)
            view = entry.ref() if entry is not None else None
    if view is None:
        view = foreign_view(storage)
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
            "\n\n(Wrapped by tensormp: see tensormp.reducers.torch_storage.)"
        )
        setattr(_US, _name, _fn)
    _US._new_shared = classmethod(_new_shared)
    _US._tensormp_wrapped = True


# -- fork ---------------------------------------------------------------------------------------
def _mark_all_exported() -> None:
    # A forked child inherits every mapping: from now on another process holds this memory.
    for entry in list(_owned.values()):
        entry.exported = True


_allocator.foreign_base = _tensor_base


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    _started_by.clear()
    _mark_all_exported()


os.register_at_fork(after_in_parent=_mark_all_exported, after_in_child=_after_fork_in_child)
