"""Contexts per start method (fork, spawn, forkserver) and the processes they start.

Each tensormp context is the stdlib context of the same start method with tensormp's queues,
pipes, processes and ``Pool`` (``pool/``: arrays as shared memory, dead workers reported)
swapped in; everything else (locks, managers...) is the stdlib's, built on those.

Process arguments
-----------------
* ``spawn``/``forkserver``: the stdlib pickles the ``Process`` object for the child with the
  global pickler while a "spawning popen" is set. tensormp's ``Process.__reduce__`` pickles the
  object's state with tensormp's reducers instead and hands every fd of the message to the
  start method (``popen.duplicate_for_child``), which passes it to the child at exec
  (``spawn``) or over the fork server's socket (``forkserver``). The child rebuilds the arrays
  from those fds. Copies made for non-shared arguments are kept alive by the parent until
  ``start()`` returns; from then on the child holds its own fd and mapping.
* ``fork``: nothing is pickled (stdlib semantics). The child inherits the parent's mappings:
  a shared array stays shared (writes visible both ways); a non-shared array is the usual
  copy-on-write private copy.

The start method
----------------
tensormp has no start-method state of its own: ``tensormp.set_start_method`` and
``tensormp.get_start_method`` *are* the stdlib's default context's (as
``torch.multiprocessing``'s are), and ``tensormp.get_context()`` is tensormp's context of the
method the stdlib's default names. So the two can never disagree: the default is the stdlib's
(``fork`` on Linux up to Python 3.13, ``forkserver`` from 3.14), setting it through either
module sets it for both (a second ``set_start_method`` without ``force=True`` raises
``RuntimeError``, whichever module it goes through), and locks and ``sharedctypes`` objects made
with the stdlib's default context match the processes tensormp starts. Children learn their
parent's method exactly as the stdlib's do: ``spawn``/``forkserver`` children get it in the
stdlib's preparation data, fork children inherit it, and a process of a concrete context
(``get_context("spawn").Process``) forces its own method at bootstrap.

The end of a spawn ``DataLoader`` or pool worker
-----------------------------------------------
A spawn child ends with ``sys.exit``: the interpreter tears down every module, which with torch
loaded takes 0.4 s of CPU per process (1-2 s for a ``DataLoader``'s two workers on a busy
2-core machine), and the ``DataLoader`` joins its workers at the end of every epoch; a
``Pool``'s ``terminate()`` (the end of ``with Pool(...)``) waited 0.25 s for it where the stdlib's
SIGTERM takes 0.01 s. A spawn child whose target is torch's ``DataLoader`` worker loop or
tensormp's pool worker loop (library code, not the user's) ends as a ``fork`` or
``forkserver`` child of the stdlib does: the stdlib's exit steps (``multiprocessing``
finalizers, non-daemon threads joined), then the ``atexit`` handlers, stdout and stderr flushed,
and ``os._exit``. Only the module teardown is skipped, as in such a worker under ``fork``.

Contexts are named as the stdlib's (:class:`ForkContext`, :class:`SpawnContext`,
:class:`ForkServerContext`; their processes ``ForkProcess``...). ``tensormp.SpawnContext`` at
the top level is something else: torch's old name for :class:`tensormp.ProcessContext`.

Children die with their parent (``_parent_death.py``) unless told otherwise: per process
(``die_with_parent=False``) or per context (``get_context(method, die_with_parent=False)``,
a context whose processes default to outliving their parent).
"""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing import context as _mpctx
from typing import Any

from . import _parent_death

__all__ = [
    "Process",
    "ForkProcess",
    "SpawnProcess",
    "ForkServerProcess",
    "ForkContext",
    "SpawnContext",
    "ForkServerContext",
    "DefaultContext",
    "get_context",
]


