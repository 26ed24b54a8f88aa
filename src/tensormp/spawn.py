"""``spawn``, ``start_processes`` and ``ProcessContext``: ``torch.multiprocessing.spawn``, over
tensormp processes, with every failure reported.

Design note
-----------
The API, the messages and the exceptions follow ``torch.multiprocessing.spawn``: ``fn(i, *args)``
runs in ``nprocs`` processes; ``join()`` waits for the first failure, stops the others and
raises ``ProcessRaisedException`` (with the child's traceback) or ``ProcessExitedException``
("process 1 terminated with exit code 3", "... with signal SIGSEGV"). What differs from torch,
and why:

* **Reports.** Each rank (``_spawn_rank.py``) reports over its own socket pair
  (``_spawn_report.py`` has the wire format). The *child* writes: "started", then an error
  report or a return value, each complete in a memfd before a single datagram announces it.
  The *parent* reads, only after the rank has exited, without blocking, a bounded number of
  bytes. A child SIGKILLed at any point has sent a whole message or none, so the parent never
  waits on a half-written report; a parent SIGKILLed takes the children with it
  (``_parent_death.py``: pdeathsig plus a pipe watchdog). No file is created, so none is left
  behind in the temp directory (torch leaves one per rank).
* **All failures.** After the first failure the parent waits ``grace_period`` for the others,
  stops the rest (SIGTERM, then SIGKILL after another grace period, 30 s by default as torch),
  and raises for the first failure. ``str(e)`` is torch's message for that one alone (for a
  rank that raised, it ends with its traceback: code matches on that last line); every other
  failure (index, pid, exit code or signal, exception, traceback or crash stack) is in
  ``failures`` and in the exception's notes, which the traceback printer shows after the
  message (Python >= 3.11; on 3.10 the notes open the message instead). Ranks the parent
  stopped are not failures.
* **Crashes by signal** come with the rank's Python stack (a note): the child enables
  ``faulthandler`` on a memfd it handed to the parent at start-up (``_crash_log.py``).
* **KeyboardInterrupt.** A ``KeyboardInterrupt`` that ``fn`` raises is a failure. A Ctrl-C at
  the terminal reaches the whole process group: each rank exits quietly, by ``SIGINT``, after
  its ``finally`` blocks ran (no traceback per rank); the parent forwards ``SIGINT`` to ranks
  it did not reach (a ``kill -INT`` of the parent alone), waits up to ``grace_period``
  (default 5 s), SIGKILLs what still runs, and raises one ``KeyboardInterrupt`` that says
  which ranks it stopped. A second Ctrl-C while it waits sends SIGKILL at once. The parent
  blocks SIGINT around ``start()``, so a rank cannot be interrupted before it has taken over
  SIGINT (spawn, fork; a forkserver child has a small window while it imports the main
  module).
* **fn** may be a lambda or a local function, or defined inside ``if __name__ == "__main__":``:
  whatever a child could not import by name is pickled by value with cloudpickle. Top-level
  functions and other callables go by reference, as in torch. Under ``fork`` nothing is
  pickled (the child inherits ``fn`` and ``args``).
* **Arguments and return values** travel with tensormp's reducers: arrays cross as shared
  memory (under ``fork``, inherited: shared arrays stay shared, others are copy-on-write).
  ``return_values=True`` returns each rank's result; a shared array stays shared.
* **Every wait is bounded** by the caller's ``timeout`` (``spawn(..., timeout=s)`` stops the
  ranks still running and raises ``ProcessTimeoutError``, a ``TimeoutError``), or by the
  grace periods.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import types
import warnings
import weakref
from collections.abc import Sequence
from contextlib import contextmanager
from multiprocessing import process as _mpprocess
from typing import Any, Literal, NamedTuple, overload

from . import _spawn_report
from ._by_value import FnByValue
from ._spawn_rank import spawn_entry
from .errors import TensormpError

__all__ = [
    "ProcessContext",
    "SpawnContext",
    "ProcessException",
    "ProcessRaisedException",
    "ProcessExitedException",
    "ProcessTimeoutError",
    "ProcessFailure",
    "SpawnBootstrapError",
    "spawn",
    "start_processes",
]

_TERM_TIMEOUT = 30.0  # seconds between SIGTERM and SIGKILL when no grace period is given (torch)
_INTERRUPT_GRACE = 5.0  # seconds from a Ctrl-C (forwarded as SIGINT) to SIGKILL by default
_KILL_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed process before giving up on it
_REAP_TIMEOUT = 5.0  # seconds from a closed sentinel to an exit status
_BLIND_POLL = 0.05  # poll interval for a rank whose sentinel closed before it exited


def _signal_name(exit_code: int) -> str:
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"<Unknown signal {-exit_code}>"


# -- exceptions -------------------------------------------------------------------------------


class ProcessFailure(NamedTuple):
    """One failed rank, as listed in :attr:`ProcessException.failures`.

    Attributes:
        index: the rank (``i`` in ``fn(i, *args)``).
        pid: its process id.
        exit_code: its exit status (negative: killed by that signal).
        signal_name: ``"SIGSEGV"`` etc. when killed by a signal, else None.
        exc_type: the exception type when ``fn`` raised (``"ValueError"``), else ``""``.
        exc_message: the exception message (truncated by the child to 8 KiB), else ``""``.
        traceback: the child's traceback, or its faulthandler stack after a crash, or ``""``.
    """

    index: int  # type: ignore[assignment]  # the rank; shadows tuple.index
    pid: int
    exit_code: int
    signal_name: str | None
    exc_type: str
    exc_message: str
    traceback: str

    def summary(self) -> str:
        """One line: ``process 3 (pid 1234): raised ValueError: bad value``."""
        if self.exc_type:
            first = self.exc_message.strip().splitlines()[0] if self.exc_message.strip() else ""
            if len(first) > 200:
                first = first[:200] + "..."
            what = f"raised {self.exc_type}" + (f": {first}" if first else "")
        elif self.signal_name:
            what = f"terminated with signal {self.signal_name}"
        else:
            what = f"terminated with exit code {self.exit_code}"
        return f"process {self.index} (pid {self.pid}): {what}"


class ProcessException(TensormpError, Exception):
    """A ``spawn()`` rank failed; base of the ``torch.multiprocessing`` exception types.

    ``str(e)`` is torch's message for the first failure: for a rank that raised, it ends with
    that rank's traceback (code matches on its last line, as with torch). Everything else
    tensormp knows (the other failures, with their tracebacks or ``faulthandler`` stacks, and
    the stack of a rank killed by a signal) is in :attr:`failures` and in the exception's notes
    (``e.__notes__``, PEP 678), which the traceback printer shows after the message on Python
    >= 3.11. On Python 3.10, whose printer ignores notes, the notes are also put at the *start*
    of the message, so a printed traceback loses nothing and ``str(e)`` still ends as torch's.

    Attributes:
        msg: the message.
        error_index: the rank that failed first.
        error_pid: its pid.
        exit_code: its exit status (None when it did not exit, e.g. a timeout).
        signal_name: the signal that killed it, or None.
        failures: every failed rank, the first included (:class:`ProcessFailure`).
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        *,
        exit_code: int | None = None,
        signal_name: str | None = None,
        failures: list[ProcessFailure] | tuple[ProcessFailure, ...] = (),
    ) -> None:
        super().__init__(msg)
        self.msg = msg
        self.error_index = error_index
        self.error_pid = error_pid
        self.exit_code = exit_code
        self.signal_name = signal_name
        self.failures = list(failures)

    def __str__(self) -> str:
        return self.msg

    def _state(self) -> dict[str, Any]:
        # Every attribute travels, set by the class or later (``__notes__``; ``node`` and
        # ``host`` of a failure on another node): an exception sent through a queue or pickled
        # by a test runner keeps them all.
        return dict(self.__dict__)

    def __reduce__(self) -> Any:
        return (
            type(self),
            (self.msg, self.error_index, self.error_pid),
            {"exit_code": self.exit_code, "signal_name": self.signal_name, **self._state()},
        )


