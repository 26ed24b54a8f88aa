"""How a callable travels to a child: by reference (its module and name), or by value.

Protocol note
-------------
``spawn()`` and ``Pool`` send a callable by reference whenever the child can import it by name
(as the stdlib and torch do), and pickle anything else by value with cloudpickle, wrapped in
:class:`FnByValue`: the bytes are made once in the parent and unpickled in the child only when
the function is needed. The child needs cloudpickle only to *load* the bytes, and imports it
then; a forked child inherits the callable and gets it by reference.

The rule (:func:`needs_value`, the one place that decides, for ``spawn()``, ``Pool``, the
executor and the joblib backend): builtins, ``functools.partial`` objects and callable objects
go by reference (pickled with tensormp's reducers: arrays they hold stay shared) unless plain
pickle refuses them (:func:`pickles`: the pool's engine asks once tensormp's pickle failed, the
joblib backend at once); a lambda or a local function goes by value; a function or a bound
method's class of ``__main__`` goes by value when a child that re-imports ``__main__`` would not
define it, that is, when its ``def`` or ``class`` line in the main module's source is indented
(under ``if __name__ == "__main__":``). Without source to read (``python -c``, a notebook) a
function goes by value and a method by reference. Workers that may not have the caller's
``__main__`` as it is (the joblib backend's kept pool, Ray's actors) get every function of
``__main__`` by value.
Answers are kept per function and class (weakly).

A function loaded from cloudpickle has globals of its own: a dict holding the values the caller's
module had when it was pickled, one per pickle. Where several functions of the caller's
``__main__`` must see one module (an initializer that sets a global, tasks that read it: a Ray
actor, which cannot import the caller's script), :func:`into_namespace` rebinds a loaded function
to one namespace per process. A global comes in with the first function that names it, with the
caller's value at the time that function was pickled, and from then on belongs to the namespace:
later arrivals add only the names it lacks (as a stdlib worker's ``__mp_main__`` keeps its own
values, whatever the parent does after it started).

This module imports nothing heavy: every spawn child loads it.
"""

from __future__ import annotations

import pickle
import sys
import types
import weakref
from typing import Any

__all__ = [
    "FnByValue",
    "needs_value",
    "pickles",
    "is_array",
    "defined_at_top_level",
    "bound_needs_value",
    "to_value",
    "prepare",
    "into_namespace",
]


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


# -- the rule -----------------------------------------------------------------------------------
def needs_value(fn: Any, *, foreign_workers: bool = False) -> bool:
    """True when a child that re-imports ``__main__`` could not import ``fn`` by name.

    ``foreign_workers``: the workers may not have the caller's ``__main__`` as it is now (the
    joblib backend's pool, kept between calls, may be older than ``fn``; a Ray actor never
    imports the script): every function of ``__main__`` goes by value, and a callable that is
    not a function when plain pickle refuses it (:func:`pickles`, arrays skipped). Otherwise
    a callable that is not a function goes by reference here, and the caller tries
    :func:`pickles` once tensormp's own pickle of it failed.
    """
    if type(fn) is not types.FunctionType:
        if foreign_workers:
            return not pickles(fn, skip_arrays=True)
        if type(fn) is types.MethodType:
            return bound_needs_value(fn)  # by value only when its class cannot be found by name
        # partial, callable object, builtin: by reference (as torch and the stdlib), its object
        # pickled with tensormp's reducers (arrays in it stay shared)
        return False
    if "<" in getattr(fn, "__qualname__", "<"):
        return True  # a lambda or a local function
    if getattr(fn, "__module__", None) != "__main__":
        return False
    if foreign_workers:
        return True
    try:
        top = _main_functions.get(fn)
    except TypeError:
        top = None
    if top is None:
        top = defined_at_top_level(fn)
        try:
            _main_functions[fn] = top
        except TypeError:
            pass
    return not top


_main_functions: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def defined_at_top_level(fn: Any) -> bool:
    """True when a child that re-imports ``__main__`` will find ``fn`` by its name.

    A function of the main module is importable in a spawn child only if its ``def`` runs at
    import time, i.e. is not inside ``if __name__ == "__main__":``. The check is the def's
    indentation: a top-level ``def`` starts at column 0. Anything else goes by value.
    """
    main = sys.modules.get("__main__")
    name = getattr(fn, "__name__", None)
    code = getattr(fn, "__code__", None)
    if name is None or code is None or getattr(main, name, None) is not fn:
        return False
    lines = _main_source(code.co_firstlineno)
    if len(lines) < code.co_firstlineno:
        return False
    line = lines[-1]
    return bool(line.strip()) and not line[:1].isspace()


