"""Runnable examples (``pip install 'tensormp[examples]'`` for scikit-learn and matplotlib).

* :mod:`tensormp.examples.hogwild`: N processes train one MLP on scikit-learn's digits by
  updating shared parameters in place without locks (``python -m tensormp.examples.hogwild``);
  the numpy version is ``hogwild_numpy.py``, the torch one ``hogwild_torch.py``, and both run
  the epoch loop of ``hogwild_loop.py``.
* :mod:`tensormp.examples.pipeline`: loader processes fill a fixed ring of shared batch buffers
  and pass only handles to the trainer, against the stdlib queue pickling every batch
  (``python -m tensormp.examples.pipeline``).
* :mod:`tensormp.examples.demo`: both, a summary and a PNG (``make demo``).

No example is imported here, so a worker process loads only the one it runs. The two helpers
below are shared by the examples.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["stop_processes", "check_processes", "interrupted"]


def stop_processes(procs: Any, timeout: float = 0.5) -> None:
    """Stop the processes of a spawn ``ProcessContext`` that still run: SIGTERM, then SIGKILL.

    Returns within about ``2 * timeout`` seconds; every process is reaped.
    """
    alive = [p for p in procs.processes if p.exitcode is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + timeout
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.exitcode is None:
            p.kill()
            p.join(timeout)


def check_processes(procs: Any, what: str) -> None:
    """Raise if a worker of ``procs`` failed, or if all of them exited while ``what`` is awaited.

    Raises:
        tensormp.ProcessRaisedException: a worker raised (with its traceback).
        tensormp.ProcessExitedException: a worker died from a signal or exit code.
        RuntimeError: every worker exited normally but the caller still waits for ``what``.
    """
    if procs.join(timeout=0):
        raise RuntimeError(f"the workers exited before sending {what}")


def interrupted(exc: BaseException) -> bool:
    """True for a Ctrl-C: a ``KeyboardInterrupt``, or a worker that spawn saw die by SIGINT.

    A Ctrl-C at a terminal reaches the workers too; spawn may see one of them die by SIGINT
    before this process handles its own ``KeyboardInterrupt``.
    """
    return isinstance(exc, KeyboardInterrupt) or getattr(exc, "signal_name", None) == "SIGINT"
