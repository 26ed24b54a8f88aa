"""The code that runs in a pool worker process, and the messages on its channel.

:func:`_worker_main` is the target of every worker ``Process`` (pickled by reference under
spawn and forkserver). It runs the initializer, says it is ready, then runs tasks one at a time,
in the order received, until told to stop, EOF, or ``maxtasksperchild`` tasks.

What crosses the worker's ``Connection`` (pickled with tensormp's reducers):

* parent -> worker: a task ``(seq, fn, kind, args)``, run by ``runner.run_task``: ``kind``
  is one of ``tasks._CALL``, ``_MAP``, ``_STARMAP``; ``fn`` is the callable, or a
  ``_by_value.FnByValue`` (cloudpickle) kept unpickled in a small cache. A list: a batch, the pickles of several such tasks that carry no fds (tiny tasks sent
  in one message), run and answered one by one as if sent one by one: ``[fns, item...]``, an
  item being a task's own pickle, or for a light task (its arguments only scalars, ``str``,
  ``bytes``: ``tasks._light_size``) the tuple ``(seq, i, kind, args)``, pickled with the batch,
  whose callable is ``fns[i]`` (a pickle, loaded once per batch; if it cannot be, each task
  using it fails on its own). ``None``: stop.
* worker -> parent: ``(_READY, pid)`` once the initializer ran; ``(_INIT_ERROR, exc)`` when it
  raised (then exit code 1); ``(_RESULT, seq, ok, value, seconds)`` for each task, in order
  (``seq`` is None when the task could not be received or unpickled; ``seconds``: how long the
  call ran, which sets how many tasks the parent queues ahead, ``engines/local.py`` "Prefetch");
  ``(_DYING, seq, traceback)`` just before a ``BaseException`` (``SystemExit``...) raised by a
  task ends the worker; ``(_RETURNED, n)``: see "Give-back".

*Give-back.* A worker also has a *give-back thread*, blocked on an eventfd of the parent's
(``give_back``). When the parent writes it (another worker idles while tasks wait here behind a
long one), the thread takes, under the lock the main thread holds to pick its next task and to
answer, every task not started: the rest of the batch being run, and every record still unread
in the channel (read with ``MSG_DONTWAIT``; a record's header ``slot`` is the number of tasks
it carries, no slot meaning one), and answers ``(_RETURNED, n)``: the last ``n`` tasks the
parent sent here are the parent's again, never to run here (the parent sends nothing here
meanwhile). It does so only while the main thread runs a task: then every unread record was
sent behind a running task, so it carries no fds and no blocks of ours (the parent queues only
such tasks behind a running one) and is simply dropped. Otherwise it answers ``n = 0``.

The crash log is a memfd of the parent's, passed as a ``Process`` argument (:class:`_RawFd`);
the worker points ``faulthandler`` at it, and the parent reads it when the worker dies of a
signal.

This module imports nothing heavy: a worker imports numpy only if its tasks carry arrays.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import reprlib
import signal
import sys
import threading
import types
from typing import Any, NoReturn

from .. import reducers
from .._by_value import FnByValue, pickles
from .._fdpass import close_all as _close_all
from ..connection import NO_SLOT as _NO_SLOT
from ..errors import FdLimitError
from .runner import format_exception, load_fn, run_task, wrap

_READY, _INIT_ERROR, _RESULT, _DYING, _RETURNED = 0, 1, 2, 3, 4  # worker -> parent tags


class _RawFd:
    """An fd handed to a worker as a ``Process`` argument (fork: inherited)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        msg = reducers.current_message()
        if msg is None:
            raise TypeError("a pool worker's crash log travels only as a tensormp Process argument")
        return _rebuild_raw_fd, (msg.add_fd(self.fd, ("pool-raw-fd", self.fd), self),)


def _rebuild_raw_fd(index: Any) -> _RawFd:
    return _RawFd(reducers.take_fd(index))


class _LoadFailed:
    """A batch's callable that could not be unpickled: every task using it fails with this."""

    __slots__ = ("error",)

    def __init__(self, error: Any) -> None:
        self.error = error