def _main_source(upto: int) -> list[bytes]:
    """The first ``upto`` lines of the main module's file ([] when it has none, or it cannot
    be read)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            return [line for _, line in zip(range(upto), f)]
    except OSError:
        return []


def bound_needs_value(fn: Any) -> bool:
    """For a bound method of an object whose class belongs to ``__main__``: True when a child
    that re-imports ``__main__`` would not find that class (defined inside a function or under
    ``if __name__ == "__main__":``), so the method must go by value. Found as for functions:
    the ``class`` line above the method's ``def`` starts at column 0 for a top-level class."""
    owner = fn.__self__
    cls = owner if isinstance(owner, type) else type(owner)
    if cls.__module__ != "__main__":
        return False
    try:
        known = _main_classes.get(cls)
    except TypeError:
        known = None
    if known is None:
        known = _main_class_needs_value(cls, fn)
        try:
            _main_classes[cls] = known
        except TypeError:
            pass
    return known


_main_classes: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _main_class_needs_value(cls: type, fn: Any) -> bool:
    name = cls.__name__
    code = getattr(fn.__func__, "__code__", None)
    if "<" in cls.__qualname__ or getattr(sys.modules.get("__main__"), name, None) is not cls:
        return True
    # No source to look at: by reference, as the stdlib.
    lines = _main_source(code.co_firstlineno) if code is not None else []
    head = f"class {name}".encode()
    for line in reversed(lines):
        text = line.lstrip()
        if text.startswith(head) and text[len(head) : len(head) + 1] in (b"(", b":", b" "):
            return line[:1].isspace()
    return False


# -- what plain pickle takes ----------------------------------------------------------------------
class _Null:
    """A file that discards what is written: the probe's sink."""

    def write(self, data: Any) -> int:
        return len(data)


_NULL = _Null()
_SKIP = (int, (0,))  # what the probe writes instead of an array


class _Probe(pickle.Pickler):
    """Plain pickle that skips what tensormp's reducers send (arrays, tensors), so finding what
    plain pickle refuses costs no copy of array bytes."""

    def reducer_override(self, obj: Any) -> Any:
        return _SKIP if is_array(obj) else NotImplemented


def pickles(obj: Any, *, skip_arrays: bool = False) -> bool:
    """Whether plain pickle takes ``obj`` (else it can go only by value, with cloudpickle).

    ``skip_arrays``: arrays and tensors (:func:`is_array`) count as taken without being pickled,
    so the answer costs no copy of their bytes (an object array is then taken on trust: tensormp's
    pickler reports what it holds and plain pickle refuses).
    """
    try:
        if skip_arrays:
            _Probe(_NULL, pickle.HIGHEST_PROTOCOL).dump(obj)
        else:
            pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - whatever plain pickle refuses, cloudpickle may take
        return False
    return True


_array_types: dict[type, bool] = {}  # type -> is_array's answer (bounded: see is_array)


def is_array(obj: Any) -> bool:
    """Whether ``obj`` is an array of a library in the reducer table (``reducers.LIBRARIES``:
    numpy arrays, torch tensors and storages), which tensormp's reducers send as shared memory.
    Answers are kept per type."""
    cls = type(obj)
    known = _array_types.get(cls)
    if known is None:
        from . import reducers  # not at import: a spawn child that sends no arrays needs none

        known = reducers.helpers_for(obj) is not None
        if len(_array_types) >= 256:
            _array_types.clear()
        _array_types[cls] = known
    return known


# -- sending by value ---------------------------------------------------------------------------
def to_value(fn: Any, name: str, refusal: str) -> FnByValue:
    """``fn`` pickled by value with cloudpickle; ``name`` names it in reprs.

    Raises:
        TypeError: cloudpickle is not installed (the message is ``refusal``: what ``fn`` is and
            the fix).
    """
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(refusal) from None
    return FnByValue(cloudpickle.dumps(fn), name)


def prepare(fn: Any, start_method: str) -> Any:
    """``fn`` as a ``spawn()`` rank started with ``start_method`` gets it: itself (by
    reference, or inherited under ``fork``), or a :class:`FnByValue`.

    Raises:
        TypeError: ``fn`` must go by value and cloudpickle is not installed.
    """
    if start_method == "fork" or not needs_value(fn):
        return fn  # under fork: inherited, not pickled
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    return to_value(
        fn,
        f"{module}.{qualname}",
        f"fn={fn!r} is a lambda, a local function or a function defined under "
        f"`if __name__ == \"__main__\":`, which a child started with {start_method!r} cannot "
        "import by name; install cloudpickle (pip install cloudpickle) so tensormp can send "
        "it by value, or define fn at the top level of a module",
    )


# -- one module namespace per process (the Ray engine's workers) -------------------------------
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