class ProcessRaisedException(ProcessException):
    """``fn`` raised in a rank; the message holds the child's traceback (as torch).

    Attributes:
        exc_type: the exception's type name (``"ValueError"``, ``"mymodule.MyError"``).
        exc_message: its message.
    """

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        *,
        exc_type: str = "",
        exc_message: str = "",
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("exit_code", 1)
        super().__init__(msg, error_index, error_pid, **kwargs)
        self.exc_type = exc_type
        self.exc_message = exc_message


class ProcessExitedException(ProcessException):
    """A rank exited with a non-zero code, or was killed by a signal (as torch)."""

    def __init__(
        self,
        msg: str,
        error_index: int,
        error_pid: int,
        exit_code: int,
        signal_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            msg, error_index, error_pid, exit_code=exit_code, signal_name=signal_name, **kwargs
        )

    def __reduce__(self) -> Any:
        return (
            type(self),
            (self.msg, self.error_index, self.error_pid, self.exit_code, self.signal_name),
            self._state(),
        )


class ProcessTimeoutError(ProcessException, TimeoutError):
    """``spawn(..., timeout=...)`` expired; the ranks still running were stopped.

    Attributes:
        running: the ranks that were still running at the deadline.
    """

    def __init__(
        self, msg: str, error_index: int, error_pid: int, *, running: Sequence[int] = (),
        **kw: Any,
    ) -> None:
        super().__init__(msg, error_index, error_pid, **kw)
        self.running = list(running)


