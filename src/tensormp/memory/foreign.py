"""The cache of idle mappings of other processes' segments, and its reaper thread.

A receiver whose last root in a segment of another process died keeps the segment mapped
(an LRU bounded in bytes by the cache limit and in number by :func:`count_cap`: at most
``FOREIGN_CACHE_MAX``, and an eighth of the soft ``RLIMIT_NOFILE``, since each idle
``file_descriptor`` mapping keeps its segment's fd open), so the
next array in the same segment costs no mmap and no page faults: a consumer that takes arrays
one by one makes a segment idle and busy again for every array, so nothing slower than a dict
update happens on that path. Only while the segment's creator lives: a dead creator never
reuses the segment, so keeping it would only hold its memory. A reaper thread, running while
idle mappings exist, drops those whose creator died about once a second, so a process that
sits idle does not keep a dead creator's memory mapped (and, for ``file_system`` segments, does
not keep the cleanup daemon from removing the file). ``empty_cache()`` unmaps them all.

Not thread-safe by itself: ``MemoryState``'s lock guards every call (the reaper takes it).
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from ..liveness import process_start_time
from .segment import Segment

__all__ = ["FOREIGN_CACHE_MAX", "ForeignCache", "count_cap", "creator_alive"]

FOREIGN_CACHE_MAX = 64  # idle mappings of other processes' segments kept (fds), at most


def count_cap(soft_limit: int | None = None) -> int:
    """How many idle mappings to keep under the soft fd limit ``soft_limit`` (read with
    ``getrlimit`` when None): an eighth of it, at most ``FOREIGN_CACHE_MAX``, at least 1. At
    the usual 1024 that is 64; at 64, 8: the cache never takes the fds a message needs."""
    if soft_limit is None:
        soft_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_limit == resource.RLIM_INFINITY or soft_limit < 0:
        return FOREIGN_CACHE_MAX
    return max(1, min(FOREIGN_CACHE_MAX, soft_limit // 8))


def creator_alive(seg: Segment, thorough: bool = False) -> bool:
    """Whether the segment's creator still runs. The quick check (``kill(pid, 0)``) takes a
    zombie for alive; the thorough one (``/proc/<pid>/stat``) does not."""
    if thorough:
        return process_start_time(seg.creator_pid) is not None
    try:
        os.kill(seg.creator_pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


class ForeignCache:
    """Idle foreign mappings, least recently used first.

    Args:
        close: unmaps a segment that no root uses (``MemoryState.close_if_unused``, which also
            calls :meth:`unidle`).
    """

    __slots__ = ("idle", "idle_bytes", "max_count", "reaper", "close")

    def __init__(self, close: Callable[[Segment], None]) -> None:
        self.idle: collections.OrderedDict[bytes, Segment] = collections.OrderedDict()
        self.idle_bytes = 0  # sum of the sizes in idle
        self.max_count = count_cap()  # updated when the fd limit is read again (fdbudget.py)
        self.reaper: threading.Thread | None = None  # None exactly while no reaper runs
        self.close = close

    def keep(
        self, seg: Segment, limit: int, locked: AbstractContextManager[None], exiting: bool
    ) -> None:
        """Keep an idle mapping for reuse (its creator lives); trims to ``limit`` bytes and
        starts the reaper (which takes ``locked``) if none runs and the process is not
        ``exiting``."""
        idle = self.idle
        if seg.id not in idle:
            self.idle_bytes += seg.size
            idle[seg.id] = seg
            if self.idle_bytes > limit or len(idle) > self.max_count:
                self.trim(limit)
        else:
            idle.move_to_end(seg.id)
        if self.reaper is None and not exiting:
            self._start_reaper(locked)

    def unidle(self, seg_id: bytes) -> None:
        """``seg_id`` is in use again (or closed): no longer idle."""
        seg = self.idle.pop(seg_id, None)
        if seg is not None:
            self.idle_bytes -= seg.size

    def trim(self, limit_bytes: int) -> None:
        """Unmap the least recently used idle mappings until at most ``limit_bytes`` (and
        ``max_count`` mappings) stay."""
        idle = self.idle
        while idle and (self.idle_bytes > limit_bytes or len(idle) > self.max_count):
            seg = next(iter(idle.values()))
            self.unidle(seg.id)
            self.close(seg)

    def close_dead_creators(self) -> None:
        for other in [s for s in self.idle.values() if not creator_alive(s, thorough=True)]:
            self.close(other)

    def _start_reaper(self, locked: AbstractContextManager[None]) -> None:
        if sys.is_finalizing():
            return  # a thread started at shutdown hangs it
        self.reaper = threading.Thread(
            target=self._reap, args=(locked,), name="tensormp-idle-mappings", daemon=True
        )
        self.reaper.start()

    def _reap(self, locked: AbstractContextManager[None]) -> None:
        while True:
            time.sleep(1.0)
            with locked:
                self.close_dead_creators()
                if not self.idle:
                    self.reaper = None
                    return
