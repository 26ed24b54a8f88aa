"""The crash log: a child's Python stacks at the moment a signal killed it.

Design note
-----------
A child that dies of ``SIGSEGV``/``SIGABRT``/``SIGBUS``/``SIGFPE``/``SIGILL`` runs no Python code
afterwards, so its stack must be written by ``faulthandler``, from the signal handler, to a file
it was pointed at beforehand. That file is an anonymous memfd (``memfd_create``,
close-on-exec): nothing is created in the file system, so nothing is left behind whoever dies,
and the kernel frees it with its last fd.

Who creates it depends on the channel, never who reads it:

* ``spawn()`` ranks create their own and send it to the parent on the report channel
  (``_spawn_report.py``, message ``S``);
* pool workers get one from the parent as a ``Process`` argument.

Either way the child calls :func:`enable` and keeps the fd open for its whole life (``faulthandler``
writes to it at the crash); the parent calls :func:`read` after the child exited. The read is
bounded (:data:`MAX_BYTES`), so a child that wrote a huge or forged log costs the parent one
bounded ``pread``, never a hang or an unbounded allocation.

This module imports nothing heavy (a spawn child imports it before running ``fn``).
"""

from __future__ import annotations

import faulthandler
import os

__all__ = ["MAX_BYTES", "create", "enable", "read"]

MAX_BYTES = 64 << 10  # the parent reads at most this much of a crash log


def create(name: str = "tensormp-crash-log") -> int:
    """A new, empty crash log: an anonymous memfd (close-on-exec), owned by the caller.

    Raises:
        OSError: ``memfd_create`` failed (out of fds or memory).
    """
    return os.memfd_create(name, os.MFD_CLOEXEC)


def enable(fd: int) -> None:
    """In the child: let ``faulthandler`` write every thread's stack to ``fd`` at a fatal signal.

    The caller must keep ``fd`` open until the process ends.
    """
    faulthandler.enable(file=fd, all_threads=True)


def read(fd: int) -> str:
    """In the parent, after the child exited: the log's text (at most :data:`MAX_BYTES` bytes,
    undecodable bytes replaced), or ``""`` when it is empty or cannot be read."""
    try:
        raw = os.pread(fd, MAX_BYTES, 0)
    except OSError:
        return ""
    return raw.decode("utf-8", "replace").strip()