class _ProcessMixin:
    """Pickles a process's state with tensormp's reducers when a start method needs it, and
    makes the child die with its parent unless ``die_with_parent`` is False."""

    _die_with_parent_default = True  # False in the processes of an outliving context

    def __init__(
        self,
        group: None = None,
        target: Any = None,
        name: str | None = None,
        args: Any = (),
        kwargs: Any = None,
        *,
        daemon: bool | None = None,
        die_with_parent: bool | None = None,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]
            group, target, name, args, {} if kwargs is None else kwargs, daemon=daemon
        )
        if die_with_parent is not None:
            self.die_with_parent = die_with_parent

    @property
    def die_with_parent(self) -> bool:
        """Whether the child is killed (``SIGKILL``) when this process dies (default True;
        False in the processes of ``get_context(method, die_with_parent=False)``). False gives
        the stdlib's behaviour: the child outlives a parent that dies abruptly. Set it before
        ``start()``.

        Raises:
            TypeError: set to something other than a bool.
            ValueError: set after ``start()``.
        """
        value = self.__dict__.get("_tensormp_die_with_parent")
        return self._die_with_parent_default if value is None else bool(value)

    @die_with_parent.setter
    def die_with_parent(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"die_with_parent must be True or False, got {value!r}")
        if getattr(self, "_popen", None) is not None:
            raise ValueError(
                f"{self!r} has already started: set die_with_parent before start()"
            )
        self.__dict__["_tensormp_die_with_parent"] = value

    def __reduce__(self) -> Any:
        popen = _mpctx.get_spawning_popen()
        if popen is None:
            raise TypeError(
                f"{type(self).__name__} objects can only be pickled by a start method while "
                "starting the process; pass the process's target and arguments instead"
            )
        from . import reducers

        msg = reducers.dumps(dict(self.__dict__))
        fds: list[Any] | None = [popen.DupFd(popen.duplicate_for_child(fd)) for fd in msg.fds]
        if not (fds or msg.noted or msg.keepalive or msg.by_value):
            # No array in it (a handle carries an fd or pins a block): the child unpickles it
            # without loading tensormp's reducers, as a stdlib child would (~5 ms of CPU).
            fds = None
        self.__dict__["_tensormp_keepalive"] = msg.keepalive
        self.__dict__["_tensormp_noted"] = msg.noted
        msg.sent()  # the child rebuilds (and later releases) these handles
        settings = _settings()
        state = self.__dict__  # what _parent_death.before_start recorded
        settings.update(
            die_with_parent=state.get("_tensormp_die_with_parent", False),
            method=state.get("_tensormp_method"),
            main_thread=state.get("_tensormp_main_thread", False),
        )
        return _rebuild_process, (type(self), msg.data, fds, os.getpid(), settings)

    def start(self) -> None:
        # tensormp.Process (no method of its own): the default context decides at start().
        method = getattr(self, "_start_method", None) or get_context().get_start_method()
        _parent_death.before_start(self, method)
        try:
            super().start()  # type: ignore[misc]
            noted = self.__dict__.get("_tensormp_noted")
            if noted:
                # We know who holds these handles: the child. If it dies before releasing
                # them (even during start-up), our liveness check frees them.
                from .memory.allocator import register_holder

                register_holder(self.pid, noted)  # type: ignore[attr-defined]
        finally:
            self.__dict__.pop("_tensormp_keepalive", None)
            self.__dict__.pop("_tensormp_noted", None)

    def _bootstrap(self, parent_sentinel: Any = None) -> Any:
        # In the child: die with the parent (PR_SET_PDEATHSIG + a watchdog; see _parent_death.py).
        _parent_death.at_bootstrap(self, parent_sentinel)
        try:
            code = super()._bootstrap(parent_sentinel)  # type: ignore[misc]
        finally:
            # The child ends with os._exit (no garbage collection): hand back what it received.
            allocator = sys.modules.get("tensormp.memory.allocator")
            if allocator is not None:
                allocator.process_exiting()
        if self.__dict__.get("_tensormp_method") == "spawn" and _is_library_worker(self):
            _exit_as_forked(code)
        return code


def _is_library_worker(process: Any) -> bool:
    """Whether ``process`` runs torch's ``DataLoader`` worker loop or tensormp's pool worker
    loop (imports neither)."""
    target = getattr(process, "_target", None)
    if target is None:
        return False
    for module, name in (("torch.utils.data._utils.worker", "_worker_loop"),
                         ("tensormp.pool.worker", "_worker_main")):
        loop = getattr(sys.modules.get(module), name, None)
        if loop is not None and target is loop:
            return True
    return False


