"""Children never outlive their parent: every kind of tensormp child (Process under each start
method, spawn() ranks, Pool workers, grandchildren, processes started from short-lived
threads) is gone within 5 s of a SIGKILL of its parent, and no shared-memory segment remains.
A normally exiting parent keeps the stdlib's semantics (non-daemon children are joined), and
a process started with ``die_with_parent=False`` outlives its parent as a stdlib child does.

Each test runs a driver script in its own session, reads the pids (and segment names) it
reports, kills it from outside and watches the machine's process table."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from helpers import START_METHODS, read_json_lines, wait_for
from tensormp import _parent_death

PRELUDE = r"""
import json, os, signal, sys, threading, time
import tensormp as mp

def emit(**kw):
    os.write(1, (json.dumps(kw) + "\n").encode())  # one write: processes share stdout

def segments():
    with open("/proc/self/maps") as f:
        return sorted({line.split("/memfd:")[1].split()[0]
                       for line in f if "/memfd:tensormp-" in line})

def busy(a, *rest):
    x = 0
    while True:  # holds the GIL, never sleeps
        x += 1
        a[0] = x
"""


def _driver(tmp_path, body, *args):
    path = tmp_path / "driver.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(path), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, cwd=tmp_path,
    )


def _read(proc, n=1, timeout=60.0):
    out = read_json_lines(proc, n, timeout)
    if len(out) < n:
        _kill_session(proc)
        pytest.fail(f"driver printed {out}, then nothing (rc={proc.poll()}):\n"
                    f"{proc.stderr.read()}")
    return out


def _kill_session(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _mapped_anywhere(names):
    """Pids of live processes that map any of the memfd segments ``names``."""
    holders = []
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:
            continue
        if any(name in text for name in names):
            holders.append(int(maps.split("/")[2]))
    return holders


def _kill_parent_and_check(proc, pids, segments=()):
    """SIGKILL the driver alone; every pid must be gone and no segment mapped within 5 s."""
    assert pids and all(not _gone(p) for p in pids), "children not running before the kill"
    proc.kill()
    proc.wait(10)
    t = time.monotonic()
    ok = wait_for(lambda: all(_gone(p) for p in pids), 5.0)
    alive = [p for p in pids if not _gone(p)]
    for pid in alive:  # do not leak them into other tests
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert ok, f"children {alive} outlived their parent by {time.monotonic() - t:.1f} s"
    if segments:
        assert wait_for(lambda: not _mapped_anywhere(segments), 5.0), (
            f"segments {segments} still mapped by {_mapped_anywhere(segments)}"
        )


# -- every kind of child, SIGKILL of the parent -------------------------------------------------


@pytest.mark.parametrize("method", START_METHODS)
def test_processes_die_with_their_parent(tmp_path, method):
    proc = _driver(tmp_path, """
        if __name__ == "__main__":
            ctx = mp.get_context(sys.argv[1])
            a = mp.zeros(1 << 17)  # 1 MiB: a segment of its own
            ps = [ctx.Process(target=busy, args=(a,), daemon=d) for d in (False, True)]
            for p in ps:
                p.start()
            while a[0] == 0:
                time.sleep(0.01)  # the children are busy and map the segment
            emit(pids=[p.pid for p in ps], segments=segments())
            time.sleep(120)
    """, method)
    (info,) = _read(proc)
    assert info["segments"]
    _kill_parent_and_check(proc, info["pids"], info["segments"])


def test_spawn_ranks_die_with_their_parent(tmp_path):
    proc = _driver(tmp_path, """
        def rank(i, a):
            emit(pid=os.getpid())
            busy(a)
        if __name__ == "__main__":
            a = mp.zeros(1 << 17)
            emit(segments=segments())
            mp.spawn(rank, args=(a,), nprocs=2)
    """)
    first, *ranks = _read(proc, 3)
    _kill_parent_and_check(proc, [r["pid"] for r in ranks], first["segments"])


def test_pool_workers_die_with_their_parent(tmp_path):
    proc = _driver(tmp_path, """
        def work(x):
            while True:
                x += 1
        if __name__ == "__main__":
            pool = mp.get_context("spawn").Pool(2)
            pool.map_async(work, range(2))
            time.sleep(0.5)
            emit(pids=[p.pid for p in pool._pool])
            time.sleep(120)
    """)
    (info,) = _read(proc)
    _kill_parent_and_check(proc, info["pids"])


@pytest.mark.parametrize("method", START_METHODS)
def test_grandchildren_die_too(tmp_path, method):
    proc = _driver(tmp_path, """
        def child(method, a):
            g = mp.get_context(method).Process(target=busy, args=(a,))
            g.start()
            emit(pids=[os.getpid(), g.pid])
            busy(a)
        if __name__ == "__main__":
            method = sys.argv[1]
            a = mp.zeros(1 << 17)
            p = mp.get_context(method).Process(target=child, args=(method, a))
            p.start()
            time.sleep(120)
    """, method)
    (info,) = _read(proc)
    _kill_parent_and_check(proc, info["pids"])


@pytest.mark.parametrize("method", START_METHODS)
def test_process_started_from_a_short_lived_thread(tmp_path, method):
    # PR_SET_PDEATHSIG would kill it when the thread exits: it must rely on the watchdog only.
    proc = _driver(tmp_path, """
        if __name__ == "__main__":
            ctx = mp.get_context(sys.argv[1])
            a = mp.zeros(4)
            started = []
            t = threading.Thread(target=lambda: started.append(ctx.Process(target=busy, args=(a,))))
            t.start(); t.join()
            t = threading.Thread(target=started[0].start)
            t.start(); t.join()
            time.sleep(1.0)  # long after the thread that forked it is gone
            emit(pid=started[0].pid, alive=started[0].is_alive())
            time.sleep(120)
    """, method)
    (info,) = _read(proc)
    assert info["alive"], "a process started from a thread died when the thread exited"
    _kill_parent_and_check(proc, [info["pid"]])


@pytest.mark.parametrize("method", ["spawn", "fork"])
@pytest.mark.parametrize("when", ["running", "starting"])
def test_pdeathsig_covers_a_sentinel_held_open_elsewhere(tmp_path, method, when):
    # The driver forks a plain process that inherits the write end of the child's parent pipe:
    # the watchdog cannot see the parent die; PR_SET_PDEATHSIG does, or, when the parent dies
    # before the child armed it ("starting"), the child's getppid() check.
    proc = _driver(tmp_path, """
        if __name__ == "__main__":
            p = mp.get_context(sys.argv[1]).Process(target=busy, args=(mp.zeros(4),))
            p.start()
            holder = os.fork()
            if holder == 0:
                time.sleep(60)
                os._exit(0)
            if sys.argv[2] == "running":
                time.sleep(0.5)
            emit(pid=p.pid, holder=holder)
            time.sleep(120)
    """, method, when)
    (info,) = _read(proc)
    try:
        _kill_parent_and_check(proc, [info["pid"]])
    finally:
        os.kill(info["holder"], signal.SIGKILL)


def test_parent_os_exit_takes_children_along(tmp_path):
    proc = _driver(tmp_path, """
        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=busy, args=(mp.zeros(4),))
            p.start()
            time.sleep(0.3)
            emit(pid=p.pid)
            os._exit(0)  # no join, no atexit: the children must not be orphaned
    """)
    (info,) = _read(proc)
    proc.wait(10)
    assert wait_for(lambda: _gone(info["pid"]), 5.0)


def test_normal_exit_keeps_stdlib_semantics(tmp_path):
    proc = _driver(tmp_path, """
        def write_later(path, delay):
            time.sleep(delay)
            with open(path, "w") as f:
                f.write("done")
        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            ctx.Process(target=write_later, args=("joined.txt", 1.0)).start()
            d = ctx.Process(target=write_later, args=("daemon.txt", 30.0), daemon=True)
            d.start()
            emit(daemon=d.pid)
            # the main module ends here: the stdlib joins the first, terminates the daemon
    """)
    t = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert time.monotonic() - t >= 1.0
    assert (tmp_path / "joined.txt").read_text() == "done"
    assert not (tmp_path / "daemon.txt").exists()
    assert wait_for(lambda: _gone(json.loads(out)["daemon"]), 5.0)


@pytest.mark.parametrize("method", START_METHODS)
def test_only_opted_out_children_survive_a_killed_parent(tmp_path, method):
    proc = _driver(tmp_path, """
        if __name__ == "__main__":
            ctx = mp.get_context(sys.argv[1])
            kept = ctx.Process(target=time.sleep, args=(60,), daemon=True, die_with_parent=False)
            default = ctx.Process(target=time.sleep, args=(60,), daemon=True)
            kept.start()
            default.start()
            emit(kept=kept.pid, default=default.pid)
            time.sleep(120)
    """, method)
    (info,) = _read(proc)
    try:
        _kill_parent_and_check(proc, [info["default"]])
        assert not _gone(info["kept"]), "the opted-out child died with its parent"
    finally:
        try:
            os.kill(info["kept"], signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_pdeathsig_only_from_the_main_thread():
    # PR_SET_PDEATHSIG is documented to fire when the forking *thread* exits, so start()
    # records where it runs. (The kernel here, 6.18, did not fire it at a thread's exit in a
    # direct test, so the driver test above cannot tell; this checks the recorded flag.)
    import threading

    import tensormp as mp

    p = mp.get_context("spawn").Process(target=print)
    _parent_death.before_start(p, "spawn")
    assert p._tensormp_main_thread is True
    t = threading.Thread(target=_parent_death.before_start, args=(p, "spawn"))
    t.start()
    t.join()
    assert p._tensormp_main_thread is False


def test_watchdog_catches_a_parent_that_died_before_it_was_armed():
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            os.close(w)
            time.sleep(0.3)  # meanwhile the "parent" closed its end: EOF already
            _parent_death._watch_parent(r)
            time.sleep(5)
        finally:
            os._exit(3)
    os.close(w)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


# -- slow: kill at random moments ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("method", START_METHODS)
def test_sigkill_during_start_leaves_no_orphan(tmp_path, method):
    body = """
        if __name__ == "__main__":
            ctx = mp.get_context(sys.argv[1])
            emit(sid=os.getsid(0))
            while True:
                p = ctx.Process(target=busy, args=(mp.zeros(4),), daemon=True)
                p.start()
    """
    for delay in (0.1, 0.3, 0.6, 1.0):
        proc = _driver(tmp_path, body, method)
        (info,) = _read(proc)
        time.sleep(delay)
        proc.kill()
        proc.wait(10)

        def session(info=info):
            found = []
            for p in psutil.process_iter():
                try:
                    if os.getsid(p.pid) == info["sid"] and not _gone(p.pid):
                        if "forkserver" not in " ".join(p.cmdline()):
                            found.append(p.pid)
                except (OSError, psutil.Error):
                    pass
            return found

        assert wait_for(lambda: not session(), 5.0), f"orphans after {delay} s: {session()}"
        _kill_session(proc)
