"""Sharing strategies, with ``torch.multiprocessing``'s API.

``file_descriptor`` (the default): segments are anonymous memfds whose fds travel with each
message. Nothing has a name, so nothing can leak, and the size of ``/dev/shm`` does not matter.
``file_system`` (named segments under the shm directory plus a cleanup daemon) is not built yet.
"""

from __future__ import annotations

__all__ = ["get_all_sharing_strategies", "get_sharing_strategy", "set_sharing_strategy"]

_AVAILABLE = ("file_descriptor",)
_PLANNED = ("file_system",)
_strategy = "file_descriptor"


def get_all_sharing_strategies() -> set[str]:
    """The sharing strategies this build supports (a set, as in torch)."""
    return set(_AVAILABLE)


def get_sharing_strategy() -> str:
    """The current sharing strategy (``"file_descriptor"`` by default)."""
    return _strategy


def set_sharing_strategy(new_strategy: str) -> None:
    """Choose how shared memory crosses processes (as ``torch.multiprocessing``).

    Raises:
        ValueError: ``new_strategy`` is unknown, or is ``"file_system"``, which this
            version does not provide yet.
    """
    global _strategy
    if new_strategy in _PLANNED:
        raise ValueError(
            f"sharing strategy {new_strategy!r} is not available in this version of tensormp; "
            "use 'file_descriptor' (the default), which needs no /dev/shm space and leaks "
            "nothing when a process is killed"
        )
    if new_strategy not in _AVAILABLE:
        raise ValueError(
            f"unknown sharing strategy {new_strategy!r}; this version supports "
            f"{sorted(_AVAILABLE)}"
        )
    _strategy = new_strategy
