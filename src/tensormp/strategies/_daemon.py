"""The ``file_system`` cleanup daemon: removes named segments that nobody can need any more.

Design note
-----------
**One daemon per user and shm directory**, started on demand by the first client
(:func:`start`) as ``python -m tensormp.strategies._daemon``, which forks twice and calls
``setsid()``: the daemon has no parent among the clients, no terminal and no process group of
theirs, so it outlives any of them (``kill -9`` of the whole program included). It holds an
exclusive ``flock`` on its lock file for its life, so two clients starting daemons at once end
with one daemon. Its socket and lock live in :func:`runtime_dir` (``/tmp/tensormp-<uid>``),
created 0700 and checked to belong to this uid; the socket name
includes the shm directory's device and inode, so a process with another ``/dev/shm`` (another
mount namespace, another ``$TENSORMP_SHM_DIR``) talks to a daemon that sees its files.

**Protocol** (``AF_UNIX``/``SOCK_SEQPACKET``, version :data:`PROTOCOL`). A client connects and
sends ``HELLO <version> <program pid> <program start>``; the daemon takes the client's pid and
uid from the kernel (``SO_PEERCRED``), drops any peer of another uid, and answers
``OK <version> <daemon pid>`` or ``VERSION <version> <daemon pid>`` (mismatch: the client
raises, naming the daemon's pid). Then the client sends ``C <name>`` records (I am about to
create ``name``; never answered), and two requests, answered with one JSON packet: ``STATE``
(pid, version, which files a token still carries) and ``GC`` (collect now; the names removed).
The daemon counts nothing per message; it only remembers which names were announced.

**Collection** (:meth:`Daemon.collect`, about once a second and on ``GC``). For each named
segment file of this uid whose creator is dead (pid + start time), :func:`names.is_orphan`
decides: no live process maps it (``/proc/<pid>/maps``) and, for a file announced by a ``C``
record, no token of it exists (one ``F_OFD_GETLK``: a message carrying it is unread, or a
process maps it through one; see ``file_system.py``); for a file it was not told of, its
program has ended (its root is dead and no client of it is connected). An orphan is unlinked;
processes that still map it are never affected (they hold no name, only a mapping).

**What each party sees when another is SIGKILLed.** A client: its connection closes; the
daemon forgets it; its segments become candidates (creator dead), and the tokens it held
(messages it was writing, messages it had taken and not yet mapped) close with it, so its
files go at the next collection. The daemon: clients get ``EPIPE`` at their next record and
start a new one, which was not told of the files made before: it keeps them until their program
has ended (and reclaims at once the orphans of programs that are gone); ``tensormp gc`` applies
that rule without any daemon.

The daemon exits after :data:`IDLE_EXIT` seconds with no client and no named segment left,
removing its socket and lock file first (a client that connects during the exit retries and
starts a new daemon). All daemons of a user append to one log, ``daemon.log`` (reset past
1 MiB).
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import socket
import stat
import struct
import sys
import time

from ..liveness import process_alive
from . import names

PROTOCOL = 2
# The collection rule (tokens). It names the socket and the lock, so that daemons of programs
# with an older tensormp (which send bare names) run side by side with this one, each judging
# the files its own clients announce and keeping the others until their program ends.
GENERATION = 2
_CREATED_GRACE = 60.0  # seconds a "C" record waits for its file before being forgotten
IDLE_EXIT = 10.0
COLLECT_INTERVAL = 1.0
_MAX_PACKET = 1 << 16
_LOG_MAX = 1 << 20
_BATCH_DELAY = 0.002  # seconds the daemon lets records accumulate after reading some


def runtime_dir() -> str:
    """The private (0700) directory of the daemon's socket, lock and log, ``/tmp/tensormp-<uid>``
    (one fixed place, so every process of a user finds the same daemon); created if needed.

    Raises:
        PermissionError: the directory exists but is not a 0700 directory of this uid.
    """
    uid = os.getuid()
    path = f"/tmp/tensormp-{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{path} must be a directory of uid {uid} with mode 0700 (it is owned by "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); remove it, or set "
            "restart the program"
        )
    return path


def _key(shm: str) -> str:
    import hashlib

    st = os.stat(shm)
    where = hashlib.sha1(os.path.realpath(shm).encode()).hexdigest()[:8]
    return f"{st.st_dev:x}-{st.st_ino:x}-{where}"


def socket_path(shm: str | None = None) -> str:
    """The daemon socket for the shm directory ``shm`` (default: the current one)."""
    return os.path.join(runtime_dir(), f"daemon-{_key(shm or names.shm_dir())}-g{GENERATION}.sock")


class _Client:
    __slots__ = ("sock", "pid", "program", "hello")

    def __init__(self, sock: socket.socket, pid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.program: tuple[int, int] | None = None
        self.hello = False


class Daemon:
    """The collection loop. Runs in the detached daemon process (:func:`main`)."""

    def __init__(self, shm: str, listener: socket.socket, log: object) -> None:
        self.shm = shm
        self.socket_path = listener.getsockname()
        self.lock_path = self.socket_path[: -len(".sock")] + ".lock"
        self.listener = listener
        self.log = log
        self.clients: dict[int, _Client] = {}
        self.created: dict[str, float] = {}  # names seen in a C record -> when
        self.started = time.time()
        self.idle_since = time.monotonic()

    def _say(self, text: str) -> None:
        try:
            self.log.write(  # type: ignore[attr-defined]
                f"{time.strftime('%Y-%m-%d %H:%M:%S')} [{os.getpid()} {self.shm}] {text}\n"
            )
            self.log.flush()  # type: ignore[attr-defined]
        except (OSError, ValueError):
            pass

    # -- sockets ---------------------------------------------------------------------------
    def _accept_all(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            pid, uid, _gid = struct.unpack("3i", cred)
            if uid != os.getuid():
                self._say(f"refused pid {pid}: uid {uid}")
                sock.close()
                continue
            sock.setblocking(False)
            self.clients[sock.fileno()] = _Client(sock, pid)

    def _read_all(self, fds: list[int] | None = None) -> None:
        for fd in list(self.clients) if fds is None else fds:
            client = self.clients.get(fd)
            while client is not None:
                try:
                    data = client.sock.recv(_MAX_PACKET)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    data = b""
                if not data:
                    self._drop(client)
                    break
                self._handle(client, data)

    def _drop(self, client: _Client) -> None:
        self.clients.pop(client.sock.fileno(), None)
        client.sock.close()

    def _reply(self, client: _Client, obj: object) -> None:
        try:
            client.sock.setblocking(True)
            client.sock.settimeout(5.0)
            client.sock.send(json.dumps(obj).encode()[: _MAX_PACKET])
            client.sock.setblocking(False)
        except OSError:
            self._drop(client)

    def _handle(self, client: _Client, data: bytes) -> None:
        try:
            self._handle_lines(client, data)
        except (ValueError, IndexError) as e:  # a malformed record: drop that client only
            self._say(f"dropped pid {client.pid}: malformed record ({e})")
            self._drop(client)

    def _handle_lines(self, client: _Client, data: bytes) -> None:
        for line in data.decode("ascii", "replace").splitlines():
            parts = line.split()
            if not parts:
                continue
            op = parts[0]
            if not client.hello:
                if op != "HELLO" or len(parts) != 4:
                    self._drop(client)
                    return
                if int(parts[1]) != PROTOCOL:
                    try:
                        client.sock.send(f"VERSION {PROTOCOL} {os.getpid()}".encode())
                    except OSError:
                        pass
                    self._drop(client)
                    return
                client.program = (int(parts[2]), int(parts[3]))
                client.hello = True
                try:
                    client.sock.send(f"OK {PROTOCOL} {os.getpid()}".encode())
                except OSError:
                    self._drop(client)
                    return
            elif op == "C" and len(parts) == 2:
                self.created[parts[1]] = time.monotonic()
            elif op == "STATE":
                files = names.list_segment_files(self.shm)
                carried = [f.name for f in files if names.carried(f.name, self.shm)]
                self._reply(client, {
                    "pid": os.getpid(), "protocol": PROTOCOL, "clients": len(self.clients),
                    "shm_dir": self.shm, "started": self.started,
                    # At most 500 names (one packet); "in_flight_total" counts them all.
                    "in_flight": {name: 1 for name in carried[:500]},
                    "in_flight_total": len(carried),
                })
            elif op != "GC":
                raise ValueError(f"unknown record {op!r}")
            else:
                freed = self.collect()
                self._reply(client, {"freed": [[f.name, f.size] for f in freed][:500],
                                     "count": len(freed),
                                     "bytes": sum(f.size for f in freed)})

    # -- collection ----------------------------------------------------------------------------
    def program_alive(self, prog: tuple[int, int]) -> bool:
        if process_alive(*prog):
            return True
        return any(c.program == prog for c in self.clients.values())

    def collect(self) -> list[names.SegmentFile]:
        """Remove every orphaned named segment (see the module notes); returns them."""
        self._accept_all()
        self._read_all()
        files = names.list_segment_files(self.shm)
        present = {f.name for f in files}
        now = time.monotonic()
        for name in [n for n, t in self.created.items() if n not in present and now - t > _CREATED_GRACE]:
            del self.created[name]
        candidates = [f for f in files if not process_alive(*f.creator)]
        if not candidates:
            return []
        mapped = names.mapped_names(self.shm)
        freed = []
        for f in candidates:
            known = f.name in self.created
            if names.is_orphan(f, mapped, known, known or self.program_alive(f.program), self.shm):
                if names.unlink(f.name, self.shm):
                    freed.append(f)
                    self._say(f"removed {f.name} ({f.size} bytes)")
                self.created.pop(f.name, None)
        return freed

    def _remove_files(self) -> None:
        # Still holding the lock: a client that finds no socket starts a new daemon, which
        # gets the lock once this process has exited (clients retry until then).
        for path in (self.socket_path, self.lock_path):
            try:
                os.unlink(path)
            except OSError:
                pass

    def serve(self) -> None:
        next_collect = time.monotonic()
        while True:
            now = time.monotonic()
            if now >= next_collect:
                self.collect()
                next_collect = now + COLLECT_INTERVAL
                if self.clients or names.list_segment_files(self.shm):
                    self.idle_since = now
                elif now - self.idle_since > IDLE_EXIT:
                    self._say("idle: exiting")
                    self._remove_files()
                    return
            fds = [self.listener.fileno(), *self.clients]
            try:
                ready, _, _ = select.select(fds, [], [], max(0.0, next_collect - time.monotonic()))
            except InterruptedError:
                continue
            if self.listener.fileno() in ready:
                self._accept_all()
            busy = [fd for fd in ready if fd in self.clients]
            self._read_all(busy)
            if busy:
                # Records are only needed at the next collection: let them pile up instead of
                # waking for every message (a ping-pong sends one per message; on 2 cores each
                # wake-up of this process costs the senders as much as the record itself).
                time.sleep(_BATCH_DELAY)


def _bind(shm: str) -> tuple[socket.socket, object, int] | None:
    """Take the lock and bind the socket; None if another daemon holds the lock."""
    rundir = runtime_dir()
    key = f"{_key(shm)}-g{GENERATION}"
    lock_fd = os.open(os.path.join(rundir, f"daemon-{key}.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        return None
    path = os.path.join(rundir, f"daemon-{key}.sock")
    try:
        os.unlink(path)  # a dead daemon's socket: we hold the lock, so nobody serves it
    except FileNotFoundError:
        pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(128)
    listener.setblocking(False)
    log_path = os.path.join(rundir, "daemon.log")  # shared by this user's daemons (O_APPEND)
    try:
        if os.path.getsize(log_path) > _LOG_MAX:
            os.unlink(log_path)
    except OSError:
        pass
    log = open(log_path, "a")  # noqa: SIM115 - lives as long as the daemon
    return listener, log, lock_fd


def main(argv: list[str]) -> int:
    """``python -m tensormp.strategies._daemon <shm dir>``: detach and serve.

    The launcher exits once the daemon is ready (status 0) or another daemon already serves
    this directory (status 0 too); 1 if the daemon could not start.
    """
    if len(argv) != 1:
        print("usage: python -m tensormp.strategies._daemon SHM_DIR", file=sys.stderr)
        return 2
    shm = argv[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid:  # the launcher
        os.close(w)
        ready, _, _ = select.select([r], [], [], 10.0)
        status = os.read(r, 64) if ready else b""
        os.waitpid(pid, 0)
        if status not in (b"ready", b"busy"):
            print(f"tensormp cleanup daemon did not start: {status.decode() or 'timeout'}",
                  file=sys.stderr)
            return 1
        return 0
    os.close(r)
    try:
        os.setsid()
        if os.fork():
            os._exit(0)  # the daemon is the grandchild: no session leader, no controlling tty
        os.chdir("/")
        os.umask(0o077)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
        bound = _bind(shm)
        if bound is None:
            os.write(w, b"busy")
            os._exit(0)
        listener, log, _lock_fd = bound
        daemon = Daemon(shm, listener, log)
        daemon._say(f"started pid {os.getpid()} for {shm}")
        os.write(w, b"ready")
        os.close(w)
    except BaseException as e:  # report to the launcher, never raise in a detached process
        try:
            os.write(w, f"error {type(e).__name__}: {e}"[:60].encode())
        finally:
            os._exit(1)
    try:
        daemon.serve()
    except BaseException as e:  # pragma: no cover - logged for the next engineer
        daemon._say(f"crashed: {type(e).__name__}: {e}")
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
