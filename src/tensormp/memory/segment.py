"""Segments: one shared-memory file (a ``memfd``, or a named file), and its one mapping.

Protocol and ownership
----------------------
* A segment is created by exactly one process, its *creator*, through the current sharing
  strategy (``strategies/``: ``file_descriptor.py`` makes memfds, ``file_system.py`` named
  files). The creator allocates every page up front (``MADV_POPULATE_WRITE``, or
  ``posix_fallocate`` on kernels before 5.14: :meth:`Segment.reserve`), after checking the
  request against the available memory, so running out of memory is an ``OSError``
  (``ENOMEM``/``ENOSPC``) in the caller at allocation time and never a ``SIGBUS`` on a later
  page fault.
* A segment has a 16-byte random identity (``Segment.id``) that travels in every handle, with
  its size, creator, kind and the code of its strategy (``Segment.wire``). Each process keeps
  at most one :class:`Segment` object per identity (the registry in ``memory/state.py``): one
  fd and one mapping, whatever the number of arrays it holds in it.
* The segment's strategy (``Segment.strategy``) says what a handle carries so that another
  process can map it: the fd itself, carried by the message (``SCM_RIGHTS`` on a Unix socket,
  or the fd inheritance of a process start), so there is no name to leak and the kernel frees
  the memory when the last fd and the last mapping are gone, in whatever order processes exit,
  ``kill -9`` included; or (``file_system``) a name in the shm directory, in which case the
  process maps the file and closes the fd at once (``Segment.fd`` is -1, ``Segment.name`` is
  set). The creator lets the strategy drop the name (``Strategy.remove``) when its allocator
  lets the segment go; the cleanup daemon removes names that a dead creator left and nobody
  can need.
* Closing a segment unmaps it and closes its fd in this process only. Every array tensormp
  hands out is a view of a block *root* (``memory/blocks.py``), and views keep their root
  alive, so the allocator closes a segment only when the last root in it has died: no array
  can outlive its mapping.

This module imports no other layer of tensormp (errors aside): strategies build on it.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
from typing import TYPE_CHECKING

from ..errors import SharedMemoryError

if TYPE_CHECKING:
    from ..strategies.base import Strategy
    from .blocks import RootRef

__all__ = ["Segment", "format_bytes", "available_memory", "WIRE_SIZE", "STRATEGY_AT", "unpack_wire"]

PAGE_SIZE = mmap.PAGESIZE

# Segments are mapped with libc's mmap rather than Python's ``mmap`` module, which keeps a dup()
# of every fd it maps (before Python 3.13's ``trackfd=False``): one fd per segment, not two.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MADV_POPULATE_WRITE = 23

# What a handle says about its segment, packed once per segment (``Segment.wire``): id, size,
# creator pid, kind, strategy code, then the creator's release address (the rest of the bytes).
_WIRE = struct.Struct("<16sQIcB")
WIRE_SIZE = _WIRE.size
STRATEGY_AT = WIRE_SIZE - 1  # index of the strategy code in the wire bytes
_KINDS = {"arena": b"a", "large": b"l"}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}


def unpack_wire(wire: bytes) -> tuple[bytes, int, int, str, int, bytes]:
    """``(segment id, size, creator pid, kind, strategy code, release address)`` of a segment's
    wire bytes."""
    seg_id, size, creator_pid, kind, code = _WIRE.unpack_from(wire)
    return seg_id, size, creator_pid, _KIND_NAMES[kind], code, bytes(wire[WIRE_SIZE:])


def _map(fd: int, size: int) -> int:
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(addr)


_POPULATE_SPLIT = 64 << 20  # segments at least this large are populated by several threads


def _populate_range(address: int, size: int) -> int:
    if _libc.madvise(address, size, _MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def _populate(address: int, size: int) -> int:
    """``MADV_POPULATE_WRITE`` over ``[address, address + size)``; returns 0 or an errno.

    The kernel's work (allocating and zeroing every page) runs with the GIL released, so a
    large segment is split over up to 4 threads, one per CPU: zeroing runs on every core at once
    (256 MiB on 2 cores: about half the time of one call).
    """
    threads = min(4, os.cpu_count() or 1, size // (_POPULATE_SPLIT // 2) or 1)
    if size < _POPULATE_SPLIT or threads < 2:
        return _populate_range(address, size)
    import threading

    chunk = -(-size // threads // PAGE_SIZE) * PAGE_SIZE
    errors = [0] * threads

    def work(i: int) -> None:
        start = i * chunk
        errors[i] = _populate_range(address + start, min(chunk, size - start))

    pool = [threading.Thread(target=work, args=(i,)) for i in range(1, threads)]
    for t in pool:
        t.start()
    work(0)
    for t in pool:
        t.join()
    return next((e for e in errors if e), 0)


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``: sizes in error messages and reprs."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _read_int(path: str) -> int | None:
    try:
        with open(path, "rb") as f:
            raw = f.read().strip()
    except OSError:
        return None
    return None if raw in (b"max", b"") else int(raw)


def _cgroup_room() -> int | None:
    """Bytes the memory cgroups of this process still allow (v2 and v1), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    room: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: the limit may sit on any ancestor
            base, limit_file, usage_file = "/sys/fs/cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            base = "/sys/fs/cgroup/memory"
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            directory = "/".join([base, *parts[:depth]])
            limit = _read_int(f"{directory}/{limit_file}")
            usage = _read_int(f"{directory}/{usage_file}")
            if limit is not None and usage is not None and limit < (1 << 60):
                free = max(0, limit - usage)
                room = free if room is None else min(room, free)
    return room


