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
workers itself, so that a task is never run twice behind the caller's back (unless the caller
allows it: ``task_retries``, see *Lost nodes*).

**Tasks.** The manager thread (``base.QueueEngine``) calls ``actor.run.remote(fn, kind,
args)`` for a task (``run_packed(bytes)`` for a light one: a plain function and scalar or string
arguments, pickled in one go; a light answer comes back the same way) and turns the
``ObjectRef`` into a ``concurrent.futures.Future`` whose completion puts an event on the
manager's queue; callers' threads wake it the same way. A worker holds at most four tasks (the
one it runs and, while more tasks wait than there are workers, the next three: a Ray call's
round trip is about 1 ms, so a worker needs more queued than a local one to stay busy on small
tasks), or up to 32 when its recent tasks ran so briefly that those queued wait at most 5 ms
(``_limit``; ``run`` reports each task's run time). An actor runs its
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

**Lost nodes and transient errors.** When a node dies, our calls to its actors fail within
about 1.5 s with ``ActorUnavailableError`` ("temporarily unavailable": the connection broke),
while Ray's tables call the node and the actor alive until its health checks give up (15 s by
default). Ray raises the same error for a transient RPC failure to a healthy actor. So on that
error the engine asks (``_check``): Ray's tables (actor dead? node dead?), then the node's raylet
and the actor's own port by TCP: a refused raylet, or one silent for 2 s, is a lost node; a
refused actor port is a dead actor; both answering is a transient error. A lost node fails the
task its actors ran at once with :class:`WorkerLostError` naming the node (``map`` raises at
its first failed chunk, as the stdlib's), and every actor of that node is replaced; a transient
error keeps the actor and fails only the task whose answer was lost (it may have run). With
``task_retries=N`` (an engine option) such a task is sent again, up to N times, to whatever
worker is free: at least once, so only for tasks that may run twice. A node that vanishes
without a word (no TCP reset) is found when the raylet stays silent, or by Ray's health checks.

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
import pickle
import queue
import re
import socket
import sys
import threading
import time
import types
from collections.abc import Mapping
from typing import Any

from ..._by_value import FnByValue, needs_value
from ..runner import format_exception, load_fn, run_task, unwrap, wrap
from ..tasks import _describe, _light_size, _Task
from .base import LOST_TAIL, TERMINATE, EngineConfig, QueueEngine

OPTIONS: tuple[str, ...] = ("address", "ray_remote_args", "task_retries")

_PROBE_TIMEOUT = 5.0  # seconds to reach the cluster's address before ConnectionError
_SETTLE_TIMEOUT = 5.0  # seconds a dead actor's task futures get to settle
_STOP_TIMEOUT = 10.0  # seconds for the actors to be gone at close/terminate
_MAX_STARTUP_FAILURES = 3
_MAX_IN_FLIGHT = 4  # tasks sent to one actor and not answered (1 running + 3 queued there)
_MAX_IN_FLIGHT_TINY = 32  # the same for tasks known to be tiny (see _limit)
_QUEUED_WORK = 0.005  # seconds of recent tasks' run time that may wait queued on one actor
_WATCH_GROUP = "tensormp-watch"
# callables that plain pickle sends as the actor can load them (by name, or by value); any
# other (a method, a partial, a callable object) goes to Ray's serializer
_PACKABLE = (FnByValue, types.FunctionType, types.BuiltinFunctionType)
_LIGHT_TYPES = (int, float, bool, complex, str, bytes, type(None))
_CONNECT_TIMEOUT = 0.5  # seconds per TCP connect when asking whether a node or actor is there
_SILENT_NODE_GRACE = 2.0  # seconds a node's raylet may not answer before the node counts as lost
_ALIVE, _DEAD, _NODE_LOST = "alive", "dead", "node lost"  # what a check of an actor finds


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
                load_fn(initializer, {}, self._main)(*initargs)
            except BaseException as e:  # noqa: BLE001 - reported by ready(); the pool breaks
                self._init_error = wrap(e)

    def ready(self) -> tuple[Any, int, str, str]:
        import ray

        context = ray.get_runtime_context()
        return self._init_error, os.getpid(), context.get_node_id(), ray.util.get_node_ip_address()

    def run(self, fn: Any, kind: int, args: Any) -> tuple[bool | None, Any, float]:
        """``runner.run_task``; a ``BaseException`` (``SystemExit``...) comes back as its
        traceback's text (``(None, text, 0.0)``): the engine ends this worker."""
        ok, value, seconds = run_task(fn, kind, args, self._cache, self._main)
        if ok is None:
            return None, format_exception(value), 0.0
        return ok, value, seconds

    def run_packed(self, data: bytes) -> Any:
        """``run`` of a light task, pickled by the engine in one go (``_send``); a light
        answer comes back pickled the same way (Ray then moves two ``bytes`` objects instead
        of serializing each argument and the answer: a third less of the caller's time)."""
        result = self.run(*pickle.loads(data))
        if result[0] and _light_value(result[1]):
            return pickle.dumps(result, pickle.HIGHEST_PROTOCOL)
        return result

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
        "retiring", "stopping", "gone", "watch", "alone", "recent", "answered",
    )

    def __init__(self, handle: Any) -> None:
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
        self.watch: concurrent.futures.Future[Any] = concurrent.futures.Future()  # _watch()
        self.alone = False  # runs a task that may have killed a worker: nothing behind it
        self.recent: float | None = None  # seconds its recent tasks ran (decaying maximum)
        self.answered = 0.0  # time.monotonic() of its last answer, or when it got work while idle

    def name(self) -> str:
        pid = f" (pid {self.pid})" if self.pid is not None else ""
        node = f" on node {self.node_ip} (id {self.node_id[:12]})" if self.node_id else ""
        return f"worker actor {self.id[:12]}{pid}{node}"


