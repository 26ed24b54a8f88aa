"""Counts of a queue that survive the death of any process: slots, unfinished tasks, size.

Protocol
--------
The stdlib keeps a bounded queue's free slots and a ``JoinableQueue``'s unfinished tasks in
POSIX semaphores: a process killed between ``acquire`` and ``release`` takes its unit with it,
for good. Here nothing a process holds outlives it.

**Slots (bounded queues).** The items of a bounded queue are: the items of the records in the
socket, messages a producer accepted but left to its feeder thread (*reserved*), and the record
a producer is writing. The kernel counts the first kind: the consumers' ``recvmsg`` is the only
count of a get (a consumer keeps no slot, so its death costs none, and ``get()`` adds no
syscall). A
producer takes the *write lock* ``W`` (``flock(LOCK_EX)`` of the ledger file through the
process's own open file description, so the kernel drops it when the process dies; a ``flock``,
not a byte-range lock: the kernel does not walk the byte-range locks of rows and task tokens to
grant it) around: the room check, the record's write, and the book-keeping below, all in the
ledger file (a memfd every process maps):

* ``S`` items written so far (a ``put_many`` record holds ``k`` items and takes ``k`` slots);
  each record's header carries the number of its first item, ``S + 1`` (mod 2**32), and
  ``cum[j]`` (a ring of ``maxsize + 2`` words, written at each record's last item ``j``) the
  bytes of the records up to item ``j``;
* ``D`` a lower bound of the items read; the room check ``S - D + RES + k <= maxsize`` is exact
  after one ``MSG_PEEK`` of the head record (``D`` = its first item's number - 1, or ``S`` when
  empty);
* ``RES`` the reserved messages, and per process (16 bytes at ``16 * pid``) its own share, so
  that a dead producer's reservations can be subtracted (its *row lock*, an OFD lock on
  ``ROW_BASE + pid`` held for life, is gone): done after a blocked ``put()`` waited in vain
  and by ``qsize()``.

A producer killed while holding ``W`` leaves an *intent* (the record's number, item count
and length, written before its ``sendmsg``): the next holder of ``W`` finds out whether that
record was sent from ``FIONREAD`` (the bytes of all records in the socket, read between two
peeks at the same head) against ``cum``, and counts it or not. So ``qsize()`` is exact, and
a slot of a process that died is free at once (its reservations: within a blocked ``put()``'s
back-off).

Waiting for a slot: a producer that finds no room adds itself to ``WAITERS`` (and its row)
*before* it peeks, then sleeps on the *bell*, a datagram socket pair; a consumer that read a
record rings it (one datagram wakes one sleeper) when ``WAITERS`` is not 0. The peek and the
consumer's ``recvmsg`` take the same socket lock in the kernel, so either the peek sees the
read or the consumer sees the waiter: no wake-up is lost. A producer wakes after 20 ms doubling
to 250 ms without a ring all the same, to notice the dead.

**Tasks (JoinableQueue).** The queue has a *task pipe* (an anonymous pipe, created with no
writer; every process holds its read end, nobody ever writes to it). A *writer* of that pipe is
an open file description opened through ``/proc/self/fd/<read end>`` with ``O_WRONLY``. The
kernel counts a pipe's writers: open descriptions, each alive while any fd of it exists in any
process or rides in flight in a socket (``SCM_RIGHTS``), dropped when the last such reference is
closed, by ``close()`` or by the death of the last process holding one; the read end reports
``POLLHUP`` exactly while there is none. ``join()`` polls the read end until ``POLLHUP``, so the
rule is: *every unfinished task is covered by some reference to a writer*.

* A process holds at most one writer fd per queue (``_wfd``), open while it has *uses*
  (messages being put: written now, or waiting in its feeder's buffer) or items it got and has
  not marked done (``task_items``); it opens one when it needs one and has none (about 1.1 us)
  and closes it when both counts reach 0. So a process holds one fd for tasks whatever their
  number (before, one fd per buffered message and per item held: ``EMFILE`` after about a
  thousand of either with ``ulimit -n 1024``, and a consumer out of fds dropped the item).
* ``put()`` sends the writer's fd *inside the message's record*: the record in flight holds its
  own reference, so the producer's fd may close once written.
* ``get()`` receives a reference with the record: it becomes the process's writer if it holds
  none, else it is closed at once (the held one covers the item). ``task_done()`` only counts,
  and closes the writer at the process's last unfinished item (a ``put_many`` record of ``k``
  items counts ``k``).

A producer killed before its ``sendmsg`` frees its task, a consumer killed after its ``recvmsg``
too (the item counts as done): its fds close. Costs: an ``open`` per put while the process
holds no writer, a ``close`` per record got while it holds one (or at its last ``task_done()``),
whatever the number of unfinished tasks (the byte-range locks used before cost O(unfinished)
each: a ``put`` took 6.6 us with 100 tasks unfinished, 40 us with 4,000).

**Size of an unbounded queue.** No tokens, no lock: a pair of counters per pid (16 bytes at
``16 * pid``; the file is sparse) that only that process writes, one per message put or got;
``qsize()`` is the sum of puts minus gets over the pages in use (``SEEK_DATA``). Approximate,
as the stdlib documents: a process killed between a write and its count leaves it off by one.

Fork: a child inherits every fd of its parent, hence its task writer and its OFD of ``W`` and
its row: an ``os.register_at_fork`` hook closes them in the child (the parent's locks stay), and
tokens copied into the child end no use there.
"""

