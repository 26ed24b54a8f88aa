"""``Pool``: the stdlib's process pool, with arrays (arguments *and* results) moving through
shared memory, dead workers reported instead of hangs, and progress bars.

Design note
-----------
The front end (``pool.py``, and ``tensormp.futures``) runs on an *engine* behind the interface
written at the top of ``engines/__init__.py``: ``local`` (below) or ``ray`` (workers are Ray
actors; its note is at the top of ``engines/ray.py``). What follows is the local engine.

**Channels.** Each worker has its own duplex tensormp ``Connection`` (a Unix socket pair that
carries fds). There is no task queue shared by the workers and no lock shared between
processes, so a worker killed at any instant cannot wedge the others (in the stdlib, a worker
SIGKILLed while it holds the task queue's read lock blocks every other worker forever). One
*manager thread* in the parent owns the workers: it starts them, sends them tasks, reads their
results, reaps the dead and starts replacements. The caller's threads only append tasks to a
deque and wake the manager (a pipe). ``imap`` pulls from its iterable in a *feeder thread*,
which waits while many tasks are already queued, so a huge generator of arrays is never
materialised.

**Tasks.** A task is one call (``apply``) or one chunk of a map. It is pickled with tensormp's
reducers just before it is sent: a numpy argument not yet in shared memory is copied once into
a block of the parent's and the pickle holds a handle (~200 bytes). Usually the manager sends
it; a single task submitted while a worker can take it at once is pickled and sent by the
caller's own thread (``engines/local.py``, "Direct send": a thread hop less). A worker holds the task
it runs and, while more tasks wait than there are workers, a few more queued in its socket so
it need not wait for a round trip: one more when its calls take a millisecond or more, up to 32
when its calls are tiny (about 2 ms of queued work, from the run times the worker reports);
none that carries shared memory. When a worker idles while another's task has run 10 ms with
tasks queued behind it, the manager takes those back for it, so no task waits behind a long
one while a worker idles (``engines/local.py``, "Prefetch"; ``worker.py``, "Give-back").
Tiny tasks the manager sends to
one worker at once travel as one message (a batch), each still answered on its own. A worker
runs its tasks one at a time, in the order sent. In a batch, a task whose arguments are only
scalars, ``str`` and ``bytes`` is not pickled on its own: it rides in the batch's one pickle,
its callable pickled once per batch ("Light batches"). The callable goes by reference when the
workers can import it by name (as the stdlib; a bound method pickles its object with tensormp's
reducers, so arrays in it stay shared); lambdas, local functions, functions defined under
``if __name__ == "__main__":``, methods of classes defined there and callables that plain
pickle refuses go by value with cloudpickle (as ``tensormp.spawn``; arrays they hold are then
copied). A plain function is unpickled once per worker (its globals live on between calls, as a
module's in a stdlib worker); any other callable afresh for each task, as the stdlib's.

**Results.** The worker answers ``(seq, ok, value)``: the value, or the exception with its
traceback (``multiprocessing.pool``'s ``RemoteTraceback`` as ``__cause__``, as the stdlib).
Arrays in the value are copied once into the worker's shared memory (no copy when already
shared) and the parent maps them: a 64 MiB result costs one ``memcpy``, not a pickle. The
answer belongs to the oldest task outstanding on that worker (checked by ``seq``).

**Dead workers.** The manager polls every worker's socket and process sentinel (plus a
``waitpid`` once a second, for a sentinel that a grandchild keeps open). When a worker ends, it
first reads what the socket still holds (a result sent just before death is delivered), then the
exit status. Since a worker runs its tasks in order, the oldest task still outstanding is the
one it was running: its result fails with :class:`WorkerLostError` (pid, exit code or signal
name, task; chained with the worker's traceback when a task called ``sys.exit()``, or its
faulthandler stack after SIGSEGV/SIGBUS/SIGABRT...). A younger task was never started (at most
read, in a batch): it is pickled anew for another worker. The pool starts a replacement and
stays usable. A worker that dies before it is ready (the initializer raised, the main module
failed to import) makes the pool *broken* (:class:`BrokenPoolError` for every task not yet
running and every new call) instead of respawning forever as the stdlib does.

What each party sees when a worker is SIGKILLed (the OOM killer sends SIGKILL):

* before it reported ready: no task is assigned to it; a replacement starts (three such deaths
  in a row, or one with an exit code, break the pool);
* while idle: nothing is lost; a replacement starts;
* between reading a task and sending its result: that task fails with ``WorkerLostError``;
  a task queued behind it goes to another worker;
* while sending a result: the parent reads a partial message, gets EOF, and fails that task;
* after sending a result: the result is delivered; only the replacement is visible.

The parent SIGKILLed: every worker dies with it (``_parent_death.py``: ``PR_SET_PDEATHSIG`` plus a
watchdog pipe; workers that the manager thread replaced rely on the watchdog alone).

**Who frees shared memory.** Arguments: blocks the parent created when it pickled the task.
Once the task is sent, the parent registers the worker as the holder of each (``register_holder``,
as for ``Process`` arguments; a release that came first cancels the hold) and the worker rebuilds
them without hold records (``reducers.process_args_parent``), so the count is exact. A task
whose send failed is not registered: its message is dropped and gives its handles back, once. The worker drops its views when the
task is done and tells the parent (a release record, sent before it waits for the next task);
the parent recycles the block for a later argument. A worker killed while holding them: the
parent's liveness check (about once a second) drops its holds. Results: blocks the worker
created; the parent's views keep them alive; when the caller drops a result, the parent tells
the worker, which recycles the block for a later result. When the worker is gone
(``maxtasksperchild``, killed), its blocks live on in the parent's mapping until the parent lets
go, then the kernel frees them. ``terminate()`` leaves nothing pinned either: tasks not yet sent
give their handles back, and the holds of killed workers go with the liveness check.

Modules
-------
* ``errors.py``: :class:`WorkerLostError`, :class:`BrokenPoolError`.
* ``worker.py``: what runs in a worker process (``_worker_main``), and the messages on its
  channel.
* ``tasks.py``: a task as the parent holds it (``_Task``, its kinds), its callable as it
  travels (by name, or by value with cloudpickle: ``_by_value.py`` decides), and how error
  messages name it.
* ``runner.py``: one task run in a worker (``run_task``), for every engine.
* ``engines/``: what runs the tasks, behind one interface (``engines/__init__.py``,
  ``docs/engines.md``):
  ``base.py`` (the task deque, state and flow control every engine shares), ``local.py`` (the
  engine described above: the manager thread and the workers' bookkeeping, dispatch and
  prefetch, dead workers, close and terminate), ``ray.py`` (workers as Ray actors).
* ``results.py``: :class:`AsyncResult` (``ApplyResult``), :class:`MapResult`,
  :class:`IMapIterator`.
* ``progress.py``: ``progress=True`` (a tqdm bar) or ``progress=callable(done, total)``.
* ``pool.py``: :class:`Pool`, the public API on top of an engine (also the front end of
  ``tensormp.futures``).

This package imports nothing heavy: a worker imports numpy only if its tasks carry arrays.
"""

from __future__ import annotations

from .errors import BrokenPoolError, WorkerLostError
from .pool import Pool
from .results import ApplyResult, AsyncResult, IMapIterator, MapResult

__all__ = [
    "Pool",
    "AsyncResult",
    "ApplyResult",
    "MapResult",
    "IMapIterator",
    "WorkerLostError",
    "BrokenPoolError",
]


def __getattr__(name: str) -> object:
    """``ThreadPool``: the stdlib's (``multiprocessing.pool.ThreadPool``; threads share memory
    already, so tensormp has nothing to add to it)."""
    if name == "ThreadPool":
        from multiprocessing.pool import ThreadPool

        return ThreadPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
