"""The tensormp exception hierarchy.

Every tensormp error derives from :class:`TensormpError` and also from the stdlib type
that users already catch for that failure (``OSError`` for resources, ``ValueError`` or
``TypeError`` for bad arguments), so ``except OSError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "TensormpError",
    "SharedMemoryError",
    "HandleError",
    "FdLimitError",
]


class TensormpError(Exception):
    """Base class of every exception raised by tensormp."""


class SharedMemoryError(TensormpError, OSError):
    """Shared memory could not be reserved, mapped or reached.

    Raised at allocation time, in the calling thread, never later as a ``SIGBUS``.
    ``errno`` is set (``ENOSPC`` or ``ENOMEM`` when memory runs out).
    """


class HandleError(TensormpError, RuntimeError):
    """A shared-memory handle could not be rebuilt into an array.

    For example, a tensormp pickle was loaded with plain :func:`pickle.loads` instead of
    arriving through a tensormp queue, pipe or process argument, so the file descriptors
    that travel beside the bytes are missing.
    """


class FdLimitError(TensormpError, OSError):
    """A message's file descriptors could not be received: the process is out of fds.

    ``errno`` is ``EMFILE``. Raised only once the fds kept for reuse (idle mappings, cached
    segments) were given back: the rest are in use (arrays alive, files open). The message is
    dropped whole and the connection stays usable; the text gives the counts.
    """
