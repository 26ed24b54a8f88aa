"""``spawn()`` beyond one machine: under ``torchrun``, and as a multi-node job of its own, both on
torch.distributed.elastic.

Design note
-----------
Two ways in, both from :func:`tensormp.spawn`; torch is imported only on these paths.

* **Under torchrun** (``TORCHELASTIC_RUN_ID`` is set; :func:`spawn_under_torchrun`). torchrun has
  started this process as one rank already, so ``spawn(fn, args, nprocs)`` starts none: it checks
  ``nprocs`` against ``LOCAL_WORLD_SIZE`` and runs ``fn(LOCAL_RANK, *args)`` here. torchrun's
  ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` stay as they are, so a one-machine
  script runs unchanged under ``torchrun --nnodes=N``. A call made while ``fn`` runs (``fn``
  itself calls ``spawn``), or in a process that ``fn`` started (``TENSORMP_ELASTIC_RANK_PID``
  names the rank's pid), starts processes as usual.
* **spawn(..., nnodes=N, rdzv_endpoint="host:port")** (:func:`launch`). Every node runs the
  same call; ``torch.distributed.launcher.api.elastic_launch`` (a ``LaunchConfig`` with the c10d
  rendezvous) starts ``nprocs`` workers per node, each runs :func:`_worker`, which is the
  torchrun path above. The node whose address is the endpoint's hosts the rendezvous'
  ``TCPStore`` itself (``is_host=False`` for torch), so that the store outlives the workers:
  it stays up until every node has left, or ``_LEAVE_TIMEOUT``.

**The job exchange** makes one rank's failure reach every node in bounded time; torch's agent
only notices a peer node's failure when its own workers fail (a collective op timing out,
30 min with gloo by default). Keys, under ``tensormp/spawn/<run id>/`` in a ``TCPStore`` of the
job (the rendezvous store with ``nnodes``; under plain torchrun the store torchrun shares with
its workers, ``TORCHELASTIC_USE_AGENT_STORE=True``):

* ``failure``: the first failure of the job, a JSON record (global rank, local rank, node,
  host, pid, kind, exception type, message and traceback), set once with ``compare_set``: the
  first writer wins. A rank publishes it when ``fn`` raises, or at its ``timeout``, and only in
  the last attempt (``TORCHELASTIC_RESTART_COUNT == TORCHELASTIC_MAX_RESTARTS``): earlier
  failures are torch's to restart. With ``nnodes``, a node whose rank *crashed* (a signal,
  ``os._exit``) publishes it from the launcher, after torch reported the crash.
* ``seen``: how many ranks took the record and are leaving. Under torchrun the publisher waits
  for ``WORLD_SIZE - 1`` of them (at most ``_ACK_TIMEOUT``) before it exits, so that a store
  hosted by its own node outlives the others' reading (with ``nnodes`` our launcher hosts the
  store and waits for the nodes to leave: no wait).
* ``<restart>/<call>/done``: ranks of this attempt whose ``fn`` returned. A rank whose ``fn``
  returned waits until all ranks of the job are done (then returns its value) or a failure is
  published (then fails, as the ranks of one-machine ``spawn`` that are stopped after a failure).
* ``nodes-left`` (``nnodes`` only): launchers that are done; the store's host waits for all
  that are not lost; ``left/<slot>``: that launcher left (it is not lost).
* ``launchers``, ``beat/<slot>`` (``nnodes`` only): each launcher takes a slot and bumps its
  beat every ``_BEAT`` s from a thread (:class:`_Heartbeat`); local rank 0 of each node writes
  ``node/<index>`` (its launcher's slot, host, first rank), and of the node whose launcher hosts
  the store, ``store-node``. A node whose beat has not moved for ``_BEAT_TIMEOUT`` s is lost
  (:class:`_Liveness`): launchers kill -9'd with their ranks, a machine or network gone.

Each rank polls ``failure`` every ``_POLL`` seconds from a thread while ``fn`` runs. When
another rank's record arrives, it writes the record into its ``TORCHELASTIC_ERROR_FILE``
(torch's JSON format, plus a ``"tensormp"`` entry), counts itself in ``seen``, and ends its
process (``os._exit(1)``, as a ``SIGTERM`` would): ``fn`` may be blocked in a collective op
that would only return at gloo's timeout. Its agent then reports the rank as failed, and the
launcher turns the record into the exception: :class:`ProcessRaisedException` (with the failed
rank's traceback, ``error_index`` its global rank, ``node`` its node), or
:class:`ProcessTimeoutError`, or :class:`ProcessExitedException`, the same on every node.

Who dies when: a rank that raises or times out: every node raises within about
``_POLL + monitor_interval`` seconds plus torch's stop of the workers. A rank that crashes under
``nnodes``: its node raises at once, the others once its launcher published the crash. The node
that hosts the store dies: the other launchers' heartbeats fail at once, and they raise
:class:`ProcessExitedException` naming that node and the store's address (what their ranks saw,
or torch's ``RendezvousConnectionError``, as ``__cause__``), touching the dead store no more
(each failed store operation prints pages of torch's C++ frames). Another node lost (``nnodes``):
the ranks' watch threads and the launchers find it within ``_BEAT_TIMEOUT`` s; the job stops
and every launcher raises :class:`ProcessExitedException` naming the lost node's index and host
(``__cause__``: what its own ranks saw, typically a collective op's connection error, which they
see first: a launcher whose ranks failed waits a beat or two for every node's heartbeat before it
reports, :meth:`_Heartbeat.lost`). A rank that failed and reported ends with ``os._exit(1)``:
the interpreter's teardown of torch took 1-2 s, which the whole job waited for. Under plain ``torchrun`` a crash (no Python left to report)
is torch's to handle. Every worker has ``PR_SET_PDEATHSIG``: a launcher killed takes its workers.
Nothing is left in the temp directory: torch's per-run log directory is ours, removed at the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from itertools import count
from typing import TYPE_CHECKING, Any

from . import _parent_death, _spawn_report
from ._by_value import FnByValue
from ._by_value import prepare as _prepare_fn
from ._spawn_errors import (
    ProcessException,
    ProcessExitedException,
    ProcessFailure,
    ProcessRaisedException,
    ProcessTimeoutError,
    torch_compatible,
)
from ._spawn_errors import signal_name as _signal_name

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["under_torchrun", "spawn", "spawn_under_torchrun", "launch"]

_POLL = 0.2  # seconds between two looks at the job's failure key, while fn runs
_ACK_TIMEOUT = 10.0  # seconds a failed rank waits for the others to take its record
_LEAVE_TIMEOUT = 30.0  # seconds the store's host waits for the other nodes to leave
_STORE_TIMEOUT = 30.0  # seconds for one store operation
_JOIN_TIMEOUT = 600  # seconds for all nodes to join the rendezvous (torchrun's default)
_KEY_PREFIX = "tensormp/spawn"
_BEAT = 0.2  # seconds between two heartbeats of a launcher (spawn(nnodes=...))
_BEAT_TIMEOUT = 1.2  # seconds without a heartbeat after which a node counts as lost

_RANK_PID = "TENSORMP_ELASTIC_RANK_PID"  # set by a rank: its children are no ranks

_calls = count()  # spawn() calls in this process: every rank makes the same ones, in order
_running_here = False  # fn runs here: a spawn() that fn makes starts processes


def under_torchrun() -> bool:
    """True when torchrun (torch.distributed.elastic) started this process as a rank, and
    ``fn`` is not running in it already (a ``spawn()`` that ``fn`` makes, or one made in a
    process that ``fn`` started, starts processes as usual)."""
    return (
        bool(os.environ.get("TORCHELASTIC_RUN_ID"))
        and not _running_here
        and os.environ.get(_RANK_PID, str(os.getpid())) == str(os.getpid())
    )


def _import_torch_distributed(what: str) -> None:
    try:
        import torch.distributed  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"tensormp.spawn({what}) runs on torch.distributed.elastic, and torch is not "
            f"installed ({e}); install it: pip install 'tensormp[torch]'"
        ) from None


# -- the job exchange -------------------------------------------------------------------------


def _store_client(host: str, port: int, timeout: float) -> Store:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


class _Exchange:
    """One rank's view of the job's keys (see the module notes); one store client per thread."""

    def __init__(
        self, host: str, port: int, run_id: str, slot: int | None = None, hosting: bool = False
    ) -> None:
        self.host, self.port = host, port
        self.prefix = f"{_KEY_PREFIX}/{run_id}/"
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.nprocs = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        self.node = int(os.environ.get("GROUP_RANK", "0"))
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.final = restart == os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
        self.done_key = f"{restart}/{next(_calls)}/done"
        self.launched = slot is not None  # by spawn(nnodes=...), not torchrun
        self.store_gone = False  # a store operation failed: its host is gone (each further
        # failed operation would print pages of torch's C++ frames)
        self.store = self.connect()
        # spawn(nnodes=...): say which launcher (heartbeat slot) runs this node
        if slot is not None and os.environ.get("LOCAL_RANK", "0") == "0":
            me = json.dumps({"slot": slot, "host": socket.gethostname(), "rank": self.rank,
                             "node": self.node})
            self.store.set(f"node/{self.node}", me)
            if hosting:  # this node's launcher hosts the store: say which node that is
                self.store.set("store-node", me)

    def liveness(self) -> _Liveness:
        return _Liveness(self.world_size // self.nprocs, self.node)

    def connect(self) -> Store:
        from torch.distributed import PrefixStore

        return PrefixStore(self.prefix, _store_client(self.host, self.port, _STORE_TIMEOUT))

    @classmethod
    def of_torchrun(cls) -> _Exchange | None:
        """The exchange on the store torchrun shares with its workers, or None without one."""
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return None  # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: no store that outlives rank 0
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
        if not host or not port.isdigit():
            return None
        return cls(host, int(port), os.environ["TORCHELASTIC_RUN_ID"])


def _failure(store: Store) -> dict[str, Any] | None:
    if not store.check(["failure"]):
        return None
    return dict(json.loads(store.get("failure")))


def _publish(store: Store, record: dict[str, Any]) -> dict[str, Any]:
    """Offer ``record`` as the job's failure; returns the one that won (ours or an earlier)."""
    won = store.compare_set("failure", "", json.dumps(record))
    return dict(json.loads(won))


