"""What a ``spawn()`` rank runs: :func:`spawn_entry`, the target of its ``Process``.

Design note
-----------
The rank runs ``fn(index, *args)`` and reports the outcome to its parent over its report channel
(``_spawn_report.py``): "started" (with its crash log) before ``fn`` is even unpickled, then an
error report or the return value. Exit status: 0 when ``fn`` returned, 1 after an error report,
``sys.exit``'s code, or death by ``SIGINT``.

Ctrl-C: the parent blocks ``SIGINT`` around ``start()`` (spawn, fork), so nothing before
:func:`spawn_entry` takes over ``SIGINT`` can print a ``KeyboardInterrupt`` traceback. A ``SIGINT``
that reaches the rank (a Ctrl-C at the terminal reaches the whole process group, or the parent
forwards one) makes it exit quietly, *by* ``SIGINT``, after its ``finally`` blocks ran; a
``KeyboardInterrupt`` that ``fn`` raises itself is an error like any other. After a first
failure the parent stops the other ranks with ``SIGTERM``: a rank that has failed too ignores it
while it sends its own report.

This module imports nothing heavy (no numpy, no torch): a rank imports those only when ``fn`` or
its arguments need them.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from multiprocessing import util
from typing import Any

from . import _spawn_report
from ._by_value import FnByValue

__all__ = ["spawn_entry"]

_sigint_received = False
_channel: socket.socket | None = None  # this rank's end, for tests that forge reports


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
    # Closed at the rank's exit (every path runs multiprocessing's finalizers), not left to the
    # interpreter's teardown, which warns (ResourceWarning) when it collects it still open.
    util.Finalize(None, sock.close, exitpriority=0)
    # The parent blocked SIGINT around start() (spawn, fork): nothing before this point can
    # print a KeyboardInterrupt traceback. Take it over, then let a pending one in. A parent
    # that ignores SIGINT (nohup, a background job) has children that ignore it too, as with
    # the stdlib.
    if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, _on_sigint)
    try:
        _spawn_report.send_started(sock)
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
        _spawn_report.send_error(sock, e)
        sys.exit(1)
    except BaseException as e:
        # The parent stops the other ranks with SIGTERM after a first failure: when this rank
        # has failed too, its own report must still get out. Ignored, not blocked: a blocked
        # signal would still kill us through any other thread that does not block it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _spawn_report.send_error(sock, e)
        sys.exit(1)
    if return_value:
        try:
            _spawn_report.send_result(sock, result)
        except KeyboardInterrupt:
            _die_of_sigint()
        except ConnectionError:  # nobody is listening for it any more
            pass
        except BaseException as e:
            _spawn_report.send_error(sock, e, "sending the return value to the parent")
            sys.exit(1)
