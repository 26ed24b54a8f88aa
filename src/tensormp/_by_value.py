"""Functions sent by value: what a child could not import by name travels pickled by cloudpickle.

``spawn()`` and ``Pool`` send a function by reference (module and name, as the stdlib and torch
do) whenever the child can import it, and wrap anything else (a lambda, a local function, a
function defined under ``if __name__ == "__main__":``) in :class:`FnByValue`: the cloudpickle
bytes, made once in the parent, unpickled in the child only when the function is needed. The
child needs cloudpickle only to *load* the bytes, and imports it then.

A function loaded from cloudpickle has globals of its own: a dict holding the values the caller's
module had when it was pickled, one per pickle. Where several functions of the caller's
``__main__`` must see one module (an initializer that sets a global, tasks that read it: a Ray
actor, which cannot import the caller's script), :func:`into_namespace` rebinds a loaded function
to one namespace per process. A global comes in with the first function that names it, with the
caller's value at the time that function was pickled, and from then on belongs to the namespace:
later arrivals add only the names it lacks (as a stdlib worker's ``__mp_main__`` keeps its own
values, whatever the parent does after it started).
"""

from __future__ import annotations

import pickle
import types
from typing import Any

__all__ = ["FnByValue", "into_namespace"]


class FnByValue:
    """``fn`` pickled by value (cloudpickle) for a child that could not import it by name."""

    __slots__ = ("data", "name")

    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.name = name

    def __reduce__(self) -> Any:
        return FnByValue, (self.data, self.name)

    def load(self) -> Any:
        return pickle.loads(self.data)  # imports cloudpickle here, in the child, if needed

    def __repr__(self) -> str:
        return f"<fn {self.name} by value, {len(self.data)} bytes>"


def into_namespace(fn: types.FunctionType, ns: dict[str, Any]) -> types.FunctionType:
    """``fn``, loaded from cloudpickle with globals of its own, rebound to the module namespace
    ``ns``: the names ``ns`` lacks are copied in (functions and classes of the same pickle
    rebound too, so a helper they call sees ``ns`` as well), then a copy of ``fn`` whose
    ``__globals__`` is ``ns`` is returned. ``ns`` keeps its own value of a name it has."""
    own = fn.__globals__
    if own is ns:
        return fn
    rebound: dict[int, types.FunctionType] = {}

    def rebind(f: types.FunctionType) -> types.FunctionType:
        new = rebound.get(id(f))
        if new is None:
            new = types.FunctionType(f.__code__, ns, f.__name__, f.__defaults__, f.__closure__)
            for attr in ("__kwdefaults__", "__qualname__", "__module__", "__doc__",
                         "__annotations__", "__type_params__"):
                if hasattr(f, attr):
                    setattr(new, attr, getattr(f, attr))
            new.__dict__.update(f.__dict__)
            rebound[id(f)] = new
        return new

    def ours(value: Any) -> bool:
        return type(value) is types.FunctionType and value.__globals__ is own

    for name, value in list(own.items()):
        if name in ns:
            continue
        if ours(value):
            value = rebind(value)
        elif isinstance(value, type) and value.__module__ == fn.__module__:
            for attr, member in list(vars(value).items()):  # a class of the same script
                if ours(member):
                    setattr(value, attr, rebind(member))
                elif isinstance(member, (staticmethod, classmethod)):
                    inner = member.__func__
                    if type(inner) is types.FunctionType and inner.__globals__ is own:
                        setattr(value, attr, type(member)(rebind(inner)))
        ns[name] = value
    return rebind(fn)
