"""The ``local`` engine: worker processes of this machine, each with its own Unix socket; arrays
in arguments and results cross as shared memory. :class:`Engine` is a ``base.QueueEngine``
(the task deque, the state, feeders, the manager's loop) that owns the workers (:class:`_Worker`)
and writes the manager's turns: ``_dispatch``, ``_wait``, ``_closing_done``, ``_shutdown``. Two
additions of its own, for tiny tasks: callers send a lone task to an idle worker themselves
("Direct send", ``_send_now``), and imap feeders get room for as many tasks as the workers'
channels hold ("Prefetch": ``_room_limit`` follows the workers' depths).

Callers' threads (and imap feeders) touch the task deque and the state, under ``_lock``, and
wake the manager through an eventfd, only when it may be asleep with nothing to do (``_idle``:
a manager waiting for a worker's answer re-reads the deque when it comes). The manager thread
owns the rest (once the constructor has started the first workers): it starts replacement
workers, pickles and sends tasks (a few per worker: see "Prefetch"), reads results and runs the
result sinks (callbacks included), reaps dead workers, fails or requeues their tasks, and at the
end stops the workers and closes every fd.

*Direct send.* One exception, for latency: a single task submitted while the deque is empty and
a worker is idle is pickled and sent by the caller's own thread (no hop through the manager;
``apply()`` of a tiny call is about 1.5 thread wake-ups faster). Every write to a worker's
channel, every append to a worker's ``outstanding`` by a sender, and every step that makes a
worker unusable (its channel closed, it stopping, it gone) happens under ``_send_lock``; a
caller only tries that lock (never waits behind a large send by the manager) and sends only
what goes in without blocking, else it leaves the task to the manager as before. The answer
still comes back through the manager, which reads every channel. Tasks carrying blocks of ours
(arrays: the worker must be registered as their holder first), large ones, and pools with
``maxtasksperchild`` always go through the manager.

*Prefetch.* A worker whose tasks are tiny would sleep and be woken once per task, as would the
manager, if it held only the task it runs: on 2 cores that costs more than the tasks (the
stdlib's shared queue holds every task at once, so its workers never wait). So the manager keeps
up to ``depth`` small tasks queued in a worker's channel, ``depth`` chosen so that they add up
to about ``_PREFETCH_BUDGET`` seconds of run time (the worker measures each call; a moving
average; at least 2, at most ``_MAX_DEPTH``): tasks of a millisecond or more keep "one running,
one queued", while thousands of microsecond tasks stream. The rule, so that no task waits behind
a long one while a worker idles (the stdlib and loky never let it):

* an idle worker is served first; a busy one gets a queued task only while more tasks wait
  than there are workers, and not while it runs a task it gave tasks back behind (below);
* only *queueable* tasks wait behind a running one: small, no fds, no blocks of ours
  (``_queueable``): what carries shared memory waits here for an idle worker, pickled already;
* *give-back*: when a worker idles with nothing pending while another's running task has run
  ``_STEAL_AFTER`` with tasks queued behind it, the manager asks that worker (its eventfd) for
  every task it has not started, sends it nothing until it answers ``(_RETURNED, n)``, and puts
  its last ``n`` tasks back at the head of the deque, for the idle worker (``worker.py``,
  "Give-back", says why no task can run twice or be lost). A future stays RUNNING meanwhile.

*Light batches.* Small fd-less tasks bound for one worker in one round go as one message. A
*light* task (arguments only scalars, ``str``, ``bytes``: ``tasks._light_size``) is not
pickled on its own: its tuple goes in the batch's single pickle and its callable is pickled
once per batch (``_messages``). That cuts the CPU per tiny
``imap`` task (parent and worker) by about a third: one ``dumps``/``loads`` per batch, not
per task.

:class:`_Worker` is its record of one worker. What a worker's death does to its tasks, and who
frees which shared memory, is in the package's design note (``__init__.py``).
"""

from __future__ import annotations

import collections
import os
import select
import signal
import threading
import time
from typing import Any

from ... import reducers
from ..._by_value import pickles
from ...connection import Pipe
from ...errors import FdLimitError
from ..errors import WorkerLostError, _signal_name
from ..tasks import _describe, _light_size, _Task
from ..worker import _DYING, _INIT_ERROR, _READY, _RESULT, _RETURNED, _RawFd, _worker_main
from .base import LOST_TAIL, TERMINATE, EngineConfig, QueueEngine

