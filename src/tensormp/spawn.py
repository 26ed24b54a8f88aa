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

Where the code is: this module checks the arguments and starts the ranks; ``_spawn_context.py``
waits for them, stops them and collects their failures (:class:`ProcessContext`);
``_spawn_errors.py`` has the exceptions and their text; ``_spawn_rank.py`` is what a rank runs
and ``_spawn_report.py`` what it reports; ``_by_value.py`` decides how ``fn`` travels;
``elastic.py`` goes beyond one machine.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import warnings
from contextlib import contextmanager
from multiprocessing import process as _mpprocess
from typing import Any, Literal, overload

from . import _by_value
from ._spawn_context import ProcessContext, SpawnContext
from ._spawn_errors import (
    ProcessException,
    ProcessExitedException,
    ProcessFailure,
    ProcessRaisedException,
    ProcessTimeoutError,
    SpawnBootstrapError,
)
from ._spawn_rank import spawn_entry

__all__ = [  # in the order of the API page (docs/api/spawn.md)
    "ProcessFailure",
    "ProcessException",
    "ProcessRaisedException",
    "ProcessExitedException",
    "ProcessTimeoutError",
    "SpawnBootstrapError",
    "ProcessContext",
    "SpawnContext",
    "start_processes",
    "spawn",
]


# -- starting -----------------------------------------------------------------------------------
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
    target = _by_value.prepare(fn, method)
    args = tuple(args)
    base_env = None
    if distributed:
        from ._spawn_env import distributed_env

        base_env = distributed_env(nprocs)
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

