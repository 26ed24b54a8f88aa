"""A process's connection to the ``file_system`` cleanup daemon (protocol: ``_daemon.py``).

A process connects when it first creates a named segment, and sends one ``C`` record per
segment it creates, synchronously, before the file exists: so a daemon serves the shm
directory whenever a file of ours can be orphaned. Nothing is sent per message: whether a
message can still carry a file is the kernel's to tell (tokens, ``file_system.py``).

A forked child never writes on its parent's connection: the connection is dropped in the child
at fork and the child connects on its first record. A daemon that died (``EPIPE``/
``ECONNRESET``) is restarted once per record; if that fails, creating a named segment raises.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..errors import TensormpError
from . import _daemon, add_closer, names, program

__all__ = ["created", "request", "connection_fd", "start_daemon"]

_lock = threading.Lock()
_sock: socket.socket | None = None
_sock_dir: str | None = None
_CONNECT_TIMEOUT = 10.0
_MAX_PACKET = 32 << 10


def start_daemon(shm: str) -> None:
    """Start the daemon for ``shm`` (no-op if one is already serving it).

    Raises:
        TensormpError: the daemon could not start (its launcher's message included).
    """
    env = dict(os.environ)
    env.pop("PYTHONSTARTUP", None)
    # The daemon must import this very tensormp, wherever the program found it.
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "tensormp.strategies._daemon", shm],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=30,
        env=env,
        cwd="/",
        close_fds=True,
    )
    if proc.returncode != 0:
        raise TensormpError(
            f"cannot start the tensormp cleanup daemon for {shm}: "
            f"{proc.stderr.decode(errors='replace').strip() or f'exit status {proc.returncode}'}"
        )


def _hello(sock: socket.socket, path: str) -> None:
    ppid, pstart = program()
    sock.send(f"HELLO {_daemon.PROTOCOL} {ppid} {pstart}\n".encode())
    reply = sock.recv(256).decode(errors="replace").split()
    if not reply:
        raise _Retry
    if len(reply) >= 3 and reply[0] == "OK":
        return
    if len(reply) >= 3 and reply[0] == "VERSION":
        raise TensormpError(
            f"the tensormp cleanup daemon (pid {reply[2]}, socket {path}) speaks protocol "
            f"{reply[1]}, this tensormp speaks {_daemon.PROTOCOL}: use one tensormp version in "
            f"every process, or stop the old daemon (kill {reply[2]}; the next tensormp "
            "process starts a new one, and no memory is lost)"
        )
    raise TensormpError(f"unexpected answer from the tensormp cleanup daemon at {path}: {reply}")


class _Retry(TensormpError):
    """The daemon went away during the greeting (it was exiting): connect again."""

    def __init__(self) -> None:
        super().__init__("the tensormp cleanup daemon hung up while greeting (it was exiting)")


def _connect() -> socket.socket:
    shm = names.shm_dir()
    path = _daemon.socket_path(shm)
    deadline = time.monotonic() + _CONNECT_TIMEOUT
    last_start = 0.0
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(_CONNECT_TIMEOUT)
        try:
            sock.connect(path)
            _hello(sock, path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError,
                _Retry):
            sock.close()
            now = time.monotonic()
            if now > deadline:
                raise TensormpError(
                    f"cannot reach the tensormp cleanup daemon at {path} within "
                    f"{_CONNECT_TIMEOUT:.0f} s (its log: {_daemon.runtime_dir()}/daemon.log)"
                ) from None
            if now - last_start > 0.5:
                # None serves it, or one is exiting: start one (a no-op while another holds
                # the lock; we then retry until the exiting one is gone).
                start_daemon(shm)
                last_start = time.monotonic()
            else:
                time.sleep(0.02)
        except BaseException:
            sock.close()
            raise


def _send_locked(packets: list[bytes], must: bool) -> None:
    global _sock, _sock_dir
    for attempt in (0, 1):
        try:
            if _sock is None or _sock_dir != names.shm_dir():
                if _sock is not None:
                    _sock.close()
                _sock = None
                _sock = _connect()
                _sock_dir = names.shm_dir()
            fd = _sock.fileno()
            for packet in packets:
                # The socket has a timeout, so Python polls before every send(); its fd is
                # non-blocking underneath (that is how Python times out), so write() first
                # and let send() wait only when the daemon's buffer is full (EAGAIN).
                try:
                    os.write(fd, packet)  # one record: sent whole or not at all
                    continue
                except BlockingIOError:
                    pass
                _sock.send(packet)
            return
        except (BrokenPipeError, ConnectionResetError, ConnectionRefusedError, TimeoutError):
            if _sock is not None:
                _sock.close()
                _sock = None
            if attempt:
                if must:
                    raise TensormpError(
                        "lost the tensormp cleanup daemon and could not restart it"
                    ) from None
                return
        except TensormpError:
            if must:
                raise
            return


def _packets(op: str, segments: Iterable[str], n: int | None) -> list[bytes]:
    out: list[bytes] = []
    buf: list[str] = []
    size = 0
    for name in segments:
        line = f"{op} {name}\n" if n is None else f"{op} {name} {n}\n"
        if size + len(line) > _MAX_PACKET and buf:
            out.append("".join(buf).encode())
            buf, size = [], 0
        buf.append(line)
        size += len(line)
    if buf:
        out.append("".join(buf).encode())
    return out


def created(name: str) -> None:
    """``name`` is about to be created by this process.

    Raises:
        TensormpError: no daemon could be reached or started (the segment must not be made:
            nobody would remove it if this process were killed).
    """
    with _lock:
        _send_locked(_packets("C", [name], None), must=True)


def request(what: str, shm: str | None = None, start: bool = False) -> dict[str, Any] | None:
    """Ask the daemon of ``shm`` for ``"STATE"`` or ``"GC"`` on a connection of its own;
    None when no daemon serves it (and ``start`` is False)."""
    import json

    shm = shm or names.shm_dir()
    path = _daemon.socket_path(shm)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(_CONNECT_TIMEOUT)
    try:
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            if not start:
                return None
            start_daemon(shm)
            sock.connect(path)
        _hello(sock, path)
        sock.send(f"{what}\n".encode())
        return json.loads(sock.recv(1 << 16))  # type: ignore[no-any-return]
    finally:
        sock.close()


def connection_fd() -> int | None:
    """The fd of this process's daemon connection (for fd-leak checks), or None."""
    return _sock.fileno() if _sock is not None else None


def _after_fork_in_child() -> None:
    global _lock, _sock
    _lock = threading.Lock()
    if _sock is not None:
        # Not ours to write on; closing our copy leaves the parent's connection open.
        _sock.close()
        _sock = None


def _close() -> None:
    """Close the connection once this process is done (exit): the daemon reads what it holds
    first, and a record sent later connects again."""
    global _sock
    with _lock:
        if _sock is not None:
            _sock.close()
            _sock = None


os.register_at_fork(after_in_child=_after_fork_in_child)
add_closer(_close)
