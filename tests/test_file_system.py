"""The file_system strategy: named segments, the cleanup daemon, kill -9 of every party.

The kill tests run whole programs (``scripts/fs_program.py``) in a private shm directory
(``TENSORMP_SHM_DIR``), so they have a daemon of their own and cannot disturb other tests.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import tensormp as mp
from helpers import wait_for
from tensormp.errors import HandleError, SharedMemoryError, TensormpError
from tensormp.memory.allocator import find_block
from tensormp.strategies import _client, _daemon, program
from tensormp.strategies import names as naming

pytestmark = pytest.mark.timeout(90)
SCRIPTS = Path(__file__).parent / "scripts"
IS_ROOT = os.geteuid() == 0


def name_of(a: np.ndarray) -> str:
    return find_block(a)[0].segment.name


@pytest.fixture
def file_system():
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy("file_descriptor")


@pytest.fixture
def shm_dir():
    """A private shm directory (a tmpfs directory, so a daemon of its own serves it)."""
    path = Path("/dev/shm") / f"fs-test-{uuid.uuid4().hex[:12]}"
    path.mkdir(mode=0o700)
    yield path
    leftover = wait_for(lambda: not os.listdir(path), 10.0) or os.listdir(path)
    shutil.rmtree(path, ignore_errors=True)
    assert leftover is True, f"files left in the private shm directory: {leftover}"


def _env(shm_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TENSORMP_SHM_DIR"] = str(shm_dir)
    return env


def _names(shm_dir: Path) -> set[str]:
    return {n for n in os.listdir(shm_dir) if n.startswith("tensormp-")}


# -- children -----------------------------------------------------------------------------------
def _report_strategy_and_make(q, out):
    a = q.get()
    a += 1
    b = mp.full(300_000, 7.0)  # 2.3 MiB: a segment of its own, made in the child
    out.put((mp.get_sharing_strategy(), b))


def _switch_and_echo(q, out):
    mp.set_sharing_strategy("file_system")
    a = q.get()
    out.put((a.sum(), mp.full(10, 5.0)))


def _keep(q, ready):
    kept = q.get()
    ready.put(float(kept.sum()))
    time.sleep(60)


# -- tests ----------------------------------------------------------------------------------------
def test_segment_files_are_private_named_and_hold_no_fd(file_system):
    before = mp.memory_stats()["fds"]
    arrays = [mp.zeros(300_000) for _ in range(3)]  # large: one file each
    small = mp.zeros(10)
    for a in [*arrays, small]:
        name = name_of(a)
        info = naming.parse_name(name)
        assert info is not None and info.uid == os.getuid()
        assert info.creator[0] == os.getpid() and info.program == program()
        st = os.stat(os.path.join(naming.shm_dir(), name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_blocks * 512 >= st.st_size
    assert len({name_of(a) for a in arrays}) == 3
    assert mp.memory_stats()["fds"] == before  # mapped, fd closed
    names = [name_of(a) for a in arrays]
    del arrays, a
    mp.empty_cache()
    assert not any(os.path.exists(os.path.join(naming.shm_dir(), n)) for n in names)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_strategy_applies_in_children(file_system, method):
    ctx = mp.get_context(method)
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_report_strategy_and_make, args=(q, out))
    p.start()
    a = mp.zeros(1000)
    q.put(a)
    strategy, b = out.get(timeout=60)
    p.join(30)
    assert strategy == "file_system"  # torch drops it under spawn and forkserver
    assert (a == 1).all() and (b == 7).all()
    assert naming.parse_name(name_of(b)).creator[0] == p.pid


def test_each_strategy_rebuilds_the_other():
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_switch_and_echo, args=(q, out))
    p.start()
    a = mp.full(1000, 2.0)  # a memfd segment, received by a child that uses file_system
    assert name_of(a) == ""
    q.put(a)
    total, b = out.get(timeout=60)  # a named segment, received under file_descriptor
    p.join(30)
    assert total == 2000.0 and (b == 5).all() and name_of(b)


def test_kill_consumer_then_creator_exit(file_system):
    """The consumer holds a segment and is SIGKILLed after its creator exited: gone."""
    ctx = mp.get_context("spawn")
    q, ready = ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(target=_keep, args=(q, ready))
    consumer.start()
    producer = ctx.Process(target=_produce_one, args=(q,))
    producer.start()
    producer.join(60)
    assert ready.get(timeout=60) == 300_000 * 3.0
    names = _names(Path(naming.shm_dir())) & _created_by(producer.pid)
    assert names  # the producer is gone, the consumer maps its segment: still there
    time.sleep(1.5)
    assert names <= _names(Path(naming.shm_dir()))
    os.kill(consumer.pid, signal.SIGKILL)
    consumer.join(30)
    assert wait_for(lambda: not (names & _names(Path(naming.shm_dir()))), 10.0)


def _produce_one(q):
    q.put(mp.full(300_000, 3.0))
    q.close()
    q.join_thread()


def _created_by(pid: int) -> set[str]:
    return {n for n in _names(Path(naming.shm_dir())) if naming.parse_name(n).creator[0] == pid}


def _start_program(shm_dir: Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "fs_program.py")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env(shm_dir),
        start_new_session=True,
    )
    line = proc.stdout.readline()
    assert line, f"fs_program.py failed (exit {proc.wait(30)})"
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    proc.stdin.close()
    proc.stdout.close()


def test_kill_producer(shm_dir):
    proc, info = _start_program(shm_dir)
    try:
        names = info["names"]
        assert set(names.values()) <= _names(shm_dir)
        os.kill(info["pids"]["producer"], signal.SIGKILL)
        # Gone: nobody maps them and no message carries them.
        gone = {names["dropped"], names["private"]}
        assert wait_for(lambda: not (gone & _names(shm_dir)), 10.0), _names(shm_dir)
        # Kept: the consumer maps one; a handle to the other waits in a queue.
        assert {names["held"], names["queued"]} <= _names(shm_dir)
        proc.stdin.write("read\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"held_ok": True, "queued_ok": True}
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert json.loads(proc.stdout.readline()) == {"consumer_exit": 0}
        assert proc.wait(30) == 0
        assert wait_for(lambda: not _names(shm_dir), 10.0), _names(shm_dir)
    finally:
        _stop(proc)


def test_kill_whole_program(shm_dir):
    proc, info = _start_program(shm_dir)
    try:
        assert len(_names(shm_dir)) == 4
        for pid in info["pids"].values():
            os.kill(pid, signal.SIGKILL)
        # The queued handle can no longer be read by anyone: everything goes.
        assert wait_for(lambda: not _names(shm_dir), 10.0), _names(shm_dir)
    finally:
        _stop(proc)


def test_kill_daemon_then_program_next_process_reclaims(shm_dir):
    proc, info = _start_program(shm_dir)
    try:
        state = _client.request("STATE", str(shm_dir))
        assert state is not None and state["in_flight"]  # the queued handle is counted
        os.kill(state["pid"], signal.SIGKILL)
        for pid in info["pids"].values():
            os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        time.sleep(1.5)
        assert len(_names(shm_dir)) == 4  # no daemon: nobody removed them
        # The next tensormp process that uses the strategy there starts a daemon, which finds
        # the orphans (their creator and their whole program are dead) at its first pass.
        subprocess.run(
            [sys.executable, "-c",
             "import tensormp as mp; mp.set_sharing_strategy('file_system'); mp.zeros(10)"],
            env=_env(shm_dir), check=True, timeout=60,
        )
        assert wait_for(lambda: not _names(shm_dir), 10.0), _names(shm_dir)
    finally:
        _stop(proc)


def test_daemon_checks_protocol_version(monkeypatch, shm_dir):
    monkeypatch.setenv("TENSORMP_SHM_DIR", str(shm_dir))
    state = _client.request("STATE", start=True)
    assert state["protocol"] == _daemon.PROTOCOL and state["shm_dir"] == str(shm_dir)
    path = _daemon.socket_path()
    rundir = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(rundir).st_mode) == 0o700
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.send(b"HELLO 999 1 1\n")
        assert sock.recv(256).split()[:3] == [b"VERSION", str(_daemon.PROTOCOL).encode(),
                                              str(state["pid"]).encode()]
        assert sock.recv(256) == b""  # and it hangs up
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(10)
        sock.connect(path)
        sock.send(f"HELLO {_daemon.PROTOCOL} 1 1\n".encode())
        assert sock.recv(256).startswith(b"OK ")
        sock.send(b"S tensormp-x notanumber\n")  # malformed: this client is dropped...
        assert sock.recv(256) == b""
    assert _client.request("STATE")["pid"] == state["pid"]  # ...the daemon serves on
    monkeypatch.setattr(_daemon, "PROTOCOL", _daemon.PROTOCOL + 1)
    with pytest.raises(TensormpError, match=rf"pid {state['pid']}.*kill {state['pid']}"):
        _client.request("STATE")


def test_daemon_refuses_other_users(shm_dir):
    if not IS_ROOT or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to act as another user")
    path = _client.request("STATE", str(shm_dir), start=True) and _daemon.socket_path(str(shm_dir))
    probe = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "try:\n"
        f"    s.connect({path!r})\n"
        "except PermissionError:\n"
        "    print('denied'); sys.exit(0)\n"
        "s.send(b'HELLO 1 1 1\\n'); print('answer', s.recv(64))\n"
    )
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
         "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
         sys.executable, "-c", probe],
        capture_output=True, text=True, timeout=60, cwd="/",
    )
    # The 0700 directory stops it; were it reachable, SO_PEERCRED would (empty answer).
    assert out.stdout.strip() in ("denied", "answer b''"), out


@pytest.mark.skipif(not IS_ROOT or not shutil.which("unshare"), reason="needs root and unshare")
@pytest.mark.timeout(120)
def test_256_mib_with_a_64_mib_shm_dir_raises_in_the_caller():
    script = (
        "d=$(mktemp -d) && mount -t tmpfs -o size=64m tmpfs \"$d\" && "
        f"TENSORMP_SHM_DIR=\"$d\" {sys.executable} {SCRIPTS / 'fs_small_shm.py'}; "
        "s=$?; for i in $(seq 50); do [ -z \"$(ls -A \"$d\")\" ] && break; sleep 0.2; done; "
        "ls -A \"$d\" | grep -c . ; umount -l \"$d\"; rmdir \"$d\"; exit $s"
    )
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True,
                          text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    res = json.loads(lines[-2])
    assert res["shm_total"] == 64 << 20
    assert res["errno"] == "ENOSPC" and "64.0 MiB" in res["message"]
    assert "TENSORMP_SHM_DIR" in res["message"] and "file_descriptor" in res["message"]
    assert res["put_raised"] == "SharedMemoryError" and res["small_ok"] is True
    # The segment sent to the consumer was removed by the daemon (within 10 s): no file left.
    assert lines[-1] == "0"


@pytest.mark.timeout(180)
def test_5000_live_arrays_at_256_fds(shm_dir):
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fs_many.py")],
        env=_env(shm_dir), capture_output=True, text=True, timeout=170,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["limit"] == 256 and res["kept"] == 5000 and res["ok"]
    assert res["segments_consumer"] > 256 and res["segments_producer"] > 256
    assert res["fds_consumer_after"] - res["fds_consumer_before"] <= 3


def _receive_and_report(q, out):
    try:
        a = q.get()
        out.put(float(a[0]))
    except Exception as e:
        out.put(f"{type(e).__name__}: {e}")


def test_a_removed_file_still_arrives_and_cannot_be_sent_again(file_system):
    """A message carries a token of the file (an fd), not only its name: a file removed by
    hand after the put is still received. A put of an array whose file is gone is a clear error
    in the caller, and nothing stays pinned."""
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_receive_and_report, args=(q, out))
    p.start()
    a = mp.full(300_000, 7.0)
    q.put(a)
    os.unlink(os.path.join(naming.shm_dir(), name_of(a)))  # as if removed by hand
    assert out.get(timeout=60) == 7.0
    p.join(30)
    assert p.exitcode == 0
    b = mp.zeros(300_000)
    os.unlink(os.path.join(naming.shm_dir(), name_of(b)))
    with pytest.raises(HandleError, match="no longer exists.*a.copy()"):
        q.put(b)
    del a, b
    assert wait_for(lambda: mp.memory_stats()["remote_held_bytes"] == 0, 10.0)


def _echo_queue(q, out, n):
    for _ in range(n):
        out.send(q.get())
    out.close()


@pytest.mark.timeout(90)
def test_channels_do_not_wait_for_the_cleanup_daemon(monkeypatch, shm_dir, file_system):
    """A daemon starved of CPU (here: stopped) must not slow messages down: they carry tokens
    the kernel tracks, and tell the daemon nothing. (Before tokens, every put wrote a record to
    the daemon synchronously: once its socket was full, each put waited up to 10 s.)"""
    monkeypatch.setenv("TENSORMP_SHM_DIR", str(shm_dir))
    ctx = mp.get_context("fork")
    n = 1000
    q = ctx.Queue()
    r, w = ctx.Pipe(duplex=False)
    a = mp.full(512, 3.0)  # its segment is made (and the daemon started) before the stop
    p = ctx.Process(target=_echo_queue, args=(q, w, n))
    p.start()
    w.close()
    daemon = _client.request("STATE", str(shm_dir))["pid"]
    os.kill(daemon, signal.SIGSTOP)
    try:
        start = time.monotonic()
        for _ in range(n):
            q.put(a)
            assert r.recv()[0] == 3.0
        elapsed = time.monotonic() - start
    finally:
        os.kill(daemon, signal.SIGCONT)
    p.join(30)
    r.close()
    assert p.exitcode == 0
    assert elapsed < 20, f"{n} round trips took {elapsed:.1f} s with the daemon stopped"
    del a
    mp.empty_cache()  # our arena's file goes before the private directory is checked


def test_out_of_space_error_names_the_fix(monkeypatch, shm_dir, file_system):
    monkeypatch.setenv("TENSORMP_SHM_DIR", str(shm_dir))
    free = shutil.disk_usage(shm_dir).free
    with pytest.raises(SharedMemoryError) as info:
        mp.empty(free + (1 << 30), dtype=np.uint8)
    assert info.value.errno in (28, 12)  # ENOSPC, or ENOMEM when memory is the limit
    assert not _names(shm_dir)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_normal_exit_is_silent_and_leaves_no_file(shm_dir, strategy):
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "exit_clean.py"), strategy],
        env=_env(shm_dir), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # nothing printed by children or by the parent at exit
    res = json.loads(proc.stdout)
    assert res == {"first": 300_000.0, "second": 300_045.0, "exitcodes": [0, 0], "a00": 99.0}
    # Every handle came back released before exit: the creator removed its own files.
    assert not _names(shm_dir)


def test_missing_shm_dir_is_a_clear_error(monkeypatch, file_system, tmp_path):
    monkeypatch.setenv("TENSORMP_SHM_DIR", str(tmp_path / "nope"))
    with pytest.raises(SharedMemoryError, match="does not exist or is not a directory"):
        mp.zeros(10)


def test_fork_child_before_any_allocation_belongs_to_the_program(shm_dir):
    """Regression: a child forked before the parent had made any shared memory took itself for
    the program root (the fork hook that passes the program id on was registered only once the
    file_system module was imported), so its unread files were removed when it exited."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "fs_fork_first.py")],
        env=_env(shm_dir), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"values": [5.0, 7.0, 9.0], "errors": [], "exitcode": 0}