def _wait_count(
    store: Store, key: str, want: int, deadline: float, gone: Callable[[], int] | None = None
) -> bool:
    """Wait until the counter ``key`` reaches ``want`` less ``gone()`` (those of lost nodes,
    who will never count)."""
    while store.add(key, 0) < want - (gone() if gone is not None else 0):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class _Liveness:
    """Which nodes of a ``spawn(nnodes=...)`` job are lost: their launcher's heartbeat
    (``beat/<slot>`` in the job's store, bumped every ``_BEAT`` s) has not moved for
    ``_BEAT_TIMEOUT`` s, and it did not leave (``left/<slot>``). A node is known once its
    local rank 0 wrote ``node/<index>`` (its launcher's slot and host). Without such keys
    (plain torchrun) no node is ever found lost. Not thread-safe: one per thread."""

    def __init__(self, nnodes: int, own: int | None) -> None:
        self.nnodes, self.own = nnodes, own
        self.nodes: dict[int, dict[str, Any]] = {}
        self.beats: dict[int, tuple[int, float]] = {}  # node -> (beat, when it last moved)

    def lost(self, store: Store) -> list[tuple[int, str]]:
        """``(node index, host)`` of each lost node. Raises what the store raises."""
        now = time.monotonic()
        out = []
        for node in range(self.nnodes):
            if node == self.own:
                continue
            info = self.nodes.get(node)
            if info is None:
                if not store.check([f"node/{node}"]):
                    continue
                info = self.nodes[node] = json.loads(store.get(f"node/{node}"))
            slot = info["slot"]
            if store.check([f"left/{slot}"]):
                continue
            beat = store.add(f"beat/{slot}", 0)
            last = self.beats.get(node)
            if last is None or last[0] != beat:
                self.beats[node] = (beat, now)
            elif now - last[1] > _BEAT_TIMEOUT:
                out.append((node, str(info["host"])))
        return out

    def record(self, node: int, host: str) -> dict[str, Any]:
        """The job's failure record for the lost ``node``."""
        info = self.nodes.get(node, {})
        return {
            **_here("lost"),
            "rank": int(info.get("rank", -1)), "local_rank": 0, "node": node, "host": host,
            "pid": 0, "exit_code": -9, "type": "NodeLost",
            "message": (
                f"node {node} (host {host}) was lost: its launcher has not answered for "
                f"{_BEAT_TIMEOUT:g} s (killed, or its machine or network is down)"
            ),
        }


