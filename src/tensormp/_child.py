"""What every tensormp child does at start-up, and how a ``spawn()`` child reports back.

Design note
-----------
**Children never outlive their parent.** Every tensormp ``Process`` (and so every ``Pool`` and
executor worker, and every ``spawn()`` rank) runs :func:`at_bootstrap` first thing in
``Process._bootstrap``, in the child, before the target. It arms two independent kernel
mechanisms; neither needs a thread, the GIL or any cooperation from the parent:

1. *Watchdog on the logical parent.* Every stdlib start method hands the child a
   ``parent_sentinel``: the read end of a pipe whose write end the parent holds until the
   child has been joined (fork: ``popen_fork``; spawn: the pipe the process object came
   through; forkserver: the same pipe, although the real parent is the fork server). The
   parent never writes to it after start-up, so it becomes readable only at EOF, when the
   parent is gone. The child puts the pipe in async mode (``O_ASYNC``, ``F_SETOWN`` = itself,
   ``F_SETSIG`` = ``SIGKILL``): when the last write end closes, the kernel's ``kill_fasync``
   sends ``SIGKILL`` to the child. This covers forkserver children (whose real parent is the
   fork server), processes started from short-lived threads, and grandchildren (each level
   watches its own parent, so the kill cascades). ``F_SETOWN`` pins the owner's ``struct
   pid``, so a recycled pid is never signalled. After arming, the child polls the pipe once:
   a parent that died before that is caught too.
2. *PR_SET_PDEATHSIG = SIGKILL.* It covers what the pipe misses: a write end kept open by
   another process (a process the parent forked with ``os.fork``; a fork-start sibling, which
   inherits its elder siblings' write ends). It fires when the *thread* that forked the child
   exits, so the parent records in ``start()`` (:func:`before_start`) whether it ran on the
   main thread, and the child sets it only then (or under forkserver, whose forking thread is
   the server's main thread). A ``Process`` started from a short-lived thread (or a ``Pool``
   worker replaced by the pool's handler thread) relies on the watchdog alone. A parent that
   died before the child armed it is caught by comparing ``getppid()`` with the parent's pid
   (fork and spawn, whose real parent is the logical one).

A normally exiting parent is unaffected: the stdlib joins non-daemon children (and terminates
daemonic ones) in its exit handler *before* the finalizers close the write ends, so no child is
killed early. A parent that dies any other way (``os._exit``, ``SIGKILL``, a crash) takes its
children with it, with ``SIGKILL``: no clean-up runs in them, and none is needed for
tensormp's memory, which the kernel frees with the last fd and mapping.

**The spawn report channel** (:func:`spawn_entry` in the child, :func:`read_channel` in the
parent). ``spawn()`` gives each rank one ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair; the child
gets one end as a ``Process`` argument. Only the child writes; each message is one datagram
(atomic: it arrives whole or not at all) of a tag plus ``SCM_RIGHTS`` fds:

* ``S`` (started), fds ``[crash log]``: sent before ``fn`` is unpickled. The crash log is a
  memfd on which the child enables ``faulthandler``; a SIGSEGV/SIGABRT/SIGBUS/SIGFPE/SIGILL
  writes the child's Python stacks there.
* ``E`` + ``<Q`` payload length, fds ``[payload]``: the error report, written *completely* into
  a memfd before the message is sent (a SIGKILL while writing leaves no message, never half a
  message). The payload is text (type, message, traceback) capped by the child
  (``_MAX_TRACEBACK``), so a truncated one is still readable.
* ``R`` + ``<QI`` payload length, fd count, fds ``[payload, array fds...]`` (more than 252
  array fds travel in one bag, ``_fdpass.py``: still one datagram): the return value, pickled
  with tensormp's reducers (arrays cross as shared memory).

The child never blocks on the channel: each rank sends at most a few small datagrams, far below
the socket buffer, and payloads go into memfds. The parent reads only after the child has
exited, with ``MSG_DONTWAIT``, at most ``_MAX_MESSAGES`` datagrams, and ``pread``s at most
``_MAX_REPORT_BYTES`` of an error report and ``_MAX_CRASH_LOG`` of a crash log: a huge, forged
or half-written report can cost the parent a bounded read, never a hang. Nothing is written to
the file system, so nothing is left in the temp directory, whoever dies.

Who dies when: a child SIGKILLed at any point has either sent a complete message or none; the
parent reports its exit code or signal (with the crash log when there is one). A parent
SIGKILLed takes the children with it (above); fds in flight die with the socket.

This module imports nothing heavy (no numpy, no torch): spawn children import those only when
``fn`` or its arguments need them.
"""

