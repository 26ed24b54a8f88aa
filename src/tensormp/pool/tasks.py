"""A task as the parent holds it: :class:`_Task` (one call or one map chunk, and where its
answer goes), its callable as it travels (:class:`_Fn`), and the text that names it in errors.

A callable goes by reference when the workers can import it by name (as the stdlib); lambdas,
local functions, functions defined under ``if __name__ == "__main__":`` and callables that plain
pickle refuses go by value with cloudpickle (as ``tensormp.spawn``). Shared by
:class:`tensormp.Pool` and ``tensormp.ProcessPoolExecutor``.
"""

from __future__ import annotations

import pickle
import reprlib
import weakref
from collections.abc import Callable
from typing import Any

from .. import reducers
from .._by_value import FnByValue

_top_level: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _needs_value(fn: Any) -> bool:
    """True when workers cannot import ``fn`` by name (see ``spawn._defined_at_top_level``)."""
    if getattr(fn, "__code__", None) is None:
        return False  # builtin, partial, bound method, callable object: by reference first
    if "<" in getattr(fn, "__qualname__", "<"):
        return True  # lambda or local function
    if getattr(fn, "__module__", None) != "__main__":
        return False
    try:
        top = _top_level.get(fn)
    except TypeError:
        top = None
    if top is None:
        from ..spawn import _defined_at_top_level

        top = _defined_at_top_level(fn)
        try:
            _top_level[fn] = top
        except TypeError:
            pass
    return not top


class _Fn:
    """A job's callable as it travels: by reference, or by value (cloudpickle) once needed."""

    __slots__ = ("fn", "name", "wire", "what")

    def __init__(self, fn: Any, what: str) -> None:
        self.fn = fn
        self.what = what
        self.name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
        if not isinstance(self.name, str):
            self.name = reprlib.repr(fn)
        self.wire: Any = fn

    @property
    def by_value(self) -> bool:
        return isinstance(self.wire, FnByValue)

    def to_value(self) -> None:
        """Send the callable by value from now on.

        Raises:
            TypeError: cloudpickle is not installed.
        """
        try:
            import cloudpickle
        except ImportError:
            raise TypeError(
                f"{self.what}={self.fn!r} cannot be imported by name in a worker (a lambda, a "
                "local function, a function defined under `if __name__ == \"__main__\":`, or "
                "an object plain pickle refuses); install cloudpickle (pip install "
                "'tensormp[cloudpickle]') so tensormp can send it by value, or define it at "
                "the top level of a module"
            ) from None
        module = getattr(self.fn, "__module__", None) or "?"
        self.wire = FnByValue(cloudpickle.dumps(self.fn), f"{module}.{self.name}")


def _prepare(fn: Any, what: str = "func") -> _Fn:
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}: {reprlib.repr(fn)}")
    ref = _Fn(fn, what)
    if _needs_value(fn):
        ref.to_value()
    return ref


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


def _pickles(obj: Any) -> bool:
    try:
        pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001
        return False
    return True
