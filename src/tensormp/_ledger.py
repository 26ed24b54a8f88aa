"""Counts of a queue that survive the death of any process: slots, unfinished tasks, size.

Protocol
--------
A bounded queue's free slots and a ``JoinableQueue``'s unfinished tasks are counts that the
stdlib keeps in POSIX semaphores: a process killed between ``acquire`` and ``release`` takes
its unit with it, for good. Here each unit is a *token* whose owner the kernel tracks:

* A token is an open file description (OFD) of the queue's *ledger file* (a memfd) holding an
  OFD byte lock (``F_OFD_SETLK``): slot ``i`` is the lock on byte ``SLOT_BASE + i``, a task is
  a lock on a random byte of ``[TASK_BASE, TASK_BASE + TASK_SPAN)``. An OFD lock belongs to the
  open file description, not to a process, and the kernel drops it when the last fd of that
  description is closed: by ``close()``, or by the death of the last process holding one.
* ``put()`` opens a fresh OFD (``open("/proc/self/fd/N")``), locks a free slot byte (and a
  task byte), and sends the OFD's fd *inside the message's record* (``SCM_RIGHTS``, see
  ``connection.py``), then closes its own fd: from then on the kernel holds the token in
  flight, with the message, atomically. ``get()`` receives the token with the message and
  closes it (slot given back) or keeps it until ``task_done()`` (task token).
* So at every instant a token is held by exactly one of: the producer (taken, not yet sent),
  the socket (in flight), a consumer (received, not yet given back). Each of those owners
  releases it by dying: a producer killed before its ``sendmsg`` frees its slot and its task
  (the put never happened), a record that is never read frees both with the socket, a
  consumer killed after its ``recvmsg`` frees both (the item counts as done: see below).
  Nothing needs a liveness check or a lock that a dead process could hold.

Who counts: nobody. ``qsize()`` of a bounded queue *counts the locks* in the slot range
(``F_OFD_GETLK``, one call per lock found plus one per gap); ``full()`` compares that with
``maxsize``; ``JoinableQueue.join()`` waits with ``F_OFD_SETLKW`` for a read lock on the whole
task range, which the kernel grants once no task token is left (then releases it at once).

Waiting for a slot: a blocked ``put()`` sleeps in ``poll()`` on the *bell*, a datagram socket
pair: a consumer that gives a slot back rings it with the slot's index; the producer retries
that slot first, then scans from where it last found one. A consumer killed before it could
ring frees its slot all the same: the producer rescans after a back-off of 20 ms doubling to
250 ms, so a death delays a blocked ``put()`` by at most that much. Rings nobody waits for
pile up to the socket's capacity and are then dropped: a ring is a hint, never a count.

``qsize()`` of an unbounded queue has no tokens (they cost about 5 us a message): the ledger
file, mapped by every process that counts, holds a pair of counters per pid (16 bytes at
``16 * pid``; the file is sparse, a process touches one page). Only the live process with that
pid writes its pair, adding one to *put* or *got* per message; a process that later gets a
dead one's pid adds to its counts, which stay right. ``qsize()`` is the sum of puts minus the
sum of gets over the pages in use (``SEEK_DATA``). It is approximate, as the stdlib documents:
a process killed between a write and its count, or between a read and its count, leaves it
off by one for good.

Fork: a child inherits every fd, hence every token and claim, of its parent; it must not keep
them (a task token held by a forked child would make ``join()`` wait for the child). An
``os.register_at_fork`` hook closes, in the child, every token fd and claim this process
holds; the parent's copies are untouched.

``JoinableQueue``: an item whose taker died before ``task_done()`` *counts as done* (its token
died with it): ``join()`` never waits for the dead. ``task_done()`` closes a token this process
received, so it must be called by a process that got an item (the stdlib lets any process call
it).
"""

from __future__ import annotations

import collections
import errno
import fcntl
import mmap
import os
import random
import select
import socket
import struct
import time
import weakref
from multiprocessing import reduction as _mpr
from typing import Any

__all__ = ["Token", "Ledger"]

_FLOCK = struct.Struct("hhqqi4x")  # struct flock (LP64 Linux): type, whence, start, len, pid
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_F_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", 38)
_WR = fcntl.F_WRLCK
_RD = fcntl.F_RDLCK
_UN = fcntl.F_UNLCK

SLOT_BASE = 1 << 32
TASK_BASE = 1 << 40
TASK_SPAN = 1 << 40
NO_SLOT = 0xFFFFFFFF
_BELL = struct.Struct("I")
_BACKOFF_FIRST = 0.02
_BACKOFF_MAX = 0.25
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
_NO_VIEW = memoryview(b"").cast("Q")


def _lock(fd: int, cmd: int, kind: int, start: int, length: int = 1) -> bool:
    """One ``fcntl`` record-lock call; False when a set-lock conflicts (EAGAIN/EACCES)."""
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, 0, start, length, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _held(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """``(start, length)`` of some lock another OFD holds in the range, or None."""
    got = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(_WR, 0, start, length, 0))
    kind, _, s, n, _ = _FLOCK.unpack(got)
    return None if kind == _UN else (s, n)


