"""The parent's side of ``spawn()``: :class:`ProcessContext` waits for the ranks, reads their
reports, stops them, and turns what it learnt into one exception.

Protocol note
-------------
Each rank has a ``Process`` and the parent's end of its report channel (``_spawn_report.py``).
A rank is *running* until its sentinel closes, then *reaped*: its exit status is taken
(``waitpid``, never blocking for long: a rank that closed its sentinel but lives on is polled
from then on, *blind*), and only then is its channel read, without blocking, a bounded number
of bytes, into an ``_Outcome``. A rank failed when it reported an error, or exited non-zero
without the parent having stopped it. On the first failure, a timeout or a Ctrl-C the parent
stops the others: a grace period, SIGTERM (SIGINT after a Ctrl-C), a grace period, SIGKILL,
each wait bounded. Ranks the parent stopped are not failures. The exception is built once
(``_spawn_errors.py``) and raised again by every later ``join()``. The channels are closed when
the run is over, or when the context is collected.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import warnings
from typing import Any

from . import _spawn_report
from ._spawn_errors import (
    ProcessException,
    ProcessFailure,
    ProcessTimeoutError,
    failure_exception,
    signal_name,
    stack_note,
)

__all__ = ["ProcessContext", "SpawnContext"]

_TERM_TIMEOUT = 30.0  # seconds between SIGTERM and SIGKILL when no grace period is given (torch)
_INTERRUPT_GRACE = 5.0  # seconds from a Ctrl-C (forwarded as SIGINT) to SIGKILL by default
_KILL_TIMEOUT = 10.0  # seconds to wait for a SIGKILLed process before giving up on it
_REAP_TIMEOUT = 5.0  # seconds from a closed sentinel to an exit status
_BLIND_POLL = 0.05  # poll interval for a rank whose sentinel closed before it exited


class _Outcome:
    """What the parent learnt of a rank once it exited."""

    # A plain class, not a NamedTuple: typing.NamedTuple compiles code when the class is made,
    # about 0.3 ms of every `import tensormp` (and so of every child's start-up).
    __slots__ = ("exit_code", "report", "stopped")

    def __init__(self, exit_code: int, report: _spawn_report.ChannelReport, stopped: bool) -> None:
        self.exit_code = exit_code
        self.report = report
        self.stopped = stopped  # the parent had sent it SIGTERM/SIGKILL


class ProcessContext:
    """The ranks started by :func:`start_processes` (``torch.multiprocessing.ProcessContext``).

    Attributes:
        processes: the ``Process`` objects, by rank.
        sentinels: ``{sentinel: rank}`` of the ranks not yet joined (as torch).
    """

    __module__ = "tensormp.spawn"  # its public home (reprs, docs)

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
            signal_name(code) if code < 0 else None,
            error.type if error else "", error.message if error else "", trace,
        )

    def _first_notes(self, failure: ProcessFailure) -> list[str]:
        """What tensormp knows of the first failure besides torch's message."""
        outcome = self._outcomes[failure.index]
        assert outcome is not None
        report = outcome.report
        i = failure.index
        notes = []
        if failure.signal_name and failure.traceback:
            notes.append(stack_note(failure))
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
        # The first failure: ranks that raised or crashed before ranks that merely exited,
        # which are often collateral (a collective op whose peer died); then by rank.
        failures = [self._failure(i) for i in self._failed()]
        failures.sort(key=lambda f: (not (f.exc_type or f.signal_name), f.index))
        return failure_exception(failures, self._first_notes(failures[0]))


class SpawnContext(ProcessContext):
    """torch's old name for :class:`ProcessContext`: constructing one warns, as in torch.

    Deprecated: use :class:`ProcessContext`.
    """

    __module__ = "tensormp.spawn"  # its public home (reprs, docs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        warnings.warn(
            "SpawnContext is renamed to ProcessContext (as in torch since 1.4); use "
            "tensormp.ProcessContext",
            stacklevel=2,
        )
        super().__init__(*args, **kwargs)
