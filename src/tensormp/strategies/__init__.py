"""Sharing strategies, with ``torch.multiprocessing``'s API.

* ``file_descriptor`` (the default): segments are anonymous memfds whose fds travel inside each
  message. Nothing has a name, so nothing can leak, and the size of ``/dev/shm`` does not
  matter. A process holds one fd per segment it maps (small arrays share segments).
* ``file_system``: segments are named files in the shm directory (``$TENSORMP_SHM_DIR``,
  default ``/dev/shm``) that a process maps and closes at once, so no fd is held per segment;
  messages carry names. A per-user cleanup daemon removes the files that no live process maps
  and no unread message carries (``file_system.py`` and ``_daemon.py`` have the rules). The
  files count against the shm directory's size: a full one raises ``SharedMemoryError``
  (``ENOSPC``) at allocation.

The strategy decides how *new* segments are made; a receiver rebuilds arrays sent under either
one. Unlike ``torch.multiprocessing``, the strategy set in a parent also applies in the
children a tensormp context starts (spawn and forkserver included).

Each strategy is an object (``base.py`` has the interface: create / reference / attach /
remove): ``file_descriptor.py`` and ``file_system.py``, listed in :data:`_TABLE` with the byte
that names them in handles. :func:`current` gives the one that makes this process's new
segments; a segment records the strategy that made it, and a receiver finds it with
:func:`by_code`. A third strategy is one module and one line in the table.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..liveness import process_alive, process_start_time

if TYPE_CHECKING:
    from .base import Strategy

__all__ = [
    "get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy",
    "current", "by_code", "add_flusher", "flush_pending",
    "process_start_time", "process_alive", "program", "set_program",
]


_program: tuple[int, int] | None = None


def program() -> tuple[int, int]:
    """``(pid, start time)`` of the root of this process's program (see the module notes)."""
    global _program
    if _program is None:
        pid = os.getpid()
        _program = (pid, process_start_time(pid) or 0)
    return _program


def set_program(value: tuple[int, int]) -> None:
    """In a child started by a tensormp context: adopt the parent's program id."""
    global _program
    _program = (int(value[0]), int(value[1]))


# A forked child belongs to its parent's program: the parent fixes its own id before any fork
# (a child forked first would otherwise take itself for the root, and the cleanup daemon would
# remove the files of its messages still unread when it exits). Registered at import, whatever
# the strategy: the strategy can change later, in the parent or in a child.
os.register_at_fork(before=program)


# The strategies: name -> (code in handles, module, class). A module is imported the first time
# its strategy makes or maps a segment. A new strategy is one module and one line here.
_TABLE: dict[str, tuple[int, str, str]] = {
    "file_descriptor": (ord("f"), "tensormp.strategies.file_descriptor", "FileDescriptor"),
    "file_system": (ord("n"), "tensormp.strategies.file_system", "FileSystem"),
}
_AVAILABLE = tuple(_TABLE)
_strategy = "file_descriptor"
_current: Strategy | None = None  # the instance of _strategy, once asked for
# code -> instance, filled as strategies are loaded (a list: a handle's byte indexes it).
_by_code: list[Strategy | None] = [None] * 256


def _load(name: str) -> Strategy:
    code, module, cls = _TABLE[name]
    strategy = _by_code[code]
    if strategy is None:
        strategy = getattr(importlib.import_module(module), cls)()
        if strategy.code != code or strategy.name != name:  # pragma: no cover - a table typo
            raise ImportError(f"{module}.{cls} does not match its line in the strategy table")
        _by_code[code] = strategy
    return strategy


def current() -> Strategy:
    """The strategy that makes this process's new segments (see :func:`set_sharing_strategy`)."""
    strategy = _current
    if strategy is None:
        strategy = _set_current(_load(_strategy))
    return strategy


def _set_current(strategy: Strategy) -> Strategy:
    global _current
    _current = strategy
    return strategy


def by_code(code: int) -> Strategy:
    """The strategy a handle names with ``code`` (its segment wire's strategy byte).

    Raises:
        HandleError: no strategy has that code (a corrupt message, or another tensormp).
    """
    strategy = _by_code[code]
    if strategy is not None:
        return strategy
    for name, row in _TABLE.items():
        if row[0] == code:
            return _load(name)
    from ..errors import HandleError

    raise HandleError(
        f"a handle names sharing strategy code {code:#x}, which this tensormp does not know "
        "(corrupt message, or a different tensormp version in the sender)"
    )


# Work a strategy queues for later (the file_system strategy's records to its daemon), done
# before this process sends a message or waits for one, and at exit. Registered by the module
# that queues the work, once it is fully imported.
_flushers: list[Callable[[], None]] = []


def add_flusher(flush: Callable[[], None]) -> None:
    """Have ``flush()`` called at this process's flush points (before it sends a message or
    waits for one, and at exit); ``flush`` returns quickly when it has nothing queued."""
    _flushers.append(flush)


def flush_pending() -> None:
    """Run every registered flusher (see :func:`add_flusher`)."""
    for flush in _flushers:
        flush()


_closers: list[Callable[[], None]] = []


def add_closer(close: Callable[[], None]) -> None:
    """Have ``close()`` called when this process is done with shared memory (exit, after the
    last flush): it closes the strategy's connections, which would otherwise be left for the
    interpreter to collect (a ``ResourceWarning`` at exit)."""
    _closers.append(close)


def close_connections() -> None:
    """Run every registered closer (see :func:`add_closer`)."""
    for close in _closers:
        close()


def get_all_sharing_strategies() -> set[str]:
    """The sharing strategies this build supports (a set, as in torch)."""
    return set(_AVAILABLE)


def get_sharing_strategy() -> str:
    """The current sharing strategy (``"file_descriptor"`` by default)."""
    return _strategy


def set_sharing_strategy(new_strategy: str) -> None:
    """Choose how new shared memory is made and crosses processes (as ``torch.multiprocessing``).

    Applies to segments created from now on, in this process and in the children tensormp
    contexts start later. Arrays already shared keep their kind.

    Raises:
        ValueError: ``new_strategy`` is not one of :func:`get_all_sharing_strategies`.
    """
    global _strategy, _current
    if new_strategy not in _TABLE:
        raise ValueError(
            f"unknown sharing strategy {new_strategy!r}; choose one of {sorted(_AVAILABLE)}"
        )
    _strategy = new_strategy
    _current = None
