"""The ``ray`` engine: the workers of a :class:`tensormp.Pool` or ``ProcessPoolExecutor`` are
Ray actors on a Ray cluster; arguments and results travel through Ray's object store.

Design note
-----------
**Workers.** One worker is one actor of :class:`_RayWorker`, created with
``ray_remote_args`` (default ``{"num_cpus": 1}``, so Ray spreads the workers over the nodes'
CPUs; Ray's own ``ray.util.multiprocessing.Pool`` asks for 0 CPUs and piles them on one node).
Its constructor runs the initializer in the actor's process, so the module globals it sets
persist for every task of that worker. ``ready()`` answers once that is done, with the actor's
pid, node id and node address (or the initializer's exception: the pool breaks, as the local
engine's). Ray restarts nothing (``max_restarts=0``, no task retries): the engine replaces
workers itself, so that a task is never run twice behind the caller's back.

**Tasks.** The manager thread (``base.QueueEngine``) calls ``actor.run.remote(fn, kind,
args)`` for a task and turns the ``ObjectRef`` into a ``concurrent.futures.Future`` whose
completion puts an event on the manager's queue; callers' threads wake it the same way. A worker
holds at most four tasks (the one it runs and, while more tasks wait than there are workers, the
next three: a Ray call's round trip is about 1 ms, so a worker needs more queued than a local
one to stay busy on small tasks). An actor runs its
calls one at a time in the order sent (one thread for the default concurrency group), so the
oldest task outstanding on a worker is the one it runs, with one caveat (see *Dead workers*).
``run`` returns ``(True, value)``,
``(False, exception)`` (wrapped with its traceback as ``multiprocessing.pool`` does: the caller
gets the same exception type, with ``RemoteTraceback`` as ``__cause__``), or ``(None,
traceback)`` when the task raised a ``BaseException`` such as ``SystemExit`` (the worker ends:
the engine kills the actor and reports :class:`WorkerLostError`, as the local engine). Callables
travel with Ray's serializer (cloudpickle): lambdas and closures work. A function of the
caller's ``__main__`` is pickled by value once per job (``_main_by_value``) and bound, in the
actor, to one ``__mp_main__`` namespace (``_by_value.into_namespace``), so that the initializer
and the tasks share module globals as in a stdlib worker; the script is not needed on the node.

**Arrays.** Ray stores numpy arrays of arguments and results in its object store and maps them
without copying on the same node (it moves them between nodes). Those arrays are *read-only*
(Ray's zero-copy numpy; writing raises ``ValueError: assignment destination is read-only``):
no write crosses between processes, unlike the local engine's shared memory. Arrays made with
``tensormp.zeros`` etc. are sent by value like any other array.

**Dead workers.** Each actor also runs ``watch()`` in a second concurrency group (one thread):
a call that never returns, so its future fails with ``ActorDiedError`` within milliseconds of
the actor's death (``os._exit``, SIGKILL, the OOM killer, its node lost), even when the actor
was idle. On a death the manager first waits (bounded) for the futures of the tasks it had sent
to settle, delivers those that completed, fails the oldest unfinished one with
:class:`WorkerLostError` (naming the node, the actor and its pid, the task, and Ray's exit
detail), gives the younger ones to other workers, and starts a replacement. The caveat: an
actor replies asynchronously (Ray's I/O thread sends the answer while the next call already
runs), so a death just after a task finished can lose that task's answer, and the task then
running was the next one. When a dead actor had two or more unanswered tasks, the error says
so and names both, and the second runs again, alone on a worker (nothing queued behind it), so
that if it was the one that killed the worker, its second death is attributed exactly (measured:
``os._exit`` at the start of a task loses the previous answer). Only that task can run twice. A worker that dies before it is ready breaks the pool after three in a row (or at
once, when its constructor failed: the cause is chained).

**Connection.** One process talks to one Ray cluster (``ray.init`` is per process). ``address``,
else ``$RAY_ADDRESS``: the engine first opens a TCP connection to it (5 s), so an unreachable
cluster is a ``ConnectionError`` naming the address, not Ray's minutes of retries; then
``ray.init(address=...)``. Without either, the engine uses the cluster this process is already
connected to, else starts a local Ray. A connection (or local Ray) the engine made is closed
(``ray.shutdown``) when the last pool using it ends; one the caller made is left alone.

**Ending.** ``close()`` (once every task is done), ``terminate()``, and a worker retired by
``maxtasksperchild`` (once its last result is in): ``ray.kill`` (a graceful
``__ray_terminate__`` would wait for ``watch()`` forever; an idle actor loses nothing). The
manager waits (bounded) until each actor's ``watch()`` fails, that is until Ray reports it dead
(its process exits moments later), before unfinished tasks fail with ``BrokenPoolError`` and
``join()`` returns.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import os
import queue
import re
import socket
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any

from ..._by_value import FnByValue
from ..tasks import _describe, _Task
from ..worker import _CALL, _MAP, _format, _load_fn, _wrap
from . import EngineConfig
from .base import _CLOSE, _TERMINATE, QueueEngine

OPTIONS: tuple[str, ...] = ("address", "ray_remote_args")

_PROBE_TIMEOUT = 5.0  # seconds to reach the cluster's address before ConnectionError
_SETTLE_TIMEOUT = 5.0  # seconds a dead actor's task futures get to settle
_STOP_TIMEOUT = 10.0  # seconds for the actors to be gone at close/terminate
_MAX_STARTUP_FAILURES = 3
_MAX_IN_FLIGHT = 4  # tasks sent to one actor and not answered (1 running + 3 queued there)
_WATCH_GROUP = "tensormp-watch"


# -- what runs in the actor --------------------------------------------------------------------
class _RayWorker:
    """A pool worker as a Ray actor (wrapped with ``ray.remote`` by the engine)."""

    def __init__(self, initializer: Any, initargs: tuple[Any, ...]) -> None:
        self._cache: dict[bytes, Any] = {}
        self._init_error: Any = None
        self._stop = threading.Event()
        # The caller's __main__ as this worker sees it: one namespace for the initializer and
        # every task defined there (a stdlib worker imports the script as __mp_main__).
        main = types.ModuleType("__mp_main__")
        sys.modules["__mp_main__"] = main
        self._main: dict[str, Any] = main.__dict__
        if initializer is not None:
            try:
                _load_fn(initializer, {}, self._main)(*initargs)
            except BaseException as e:  # noqa: BLE001 - reported by ready(); the pool breaks
                self._init_error = _wrap(e)

    def ready(self) -> tuple[Any, int, str, str]:
        import ray

        context = ray.get_runtime_context()
        return self._init_error, os.getpid(), context.get_node_id(), ray.util.get_node_ip_address()

    def run(self, fn: Any, kind: int, args: Any) -> tuple[bool | None, Any]:
        try:
            f = _load_fn(fn, self._cache, self._main)
            if kind == _CALL:
                value = f(*args[0], **args[1])
            elif kind == _MAP:
                value = [f(x) for x in args]
            else:
                value = [f(*x) for x in args]
        except Exception as e:
            return False, _wrap(e)
        except BaseException as e:  # noqa: BLE001 - SystemExit...: the engine ends this worker
            return None, _format(e)
        return True, value

    def watch(self) -> None:
        """Never returns while the actor lives: its failure tells the engine of a death."""
        self._stop.wait()


# -- connection --------------------------------------------------------------------------------
_conn_lock = threading.Lock()
_conn_users = 0  # engines using a connection this module opened


def _import_ray(owner: str) -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            f"{owner}(engine='ray') runs its workers on a Ray cluster, and Ray is not "
            "installed: pip install 'tensormp[ray]'"
        ) from None
    return ray


def _probe(address: str, owner: str) -> None:
    """Raises: ConnectionError naming ``address`` when no TCP connection is possible in 5 s."""
    target = address.split("://", 1)[-1]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(
            f"{owner}: address={address!r} is not a Ray cluster address; give 'host:port' "
            "(the head node's GCS port, 6379 by default) or 'auto'"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=_PROBE_TIMEOUT):
            pass
    except OSError as e:
        raise ConnectionError(
            f"{owner}: cannot reach the Ray cluster at {address!r} ({e}); start it with "
            "`ray start --head --port=PORT` on the head node, check the address and that "
            "the port is open from here"
        ) from e


def _host_port(address: str) -> tuple[str, str]:
    """``("10.0.0.5", "6379")`` for ``"headnode:6379"`` (the host resolved where possible)."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        host = socket.gethostbyname(host.strip("[]"))
    except OSError:
        pass
    return host, port


