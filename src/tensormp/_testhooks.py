"""Test hook: make this process ``SIGKILL`` itself at a named point of a channel operation.

The channels (``connection.py``, ``queues.py``) call :func:`reached` at the points listed in
:data:`POINTS` when a kill is armed (one dict lookup otherwise). Tests arm one in a child
process with :func:`kill_at` to check what the survivors see when a process dies at exactly
that point; nothing else uses it.
"""

from __future__ import annotations

import os
import signal
import time

__all__ = ["POINTS", "armed", "kill_at", "reached"]

POINTS = {
    # Queue.put / JoinableQueue.put
    "put.begin": "pickled, before any syscall (no slot taken yet)",
    "put.tokens": "task token and slot taken (bounded: holding the write lock), before the "
    "record is written",
    "put.queued": "the message was left to the feeder thread (not written)",
    # Connection.send and every queue write
    "send.payload": "a large pickle written to its memfd, before sendmsg",
    "send.bag": "more than 253 fds put in a bag, before sendmsg",
    "send.sent": "right after the record's sendmsg",
    # Connection.recv and every queue read
    "recv.begin": "before recvmsg",
    "recv.got": "right after recvmsg, before the record is parsed",
    "recv.payload": "large payload or fd bag read, before unpickling",
    "recv.loaded": "unpickled, before the task token is kept",
    "recv.done": "everything done, before returning the object",
}

armed: dict[str, int] = {}


def kill_at(point: str, nth: int = 1) -> None:
    """Arm: SIGKILL this process the ``nth`` time it reaches ``point`` (one of :data:`POINTS`).

    Raises:
        ValueError: unknown ``point`` or ``nth < 1``.
    """
    if point not in POINTS:
        raise ValueError(f"unknown kill point {point!r}; known: {', '.join(POINTS)}")
    if nth < 1:
        raise ValueError(f"nth must be >= 1, got {nth}")
    armed[point] = nth


def reached(point: str) -> None:
    """Called by the channels at ``point``; kills this process if armed for it."""
    left = armed.get(point)
    if left is None:
        return
    if left > 1:
        armed[point] = left - 1
        return
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - the signal is on its way
        time.sleep(1)
