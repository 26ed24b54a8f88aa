"""torch objects in shared memory: what :func:`tensormp.share` and :func:`tensormp.is_shared` do
with tensors, storages, modules and optimizers.

The memory is tensormp's (see ``reducers/torch.py`` for where it lives and who frees it): a
private CPU storage is moved into it *in place*, as torch's ``share_memory_()`` moves one into
torch's shared memory, so every tensor and view on that storage keeps working and is shared
from then on. This module never imports torch: it is used only once ``torch`` is loaded.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_torch_object", "handles", "share", "is_shared"]


def is_torch_object(obj: object) -> bool:
    """True for the torch objects :func:`share` and :func:`is_shared` take (without importing
    torch: a program that has not imported torch has none)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return isinstance(
        obj,
        (torch.Tensor, torch.UntypedStorage, torch.TypedStorage, torch.nn.Module,
         torch.optim.Optimizer),
    )


# The reducer table's name for it (``reducers.LIBRARIES``: this module is torch's helpers).
handles = is_torch_object


def _storage_parts(t: Any) -> list[Any]:
    """The dense tensors holding ``t``'s memory (``t`` itself, or a sparse tensor's parts)."""
    import torch

    if t.layout is torch.strided:
        if t.is_nested:
            raise TypeError(
                "cannot share a nested tensor in place; share its buffer (t.values()) or send "
                "it through a tensormp channel (it is then copied, as by torch.multiprocessing)"
            )
        return [t]
    if t.layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values()]
    raise TypeError(f"cannot share a tensor of layout {t.layout}")  # pragma: no cover


def _share_tensor(t: Any) -> None:
    from .reducers import torch as rt

    if t.device.type != "cpu":
        return  # CUDA tensors need no moving; meta tensors have no memory (as torch)
    for part in _storage_parts(t):
        rt.share_storage(part.untyped_storage())
    grad = t.grad if t.is_leaf else None
    if grad is not None:
        _share_tensor(grad)


def _tensor_is_shared(t: Any) -> bool:
    from .reducers import torch as rt

    if t.device.type == "cuda":
        return True  # CUDA memory crosses through CUDA IPC (as torch.Tensor.is_shared)
    if t.device.type != "cpu":
        return False
    for part in _storage_parts(t):
        storage = part.untyped_storage()
        if storage.nbytes() and not rt.is_shared_storage(storage):
            return False
    return True


def _module_tensors(module: Any) -> list[Any]:
    tensors = list(module.parameters()) + list(module.buffers())
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    return tensors


def _optimizer_tensors(opt: Any) -> list[Any]:
    import torch

    tensors = [p for group in opt.param_groups for p in group["params"]]
    tensors += [p.grad for p in tensors if p.grad is not None]
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _create_optimizer_state(opt: Any) -> None:
    """Create the state of every trainable parameter of ``opt`` that has none yet.

    torch's optimizers create their state lazily, in the first ``step()``. Here one step runs
    with zero gradients and weight decay switched off, the parameters are restored from a copy
    afterwards, and the step counts are reset to 0: for SGD, Adam, AdamW, Adamax, RAdam,
    RMSprop, Adadelta and Rprop this is exactly the state of an optimizer that never stepped.
    Parameters that have state already, or ``requires_grad=False``, are not touched.
    """
    import torch

    params = [p for group in opt.param_groups for p in group["params"]]
    missing = [p for p in params if p.requires_grad and not opt.state.get(p)]
    if not missing:
        return
    missing_ids = {id(p) for p in missing}
    grads = [p.grad for p in params]
    decay = [group.get("weight_decay") for group in opt.param_groups]
    with torch.no_grad():
        kept = [p.detach().clone() for p in missing]
        try:
            for p in params:
                p.grad = torch.zeros_like(p) if id(p) in missing_ids else None
            for group in opt.param_groups:
                if "weight_decay" in group:
                    group["weight_decay"] = 0.0
            opt.step()
        except Exception as e:
            raise TypeError(
                f"cannot create the state of {type(opt).__name__} without a real step (its "
                f"step() with zero gradients failed: {e}); take one training step first, then "
                "call tensormp.share(optimizer)"
            ) from e
        finally:
            for p, grad in zip(params, grads):
                p.grad = grad
            for group, value in zip(opt.param_groups, decay):
                if value is not None:
                    group["weight_decay"] = value
            for p, copy in zip(missing, kept):
                p.copy_(copy)
        for p in missing:
            state = opt.state.get(p)
            if state and "step" in state:
                step = state["step"]
                if isinstance(step, torch.Tensor):
                    step.zero_()
                else:
                    state["step"] = type(step)(0)


