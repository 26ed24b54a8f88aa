"""The exceptions of ``spawn()`` and the text they carry (``torch.multiprocessing``'s types).

Protocol note
-------------
The parent builds one exception per failed run from a :class:`ProcessFailure` per failed rank
(what the rank's report channel and exit status told it, ``_spawn_context.py``). ``str(e)`` is
torch's message for the first failure alone (``_torch_message``); everything else is in
``e.failures`` and in the exception's notes (PEP 678), which the traceback printer shows after
the message on Python >= 3.11 and which open the message on 3.10 (:func:`failure_exception`).

The exceptions cross processes (a queue, a test runner, ``elastic.py``'s failure records) by
``__reduce__``, which keeps every attribute, notes included. They live here, and say
``__module__ = "tensormp.spawn"``: pickles and printed tracebacks name the public module, as
they did when these classes were defined in ``spawn.py``. This module imports nothing heavy.
"""

# No `from __future__ import annotations` here: with it, typing.NamedTuple compiles each field's
# annotation string at import, about 0.1 ms of every child's start-up.
import signal
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeVar

from .errors import TensormpError

__all__ = [
    "ProcessFailure",
    "ProcessException",
    "ProcessRaisedException",
    "ProcessExitedException",
    "ProcessTimeoutError",
    "SpawnBootstrapError",
    "signal_name",
    "stack_note",
    "failure_exception",
]

_PUBLIC = "tensormp.spawn"  # the module users import these from, and pickles name


def signal_name(exit_code: int) -> str:
    """``"SIGSEGV"`` for an exit code of ``-11``: the signal a negative exit status names."""
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"<Unknown signal {-exit_code}>"


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


ProcessFailure.__module__ = _PUBLIC  # (a NamedTuple's body cannot set it)


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

    __module__ = _PUBLIC

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
        # Exception's own (not the next in the MRO: in a torch_compatible() class that is
        # torch's, whose __init__ takes more arguments).
        Exception.__init__(self, msg)
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

    __module__ = _PUBLIC

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

    __module__ = _PUBLIC

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


_twins: dict[type, type] = {}


_E = TypeVar("_E", bound="ProcessException")


def torch_compatible(cls: type[_E]) -> type[_E]:
    """``cls`` (:class:`ProcessRaisedException` or :class:`ProcessExitedException`), or, once
    ``torch.multiprocessing`` is imported, a subclass of it and of torch's class of the same name:
    code (a library) that catches ``torch.multiprocessing.ProcessRaisedException`` catches
    tensormp's too. It has the same name, and pickles as ``cls`` (a pickle never names it)."""
    torch_cls = getattr(sys.modules.get("torch.multiprocessing.spawn"), cls.__name__, None)
    if not isinstance(torch_cls, type) or not issubclass(torch_cls, BaseException):
        return cls
    twin: Any = _twins.get(cls)
    if twin is None:

        def __reduce__(self: Any) -> Any:
            return (cls, *cls.__reduce__(self)[1:])

        try:
            twin = type(cls.__name__, (cls, torch_cls), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__, "__reduce__": __reduce__,
            })
        except TypeError:  # a torch whose class cannot be combined with ours: ours alone
            twin = cls
        _twins[cls] = twin
    return twin  # type: ignore[no-any-return]


class ProcessTimeoutError(ProcessException, TimeoutError):
    """``spawn(..., timeout=...)`` expired; the ranks still running were stopped.

    Attributes:
        running: the ranks that were still running at the deadline.
    """

    __module__ = _PUBLIC

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

    __module__ = _PUBLIC


# -- the message and the notes ------------------------------------------------------------------
MAX_NOTED_STACKS = 8  # other failures whose stacks become notes; the rest: in e.failures
# The traceback printer shows exception notes from Python 3.11 on (PEP 678).
_PRINTER_SHOWS_NOTES = sys.version_info >= (3, 11)


def _torch_message(failure: ProcessFailure) -> str:
    """torch's message for a failure: ``str(e)`` ends with the rank's traceback (as torch's,
    which code matches on) or is torch's one line for an exit code or a signal."""
    i = failure.index
    if failure.exc_type:
        trace = failure.traceback or f"{failure.exc_type}: {failure.exc_message}\n"
        return f"\n\n-- Process {i} terminated with the following error:\n{trace}"
    if failure.signal_name:
        return f"process {i} terminated with signal {failure.signal_name}"
    return f"process {i} terminated with exit code {failure.exit_code}"


def stack_note(failure: ProcessFailure) -> str:
    """A note with a failed rank's traceback, or its ``faulthandler`` stack after a signal."""
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


def failure_exception(failures: list[ProcessFailure], notes: list[str]) -> ProcessException:
    """The exception that ``join()`` raises for ``failures`` (the first one first).

    Args:
        failures: every failed rank, the one the exception is about first.
        notes: what is known of the first failure besides torch's message (its stack, why it
            failed before running ``fn``); a summary of the others and their stacks follow.
    """
    first, others = failures[0], failures[1:]
    notes = list(notes)
    if others:
        notes.append(
            f"-- {len(others)} other process(es) failed too:\n"
            + "\n".join("  " + f.summary() for f in others)
        )
        stacks = [f for f in others if f.traceback]
        notes.extend(stack_note(f) for f in stacks[:MAX_NOTED_STACKS])
        if len(stacks) > MAX_NOTED_STACKS:
            notes.append(
                f"[the stacks of {len(stacks) - MAX_NOTED_STACKS} more processes are in "
                "e.failures]"
            )
    msg = _message_with_notes(_torch_message(first), notes)
    error: ProcessException
    if first.exc_type:
        error = torch_compatible(ProcessRaisedException)(
            msg, first.index, first.pid, exc_type=first.exc_type,
            exc_message=first.exc_message, exit_code=first.exit_code,
            signal_name=first.signal_name, failures=failures,
        )
    else:
        error = torch_compatible(ProcessExitedException)(
            msg, first.index, first.pid, first.exit_code, first.signal_name,
            failures=failures,
        )
    _attach_notes(error, notes)
    return error
