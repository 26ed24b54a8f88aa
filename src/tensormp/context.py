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
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from multiprocessing import context as _mpctx
from typing import Any

from . import _child, reducers

__all__ = ["Process", "DefaultContext", "get_context"]


class _ProcessMixin:
    """Pickles a process's state with tensormp's reducers when a start method needs it."""

    def __reduce__(self) -> Any:
        popen = _mpctx.get_spawning_popen()
        if popen is None:
            raise TypeError(
                f"{type(self).__name__} objects can only be pickled by a start method while "
                "starting the process; pass the process's target and arguments instead"
            )
        msg = reducers.dumps(dict(self.__dict__))
        fds = [popen.DupFd(popen.duplicate_for_child(fd)) for fd in msg.fds]
        self.__dict__["_tensormp_keepalive"] = msg.keepalive
        self.__dict__["_tensormp_noted"] = msg.noted
        msg.sent()  # the child rebuilds (and later releases) these handles
        return _rebuild_process, (type(self), msg.data, fds, os.getpid(), _settings())

    def start(self) -> None:
        _child.before_start(self)
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
        # In the child: die with the parent (PR_SET_PDEATHSIG + a watchdog; see _child.py).
        _child.at_bootstrap(self, parent_sentinel)
        try:
            return super()._bootstrap(parent_sentinel)  # type: ignore[misc]
        finally:
            # The child ends with os._exit (no garbage collection): hand back what it received.
            allocator = sys.modules.get("tensormp.memory.allocator")
            if allocator is not None:
                allocator.process_exiting()


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
    cls: type, data: bytes, fds: list[Any], parent_pid: int = 0, settings: Any = None
) -> Any:
    if settings is not None:
        _apply_settings(settings)
    # Handles to the parent's own blocks are registered by the parent at start(): no hold
    # records for those (reducers.numpy reads parent_pid); others are announced at once.
    reducers.process_args_parent(parent_pid)
    try:
        state = reducers.loads(data, [fd.detach() for fd in fds])
    finally:
        reducers.process_args_parent(0)
    reducers.flush_release_records()
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    return obj


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
    """tensormp's queues and pipes on top of a stdlib context."""

    def Queue(self, maxsize: int = 0) -> Any:
        """A :class:`tensormp.queues.Queue` (arrays travel as shared memory)."""
        from .queues import Queue

        return Queue(maxsize, ctx=self.get_context())  # type: ignore[attr-defined]

    def JoinableQueue(self, maxsize: int = 0) -> Any:
        """A :class:`tensormp.queues.JoinableQueue` (arrays travel as shared memory)."""
        from .queues import JoinableQueue

        return JoinableQueue(maxsize, ctx=self.get_context())  # type: ignore[attr-defined]

    def SimpleQueue(self) -> Any:
        """A :class:`tensormp.queues.SimpleQueue` (arrays travel as shared memory)."""
        from .queues import SimpleQueue

        return SimpleQueue(ctx=self.get_context())  # type: ignore[attr-defined]

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
            context=self.get_context(),  # type: ignore[attr-defined]
            **engine,
        )


class _ForkContext(_ContextMixin, _mpctx.ForkContext):
    Process = ForkProcess


class _SpawnContext(_ContextMixin, _mpctx.SpawnContext):
    Process = SpawnProcess


class _ForkServerContext(_ContextMixin, _mpctx.ForkServerContext):
    Process = ForkServerProcess


_concrete_contexts: dict[str, Any] = {
    "fork": _ForkContext(),
    "spawn": _SpawnContext(),
    "forkserver": _ForkServerContext(),
}


class DefaultContext(_ContextMixin, _mpctx.DefaultContext):
    """tensormp's module-level context: follows the stdlib's start method until one is set."""

    Process = Process

    def __init__(self) -> None:
        super().__init__(None)

    def get_context(self, method: str | None = None) -> Any:
        if method is None:
            if self._actual_context is None:
                self._actual_context = _concrete_contexts[_stdlib_start_method()]
            return self._actual_context
        try:
            return _concrete_contexts[method]
        except KeyError:
            raise ValueError(
                f"cannot find context for {method!r}; choose one of "
                f"{sorted(_concrete_contexts)}"
            ) from None

    def set_start_method(self, method: str | None, force: bool = False) -> None:
        if self._actual_context is not None and not force:
            raise RuntimeError("context has already been set")
        if method is None and force:
            self._actual_context = None
            return
        self._actual_context = self.get_context(method)

    def get_start_method(self, allow_none: bool = False) -> str | None:
        if self._actual_context is None:
            if allow_none:
                return None
            self._actual_context = _concrete_contexts[_stdlib_start_method()]
        return self._actual_context._name  # type: ignore[no-any-return]

    def get_all_start_methods(self) -> list[str]:
        return multiprocessing.get_all_start_methods()


def _stdlib_start_method() -> str:
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


_default_context = DefaultContext()


def get_context(method: str | None = None) -> Any:
    """The tensormp context for ``method`` (``"fork"``, ``"spawn"``, ``"forkserver"``).

    Raises:
        ValueError: unknown start method.
    """
    return _default_context.get_context(method)