# -- records ----------------------------------------------------------------------------------


def _here(kind: str) -> dict[str, Any]:
    return {
        "kind": kind,
        "rank": int(os.environ.get("RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "node": int(os.environ.get("GROUP_RANK", "0")),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "exit_code": 1,
        "type": "",
        "message": "",
        "traceback": "",
    }


def _raised(exc: BaseException) -> dict[str, Any]:
    report = _spawn_report.error_report(exc)
    return {
        **_here("raised"),
        "type": report.type,
        "message": report.message,
        "traceback": report.traceback,
    }


def _where(record: dict[str, Any]) -> str:
    return (
        f"process {record['local_rank']} of node {record['node']} (global rank "
        f"{record['rank']}; host {record['host']}, pid {record['pid']})"
    )


def _exception(record: dict[str, Any], seen_from: str = "") -> ProcessException:
    """The exception every node raises for the job's failure ``record``."""
    kind, rank, pid = record["kind"], int(record["rank"]), int(record["pid"])
    code = int(record["exit_code"])
    signame = _signal_name(code) if code < 0 else None
    failure = ProcessFailure(
        rank, pid, code, signame, record["type"], record["message"], record["traceback"]
    )
    where = _where(record)
    note = f"\n[{seen_from}]" if seen_from else ""
    exc: ProcessException
    if kind == "raised":
        msg = f"\n\n-- {where} terminated with the following error:\n{record['traceback']}{note}"
        exc = torch_compatible(ProcessRaisedException)(
            msg, rank, pid, exc_type=record["type"], exc_message=record["message"],
            exit_code=code, failures=[failure],
        )
    elif kind == "timeout":
        msg = f"spawn() timed out: {where} {record['message']}; the job was stopped{note}"
        exc = ProcessTimeoutError(msg, rank, pid, running=[rank], failures=[failure])
    elif kind == "lost":
        msg = f"{record['message']}; the job was stopped{note}"
        exc = torch_compatible(ProcessExitedException)(msg, rank, pid, code, signame, failures=[failure])
    else:
        what = f"signal {signame}" if signame else f"exit code {code}"
        msg = f"{where} terminated with {what}{note}"
        exc = torch_compatible(ProcessExitedException)(msg, rank, pid, code, signame, failures=[failure])
    exc.__dict__.update(node=int(record["node"]), host=str(record["host"]))
    return exc


def _write_error_file(record: dict[str, Any]) -> None:
    """Record the failure for torch's agent, in its format (its ``ProcessFailure`` reads it)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    line = f"{record['type'] or record['kind']}: {record['message']}".strip()
    data = {
        "message": {
            "message": f"{line} ({_where(record)})",
            "extraInfo": {"py_callstack": record["traceback"], "timestamp": str(int(time.time()))},
        },
        "tensormp": record,
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


# -- one rank, here ---------------------------------------------------------------------------


class _Watch(threading.Thread):
    """While ``fn`` runs: end this rank when another rank's failure is published, or at the
    deadline (see the module notes)."""

    def __init__(
        self, exchange: _Exchange | None, deadline: float | None, timeout: float | None
    ) -> None:
        super().__init__(name="tensormp-spawn-watch", daemon=True)
        self.exchange = exchange
        self.deadline, self.timeout = deadline, timeout
        self.stopped = threading.Event()
        self.decided = threading.Lock()  # taken by whoever reports: this thread or fn's

    def run(self) -> None:
        store = None
        live = self.exchange.liveness() if self.exchange is not None else _Liveness(0, None)
        try:
            if self.exchange is not None:
                store = self.exchange.connect()
        except Exception as e:  # noqa: BLE001 - the job goes on without the exchange
            print(f"tensormp.spawn: cannot watch the job for failures: {e}", file=sys.stderr)
            if self.deadline is None:
                return
        while not self.stopped.wait(_POLL):
            if self.deadline is not None and time.monotonic() >= self.deadline:
                record = {**_here("timeout"), "type": "ProcessTimeoutError",
                          "message": f"ran for {self.timeout:g} s"}
                print(f"tensormp.spawn: {_where(record)} timed out after {self.timeout:g} s; "
                      "stopping it", file=sys.stderr)
                self._end(store, record)
            if store is None or self.exchange is None:
                continue
            try:
                published = _failure(store)
            except Exception as e:  # noqa: BLE001 - its host is gone: torch's agent sees it
                print(f"tensormp.spawn: lost the job's store ({e}); no longer watching it for "
                      "failures of other ranks", file=sys.stderr)
                store = None
                if self.exchange is not None:
                    self.exchange.store_gone = True
                continue
            if published is not None and int(published["rank"]) != self.exchange.rank:
                self._end(store, published)
            try:
                lost = live.lost(store)
                if lost:  # the job cannot go on: stop it, naming the node
                    self._end(store, _publish(store, live.record(*lost[0])))
            except Exception:  # noqa: BLE001 - the store went meanwhile: seen at the next poll
                pass

    def _end(self, store: Store | None, record: dict[str, Any]) -> None:
        """Take or publish ``record``, leave it in the error file, end this process."""
        if not self.decided.acquire(blocking=False):
            return  # fn's thread is reporting its own failure
        if store is not None and self.exchange is not None:
            record = _take_or_publish(store, self.exchange, record)
        _write_error_file(record)
        _exit_now()

    def stop(self) -> None:
        self.stopped.set()
        if self.ident is not None and threading.current_thread() is not self:
            self.join()


def _run_rank(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    exchange: _Exchange | None,
    timeout: float | None,
) -> Any:
    """``fn(LOCAL_RANK, *args)`` here, as one rank of the job; see the module notes.

    Raises:
        ProcessRaisedException: ``fn`` raised here, or in another rank of the job.
        ProcessTimeoutError, ProcessExitedException: another rank timed out or crashed.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    deadline = None if timeout is None else time.monotonic() + timeout
    watch = None
    if exchange is not None or deadline is not None:
        watch = _Watch(exchange, deadline, timeout)
    if watch is not None:
        watch.start()
    global _running_here
    os.environ[_RANK_PID] = str(os.getpid())
    _running_here = True
    try:
        result = fn(local_rank, *args)
    except BaseException as e:
        if watch is not None and not watch.decided.acquire(blocking=False):
            watch.join()  # it is ending this process for another rank's failure
        if isinstance(e, SystemExit) and e.code in (None, 0):
            result = None  # sys.exit(0): a clean exit, as of a one-machine rank
        else:
            record = _raised(e)
            if watch is not None:
                watch.stop()
            if exchange is not None:
                record = _take_or_publish(exchange.store, exchange, record)
            _write_error_file(record)
            raise _exception(record) from None
    finally:
        _running_here = False
    if watch is not None:
        watch.stop()  # returns once it stopped looking: it can no longer end this process
    if exchange is None:
        return result
    failed = _wait_all_done(exchange)
    if failed is not None:
        _write_error_file(failed)
        raise _exception(failed, f"seen by global rank {exchange.rank} after its fn returned")
    return result


def _take_or_publish(store: Store, exchange: _Exchange, record: dict[str, Any]) -> dict[str, Any]:
    """This rank's failure ``record``: publish it (in the last attempt) and wait, bounded, for
    the others to take it; or another rank's: count this rank in ``seen``. Returns the job's
    failure (an earlier one wins)."""
    if exchange.store_gone:
        return record
    try:
        if int(record["rank"]) == exchange.rank:
            if not exchange.final:
                return record  # torch restarts the job; nobody is told
            record = _publish(store, record)
        if int(record["rank"]) == exchange.rank and not exchange.launched:
            # (a launcher of ours keeps the store up until the other nodes left: no wait)
            _wait_count(store, "seen", exchange.world_size - 1, time.monotonic() + _ACK_TIMEOUT)
        else:
            store.add("seen", 1)
    except Exception:  # noqa: BLE001 - the store is gone: report what this rank knows
        exchange.store_gone = True
    return record


def _wait_all_done(exchange: _Exchange) -> dict[str, Any] | None:
    """After ``fn`` returned: wait for every rank's, or for a failure (its record)."""
    store = exchange.store
    live = exchange.liveness()
    try:
        store.add(exchange.done_key, 1)
        pause = 0.01
        while store.add(exchange.done_key, 0) < exchange.world_size:
            record = _failure(store)
            if record is None:
                lost = live.lost(store)
                if lost:
                    record = _publish(store, live.record(*lost[0]))
            if record is not None:
                store.add("seen", 1)
                return record
            time.sleep(pause)
            pause = min(2 * pause, _POLL)
    except Exception:  # noqa: BLE001 - the store is gone: this rank's fn did return
        pass
    return None


# -- under torchrun ---------------------------------------------------------------------------


def spawn_under_torchrun(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    join: bool,
    *,
    timeout: float | None = None,
    grace_period: float | None = None,
    return_values: bool = False,
    distributed: bool = False,
    **unexpected: Any,
) -> list[Any] | None:
    """``spawn()`` in a process that torchrun started: run ``fn(LOCAL_RANK, *args)`` here.

    Returns:
        None, or with ``return_values=True`` a list of ``nprocs`` entries in which only this
        process's (index ``LOCAL_RANK``) is filled: the other local ranks are other processes.

    Raises:
        ValueError: ``nprocs`` is not torchrun's ``LOCAL_WORLD_SIZE``; ``join=False``; or
            ``nnodes`` was given (torchrun has placed the nodes already).
        ProcessRaisedException: ``fn`` raised here or in another rank of the job.
    """
    del grace_period, distributed  # torchrun's environment is kept as it is; torch stops ranks
    if "nnodes" in unexpected:
        raise ValueError(
            "tensormp.spawn(nnodes=...) was called in a process that torchrun started: "
            "torchrun has placed the job on its nodes already; drop nnodes and rdzv_endpoint "
            "(or run the script with python instead of torchrun)"
        )
    if unexpected:
        raise TypeError(f"spawn() got unexpected keyword arguments: {sorted(unexpected)}")
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and int(local) != nprocs:
        raise ValueError(
            f"tensormp.spawn(nprocs={nprocs}) runs under torchrun, which started "
            f"{local} processes on this node (LOCAL_WORLD_SIZE={local}); under torchrun each "
            "process is one rank and spawn() starts none. Start torchrun with "
            f"--nproc-per-node={nprocs}, or pass nprocs=int(os.environ['LOCAL_WORLD_SIZE'])"
        )
    if not join:
        raise ValueError(
            "tensormp.spawn(join=False) is not supported under torchrun: this process is the "
            "rank and runs fn itself; call spawn() with join=True"
        )
    exchange = None
    try:
        exchange = _Exchange.of_torchrun()
    except ImportError:
        pass  # TORCHELASTIC_RUN_ID without torch: no job to exchange with
    result = _run_rank(fn, tuple(args), exchange, timeout)
    if not return_values:
        return None
    values: list[Any] = [None] * nprocs
    values[int(os.environ.get("LOCAL_RANK", "0"))] = result
    return values


# -- a multi-node job of our own ---------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    """What every worker gets (pickled by torch's start method)."""

    fn: Any  # fn, or FnByValue
    args: tuple[Any, ...]
    store_host: str
    store_port: int
    run_id: str
    timeout: float | None
    slot: int | None = None  # the launcher's heartbeat slot (_Heartbeat)
    hosting: bool = False  # the launcher hosts the job's store


def _worker(job: _Job) -> Any:
    """The entrypoint torch.distributed.elastic starts ``nprocs`` times per node."""
    _parent_death.arm_pdeathsig()  # the launcher's death ends us
    fn = job.fn.load() if isinstance(job.fn, FnByValue) else job.fn
    exchange = _Exchange(job.store_host, job.store_port, job.run_id, job.slot, job.hosting)
    try:
        return _run_rank(fn, job.args, exchange, job.timeout)
    except ProcessException:
        # Reported (error file and store): the launcher raises. End now, as _Watch does: the
        # interpreter's teardown of torch (gloo, store clients) took 1-2 s here on a busy
        # machine, and the job's failure waits for this exit.
        _exit_now()


def _exit_now() -> None:
    """End this rank with status 1 now (its failure is reported), output flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)


def _parse_endpoint(endpoint: Any) -> tuple[str, int]:
    if isinstance(endpoint, str):
        host, sep, port = endpoint.rpartition(":")
        host = host.strip("[]")
        if sep and host and port.isdigit() and 0 < int(port) < 65536:
            return host, int(port)
    raise ValueError(
        f"rdzv_endpoint must be 'host:port' (the address of the node that hosts the "
        f"rendezvous, the same on every node), got {endpoint!r}"
    )


def _host_or_join(host: str, port: int, timeout: float) -> tuple[Store, bool]:
    """The rendezvous store: hosted here when ``host`` is this machine and the port is free
    (as torch's c10d backend decides), else a client of it."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    if _matches_machine_hostname(host):
        try:
            store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                             multi_tenant=True, timeout=timedelta(seconds=timeout))
            return store, True
        except (RuntimeError, ValueError, TimeoutError):
            pass  # another process of this machine hosts it (two nodes on one machine)
    return _store_client(host, port, timeout), False


def launch(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    join: bool,
    *,
    nnodes: int,
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout: float = _JOIN_TIMEOUT,
    monitor_interval: float = 0.1,
    local_addr: str | None = None,
    timeout: float | None = None,
    grace_period: float | None = None,
    return_values: bool = False,
    distributed: bool = False,
) -> list[Any] | None:
    """``spawn(fn, args, nprocs, nnodes=N, rdzv_endpoint=...)``: one node of a multi-node job.

    See :func:`tensormp.spawn` for the arguments and the module notes for the protocol.

    Returns:
        None, or with ``return_values=True`` this node's ranks' return values, by local index.

    Raises:
        ProcessRaisedException: ``fn`` raised in some rank of the job, on any node.
        ProcessExitedException: a rank of the job exited or was killed by a signal.
        ProcessTimeoutError: a rank of the job ran past ``timeout``.
        ValueError: bad ``nnodes``, ``rdzv_endpoint``, ``max_restarts`` or ``join=False``.
        ImportError: torch is not installed.
    """
    del distributed  # torch's agent sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 1:
        raise ValueError(f"nnodes must be a positive int (the number of machines), got {nnodes!r}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise ValueError(
                f"spawn(nnodes={nnodes}) needs rdzv_endpoint='host:port': the address of one "
                "of the machines, the same on every node (that node hosts the rendezvous)"
            )
        from ._spawn_env import free_port as _free_port

        rdzv_endpoint = f"127.0.0.1:{_free_port()}"
    host, port = _parse_endpoint(rdzv_endpoint)
    if not join:
        raise ValueError("spawn(nnodes=..., join=False) is not supported: call it with join=True")
    _import_torch_distributed("nnodes=...")
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    run_id = rdzv_id if rdzv_id is not None else f"tensormp-{port}"
    store, hosting = _host_or_join(host, port, float(rdzv_timeout))
    keys = _prefixed(store, run_id)
    log_dir = tempfile.mkdtemp(prefix="tensormp-elastic-")
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nprocs,
        run_id=run_id,
        rdzv_endpoint=f"{host}:{port}",
        rdzv_backend="c10d",
        rdzv_configs={"is_host": False, "join_timeout": int(rdzv_timeout)},
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(log_dir, "logs")),
        local_addr=local_addr,
        shutdown_timeout=None if grace_period is None else max(1, int(grace_period)),
    )
    target = _prepare_fn(fn, "spawn")
    beat = _Heartbeat(host, port, run_id, nnodes)
    beat.start()
    job = _Job(target, tuple(args), host, port, run_id, timeout, beat.slot, hosting)
    formed = False  # the rendezvous formed: other nodes may need the store until they leave
    try:
        with _no_torch_tracebacks_in_logs():
            values = elastic_launch(config, _worker)(job)
        formed = True
    except ChildFailedError as e:
        formed = True
        failure = _job_failure(keys, e, nprocs, beat)
        raise failure from failure.__cause__  # (not torch's ChildFailedError)
    except RendezvousConnectionError as e:
        if beat.store_lost is None and not beat.wait_store_verdict():
            raise
        lost_store = beat.store_lost_error(e)
        raise lost_store from e
    except RendezvousError as e:
        e.add_note(
            f"tensormp.spawn: {nnodes} nodes were to meet at {host}:{port} (rdzv_id "
            f"{run_id!r}) within rdzv_timeout={rdzv_timeout:g} s; start the same spawn() call "
            "on every node, with the same rdzv_endpoint and rdzv_id"
        )
        raise
    finally:
        _leave(keys, nnodes, hosting and formed, beat)
        beat.stop()
        del keys, store
        shutil.rmtree(log_dir, ignore_errors=True)
    if not return_values:
        return None
    return [values[rank] for rank in sorted(values)]