def _exit_as_forked(code: int) -> None:
    """End a spawn ``DataLoader`` or pool worker as a forked one ends (see the module notes)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _no_other_keywords(kind: str, unknown: dict[str, Any]) -> None:
    """The stdlib's TypeError for an unexpected keyword, with faster-fifo's named: code moved
    from ``faster_fifo.Queue(max_size_bytes=..., maxsize=...)`` meets it first."""
    if not unknown:
        return
    name = next(iter(unknown))
    if name == "max_size_bytes":
        raise TypeError(
            f"{kind}() has no max_size_bytes (faster-fifo's byte size of its ring buffer): a "
            "tensormp queue has no fixed buffer (arrays travel as shared-memory handles, other "
            f"objects as records of any size); drop it, and bound the items with {kind}(maxsize=N)"
        )
    raise TypeError(f"{kind}() got an unexpected keyword argument {name!r}")


def _settings() -> dict[str, Any]:
    """What a child inherits from its parent besides its arguments: the sharing strategy (torch
    drops it under spawn and forkserver) and the program it belongs to (``file_system``)."""
    from . import strategies

    return {"strategy": strategies.get_sharing_strategy(), "program": strategies.program()}


def _apply_settings(settings: dict[str, Any]) -> None:
    from . import strategies

    strategies.set_sharing_strategy(settings["strategy"])
    strategies.set_program(settings["program"])


def _rebuild_process(
    cls: type, data: bytes, fds: list[Any] | None, parent_pid: int, settings: dict[str, Any]
) -> Any:
    _parent_death.before_arguments(settings, parent_pid)
    _apply_settings(settings)
    if fds is None:  # no handle in the state (see __reduce__)
        state = pickle.loads(data)
        _load_array_support()
    else:
        from . import reducers

        # Handles to the parent's own blocks are registered by the parent at start(): no hold
        # records for those (reducers.numpy reads parent_pid); others are announced at once.
        reducers.process_args_parent(parent_pid)
        try:
            state = reducers.loads(data, [fd.detach() for fd in fds])
        finally:
            reducers.process_args_parent(0)
        reducers.flush_release_records()
    obj: Any = object.__new__(cls)
    obj.__dict__.update(state)
    return obj


_ARRAY_LIBRARIES = ("numpy", "torch")  # the modules of reducers.LIBRARIES (tests/test_layout.py)


def _load_array_support() -> None:
    """As ``reducers.loads`` after unpickling: an array library the arguments imported (a
    DataLoader worker's dataset class imports torch) gets tensormp's support before the target
    runs (its first batch), not on its first message."""
    modules = sys.modules
    if any(name in modules for name in _ARRAY_LIBRARIES):
        from .reducers import LIBRARIES

        for lib in LIBRARIES:
            if lib.module in modules:
                __import__(lib.reducers)


class ForkProcess(_ProcessMixin, _mpctx.ForkProcess):
    """``multiprocessing.context.ForkProcess`` with tensormp transfer."""


class SpawnProcess(_ProcessMixin, _mpctx.SpawnProcess):
    """``multiprocessing.context.SpawnProcess`` with tensormp transfer."""


class ForkServerProcess(_ProcessMixin, _mpctx.ForkServerProcess):
    """``multiprocessing.context.ForkServerProcess`` with tensormp transfer."""


class Process(_ProcessMixin, _mpctx.Process):
    """``multiprocessing.Process`` using tensormp's default start method and transfer.

    Arguments that are numpy arrays reach the child as shared memory under ``spawn`` and
    ``forkserver`` (see the module notes for ``fork``).
    """

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _default_context.get_context().Process._Popen(process_obj)

    @staticmethod
    def _after_fork() -> Any:
        return _default_context.get_context().Process._after_fork()


class _ContextMixin:
    """tensormp's processes, queues and pipes on top of a stdlib context."""

    _die_with_parent = True

    def get_context(self, method: str | None = None) -> Any:
        """This context (``method=None``), or tensormp's context for ``method`` (the stdlib's
        concrete contexts return the stdlib's)."""
        if method is None:
            return self
        return _lookup(method, self._die_with_parent)

    def Queue(self, maxsize: int = 0, **unknown: Any) -> Any:
        """A :class:`tensormp.queues.Queue` (arrays travel as shared memory).

        Raises:
            TypeError: a keyword other than ``maxsize`` (faster-fifo's ``max_size_bytes``
                named, with what to do instead).
        """
        from .queues import Queue

        _no_other_keywords("Queue", unknown)
        return Queue(maxsize, ctx=self.get_context())

    def JoinableQueue(self, maxsize: int = 0, **unknown: Any) -> Any:
        """A :class:`tensormp.queues.JoinableQueue` (arrays travel as shared memory).

        Raises:
            TypeError: as :meth:`Queue`.
        """
        from .queues import JoinableQueue

        _no_other_keywords("JoinableQueue", unknown)
        return JoinableQueue(maxsize, ctx=self.get_context())

    def SimpleQueue(self) -> Any:
        """A :class:`tensormp.queues.SimpleQueue` (arrays travel as shared memory)."""
        from .queues import SimpleQueue

        return SimpleQueue(ctx=self.get_context())

    def Pipe(self, duplex: bool = True) -> Any:
        """Two :class:`tensormp.connection.Connection` ends (Unix sockets that carry fds)."""
        from .connection import Pipe

        return Pipe(duplex)

    def Pool(
        self,
        processes: int | None = None,
        initializer: Any = None,
        initargs: Any = (),
        maxtasksperchild: int | None = None,
        **engine: Any,
    ) -> Any:
        """A :class:`tensormp.pool.Pool` of this context's start method (arrays travel as
        shared memory; a dead worker fails its task instead of hanging the pool). Keywords
        ``engine``, ``address``, ``ray_remote_args``: as :class:`tensormp.pool.Pool`."""
        from .pool import Pool

        return Pool(
            processes, initializer, initargs, maxtasksperchild,
            context=self.get_context(),
            **engine,
        )


class ForkContext(_ContextMixin, _mpctx.ForkContext):
    """``multiprocessing.context.ForkContext`` with tensormp's processes, queues, pipes and Pool."""

    Process = ForkProcess


class SpawnContext(_ContextMixin, _mpctx.SpawnContext):
    """``multiprocessing.context.SpawnContext`` with tensormp's processes, queues, pipes and
    Pool (not ``tensormp.SpawnContext``, torch's old name for ``ProcessContext``)."""

    Process = SpawnProcess


class ForkServerContext(_ContextMixin, _mpctx.ForkServerContext):
    """``multiprocessing.context.ForkServerContext`` with tensormp's processes, queues, pipes
    and Pool."""

    Process = ForkServerProcess


class _OutlivingForkProcess(ForkProcess):
    """A :class:`ForkProcess` that outlives its parent unless told otherwise."""

    _die_with_parent_default = False


class _OutlivingSpawnProcess(SpawnProcess):
    """A :class:`SpawnProcess` that outlives its parent unless told otherwise."""

    _die_with_parent_default = False


class _OutlivingForkServerProcess(ForkServerProcess):
    """A :class:`ForkServerProcess` that outlives its parent unless told otherwise."""

    _die_with_parent_default = False


class _OutlivingForkContext(ForkContext):
    Process = _OutlivingForkProcess
    _die_with_parent = False


class _OutlivingSpawnContext(SpawnContext):
    Process = _OutlivingSpawnProcess
    _die_with_parent = False


class _OutlivingForkServerContext(ForkServerContext):
    Process = _OutlivingForkServerProcess
    _die_with_parent = False


# (method, die_with_parent) -> the one context of that kind, as the stdlib's are singletons.
_concrete_contexts: dict[tuple[str, bool], Any] = {
    ("fork", True): ForkContext(),
    ("spawn", True): SpawnContext(),
    ("forkserver", True): ForkServerContext(),
    ("fork", False): _OutlivingForkContext(),
    ("spawn", False): _OutlivingSpawnContext(),
    ("forkserver", False): _OutlivingForkServerContext(),
}
_stdlib_default = _mpctx._default_context


_checked: dict[tuple[str, bool], Any] = {}  # contexts found available, for the fast path


def _lookup(method: str, die_with_parent: bool) -> Any:
    """The context of ``method``; checked once (as the stdlib's ``get_context`` checks each time).

    Raises:
        ValueError: unknown or unavailable start method.
        TypeError: ``die_with_parent`` is not a bool.
    """
    if die_with_parent is True or die_with_parent is False:
        ctx = _checked.get((method, die_with_parent)) if isinstance(method, str) else None
        if ctx is not None:
            return ctx
    else:
        raise TypeError(f"die_with_parent must be True or False, got {die_with_parent!r}")
    try:
        ctx = _concrete_contexts[method, die_with_parent]
    except (KeyError, TypeError):
        raise ValueError(
            f"cannot find context for {method!r}; choose one of "
            f"{_stdlib_default.get_all_start_methods()}"
        ) from None
    ctx._check_available()
    _checked[method, die_with_parent] = ctx
    return ctx


class DefaultContext(_ContextMixin, _mpctx.DefaultContext):
    """tensormp's module-level context. Its start method is the stdlib's default context's, read
    and set there (see the module notes): the two never disagree."""

    Process = Process

    def __init__(self) -> None:
        super().__init__(_stdlib_default)  # unused: get_context() asks the stdlib's default

    def get_context(self, method: str | None = None, *, die_with_parent: bool = True) -> Any:
        if method is None:
            actual = _stdlib_default._actual_context  # type: ignore[attr-defined]  # not in typeshed
            method = actual._name if actual is not None else _stdlib_default.get_start_method()
        return _lookup(method, die_with_parent)

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        _stdlib_default.set_start_method(method, force)

    # typeshed types DefaultContext.get_start_method as returning str, BaseContext's as
    # overloads with str | None for allow_none=True: no signature satisfies both.
    def get_start_method(self, allow_none: bool = False) -> str | None:  # type: ignore[override]
        return _stdlib_default.get_start_method(allow_none)

    def get_all_start_methods(self) -> list[str]:
        return _stdlib_default.get_all_start_methods()


_default_context = DefaultContext()


def get_context(method: str | None = None, *, die_with_parent: bool = True) -> Any:
    """The tensormp context for ``method`` (``"fork"``, ``"spawn"``, ``"forkserver"``; None:
    the default start method), as ``multiprocessing.get_context``.

    Args:
        method: the start method.
        die_with_parent: False gives a context whose processes outlive their parent (the
            stdlib's behaviour); each process can still override it.

    Raises:
        ValueError: unknown or unavailable start method.
        TypeError: ``die_with_parent`` is not a bool.
    """
    return _default_context.get_context(method, die_with_parent=die_with_parent)