class Token:
    """One unit of a count: an fd of an OFD holding one byte lock (see the module notes).

    Closing it gives the unit back. In a fork child, every token of the parent is closed.
    """

    __slots__ = ("fd", "index")

    def __init__(self, fd: int, index: int = NO_SLOT) -> None:
        self.fd = fd
        self.index = index  # the slot number, or NO_SLOT for a task token
        _open[fd] = self

    def close(self, _close: Any = os.close) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            if _open is not None:  # None at interpreter shutdown
                _open.pop(fd, None)
            _close(fd)

    def __del__(self) -> None:
        if self.fd >= 0:
            self.close()

    def __repr__(self) -> str:
        return f"<Token fd={self.fd} slot={self.index if self.index != NO_SLOT else '-'}>"


_open: dict[int, Token] = {}  # this process's open tokens, by fd
_ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()


class Ledger:
    """The death-proof counts of one queue (see the module notes).

    Args:
        maxsize: slots (0: unbounded, no slot tokens).
        joinable: whether items carry task tokens.
    """

    def __init__(self, maxsize: int, joinable: bool) -> None:
        self.maxsize = maxsize
        self.joinable = joinable
        fd = os.memfd_create("tensormp-queue", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _file_size())
            bell = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) if maxsize else None
        except BaseException:
            os.close(fd)
            raise
        self._setup(fd, bell)

    def _setup(self, fd: int, bell: tuple[socket.socket, socket.socket] | None) -> None:
        self._fd = fd
        self._bell = bell
        if bell is not None:
            bell[0].setblocking(False)
            bell[1].setblocking(False)
        self._counts: _Counters | None = None
        self._view = _NO_VIEW  # _counts.array once this process counts (_ci >= 0)
        self._new_process()
        _ledgers.add(self)

    def _new_process(self) -> None:
        """Forget per-process state (at start, and in a fork child)."""
        self._path = f"/proc/self/fd/{self._fd}"
        self._ci = -1  # index of our "put" counter (2 * pid), once known
        self._next = random.randrange(self.maxsize) if self.maxsize else 0
        self._hints: list[int] = []
        self.tasks: collections.deque[Token] = collections.deque()

    def __getstate__(self) -> tuple[Any, ...]:
        fds = [self._fd] + ([s.fileno() for s in self._bell] if self._bell else [])
        return (self.maxsize, self.joinable, [_mpr.DupFd(f) for f in fds])

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.maxsize, self.joinable, dups = state
        fds = [d.detach() for d in dups]
        bell = None
        if len(fds) == 3:
            bell = (socket.socket(fileno=fds[1]), socket.socket(fileno=fds[2]))
        self._setup(fds[0], bell)

    def close(self, _close: Any = os.close) -> None:
        """Close this process's fds of the ledger (tokens already taken stay valid)."""
        fd, self._fd = self._fd, -1
        for t in self.tasks:
            t.close()
        self.tasks.clear()
        if self._counts is not None:
            self._view = _NO_VIEW
            self._counts.close()
            self._counts = None
        if self._bell is not None:
            for s in self._bell:
                s.close()
        if fd >= 0:
            _close(fd)

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def _reopen(self) -> int:
        """A new open file description of the ledger file (a token to be)."""
        return os.open(self._path, os.O_RDWR | os.O_CLOEXEC)

    # -- slots ----------------------------------------------------------------------------------
    def take_slot(self, block: bool, timeout: float | None) -> Token | None:
        """A slot token, waiting up to ``timeout`` seconds (None: forever) if ``block``;
        None when no slot became free in time."""
        ofd = self._reopen()
        try:
            deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
            backoff = _BACKOFF_FIRST
            while True:
                index = self._try_slots(ofd)
                if index >= 0:
                    return Token(ofd, index)
                if not block:
                    break
                wait = backoff
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    wait = min(wait, left)
                if not self._wait_bell(wait):
                    backoff = min(backoff * 2, _BACKOFF_MAX)
        except BaseException:
            os.close(ofd)
            raise
        os.close(ofd)
        return None

    def _try_slots(self, ofd: int) -> int:
        maxsize = self.maxsize
        hints, self._hints = self._hints, []
        for i in hints:
            if i < maxsize and _lock(ofd, _F_OFD_SETLK, _WR, SLOT_BASE + i):
                self._next = (i + 1) % maxsize
                return i
        start = self._next
        for k in range(maxsize):
            i = (start + k) % maxsize
            if _lock(ofd, _F_OFD_SETLK, _WR, SLOT_BASE + i):
                self._next = (i + 1) % maxsize
                return i
        return -1

    def _wait_bell(self, timeout: float) -> bool:
        """Sleep until a ring or ``timeout``; keep the rung slot numbers as hints."""
        assert self._bell is not None
        sock = self._bell[0]
        ready = select.select([sock], [], [], timeout)[0]
        if not ready:
            return False
        hints = self._hints
        for _ in range(1024):
            try:
                data = sock.recv(_BELL.size, _MSG_DONTWAIT)
            except BlockingIOError:
                break
            if len(data) == _BELL.size:
                hints.append(_BELL.unpack(data)[0])
        return True

    def give_back(self, token: Token | None, index: int) -> None:
        """Close a slot token received with a message, and ring the bell for slot ``index``."""
        if token is not None:
            token.close()
        self.ring(index)

    def ring(self, index: int = NO_SLOT) -> None:
        if self._bell is not None:
            try:
                self._bell[1].send(_BELL.pack(index), _MSG_DONTWAIT)
            except OSError:
                pass  # full: enough rings are waiting already

    def slots_taken(self) -> int:
        """How many slot tokens exist now (taken, in flight or held)."""
        return self._count_locks(SLOT_BASE, SLOT_BASE + self.maxsize)

    def _count_locks(self, start: int, end: int) -> int:
        n = 0
        ranges = [(start, end)]
        while ranges:
            a, b = ranges.pop()
            if a >= b:
                continue
            got = _held(self._fd, a, b - a)
            if got is None:
                continue
            s, length = got
            n += 1
            ranges.append((a, s))
            ranges.append((s + max(length, 1), b))
        return n

    # -- tasks ----------------------------------------------------------------------------------
    def take_task(self) -> Token:
        """A task token (an unfinished item of a ``JoinableQueue``)."""
        ofd = self._reopen()
        try:
            for _ in range(4):
                if _lock(ofd, _F_OFD_SETLK, _WR, TASK_BASE + random.getrandbits(40)):
                    return Token(ofd)
            # A join() holds the whole range for an instant (or a 1-in-2**40 clash): wait.
            _lock(ofd, _F_OFD_SETLKW, _WR, TASK_BASE + random.getrandbits(40))
            return Token(ofd)
        except BaseException:
            os.close(ofd)
            raise

    def unfinished(self) -> bool:
        return _held(self._fd, TASK_BASE, TASK_SPAN) is not None

    def wait_all_done(self) -> None:
        """Block until no task token exists (``F_OFD_SETLKW`` of a read lock on the range)."""
        ofd = self._reopen()
        try:
            _lock(ofd, _F_OFD_SETLKW, _RD, TASK_BASE, TASK_SPAN)
        finally:
            os.close(ofd)  # releases the read lock

    # -- approximate size of an unbounded queue ---------------------------------------------------
    def _counter(self) -> int:
        if self._counts is None:
            self._counts = _Counters(self._fd)
        self._view = self._counts.array
        self._ci = 2 * os.getpid()
        return self._ci

    def count(self, got: int) -> None:
        """Count one message put (``got`` 0) or got (``got`` 1) by this process.

        No lock between this process's threads: with the GIL, ``view[i] += 1`` on a
        memoryview runs without a thread switch between its read and its write (no eval
        breaker check inside it, CPython 3.10-3.13)."""
        ci = self._ci if self._ci >= 0 else self._counter()
        self._view[ci + got] += 1

    def size(self) -> int:
        """Puts minus gets of every process that ever counted (at least 0)."""
        if self._counts is None:
            self._counts = _Counters(self._fd)
        return max(0, self._counts.balance())

    def __repr__(self) -> str:
        return f"<Ledger maxsize={self.maxsize} joinable={self.joinable} fd={self._fd}>"


