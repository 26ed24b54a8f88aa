"""Room for the fds of the next message: a receiver never takes a message it has no fds for.

Why before, not after: the fds of a message (``SCM_RIGHTS``) are installed by ``recvmsg`` in the
same call that takes the record off the socket. When the process is out of fds (the soft
``RLIMIT_NOFILE``), the kernel drops the fds it could not install (``MSG_CTRUNC``) and the record
is gone all the same: nothing can retry it. So room is made *before* a record that may carry
fds is read, by giving back the fds this process keeps only for reuse (idle mappings of other
processes' segments, its own cached free segments: ``MemoryState.trim_caches``).

Counting the open fds costs a ``stat`` of ``/proc/self/fd`` (whose size is the count since
Linux 6.2; a listing on older kernels): about 9 us, too much for every message. So the count is
taken when the fds received since the last count (:attr:`FdBudget.taken`, counted by the
receiver, closes not subtracted) reach :attr:`FdBudget.slack`: the room the last count found
beyond :func:`reserve` fds, at most 64 (so that fds the rest of the program opened meanwhile, or
a lowered limit, are seen within 64 received fds). A count that finds fewer than the reserve
free gives back the cached fds (then ``slack`` is 0 and every receive counts again, until the
pressure is gone). The same count sets the size of the idle-mapping cache (an eighth of the
limit, ``foreign.count_cap``), so the cache alone never fills the table.

What stays possible: a message that carries more fds than are free once the caches are
empty (arrays alive here, or files the program opened, fill the table). The receiver then gets
:class:`~tensormp.FdLimitError`, whose text gives the counts (:func:`shortage`).

One :class:`FdBudget` per process; a fork child counts its own table (``/proc/self``).
"""

from __future__ import annotations

import os
import resource
import sys

__all__ = ["FdBudget", "budget", "open_fds", "reserve", "shortage"]

_SLACK_MAX = 64  # fds received between two counts, at most
_ALLOCATOR = __name__.rpartition(".")[0] + ".allocator"


def open_fds() -> int:
    """The number of fds open in this process."""
    try:
        n = os.stat("/proc/self/fd").st_size  # the count, since Linux 6.2
    except OSError:  # pragma: no cover - no /proc
        return 0
    if n > 0:
        return n
    return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own fd


def soft_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY or soft < 0 else soft


def reserve(soft: int) -> int:
    """The fds kept free for incoming messages under the soft limit ``soft``: a sixteenth of
    it, between 8 and 64."""
    return max(8, min(64, soft // 16))


class FdBudget:
    """Fds this process may still receive before it counts again (see the module notes).

    Attributes:
        taken: fds received since the last count (the receiver adds them).
        slack: how many may be received before the next count.
    """

    __slots__ = ("taken", "slack")

    def __init__(self) -> None:
        self.taken = 0
        self.slack = 0  # count before the first receive

    def make_room(self) -> None:
        """Count the open fds; below the reserve, give back the cached ones. Never raises
        (a receive that then finds no room reports it itself)."""
        soft = soft_limit()
        free = soft - open_fds()
        keep = reserve(soft)
        # No cache to trim before the allocator is loaded (a process that has not touched an
        # array yet; loading it here would import numpy into every process with a queue).
        allocator = sys.modules.get(_ALLOCATOR)
        if allocator is not None:
            from .foreign import count_cap

            st = allocator._state
            cap = count_cap(soft)
            with st:
                foreign = st.foreign
                if foreign.max_count != cap:
                    foreign.max_count = cap
                    foreign.trim(st.arenas.cache_limit)
                if free < keep:
                    st.trim_caches()
            if free < keep:
                free = soft - open_fds()
        self.taken = 0
        self.slack = max(0, min(_SLACK_MAX, free - keep))


budget = FdBudget()


def shortage(needed: int, got: int | None) -> str:
    """The text of the error for a message whose ``needed`` fds could not all be received
    (``got`` were; None: not known). Gives back the cached fds first (the next message finds
    them free), then states the counts and the fix that applies."""
    allocator = sys.modules.get(_ALLOCATOR)
    ours = 0
    if allocator is not None:
        allocator.empty_cache()
        ours = allocator.memory_stats()["fds"]
    received = "not all" if got is None else f"only {got}"
    fix = "keep fewer arrays alive, close files" if ours else "close files"
    soft, hard = soft_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard > soft:
        raise_it = (
            f"raise the soft limit up to the hard one ({'unlimited' if hard < 0 else hard}): "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard)) at the start of the program "
            "(its workers inherit it), or `ulimit -n` before it"
        )
    else:
        raise_it = "raise the limit (`tensormp doctor` says how)"
    if ours:
        raise_it += (
            ", or tensormp.set_sharing_strategy('file_system') (its arrays keep no fd once "
            "mapped)"
        )
    return (
        f"a message arrived with {needed} file descriptors but {received} could be received: "
        f"this process is out of fds (soft RLIMIT_NOFILE {soft}; {open_fds()} open "
        f"now, {ours} of them for shared memory in use here, none kept idle). The message was "
        f"dropped and the connection stays usable; {fix}, or {raise_it}"
    )
