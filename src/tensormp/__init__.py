"""tensormp: ``multiprocessing`` whose queues, pipes, pools and processes move arrays
through shared memory instead of pickling their bytes.

``import tensormp as mp`` replaces ``import multiprocessing``: every name of
``multiprocessing.__all__`` is here and behaves as the stdlib's, except that numpy arrays (and,
with torch installed, tensors) travel as small handles to shared memory. See the README.

Pickle is a trusted channel, as in the stdlib: never receive from a process you do not trust.
"""

from __future__ import annotations

import sys

if not sys.platform.startswith("linux"):  # pragma: no cover - platform gate
    if sys.platform == "win32":
        raise ImportError(
            "tensormp needs Linux (it passes file descriptors over Unix sockets and uses "
            "memfd_create); Windows is not supported. Use WSL2, or the stdlib multiprocessing."
        )

import multiprocessing as _mp
from types import ModuleType as _ModuleType
from typing import TYPE_CHECKING
from typing import Any as _Any

from .errors import FdLimitError, HandleError, SharedMemoryError, TensormpError

if TYPE_CHECKING:  # what the lazy names below are, for type checkers
    from .arrays import (
        empty,
        empty_like,
        full,
        full_like,
        is_shared,
        ones,
        ones_like,
        share,
        zeros,
        zeros_like,
    )
    from .connection import Connection
    from .context import get_context
    from .futures import BrokenExecutorError, ProcessPoolExecutor, TerminatedWorkerError
    from .memory import empty_cache, get_cache_limit, memory_stats, set_cache_limit
    from .pool import BrokenPoolError, WorkerLostError
    from .spawn import (
        ProcessContext,
        ProcessException,
        ProcessExitedException,
        ProcessFailure,
        ProcessRaisedException,
        ProcessTimeoutError,
        SpawnBootstrapError,
        SpawnContext,
        spawn,
        start_processes,
    )
    from .strategies import (
        get_all_sharing_strategies,
        get_sharing_strategy,
        set_sharing_strategy,
    )

_STDLIB_NAMES = [name for name in _mp.__all__ if name != "get_context"]
# The stdlib's submodules that tensormp has no module of its own for, as attributes (``from
# tensormp import shared_memory``; ``import tensormp.managers`` is not supported).
_STDLIB_MODULES = frozenset(
    {"shared_memory", "managers", "dummy", "sharedctypes", "heap", "resource_tracker", "util"}
)

# Every name but the base exceptions (errors.py) is loaded on first use (PEP 562), so that a
# child imports only what it uses: a spawn child re-imports the main module, and so tensormp,
# before it runs anything. A Process child loads tensormp.context (its Process class) and
# nothing of tensormp's Connection (and the stdlib's multiprocessing.connection, tempfile,
# shutil...), of numpy (~130 ms), of the pools, of spawn()'s parent side (a rank loads
# _spawn_rank alone). The stdlib names (Process, Queue, Pool...) are the default context's, as
# in multiprocessing.
_LAZY = {
    "spawn": "spawn", "start_processes": "spawn", "ProcessContext": "spawn",
    "SpawnContext": "spawn", "ProcessException": "spawn", "ProcessRaisedException": "spawn",
    "ProcessExitedException": "spawn", "ProcessTimeoutError": "spawn", "ProcessFailure": "spawn",
    "SpawnBootstrapError": "spawn",
    "get_context": "context", "Connection": "connection",
    "get_all_sharing_strategies": "strategies", "get_sharing_strategy": "strategies",
    "set_sharing_strategy": "strategies",
    # Names that need numpy: a child that never touches an array does not import it.
    "share": "arrays", "is_shared": "arrays", "empty": "arrays", "zeros": "arrays",
    "ones": "arrays", "full": "arrays", "empty_like": "arrays", "zeros_like": "arrays",
    "ones_like": "arrays", "full_like": "arrays",
    "memory_stats": "memory", "empty_cache": "memory", "set_cache_limit": "memory",
    "get_cache_limit": "memory",
    # Pool itself is the default context's (a stdlib name); these load tensormp.pool / futures.
    "WorkerLostError": "pool", "BrokenPoolError": "pool",
    "ProcessPoolExecutor": "futures", "TerminatedWorkerError": "futures",
    "BrokenExecutorError": "futures",
}


def _version() -> str:
    """The installed distribution's version (importlib.metadata costs ~10-70 ms to import, so
    ``tensormp.__version__`` is resolved on first use, not at ``import tensormp``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tensormp")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


def __getattr__(name: str) -> _Any:
    if name == "__version__":
        version = globals()["__version__"] = _version()
        return version
    value: _Any
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    elif name in _STDLIB_NAMES:
        from .context import _default_context

        value = getattr(_default_context, name)
    elif name in _STDLIB_MODULES:  # ``from tensormp import shared_memory``: the stdlib's module
        import importlib

        value = importlib.import_module(f"multiprocessing.{name}")
    else:
        raise AttributeError(f"module 'tensormp' has no attribute {name!r}")
    globals()[name] = value
    return value


class _Package(_ModuleType):
    """tensormp's module object. The import system binds a submodule as an attribute of its
    package when it first loads it (``setattr``): after ``import tensormp.spawn`` (a pickle of a
    spawn exception does it too), ``tensormp.spawn`` would be the module, not the function. The
    public name wins over the submodule of the same name."""

    def __setattr__(self, name: str, value: _Any) -> None:
        if isinstance(value, _ModuleType) and name in _SHADOWED:
            value = getattr(value, name)
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple[_Any, ...]:
        # By name, as cloudpickle pickles a module (its table knows the exact ModuleType only):
        # a function pickled by value that uses ``tensormp.`` refers to the package so.
        import importlib

        return importlib.import_module, (self.__name__,)


_SHADOWED = frozenset(name for name, module in _LAZY.items() if name == module)
sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_STDLIB_NAMES) | {"__version__"})


__all__ = [  # noqa: PLE0604 - the stdlib names are added below
    "get_context",
    "share", "is_shared", "empty", "zeros", "ones", "full",
    "empty_like", "zeros_like", "ones_like", "full_like",
    "get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy",
    "memory_stats", "empty_cache", "set_cache_limit", "get_cache_limit",
    "Connection", "TensormpError", "SharedMemoryError", "HandleError", "FdLimitError",
    "spawn", "start_processes", "ProcessContext", "SpawnContext", "ProcessException",
    "ProcessRaisedException", "ProcessExitedException", "ProcessTimeoutError",
    "ProcessFailure", "SpawnBootstrapError",
    "WorkerLostError", "BrokenPoolError", "ProcessPoolExecutor", "TerminatedWorkerError",
    "BrokenExecutorError",
]
__all__ += _STDLIB_NAMES
