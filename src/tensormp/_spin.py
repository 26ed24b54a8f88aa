"""Spin-then-block: how a reader waits for the next record of a channel.

Who spins, how long, when it stops
----------------------------------
A process that waits for a record (``Connection.recv``/``read_record``, so ``SimpleQueue.get``,
``Queue.get()`` without a timeout and ``Pipe`` receives) *after it wrote a record itself* (on
any tensormp channel, since its previous wait) first polls its socket without blocking
(``recvmsg`` with ``MSG_DONTWAIT``) for up to ``TENSORMP_SPIN_US`` microseconds (default
``SPIN_US``, 100), and only then blocks in the kernel. Such a wait is likely for an answer: in
a ping-pong (or a pool worker waiting for its next task) the answer usually comes within that
budget, the reader takes it without being put to sleep and woken (two cross-CPU wake-ups a
round trip, most of a small round trip's time on a VM), and the writer's ``sendmsg`` has
nobody to wake. A process that only reads (a consumer of a stream, a result thread) never
spins: it would trade its idle time between items for CPU, and a stream needs no answer fast.

The rule adapts, per process (one state for all its channels), so that waits that are long,
or CPUs that others need, do not burn CPU:

* **Spins that found nothing back off.** After a spin that ended without a record, the next
  ``2**k - 1`` waits that could spin block at once (``k`` the number of such spins in a row,
  at most ``_MAX_BACKOFF``): a reader whose records come seldom spins once every 255 waits at most,
  about 0.4 us of CPU per wait. One spin that finds a record resets ``k``.
* **No spin where CPUs are crowded.** A machine of one CPU never spins (the writer could not
  run meanwhile). A process pinned to one CPU may spin: its writer may be pinned to another
  (the ping-pong benchmark pins its two processes so). At most every ``_CHECK_NS`` (250 ms;
  50 ms while crowded) a process that would spin reads the kernel's count of runnable threads
  (``/proc/loadavg``, about 10 us); while that count exceeds the machine's CPUs by more than
  one it does not spin (several consumers and a producer on 2 CPUs: spinning readers would take the
  producer's CPU). A spin that sees it was descheduled (one poll took more than
  ``_PREEMPTED_NS`` of wall time: someone else wanted this CPU, perhaps the writer pinned to
  the same one) stops, counts as found-nothing, and turns spinning off until the next check.
* ``TENSORMP_SPIN_US=0`` turns spinning off; another value sets the budget (microseconds).

A consumer among several gives the CPU away once before it sleeps
----------------------------------------------------------------
A blocking ``get`` of a ``Queue`` or ``JoinableQueue`` (with no timeout or one > 0) whose
previous record showed that other processes take from the same queue (its number did not
follow the one before: a bounded queue's records carry the ledger's numbers, an unbounded
queue's each producer's own; ``Queue._load``) first takes a record that is already there;
when there is none, it gives the CPU away once (``sched_yield``) and looks once more before it
sleeps (``after_yield`` counts the outcome). Where the pipeline itself has more runnable processes than CPUs (one
producer and four consumers on 2 CPUs) the thread that runs meanwhile is often the producer,
whose next record is then there: the consumer takes it without going to sleep, and the
producer's ``sendmsg`` has nobody to wake (a wake-up preempts the producer, the pipeline's
serial stage, on its own CPU). Measured there (``benchmarks/transfer.py``, 1 -> 4, per item,
median of 5): bounded, 64 B 9.6 -> 7.2 us, 4 KiB arrays 26.8 -> 18.7 us (the stdlib's: 11-12
and 24-26 us); ``JoinableQueue``, 64 B, 17.3-17.5 -> 10.6-10.7 us (the stdlib's: 14 us).

Who never yields, because a yield can cost a reader a whole time slice (milliseconds) when the
CPU goes to a process that is not part of the pipeline (a busy loop: the kernel's EEVDF
scheduler also moves the yielder's deadline back): a ``Pipe`` or ``SimpleQueue`` reader, a
queue's only consumer (its records' numbers follow each other), ``get(timeout=0)`` and
``get(block=False)``. A yield that found nothing backs off as a spin does (the next
``2**k - 1`` such waits sleep at once); ``TENSORMP_SPIN_US=0`` turns yielding off too.

Nothing here is shared between processes and no lock is taken: a spinning reader only calls
``recvmsg``, so a SIGKILLed peer means what it means to a blocked reader. A writer killed before
its ``sendmsg`` wrote nothing (the spin runs out and the reader blocks, as before); when every
writer is gone, ``recvmsg`` returns end-of-file at once, during the spin or the block. The GIL
is let go in every poll, so the process's other threads (the release thread) run meanwhile.
Timed waits (``poll(timeout)``, ``get(timeout=...)``) do not spin: their deadline stays exact.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

__all__ = ["SPIN_US", "after_yield", "may_yield", "recvmsg", "sched_yield", "set_budget_us",
           "state", "stats"]

SPIN_US = 100  # the default budget, microseconds
_MAX_BACKOFF = 8  # at most 2**8 - 1 waits block at once after spins that found nothing
_CHECK_NS = 250_000_000  # how often a spinning process looks at the runnable count
_RECHECK_NS = 50_000_000  # ... while it found the CPUs crowded (a passing burst ends soon)
_PREEMPTED_NS = 200_000  # one non-blocking poll that took longer: this process was descheduled
_DONTWAIT = int(socket.MSG_DONTWAIT)
_monotonic_ns = time.monotonic_ns
sched_yield = os.sched_yield


def _budget_from_env() -> int:
    raw = os.environ.get("TENSORMP_SPIN_US", "")
    if not raw:
        return SPIN_US * 1000
    try:
        us = float(raw)
    except ValueError:
        raise ValueError(
            f"TENSORMP_SPIN_US={raw!r} is not a number of microseconds; set it to 0 (never spin) "
            f"or a budget such as {SPIN_US}"
        ) from None
    return max(0, int(us * 1000))


class _State:
    """This process's spin state (threads share it: a race only misjudges one wait)."""

    __slots__ = ("budget_ns", "sent", "skip", "fails", "next_check", "crowded", "found", "empty",
                 "plain", "yield_skip", "yield_fails", "yield_found", "yield_slept")

    def __init__(self) -> None:
        self.budget_ns = _budget_from_env()
        self.sent = False  # a record was written since the last wait (Connection.write_record)
        self.skip = 0  # waits left that block at once (back-off)
        self.fails = 0  # spins in a row that found nothing
        self.next_check = 0  # monotonic ns of the next look at the runnable count
        self.crowded = False
        self.found = 0  # spins that found a record (test hook and stats)
        self.empty = 0  # spins that found nothing
        self.plain = 0  # waits that did not spin
        self.yield_skip = 0  # waits left that sleep without a yield (back-off)
        self.yield_fails = 0  # yields in a row that found nothing
        self.yield_found = 0  # yields after which a record was there (stats)
        self.yield_slept = 0  # ... after which none was: the wait slept