from __future__ import annotations

import array
import errno
import fcntl
import mmap
import os
import select
import socket
import stat as _stat
import struct
import termios
import threading
import time
import weakref
from collections.abc import Iterator
from multiprocessing import reduction as _mpr
from typing import Any

from .connection import HEADER, INLINE_MAX

__all__ = ["Token", "Ledger"]

_FLOCK = struct.Struct("hhqqi4x")  # struct flock (LP64 Linux): type, whence, start, len, pid
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
_F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
_WR = fcntl.F_WRLCK
_UN = fcntl.F_UNLCK
_LOCK_EX = fcntl.LOCK_EX
_LOCK_UN = fcntl.LOCK_UN
_TASK_OPEN = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC  # a writer of the task pipe: a token

ROW_BASE = (1 << 32) + 1  # + pid: a producer's row lock, held for its life
NO_SLOT = 0xFFFFFFFF
_M32 = 0xFFFFFFFF
_BELL = b"r"
_BACKOFF_FIRST = 0.02
_BACKOFF_MAX = 0.25
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
_MSG_PEEK = int(socket.MSG_PEEK)
_PEEK = _MSG_PEEK | _MSG_DONTWAIT
_SOL_SOCKET = int(socket.SOL_SOCKET)
_SO_RCVTIMEO = int(socket.SO_RCVTIMEO)
_TIMEVAL = struct.Struct("ll")
_NO_VIEW = memoryview(b"").cast("Q")
# Words of the bounded queue's header (after the per-pid rows), then the ring of cum[].
_S, _P_LEN, _P_SEQ, _RES, _WAITERS, _D, _P_CNT = range(7)
_LOG = 8
_SEQ_AT = 16  # offset of the record number ("slot") in a record header
_RING_MAX = (1 << 16) + 2