def _resolve_auto(ray: Any) -> str | None:
    """The address ``ray.init(address="auto")`` would use, if Ray can say (else None)."""
    try:
        from ray._private import services

        found = services.get_ray_address_from_environment("auto", None)
    except Exception:  # noqa: BLE001 - no cluster known here, or Ray's private API moved
        return None
    return found if isinstance(found, str) else None


def _connect(address: str | None, owner: str) -> tuple[Any, bool, str]:
    """Connect this process to Ray; returns (ray, whether we made the connection, address)."""
    global _conn_users
    ray = _import_ray(owner)
    if address is not None and not isinstance(address, str):
        raise TypeError(f"{owner}: address must be a str or None, got {type(address).__name__}")
    with _conn_lock:
        wanted = address or os.environ.get("RAY_ADDRESS") or None
        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if wanted not in (None, "auto") and _host_port(wanted) != _host_port(current):
                raise ValueError(
                    f"{owner}: this process is connected to the Ray cluster at {current!r}, "
                    f"not {wanted!r}; a process talks to one Ray cluster (ray.shutdown() first)"
                )
            if _conn_users:
                _conn_users += 1
                return ray, True, current
            return ray, False, current
        if wanted == "auto":
            resolved = _resolve_auto(ray)
            if resolved is None:
                raise ConnectionError(
                    f"{owner}: address='auto' but no running Ray cluster was found on this "
                    "machine; start one with `ray start --head`, or give its address"
                )
            _probe(resolved, owner)
        elif wanted is not None:
            _probe(wanted, owner)
        if wanted is None:
            ray.init(include_dashboard=False, configure_logging=False)
        else:
            ray.init(address=wanted, configure_logging=False)
        _conn_users = 1
        return ray, True, ray.get_runtime_context().gcs_address