class SpawnBootstrapError(TensormpError, RuntimeError):
    """``spawn()`` was called in a child while it imported its parent's main module.

    The script calls ``spawn()`` at import time; under ``spawn``/``forkserver`` every child
    re-imports the main module, so each child would spawn again.
    """


# -- the context --------------------------------------------------------------------------------


class _Outcome(NamedTuple):
    exit_code: int
    report: _spawn_report.ChannelReport
    stopped: bool  # the parent had sent it SIGTERM/SIGKILL


class ProcessContext:
    """The ranks started by :func:`start_processes` (``torch.multiprocessing.ProcessContext``).

    Attributes:
        processes: the ``Process`` objects, by rank.
        sentinels: ``{sentinel: rank}`` of the ranks not yet joined (as torch).
    """

    def __init__(
        self,
        processes: list[Any],
        channels: list[socket.socket],
        *,
        return_values: bool = False,
    ) -> None:
        self.processes = processes
        self.sentinels = {p.sentinel: i for i, p in enumerate(processes)}
        self._channels: list[socket.socket | None] = list(channels)
        self._want_results = return_values
        self._outcomes: list[_Outcome | None] = [None] * len(processes)
        self._results: list[Any] = [None] * len(processes)
        self._stopped: set[int] = set()
        self._blind: set[int] = set()  # sentinel closed, no exit status yet
        self._error: BaseException | None = None

    # -- public API -------------------------------------------------------------------------
    def pids(self) -> list[int]:
        """The pids of the ranks, by rank."""
        return [int(p.pid) for p in self.processes]

    @property
    def return_values(self) -> list[Any]:
        """Each rank's return value (``return_values=True``; None for ranks not finished)."""
        return list(self._results)

    def join(self, timeout: float | None = None, grace_period: float | None = None) -> bool:
        """Wait for the ranks; on the first failure stop the others and raise.

        Same contract as torch's ``ProcessContext.join``: returns True when every rank exited
        cleanly, False when ``timeout`` seconds passed with some still running.

        Args:
            timeout: seconds to wait (None: until a rank exits).
            grace_period: after a failure, seconds to let the other ranks finish on their own
                before SIGTERM, and again before SIGKILL (None: SIGTERM at once, SIGKILL after
                30 s, as torch).

        Raises:
            ProcessRaisedException: ``fn`` raised in a rank.
            ProcessExitedException: a rank exited with a non-zero code or by a signal.
            KeyboardInterrupt: Ctrl-C; the ranks were stopped first.
        """
        if self._error is not None:
            raise self._error
        if not self.sentinels and not self._blind:
            return True
        try:
            self._wait_some(timeout)
            if not self._failed():
                done = not self.sentinels and not self._blind
                if done:
                    self._close_channels()
                return done
            self._stop(grace_period)
        except KeyboardInterrupt as e:
            raise self._interrupted(grace_period, e) from None
        self._error = self._failure_exception()
        self._close_channels()
        raise self._error

    def __repr__(self) -> str:
        running = sorted(self._running())
        failed = sorted(self._failed())
        return (
            f"<ProcessContext nprocs={len(self.processes)} running={running} failed={failed} "
            f"pids={self.pids()}>"
        )

    # -- waiting and reaping ------------------------------------------------------------------
    def _running(self) -> set[int]:
        return set(self.sentinels.values()) | self._blind

    def _wait_some(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` for at least one rank to exit, and reap those that did."""
        if self._blind:
            timeout = _BLIND_POLL if timeout is None else min(timeout, _BLIND_POLL)
        # Imported here: multiprocessing.connection loads tempfile, shutil, bz2, lzma, random
        # (milliseconds), and `import tensormp` (every spawn child's) loads this module.
        from multiprocessing.connection import wait

        ready = wait(list(self.sentinels), timeout)
        for sentinel in ready:
            self._reap(self.sentinels.pop(sentinel))
        for index in list(self._blind):
            if self.processes[index].exitcode is not None:
                self._blind.discard(index)
                self._reap(index)

    def _wait_until(self, deadline: float) -> None:
        while self._running():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wait_some(left)

    def _reap(self, index: int) -> None:
        process = self.processes[index]
        deadline = time.monotonic() + _REAP_TIMEOUT
        code = process.exitcode  # waitpid(WNOHANG): never blocks
        while code is None and time.monotonic() < deadline:
            time.sleep(0.001)
            code = process.exitcode
        if code is None:  # it closed its sentinel but lives on: poll it from now on
            self._blind.add(index)
            return
        process.join(0)  # forget it in multiprocessing's table of children
        channel = self._channels[index]
        report = (
            _spawn_report.read_channel(channel)
            if channel is not None
            else _spawn_report.ChannelReport()
        )
        self._outcomes[index] = _Outcome(code, report, index in self._stopped)
        if code == 0 and self._want_results:
            self._load_result(index, report)

    def _load_result(self, index: int, report: _spawn_report.ChannelReport) -> None:
        from . import reducers

        result = report.take_result()
        if result is None:
            # Exit status 0 but no return value: fn never returned (os._exit(0) in the rank, or
            # a library that ends the process). Say so rather than hand back a silent None.
            report.error = _spawn_report.ErrorReport(
                "ProcessExitedWithoutResult",
                f"process {index} exited with status 0 without returning from fn",
                f"(process {index} exited with status 0 before fn returned: sys.exit(0), "
                "os._exit(0) or something that ended the process; spawn(return_values=True) has "
                "no value to give for it)\n",
                "",
            )
            return
        try:
            self._results[index] = reducers.loads(*result)
        except Exception as e:  # noqa: BLE001 - reported as this rank's failure
            report.error = _spawn_report.ErrorReport(
                type(e).__name__, str(e),
                f"(loading the return value of process {index} in the parent)\n"
                f"{type(e).__name__}: {e}\n",
                "",
            )

    def _failed(self) -> list[int]:
        out = []
        for i, outcome in enumerate(self._outcomes):
            if outcome is None:
                continue
            if outcome.report.error is not None:
                out.append(i)
            elif outcome.exit_code != 0 and not outcome.stopped:
                out.append(i)
        return out

    def _signal(self, indices: set[int], sig: int) -> None:
        for i in sorted(indices):
            self._stopped.add(i)
            if self.processes[i].exitcode is not None:
                continue  # reaped already (its pid may be someone else's by now)
            try:
                os.kill(self.processes[i].pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _stop(self, grace_period: float | None) -> None:
        """Let the ranks still running finish, then SIGTERM, then SIGKILL (all bounded)."""
        try:
            if grace_period:
                self._wait_until(time.monotonic() + grace_period)
            self._signal(self._running(), signal.SIGTERM)
            term = _TERM_TIMEOUT if grace_period is None else grace_period
            self._wait_until(time.monotonic() + term)
        except KeyboardInterrupt:  # impatient: a second Ctrl-C while stopping
            pass
        self._kill_all()

    def _kill_all(self) -> None:
        self._signal(self._running(), signal.SIGKILL)
        self._wait_until(time.monotonic() + _KILL_TIMEOUT)

    def _interrupted(self, grace_period: float | None, exc: BaseException) -> BaseException:
        """Ctrl-C: stop every rank and build the one KeyboardInterrupt the user sees."""
        if getattr(exc, "_tensormp_handled", False):
            return exc
        running = sorted(self._running())
        try:  # what a Ctrl-C at the terminal does, for ranks it did not reach
            self._signal(self._running(), signal.SIGINT)
            grace = _INTERRUPT_GRACE if grace_period is None else grace_period
            self._wait_until(time.monotonic() + grace)
        except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
            pass
        self._kill_all()
        self._close_channels()
        pids = ", ".join(str(self.processes[i].pid) for i in running)
        what = (
            f"stopped processes {', '.join(map(str, running))} (pids {pids})"
            if running
            else "no process was still running"
        )
        interrupt = KeyboardInterrupt(f"tensormp.spawn: interrupted (Ctrl-C); {what}")
        interrupt._tensormp_handled = True  # type: ignore[attr-defined]
        self._error = interrupt
        return interrupt

    def _timed_out(self, timeout: float, grace_period: float | None) -> ProcessTimeoutError:
        running = sorted(self._running())
        try:
            self._stop(grace_period)
        except KeyboardInterrupt as e:
            raise self._interrupted(grace_period, e) from None
        self._close_channels()
        listed = ", ".join(f"process {i} (pid {self.processes[i].pid})" for i in running)
        failures = [self._failure(i) for i in self._failed()]
        msg = (
            f"spawn() timed out after {timeout:g} s: {len(running)} of {len(self.processes)} "
            f"processes were still running and have been stopped: {listed}"
        )
        if failures:
            msg += "\n\n-- failures before the timeout:\n" + "\n".join(
                "  " + f.summary() for f in failures
            )
        first = running[0] if running else 0
        error = ProcessTimeoutError(
            msg, first, self.processes[first].pid, running=running, failures=failures
        )
        self._error = error
        return error

    def _close_channels(self) -> None:
        for i, channel in enumerate(self._channels):
            if channel is not None:
                channel.close()
                self._channels[i] = None
        for outcome in self._outcomes:
            if outcome is not None:
                outcome.report.close()

    def __del__(self) -> None:
        try:
            self._close_channels()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- the exception ------------------------------------------------------------------------
    def _failure(self, index: int) -> ProcessFailure:
        outcome = self._outcomes[index]
        assert outcome is not None
        code = outcome.exit_code
        error = outcome.report.error
        trace = ""
        if error is not None:
            trace = error.traceback
        elif code < 0:
            trace = outcome.report.crash_log()
        return ProcessFailure(
            index, int(self.processes[index].pid), code,
            _signal_name(code) if code < 0 else None,
            error.type if error else "", error.message if error else "", trace,
        )

    def _torch_message(self, failure: ProcessFailure) -> str:
        """torch's message for a failure: ``str(e)`` ends with the rank's traceback (as torch's,
        which code matches on) or is torch's one line for an exit code or a signal."""
        i = failure.index
        if failure.exc_type:
            trace = failure.traceback or f"{failure.exc_type}: {failure.exc_message}\n"
            return f"\n\n-- Process {i} terminated with the following error:\n{trace}"
        if failure.signal_name:
            return f"process {i} terminated with signal {failure.signal_name}"
        return f"process {i} terminated with exit code {failure.exit_code}"

    def _first_notes(self, failure: ProcessFailure) -> list[str]:
        """What tensormp knows of the first failure besides torch's message."""
        outcome = self._outcomes[failure.index]
        assert outcome is not None
        report = outcome.report
        i = failure.index
        notes = []
        if failure.signal_name and failure.traceback:
            notes.append(_stack_note(failure))
        if not failure.exc_type and not report.started:
            notes.append(
                f"Process {i} failed while starting, before running fn: importing the main "
                "module or unpickling fn and its arguments (its traceback is on stderr). If the "
                "script calls spawn() at module level, move the call under "
                "`if __name__ == \"__main__\":` (children re-import the main module under the "
                "'spawn' and 'forkserver' start methods)."
            )
        for note in (report.note, report.error.note if report.error else ""):
            if note:
                notes.append(f"[process {i}: {note}]")
        return notes

    def _failure_exception(self) -> ProcessException:
        failed = self._failed()
        # The first failure: ranks that raised or crashed before ranks that merely exited,
        # which are often collateral (a collective op whose peer died); then by rank.
        failures = [self._failure(i) for i in failed]
        failures.sort(key=lambda f: (not (f.exc_type or f.signal_name), f.index))
        first, others = failures[0], failures[1:]
        notes = self._first_notes(first)
        if others:
            notes.append(
                f"-- {len(others)} other process(es) failed too:\n"
                + "\n".join("  " + f.summary() for f in others)
            )
            stacks = [f for f in others if f.traceback]
            notes.extend(_stack_note(f) for f in stacks[:_MAX_NOTED_STACKS])
            if len(stacks) > _MAX_NOTED_STACKS:
                notes.append(
                    f"[the stacks of {len(stacks) - _MAX_NOTED_STACKS} more processes are in "
                    "e.failures]"
                )
        msg = _message_with_notes(self._torch_message(first), notes)
        error: ProcessException
        if first.exc_type:
            error = ProcessRaisedException(
                msg, first.index, first.pid, exc_type=first.exc_type,
                exc_message=first.exc_message, exit_code=first.exit_code,
                signal_name=first.signal_name, failures=failures,
            )
        else:
            error = ProcessExitedException(
                msg, first.index, first.pid, first.exit_code, first.signal_name,
                failures=failures,
            )
        _attach_notes(error, notes)
        return error


