"""Children die with their parent: ``PR_SET_PDEATHSIG`` plus a watchdog on the parent's pipe.

Design note
-----------
**Children never outlive their parent** (unless told to). Every tensormp ``Process`` (and so
every ``Pool`` and executor worker, and every ``spawn()`` rank) runs :func:`at_bootstrap` first
thing in ``Process._bootstrap``, in the child, before the target. It arms two independent kernel
mechanisms; neither needs a thread, the GIL or any cooperation from the parent (under spawn
and forkserver, :func:`before_arguments` already sets the second and checks the parent while
the process object is unpickled, before its arguments, whose imports can take seconds):

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

**Opting out.** The stdlib lets a child outlive its parent (CPython's own tests check that a
grandchild sees its parent die). A program that wants that asks for it per process
(``Process(..., die_with_parent=False)``, or ``p.die_with_parent = False`` before ``start()``)
or per context (``tensormp.get_context("spawn", die_with_parent=False)``, whose processes all
default to it). :func:`before_start` records the choice in the process's state (which the child
receives: inherited under ``fork``, pickled under ``spawn``/``forkserver``), and
:func:`at_bootstrap` then arms nothing: the child lives on as a stdlib child would, and a
normal parent exit still joins it (non-daemonic) or terminates it (daemonic), as the stdlib
does.

This module imports nothing heavy (every child runs it before its target).
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import threading
from typing import Any

__all__ = ["before_start", "before_arguments", "at_bootstrap", "arm_pdeathsig"]

_PR_SET_PDEATHSIG = 1
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)  # Linux value; the fcntl module has it on glibc
_PARENT_DEATH_SIGNAL = signal.SIGKILL
_watch_fd: int | None = None


def before_start(process: Any, method: str) -> None:
    """Parent side, in ``Process.start()``: record what the child needs to know.

    Records the start method ``method`` (the caller's context knows it), whether ``start()``
    runs on the main thread (``PR_SET_PDEATHSIG`` fires when the forking *thread* exits, so it
    is only safe from a thread that lives as long as the process) and the process's
    ``die_with_parent`` choice.
    """
    process.__dict__["_tensormp_method"] = method
    process.__dict__["_tensormp_main_thread"] = (
        threading.current_thread() is threading.main_thread()
    )
    process.__dict__["_tensormp_die_with_parent"] = bool(getattr(process, "die_with_parent", True))


def at_bootstrap(process: Any, parent_sentinel: int | None) -> None:
    """Child side, first thing in ``Process._bootstrap``: die when the parent dies.

    Best effort by design: a failure to arm (a kernel without ``F_SETSIG``, a seccomp filter)
    never keeps the child from running its target.
    """
    state = process.__dict__
    if not state.get("_tensormp_die_with_parent", True):
        return  # opted out: lives on as a stdlib child would
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


def before_arguments(settings: dict[str, Any], parent_pid: int) -> None:
    """Child side, ``spawn``/``forkserver``: as soon as the process object is being rebuilt,
    before its arguments are (which may import numpy or torch: seconds when many children
    start at once). A child whose parent dies in that window would otherwise run on until
    :func:`at_bootstrap`. ``settings`` carries what :func:`before_start` recorded; the watchdog
    waits for :func:`at_bootstrap` (the sentinel is not known yet), ``PR_SET_PDEATHSIG`` and the
    parent checks do not."""
    if not settings.get("die_with_parent", False):
        return
    if settings.get("method") == "spawn":
        if settings.get("main_thread", False):
            _set_pdeathsig(_PARENT_DEATH_SIGNAL)
        gone = os.getppid() != parent_pid
    else:  # forkserver: our real parent is the server; look at the logical one
        try:
            os.kill(parent_pid, 0)
            gone = False
        except ProcessLookupError:
            gone = True
        except OSError:
            gone = False
    if gone and parent_pid:
        os.kill(os.getpid(), _PARENT_DEATH_SIGNAL)


def arm_pdeathsig() -> None:
    """``PR_SET_PDEATHSIG`` alone, for a process started by another launcher (torch elastic's):
    killed when the thread that started it exits. Best effort, as :func:`at_bootstrap`."""
    _set_pdeathsig(_PARENT_DEATH_SIGNAL)


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