def share(obj: Any) -> Any:
    """Put a torch object's CPU memory in tensormp shared memory, in place; returns ``obj``.

    * ``torch.Tensor`` / ``Parameter``: its storage is moved in place (one copy of its bytes),
      as torch's ``Tensor.share_memory_()`` does, so every view of that storage is shared too;
      so is its ``.grad``, if it has one. A sparse tensor's indices and values are moved.
      Storages already in shared memory (tensormp's, or torch's own) and CUDA tensors are left
      as they are.
    * ``torch.UntypedStorage`` / ``TypedStorage``: the same for the storage.
    * ``torch.nn.Module``: every parameter, buffer and the gradients that exist *now*, as
      ``Module.share_memory()``. Gradients created later by a process's ``backward()`` are that
      process's own (what Hogwild wants).
    * ``torch.optim.Optimizer``: its parameters and its state, created first if the optimizer
      never stepped (Adam's moments and step counts, SGD's momentum buffers...; see
      :func:`_create_optimizer_state`), so that workers that receive the model and the
      optimizer *in the same message* (e.g. the same ``Process`` arguments) update one
      shared state.

    Raises:
        TypeError: a nested tensor, or an optimizer whose state cannot be created without a
            real step (e.g. ``LBFGS``, ``SparseAdam``).
        SharedMemoryError: the memory could not be reserved (an ``OSError``).
    """
    import torch

    from .reducers import torch as rt

    if isinstance(obj, torch.Tensor):
        _share_tensor(obj)
    elif isinstance(obj, torch.UntypedStorage):
        rt.share_storage(obj)
    elif isinstance(obj, torch.TypedStorage):
        rt.share_storage(obj._untyped_storage)
    elif isinstance(obj, torch.nn.Module):
        for t in _module_tensors(obj):
            _share_tensor(t)
    elif isinstance(obj, torch.optim.Optimizer):
        _create_optimizer_state(obj)
        for t in _optimizer_tensors(obj):
            _share_tensor(t)
    else:
        raise TypeError(f"share() does not take {type(obj).__module__}.{type(obj).__qualname__}")
    return obj


def is_shared(obj: Any) -> bool:
    """Whether ``obj``'s memory crosses processes by reference (tensormp memory, memory torch
    shared with ``share_memory_()``, or CUDA memory).

    For a module: every parameter, buffer and existing gradient; for an optimizer: every
    parameter and state tensor. An empty storage (0 bytes) counts as shared: nothing is copied.

    Raises:
        TypeError: ``obj`` is not a tensor, storage, module or optimizer.
    """
    import torch

    from .reducers import torch as rt

    if isinstance(obj, torch.Tensor):
        return _tensor_is_shared(obj)
    if isinstance(obj, torch.UntypedStorage):
        return obj.nbytes() == 0 or rt.is_shared_storage(obj)
    if isinstance(obj, torch.TypedStorage):
        return is_shared(obj._untyped_storage)
    if isinstance(obj, torch.nn.Module):
        return all(_tensor_is_shared(t) for t in _module_tensors(obj))
    if isinstance(obj, torch.optim.Optimizer):
        return all(_tensor_is_shared(t) for t in _optimizer_tensors(obj))
    raise TypeError(f"is_shared() does not take {type(obj).__module__}.{type(obj).__qualname__}")
