"""Pool engines: what runs the tasks of :class:`tensormp.Pool` and
``tensormp.ProcessPoolExecutor``.

The front ends (``pool/pool.py``, ``futures.py``) own the API: argument checks, chunking,
result objects and futures, callbacks, ``progress=``, the ``imap`` feeder thread, and the error
types. An *engine* owns the workers and runs :class:`~tensormp.pool.tasks._Task` objects on
them. The front ends use nothing of an engine but the interface below (:class:`Engine`).

The engine interface
--------------------
An engine is made by ``create(name, config, options)`` from an :class:`EngineConfig` (what every
engine needs) and a dict of engine-specific options: the front ends' ``address=`` and
``ray_remote_args=`` (Ray's), and whatever their ``engine_options=`` holds. Its workers exist once the constructor returns (or it raised: then nothing is left
running).

* **Tasks.** ``submit(tasks)`` queues :class:`_Task` objects (one call or one map chunk each:
  ``fn`` a :class:`~tensormp.pool.tasks._Fn`, ``kind`` one of ``worker._CALL``, ``_MAP``,
  ``_STARMAP``, ``args``). The engine calls ``task.start()`` (when set) once, just before a
  worker gets the task; False means the future was cancelled: drop the task. It calls
  ``task.sink(ok, value)`` exactly once per task that was not dropped: ``(True, result)``, or
  ``(False, exception)`` where the exception is what the function raised (``__cause__``: a
  ``multiprocessing.pool.RemoteTraceback``), ``config.lost_error`` when the worker died while
  running it, or ``config.broken_error`` when the engine broke or was terminated first. Sinks
  run in an engine thread, one at a time; they may call ``terminate()``.
* **Flow control.** ``feeder_started()`` / ``feeder_done()`` bracket an ``imap`` feeder thread
  (a closing engine waits for feeders); ``wait_room()`` blocks a feeder while many tasks are
  queued and returns how many it may queue now (0: terminated); ``take_pending()`` removes
  and returns the tasks no worker has yet (``shutdown(cancel_futures=True)``).
* **State.** ``state`` is ``RUN``, ``CLOSE`` (no new tasks; workers exit once the queued ones
  are done) or ``TERMINATE``; ``close()``, ``terminate()`` (stop now; unfinished tasks fail
  with ``broken_error``; waits unless called from a sink) and ``join()`` move it.
  ``check_running()`` raises what a new call should see (``broken_error`` when broken,
  ``ValueError`` when closed); ``is_broken`` and ``broken()`` (the error to raise) tell a broken
  engine apart; ``broken_error(msg)`` makes the front end's error for the engine's type.
* **Introspection.** ``processes``: the number of workers; ``describe()`` for reprs (``start_method=spawn pids=[...]``),
  ``worker_processes()`` for ``Pool._pool``.
* **Death.** A worker that dies fails only the task it was running, with ``config.lost_error``
  naming the worker (pid, node where there are several), how it died and the task; the engine
  replaces it. A worker that dies before it ran its initializer's first task (the initializer
  raised, it could not start) breaks the engine.

:class:`~tensormp.pool.engines.base.QueueEngine` implements the queue, state and flow control
once; an engine subclasses it and writes its manager thread (``_step``, ``_shutdown``) and
``_wake_locked``. Engines:

* ``local`` (``local.py``): worker processes of this machine, one Unix socket each; arrays in
  arguments and results cross as shared memory (see ``pool/__init__.py``).
* ``ray`` (``ray.py``): workers are Ray actors on a Ray cluster; arrays travel through Ray's
  object store.

Another engine (Dask, say) is one new module here with a class ``Engine`` built as
``Engine(config, **options)`` and a tuple ``OPTIONS`` of the option names it takes, plus one
entry in ``_ENGINES`` (``tests/test_engines.py`` plugs in a third engine that way). An engine module imports its library only when ``Engine`` is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..errors import BrokenPoolError, WorkerLostError
    from ..tasks import _Task

# engine name -> the module that defines it (imported on first use)
_ENGINES: dict[str, str] = {
    "local": "tensormp.pool.engines.local",
    "ray": "tensormp.pool.engines.ray",
}


def _module(name: str) -> Any:
    return importlib.import_module(_ENGINES[name])


@dataclass(frozen=True)
class EngineConfig:
    """What every engine gets from the front end.

    Attributes:
        processes: number of workers (>= 1); None: the engine's default (the CPUs of this
            machine, or of the cluster). Read the engine's ``processes`` for the number.
        initializer: the initializer as it travels (a callable or a ``_child.FnByValue``), or
            None.
        initargs: its arguments.
        maxtasks: tasks a worker runs before it is replaced (None: no limit).
        owner: the front end's name for messages (``"tensormp.Pool"``).
        lost_error: the exception type of a task whose worker died.
        broken_error: the exception type of a broken or terminated engine.
        ctx: the start-method context (the local engine's; others ignore it).
    """

    processes: int | None
    initializer: Any
    initargs: tuple[Any, ...]
    maxtasks: int | None
    owner: str
    lost_error: type[WorkerLostError]
    broken_error: type[BrokenPoolError]
    ctx: Any = field(default=None)


class Engine(Protocol):
    """The interface the front ends use (see the module notes)."""

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
    module = _ENGINES.get(name) if isinstance(name, str) else None
    if module is None:
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