state = _state = _State()


def set_budget_us(us: float) -> None:
    """Set this process's spin budget in microseconds (0: never spin), as
    ``TENSORMP_SPIN_US`` does for a process that starts."""
    if us < 0:
        raise ValueError(f"a spin budget is >= 0 microseconds, got {us!r}")
    _state.budget_ns = int(us * 1000)


def stats() -> dict[str, int]:
    """Outcomes of this process's waits so far: ``found`` (a spin took the record), ``empty``
    (a spin found nothing, then blocked), ``plain`` (a wait after a write that did not spin:
    backing off, crowded CPUs, or ``TENSORMP_SPIN_US=0``; a wait without a write before it is
    not counted), ``yield_found``/``yield_slept`` (a consumer among several gave the CPU away
    before it slept: a record was there after, or none was)."""
    st = _state
    return {"found": st.found, "empty": st.empty, "plain": st.plain,
            "yield_found": st.yield_found, "yield_slept": st.yield_slept,
            "budget_ns": st.budget_ns}


def may_yield() -> bool:
    """Whether a consumer among several that found no record may give the CPU away once
    (``sched_yield``) before it sleeps: not while backing off after yields that found nothing,
    nor with ``TENSORMP_SPIN_US=0`` (module notes). The caller counts the outcome with
    :func:`after_yield`."""
    st = _state
    if st.yield_skip:
        st.yield_skip -= 1
        return False
    return st.budget_ns != 0


def after_yield(found: bool) -> None:
    """Count what the look after a yield found; a yield that found nothing backs off."""
    st = _state
    if found:
        st.yield_found += 1
        st.yield_fails = 0
        return
    st.yield_slept += 1
    if st.yield_fails < _MAX_BACKOFF:
        st.yield_fails += 1
    st.yield_skip = (1 << st.yield_fails) - 1


def _crowded() -> bool:
    """More runnable threads on the machine than CPUs + 1, or a machine of one CPU."""
    cpus = os.cpu_count() or 1
    if cpus < 2:
        return True
    try:
        with open("/proc/loadavg", "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return True
    # One runnable thread more than CPUs is allowed: the count includes this reader and its
    # spinning peer, and a passing third (a release thread, a kernel worker) turned spinning
    # off for 50 ms at a time: the 4 KiB ping-pong was bimodal here (48-52 us or 80-85 us a
    # round trip, run by run); with the allowance, 4 of 4 runs at 48-52 us.
    return running > cpus + 1


def recvmsg(sock: socket.socket, bufsize: int, ancsize: int, flags: int) -> Any:
    """``sock.recvmsg(bufsize, ancsize, flags)`` that blocks, spinning first (module notes);
    the caller calls it only when ``state.sent`` (a reader that did not write blocks at once)."""
    st = _state
    st.sent = False
    if st.skip or not st.budget_ns:
        if st.skip:
            st.skip -= 1
        st.plain += 1
        return sock.recvmsg(bufsize, ancsize, flags)
    now = _monotonic_ns()
    if now >= st.next_check:
        st.crowded = _crowded()
        st.next_check = now + (_RECHECK_NS if st.crowded else _CHECK_NS)
    if st.crowded:
        st.plain += 1
        return sock.recvmsg(bufsize, ancsize, flags)
    end = now + st.budget_ns
    spin_flags = flags | _DONTWAIT
    while True:
        try:
            got = sock.recvmsg(bufsize, ancsize, spin_flags)
        except BlockingIOError:
            before, now = now, _monotonic_ns()
            if now < end and now - before < _PREEMPTED_NS:
                continue
            if now - before >= _PREEMPTED_NS:  # descheduled: someone else needs this CPU
                st.crowded = True
            break
        st.found += 1
        st.fails = 0
        return got
    st.empty += 1
    if st.fails < _MAX_BACKOFF:
        st.fails += 1
    st.skip = (1 << st.fails) - 1
    return sock.recvmsg(bufsize, ancsize, flags)