def _disconnect(ray: Any) -> None:
    global _conn_users
    with _conn_lock:
        _conn_users -= 1
        if _conn_users == 0:
            ray.shutdown()


# -- the engine --------------------------------------------------------------------------------
class _Actor:
    __slots__ = (
        "handle", "id", "pid", "node_id", "node_ip", "ready", "assigned", "outstanding",
        "retiring", "stopping", "gone", "watch", "alone",
    )

    def __init__(self, handle: Any, watch: concurrent.futures.Future[Any]) -> None:
        self.handle = handle
        self.id: str = handle._actor_id.hex()
        self.pid: int | None = None
        self.node_id = ""
        self.node_ip = ""
        self.ready = False
        self.assigned = 0  # tasks sent, for maxtasksperchild
        self.outstanding: collections.deque[tuple[_Task, concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self.retiring = False  # got its last task (maxtasksperchild)
        self.stopping = False  # told to exit (close(), terminate(), retired)
        self.gone = False
        self.watch = watch
        self.alone = False  # runs a task that may have killed a worker: nothing behind it

    def name(self) -> str:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        node = f" on node {self.node_ip} (id {self.node_id[:12]})" if self.node_id else ""
        return f"worker actor {self.id[:12]}{pid}{node}"


_WAKE, _DONE, _READY, _DEAD = 0, 1, 2, 3  # manager events


class Engine(QueueEngine):
    """Workers as Ray actors (see the module notes)."""

    def __init__(
        self,
        config: EngineConfig,
        address: str | None = None,
        ray_remote_args: Mapping[str, Any] | None = None,
    ) -> None:
        if ray_remote_args is not None and not isinstance(ray_remote_args, Mapping):
            raise TypeError(
                f"{config.owner}: ray_remote_args must be a dict of actor options, got "
                f"{type(ray_remote_args).__name__}"
            )
        options: dict[str, Any] = {"num_cpus": 1}
        options.update(ray_remote_args or {})
        groups = dict(options.pop("concurrency_groups", None) or {})
        groups[_WATCH_GROUP] = 1
        options.update(max_restarts=0, max_task_retries=0)
        self._ray, self._owns_connection, self.address = _connect(address, config.owner)
        try:
            if type(config.initializer) is types.FunctionType:
                config = dataclasses.replace(
                    config, initializer=_main_by_value(config.initializer, self._ray)
                )
            if config.processes is None:  # as many workers as the cluster has CPUs for
                cpus = float(self._ray.cluster_resources().get("CPU", 1))
                per = float(options.get("num_cpus") or 1)
                config = dataclasses.replace(config, processes=max(1, int(cpus // per)))
            super().__init__(config)
            # concurrency_groups is a ray.remote() argument only (.options() refuses it)
            self._actor_class = self._ray.remote(concurrency_groups=groups)(_RayWorker).options(
                **options
            )
        except BaseException:
            self._release()
            raise
        self._events: queue.SimpleQueue[tuple[int, _Actor | None]] = queue.SimpleQueue()
        self._woken = False
        self._serial = itertools.count(1)
        self.workers: list[_Actor] = []
        self._startup_failures = 0
        self._init_failures: dict[_Actor, Any] = {}  # initializer errors, set in Ray's thread
        self._alone: set[int] = set()  # seq of tasks to run with nothing queued behind them
        try:
            for _ in range(self.processes):
                self._start_worker()
        except BaseException:
            self._state = _TERMINATE
            self._shutdown()
            raise
        self._start_manager()

    def describe(self) -> str:
        live = [w for w in list(self.workers) if not w.gone]
        where = [f"{w.pid}@{w.node_ip}" if w.pid is not None else "starting" for w in live]
        return f"engine=ray address={self.address} workers={where}"

    def worker_processes(self) -> list[Any]:
        return [w.handle for w in list(self.workers) if not w.gone]

    def _wake_locked(self) -> None:
        if not self._woken:
            self._woken = True
            self._events.put((_WAKE, None))

    # -- workers ----------------------------------------------------------------------------
    def _start_worker(self) -> None:
        handle = self._actor_class.remote(self._initializer, self._initargs)
        watch = handle.watch.options(concurrency_group=_WATCH_GROUP).remote().future()
        w = _Actor(handle, watch)
        self.workers.append(w)
        ready = handle.ready.remote().future()
        ready.add_done_callback(lambda f, w=w: self._on_ready(w, f))
        watch.add_done_callback(lambda f, w=w: self._events.put((_DEAD, w)))

    def _on_ready(self, w: _Actor, future: concurrent.futures.Future[Any]) -> None:
        # Ray's thread: record the answer, let the manager act on it.
        try:
            init_error, w.pid, w.node_id, w.node_ip = future.result()
        except BaseException:  # noqa: BLE001 - the actor died first: watch() reports it
            return
        if init_error is not None:
            self._init_failures[w] = init_error
        self._events.put((_READY, w) if init_error is None else (_DEAD, w))

    def _replenish(self) -> None:
        with self._lock:
            state = self._state
            broken = self._broken_msg is not None
        if state == _TERMINATE or broken or (state == _CLOSE and not self._has_work()):
            return
        active = sum(1 for w in self.workers if not (w.retiring or w.stopping or w.gone))
        for _ in range(self.processes - active):
            try:
                self._start_worker()
            except Exception as e:  # noqa: BLE001 - the connection to Ray is gone...
                self._break(
                    f"{self.owner}: could not start a replacement worker actor "
                    f"({type(e).__name__}: {e}); the pool is broken",
                    e,
                )
                return

    def _stop_worker(self, w: _Actor) -> None:
        # ray.kill, not __ray_terminate__: a graceful exit would wait for watch(), forever.
        if w.stopping:
            return
        w.stopping = True
        try:
            self._ray.kill(w.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone, or Ray is shutting down
            pass

    # -- the manager thread -----------------------------------------------------------------
    def _step(self) -> bool:
        with self._lock:
            state = self._state
        if state == _TERMINATE:
            return False
        self._dispatch()
        if state == _CLOSE and self._closing_done():
            return False
        try:
            event = self._events.get(timeout=1.0)
        except queue.Empty:
            return True
        while True:
            self._handle(*event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, kind: int, w: _Actor | None) -> None:
        if kind == _WAKE:
            with self._lock:
                self._woken = False
        elif w is None or w.gone:
            return
        elif kind == _DONE:
            self._collect(w)
        elif kind == _READY:
            w.ready = True
            self._startup_failures = 0
        else:
            self._on_death(w)

    def _collect(self, w: _Actor) -> bool:
        """Deliver the results of ``w``'s finished tasks, oldest first; False when one failed
        because the actor died (its death is handled by :meth:`_on_death`)."""
        while w.outstanding and w.outstanding[0][1].done():
            task, future = w.outstanding[0]
            try:
                ok, value = future.result()
            except self._ray.exceptions.RayActorError:
                self._on_death(w)
                return False
            except Exception as e:  # noqa: BLE001 - e.g. the task cannot be loaded there
                ok, value = False, e
                if hasattr(e, "add_note"):
                    e.add_note(f"({self.owner}: running {_describe(task.label)} on a Ray actor)")
                    if "No module named" in str(e):
                        e.add_note(
                            "Ray workers import the modules of functions and arguments by "
                            "name: install them on every node, or ship them with "
                            "ray_remote_args={'runtime_env': {'py_modules': [...]}}"
                        )
            w.outstanding.popleft()
            if ok is None:  # the task raised SystemExit & co: this worker ends (as local)
                self._lose(w, task, f"the task raised {value.strip().splitlines()[-1]}", value)
                return False
            self._deliver(task, ok, value)
        if not w.outstanding:
            w.alone = False
        if w.retiring and not w.outstanding:
            self._stop_worker(w)
        return True

    def _on_death(self, w: _Actor) -> None:
        if w.gone:
            return
        # Ray fails a dead actor's calls promptly; wait for them so that a result the actor
        # sent before it died is delivered and the task it ran is known exactly.
        pending = [f for _, f in w.outstanding]
        if pending:
            concurrent.futures.wait(pending, timeout=_SETTLE_TIMEOUT)
        while w.outstanding:
            task, future = w.outstanding[0]
            if future.done() and future.exception() is None:
                w.outstanding.popleft()
                ok, value = future.result()
                if ok is None:
                    self._lose(w, task, f"the task raised {value.strip().splitlines()[-1]}", value)
                    return
                self._deliver(task, ok, value)
                continue
            w.outstanding.popleft()
            # The oldest unanswered task ran when the actor died, or had just finished: Ray
            # drops the answers a dying actor has not sent yet, so the next one may be the
            # task that was running. That one is retried alone on another worker.
            suspect = w.outstanding[0][0] if w.outstanding else None
            self._lose(w, task, _death_detail(future, w.watch), None, suspect)
            return
        init_error = self._init_failures.pop(w, None)
        if init_error is not None:
            self._stop_worker(w)  # alive, but useless
        self._forget(w)
        if init_error is not None:
            name = getattr(self._initializer, "name", None) or getattr(
                self._initializer, "__qualname__", repr(self._initializer)
            )
            error = _unwrap(init_error)
            self._break(
                f"{self.owner}: the initializer {name} raised in {w.name()}: "
                f"{type(error).__name__}: {error}. The pool is broken (every worker runs it); "
                "fix the initializer and create a new pool",
                error,
            )
        elif not w.ready and not w.stopping and self._state != _TERMINATE:
            self._startup_failures += 1
            detail = _death_detail(None, w.watch)
            if "creation task" in detail or self._startup_failures >= _MAX_STARTUP_FAILURES:
                self._break(
                    f"{self.owner}: {w.name()} died while starting, before it could run a task "
                    f"({detail}); the pool is broken. Every node needs tensormp and the "
                    "function's module importable (the same environment, or a runtime_env in "
                    "ray_remote_args)",
                    _exception_of(w.watch),
                )
        self._replenish()

    def _lose(
        self, w: _Actor, running: _Task, how: str, traceback: str | None,
        suspect: _Task | None = None,
    ) -> None:
        """``w`` ended while running ``running`` (or, when ``suspect`` is given, just after it
        finished ``running`` while starting ``suspect``): fail ``running``, requeue the
        younger tasks (``suspect`` first, to run alone), replace the worker."""
        from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined]  # not in typeshed

        rest = [task for task, _ in w.outstanding]
        w.outstanding.clear()
        self._stop_worker(w)
        self._forget(w)
        if suspect is not None:
            self._alone.add(suspect.seq)
        if rest:  # not started by the dead worker (but maybe suspect): others will run them
            with self._lock:
                self._pending.extendleft(reversed(rest))
        what = _describe(running.label)
        if suspect is None:
            msg = f"{self.owner}: {w.name()} died while running {what}: {how}."
        else:
            msg = (
                f"{self.owner}: {w.name()} died while running {what}, or just after it "
                f"finished it, when it started {_describe(suspect.label)}: {how}. (Ray drops "
                "the answers a dying actor has not sent yet, so it cannot tell which; the "
                "second task runs again, alone, on another worker, where a second death is "
                "reported exactly.)"
            )
        msg += (
            " The pool replaced the worker and keeps running; only this task failed, resubmit "
            "it if it is safe to run again"
        )
        error = self._lost_error(msg, w.pid, _exit_code(how), what, w.node_ip or None)
        error.__cause__ = RemoteTraceback(traceback) if traceback else None
        self._deliver(running, False, error)
        self._replenish()

    def _forget(self, w: _Actor) -> None:
        w.gone = True
        if w in self.workers:
            self.workers.remove(w)

    # -- tasks ------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        while True:
            with self._lock:
                npending = len(self._pending)
            if not npending:
                return
            target = None
            nready = 0
            for w in self.workers:
                if not w.ready or w.gone or w.stopping or w.retiring or w.alone:
                    continue
                nready += 1
                if target is None or len(w.outstanding) < len(target.outstanding):
                    target = w
            if target is None:
                return
            depth = len(target.outstanding)
            if depth and (depth >= _MAX_IN_FLIGHT or npending < nready):
                return
            with self._lock:
                if not self._pending:
                    return
                if depth and self._pending[0].seq in self._alone:
                    return  # it waits for an idle worker
                task = self._pending.popleft()
                self._room.notify_all()
            if task.seq in self._alone:
                self._alone.discard(task.seq)
                target.alone = True
            if task.start is not None:
                start, task.start = task.start, None
                if not start():  # cancelled while it waited
                    continue
            self._send(target, task)

    def _send(self, w: _Actor, task: _Task) -> None:
        wire = task.fn.wire
        if type(wire) is types.FunctionType and wire.__module__ == "__main__":
            wire = task.fn.wire = _main_by_value(wire, self._ray)
        try:
            ref = w.handle.run.remote(wire, task.kind, task.args)
        except Exception as e:  # noqa: BLE001 - Ray could not serialize the call
            if hasattr(e, "add_note"):
                e.add_note(f"({self.owner}: sending {_describe(task.label)} to a worker actor)")
            self._deliver(task, False, e)
            return
        future = ref.future()
        w.outstanding.append((task, future))
        future.add_done_callback(lambda f, w=w: self._events.put((_DONE, w)))
        w.assigned += 1
        if self._maxtasks is not None and w.assigned >= self._maxtasks:
            w.retiring = True  # it ends after this task: start its successor now
            self._replenish()

    def _closing_done(self) -> bool:
        """close(): once every task is done, stop the actors; True when all are gone."""
        if self._has_work() or any(w.outstanding for w in self.workers):
            return False
        for w in self.workers:
            self._stop_worker(w)
        return not self.workers

    def _shutdown(self) -> None:
        """Manager exit: stop what still runs, wait until it is gone, fail what is
        unfinished, close the Ray connection if it is ours."""
        alive = [w for w in self.workers if not w.gone]
        for w in alive:
            self._stop_worker(w)
            w.stopping = True
        watches = [w.watch for w in alive]
        if watches:
            concurrent.futures.wait(watches, timeout=_STOP_TIMEOUT)
        unfinished: list[_Task] = []
        for w in alive:
            unfinished.extend(task for task, _ in w.outstanding)
            w.outstanding.clear()
            self._forget(w)
        self._fail_unfinished(unfinished)
        self._end_state()
        self._release()

    def _release(self) -> None:
        if self._owns_connection:
            self._owns_connection = False
            _disconnect(self._ray)


def _main_by_value(fn: types.FunctionType, ray: Any) -> Any:
    """A function of the caller's ``__main__`` as it travels to the actors: pickled by value
    once (Ray would pickle it again for every call, and give each copy globals of its own); the
    actor binds it to its one ``__mp_main__`` namespace (``_by_value.into_namespace``). Any
    other function as it is (by reference)."""
    if fn.__module__ != "__main__":
        return fn
    return FnByValue(ray.cloudpickle.dumps(fn), f"__main__.{fn.__qualname__}")


def _exception_of(future: concurrent.futures.Future[Any] | None) -> BaseException | None:
    if future is None or not future.done():
        return None
    return future.exception()


def _death_detail(
    task_future: concurrent.futures.Future[Any] | None, watch: concurrent.futures.Future[Any]
) -> str:
    """What Ray says about an actor's death, shortened to its exit detail."""
    error = _exception_of(task_future) or _exception_of(watch)
    if error is None:
        return "its actor died (Ray gave no reason)"
    text = str(error)
    match = re.search(r"Worker exit detail: (.*?)(?: Some common causes|$)", text, re.S)
    if match:
        return f"Ray says: {match.group(1).strip().rstrip('.')}"
    first = next((line for line in text.splitlines() if line.strip()), type(error).__name__)
    return f"Ray says: {first.strip()}"


def _exit_code(how: str) -> int | None:
    match = re.search(r"exit code (-?\d+)", how)
    return int(match.group(1)) if match else None


def _unwrap(wrapped: Any) -> BaseException:
    """An ``ExceptionWithTraceback`` as the exception it rebuilds to (with its traceback)."""
    rebuild, args = wrapped.__reduce__()
    error: BaseException = rebuild(*args)
    return error
