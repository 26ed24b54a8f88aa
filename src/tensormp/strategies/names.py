"""Segment names: how they are made and read back, the files of named segments, and when one is an
orphan. The one home of these rules: the strategies, the cleanup daemon (``_daemon.py``) and the
CLI (``tensormp ls | gc | doctor``) import them from here.

Names
-----
A ``file_descriptor`` segment is an anonymous memfd; its name, seen in ``/proc/<pid>/fd`` and
``/proc/<pid>/maps`` as ``/memfd:<name> (deleted)``, only tells the CLI which process made it::

    tensormp-<creator pid>-<32 hex>

A ``file_system`` segment is a file in the *shm directory* (``$TENSORMP_SHM_DIR``, default
``/dev/shm``), created ``O_EXCL`` with mode 0600 (``file_system.py``). Its name carries what is
needed to find its creator, with no daemon state::

    tensormp-<uid>-<creator pid>-<creator start>-<program pid>-<program start>-<32 hex>

``start`` is a process's start time in clock ticks since boot: a (pid, start) pair names a
process for good, a pid alone does not (pids are reused). The *program* is the process tree a
segment belongs to (every process a tensormp context starts inherits its root's id); ``tensormp
ls`` shows it. The 128 random bits make names unguessable.

Who may remove a file
---------------------
* Its *creator*, while it lives: when its allocator lets the segment go (every block back,
  none held by another process), and at exit for segments none of whose blocks ever left it.
* Once the creator is dead: the cleanup daemon (``_daemon.py``) or ``tensormp gc``, when
  :func:`is_orphan` says so: **no live process maps the file** (``/proc/<pid>/maps``, for
  mappings made without a token, by hand) and **no token of it exists** (``F_OFD_GETLK``; a
  token is an fd of the file holding :data:`TOKEN_LOCK`, see ``file_system.py``). One kernel
  call answers the second, atomically, with no record of who sent what, so a killed process's
  files go at the next collection (about a second) after its death.
* The token rule holds for files the daemon saw announced (``C``, sent before the file is
  created) by a client of its own protocol. For any other file (a daemon restarted after a
  crash, ``gc`` with no daemon, a file of an older tensormp whose messages carry bare names)
  the daemon cannot tell whether a bare name is in flight, so it keeps the file until the
  program's root and every process of it are gone, as before tokens.

A mapping keeps the memory valid after the name is removed, so removing a name never breaks a
process that holds the segment.
"""

from __future__ import annotations

import fcntl
import os
import struct
from dataclasses import dataclass

from ..liveness import process_alive, process_start_time
from . import program

__all__ = [
    "PREFIX",
    "MEMFD_PREFIX",
    "TOKEN_LOCK",
    "F_OFD_SETLK",
    "SegmentFile",
    "shm_dir",
    "memfd_name",
    "parse_memfd",
    "new_name",
    "parse_name",
    "path",
    "unlink",
    "list_segment_files",
    "mapped_names",
    "carried",
    "is_orphan",
]

PREFIX = "tensormp-"
MEMFD_PREFIX = "/memfd:" + PREFIX  # how /proc shows a memfd of ours (fd link or maps path)
_DELETED = " (deleted)"
_HEX = set("0123456789abcdef")

_FLOCK = struct.Struct("hhqqi4x")  # struct flock (LP64 Linux): type, whence, start, len, pid
_F_OFD_GETLK = getattr(fcntl, "F_OFD_GETLK", 36)
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)
TOKEN_LOCK = _FLOCK.pack(fcntl.F_RDLCK, 0, 0, 1, 0)  # what a token holds
_PROBE = _FLOCK.pack(fcntl.F_WRLCK, 0, 0, 1, 0)  # conflicts with any token


def shm_dir() -> str:
    """The directory named segments live in: ``$TENSORMP_SHM_DIR`` or ``/dev/shm``."""
    return os.environ.get("TENSORMP_SHM_DIR") or "/dev/shm"


def memfd_name(seg_id: bytes) -> str:
    """The name this process gives the memfd of segment ``seg_id`` (16 bytes)."""
    return f"{PREFIX}{os.getpid()}-{seg_id.hex()}"


def parse_memfd(target: str) -> tuple[str, int] | None:
    """``'/memfd:tensormp-12-<hex> (deleted)'`` (a ``/proc`` fd link or maps path) ->
    ``('tensormp-12-<hex>', 12)``: the name and its creator's pid; None when not ours."""
    if not target.startswith(MEMFD_PREFIX):
        return None
    name = target[len("/memfd:") :].removesuffix(_DELETED)
    parts = name[len(PREFIX) :].split("-")
    if len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != 32:
        return None
    return name, int(parts[0])


