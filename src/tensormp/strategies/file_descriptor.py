"""The ``file_descriptor`` strategy (the default): anonymous memfd segments whose fds travel
inside each message.

A segment is a ``memfd_create`` file with no name. Another process gets it only as an fd carried
by the message itself (``SCM_RIGHTS`` on a Unix socket, or the fd inheritance of a process
start), so there is no name to leak: the kernel frees the memory when the last fd and the last
mapping are gone, in whatever order processes exit, ``kill -9`` included. A process keeps one
fd per segment it maps (small arrays share segments), and the size of ``/dev/shm`` does not
matter. Reserving the pages is ``memory.segment``'s (``Segment.reserve``).
"""

from __future__ import annotations

import errno
import os

from ..errors import FdLimitError, HandleError, SharedMemoryError
from ..memory.segment import Segment, available_memory, format_bytes
from .base import FdList, Strategy, TakeFd
from .names import memfd_name

__all__ = ["FileDescriptor"]


class FileDescriptor(Strategy):
    """memfd segments; handles carry the fd (an index into the message's fds)."""

    name = "file_descriptor"
    code = ord("f")
    keeps_fd = True

    def create(self, size: int, kind: str) -> Segment:
        avail = available_memory()
        if avail is not None and size > avail:
            # Checked first: reserving a memfd past the available memory does not fail
            # cleanly, it wakes the OOM killer.
            raise SharedMemoryError(
                errno.ENOMEM,
                f"cannot reserve {format_bytes(size)} of shared memory (memfd): only "
                f"{format_bytes(avail)} of memory is available to this process. Free memory, "
                "raise the container's memory limit, or send smaller arrays.",
            )
        seg_id = os.urandom(16)
        try:
            fd = os.memfd_create(memfd_name(seg_id), os.MFD_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise FdLimitError(
                    e.errno,
                    f"cannot create a shared-memory segment: this process is out of file "
                    f"descriptors ({e.strerror}). Each segment alive here (a large array, or an "
                    "arena of small ones, including ones still in flight to a consumer) holds "
                    "one fd: raise the limit (ulimit -n) or keep fewer large arrays alive.",
                ) from None
            raise SharedMemoryError(
                e.errno,
                f"memfd_create failed ({e.strerror}); tensormp needs Linux >= 3.17 with memfd "
                "support",
            ) from None
        try:
            os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            raise SharedMemoryError(e.errno, f"cannot size a memfd segment: {e.strerror}") from None
        seg = Segment(seg_id, fd, size, os.getpid(), kind, self)  # maps it (closes fd on failure)
        try:
            seg.reserve()
        except OSError as e:
            seg.close()
            avail = available_memory()
            avail_s = "unknown" if avail is None else format_bytes(avail)
            raise SharedMemoryError(
                e.errno,
                f"cannot reserve {format_bytes(size)} of shared memory (memfd) for an array: "
                f"{e.strerror}; {avail_s} of memory is available to this process. Free memory, "
                "raise the container's memory limit, or send smaller arrays.",
            ) from None
        return seg

    def reference(self, msg: FdList, seg: Segment) -> int | str:
        return msg.add_fd(seg.fd, seg.id, seg)

    def attach(
        self, seg_id: bytes, ref: int | str, size: int, creator_pid: int, kind: str,
        take_fd: TakeFd,
    ) -> Segment:
        if type(ref) is not int:
            raise HandleError(f"a file_descriptor handle carries an fd index, not {ref!r} (corrupt message)")
        return Segment(seg_id, take_fd(ref), size, creator_pid, kind, self)
