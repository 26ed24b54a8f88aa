"""The pool's exceptions: :class:`WorkerLostError` (a worker died while it ran a task) and
:class:`BrokenPoolError` (the pool cannot run tasks any more).

Both are :class:`tensormp.TensormpError` and ``RuntimeError``, and pickle with their
attributes; ``tensormp.futures`` derives ``TerminatedWorkerError`` and ``BrokenExecutorError``
from them. ``engines/local.py`` and ``engines/ray.py`` raise them and writes their messages.

Their ``__module__`` is the public ``tensormp.pool``, as before the package split: pickles
record that path (and load with older and newer versions), and tracebacks show it.
"""

from __future__ import annotations

import signal
from typing import Any

from ..errors import TensormpError


def _signal_name(exitcode: int) -> str:
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


class WorkerLostError(TensormpError, RuntimeError):
    """A pool worker died while it ran this task: killed by a signal (the OOM killer sends
    SIGKILL), ``os._exit()``, ``sys.exit()`` in the task, or a crash in native code.

    The stdlib ``Pool`` hangs forever in this case. The pool replaced the worker and keeps
    running; only this task failed. ``__cause__`` holds the worker's traceback when it is known
    (a ``sys.exit()`` in the task, or the faulthandler stack of a SIGSEGV/SIGBUS/SIGABRT).

    Attributes:
        pid: the worker's process id (None when not known: a Ray actor that died starting).
        exitcode: its exit status (negative: killed by signal ``-exitcode``; None when not
            known, as for most deaths of Ray actors).
        signal_name: ``"SIGKILL"`` etc. when killed by a signal, else None.
        task: what it was running, e.g. ``"map(work) chunk 3 of 8 (items 6-7)"``.
        node: the address of the worker's machine (``engine="ray"``), else None.
    """

    __module__ = "tensormp.pool"  # the public path (see the module docstring)

    def __init__(
        self, msg: str, pid: int | None = None, exitcode: int | None = None, task: str = "",
        node: str | None = None,
    ) -> None:
        super().__init__(msg)
        self.msg = msg
        self.pid = pid
        self.exitcode = exitcode
        self.task = task
        self.node = node

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        return _signal_name(self.exitcode)

    def __str__(self) -> str:
        return self.msg

    def __reduce__(self) -> Any:
        return type(self), (self.msg, self.pid, self.exitcode, self.task, self.node)


class BrokenPoolError(TensormpError, RuntimeError):
    """The pool cannot run this task: its initializer raised, its workers cannot start, or it
    was terminated (``terminate()``, the end of its ``with`` block) before the task finished.

    ``__cause__`` holds the initializer's exception (with its remote traceback) when that is
    the reason. A broken pool raises this for every new call; create a new pool.
    """

    __module__ = "tensormp.pool"  # the public path (see the module docstring)