# manager events: woken, a task's answer, ready() answered, watch() ended, the initializer
# failed, ready() got no answer (a transient RPC error, or a death)
_WAKE, _DONE, _READY, _WATCH, _INIT_FAILED, _UNSURE = range(6)


class Engine(QueueEngine):
    """Workers as Ray actors (see the module notes)."""

    def __init__(
        self,
        config: EngineConfig,
        address: str | None = None,
        ray_remote_args: Mapping[str, Any] | None = None,
        task_retries: int = 0,
    ) -> None:
        if isinstance(task_retries, bool) or not isinstance(task_retries, int) or task_retries < 0:
            raise ValueError(
                f"{config.owner}: task_retries must be an int >= 0 (how many times a task "
                f"whose worker was lost runs again elsewhere), got {task_retries!r}"
            )
        self._task_retries = task_retries
        self._reruns: dict[int, int] = {}  # task seq -> times it was sent again after a loss
        self._lost_nodes: dict[str, str] = {}  # node id -> how it was found lost
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
        self._start()

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
        w = _Actor(self._actor_class.remote(self._initializer, self._initargs))
        self._watch(w)
        self.workers.append(w)
        self._ask_ready(w)

    def _watch(self, w: _Actor) -> None:
        w.watch = w.handle.watch.options(concurrency_group=_WATCH_GROUP).remote().future()
        w.watch.add_done_callback(lambda _f: self._events.put((_WATCH, w)))

    def _on_ready(self, w: _Actor, future: concurrent.futures.Future[Any]) -> None:
        # Ray's thread: record the answer, let the manager act on it.
        try:
            init_error, w.pid, w.node_id, w.node_ip = future.result()
        except self._ray.exceptions.ActorUnavailableError:
            self._events.put((_UNSURE, w))  # no answer: the manager asks whether it lives
            return
        except BaseException:  # noqa: BLE001 - the actor died first: watch() reports it
            return
        if init_error is not None:
            self._init_failures[w] = init_error
        self._events.put((_READY, w) if init_error is None else (_INIT_FAILED, w))

    def _ask_ready(self, w: _Actor) -> None:
        ready = w.handle.ready.remote().future()
        ready.add_done_callback(lambda f, w=w: self._on_ready(w, f))

    def _check(self, w: _Actor) -> tuple[str, str]:
        """Ray said a call of ``w`` got no answer (``ActorUnavailableError``: the connection
        broke): is it a transient RPC error (``_ALIVE``), or did the actor's process end
        (``_DEAD``) or its node (``_NODE_LOST``)? With how it was found.

        Ray's tables (the GCS) are asked first; they call a lost node alive until its health
        checks time out (15 s by default), so the node's raylet and the actor's own port are
        asked too: a refused connection is an ended process; a raylet that does not answer
        for ``_SILENT_NODE_GRACE`` seconds is a lost node."""
        if w.node_id in self._lost_nodes:
            return _NODE_LOST, self._lost_nodes[w.node_id]
        actor: dict[str, Any] = {}
        try:
            from ray._private import state

            actor = state.actors(w.id) or {}
        except Exception:  # noqa: BLE001 - Ray's private API moved: the probes below decide
            pass
        if actor.get("State") == "DEAD":
            return _DEAD, "Ray reports the actor dead"
        where = actor.get("Address") or {}
        node_id = w.node_id or str(where.get("NodeID") or "")
        try:
            node = next((n for n in self._ray.nodes() if n.get("NodeID") == node_id), None)
        except Exception:  # noqa: BLE001 - the GCS cannot be reached: the probes decide
            node = None
        verdict: tuple[str, str] | None = None
        if node is not None and not node.get("Alive", True):
            verdict = _NODE_LOST, "Ray reports the node dead"
        raylet = (node["NodeManagerAddress"], node["NodeManagerPort"]) if node else None
        process = (where.get("IPAddress"), where.get("Port")) if where.get("Port") else None
        deadline = time.monotonic() + _SILENT_NODE_GRACE
        while verdict is None:
            answer = _answers(raylet) if raylet else True
            if answer is False:
                verdict = _NODE_LOST, (
                    f"its raylet at {raylet[0]}:{raylet[1]} refuses connections"  # type: ignore[index]
                )
            elif answer and process is not None and _answers(process) is False:
                return _DEAD, (
                    f"its process no longer accepts connections at {process[0]}:{process[1]}"
                )
            elif answer:
                return _ALIVE, ""
            elif time.monotonic() > deadline:
                verdict = _NODE_LOST, (
                    f"its raylet at {raylet[0]}:{raylet[1]} has not answered for "  # type: ignore[index]
                    f"{_SILENT_NODE_GRACE:g} s"
                )
            else:
                time.sleep(0.1)
        if node_id:
            self._lost_nodes[node_id] = verdict[1]
        return verdict

    def _retry(self, task: _Task) -> bool:
        """Whether ``task``, lost with its worker, may run again (``task_retries``); counts it."""
        done = self._reruns.get(task.seq, 0)
        if done >= self._task_retries:
            return False
        self._reruns[task.seq] = done + 1
        return True

    def _requeue(self, tasks: list[_Task]) -> None:
        """Put ``tasks`` back at the front of the queue, in order (no worker started them, or
        they may run again)."""
        if tasks:
            with self._lock:
                self._pending.extendleft(reversed(tasks))

    def _replenish(self) -> None:
        if not self._wants_workers():
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
    def _wait(self) -> None:
        try:
            event = self._events.get(timeout=1.0)
        except queue.Empty:
            return
        while True:
            self._handle(*event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

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
        elif kind == _WATCH:
            if not w.watch.done():
                return  # the event of a watch() that was renewed
            if isinstance(_exception_of(w.watch), self._ray.exceptions.ActorUnavailableError):
                verdict = self._check(w)
                if verdict[0] == _ALIVE:  # a transient RPC error: watch again
                    self._watch(w)
                    return
                self._on_death(w, verdict)
            else:
                self._on_death(w)
        elif kind == _UNSURE:
            verdict = self._check(w)
            if verdict[0] == _ALIVE:
                self._ask_ready(w)
            else:
                self._on_death(w, verdict)
        else:  # _INIT_FAILED
            self._on_death(w)

    def _collect(self, w: _Actor) -> bool:
        """Deliver the results of ``w``'s finished tasks, oldest first; False when one failed
        because the actor died (its death is handled by :meth:`_on_death`)."""
        while w.outstanding and w.outstanding[0][1].done():
            task, future = w.outstanding[0]
            try:
                result = future.result()
                if type(result) is bytes:
                    result = pickle.loads(result)
                ok, value, seconds = result
            except self._ray.exceptions.ActorUnavailableError as e:
                verdict = self._check(w)
                if verdict[0] != _ALIVE:
                    self._on_death(w, verdict)
                    return False
                w.outstanding.popleft()  # the actor lives: only this answer is lost
                self._unanswered(w, task, e)
                continue
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
            if self._reruns:
                self._reruns.pop(task.seq, None)
            w.recent = seconds if w.recent is None else max(seconds, 0.75 * w.recent)
            w.answered = time.monotonic()
            self._deliver(task, ok, value)
        if not w.outstanding:
            w.alone = False
        if w.retiring and not w.outstanding:
            self._stop_worker(w)
        return True

    def _unanswered(self, w: _Actor, task: _Task, error: BaseException) -> None:
        """A call to ``w`` failed with a transient RPC error while ``w`` lives: the task may
        or may not have run there. It runs again if ``task_retries`` allows, else it fails;
        the worker is kept."""
        if self._retry(task):
            self._requeue([task])
            return
        what = _describe(task.label)
        msg = (
            f"{self.owner}: Ray lost the answer of {what} from {w.name()} (a transient RPC "
            f"error: {_first_line(error)}); the worker lives and the pool keeps it, but the task "
            "may or may not have run there. Resubmit it if it is safe to run again, or let the "
            "pool do it: engine_options={'task_retries': N}"
        )
        lost = self._lost_error(msg, w.pid, None, what, w.node_ip or None)
        lost.__cause__ = error
        self._deliver(task, False, lost)

    def _on_death(self, w: _Actor, verdict: tuple[str, str] | None = None) -> None:
        if w.gone:
            return
        node_lost = verdict is not None and verdict[0] == _NODE_LOST
        # Ray fails a dead actor's calls promptly; wait for them so that a result the actor
        # sent before it died is delivered and the task it ran is known exactly. (Of a lost
        # node nothing more will come.)
        pending = [f for _, f in w.outstanding]
        if pending and not node_lost:
            concurrent.futures.wait(pending, timeout=_SETTLE_TIMEOUT)
        while w.outstanding:
            task, future = w.outstanding[0]
            if future.done() and future.exception() is None:
                w.outstanding.popleft()
                result = future.result()
                ok, value, _ = pickle.loads(result) if type(result) is bytes else result
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
            how = _death_detail(future, w.watch) if verdict is None else verdict[1]
            self._lose(w, task, how, None, suspect, node_lost)
            self._lose_node_of(w, verdict)
            return
        init_error = self._init_failures.pop(w, None)
        if init_error is not None:
            self._stop_worker(w)  # alive, but useless
        self._forget(w)
        if init_error is not None:
            self._initializer_failed(w.name(), unwrap(init_error))
        elif not w.ready and not w.stopping and self._state != TERMINATE:
            self._startup_failures += 1
            detail = _death_detail(None, w.watch)
            if node_lost:
                pass  # not the worker's fault: its replacement starts elsewhere
            elif "creation task" in detail or self._startup_failures >= _MAX_STARTUP_FAILURES:
                self._break(
                    f"{self.owner}: {w.name()} died while starting, before it could run a task "
                    f"({detail}); the pool is broken. Every node needs tensormp and the "
                    "function's module importable (the same environment, or a runtime_env in "
                    "ray_remote_args)",
                    _exception_of(w.watch),
                )
        self._replenish()
        self._lose_node_of(w, verdict)

    def _lose_node_of(self, w: _Actor, verdict: tuple[str, str] | None) -> None:
        """``w``'s node was lost: so are the other workers there (their calls may not have
        failed yet)."""
        if verdict is None or verdict[0] != _NODE_LOST or not w.node_id:
            return
        for other in list(self.workers):
            if other.node_id == w.node_id and not other.gone:
                self._on_death(other, verdict)

    def _lose(
        self, w: _Actor, running: _Task, how: str, traceback: str | None,
        suspect: _Task | None = None, node_lost: bool = False,
    ) -> None:
        """``w`` ended while running ``running`` (or, when ``suspect`` is given, just after it
        finished ``running`` while starting ``suspect``): fail ``running`` (or, as
        ``task_retries`` allows, run it again elsewhere), requeue the younger tasks
        (``suspect`` first, to run alone), replace the worker. ``node_lost``: ``w``'s node was
        lost, and ``how`` says how that was found."""
        from multiprocessing.pool import RemoteTraceback  # type: ignore[attr-defined]  # not in typeshed

        rest = [task for task, _ in w.outstanding]
        w.outstanding.clear()
        self._stop_worker(w)
        self._forget(w)
        if suspect is not None:
            self._alone.add(suspect.seq)
        retried = traceback is None and self._retry(running)
        # not started by the dead worker (but maybe suspect): others will run them
        self._requeue([running, *rest] if retried else rest)
        if retried:
            self._replenish()
            return
        what = _describe(running.label)
        if node_lost:
            pid = f" (pid {w.pid})" if w.pid is not None else ""
            msg = (
                f"{self.owner}: lost the node {w.node_ip} (id {w.node_id[:12]}): {how}. Its "
                f"worker actor {w.id[:12]}{pid} was running {what}"
                + (f", or had just finished it and started {_describe(suspect.label)}"
                   if suspect is not None else "")
                + ". Only this task failed; the pool replaces the worker where Ray has room "
                "and keeps running. Resubmit the task if it is safe to run again, or let the "
                "pool do it: engine_options={'task_retries': N} runs a lost worker's tasks "
                "again on other workers (at least once)"
            )
            error = self._lost_error(msg, w.pid, None, what, w.node_ip or None)
            self._deliver(running, False, error)
            self._replenish()
            return
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
        error = self._lost_error(msg + LOST_TAIL, w.pid, _exit_code(how), what, w.node_ip or None)
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
            if depth and (depth >= _limit(target) or npending < nready):
                return
            with self._lock:
                if not self._pending:
                    return
                if depth and self._pending[0].seq in self._alone:
                    return  # it waits for an idle worker
                task = self._pop_locked()
            if task.seq in self._alone:
                self._alone.discard(task.seq)
                target.alone = True
            if task.start is not None and not self._claim(task):  # cancelled while it waited
                continue
            self._send(target, task)

    def _send(self, w: _Actor, task: _Task) -> None:
        wire = task.fn.wire
        if type(wire) is types.FunctionType:
            wire = task.fn.wire = _main_by_value(wire, self._ray)
        try:
            if type(wire) in _PACKABLE and _light_size(task) >= 0:
                data = pickle.dumps((wire, task.kind, task.args), pickle.HIGHEST_PROTOCOL)
                ref = w.handle.run_packed.remote(data)
            else:
                ref = w.handle.run.remote(wire, task.kind, task.args)
        except Exception as e:  # noqa: BLE001 - Ray could not serialize the call
            if hasattr(e, "add_note"):
                e.add_note(f"({self.owner}: sending {_describe(task.label)} to a worker actor)")
            self._deliver(task, False, e)
            return
        future = ref.future()
        if not w.outstanding:
            w.answered = time.monotonic()
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
    """A function of the caller's ``__main__`` as it travels to the actors, which never import
    the script (``_by_value.needs_value``): pickled by value once (Ray would pickle it again for
    every call, and give each copy globals of its own); the actor binds it to its one
    ``__mp_main__`` namespace (``_by_value.into_namespace``). Any other function as it is (by
    reference)."""
    if not needs_value(fn, foreign_workers=True):
        return fn
    return FnByValue(ray.cloudpickle.dumps(fn), f"__main__.{fn.__qualname__}")


def _light_value(value: Any) -> bool:
    """Whether a task's answer is a few scalars or short strings (``run_packed``)."""
    if type(value) is list:  # a map chunk's answers
        return len(value) <= 64 and all(type(v) in _LIGHT_TYPES for v in value)
    return type(value) in _LIGHT_TYPES and (
        type(value) not in (str, bytes) or len(value) <= 65536
    )


def _limit(w: _Actor) -> int:
    """How many tasks ``w`` may hold (the one it runs and those queued behind it): 4, or
    up to 32 for tasks that recently took so little that those queued wait at most
    ``_QUEUED_WORK`` seconds (a Ray call's round trip is about 1 ms: a worker needs more of
    them queued to stay busy, and the manager thread then answers many per wake-up), as long
    as its answers keep coming (a worker silent for that long holds 4 at most: what is queued
    behind a long task cannot be taken back)."""
    recent = w.recent
    if recent is None or recent * _MAX_IN_FLIGHT >= _QUEUED_WORK:
        return _MAX_IN_FLIGHT
    if time.monotonic() - w.answered > _QUEUED_WORK:
        return _MAX_IN_FLIGHT  # no answer for a while: it may run a long task now
    return min(_MAX_IN_FLIGHT_TINY, int(_QUEUED_WORK / max(recent, 1e-6)))


def _answers(address: tuple[Any, Any]) -> bool | None:
    """Whether something listens at ``(host, port)``: True, False (refused: nothing there),
    None (no answer within ``_CONNECT_TIMEOUT``)."""
    try:
        with socket.create_connection((str(address[0]), int(address[1])), _CONNECT_TIMEOUT):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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