class _DropTraceback(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = record.exc_text = None
        return True


_TORCH_LOGGERS = (
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


@contextmanager
def _no_torch_tracebacks_in_logs() -> Iterator[None]:
    """Keep torch's log lines about failed workers, without their tracebacks (torch's own
    ``ProcessExitedException`` from its poll loop; the rank's traceback is in our exception):
    torch's log formatter imports ``torch._dynamo`` to format any traceback, which delayed the
    failure of a node by 14 s on this project's 2-core machine."""
    drop = _DropTraceback()
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def _prefixed(store: Store, run_id: str) -> Store:
    from torch.distributed import PrefixStore

    return PrefixStore(f"{_KEY_PREFIX}/{run_id}/", store)


def _job_failure(store: Store, error: Any, nprocs: int, beat: _Heartbeat) -> ProcessException:
    """The exception for a failed job, from the record in the store (or, with the store gone,
    from torch's report of this node's ranks). Publishes a crash that no rank could report.
    When a node of the job was lost, the exception names it (and ``__cause__`` is what this
    node's ranks then saw: typically a collective op's connection error)."""
    rank, failure = error.get_first_failure()
    beat.wait_store_verdict()
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    record = data.get("tensormp")
    if record is None:  # a crash or a kill: nobody wrote a record
        record = {
            **_here("exited"),
            "rank": rank,
            "local_rank": failure.local_rank,
            "node": rank // nprocs,  # torch numbers the ranks node by node
            "pid": failure.pid,
            "exit_code": failure.exitcode,
        }
    if beat.store_lost is not None:  # its host is gone: say so, with what this node saw
        seen = _exception(record)
        exc = beat.store_lost_error(seen)
        exc.__cause__ = seen
        return exc
    try:
        record = _failure(store) or _publish(store, record)
    except Exception:  # noqa: BLE001 - the store's host is gone: say what this node saw
        pass
    lost = beat.lost(settle=True)
    if not lost or record["kind"] == "lost":
        return _exception(record)
    seen = _exception(record)
    first = beat.live.record(*lost[0])
    line = (record["message"] or record["type"] or record["kind"]).strip().splitlines()
    first["message"] += (
        f"; then {_where(record)} failed: {record['type'] or record['kind']}: "
        f"{line[0] if line else ''}"
    )
    named = _exception(first)
    named.__cause__ = seen
    return named


def _leave(store: Store, nnodes: int, wait: bool, beat: _Heartbeat) -> None:
    """Count this node out; the store's host (``wait``) keeps it up until all nodes that are
    not lost left (bounded)."""
    if beat.store_lost is not None:
        return  # nothing to leave (and each failed store operation prints pages of C++ frames)
    try:
        store.set(f"left/{beat.slot}", "1")
        store.add("nodes-left", 1)
        if wait:
            _wait_count(store, "nodes-left", nnodes, time.monotonic() + _LEAVE_TIMEOUT,
                        lambda: len(beat.lost()))
    except Exception:  # noqa: BLE001 - the host is gone already
        pass


class _Heartbeat(threading.Thread):
    """A launcher's heartbeat in the job's store (``beat/<slot>``, every ``_BEAT`` s), and its
    view of the other nodes' (:meth:`lost`); its own store client."""

    def __init__(self, host: str, port: int, run_id: str, nnodes: int) -> None:
        super().__init__(name="tensormp-spawn-heartbeat", daemon=True)
        self.store = _prefixed(_store_client(host, port, _STORE_TIMEOUT), run_id)
        self.slot = int(self.store.add("launchers", 1))
        self.live = _Liveness(nnodes, None)
        self.found: list[tuple[int, str]] = []
        self.stopped = threading.Event()
        self.address = f"{host}:{port}"
        self.store_node: dict[str, Any] | None = None  # which node hosts the store, once known
        self.store_lost: BaseException | None = None  # the store's error, once it is gone

    def run(self) -> None:
        while True:
            try:
                self.store.add(f"beat/{self.slot}", 1)
                self.found = self.live.lost(self.store)
                if self.store_node is None and self.store.check(["store-node"]):
                    self.store_node = json.loads(self.store.get("store-node"))
            except Exception as e:  # noqa: BLE001 - the store's host is gone
                self.store_lost = e
                return
            if self.stopped.wait(_BEAT):
                return

    def wait_store_verdict(self) -> bool:
        """Something failed here: give the heartbeat a beat or two to find whether the store
        is gone. True when it is."""
        deadline = time.monotonic() + 3 * _BEAT
        while self.store_lost is None and self.is_alive() and time.monotonic() < deadline:
            time.sleep(_BEAT / 4)
        return self.store_lost is not None

    def store_lost_error(self, seen: BaseException) -> ProcessExitedException:
        """The exception for the loss of the node that hosted the job's store."""
        info = self.store_node or {}
        node, host = info.get("node"), info.get("host", self.address.rsplit(":", 1)[0])
        which = f"node {node} (host {host})" if node is not None else f"the node at {host}"
        msg = (
            f"{which}, which hosted the job's store at {self.address}, was lost: the store "
            f"no longer answers ({type(self.store_lost).__name__}: "
            f"{str(self.store_lost).splitlines()[0] if str(self.store_lost) else ''}); the job "
            f"was stopped. This node then saw: {type(seen).__name__}: "
            f"{(str(seen).strip().splitlines() or [''])[-1][:300]}"
        )
        rank = int(info.get("rank", -1))
        failure = ProcessFailure(rank, 0, -9, "SIGKILL", "NodeLost", msg, "")
        exc = torch_compatible(ProcessExitedException)(msg, rank, 0, -9, "SIGKILL", failures=[failure])
        exc.__dict__.update(node=node, host=host)
        return exc

    def lost(self, settle: bool = False) -> list[tuple[int, str]]:
        """``(node index, host)`` of the nodes found lost, as of the last heartbeat.
        ``settle``: a failure was just seen here, and may be a node's loss (a collective op
        whose peer vanished fails at once): first wait until every known node has beaten
        since (a beat or two: ~0.2-0.4 s) or counts as lost (``_BEAT_TIMEOUT``)."""
        since = time.monotonic()
        deadline = since + _BEAT_TIMEOUT + 3 * _BEAT
        while settle and not self.found and self.is_alive() and time.monotonic() < deadline:
            beats = dict(self.live.beats)
            if beats and all(moved > since for _, moved in beats.values()):
                break
            time.sleep(_BEAT / 4)
        return list(self.found)

    def stop(self) -> None:
        self.stopped.set()
        if self.ident is not None:
            self.join()


def spawn(
    fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, join: bool, **kwargs: Any
) -> list[Any] | None:
    """:func:`tensormp.spawn` beyond one machine: under torchrun, or with ``nnodes``."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if under_torchrun():
        return spawn_under_torchrun(fn, args, nprocs, join, **kwargs)
    return launch(fn, args, nprocs, join, **kwargs)