class _Repr:
    """Shows a pre-computed (short) repr: for MaybeEncodingError of a huge value."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _send_quietly(conn: Any, obj: Any) -> None:
    try:
        conn.send(obj)
    except Exception:  # noqa: BLE001 - the parent is gone, or obj cannot be pickled
        pass


def _stateless(fn: Any) -> bool:
    """Whether unpickling ``fn`` again would give the same object (a function, builtin or
    class found by name), so one loaded copy can serve many tasks. A callable object, bound
    method or partial is unpickled afresh for each task instead, as the stdlib does: what one
    call changes in it is not seen by the next."""
    return type(fn) in _STATELESS or isinstance(fn, type)


_STATELESS = (types.FunctionType, types.BuiltinFunctionType, FnByValue)


def _die(conn: Any, seq: Any, exc: BaseException) -> NoReturn:
    """A task raised ``exc`` (``SystemExit``...): report it (``_DYING``), and end with it."""
    _send_quietly(conn, (_DYING, seq, format_exception(exc)))
    raise exc


class _Hand:
    """What a worker holds and has not started (see "Give-back" in the module notes): the rest
    of the batch being run (last first) and whether a task is running. Changed under ``lock``
    by the main thread and by the give-back thread."""

    __slots__ = ("lock", "batch", "running")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batch: list[Any] = []
        self.running = False


def _give_back_loop(conn: Any, fd: int, hand: _Hand) -> None:
    """The give-back thread: each time the parent writes ``fd``, hand back every task queued
    here and not started, and say how many (``(_RETURNED, n)``)."""
    while True:
        try:
            os.eventfd_read(fd)
        except OSError:
            return
        with hand.lock:
            n = 0
            if hand.running:  # (else nothing is queued behind a task; the main thread reads)
                n = len(hand.batch)
                hand.batch.clear()
                try:
                    while True:
                        record = conn.read_record(wait=False)
                        if record is None:
                            break
                        # Only fd-less records wait behind a running task: nothing to free.
                        _close_all(record.fds)
                        record.close_tokens()
                        n += 1 if record.slot == _NO_SLOT else record.slot
                except (EOFError, OSError):  # the parent is gone
                    return
            try:
                conn.send_bytes(pickle.dumps((_RETURNED, n)))
            except OSError:
                return


def _worker_main(
    conn: Any,
    crash: _RawFd,
    initializer: Any,
    initargs: tuple[Any, ...],
    maxtasks: int | None,
    inherited: Any,
    parent_pid: int,
    give_back: _RawFd | None = None,
) -> None:
    """The target of every pool worker: run tasks from ``conn`` until told to stop.

    Exit status 0 after ``maxtasks`` tasks, a stop message, or EOF; 1 when the initializer
    raised (after reporting it).
    """
    if inherited is not None:  # fork: our copy of the parent's end; the parent's close is EOF
        inherited.close()
    # A Ctrl-C reaches the whole process group: the parent decides (terminate()), so that a
    # task is never half-interrupted with a traceback per worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        faulthandler.enable(file=crash.fd, all_threads=True)
    except (OSError, ValueError, RuntimeError):
        pass
    if initializer is not None:
        try:
            load_fn(initializer, {})(*initargs)
        except BaseException as e:
            _send_quietly(conn, (_INIT_ERROR, wrap(e)))
            sys.exit(1)
    hand = _Hand()
    lock = hand.lock
    if give_back is not None:
        threading.Thread(
            target=_give_back_loop, args=(conn, give_back.fd, hand),
            name="tensormp-pool-give-back", daemon=True,
        ).start()
    try:
        conn.send((_READY, os.getpid()))
    except OSError:  # the pool is gone already
        return
    cache: dict[bytes, Any] = {}
    batch = hand.batch  # a batch's tasks not run yet (pickles or tuples), last first
    batch_fns: list[Any] = []  # its callables: pickles, loaded on first use
    done = 0
    # The batch's next task, taken (and ``hand.running`` set) under the lock in the same step
    # as the previous answer went out; None: read the channel.
    data: Any = None
    while maxtasks is None or done < maxtasks:
        reply: Any = None
        if data is not None:
            fds: list[int] = []
            if type(data) is tuple:  # a light task: (seq, index of its callable, kind, args)
                seq, i, kind, args = data
                data = None
                fn = batch_fns[i]
                if type(fn) is bytes:
                    try:
                        fn = reducers.loads(fn, [])
                    except Exception as e:
                        if hasattr(e, "add_note"):
                            e.add_note("(unpickling the task's callable in the pool worker)")
                        fn = batch_fns[i] = _LoadFailed(wrap(e))
                    else:
                        if _stateless(fn):  # the same object whenever it is unpickled
                            batch_fns[i] = fn
                        # else each task gets its own copy of the callable, as the stdlib's
                if type(fn) is _LoadFailed:
                    reply = (_RESULT, seq, False, fn.error, 0.0)
                else:
                    ok, value, seconds = run_task(fn, kind, args, cache)
                    if ok is None:
                        _die(conn, seq, value)
                    reply = (_RESULT, seq, ok, value, seconds)
                    del value
                del args, fn
        else:
            try:
                data, fds = conn.recv_message()
            except FdLimitError as e:  # that task was dropped; say so, and go on
                reply = (_RESULT, None, False, wrap(e), 0.0)
            except (EOFError, OSError):  # the parent closed our channel
                return
        if reply is None:
            # The parent registered us as the holder of its own blocks in this task before
            # sending it (as for Process arguments): no hold records for those.
            reducers.process_args_parent(parent_pid)
            try:
                task = reducers.loads(data, fds)
            except Exception as e:
                if hasattr(e, "add_note"):
                    e.add_note("(unpickling the task in the pool worker)")
                reply = (_RESULT, None, False, wrap(e), 0.0)
            else:
                if task is None:
                    return
                if type(task) is list:  # a batch: each task answered on its own, in order
                    batch_fns = task[0]
                    with lock:
                        batch[:] = task[:0:-1]
                        data = batch.pop() if batch else None
                        hand.running = data is not None
                    continue
            finally:
                reducers.process_args_parent(0)
            del data, fds
            if reply is None:
                if not hand.running:
                    with lock:
                        hand.running = True
                seq, fn, kind, args = task
                ok, value, seconds = run_task(fn, kind, args, cache)
                if ok is None:
                    _die(conn, seq, value)
                reply = (_RESULT, seq, ok, value, seconds)
                del value, fn, args
                del task
        with lock:
            try:
                conn.send(reply)
            except (BrokenPipeError, ConnectionError, EOFError):
                return
            except Exception as e:  # the result cannot be pickled: say why (as the stdlib)
                from multiprocessing.pool import (  # type: ignore[attr-defined]  # no stub
                    MaybeEncodingError,
                )

                short = _Repr(reprlib.repr(reply[3]))
                error = MaybeEncodingError(e, short)
                # The pickling error itself travels too (in the instance's __dict__), when it
                # can: the executor raises it, as concurrent.futures does.
                error.pickling_error = e if pickles(e) else None
                conn.send((_RESULT, reply[1], False, wrap(error), reply[4]))
            data = batch.pop() if batch else None
            hand.running = data is not None
        reply = None
        done += 1
