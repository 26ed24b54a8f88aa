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
"""

from __future__ import annotations

import os

__all__ = [
    "get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy",
    "process_start_time", "process_alive", "program", "set_program",
]


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it has exited (or is a
    zombie, which holds no memory any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22 of the whole line


def process_alive(pid: int, start: int) -> bool:
    """True while the process ``(pid, start)`` lives (a reused pid does not count)."""
    return pid > 0 and process_start_time(pid) == start


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


_AVAILABLE = ("file_descriptor", "file_system")
_strategy = "file_descriptor"


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
    global _strategy
    if new_strategy not in _AVAILABLE:
        raise ValueError(
            f"unknown sharing strategy {new_strategy!r}; choose one of {sorted(_AVAILABLE)}"
        )
    _strategy = new_strategy
