"""Shared memory: memfd segments, the caching sub-allocator, and block lifetimes."""

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
