"""One task run in a worker, for every engine: :func:`run_task` loads the task's callable (by
reference, or a ``_by_value.FnByValue`` unpickled once per worker), calls it as the task's kind
says, and returns the outcome in the form every engine sends back to the parent.

``(True, value, seconds)``: the call returned. ``(False, error, seconds)``: it raised an
``Exception``; ``error`` is wrapped for the trip (``multiprocessing.pool``'s
``ExceptionWithTraceback``): pickled and loaded it is the exception again, with the worker's
traceback as a ``RemoteTraceback`` in ``__cause__``, as the stdlib's pool gives it; an engine
that does not pickle it (the worker is in this process) passes it through :func:`unwrap`.
``(None, exc, seconds)``: it raised a ``BaseException`` that ends a worker (``SystemExit``,
``KeyboardInterrupt``): the worker reports ``format_exception(exc)`` and ends (the local worker
re-raises ``exc``), and the parent fails the task with its engine's ``lost_error``.

This module imports nothing heavy: every local worker loads it.
"""

from __future__ import annotations

import types
from time import perf_counter
from typing import Any

from .._by_value import FnByValue, into_namespace
from .tasks import _CALL, _MAP

__all__ = ["run_task", "load_fn", "wrap", "unwrap", "format_exception"]

_FN_CACHE = 16  # functions sent by value that a worker keeps unpickled
_cache: dict[bytes, Any] = {}  # this process's, for callers that keep none of their own


def load_fn(fn: Any, cache: dict[bytes, Any] | None = None, main: dict[str, Any] | None = None) -> Any:
    """The callable of a task: ``fn`` itself, or a :class:`FnByValue` loaded. A function sent
    by value is loaded once per ``cache`` (this process's when None; its globals then live on
    between calls, as a module's do in a stdlib worker); any other callable sent by value is
    loaded afresh for each task. ``main``: the namespace that functions of the caller's
    ``__main__`` share in this worker (``_by_value.into_namespace``), where the worker has no
    ``__mp_main__`` of its own (a Ray actor)."""
    if not isinstance(fn, FnByValue):
        return fn
    if cache is None:
        cache = _cache
    loaded = cache.get(fn.data)
    if loaded is None:
        loaded = fn.load()
        if type(loaded) is types.FunctionType:
            if main is not None and loaded.__module__ == "__main__":
                loaded = into_namespace(loaded, main)
            if len(cache) >= _FN_CACHE:
                cache.pop(next(iter(cache)))
            cache[fn.data] = loaded
    return loaded


def run_task(
    fn: Any,
    kind: int,
    args: Any,
    cache: dict[bytes, Any] | None = None,
    main: dict[str, Any] | None = None,
) -> tuple[bool | None, Any, float]:
    """Run one task: ``fn`` (``task.fn.wire``), ``kind`` and ``args`` as the parent's
    ``_Task`` holds them; ``cache`` and ``main`` as :func:`load_fn`. Returns ``(ok, value,
    seconds)`` as the module notes say; raises nothing."""
    t0 = perf_counter()
    try:
        f = fn if type(fn) is not FnByValue else load_fn(fn, cache, main)
        if kind == _CALL:
            value = f(*args[0], **args[1])
        elif kind == _MAP:
            value = [f(x) for x in args]
        else:
            value = [f(*x) for x in args]
    except Exception as e:
        return False, wrap(e), perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - SystemExit...: the caller ends the worker
        return None, e, perf_counter() - t0
    return True, value, perf_counter() - t0


def wrap(exc: BaseException) -> Any:
    """``exc`` with its traceback, for the trip to the parent (see the module notes)."""
    from multiprocessing.pool import ExceptionWithTraceback  # type: ignore[attr-defined]  # no stub

    return ExceptionWithTraceback(exc, exc.__traceback__)


def unwrap(wrapped: Any) -> BaseException:
    """What :func:`wrap` gives, as it arrives after a pickle: the exception, with a
    ``RemoteTraceback`` of the worker's traceback as ``__cause__``."""
    rebuild, args = wrapped.__reduce__()
    error: BaseException = rebuild(*args)
    return error


def format_exception(exc: BaseException) -> str:
    """``exc``'s traceback as text (what a worker ended by ``exc`` reports)."""
    import traceback

    try:
        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # noqa: BLE001 - a broken __str__ must not lose the report
        return f"{type(exc).__name__}\n"