OPTIONS: tuple[str, ...] = ()  # engine-specific keywords (none)
_WAKE, _CONN, _SENTINEL = 0, 1, 2  # what a polled fd is
_PREFETCH_MAX_BYTES = 64 << 10  # never queue a bigger message behind a running task (nor send
# one from a caller's thread)
_PREFETCH_BUDGET = 0.002  # seconds of tasks queued in a worker's channel (see "Prefetch")
_MAX_DEPTH = 32  # tasks in a worker's channel at most (the one it runs included)
_STEAL_AFTER = 0.01  # seconds a task runs before the tasks queued behind it are taken back
# for an idle worker (see "Prefetch")
_EMA = 0.25  # weight of the newest sample in a worker's time per task
_TERM_GRACE = 2.0  # seconds from SIGTERM to SIGKILL in terminate()
_STOP_GRACE = 5.0  # seconds a worker told to stop (close()) may take to exit before SIGKILL
_REAP_TIMEOUT = 5.0  # seconds to wait for the exit status of a worker whose sentinel fired
_LIVENESS_INTERVAL = 1.0  # seconds between waitpid() checks of every worker
_MAX_CRASH_LOG = 64 << 10
_MAX_STARTUP_FAILURES = 3  # workers killed by a signal before ready, in a row, break the pool


class _Worker:
    __slots__ = (
        "process", "conn", "crash_fd", "pid", "ready", "assigned", "outstanding", "eof",
        "retiring", "stopping", "dying", "init_error", "gone", "stop_deadline", "per_task",
        "depth", "give_back_fd", "stealing", "gave_back", "head_since",
    )

    def __init__(self, process: Any, conn: Any, crash_fd: int, give_back_fd: int) -> None:
        self.process = process
        self.conn = conn
        self.crash_fd = crash_fd
        self.give_back_fd = give_back_fd  # written to ask for its queued tasks back
        self.stealing = False  # asked, not answered yet: nothing is sent to it meanwhile
        self.gave_back = False  # gave tasks back: nothing is queued behind its running one
        self.head_since = 0.0  # when its oldest outstanding task started (about)
        self.pid: int = process.pid
        self.ready = False
        self.assigned = 0  # tasks sent, for maxtasksperchild
        self.outstanding: collections.deque[_Task] = collections.deque()
        self.eof = False  # its channel is closed: send nothing more
        self.retiring = False  # got its last task (maxtasksperchild): a replacement is started
        self.stopping = False  # told to stop (close())
        self.dying = ""  # traceback of a BaseException that ends it
        self.init_error: BaseException | None = None
        self.gone = False
        self.stop_deadline: float | None = None
        self.per_task = -1.0  # seconds a task runs, a moving average (-1: none ran yet)
        self.depth = 2  # tasks it may hold (see "Prefetch")

    def timed(self, seconds: float) -> None:
        """A task ran ``seconds``: update the moving average and the depth."""
        per = self.per_task = seconds if self.per_task < 0 else (
            self.per_task + _EMA * (seconds - self.per_task)
        )
        self.depth = _MAX_DEPTH if per * _MAX_DEPTH <= _PREFETCH_BUDGET else max(
            2, int(_PREFETCH_BUDGET / per)
        )