_MAX_NOTED_STACKS = 8  # other failures whose stacks become notes; the rest: in e.failures
# The traceback printer shows exception notes from Python 3.11 on (PEP 678).
_PRINTER_SHOWS_NOTES = sys.version_info >= (3, 11)


def _stack_note(failure: ProcessFailure) -> str:
    i = failure.index
    if failure.exc_type:
        return f"-- Process {i} terminated with the following error:\n{failure.traceback}"
    return (
        f"-- Python stack of process {i} when it received {failure.signal_name} "
        f"(faulthandler):\n{failure.traceback}"
    )


def _message_with_notes(message: str, notes: list[str]) -> str:
    """``str(e)``: torch's message alone where the traceback printer shows notes; on Python
    3.10, whose printer does not, the notes come first, so nothing is lost from a printed
    traceback and ``str(e)`` still ends as torch's does."""
    if _PRINTER_SHOWS_NOTES or not notes:
        return message
    return "\n\n".join(notes) + ("" if message.startswith("\n") else "\n\n") + message


def _attach_notes(error: BaseException, notes: list[str]) -> None:
    """``add_note`` on Python >= 3.11; on 3.10 the same list as ``__notes__`` (PEP 678's
    attribute, which 3.10's printer ignores; the notes are in the message there)."""
    if not notes:
        return
    if _PRINTER_SHOWS_NOTES:
        for note in notes:
            error.add_note(note)  # type: ignore[attr-defined,unused-ignore]
    else:
        error.__notes__ = list(notes)  # type: ignore[attr-defined,unused-ignore]


