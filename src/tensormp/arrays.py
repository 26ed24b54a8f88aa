"""Arrays in shared memory: ``share``, ``is_shared`` and allocation (numpy signatures).

``share`` and ``is_shared`` take an object of any array library in the reducer table
(``reducers.LIBRARIES``) and dispatch to that library's helpers; the allocation functions make
numpy arrays (their signatures are numpy's).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from numpy.typing import DTypeLike

from . import memory, reducers
from .memory.allocator import find_block

__all__ = [
    "share", "is_shared", "empty", "zeros", "ones", "full",
    "empty_like", "zeros_like", "ones_like", "full_like",
]

ShapeLike = int | Sequence[int]
Order = Literal["C", "F"]


def _helpers(a: Any, what: str) -> reducers.ArrayHelpers:
    """The helpers of ``a``'s array library (``reducers.LIBRARIES``)."""
    helpers = reducers.helpers_for(a)
    if helpers is None:
        raise TypeError(
            f"{what}() takes a numpy.ndarray, got {type(a).__module__}.{type(a).__qualname__}; "
            "convert it with numpy.asarray() first"
        )
    return helpers


def is_shared(a: Any) -> bool:
    """True when ``a``'s memory is tensormp shared memory (it crosses processes as a handle).

    True for arrays from :func:`empty`/:func:`zeros`/..., :func:`share`, arrays received from
    another process, and any view of those. Like ``torch.Tensor.is_shared``. With torch
    installed, ``a`` may also be a tensor, storage, ``nn.Module`` or optimizer: see
    :func:`tensormp.torch_utils.is_shared`.

    Raises:
        TypeError: ``a`` is not a ``numpy.ndarray`` (or one of those torch objects).
    """
    return _helpers(a, "is_shared").is_shared(a)


def share(a: Any) -> Any:
    """``a`` in shared memory: ``a`` itself if already shared, else a shared copy.

    A numpy array cannot be moved in place (torch's ``share_memory_()`` can), so a non-shared
    array costs one copy of ``a.nbytes`` bytes; keep using the returned array. C or Fortran
    order is kept; other layouts become C-contiguous. Read-only stays read-only.

    With torch installed, ``a`` may also be a tensor, storage, ``nn.Module`` or optimizer: its
    memory is moved into shared memory *in place* and ``a`` is returned (like
    ``Module.share_memory()``); see :func:`tensormp.torch_utils.share`.

    Raises:
        TypeError: ``a`` is not an ndarray (or one of those torch objects), or its dtype holds
            Python objects.
        SharedMemoryError: the memory could not be reserved (an ``OSError``).
    """
    out = _helpers(a, "share").share(a)
    if reducers._waiting:  # (see empty)
        reducers._load_libraries()
    return out


def _shape(shape: ShapeLike) -> tuple[int, ...]:
    try:
        dims: tuple[int, ...] = (operator.index(shape),)  # type: ignore[arg-type]
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)  # type: ignore[union-attr]
        except TypeError:
            raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimensions are not allowed (shape {dims})")
    return dims


def empty(shape: ShapeLike, dtype: DTypeLike = float, order: Order = "C") -> np.ndarray:
    """A new array in shared memory, contents undefined (as ``numpy.empty``).

    Args:
        shape: dimensions (int or sequence of ints).
        dtype: any numpy dtype without Python objects (default float64).
        order: ``"C"`` (row-major) or ``"F"`` (column-major).

    Returns:
        An ndarray of ``prod(shape) * dtype.itemsize`` bytes whose memory crosses processes as a
        handle. Small arrays share one segment (one fd, one mapping).

    Raises:
        TypeError: bad shape, or a dtype holding Python objects.
        ValueError: negative dimension or bad ``order``.
        SharedMemoryError: the bytes could not be reserved (an ``OSError``, ``ENOSPC``/``ENOMEM``).
    """
    dims = _shape(shape)
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise TypeError(f"cannot allocate dtype {dt} in shared memory: it holds Python objects")
    if order not in ("C", "F"):
        raise ValueError(f"order must be 'C' or 'F', got {order!r}")
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    root = memory.allocate(nbytes)
    out: np.ndarray = np.ndarray(dims, dt, buffer=root, order=order)
    if reducers._waiting:
        # torch imported already: its tensormp handling loads now, so that a torch.from_numpy()
        # of this array is shared for torch too (is_shared(), share_memory_() leaves it)
        # before tensormp pickles anything.
        reducers._load_libraries()
    return out


def zeros(shape: ShapeLike, dtype: DTypeLike = float, order: Order = "C") -> np.ndarray:
    """A new shared array of zeros (as ``numpy.zeros``); see :func:`empty` for errors.

    Every byte is zeroed, padding of structured dtypes included (a recycled block holds old
    bytes)."""
    a = empty(shape, dtype, order)
    found = find_block(a)
    assert found is not None
    found[1][: a.nbytes] = 0
    return a


def ones(shape: ShapeLike, dtype: DTypeLike = float, order: Order = "C") -> np.ndarray:
    """A new shared array of ones (as ``numpy.ones``); see :func:`empty` for errors."""
    a = empty(shape, dtype, order)
    np.copyto(a, 1, casting="unsafe")  # as numpy.ones (works for void and structured dtypes)
    return a


def full(
    shape: ShapeLike, fill_value: Any, dtype: DTypeLike | None = None, order: Order = "C"
) -> np.ndarray:
    """A new shared array filled with ``fill_value`` (as ``numpy.full``); dtype defaults to
    ``numpy.array(fill_value).dtype``. See :func:`empty` for errors."""
    if dtype is None:
        dtype = np.array(fill_value).dtype
    a = empty(shape, dtype, order)
    np.copyto(a, fill_value, casting="unsafe")  # as numpy.full
    return a


def _like(
    a: Any, dtype: DTypeLike | None, shape: ShapeLike | None
) -> tuple[ShapeLike, DTypeLike, Order]:
    a = np.asanyarray(a)
    order: Order = "F" if a.flags.f_contiguous and not a.flags.c_contiguous else "C"
    return (a.shape if shape is None else shape), (a.dtype if dtype is None else dtype), order


def empty_like(a: Any, dtype: DTypeLike | None = None, shape: ShapeLike | None = None) -> np.ndarray:
    """:func:`empty` with ``a``'s shape, dtype and C/F order (as ``numpy.empty_like``)."""
    return empty(*_like(a, dtype, shape))


def zeros_like(a: Any, dtype: DTypeLike | None = None, shape: ShapeLike | None = None) -> np.ndarray:
    """:func:`zeros` with ``a``'s shape, dtype and C/F order (as ``numpy.zeros_like``)."""
    return zeros(*_like(a, dtype, shape))


def ones_like(a: Any, dtype: DTypeLike | None = None, shape: ShapeLike | None = None) -> np.ndarray:
    """:func:`ones` with ``a``'s shape, dtype and C/F order (as ``numpy.ones_like``)."""
    return ones(*_like(a, dtype, shape))


def full_like(
    a: Any, fill_value: Any, dtype: DTypeLike | None = None, shape: ShapeLike | None = None
) -> np.ndarray:
    """:func:`full` with ``a``'s shape, dtype and C/F order (as ``numpy.full_like``)."""
    shp, dt, order = _like(a, dtype, shape)
    return full(shp, fill_value, dt, order)
