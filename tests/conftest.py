"""Shared fixtures: every test is checked for leaked fds, memfds, shm files and processes
(helpers that tests import are in ``helpers.py``)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import re
import sys

import psutil
import pytest

import tensormp
from helpers import wait_for
from tensormp.strategies import _client

# Preload in the fork server so forkserver children start fast: a child imports the test module
# of its target, and with it pytest, psutil and helpers.py (0.5 s a child on 2 busy cores);
# preloaded, only the test module's own code is left.
multiprocessing.set_forkserver_preload(["numpy", "tensormp", "pytest", "psutil", "helpers"])

# Child processes of tests print every ResourceWarning (a resource left to the garbage
# collector: an unclosed socket, file...), and a test whose captured output shows one fails
# (pytest_runtest_makereport below). "default", not "error": an error raised inside a finalizer
# is printed the same way, and anywhere else it would change what the child does. Set before
# the fork server starts, so its children see it too; fork children keep pytest's filters.
os.environ["PYTHONWARNINGS"] = ",".join(
    filter(None, [os.environ.get("PYTHONWARNINGS"), "default::ResourceWarning"])
)
# What the warning looks like when an object is collected unclosed (the stdlib's own deliberate
# "unclosed running multiprocessing pool" warning, which tests provoke, is not such a leak).
_LEFT_UNCLOSED = re.compile(r"ResourceWarning: unclosed (?!running multiprocessing pool).*")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Fail a passing test whose captured stderr (its child processes' included) shows a
    resource left unclosed."""
    report = yield
    if report.passed:
        own = f"Captured stderr {report.when}"  # a report also carries the earlier phases'
        leaks = [m.group(0) for title, text in report.sections if title == own
                 for m in _LEFT_UNCLOSED.finditer(text)]
        if leaks:
            report.outcome = "failed"
            report.longrepr = (
                f"a process of this test left resources to the garbage collector ({call.when}):"
                "\n  " + "\n  ".join(leaks)
            )
    return report


def _fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass
    return out


def _shm_names() -> set[str]:
    """tensormp files in /dev/shm that belong to this test program (other programs of the
    machine, such as a second test run, may create theirs meanwhile)."""
    from tensormp.strategies import names as naming
    from tensormp.strategies import program

    mine = program()
    try:
        names = [n for n in os.listdir("/dev/shm") if "tensormp" in n]
    except OSError:
        return set()
    out = set()
    for n in names:
        info = naming.parse_name(n)
        if info is None or info.program == mine:
            out.add(n)
    return out


def _children() -> set[int]:
    keep = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "forkserver" in cmd or "resource_tracker" in cmd:
            continue  # the stdlib's long-lived helpers, started once per session
        keep.add(p.pid)
    return keep


@pytest.fixture(scope="session", autouse=True)
def _stdlib_helpers() -> None:
    """Start the process-lifetime helpers once, so tests see them as baseline."""
    from multiprocessing import forkserver, resource_tracker

    resource_tracker.ensure_running()
    forkserver.ensure_running()
    # tensormp's per-process release channel (memory/release.py) lives as long as the process.
    from tensormp.memory import allocator, release

    allocator._allocator.address()
    release._client_socket(blocking=False)
    release._client_socket(blocking=True)
    from tensormp import _ledger  # its fd of /proc/self/fd (task writers open through it)

    _ledger._fd_dir()
    _freeze_imports()


_modules_frozen = 0  # len(sys.modules) when _freeze_imports last froze


def _freeze_imports() -> None:
    """Collection imports torch, Ray, joblib (and some tests import more): 300,000 objects that
    every gc.collect() of no_leaks would walk again, 0.1-0.3 s each, several times per test.
    They live for the session: once new modules were imported, collect, then move what is left
    out of the collector's sight (gc.freeze). What a test allocates is still collected."""
    global _modules_frozen
    if len(sys.modules) != _modules_frozen:
        gc.collect()
        gc.freeze()
        _modules_frozen = len(sys.modules)


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail the test if it leaves fds, tensormp memfds, /dev/shm files or child processes."""
    gc.collect()
    _freeze_imports()  # what an earlier test imported
    before_fds = _fds()
    before_shm = _shm_names()
    before_children = _children()
    yield
    tensormp.set_sharing_strategy("file_descriptor")  # a test may have chosen file_system
    gc.collect()
    tensormp.empty_cache()
    leaked_children = wait_for(lambda: not (_children() - before_children), 10.0)
    alive = _children() - before_children
    for pid in alive:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass
    assert leaked_children, f"child processes left running: {sorted(alive)}"

    def new_fds() -> dict[int, str]:
        gc.collect()
        tensormp.empty_cache()  # releases from other processes arrive asynchronously
        now = _fds()
        # /dev/shm/pym-*: the stdlib heap behind Value/Array, kept for the process's life; the
        # connection to the file_system cleanup daemon lives as long as the process too.
        daemon = _client.connection_fd()
        return {
            fd: t
            for fd, t in now.items()
            if before_fds.get(fd) != t and not t.startswith("/dev/shm/pym-") and fd != daemon
        }

    # Feeder threads close their pipes asynchronously: give them a moment.
    wait_for(lambda: not new_fds(), 5.0)
    leaked = new_fds()
    assert not leaked, f"fds leaked by the test: {leaked}"
    # Names a dead creator left are removed by the cleanup daemon within about a second; ask
    # it to collect now (the same collection, GC request) rather than wait for its next round.
    def shm_back() -> bool:
        if _shm_names() <= before_shm:
            return True
        _client.request("GC")
        return _shm_names() <= before_shm

    wait_for(shm_back, 5.0, 0.05)
    assert _shm_names() <= before_shm, f"/dev/shm files leaked: {_shm_names() - before_shm}"