class SpawnContext(ProcessContext):
    """torch's old name for :class:`ProcessContext`: constructing one warns, as in torch.

    Deprecated: use :class:`ProcessContext`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "SpawnContext is renamed to ProcessContext (as in torch since 1.4); use "
            "tensormp.ProcessContext",
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)



# -- starting ---------------------------------------------------------------------------------


@contextmanager
def _sigint_blocked() -> Any:
    """Block SIGINT in this thread; a child forked meanwhile inherits the mask."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _check_not_bootstrapping() -> None:
    if getattr(_mpprocess.current_process(), "_inheriting", False):
        raise SpawnBootstrapError(
            "tensormp.spawn() was called while this process, a child started by spawn() or "
            "Process.start(), was importing its parent's main module: the script calls spawn() "
            "at module level. Under the 'spawn' and 'forkserver' start methods every child "
            "re-imports the main module, so each would start processes again. Move the call "
            "under `if __name__ == \"__main__\":` (or into a function called from there)."
        )


def _defined_at_top_level(fn: Any) -> bool:
    """True when a child that re-imports ``__main__`` will find ``fn`` by its name.

    A function of the main module is importable in a spawn child only if its ``def`` runs at
    import time, i.e. is not inside ``if __name__ == "__main__":``. The check is the def's
    indentation: a top-level ``def`` starts at column 0. Anything else goes by value.
    """
    main = sys.modules.get("__main__")
    name = getattr(fn, "__name__", None)
    code = getattr(fn, "__code__", None)
    if name is None or code is None or getattr(main, name, None) is not fn:
        return False
    lines = _main_source(code.co_firstlineno)
    if len(lines) < code.co_firstlineno:
        return False
    line = lines[-1]
    return bool(line.strip()) and not line[:1].isspace()