from __future__ import annotations

import faulthandler
import fcntl
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
from typing import Any, NamedTuple

from . import _fdpass

__all__ = [
    "before_start",
    "at_bootstrap",
    "FnByValue",
    "spawn_entry",
    "ChannelReport",
    "read_channel",
]

# -- parent-death hygiene ---------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)  # Linux value; the fcntl module has it on glibc
_PARENT_DEATH_SIGNAL = signal.SIGKILL
_watch_fd: int | None = None


def before_start(process: Any) -> None:
    """Parent side, in ``Process.start()``: record what the child needs to know.

    Records the start method and whether ``start()`` runs on the main thread:
    ``PR_SET_PDEATHSIG`` fires when the forking *thread* exits, so it is only safe from a
    thread that lives as long as the process.
    """
    method = getattr(process, "_start_method", None)
    if method is None:  # tensormp.Process: the default context decides at start()
        from .context import get_context

        method = get_context().get_start_method()
    process.__dict__["_tensormp_method"] = method
    process.__dict__["_tensormp_main_thread"] = (
        threading.current_thread() is threading.main_thread()
    )


def at_bootstrap(process: Any, parent_sentinel: int | None) -> None:
    """Child side, first thing in ``Process._bootstrap``: die when the parent dies.

    Best effort by design: a failure to arm (a kernel without ``F_SETSIG``, a seccomp filter)
    never keeps the child from running its target.
    """
    state = process.__dict__
    by_server = state.get("_tensormp_method") == "forkserver"
    if by_server or state.get("_tensormp_main_thread", False):
        _set_pdeathsig(_PARENT_DEATH_SIGNAL)
    if not by_server and os.getppid() != getattr(process, "_parent_pid", None):
        # Our parent forked us and has died since (we were reparented), before pdeathsig
        # was armed; the watchdog may not see it if another process holds the pipe open.
        os.kill(os.getpid(), _PARENT_DEATH_SIGNAL)
    if parent_sentinel is not None:
        try:
            _watch_parent(parent_sentinel)
        except OSError:
            pass


def _set_pdeathsig(sig: int) -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the watchdog still works
        pass


def _watch_parent(sentinel: int) -> None:
    """Arm ``SIGKILL`` on EOF of ``sentinel`` (see the module notes), then check it once."""
    global _watch_fd
    fd = os.dup(sentinel)  # ours (close-on-exec): whatever the stdlib does with its copy
    try:
        fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        fcntl.fcntl(fd, _F_SETSIG, int(_PARENT_DEATH_SIGNAL))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    except OSError:
        os.close(fd)
        raise
    if _watch_fd is not None:  # a fork child that itself started as a tensormp Process
        try:
            os.close(_watch_fd)
        except OSError:
            pass
    _watch_fd = fd
    if _parent_gone(fd):  # died before we armed: kill_fasync will not fire again
        os.kill(os.getpid(), _PARENT_DEATH_SIGNAL)