_self: tuple[int, int] | None = None


def _self_id() -> tuple[int, int]:
    global _self
    pid = os.getpid()
    if _self is None or _self[0] != pid:
        _self = (pid, process_start_time(pid) or 0)
    return _self


def new_name() -> str:
    """A fresh, unguessable segment file name for this process and program."""
    pid, start = _self_id()
    ppid, pstart = program()
    return f"{PREFIX}{os.getuid()}-{pid}-{start}-{ppid}-{pstart}-{os.urandom(16).hex()}"


@dataclass(frozen=True)
class SegmentFile:
    """A named segment as found in the shm directory.

    Attributes:
        name: file name (no directory).
        uid: uid of the creator (from the name).
        creator: ``(pid, start time)`` of the process that created it.
        program: ``(pid, start time)`` of the root of the creator's program.
        size: bytes (0 when unknown).
    """

    name: str
    uid: int
    creator: tuple[int, int]
    program: tuple[int, int]
    size: int = 0


def parse_name(name: str, size: int = 0) -> SegmentFile | None:
    """The fields of a named segment's file name, or None when it is not one of ours."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split("-")
    if len(parts) != 6 or len(parts[5]) != 32 or not set(parts[5]) <= _HEX:
        return None
    try:
        uid, cpid, cstart, ppid, pstart = (int(p) for p in parts[:5])
    except ValueError:
        return None
    return SegmentFile(name, uid, (cpid, cstart), (ppid, pstart), size)


def path(name: str, directory: str | None = None) -> str:
    """Where the file ``name`` is: in ``directory``, by default the shm directory."""
    return os.path.join(directory or shm_dir(), name)


def unlink(name: str, directory: str | None = None) -> bool:
    """Remove a named segment's file; False if it was already gone."""
    try:
        os.unlink(path(name, directory))
        return True
    except FileNotFoundError:
        return False


def list_segment_files(directory: str | None = None, all_users: bool = False) -> list[SegmentFile]:
    """The tensormp named segments in ``directory`` (default: the shm directory) of this uid
    (every uid with ``all_users``), with their sizes."""
    directory = directory or shm_dir()
    out = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    uid = os.getuid()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            st = os.lstat(os.path.join(directory, name))
        except OSError:
            continue
        info = parse_name(name, st.st_size)
        if info is not None and (all_users or (info.uid == uid and st.st_uid == uid)):
            out.append(info)
    return out


def mapped_names(directory: str | None = None) -> dict[str, set[int]]:
    """Named segments of ``directory`` mapped by live processes: ``{name: {pid, ...}}``.

    Reads ``/proc/<pid>/maps`` of every process this user may read (all of them as root).
    """
    real = os.path.realpath(directory or shm_dir()).rstrip("/") + "/" + PREFIX
    out: dict[str, set[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if real.encode() not in data:
            continue
        pid = int(entry)
        for line in data.decode(errors="replace").splitlines():
            at = line.find(real)
            if at < 0:
                continue
            name = line[at + len(real) - len(PREFIX) :].split(" ", 1)[0]
            out.setdefault(name, set()).add(pid)
    return out


def carried(name: str, directory: str | None = None) -> bool:
    """Whether a token of the file ``name`` exists (see the module notes): a message carrying
    it can still be read, or a process maps it through one. False when the file is gone."""
    try:
        fd = os.open(path(name, directory), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        got = fcntl.fcntl(fd, _F_OFD_GETLK, _PROBE)
    finally:
        os.close(fd)
    return bool(_FLOCK.unpack(got)[0] != fcntl.F_UNLCK)


def is_orphan(
    info: SegmentFile,
    mapped: dict[str, set[int]],
    known: bool,
    program_alive: bool,
    directory: str | None = None,
) -> bool:
    """True when nobody can need ``info`` any more (see the module notes).

    Args:
        mapped: the result of :func:`mapped_names` (taken after the creator was seen dead).
        known: the file was made by a process that sends tokens (the daemon saw it created);
            otherwise a message may carry its bare name, and only the program's end tells.
        program_alive: whether any process of the segment's program still lives.
        directory: the shm directory (default: the current one).
    """
    if process_alive(*info.creator):
        return False
    if info.name in mapped:
        return False
    if not known:
        return not program_alive
    return not carried(info.name, directory)