def _lock(fd: int, cmd: int, kind: int, start: int, length: int = 1) -> bool:
    """One ``fcntl`` record-lock call; False when a set-lock conflicts (EAGAIN/EACCES)."""
    try:
        fcntl.fcntl(fd, cmd, _FLOCK.pack(kind, 0, start, length, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True



def _written(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """The ``[start, end)`` byte ranges of ``fd``'s first ``size`` bytes that hold data (pages
    some process wrote: ``SEEK_DATA``/``SEEK_HOLE``); the holes read as zeros."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data after pos
            return
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        pos = end

def _held(fd: int, start: int, length: int) -> tuple[int, int] | None:
    """``(start, length)`` of some lock another OFD holds in the range, or None."""
    got = fcntl.fcntl(fd, _F_OFD_GETLK, _FLOCK.pack(_WR, 0, start, length, 0))
    kind, _, s, n, _ = _FLOCK.unpack(got)
    return None if kind == _UN else (s, n)


def _head(sock: socket.socket) -> int | None:
    """The record number in the header of the first record in ``sock``, or None if empty."""
    try:
        data = sock.recv(HEADER.size, _PEEK)
    except BlockingIOError:
        return None
    if len(data) < HEADER.size:
        return None
    return int.from_bytes(data[_SEQ_AT : _SEQ_AT + 4], "little")


def _inq(sock: socket.socket) -> int:
    """Bytes of all records in ``sock`` (``FIONREAD`` of a ``SOCK_SEQPACKET`` socket)."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    return buf[0]


class Token:
    """One use of this process's task writer of a queue (see the module notes): a message of a
    ``JoinableQueue`` being put, from ``put()`` until its record is written or abandoned.
    ``fd``: the writer's fd, to send with the record while the use lasts; :meth:`close` ends
    the use (once; a token copied into a fork child ends nothing there).
    """

    __slots__ = ("fd", "_ledger", "_epoch")

    def __init__(self, fd: int, ledger: Ledger, epoch: object) -> None:
        self.fd = fd
        self._ledger: Ledger | None = ledger
        self._epoch = epoch

    def close(self) -> None:
        ledger, self._ledger = self._ledger, None
        self.fd = -1
        if ledger is not None and ledger._epoch is self._epoch:
            ledger.drop_task()

    def __del__(self) -> None:
        if self._ledger is not None:
            self.close()

    def __repr__(self) -> str:
        return f"<Token fd={self.fd}>"


_ledgers: weakref.WeakSet[Ledger] = weakref.WeakSet()


class Ledger:
    """The death-proof counts of one queue (see the module notes).

    Args:
        maxsize: slots (0: unbounded).
        joinable: whether items carry task tokens.
    """

    def __init__(self, maxsize: int, joinable: bool) -> None:
        self.maxsize = maxsize
        self.joinable = joinable
        fd = os.memfd_create("tensormp-queue", os.MFD_CLOEXEC)
        bell = None
        tasks = -1
        try:
            os.ftruncate(fd, _file_size(maxsize))
            bell = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) if maxsize else None
            if joinable:  # the task pipe: its read end only (see the module notes)
                tasks, w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
                os.close(w)
        except BaseException:
            os.close(fd)
            if bell is not None:
                for sock in bell:
                    sock.close()
            raise
        self._setup(fd, bell, tasks)

    def _setup(
        self, fd: int, bell: tuple[socket.socket, socket.socket] | None, tasks: int
    ) -> None:
        self._fd = fd
        self._bell = bell
        self._tasks = tasks  # the task pipe's read end (-1: not joinable)
        if bell is not None:
            bell[0].setblocking(True)  # a sleeper waits in recv: one ring wakes one sleeper
            bell[1].setblocking(False)
        self._ring = min(self.maxsize, _RING_MAX - 2) + 2
        # The rows end where the file's tail (a bounded queue's header and log) begins: from
        # the file's own size, so every process agrees whatever pid_max says meanwhile.
        size = os.fstat(fd).st_size
        self._rows = size - (8 * (_LOG + self._ring) if self.maxsize else 0)
        self._hdr = self._rows // 8  # word index of the bounded queue's header
        self._counts: _Counters | None = None
        self._view = _NO_VIEW  # _counts.array once this process maps it
        self._mine = -1
        self._new_process()
        _ledgers.add(self)

    def _new_process(self) -> None:
        """Forget per-process state (at start, and in a fork child)."""
        if self._mine >= 0:
            os.close(self._mine)  # the parent's OFD: its locks stay the parent's
        self._mine = -1  # our own OFD: row lock for life, W while writing
        self._row = os.getpid()  # our row (our pid's, unless another live process holds it)
        self._path = f"/proc/self/fd/{self._fd}"
        self._task_name = str(self._tasks)  # in /proc/self/fd (see _fd_dir)
        self._ci = -1  # index of our "put" counter (2 * pid), once known
        self._wlock = threading.Lock()  # the threads of this process, around W
        self._reclaim_due = False
        self._rcvtimeo = 0  # the bell's SO_RCVTIMEO as this process last set it (ms)
        # Tasks (see the module notes): this process's writer of the task pipe, open while
        # it has uses (messages being put) or items got and not marked done. (In a fork child
        # the parent's was closed by _after_fork_in_child, with every other writer.)
        self._wfd = -1
        self._uses = 0
        self.task_items = 0  # items this process got and has not marked done yet
        self._returned = 0  # of those, the ones get/get_many returned (the rest: a batch's)
        self._epoch = object()  # this process's: tokens copied into a fork child end nothing
        self._tlock = threading.Lock()  # around the writer, _uses and task_items

    def __getstate__(self) -> tuple[Any, ...]:
        fds = [self._fd] + ([s.fileno() for s in self._bell] if self._bell else [])
        if self._tasks >= 0:
            fds.append(self._tasks)
        return (self.maxsize, self.joinable, [_mpr.DupFd(f) for f in fds])

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.maxsize, self.joinable, dups = state
        fds = [d.detach() for d in dups]
        tasks = fds.pop() if self.joinable else -1
        bell = None
        if len(fds) == 3:
            bell = (socket.socket(fileno=fds[1]), socket.socket(fileno=fds[2]))
        self._mine = -1
        self._setup(fds[0], bell, tasks)

    def close(self, _close: Any = os.close) -> None:
        """Close this process's fds of the ledger (tokens already taken stay valid)."""
        fd, self._fd = self._fd, -1
        mine, self._mine = self._mine, -1
        tasks, self._tasks = self._tasks, -1
        wfd, self._wfd = self._wfd, -1
        self.task_items = self._returned = 0
        if wfd >= 0:  # (no use is left: each token keeps its ledger alive)
            _close(wfd)
        if self._counts is not None:
            self._view = _NO_VIEW
            self._counts.close()
            self._counts = None
        if self._bell is not None:
            for s in self._bell:
                s.close()
        if mine >= 0:
            _close(mine)
        if tasks >= 0:
            _close(tasks)
        if fd >= 0:
            _close(fd)

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            self.close()

    def _reopen(self) -> int:
        """A new open file description of the ledger file (a token to be)."""
        return os.open(self._path, os.O_RDWR | os.O_CLOEXEC)

    def _map(self) -> memoryview:
        if self._counts is None:
            self._counts = _Counters(self._fd)
        self._view = self._counts.array
        return self._view

    # -- slots of a bounded queue: W, room, writes ------------------------------------------------
    def enter(self, sock: socket.socket, block: bool, timeout: float | None, k: int = 1) -> bool:
        """Take ``W`` and ``k`` free slots (``1 <= k <= maxsize``), waiting up to ``timeout``
        seconds (None: forever) if ``block``. True: the caller holds ``W`` and must
        :meth:`write` or :meth:`reserve` one record of ``k`` items, then :meth:`leave`.
        False: the slots did not become free in time (nothing held).

        ``sock`` is the queue's reading end (peeked at, never read)."""
        self._take_w(sock)
        view, hdr = self._view, self._hdr  # the usual case: room, by the counts alone
        taken = view[hdr + _S] - view[hdr + _D] + view[hdr + _RES]
        if taken <= self.maxsize - k and not self._reclaim_due:
            return True
        return self._wait_room(sock, block, timeout, k)

    def _wait_room(self, sock: socket.socket, block: bool, timeout: float | None, k: int) -> bool:
        """:meth:`enter` when the counts show no room: peek, wait for rings (called holding
        W; returns holding it when True, not holding it when False)."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        backoff = _BACKOFF_FIRST
        hdr, room = self._hdr, self.maxsize - k
        waiting = False  # this call is counted in WAITERS
        held = True
        while True:
            if not held:
                self._take_w(sock)
            held = False
            try:
                view = self._view
                if self._reclaim_due:
                    self._reclaim()
                if not waiting and view[hdr + _S] - view[hdr + _D] + view[hdr + _RES] <= room:
                    return True
                if not waiting:  # first count us, then look (see the module notes)
                    waiting = True
                    self._wait_count(1)
                self._refresh(sock)
                if view[hdr + _S] - view[hdr + _D] + view[hdr + _RES] <= room:
                    waiting = False
                    self._wait_count(-1)
                    return True
                wait = backoff if block else 0.0
                if deadline is not None:
                    wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    waiting = False
                    self._wait_count(-1)
            except BaseException:
                if waiting:
                    self._wait_count(-1)
                self._leave_w()
                raise
            self._leave_w()
            if not waiting:
                return False
            try:
                rung = self._sleep(wait, deadline is not None)
            except BaseException:
                self._take_w(sock)
                try:
                    self._wait_count(-1)
                finally:
                    self._leave_w()
                raise
            if not rung:
                backoff = min(backoff * 2, _BACKOFF_MAX)
                self._reclaim_due = True  # a dead producer may hold reservations

    def enter_reserved(self, sock: socket.socket) -> None:
        """Take ``W`` to write a message whose slot is already reserved (the feeder)."""
        self._take_w(sock)

    def _take_w(self, sock: socket.socket) -> None:
        self._wlock.acquire()
        try:
            view = self._view if self._counts is not None else self._map()
            mine = self._mine
            if mine < 0:
                mine = self._claim_row()
            fcntl.flock(mine, _LOCK_EX)
        except BaseException:
            self._wlock.release()
            raise
        if view[self._hdr + _P_LEN]:
            try:
                self._resolve(sock)
            except BaseException:
                self._leave_w()
                raise

    def _leave_w(self) -> None:
        try:
            fcntl.flock(self._mine, _LOCK_UN)
        finally:
            self._wlock.release()

    leave = _leave_w  # what enter() and enter_reserved() took

    def _claim_row(self) -> int:
        """Open our OFD and lock our row (once per process), before taking W."""
        mine = self._reopen()
        try:
            rows = self._rows // 16
            # Our pid's row; taken only if a process of another pid namespace has our pid.
            for row in (self._row, *range(rows - 1, 0, -1)):
                if _lock(mine, _F_OFD_SETLK, _WR, ROW_BASE + row):
                    break
            else:
                raise OSError(errno.EMFILE, f"no free row in {self!r}")
            self._row = row
            fcntl.flock(mine, _LOCK_EX)
            try:  # what a dead process left in this row is not ours
                self._forget_row(row)
            finally:
                fcntl.flock(mine, _LOCK_UN)
        except BaseException:
            os.close(mine)
            raise
        self._mine = mine
        return mine

    def _forget_row(self, row: int) -> None:
        """Subtract a dead process's reservations and waiters (holding W)."""
        view, hdr = self._view, self._hdr
        i = 2 * row
        if view[i] or view[i + 1]:
            view[hdr + _RES] -= view[i]
            view[hdr + _WAITERS] -= view[i + 1]
            view[i] = view[i + 1] = 0

    def _wait_count(self, delta: int) -> None:
        """Count a sleeper in or out of WAITERS and our row (holding W)."""
        view = self._view
        view[self._hdr + _WAITERS] += delta
        view[2 * self._row + 1] += delta

    def _refresh(self, sock: socket.socket) -> None:
        """D from the number of the head record's first item (holding W: no record is being
        written)."""
        view, hdr = self._view, self._hdr
        s = view[hdr + _S]
        h = _head(sock)
        inside = 0 if h is None else (s - h + 1) & _M32
        if inside <= s and inside <= self.maxsize:
            view[hdr + _D] = max(view[hdr + _D], s - inside)

    def _sleep(self, timeout: float, timed: bool) -> bool:
        """Sleep until a ring or ``timeout``; True when rung."""
        assert self._bell is not None
        sock = self._bell[0]
        if timed:  # poll has this caller's own timeout (SO_RCVTIMEO is the socket's, shared)
            if not select.select([sock], [], [], timeout)[0]:
                return False
            try:
                sock.recv(8, _MSG_DONTWAIT)
            except BlockingIOError:
                pass  # another sleeper took that ring
            return True
        ms = max(1, int(timeout * 1000))
        if ms != self._rcvtimeo:  # the socket's, shared by all sleepers: any back-off will do
            self._rcvtimeo = ms
            sock.setsockopt(_SOL_SOCKET, _SO_RCVTIMEO, _TIMEVAL.pack(ms // 1000, ms % 1000 * 1000))
        try:
            sock.recv(8)
        except (BlockingIOError, TimeoutError):
            return False
        return True

    def write(
        self, writer: Any, data: Any, fds: Any, tokens: Any, block: bool, k: int = 1
    ) -> bool:
        """Write one record of ``k`` items through ``writer`` (``Connection.write_record``)
        holding W, with its intent and count (see the module notes). True when written."""
        view, hdr, ring = self._view, self._hdr, self._ring
        s = view[hdr + _S]
        n = len(data)
        length = HEADER.size + (n if n <= INLINE_MAX else 0)
        view[hdr + _LOG + (s + k) % ring] = view[hdr + _LOG + s % ring] + length
        view[hdr + _P_SEQ] = s + 1
        view[hdr + _P_CNT] = k
        view[hdr + _P_LEN] = length
        try:
            sent: bool = writer.write_record(data, fds, tokens, (s + 1) & _M32, block)
        except BaseException:
            view[hdr + _P_LEN] = 0
            raise
        if sent:
            view[hdr + _S] = s + k
        view[hdr + _P_LEN] = 0
        return sent

    def reserve(self, count: int = 1) -> None:
        """Count the ``count`` items of a record left to the feeder (holding W); ``-count``
        once written or dropped."""
        view = self._view
        view[self._hdr + _RES] += count
        view[2 * self._row] += count

    def _resolve(self, sock: socket.socket) -> None:
        """The previous holder of W died while writing: count its record if it was sent."""
        view, hdr = self._view, self._hdr
        s, length, k = view[hdr + _S], view[hdr + _P_LEN], max(1, view[hdr + _P_CNT])
        if view[hdr + _P_SEQ] == s + 1:  # else it was counted already
            view[hdr + _S] = s + k * self._sent(sock, s, length, k)
        view[hdr + _P_LEN] = 0

    def _sent(self, sock: socket.socket, s: int, length: int, k: int) -> int:
        """1 if the record of items ``s + 1 .. s + k`` (``length`` bytes) is in the socket,
        else 0 (holding W)."""
        view, log, ring = self._view, self._hdr + _LOG, self._ring
        pending = (s + 1) & _M32
        for _ in range(1000):
            h = _head(sock)
            inq = _inq(sock)
            if _head(sock) != h:
                continue  # a record was read meanwhile: look again
            if h is None:
                return 0  # nothing left: sent or not, it is not in the queue
            inside = 0 if h == pending else (s - h + 1) & _M32  # written items before it
            if inside > s or inside + k > ring - 2:
                return 1  # beyond the log: count it (at worst k slots too many)
            before = view[log + s % ring] - view[log + (s - inside) % ring]
            if inq == before + length:
                return 1
            if inq == before:
                return 0
        return 1

    def _reclaim(self) -> None:
        """Subtract the reservations and waiters of dead processes (holding W)."""
        self._reclaim_due = False
        view, fd = self._view, self._fd
        for start, end in _written(fd, self._rows):
            for i in range(start // 8 & ~1, end // 8, 2):
                if (view[i] or view[i + 1]) and i // 2 != self._row:
                    if _held(fd, ROW_BASE + i // 2, 1) is None:
                        self._forget_row(i // 2)

    def slots_taken(self, sock: socket.socket) -> int:
        """Items now in a bounded queue: in the socket, being written, reserved."""
        self._take_w(sock)
        try:
            view, hdr = self._view, self._hdr
            if view[hdr + _RES] or view[hdr + _WAITERS]:
                self._reclaim()
            self._refresh(sock)
            return max(0, view[hdr + _S] - view[hdr + _D] + view[hdr + _RES])
        finally:
            self._leave_w()

    def waiters(self) -> int:
        """Producers sleeping for a slot (0 when nobody needs a ring)."""
        view = self._view if self._counts is not None else self._map()
        return view[self._hdr + _WAITERS]

    def ring(self) -> None:
        if self._bell is not None:
            try:
                self._bell[1].send(_BELL, _MSG_DONTWAIT)
            except OSError:
                pass  # full: enough rings are waiting already

    # -- tasks ----------------------------------------------------------------------------------
    def take_task(self) -> int:
        """Start a use of this process's task writer, for one message being put (see the module
        notes), and return its fd; opens the writer if this process holds none. End the use
        with :meth:`drop_task` once the record is written (the kernel holds a reference in
        flight then) or abandoned, or hand it to a :meth:`token`.

        Raises:
            OSError: no fd left in this process (``EMFILE``).
        """
        with self._tlock:
            fd = self._wfd
            if fd < 0:
                fd = self._wfd = os.open(self._task_name, _TASK_OPEN, dir_fd=_fd_dir())
            self._uses += 1
        return fd

    def token(self, fd: int) -> Token:
        """The use that :meth:`take_task` started (its ``fd``) as an object that ends it."""
        return Token(fd, self, self._epoch)

    def drop_task(self) -> None:
        """End a use that :meth:`take_task` started."""
        with self._tlock:
            self._uses -= 1
            self._close_if_idle()

    def _close_if_idle(self) -> None:
        """Close the writer when no use and no unfinished item needs it (holding ``_tlock``)."""
        if self._uses == 0 and self.task_items == 0 and self._wfd >= 0:
            fd, self._wfd = self._wfd, -1
            os.close(fd)

    def keep_task(self, fd: int, items: int) -> None:
        """This process took a record of ``items`` items with the task writer ``fd``: ``fd``
        becomes this process's writer, or is closed if it holds one already."""
        with self._tlock:
            if self._wfd < 0:
                self._wfd = fd
            else:
                os.close(fd)
            self.task_items += items

    def returned(self, n: int) -> None:
        """``get``/``get_many`` returned ``n`` items this process took (items of a batch that
        the queue keeps for a later ``get`` are taken, not returned: they cannot be done)."""
        with self._tlock:
            self._returned += n

    def task_done(self) -> None:
        """One item returned to this process is done; the writer closes at its last unfinished
        item (if no put needs it).

        Raises:
            ValueError: more calls than items returned.
        """
        with self._tlock:  # threads of this process: one decrement at a time, in one step
            if self._returned <= 0:  # with the count (a count read before could be stale)
                raise ValueError("task_done() called too many times")
            self._returned -= 1
            self.task_items -= 1
            self._close_if_idle()

    def wait_all_done(self) -> None:
        """Block until no task writer exists: the task pipe's read end reports ``POLLHUP``."""
        while not self._tasks_hup(None):
            pass

    def _tasks_hup(self, timeout: float | None) -> bool:
        """One ``poll`` of the task pipe's read end (``timeout`` ms, None: until an event):
        True when it has no writer."""
        poller = select.poll()
        poller.register(self._tasks, select.POLLIN)
        events = poller.poll(timeout)
        if events and events[0][1] & select.POLLIN:  # nobody writes tokens: drop any bytes
            try:
                os.read(self._tasks, 1 << 16)
            except BlockingIOError:
                pass
        return bool(events) and bool(events[0][1] & select.POLLHUP)

    # -- approximate size of an unbounded queue ---------------------------------------------------
    def _counter(self) -> int:
        self._map()
        self._ci = 2 * os.getpid()
        return self._ci

    def count(self, got: int, n: int = 1) -> None:
        """Count ``n`` items put (``got`` 0) or got (``got`` 1) by this process.

        No lock between this process's threads: with the GIL, ``view[i] += 1`` on a
        memoryview runs without a thread switch between its read and its write (no eval
        breaker check inside it, CPython 3.10-3.13)."""
        ci = self._ci if self._ci >= 0 else self._counter()
        self._view[ci + got] += n

    def size(self) -> int:
        """Puts minus gets of every process that ever counted (at least 0)."""
        if self._counts is None:
            self._counts = _Counters(self._fd)
        return max(0, self._counts.balance(self._rows))

    def __repr__(self) -> str:
        return f"<Ledger maxsize={self.maxsize} joinable={self.joinable} fd={self._fd}>"


def _pid_area() -> int:
    """Bytes of the per-pid rows (16 per pid), a whole number of pages."""
    try:
        with open("/proc/sys/kernel/pid_max") as f:
            pid_max = int(f.read())
    except (OSError, ValueError):
        pid_max = 1 << 22  # the largest pid_max Linux allows
    size = 16 * max(pid_max, 1 << 15)
    return -(-size // mmap.PAGESIZE) * mmap.PAGESIZE


def _file_size(maxsize: int) -> int:
    if not maxsize:
        return _pid_area()
    return _pid_area() + 8 * (_LOG + min(maxsize, _RING_MAX - 2) + 2)


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

    def balance(self, size: int) -> int:
        """Sum of puts minus sum of gets, over the pages any process wrote in ``[0, size)``."""
        array = self.array
        total = 0
        for start, end in _written(self._fd, size):
            values = array[start // 8 : end // 8]
            total += sum(values[0::2]) - sum(values[1::2])
        return total

    def close(self) -> None:
        addr, self._addr = self._addr, 0
        if addr:
            self.array.release()
            self._munmap(addr, self._size)


_fd_dirs = [-1]  # this process's /proc/self/fd, once opened (O_PATH)


def _fd_dir() -> int:
    """An fd of this process's ``/proc/self/fd``: an ``open`` relative to it walks one name, not
    four (a task writer: 1.1 us against 1.45)."""
    fd = _fd_dirs[0]
    if fd < 0:
        fd = _fd_dirs[0] = os.open("/proc/self/fd", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    return fd


def _close_task_writers(pipes: set[tuple[int, int]]) -> None:
    """Close every fd of this process that is a writer of one of the task pipes ``pipes``
    (``(st_dev, st_ino)``): in a fork child, the parent's writer, and the writers of records
    that another thread of the parent had received and not yet kept or closed when it forked
    (a writer the child holds would make ``join()`` wait for the child)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
            if not _stat.S_ISFIFO(st.st_mode) or (st.st_dev, st.st_ino) not in pipes:
                continue
            if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
                os.close(fd)
        except OSError:  # (the listing's own fd, closed since)
            continue


def _after_fork_in_child() -> None:
    fd, _fd_dirs[0] = _fd_dirs[0], -1
    if fd >= 0:  # the parent's fd table, not ours
        os.close(fd)
    pipes = set()
    for ledger in list(_ledgers):
        if ledger._tasks >= 0:
            ledger._wfd = -1  # closed with every other writer of the pipe below
            st = os.fstat(ledger._tasks)
            pipes.add((st.st_dev, st.st_ino))
    if pipes:
        _close_task_writers(pipes)
    for ledger in list(_ledgers):
        ledger._new_process()


os.register_at_fork(after_in_child=_after_fork_in_child)
