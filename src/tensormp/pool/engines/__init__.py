"""Pool engines: what runs the tasks of :class:`tensormp.Pool` and
``tensormp.ProcessPoolExecutor``.

The front ends (``pool/pool.py``, ``futures.py``) own the API: argument checks, chunking,
result objects and futures, callbacks, ``progress=``, the ``imap`` feeder thread, and the error
types. An *engine* owns the workers and runs the front ends' tasks on them; the front ends use
nothing of it but :class:`Engine`. Engines:

* ``local`` (``local.py``): worker processes of this machine, one Unix socket each; arrays in
  arguments and results cross as shared memory (the design note is ``pool/__init__.py``'s).
* ``ray`` (``ray.py``): workers are Ray actors on a Ray cluster; arrays travel through Ray's
  object store.

Another engine (Dask, say) is one module with a class ``Engine`` built as
``Engine(config, **options)`` and a tuple ``OPTIONS`` of the option names it takes, made known
with :func:`register_engine`. What it gets and what it must do (tasks, results, errors,
threads, the end), and the parts it builds on, all importable from here (:class:`QueueEngine`,
:func:`run_task`...): ``docs/engines.md``. ``tests/test_engines.py`` is such an engine.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ..runner import format_exception, load_fn, run_task, unwrap, wrap
from .base import CLOSE, RUN, TERMINATE, EngineConfig, QueueEngine, describe_task

if TYPE_CHECKING:
    from ..errors import BrokenPoolError
    from ..tasks import _Task

__all__ = [
    "register_engine",
    "names",
    "create",
    "Engine",
    "EngineConfig",
    "QueueEngine",
    "RUN",
    "CLOSE",
    "TERMINATE",
    "describe_task",
    "run_task",
    "load_fn",
    "wrap",
    "unwrap",
    "format_exception",
]

# engine name -> the module that defines it (a name: imported on first use)
_ENGINES: dict[str, str | types.ModuleType] = {
    "local": "tensormp.pool.engines.local",
    "ray": "tensormp.pool.engines.ray",
}
_BUILTIN = frozenset(_ENGINES)


def register_engine(name: str, module: str | types.ModuleType) -> None:
    """Make ``Pool(engine=name)`` and ``ProcessPoolExecutor(engine=name)`` run on the engine
    that ``module`` defines: its class ``Engine``, built as ``Engine(config, **options)``, and
    its tuple ``OPTIONS`` of the option names it takes (``docs/engines.md``). A module name is
    imported when a pool first uses the engine. Registering a name again with the same module
    does nothing.

    Raises:
        TypeError: ``name`` is not a str, or ``module`` is neither a module nor its name.
        ValueError: ``name`` is empty, is ``"local"`` or ``"ray"``, or names another module
            already.
    """
    if not isinstance(name, str):
        raise TypeError(f"register_engine: name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError("register_engine: name must not be empty")
    if not isinstance(module, (str, types.ModuleType)):
        raise TypeError(
            "register_engine: module must be a module or its dotted name (\"mypkg.dask_engine\"), "
            f"got {type(module).__name__}"
        )
    if name in _BUILTIN:
        raise ValueError(f"register_engine: {name!r} is tensormp's own engine; choose another name")
    known = _ENGINES.get(name)
    if known is not None and _module_name(known) != _module_name(module):
        raise ValueError(
            f"register_engine: engine {name!r} is {_module_name(known)!r} already, not "
            f"{_module_name(module)!r}; choose another name"
        )
    _ENGINES[name] = module


def _module_name(module: str | types.ModuleType) -> str:
    return module if isinstance(module, str) else module.__name__


def _module(name: str) -> Any:
    module = _ENGINES[name]
    return importlib.import_module(module) if isinstance(module, str) else module


class Engine(Protocol):
    """The interface the front ends use (``docs/engines.md`` says what each part must do)."""

    owner: str
    processes: int

    @property
    def state(self) -> str: ...
    @property
    def is_broken(self) -> bool: ...
    def broken(self) -> BrokenPoolError: ...
    def broken_error(self, msg: str) -> BrokenPoolError: ...
    def check_running(self) -> None: ...
    def submit(self, tasks: list[_Task], *, feeder: bool = False) -> None: ...
    def feeder_started(self) -> None: ...
    def feeder_done(self) -> None: ...
    def wait_room(self) -> int: ...
    def take_pending(self) -> list[_Task]: ...
    def close(self) -> None: ...
    def terminate(self) -> None: ...
    def join(self) -> None: ...
    def describe(self) -> str: ...
    def worker_processes(self) -> list[Any]: ...


def names() -> list[str]:
    """The engine names ``Pool(engine=...)`` accepts."""
    return list(_ENGINES)


def create(name: Any, config: EngineConfig, options: dict[str, Any]) -> Engine:
    """Start an engine's workers.

    Raises:
        ValueError: unknown engine name, or an option the engine does not take.
        ImportError: the engine's library is not installed (the message names the extra).
    """
    if not isinstance(name, str) or name not in _ENGINES:
        raise ValueError(
            f"{config.owner}: unknown engine={name!r}; choose one of {', '.join(map(repr, _ENGINES))}"
        )
    mod = _module(name)
    given = {k: v for k, v in options.items() if v is not None}
    for key in given:
        if key not in mod.OPTIONS:
            takes = [n for n in _ENGINES if key in _options_of(n)]
            if takes:
                raise ValueError(
                    f"{config.owner}: {key}= is an option of "
                    f"engine={' or '.join(map(repr, takes))}, not of engine={name!r}"
                )
            raise ValueError(
                f"{config.owner}: engine={name!r} has no option {key}= (its options: "
                f"{', '.join(mod.OPTIONS) or 'none'})"
            )
    factory: Callable[..., Engine] = mod.Engine
    return factory(config, **given)


def _options_of(name: str) -> tuple[str, ...]:
    # Read without importing the engine's library (the module imports it lazily).
    return tuple(_module(name).OPTIONS)
