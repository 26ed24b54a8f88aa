"""Shared memory: segments, the caching sub-allocator, and block lifetimes.

Layers, each importing only those below it (and ``errors``, ``liveness``):

* ``segment.py``: one shared-memory file and its mapping (strategies build on it);
* ``release.py``: the release channel between receivers and a segment's creator;
* ``strategies/`` (a sibling package): how segments are made and cross processes;
* ``blocks.py``: a block of a segment and its root (the array every view leads back to);
* ``arenas.py``: the caching sub-allocator (size-class arenas, cached large segments);
* ``foreign.py``: the cache of idle mappings of other processes' segments, and its reaper;
* ``holds.py``: hold accounting, the two ends of the release protocol inside a process;
* ``state.py``: ``MemoryState``, all of the above for one process (replaced whole at fork);
* ``allocator.py``: the public functions over the current state, exit and fork;
* ``fdbudget.py``: room for the fds of the next message (receivers give back cached fds
  before they could run out); loads the allocator only if the process already has.

Names are loaded on first use: importing ``tensormp.memory.release`` or ``.segment`` does not
import numpy (the allocator does).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the names below are, for type checkers and the API docs
    from .allocator import (
        Block,
        allocate,
        attach,
        empty_cache,
        find_block,
        get_cache_limit,
        memory_stats,
        set_cache_limit,
    )
    from .segment import Segment

__all__ = [
    "Block",
    "Segment",
    "allocate",
    "attach",
    "empty_cache",
    "find_block",
    "get_cache_limit",
    "memory_stats",
    "set_cache_limit",
]

_LAZY = {name: "allocator" for name in __all__}
_LAZY["Segment"] = "segment"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
