"""The CPUs this process may run on: the default number of workers of ``Pool``,
``ProcessPoolExecutor`` and the local engine (a layer below all three, which each ask it)."""

from __future__ import annotations

import os

__all__ = ["cpu_count"]


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask; ``os.process_cpu_count`` from Python
    3.13), at least 1."""
    count = getattr(os, "process_cpu_count", None)
    if count is not None:
        return count() or 1
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1
