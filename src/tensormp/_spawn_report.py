"""How each ``spawn()`` rank reports back to its parent: the wire format, the child's senders
(:func:`send_started`, :func:`send_error`, :func:`send_result`, called by
``_spawn_rank.spawn_entry``) and the parent's reader (:func:`read_channel`).

Design note
-----------
``spawn()`` gives each rank one ``AF_UNIX``/``SOCK_SEQPACKET`` socket pair; the child gets one
end as a ``Process`` argument. Only the child writes; each message is one datagram
(atomic: it arrives whole or not at all) of a tag plus ``SCM_RIGHTS`` fds:

* ``S`` (started), fds ``[crash log]``: sent before ``fn`` is unpickled. The crash log
  (``_crash_log.py``) is a memfd on which the child enables ``faulthandler``; a
  SIGSEGV/SIGABRT/SIGBUS/SIGFPE/SIGILL writes the child's Python stacks there.
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
``_MAX_REPORT_BYTES`` of an error report and ``_crash_log.MAX_BYTES`` of a crash log: a huge,
forged or half-written report can cost the parent a bounded read, never a hang. Nothing is
written to the file system, so nothing is left in the temp directory, whoever dies.

Who dies when: a child SIGKILLed at any point has either sent a complete message or none; the
parent reports its exit code or signal (with the crash log when there is one). A parent
SIGKILLed takes the children with it (``_parent_death.py``); fds in flight die with the socket.

This module imports nothing heavy (no numpy, no torch): spawn children import those only when
``fn`` or its arguments need them.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Any, NamedTuple

from . import _crash_log, _fdpass

__all__ = [
    "ErrorReport",
    "error_report",
    "ChannelReport",
    "send_started",
    "send_error",
    "send_result",
    "read_channel",
]

# -- wire format ------------------------------------------------------------------------------

_TAG_STARTED = b"S"
_TAG_ERROR = b"E"
_TAG_RESULT = b"R"
_ERROR_HEAD = struct.Struct("<Q")
_RESULT_HEAD = struct.Struct("<QI")
_MAX_DATAGRAM = 64
_MAX_MESSAGES = 16  # at most 3 are legitimate
_MAX_REPORT_BYTES = 1 << 20  # the parent reads at most this much of an error report
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


def error_report(exc: BaseException, context: str = "") -> ErrorReport:
    """``exc`` as a parent reads it from a rank: type, message and traceback, clipped as the
    child clips them (for launchers that report ranks another way, e.g. ``elastic.py``)."""
    payload = _encode_report(exc, context)
    return _decode_report(payload, len(payload))


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


_crash_log_fd: int | None = None  # this rank's crash log: open until the process ends


def send_started(sock: socket.socket) -> None:
    """Child: point ``faulthandler`` at a new crash log and send it to the parent (``S``)."""
    global _crash_log_fd
    fd = _crash_log.create()
    _crash_log.enable(fd)
    _crash_log_fd = fd  # stays open: faulthandler writes to it at a crash
    try:
        _send(sock, _TAG_STARTED, [fd])
    except ConnectionError:  # the parent dropped its ProcessContext: run fn all the same
        pass


def send_error(sock: socket.socket, exc: BaseException, context: str = "") -> None:
    """Child: report ``exc`` (``E``); on failure print it to stderr instead (never raises)."""
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


def send_result(sock: socket.socket, result: Any) -> None:
    """Child: send ``fn``'s return value (``R``; fds beyond one record travel in a bag).

    Raises:
        ConnectionError: the parent closed its end.
        Exception: ``result`` cannot be pickled or shared.
    """
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
        """The faulthandler output of the rank (at most ``_crash_log.MAX_BYTES``), or ''."""
        return "" if self._crash_fd is None else _crash_log.read(self._crash_fd)

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