def available_memory() -> int | None:
    """Bytes of memory a new memfd can still take: ``MemAvailable``, capped by the memory
    cgroups (v2 or v1) of this process and their ancestors."""
    avail = None
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


class Segment:
    """One shared-memory segment as seen by this process: an fd and one mapping.

    Attributes:
        id: 16 random bytes naming the segment in every process.
        fd: the fd of the file in this process (sent along with handles), or -1 when the
            strategy keeps none (``file_system``: handles carry ``name``).
        name: the file's name under a strategy that names segments, else ``""``.
        strategy: the :class:`~tensormp.strategies.base.Strategy` that made it.
        size: length in bytes (a multiple of the page size).
        creator_pid: pid of the process that created it.
        address: where the segment is mapped in this process.
        buffer: a ctypes byte array over the mapping.
        view: a ``memoryview`` (format ``B``) of ``buffer``; block roots are numpy arrays over
            slices of it (so a root's ``base`` is not an ndarray, and numpy's base chain of
            any view of a root ends at the root).
    """

    __slots__ = (
        "id", "fd", "size", "creator_pid", "owner_addr", "address", "buffer", "kind", "roots",
        "name", "view", "strategy", "_wire", "__weakref__",
    )

    def __init__(
        self, seg_id: bytes, fd: int, size: int, creator_pid: int, kind: str,
        strategy: Strategy, name: str = "",
    ) -> None:
        """Map ``fd`` (``size`` bytes), taking ownership of it: kept as ``self.fd`` when
        ``strategy.keeps_fd``, closed at once otherwise (and on failure).

        Raises:
            SharedMemoryError: the mapping failed (an ``OSError``).
        """
        self.id = seg_id
        self.fd = fd
        self.name = name  # file name under the file_system strategy ("" for a memfd)
        self.strategy = strategy
        self.size = size
        self.creator_pid = creator_pid
        self.kind = kind  # "arena" (many small blocks) or "large" (one block)
        self.owner_addr = b""  # the creator's release address (memory/release.py), once known
        try:
            self.address = _map(fd, size)
        except OSError as e:
            raise SharedMemoryError(
                e.errno, f"cannot map a shared-memory segment of {format_bytes(size)}: {e.strerror}"
            ) from None
        finally:
            if not strategy.keeps_fd or not hasattr(self, "address"):
                # A named segment keeps no fd (the mapping is all it needs); a failed map
                # gives its fd back.
                os.close(fd)
                self.fd = -1
        # A buffer-protocol view of the mapping; roots are numpy views of it.
        self.buffer: ctypes.Array[ctypes.c_ubyte] | None = (
            ctypes.c_ubyte * size
        ).from_address(self.address)
        self.view: memoryview | None = memoryview(self.buffer).cast("B")
        self._wire: tuple[bytes, bytes] | None = None
        # block offset -> weakref of the live root array of that block in this process
        self.roots: dict[int, RootRef] = {}

    def wire(self, owner_addr: bytes) -> bytes:
        """This segment as a handle carries it, with ``owner_addr`` as release address
        (see :func:`unpack_wire`); the last one made is cached."""
        cached = self._wire
        if cached and cached[0] == owner_addr:
            return cached[1]
        wire = _WIRE.pack(
            self.id, self.size, self.creator_pid, _KINDS[self.kind], self.strategy.code
        ) + owner_addr
        self._wire = (owner_addr, wire)
        return wire

    def populate(self) -> int:
        """Allocate and map every page now (``MADV_POPULATE_WRITE``); returns 0 or an errno."""
        return _populate(self.address, self.size)

    def reserve(self) -> None:
        """Allocate every page now, so no later access can fail with SIGBUS.

        ``MADV_POPULATE_WRITE`` (Linux >= 5.14) allocates the pages and maps them in this
        process in one pass: the producer's first copy then runs at memory speed instead of
        faulting page by page (256 MiB: 114 ms instead of 173 ms with ``posix_fallocate`` and
        faults, measured here; about 60 ms with the work split over 2 CPUs, see
        :func:`_populate`). Older kernels get ``posix_fallocate``. Both report running out
        of memory as an error here, never a signal later.
        """
        err = _populate(self.address, self.size)
        if err == 0:
            return
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err))
        os.posix_fallocate(self.fd, 0, self.size)

    def close(self) -> None:
        """Unmap and close the fd in this process.

        The caller guarantees that no root array of the segment is alive in this process (the
        last one may be inside its deallocation, which does not touch the memory).
        """
        if self.buffer is not None:
            self.buffer = None
            self.view = None
            _libc.munmap(self.address, self.size)
            self.strategy.unmapped(self)
            if self.creator_pid == os.getpid():
                self.strategy.remove(self)  # the creator lets it go: no handle to it is out
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def closed(self) -> bool:
        return self.buffer is None

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"fd={self.fd} roots={len(self.roots)}"
        kind = f"file {self.name[:24]}..." if self.name else "memfd"
        return (
            f"<Segment {kind} {self.kind} {format_bytes(self.size)} id={self.id.hex()[:8]} "
            f"creator={self.creator_pid} {state}>"
        )