def _main_source(upto: int) -> list[bytes]:
    """The first ``upto`` lines of the main module's file ([] when it has none, or it cannot
    be read)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path:
        return []
    try:
        with open(path, "rb") as f:
            return [line for _, line in zip(range(upto), f)]
    except OSError:
        return []


def _bound_needs_value(fn: Any) -> bool:
    """For a bound method of an object whose class belongs to ``__main__``: True when a child
    that re-imports ``__main__`` would not find that class (defined inside a function or under
    ``if __name__ == "__main__":``), so the method must go by value. Found as for functions:
    the ``class`` line above the method's ``def`` starts at column 0 for a top-level class."""
    owner = fn.__self__
    cls = owner if isinstance(owner, type) else type(owner)
    if cls.__module__ != "__main__":
        return False
    try:
        known = _main_classes.get(cls)
    except TypeError:
        known = None
    if known is None:
        known = _main_class_needs_value(cls, fn)
        try:
            _main_classes[cls] = known
        except TypeError:
            pass
    return known


_main_classes: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _main_class_needs_value(cls: type, fn: Any) -> bool:
    name = cls.__name__
    code = getattr(fn.__func__, "__code__", None)
    if "<" in cls.__qualname__ or getattr(sys.modules.get("__main__"), name, None) is not cls:
        return True
    # No source to look at: by reference, as the stdlib.
    lines = _main_source(code.co_firstlineno) if code is not None else []
    head = f"class {name}".encode()
    for line in reversed(lines):
        text = line.lstrip()
        if text.startswith(head) and text[len(head) : len(head) + 1] in (b"(", b":", b" "):
            return line[:1].isspace()
    return False


def _prepare_fn(fn: Any, method: str) -> Any:
    """``fn`` as the child gets it: itself (by reference), or :class:`_by_value.FnByValue`.

    Raises:
        TypeError: ``fn`` is a lambda or a local function and cloudpickle is not installed.
    """
    if method == "fork":
        return fn  # inherited, not pickled
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if type(fn) is types.MethodType and _bound_needs_value(fn):
        pass  # by value (below): its class cannot be found by name in the child
    elif type(fn) is not types.FunctionType:
        # partial, bound method (it forwards __code__), callable object: pickled by reference
        # (as torch), its object with tensormp's reducers (arrays in it stay shared)
        return fn
    elif "<" not in qualname and (module != "__main__" or _defined_at_top_level(fn)):
        return fn
    try:
        import cloudpickle
    except ImportError:
        raise TypeError(
            f"fn={fn!r} is a lambda, a local function or a function defined under "
            f"`if __name__ == \"__main__\":`, which a child started with {method!r} cannot "
            "import by name; install cloudpickle (pip install cloudpickle) so tensormp can send "
            "it by value, or define fn at the top level of a module"
        ) from None
    return FnByValue(cloudpickle.dumps(fn), f"{module}.{qualname}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _distributed_env(nprocs: int) -> dict[str, str]:
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
    }
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, whatever the host name resolves to
    return env