def _parent_gone(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    for _, events in poller.poll(0):
        if events & select.POLLHUP:
            return True
        if events & select.POLLIN:
            os.set_blocking(fd, False)
            try:
                return os.read(fd, 1) == b""
            except BlockingIOError:
                return False
            finally:
                os.set_blocking(fd, True)
    return False


# -- the spawn report channel: wire format ----------------------------------------------------

_TAG_STARTED = b"S"
_TAG_ERROR = b"E"
_TAG_RESULT = b"R"
_ERROR_HEAD = struct.Struct("<Q")
_RESULT_HEAD = struct.Struct("<QI")
_MAX_DATAGRAM = 64
_MAX_MESSAGES = 16  # at most 3 are legitimate
_MAX_REPORT_BYTES = 1 << 20  # the parent reads at most this much of an error report
_MAX_CRASH_LOG = 64 << 10  # ... and of a faulthandler log
_MAX_MESSAGE_CHARS = 8 << 10  # the child keeps this much of an exception message ...
_MAX_TRACEBACK = 256 << 10  # ... and of its traceback (head and tail)
_REPORT_MAGIC = "tensormp-error-report 1\n"


def _memfd_with(data: bytes | bytearray | memoryview, name: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    except BaseException:
        os.close(fd)
        raise
    return fd


def _send(sock: socket.socket, head: bytes, fds: list[int]) -> None:
    _fdpass.sendmsg(sock, [head], fds)


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters omitted ...]\n{text[-half:]}"


def _safe_str(obj: object) -> str:
    try:
        return str(obj)
    except BaseException as e:  # a broken __str__ must not lose the report
        return f"<str() failed: {type(e).__name__}>"


def _encode_report(exc: BaseException, context: str) -> bytes:
    import traceback

    kind = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    message = _clip(_safe_str(exc), _MAX_MESSAGE_CHARS)
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # noqa: BLE001 - anything, rather than no report
        text = f"{kind}: {message}\n"
    if context:
        text = f"({context})\n{text}"
    fields = [("type", kind), ("message", message), ("traceback", _clip(text, _MAX_TRACEBACK))]
    out = [_REPORT_MAGIC]
    for name, value in fields:
        out.append(f"{name} {len(value)}\n{value}\n")
    return "".join(out).encode("utf-8", "backslashreplace")


class ErrorReport(NamedTuple):
    """An exception raised in a child, as the parent read it (text only)."""

    type: str
    message: str
    traceback: str
    note: str  # empty, or why the report is incomplete


def _decode_report(raw: bytes, announced: int) -> ErrorReport:
    note = ""
    if len(raw) < announced:
        note = f"the error report is truncated ({len(raw)} of {announced} bytes)"
    text = raw.decode("utf-8", "replace")
    if not text.startswith(_REPORT_MAGIC):
        return ErrorReport("", "", "", "the error report is unreadable (bad header)")
    fields: dict[str, str] = {}
    pos = len(_REPORT_MAGIC)
    while pos < len(text):
        line_end = text.find("\n", pos)
        if line_end < 0:
            break
        name, _, size = text[pos:line_end].partition(" ")
        if not size.isdigit():
            note = note or "the error report is unreadable (corrupt field)"
            break
        start = line_end + 1
        fields[name] = text[start : start + int(size)]
        if start + int(size) > len(text):
            note = note or "the error report is truncated"
            break
        pos = start + int(size) + 1
    return ErrorReport(
        fields.get("type", ""), fields.get("message", ""), fields.get("traceback", ""), note
    )


# -- the child side ---------------------------------------------------------------------------


class FnByValue:
    """``fn`` pickled by value (cloudpickle) for a child that could not import it by name."""

    __slots__ = ("data", "name")

    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.name = name

    def __reduce__(self) -> Any:
        return FnByValue, (self.data, self.name)

    def load(self) -> Any:
        return pickle.loads(self.data)  # imports cloudpickle here, in the child, if needed

    def __repr__(self) -> str:
        return f"<fn {self.name} by value, {len(self.data)} bytes>"


_sigint_received = False
_channel: socket.socket | None = None  # this rank's end, for tests that forge reports
_crash_log_fd: int | None = None


def _on_sigint(signum: int, frame: Any) -> None:
    global _sigint_received
    if _sigint_received:
        return  # a second Ctrl-C while we are already stopping: one traceback-free exit
    _sigint_received = True
    raise KeyboardInterrupt


def _die_of_sigint() -> None:
    """A Ctrl-C at the terminal reached this child too: exit quietly, by SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not interrupt this
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)  # not reached


def _started(sock: socket.socket) -> None:
    global _crash_log_fd
    fd = os.memfd_create("tensormp-crash-log", os.MFD_CLOEXEC)
    faulthandler.enable(file=fd, all_threads=True)
    _crash_log_fd = fd  # stays open: faulthandler writes to it at a crash
    try:
        _send(sock, _TAG_STARTED, [fd])
    except ConnectionError:  # the parent dropped its ProcessContext: run fn all the same
        pass


def _send_error(sock: socket.socket, exc: BaseException, context: str = "") -> None:
    try:
        payload = _encode_report(exc, context)
        fd = _memfd_with(payload, "tensormp-error-report")
        try:
            _send(sock, _TAG_ERROR + _ERROR_HEAD.pack(len(payload)), [fd])
        finally:
            os.close(fd)
    except BaseException:  # noqa: BLE001 - the parent is gone or the channel broke
        import traceback

        print(f"tensormp: could not report this error to the parent ({context or 'fn'}):",
              file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__)


def _send_result(sock: socket.socket, result: Any) -> None:
    from . import reducers

    msg = reducers.dumps(result)
    fd = _memfd_with(msg.data, "tensormp-return-value")
    bag = -1
    try:
        attach, bag = _fdpass.pack(msg.fds, _fdpass.MAX_FDS - 1)
        head = _TAG_RESULT + _RESULT_HEAD.pack(len(msg.data), len(msg.fds))
        _send(sock, head, [fd, *attach])
    finally:
        os.close(fd)
        if bag >= 0:
            os.close(bag)
        del msg  # the kernel holds the fds in flight now


def spawn_entry(
    fn: Any,
    index: int,
    args: tuple[Any, ...],
    sock: socket.socket,
    env: dict[str, str] | None,
    return_value: bool,
) -> None:
    """The target of every ``spawn()`` rank: run ``fn(index, *args)`` and report to the parent.

    Exit status: 0 when ``fn`` returned, 1 after an error report, ``sys.exit``'s code, or
    death by ``SIGINT`` (after ``finally`` blocks ran, with no traceback) when a SIGINT reached
    the rank: a Ctrl-C at the terminal, or the parent forwarding one. A ``KeyboardInterrupt``
    that ``fn`` raises itself is an error, reported as any other.
    """
    global _channel
    _channel = sock
    # The parent blocked SIGINT around start() (spawn, fork): nothing before this point can
    # print a KeyboardInterrupt traceback. Take it over, then let a pending one in. A parent
    # that ignores SIGINT (nohup, a background job) has children that ignore it too, as with
    # the stdlib.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        _started(sock)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        if env:
            os.environ.update(env)
        target = fn.load() if isinstance(fn, FnByValue) else fn
        result = target(index, *args)
    except SystemExit:
        raise
    except KeyboardInterrupt as e:
        if _sigint_received:
            _die_of_sigint()
        _send_error(sock, e)
        sys.exit(1)
    except BaseException as e:
        # The parent stops the other ranks with SIGTERM after a first failure: when this rank
        # has failed too, its own report must still get out. Ignored, not blocked: a blocked
        # signal would still kill us through any other thread that does not block it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _send_error(sock, e)
        sys.exit(1)
    if return_value:
        try:
            _send_result(sock, result)
        except KeyboardInterrupt:
            _die_of_sigint()
        except ConnectionError:  # nobody is listening for it any more
            pass
        except BaseException as e:
            _send_error(sock, e, "sending the return value to the parent")
            sys.exit(1)


# -- the parent side --------------------------------------------------------------------------


class ChannelReport:
    """What one rank sent, read by the parent after the rank exited.

    Attributes:
        started: the rank reached ``fn`` (sent ``S``); False means it died during start-up
            (importing the main module, unpickling ``fn`` or its arguments).
        error: the error report, or None.
        result: ``(pickle bytes, fds)`` of the return value, or None; the fds are owned by
            this object until :meth:`take_result`.
        note: why something could not be read (empty when all was well).
    """

    def __init__(self) -> None:
        self.started = False
        self.error: ErrorReport | None = None
        self.result: tuple[bytes, list[int]] | None = None
        self.note = ""
        self._crash_fd: int | None = None

    def crash_log(self) -> str:
        """The faulthandler output of the rank (at most ``_MAX_CRASH_LOG`` bytes), or ''."""
        if self._crash_fd is None:
            return ""
        try:
            raw = os.pread(self._crash_fd, _MAX_CRASH_LOG, 0)
        except OSError:
            return ""
        return raw.decode("utf-8", "replace").strip()

    def take_result(self) -> tuple[bytes, list[int]] | None:
        result, self.result = self.result, None
        return result

    def close(self) -> None:
        fds = [] if self.result is None else self.result[1]
        if self._crash_fd is not None:
            fds.append(self._crash_fd)
        self.result = None
        self._crash_fd = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _recv(sock: socket.socket) -> tuple[bytes, list[int]] | None:
    """One datagram without blocking, or None when there is none (or EOF)."""
    try:
        data, anc, flags, _ = sock.recvmsg(
            _MAX_DATAGRAM, _fdpass.ANC_SPACE, socket.MSG_DONTWAIT | socket.MSG_CMSG_CLOEXEC
        )
    except (BlockingIOError, InterruptedError):
        return None
    fds = _fdpass.fds_of(anc)
    if not data and not fds:
        return None  # EOF
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        for fd in fds:
            os.close(fd)
        return b"?", []
    return data, fds


def _pread_all(fd: int, want: int) -> bytes:
    chunks = []
    got = 0
    while got < want:
        chunk = os.pread(fd, min(want - got, 1 << 24), got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_channel(sock: socket.socket) -> ChannelReport:
    """Parent side: read what a rank sent, without blocking (call after the rank exited).

    Never raises for bad input: whatever cannot be read is described in ``report.note``.
    """
    report = ChannelReport()
    for _ in range(_MAX_MESSAGES):
        try:
            got = _recv(sock)
        except OSError as e:
            report.note = report.note or f"the report channel failed: {e}"
            break
        if got is None:
            break
        data, fds = got
        tag, body = data[:1], data[1:]
        if tag == _TAG_STARTED and len(fds) == 1 and not report.started:
            report.started = True
            report._crash_fd = fds[0]
        elif tag == _TAG_ERROR and len(body) == _ERROR_HEAD.size and len(fds) == 1:
            (announced,) = _ERROR_HEAD.unpack(body)
            try:
                raw = os.pread(fds[0], min(announced, _MAX_REPORT_BYTES), 0)
            except OSError as e:
                report.note = f"the error report could not be read: {e}"
            else:
                report.error = _decode_report(raw, announced)
                if announced > _MAX_REPORT_BYTES:
                    report.error = report.error._replace(
                        note=f"{report.error.note or 'the error report is truncated'}: it is "
                        f"{announced} bytes, the parent reads at most {_MAX_REPORT_BYTES}"
                    )
            finally:
                os.close(fds[0])
        elif tag == _TAG_RESULT and len(body) == _RESULT_HEAD.size and fds and report.result is None:
            length, nfds = _RESULT_HEAD.unpack(body)
            payload_fd, *attached = fds
            try:
                if length > os.fstat(payload_fd).st_size:
                    raise OSError(f"{length} bytes announced, fewer written")
                data = _pread_all(payload_fd, length)
            except OSError as e:
                report.note = f"the return value could not be read: {e}"
                _fdpass.close_all(attached)
            else:
                try:  # unpack owns the fds: it closes them all on error
                    report.result = (data, _fdpass.unpack(attached, nfds, _fdpass.MAX_FDS - 1))
                except OSError as e:
                    report.note = f"the return value lost some of its file descriptors: {e}"
            finally:
                os.close(payload_fd)
        else:
            report.note = report.note or f"unexpected message {data[:16]!r} on the report channel"
            for fd in fds:
                os.close(fd)
    return report