def _file_size() -> int:
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
    except (OSError, ValueError):
        pid_max = 1 << 22  # the largest pid_max Linux allows
    return 16 * max(pid_max, 1 << 15)


class _Counters:
    """The ledger file mapped with ``mmap(2)`` through ctypes: Python's ``mmap`` would keep a
    duplicate fd per queue in every process that counts."""

    def __init__(self, fd: int) -> None:
        import ctypes

        size = os.fstat(fd).st_size
        libc = ctypes.CDLL(None, use_errno=True)
        mmap_fn = libc.mmap
        mmap_fn.restype = ctypes.c_void_p
        mmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                            ctypes.c_int, ctypes.c_long]
        addr = mmap_fn(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map a queue's counters: {os.strerror(err)}")
        self._munmap = libc.munmap
        self._munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._fd = fd
        self._addr = addr
        self._size = size
        self.array = memoryview((ctypes.c_uint64 * (size // 8)).from_address(addr)).cast("B").cast("Q")

    def balance(self) -> int:
        """Sum of puts minus sum of gets, over the pages any process wrote."""
        fd, size, array = self._fd, self._size, self.array
        total = 0
        pos = 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            values = array[start // 8 : end // 8]
            total += sum(values[0::2]) - sum(values[1::2])
            pos = end
        return total

    def close(self) -> None:
        addr, self._addr = self._addr, 0
        if addr:
            self.array.release()
            self._munmap(addr, self._size)


def _after_fork_in_child() -> None:
    for token in list(_open.values()):
        try:
            token.close()
        except OSError:
            pass
    _open.clear()
    for ledger in list(_ledgers):
        ledger._new_process()


os.register_at_fork(after_in_child=_after_fork_in_child)