@overload
def start_processes(
    fn: Any,
    args: tuple[Any, ...] = ...,
    nprocs: int = ...,
    *,
    join: Literal[False],
    daemon: bool = ...,
    start_method: str = ...,
    timeout: float | None = ...,
    grace_period: float | None = ...,
    return_values: bool = ...,
    distributed: bool = ...,
) -> ProcessContext: ...
@overload
def start_processes(
    fn: Any,
    args: tuple[Any, ...],
    nprocs: int,
    join: Literal[False],
    daemon: bool = ...,
    start_method: str = ...,
    *,
    timeout: float | None = ...,
    grace_period: float | None = ...,
    return_values: bool = ...,
    distributed: bool = ...,
) -> ProcessContext: ...
@overload
def start_processes(
    fn: Any,
    args: tuple[Any, ...] = ...,
    nprocs: int = ...,
    join: bool = ...,
    daemon: bool = ...,
    start_method: str = ...,
    *,
    timeout: float | None = ...,
    grace_period: float | None = ...,
    return_values: bool = ...,
    distributed: bool = ...,
) -> ProcessContext | list[Any] | None: ...


def start_processes(
    fn: Any,
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    *,
    timeout: float | None = None,
    grace_period: float | None = None,
    return_values: bool = False,
    distributed: bool = False,
) -> ProcessContext | list[Any] | None:
    """Run ``fn(i, *args)`` in ``nprocs`` tensormp processes, ``i`` in ``range(nprocs)``.

    ``torch.multiprocessing.start_processes`` with any start method (``"spawn"``, ``"fork"``,
    ``"forkserver"``). Arrays in ``args`` (and in return values) cross as shared memory: ``fn``
    receives shared views, its writes are visible to the parent. See the module notes.

    Args:
        fn: the function; a lambda or local function works too (sent with cloudpickle).
        args: extra positional arguments for ``fn``.
        nprocs: the number of processes (ranks); 0 starts none (as torch).
        join: wait for the ranks (True) or return a :class:`ProcessContext` at once.
        daemon: the ranks' ``daemon`` flag.
        start_method: the start method.
        timeout: with ``join=True``, seconds for the whole run; at the deadline the ranks still
            running are stopped and :class:`ProcessTimeoutError` is raised.
        grace_period: after a failure or a timeout, seconds to let the other ranks finish
            before SIGTERM, and again before SIGKILL (None: SIGTERM at once, SIGKILL 30 s
            later, as torch); after a Ctrl-C, seconds from SIGINT to SIGKILL (None: 5 s).
        return_values: with ``join=True``, return the list of each rank's return value.
        distributed: set ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``,
            ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` (and
            ``GLOO_SOCKET_IFNAME=lo`` unless set) in each rank, for
            ``torch.distributed.init_process_group()`` on one machine.

    Returns:
        None (``join=True``), the list of return values (``join=True, return_values=True``),
        or the :class:`ProcessContext` (``join=False``).

    Raises:
        ProcessRaisedException: ``fn`` raised in a rank (its traceback is in the message).
        ProcessExitedException: a rank exited with a non-zero code or was killed by a signal.
        ProcessTimeoutError: ``timeout`` expired (also a ``TimeoutError``).
        KeyboardInterrupt: Ctrl-C; every rank was stopped first.
        SpawnBootstrapError: called at import time of the main module in a child.
        TypeError: ``fn`` is not callable, or cannot be sent to the children.
        ValueError: bad ``nprocs``, ``timeout``, ``grace_period`` or ``start_method``.
    """
    _check_not_bootstrapping()
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 0:
        raise ValueError(f"nprocs must be an int >= 0, got {nprocs!r}")
    for name, value in (("timeout", timeout), ("grace_period", grace_period)):
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0
        ):
            raise ValueError(f"{name} must be None or a number of seconds >= 0, got {value!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            f"args must be a tuple of arguments for fn(i, *args), got {type(args).__name__}; "
            f"for one argument write args=({args!r},)"
        )
    from .context import get_context

    ctx = get_context(start_method)
    method = ctx.get_start_method()
    if nprocs == 0:  # nothing to start (torch returns None too)
        empty = ProcessContext([], [], return_values=return_values)
        if not join:
            return empty
        return [] if return_values else None
    target = _prepare_fn(fn, method)
    args = tuple(args)
    base_env = _distributed_env(nprocs) if distributed else None
    deadline = None if timeout is None else time.monotonic() + timeout

    if method != "fork":
        # Its first start unblocks SIGINT in this thread (multiprocessing.resource_tracker's
        # ensure_running), which would undo _sigint_blocked() for the first rank.
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()
    processes: list[Any] = []
    channels: list[socket.socket] = []
    try:
        for i in range(nprocs):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            channels.append(ours)
            try:
                env = None
                if base_env is not None:
                    env = {**base_env, "RANK": str(i), "LOCAL_RANK": str(i)}
                process = ctx.Process(
                    target=spawn_entry,
                    args=(target, i, args, theirs, env, return_values),
                    daemon=daemon,
                )
                with _sigint_blocked():
                    try:
                        process.start()
                    except Exception as e:
                        if hasattr(e, "add_note"):
                            e.add_note(
                                f"tensormp.spawn: could not start process {i} with the "
                                f"{method!r} start method (fn and args are pickled for it)"
                            )
                        raise
                processes.append(process)
            finally:
                theirs.close()
    except BaseException as e:
        context = ProcessContext(processes, channels)
        if processes:
            try:
                context._kill_all()
            except KeyboardInterrupt:
                pass
        context._close_channels()
        if isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt(
                f"tensormp.spawn: interrupted (Ctrl-C) while starting; stopped "
                f"{len(processes)} processes"
            ) from None
        raise
    context = ProcessContext(processes, channels, return_values=return_values)
    if not join:
        return context
    try:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise context._timed_out(timeout, grace_period)  # type: ignore[arg-type]
            if context.join(left, grace_period):
                break
    except KeyboardInterrupt as e:
        raise context._interrupted(grace_period, e) from None
    return context.return_values if return_values else None