class Engine(QueueEngine):
    """Worker processes of this machine, and the manager thread (see the module notes)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.ctx = config.ctx
        self._pool_names = config.pool_names
        self.method = self.ctx.get_start_method()
        # Tasks an imap feeder may queue here: a few per worker, or as many as the workers'
        # queues hold when their tasks are tiny (one feeder wake-up per half of it).
        self._min_room = self._room_limit
        self._send_lock = threading.Lock()  # writes to workers' channels (see "Direct send")
        self._direct = self._maxtasks is None
        self.workers: list[_Worker] = []
        self._startup_failures = 0
        self._last_liveness = time.monotonic()
        self._answers: list[tuple[_Task, bool, Any]] = []  # read, not yet delivered
        self._poller = select.poll()
        self._fdmap: dict[int, tuple[int, _Worker | None]] = {}
        self._wake_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._woken = False
        self._register(self._wake_fd, _WAKE, None)
        self._start()

    def describe(self) -> str:
        pids = [w.pid for w in list(self.workers) if not w.gone]
        return f"start_method={self.method} pids={pids}"

    def worker_processes(self) -> list[Any]:
        return [w.process for w in list(self.workers) if not w.gone]

    # -- called from any thread -------------------------------------------------------------
    def _send_now(self, task: _Task, feeder: bool) -> bool:
        """Send ``task`` from the caller's thread to a worker that can take it now: True when
        it was sent (or its future was cancelled); False to leave it to the manager (see
        "Direct send" above)."""
        if not self._direct:
            return False
        target = self._room_for(None)
        if target is None:
            return False
        task.seq = next(self._seq)
        try:
            msg = reducers.dumps((task.seq, task.fn.wire, task.kind, task.args))
        except Exception:  # noqa: BLE001 - the manager pickles it again and reports the error
            return False
        task.msg = msg
        if msg.noted or len(msg.data) > _PREFETCH_MAX_BYTES:
            return False  # the manager sends it (pickled already)
        if not self._send_lock.acquire(blocking=False):
            return False
        try:
            if self._refusal(feeder) is not None:
                return False  # (submit raises it)
            if self._room_for(msg) is not target:
                target = self._room_for(msg)  # the manager sent meanwhile: look again
                if target is None:
                    return False
            if task.start is not None and not self._claim(task):  # a future cancelled first
                return True
            if not target.outstanding:
                target.head_since = time.monotonic()
            target.outstanding.append(task)  # before the answer can arrive
            try:
                sent = target.conn.try_send_message(msg)
            except OSError:  # the worker is gone: the manager will see it
                sent = False
            if not sent:
                target.outstanding.pop()
                return False
            target.assigned += 1
            return True
        finally:
            self._send_lock.release()

    def _room_for(self, msg: reducers.Message | None) -> _Worker | None:
        """A worker a caller's thread may send a task to now: an idle one, else the least
        loaded one whose tasks are known to be short (depth over 2: queued work stays within
        the prefetch budget) when the message carries no fds. ``msg`` None: not pickled yet."""
        best = None
        for w in self.workers:
            if not w.ready or w.eof or w.stopping or w.retiring or w.gone or w.stealing:
                continue
            held = len(w.outstanding)
            if held == 0:
                return w
            if w.depth > 2 and held < w.depth and not w.gave_back and (
                best is None or held < len(best.outstanding)
            ):
                best = w
        if best is not None and msg is not None and not _queueable(msg):
            return None
        return best

    def _wake_locked(self) -> None:
        if not self._woken and self._wake_fd >= 0:
            self._woken = True
            try:
                os.eventfd_write(self._wake_fd, 1)
            except OSError:
                pass

    # -- the manager thread -----------------------------------------------------------------
    def _register(self, fd: int, kind: int, worker: _Worker | None) -> None:
        self._poller.register(fd, select.POLLIN)
        self._fdmap[fd] = (kind, worker)

    def _unregister(self, fd: int) -> None:
        if self._fdmap.pop(fd, None) is not None:
            try:
                self._poller.unregister(fd)
            except (KeyError, ValueError):
                pass

    def _wait(self) -> None:
        wait = self._balance()
        reducers.flush_release_records()  # what we hold and dropped, before we wait
        events = self._poller.poll(wait * 1000)
        todo = [(self._fdmap.get(fd), fd) for fd, _ in events]
        for entry, fd in todo:
            if entry is None:
                continue
            kind, worker = entry
            if worker is not None and (worker.gone or self._fdmap.get(fd) != entry):
                continue
            if kind == _WAKE:
                self._drain_wake()
            elif kind == _CONN:
                self._on_readable(worker)  # type: ignore[arg-type]
            else:
                self._on_exit(worker)  # type: ignore[arg-type]
        now = time.monotonic()
        if now - self._last_liveness >= _LIVENESS_INTERVAL:
            self._last_liveness = now
            for worker in list(self.workers):
                if worker.gone:
                    continue
                if worker.process.exitcode is not None:
                    self._on_exit(worker)
                elif worker.stop_deadline is not None and now >= worker.stop_deadline:
                    # Told to stop, done with its tasks, yet alive: its exit is stuck (a slow
                    # atexit handler, a thread that never ends). Every wait is bounded.
                    worker.stop_deadline = None
                    worker.process.kill()

    def _drain_wake(self) -> None:
        try:
            os.eventfd_read(self._wake_fd)
        except OSError:  # BlockingIOError: drained already
            pass
        with self._lock:
            self._woken = False

    # -- workers ----------------------------------------------------------------------------
    def _start_worker(self) -> None:
        ours, theirs = Pipe(duplex=True)
        crash_fd = give_back_fd = -1
        try:
            crash_fd = os.memfd_create("tensormp-pool-crash-log", os.MFD_CLOEXEC)
            # Blocking: the worker's give-back thread waits on it (the flag is shared).
            give_back_fd = os.eventfd(0, os.EFD_CLOEXEC)
            process = self.ctx.Process(
                target=_worker_main,
                args=(
                    theirs, _RawFd(crash_fd), self._initializer, self._initargs,
                    self._maxtasks, ours if self.method == "fork" else None, os.getpid(),
                    _RawFd(give_back_fd),
                ),
                daemon=True,
            )
            if self._pool_names:  # named as the stdlib Pool's: ForkPoolWorker-3...
                process.name = process.name.replace("Process", "PoolWorker")
            process.start()
        except BaseException:
            ours.close()
            for fd in (crash_fd, give_back_fd):
                if fd >= 0:
                    os.close(fd)
            raise
        finally:
            theirs.close()
        worker = _Worker(process, ours, crash_fd, give_back_fd)
        self.workers.append(worker)
        self._register(ours.fileno(), _CONN, worker)
        self._register(process.sentinel, _SENTINEL, worker)

    def _replenish(self) -> None:
        if not self._wants_workers():
            return
        active = sum(1 for w in self.workers if not (w.retiring or w.stopping or w.eof))
        for _ in range(self.processes - active):
            try:
                self._start_worker()
            except Exception as e:  # noqa: BLE001 - fds, memory, pickling initargs...
                self._break(
                    f"{self.owner}: could not start a replacement worker "
                    f"({type(e).__name__}: {e}); the pool is broken",
                    e,
                )
                return

    def _on_readable(self, w: _Worker) -> None:
        """Read every message ``w`` has sent so far, then hand out the answers.

        A non-blocking read is the probe for the next message (no poll(0) per message). The
        answers go out together, after the reads: a caller waiting on them is woken once per
        batch, not once per result (each wake-up of a thread that then wants our GIL costs two
        context switches on a busy machine)."""
        try:
            while not w.eof:
                try:
                    got = w.conn.recv_message(wait=False)
                    if got is None:
                        return
                    reply = reducers.loads(*got)
                except FdLimitError as e:  # that message was dropped; the channel stays usable
                    self._fail_oldest(w, e)
                except (EOFError, OSError):
                    self._channel_closed(w)
                    return
                except Exception as e:  # noqa: BLE001 - a result the parent cannot unpickle
                    if hasattr(e, "add_note"):
                        e.add_note(f"({self.owner}: loading a task's result in the parent)")
                    self._fail_oldest(w, e)
                else:
                    self._handle(w, reply)
        finally:
            answers, self._answers = self._answers, []
            for task, ok, value in answers:
                self._deliver(task, ok, value)

    def _channel_closed(self, w: _Worker) -> None:
        with self._send_lock:
            if not w.eof:
                w.eof = True
                self._unregister(w.conn.fileno())
                w.conn.close()  # a live worker then reads EOF and exits: its sentinel tells us

    def _handle(self, w: _Worker, reply: Any) -> None:
        tag = reply[0]
        if tag == _RESULT:
            _, seq, ok, value, seconds = reply
            if not w.outstanding or (seq is not None and w.outstanding[0].seq != seq):
                raise RuntimeError(
                    f"worker {w.pid} answered task #{seq}, expected "
                    f"{w.outstanding[0].seq if w.outstanding else 'none'}"
                )
            depth = w.depth
            w.timed(seconds)
            if w.depth != depth:
                self._room_limit = max(self._min_room, sum(x.depth for x in self.workers))
            self._answers.append((w.outstanding.popleft(), ok, value))
            w.head_since = time.monotonic()
            w.gave_back = False
        elif tag == _READY:
            w.ready = True
            self._startup_failures = 0
        elif tag == _INIT_ERROR:
            w.init_error = reply[1]
        elif tag == _DYING:
            w.dying = reply[2]
        elif tag == _RETURNED:
            self._take_back(w, reply[1])

    def _fail_oldest(self, w: _Worker, error: BaseException) -> None:
        if w.outstanding:
            self._answers.append((w.outstanding.popleft(), False, error))

    def _on_exit(self, w: _Worker) -> None:
        if w.gone:
            return
        if not w.eof:
            try:
                if w.conn.poll(0):
                    self._on_readable(w)  # results sent before it died are delivered
            except OSError:
                pass
        code = self._reap(w)
        crash = self._crash_log(w) if code < 0 else ""
        self._forget(w)
        if w.outstanding:
            running = w.outstanding.popleft()
            rest = list(w.outstanding)
            w.outstanding.clear()
            if rest:  # never read by the dead worker: another one will run them
                for task in rest:
                    task.msg = None  # its handles were the dead worker's: pickle anew
                with self._lock:
                    self._pending.extendleft(reversed(rest))
            self._deliver(running, False, self._lost(w, code, running, crash))
        elif w.init_error is not None:
            self._initializer_failed(f"worker {w.pid}", w.init_error)
        elif not w.ready and not w.stopping and self._state != TERMINATE:
            self._startup_failures += 1
            how = _exit_text(code)
            if code >= 0:
                self._break(
                    f"{self.owner}: worker {w.pid} {how} while starting, before it could run "
                    "a task: importing the main module or unpickling the initializer or its "
                    "arguments failed (its traceback is on stderr). The pool is broken. If the "
                    "script creates the pool at import time, move that under "
                    "`if __name__ == \"__main__\":` (workers started with 'spawn' or "
                    "'forkserver' import the main module)",
                    None,
                )
            elif self._startup_failures >= _MAX_STARTUP_FAILURES:
                self._break(
                    f"{self.owner}: {self._startup_failures} workers in a row died while "
                    f"starting (the last, pid {w.pid}, {how}); the pool is broken",
                    None,
                )
        self._replenish()

    def _reap(self, w: _Worker) -> int:
        process = w.process
        process.join(_REAP_TIMEOUT)
        if process.exitcode is None:  # its sentinel closed, yet it lives: end it
            process.kill()
            process.join(_REAP_TIMEOUT)
        code = process.exitcode
        return -signal.SIGKILL if code is None else int(code)

    def _crash_log(self, w: _Worker) -> str:
        try:
            raw = os.pread(w.crash_fd, _MAX_CRASH_LOG, 0)
        except OSError:
            return ""
        return raw.decode("utf-8", "replace").strip()

    def _forget(self, w: _Worker) -> None:
        with self._send_lock:  # from here on, no caller's thread sends to it
            w.gone = True
            if not w.eof:
                w.eof = True
                self._unregister(w.conn.fileno())
                w.conn.close()
        if w in self.workers:
            self.workers.remove(w)
        self._unregister(w.process.sentinel)
        try:
            w.process.close()
        except ValueError:  # still running (a worker we could not kill): leave it
            pass
        for fd in (w.crash_fd, w.give_back_fd):
            if fd >= 0:
                os.close(fd)
        w.crash_fd = w.give_back_fd = -1

    def _lost(self, w: _Worker, code: int, task: _Task, crash: str) -> WorkerLostError:
        from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined]  # not in typeshed

        what = _describe(task.label)
        msg = f"{self.owner}: worker {w.pid} {_exit_text(code)} while running {what}"
        cause: BaseException | None = None
        if w.dying:
            first = w.dying.strip().splitlines()[-1] if w.dying.strip() else ""
            msg += f" (the task raised {first})"
            cause = RemoteTraceback(w.dying)
        elif code == -signal.SIGKILL:
            msg += (
                ". SIGKILL comes from the kernel's out-of-memory killer when memory runs out "
                "(see `dmesg`), or from a `kill -9`"
            )
        elif crash:
            msg += "; its Python stack at the crash is chained below"
            cause = RemoteTraceback(
                f"\n-- Python stack of worker {w.pid} when it received "
                f"{_signal_name(code)} (faulthandler):\n{crash}"
            )
        elif code >= 0:
            msg += " (the task called os._exit() or sys.exit(), or native code exited)"
        error = self._lost_error(f"{msg}.{LOST_TAIL}", w.pid, code, what)
        error.__cause__ = cause
        return error

    # -- tasks ------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Send pending tasks to workers that can take them. Small tasks without fds bound
        for the same worker in one round go as one message (a batch: one ``sendmsg``, one
        GIL release, instead of one per task); the worker still answers each on its own."""
        while True:
            planned: dict[_Worker, list[_Task]] = {}
            try:
                drained = self._plan(planned)
            finally:
                for w, tasks in planned.items():
                    self._send_tasks(w, tasks)
            with self._lock:
                if not drained:  # we wait for a worker's answer (or exit), and look again then
                    self._idle = False
                    return
                if self._pending:  # submitted while we sent
                    continue
                self._idle = self._hungry()
                return

    def _plan(self, planned: dict[_Worker, list[_Task]]) -> bool:
        """Take pending tasks for the workers (into ``planned``, or sent at once when they
        cannot be batched) until none is left (True) or no worker can take the next (False)."""
        batching = self._maxtasks is None
        planned_bytes: dict[_Worker, int] = {}
        while True:
            with self._lock:
                npending = len(self._pending)
            if not npending:
                return True
            idle = busy = None
            busy_held = 0
            for w in self.workers:
                if not w.ready or w.eof or w.stopping or w.retiring or w.stealing:
                    continue
                held = len(w.outstanding) + len(planned.get(w, ()))
                if held == 0:
                    idle = w
                    break
                if held < w.depth and (busy is None or held < busy_held) and not w.gave_back:
                    busy, busy_held = w, held  # the least loaded
            if idle is None and (busy is None or npending < len(self.workers)):
                return False
            with self._lock:
                if not self._pending:
                    return True
                task = self._pop_locked()
            if task.start is not None and not self._claim(task):  # cancelled while it waited
                continue
            target: _Worker = idle if idle is not None else busy  # type: ignore[assignment]
            light = _light_size(task) if batching and task.msg is None else -1
            if light >= 0:  # pickled with the rest of its batch, in _send_tasks
                nbytes, heavy = light, False
            else:
                msg = self._pickle(task)
                if msg is None:
                    continue
                nbytes, heavy = len(msg.data), not _queueable(msg)
                if idle is None and heavy:
                    with self._lock:  # it waits for an idle (or less loaded) worker
                        self._pending.appendleft(task)
                    return False
            batch = planned.setdefault(target, [])
            batch.append(task)
            size = planned_bytes[target] = planned_bytes.get(target, 0) + nbytes
            if not batching or heavy or size > _PREFETCH_MAX_BYTES:
                # sent now, after what was planned for that worker (in order)
                del planned[target], planned_bytes[target]
                self._send_tasks(target, batch)

    def _balance(self) -> float:
        """While a worker idles (nothing pending is left for it), ask every worker whose
        task has run ``_STEAL_AFTER`` with tasks queued behind it to give those back (see
        "Give-back"); the seconds until the next such check is due (the poll timeout)."""
        idle = False
        queued = []
        for w in self.workers:
            if not w.ready or w.eof or w.stopping or w.gone or w.stealing:
                continue
            held = len(w.outstanding)
            if held == 0:
                idle = idle or not w.retiring
            elif held > 1:
                queued.append(w)
        wait = _LIVENESS_INTERVAL
        if not idle or not queued:
            return wait
        now = time.monotonic()
        for w in queued:
            due = w.head_since + _STEAL_AFTER - now
            if due > 0:
                wait = min(wait, due)
                continue
            with self._send_lock:  # from here no task is sent to it until it answers
                if w.eof or w.gone:
                    continue
                w.stealing = True
            try:
                os.eventfd_write(w.give_back_fd, 1)
            except OSError:
                w.stealing = False
        return wait

    def _take_back(self, w: _Worker, n: int) -> None:
        """``w`` gave back its last ``n`` tasks, never started: they go first to the others."""
        w.stealing = False
        if not n:
            return
        with self._send_lock:
            if n > len(w.outstanding):
                raise RuntimeError(
                    f"worker {w.pid} gave back {n} tasks, it holds {len(w.outstanding)}"
                )
            back = [w.outstanding.pop() for _ in range(n)]
            for task in back:
                # Pickled for ``w``: the parent registered ``w`` as the holder of its blocks in
                # it, and ``w`` dropped the record unread. Pickled anew for the worker that
                # takes it (as ``_on_exit`` does), or ``w``'s death frees blocks it still names.
                task.msg = None
            w.assigned -= n
            w.gave_back = True
            if w.retiring and w.assigned < (self._maxtasks or 0):
                w.retiring = False  # it runs more before it exits (its successor runs already)
        with self._lock:
            self._pending.extendleft(back)  # (popped last first: in order again)

    def _hungry(self) -> bool:
        """With nothing pending: must a submit wake us? Not while every worker holds at least
        half its depth (at least one task): its next answer wakes us, and we look at the deque
        then, so tasks submitted one by one are sent in bursts (an imap feeder does not hand
        each task to this thread). Conservative when unsure: a wake too many costs a syscall,
        one too few a hang."""
        usable = False
        for w in self.workers:
            if not w.ready or w.eof or w.stopping or w.retiring:
                continue
            usable = True
            if len(w.outstanding) < max(1, w.depth // 2):
                return True
        return not usable

    def _pickle(self, task: _Task) -> reducers.Message | None:
        if task.msg is not None:
            return task.msg
        try:
            task.msg = reducers.dumps((task.seq, task.fn.wire, task.kind, task.args))
        except Exception as e:  # noqa: BLE001 - reported as this task's failure
            if not task.fn.by_value and not pickles(task.fn.wire):
                try:
                    task.fn.to_value()  # plain pickle refused the callable: cloudpickle it
                except Exception as e2:  # noqa: BLE001
                    self._deliver(task, False, e2)
                    return None
                return self._pickle(task)
            if hasattr(e, "add_note"):
                e.add_note(f"({self.owner}: pickling {_describe(task.label)} for a worker)")
            self._deliver(task, False, e)
            return None
        return task.msg

    def _send_tasks(self, w: _Worker, tasks: list[_Task]) -> None:
        """Send ``tasks`` to ``w``, in order: batches of fd-less ones (pickled already, or
        light: see ``_light_size``), and each task carrying fds or our blocks on its own."""
        groups = self._messages(tasks)
        for k, (msg, group) in enumerate(groups):
            if not self._send_group(w, msg, group):
                rest = [t for _, later in groups[k + 1:] for t in later]
                for task in rest:
                    if task.msg is not None:
                        task.msg.abandon()  # never sent: its copies and holds go
                    task.msg = None
                with self._lock:
                    self._pending.extendleft(reversed(rest))
                return

    def _send_group(self, w: _Worker, msg: reducers.Message, tasks: list[_Task]) -> bool:
        """Send one message carrying ``tasks``; False when ``w``'s channel failed (``tasks``
        are queued again, to be pickled anew)."""
        with self._send_lock:
            try:
                # The header says how many tasks the record carries (see worker.py, Give-back)
                w.conn.send_message(msg, slot=len(tasks))
            except OSError:  # the worker is gone (its sentinel will say how)
                failed = True
            else:
                failed = False
                if not w.outstanding:
                    w.head_since = time.monotonic()
                w.outstanding.extend(tasks)
                w.assigned += len(tasks)
        if not failed and msg.noted:
            # The worker holds one handle to each of our blocks in the message (it sends no
            # hold records for them: see worker._worker_main); if it dies holding them, our
            # liveness check frees them (as Process arguments, registered once started). Only
            # once sent: a message that was not is dropped, and its undo gives the handles back
            # (both would free them twice: the second time, a block handed out again). A
            # release that came first cancels the hold (register_holder).
            from ...memory.allocator import register_holder

            register_holder(w.pid, msg.noted)
        if failed:
            for task in tasks:
                task.msg = None  # never sent: its handles are given back; pickle anew
            with self._lock:
                self._pending.extendleft(reversed(tasks))
            self._channel_closed(w)
            return False
        if self._maxtasks is not None and w.assigned >= self._maxtasks:
            w.retiring = True  # it exits after this task: start its successor now
            self._replenish()
        return True

    def _messages(self, tasks: list[_Task]) -> list[tuple[reducers.Message, list[_Task]]]:
        """The messages that carry ``tasks``, in order, and the tasks each carries.

        A task whose pickle carries fds or our blocks goes alone. The others go together as
        one batch (see worker.py): ``[fns, item, item...]``, an item being a task's own pickle
        (bytes) or, for a light task (``_light_size``), the tuple ``(seq, i, kind, args)``
        where ``fns[i]`` is the pickle of its callable, made once per batch (the worker loads
        it once per task, as the stdlib, unless it is a plain function). A light task whose
        callable cannot be pickled so (plain pickle refuses it, or it holds arrays) is pickled
        on its own, as any other; a task that cannot be pickled at all fails and is left out.
        """
        out: list[tuple[reducers.Message, list[_Task]]] = []
        fns: list[bytes] = []
        index: dict[int, int] = {}
        items: list[Any] = [fns]
        carried: list[_Task] = []
        for t in tasks:
            if t.msg is None and len(tasks) > 1:
                i = index.get(id(t.fn), -1)
                if i < 0:
                    try:
                        fn_msg = reducers.dumps(t.fn.wire)
                    except Exception:  # noqa: BLE001 - pickled with its task, below
                        fn_msg = None
                    if fn_msg is not None and not (fn_msg.fds or fn_msg.noted):
                        i = index[id(t.fn)] = len(fns)
                        fns.append(fn_msg.data)
                    elif fn_msg is not None:
                        fn_msg.abandon()
                if i >= 0:
                    items.append((t.seq, i, t.kind, t.args))
                    carried.append(t)
                    continue
            msg = self._pickle(t)
            if msg is None:  # failed (delivered): left out
                continue
            if msg.fds or msg.noted:  # alone, after what came before it
                if carried:
                    out.append((reducers.dumps(items), carried))
                    fns, index, carried = [], {}, []
                    items = [fns]
                out.append((msg, [t]))
                continue
            items.append(msg.data)
            carried.append(t)
        if len(carried) == 1 and carried[0].msg is not None:
            out.append((carried[0].msg, carried))  # one task: its own pickle, no batch
        elif carried:
            out.append((reducers.dumps(items), carried))
        return out

    def _closing_done(self) -> bool:
        """close(): once every task is done, stop the workers; True when all have exited."""
        with self._lock:
            busy = bool(self._pending) or self._feeders > 0
        closed = []
        with self._send_lock:  # no direct send slips in between the check and the stop
            if busy or any(w.outstanding for w in self.workers):
                return False
            for w in self.workers:
                if not w.stopping and not w.eof:
                    w.stopping = True
                    w.stop_deadline = time.monotonic() + _STOP_GRACE
                    try:
                        w.conn.send(None)
                    except OSError:
                        closed.append(w)
        for w in closed:
            self._channel_closed(w)
        return not self.workers

    def _shutdown(self) -> None:
        """Manager exit: stop what still runs, fail what is unfinished, close every fd."""
        alive = [w for w in self.workers if not w.gone]
        for w in alive:
            if w.process.exitcode is None:
                with self._send_lock:
                    idle = w.ready and not w.outstanding and not w.eof and not w.stopping
                    if idle:
                        # Idle: a clean exit, which hands back what the worker received at
                        # once (a killed worker's holds wait for the creators' liveness checks).
                        try:
                            w.conn.send(None)
                            w.stopping = True
                        except OSError:
                            idle = False
                if idle:
                    continue
                try:
                    w.process.terminate()
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + _TERM_GRACE
        for w in alive:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join(_REAP_TIMEOUT)
        unfinished: list[_Task] = []
        for w in alive:
            unfinished.extend(w.outstanding)
            w.outstanding.clear()
            self._forget(w)
        self._fail_unfinished(unfinished)
        with self._lock:
            self._unregister(self._wake_fd)
            if self._wake_fd >= 0:
                os.close(self._wake_fd)
            self._wake_fd = -1
        self._end_state()


def _queueable(msg: reducers.Message) -> bool:
    """Whether a task may wait in a worker's channel behind a running one: small, and nothing
    to give back if it is taken back unread (no fds, no blocks of ours)."""
    return not (msg.fds or msg.noted) and len(msg.data) <= _PREFETCH_MAX_BYTES


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by signal {_signal_name(code)}"
    return f"exited with code {code}"
