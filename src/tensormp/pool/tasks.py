"""A task as the parent holds it: :class:`_Task` (one call or one map chunk, and where its
answer goes), its callable as it travels (:class:`_Fn`), and the text that names it in errors.

A callable goes by reference when the workers can import it by name (as the stdlib), else by
value with cloudpickle; ``_by_value.needs_value`` decides (as for ``tensormp.spawn``). Shared
by :class:`tensormp.Pool` and ``tensormp.ProcessPoolExecutor``.
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable
from typing import Any

from .. import _by_value, reducers
from .._by_value import FnByValue

# What a task is (``_Task.kind``): one call, ``args`` being ``(args, kwargs)``; a map chunk,
# ``args`` a list of items; a starmap chunk, ``args`` a list of argument tuples.
_CALL, _MAP, _STARMAP = 0, 1, 2


class _Fn:
    """A job's callable as it travels: by reference, or by value (cloudpickle) once needed."""

    __slots__ = ("fn", "name", "wire", "what")

    def __init__(self, fn: Any, what: str) -> None:
        self.fn = fn
        self.what = what
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        self.name: str = name if isinstance(name, str) else reprlib.repr(fn)
        self.wire: Any = fn

    @property
    def by_value(self) -> bool:
        return isinstance(self.wire, FnByValue)

    def to_value(self) -> None:
        """Send the callable by value from now on.

        Raises:
            TypeError: cloudpickle is not installed.
        """
        module = getattr(self.fn, "__module__", None) or "?"
        self.wire = _by_value.to_value(
            self.fn,
            f"{module}.{self.name}",
            f"{self.what}={self.fn!r} cannot be imported by name in a worker (a lambda, a "
            "local function, a function defined under `if __name__ == \"__main__\":`, or "
            "an object plain pickle refuses); install cloudpickle (pip install "
            "'tensormp[cloudpickle]') so tensormp can send it by value, or define it at "
            "the top level of a module",
        )


def _prepare(fn: Any, what: str = "func", *, inherited: bool = False) -> _Fn:
    """``fn`` as it will travel. ``inherited``: the workers are forked from this process (the
    local engine under ``fork``), so they have ``__main__`` as it is now: everything goes by
    reference first, as with the stdlib (arrays it holds stay shared), and by value only if
    plain pickle refuses it (a lambda, a local function)."""
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}: {reprlib.repr(fn)}")
    ref = _Fn(fn, what)
    if not inherited and _by_value.needs_value(fn):
        ref.to_value()
    return ref


def _initargs(initargs: Any) -> tuple[Any, ...]:
    """``initargs`` as a tuple (a list is taken too, as the stdlib).

    Raises:
        TypeError: ``initargs`` is not a tuple or a list.
    """
    if not isinstance(initargs, (tuple, list)):
        raise TypeError(
            f"initargs must be a tuple, got {type(initargs).__name__}; for one argument write "
            "initargs=(x,)"
        )
    return tuple(initargs)


class _Task:
    """One call or one chunk: what the manager sends, and where the answer goes."""

    __slots__ = ("seq", "fn", "kind", "args", "sink", "start", "label", "msg", "owner")

    def __init__(
        self,
        fn: _Fn,
        kind: int,
        args: Any,
        sink: Callable[[bool, Any], None],
        label: tuple[Any, ...],
        start: Callable[[], bool] | None = None,
        owner: Any = None,
    ) -> None:
        self.seq = 0
        self.fn = fn
        self.kind = kind
        self.args = args
        self.sink = sink
        self.label = label
        self.start = start  # called once, before sending; False: cancelled (executor futures)
        self.msg: reducers.Message | None = None
        self.owner = owner


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 80


def _describe(label: tuple[Any, ...]) -> str:
    """``map(work) chunk 3 of 8 (items 6-7)``, ``apply_async(work, 1, x=2)``."""
    what = label[0]
    if what in ("apply", "apply_async", "submit"):
        _, name, args, kwargs = label
        parts = [_repr.repr(a) for a in args[:6]] + ["..."] * (len(args) > 6)
        parts += [f"{k}={_repr.repr(v)}" for k, v in list(kwargs.items())[:6]]
        return f"{what}({', '.join([name, *parts])})"
    _, name, index, nchunks, first, count = label
    of = f" of {nchunks}" if nchunks else ""
    items = f"item {first}" if count == 1 else f"items {first}-{first + count - 1}"
    return f"{what}({name}) chunk {index + 1}{of} ({items})"


# Types whose values pickle without tensormp's reducers (no fds, no shared memory) in a size
# known from the value: what tiny tasks are made of.
_SCALARS = frozenset({int, float, bool, type(None), complex})
_SIZED = frozenset({str, bytes})
_LIGHT_ITEMS = 64  # values looked at, at most (a longer chunk is pickled on its own)
_LIGHT_BYTES = 16 << 10  # the size under which a task counts as light


def _light_size(task: _Task) -> int:
    """About how many bytes ``task`` pickles to when it is *light*: its arguments are only
    scalars, ``str`` and ``bytes`` (at most ``_LIGHT_ITEMS`` values, ``_LIGHT_BYTES`` bytes),
    so pickling cannot fail on them nor attach fds or shared memory. -1 when not light.

    A light task needs no pickle of its own before it is sent: the local engine pickles a
    batch of them in one go (one ``dumps`` per batch instead of one per task, and the worker
    one ``loads``). Looking costs well under a microsecond for a tiny task."""
    args = task.args
    if task.kind == _CALL:  # (args, kwargs)
        values = list(args[0])
        if args[1]:
            values.extend(args[1].values())
    elif task.kind == _MAP:  # a chunk of items
        values = args
    else:  # _STARMAP: a chunk of argument tuples
        if len(args) > _LIGHT_ITEMS:
            return -1
        values = []
        for item in args:
            if type(item) is not tuple:
                return -1
            values.extend(item)
    if len(values) > _LIGHT_ITEMS:
        return -1
    size = 64
    for value in values:
        kind = type(value)
        if kind in _SCALARS:
            size += 16
        elif kind in _SIZED:
            size += 16 + len(value)
        else:
            return -1
    return size if size <= _LIGHT_BYTES else -1