@overload
def spawn(
    fn: Any,
    args: tuple[Any, ...] = ...,
    nprocs: int = ...,
    *,
    join: Literal[False],
    daemon: bool = ...,
    start_method: str = ...,
    **kwargs: Any,
) -> ProcessContext: ...
@overload
def spawn(
    fn: Any,
    args: tuple[Any, ...],
    nprocs: int,
    join: Literal[False],
    daemon: bool = ...,
    start_method: str = ...,
    **kwargs: Any,
) -> ProcessContext: ...
@overload
def spawn(
    fn: Any,
    args: tuple[Any, ...] = ...,
    nprocs: int = ...,
    join: bool = ...,
    daemon: bool = ...,
    start_method: str = ...,
    **kwargs: Any,
) -> ProcessContext | list[Any] | None: ...


def spawn(
    fn: Any,
    args: tuple[Any, ...] = (),
    nprocs: int = 1,
    join: bool = True,
    daemon: bool = False,
    start_method: str = "spawn",
    **kwargs: Any,
) -> ProcessContext | list[Any] | None:
    """Spawn ``nprocs`` processes running ``fn(i, *args)`` (``torch.multiprocessing.spawn``).

    As in torch, ``start_method`` other than ``"spawn"`` is deprecated here (a
    ``FutureWarning``) and ignored: use :func:`start_processes` for other start methods.
    Keyword arguments (``timeout``, ``grace_period``, ``return_values``, ``distributed``) are
    those of :func:`start_processes`.

    Beyond one machine (torch.distributed.elastic; see :mod:`tensormp.elastic`): under
    ``torchrun`` this process is one rank already, so spawn() starts no process and runs
    ``fn(LOCAL_RANK, *args)`` here (``nprocs`` must be torchrun's ``LOCAL_WORLD_SIZE``). With
    ``nnodes=N, rdzv_endpoint="host:port"`` (plus ``rdzv_id=None``, ``max_restarts=0``,
    ``rdzv_timeout=600``, ``monitor_interval=0.1``, ``local_addr=None``), the same call on N
    machines forms one job of ``N * nprocs`` ranks through torch's c10d rendezvous;
    ``fn(local_index, *args)`` runs in each; a failure of any rank raises on every node.

    Example::

        def train(rank, weights):          # weights: a shared numpy array
            weights[rank] += 1

        if __name__ == "__main__":
            w = tensormp.zeros(2)
            tensormp.spawn(train, args=(w,), nprocs=2)
            assert (w == 1).all()

    Raises:
        ProcessRaisedException: ``fn`` raised in a rank.
        ProcessExitedException: a rank exited with a non-zero code or by a signal.
        ProcessTimeoutError: the ``timeout`` expired.
        KeyboardInterrupt: Ctrl-C; every rank was stopped first.
        SpawnBootstrapError: called at import time of the main module in a child.
        TypeError, ValueError: see :func:`start_processes`.
    """
    _check_not_bootstrapping()
    if start_method != "spawn":
        warnings.warn(
            f"This method only supports start_method=spawn (got: {start_method}).\n"
            "To use a different start_method use:\n\t\t tensormp.start_processes(...)",
            FutureWarning,
            stacklevel=2,
        )
    if "nnodes" in kwargs or os.environ.get("TORCHELASTIC_RUN_ID"):  # beyond one machine
        from . import elastic

        if "nnodes" in kwargs or elastic.under_torchrun():
            return elastic.spawn(fn, tuple(args), nprocs, join, **kwargs)
    return start_processes(fn, args, nprocs, join, daemon, start_method="spawn", **kwargs)

