"""The ``tensormp`` command line (``doctor``, ``ls``, ``gc``) against real segments and processes.

Every test works in a private shm directory (``TENSORMP_SHM_DIR`` = a temporary directory), so
the machine's ``/dev/shm`` and its cleanup daemon are never touched: the daemon's socket is keyed
by the directory's device and inode. Orphans are made for real: a process creates a named
segment under the ``file_system`` strategy and is SIGKILLed. The cleanup daemon removes such an
orphan within about a second, so the tests that exercise ``gc``'s own rule stop that daemon
first (its pid comes from its ``STATE`` answer).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from helpers import wait_for
from tensormp import cli
from tensormp.strategies import _client, _daemon

pytestmark = pytest.mark.timeout(30)

# Creates one named segment under the file_system strategy, says where, and waits for its stdin
# to close (so it cannot outlive a crashed test run). With "queue" it also puts the array on a
# queue nobody reads: one handle in flight.
MAKER = r"""
import os, sys, tensormp
tensormp.set_sharing_strategy(sys.argv[1])
a = tensormp.zeros(3 << 20, dtype="uint8")
a[:] = 1
if len(sys.argv) > 2:
    q = tensormp.Queue()
    q.put(a)
print(os.getpid(), flush=True)
sys.stdin.read()
"""

# Maps a file with no tensormp at all, as any other process could.
MAPPER = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0)
os.close(fd)
print(os.getpid(), flush=True)
sys.stdin.read()
"""


def _env(shm) -> dict[str, str]:
    env = dict(os.environ, TENSORMP_SHM_DIR=str(shm))
    env.pop("PYTHONSTARTUP", None)
    return env


def _start(code: str, *args: str, shm) -> tuple[subprocess.Popen, int]:
    """A helper process; returns it and the pid it reports once ready."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=_env(shm),
    )
    line = proc.stdout.readline()
    assert line, f"helper exited early with status {proc.wait(10)}"
    return proc, int(line)


def _stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
    proc.wait(10)
    for stream in (proc.stdin, proc.stdout):
        stream.close()


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _kill_daemon(shm) -> None:
    state = _client.request("STATE", str(shm), start=False)
    if state is not None:
        os.kill(state["pid"], signal.SIGKILL)
        assert wait_for(lambda: _pid_gone(state["pid"]), 5.0)


@pytest.fixture
def shm(tmp_path, monkeypatch):
    """A private, empty shm directory, set as TENSORMP_SHM_DIR in this process; on teardown its
    cleanup daemon (started by a helper) is stopped and its runtime files removed."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setenv("TENSORMP_SHM_DIR", str(d))
    sock = _daemon.socket_path(str(d))
    yield d
    _kill_daemon(d)
    for suffix in (".sock", ".lock", ".log"):
        try:
            os.unlink(sock[: -len(".sock")] + suffix)
        except FileNotFoundError:
            pass


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """``tensormp *argv`` in this process: (exit status, stdout)."""
    capsys.readouterr()
    status = cli.main(list(argv))
    return status, capsys.readouterr().out


def ls_json(capsys) -> dict:
    status, out = run_cli(capsys, "ls", "--json")
    assert status == 0
    return json.loads(out)


def _files(shm) -> list[str]:
    return sorted(n for n in os.listdir(shm) if n.startswith("tensormp-"))


def test_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("doctor", "ls", "gc"):
        assert command in out


def test_doctor_healthy(shm, capsys):
    """An empty private shm directory: no PROBLEM, exit 0; every check says what it found."""
    status, out = run_cli(capsys, "doctor", "--json")
    report = json.loads(out)
    assert status == 0 == report["exit_status"] and report["problems"] == 0, report
    by_id = {c["check"]: c for c in report["checks"]}
    for check in ("shm_dir", "shm_size", "semaphores", "memfd", "populate", "nofile",
                  "max_map_count", "start_method", "torch", "daemon", "orphans", "segments"):
        assert check in by_id, f"missing check {check}: {sorted(by_id)}"
        assert by_id[check]["status"] in ("OK", "INFO", "WARN"), by_id[check]
    assert by_id["daemon"]["data"]["running"] is False
    assert by_id["nofile"]["data"]["soft"] > 0
    assert by_id["start_method"]["data"]["default"] in by_id["start_method"]["data"]["available"]
    status, out = run_cli(capsys, "doctor")
    assert status == 0
    assert out.splitlines()[0].startswith("tensormp ") and "0 problem(s)" in out
    assert all(line.split()[0] in ("OK", "INFO", "WARN", "fix:")
               for line in out.splitlines()[1:-2] if line.strip()), out


def test_a_missing_shm_directory_is_said_once_and_named_where_it_came_from(shm, tmp_path,
                                                                               capsys):
    """doctor labels a --shm-dir as such and says nothing further of a directory that is not
    there; ls and gc stop with status 2 instead of reporting an empty directory."""
    missing = str(tmp_path / "missing")
    status, out = run_cli(capsys, "doctor", "--json", "--shm-dir", missing)
    by_id = {c["check"]: c for c in json.loads(out)["checks"]}
    assert status == 1 and by_id["shm_dir"]["status"] == "PROBLEM"
    assert f"{missing} (--shm-dir) does not exist" in by_id["shm_dir"]["message"]
    assert by_id["daemon"]["status"] == "INFO" and "no such directory" in by_id["daemon"]["message"]
    assert "orphans" not in by_id and by_id["segments"]["status"] == "INFO"
    status, out = run_cli(capsys, "doctor", "--json")  # the fixture's TENSORMP_SHM_DIR
    shm_check = next(c for c in json.loads(out)["checks"] if c["check"] == "shm_dir")
    assert "(TENSORMP_SHM_DIR)" in shm_check["message"]
    for command in ("ls", "gc"):
        assert cli.main([command, "--shm-dir", missing]) == 2
        err = capsys.readouterr().err
        assert f"tensormp {command}: shm directory {missing} (--shm-dir) does not exist" in err


def test_ls_shows_memfd_segments_of_live_processes(shm, capsys):
    """A default-strategy process holds a memfd: ls names it, its size and its holder."""
    proc, pid = _start(MAKER, "file_descriptor", shm=shm)
    try:
        rows = [r for r in ls_json(capsys)["segments"] if r["creator_pid"] == pid]
        assert rows, "the helper's memfd is not listed"
        assert all(r["kind"] == "memfd" and r["status"] == "live" for r in rows)
        assert all(r["creator_alive"] and pid in r["holders"] for r in rows)
        assert sum(r["size"] for r in rows) >= 3 << 20
        assert all(r["name"].startswith(f"tensormp-{pid}-") and r["inode"] for r in rows)
        status, out = run_cli(capsys, "ls")
        assert status == 0
        line = next(li for li in out.splitlines() if f"tensormp-{pid}-" in li)
        assert "memfd" in line and "live" in line and str(pid) in line
    finally:
        _stop(proc)
    assert not [r for r in ls_json(capsys)["segments"] if r["creator_pid"] == pid]
    assert _files(shm) == []


def test_gc_removes_orphans_only(shm, capsys):
    """Without a daemon: a file mapped by a live process survives its creator's SIGKILL and gc;
    once its last holder is gone it is an orphan: ls and doctor report it, gc --dry-run keeps
    it, gc removes it and says so."""
    maker, maker_pid = _start(MAKER, "file_system", shm=shm)
    try:
        (name,) = _files(shm)
        mapper, mapper_pid = _start(MAPPER, str(shm / name), shm=shm)
    except BaseException:
        _stop(maker)
        raise
    try:
        _kill_daemon(shm)  # otherwise it would collect the orphan within a second
        _stop(maker)
        (row,) = [r for r in ls_json(capsys)["segments"] if r["kind"] == "file"]
        assert row["name"] == name and row["creator_pid"] == maker_pid
        assert not row["creator_alive"] and row["holders"] == [mapper_pid]
        assert row["status"] == "live" and row["in_flight"] is None
        status, out = run_cli(capsys, "gc")
        assert status == 0 and "no orphaned segments" in out
        assert _files(shm) == [name]
        assert run_cli(capsys, "doctor")[0] == 0
    finally:
        _stop(mapper)
    size = os.stat(shm / name).st_size
    (row,) = [r for r in ls_json(capsys)["segments"] if r["kind"] == "file"]
    assert row["status"] == "orphan" and row["holders"] == [] and row["size"] == size
    status, out = run_cli(capsys, "ls")
    assert "orphan" in out and "tensormp gc" in out

    status, out = run_cli(capsys, "doctor", "--json")
    report = json.loads(out)
    orphans = next(c for c in report["checks"] if c["check"] == "orphans")
    assert status == 1 and orphans["status"] == "PROBLEM" and orphans["data"]["names"] == [name]
    status, out = run_cli(capsys, "doctor")
    assert status == 1 and "PROBLEM" in out and "tensormp gc" in out

    status, out = run_cli(capsys, "gc", "--dry-run")
    assert status == 0 and f"would remove {shm / name}" in out and _files(shm) == [name]
    status, out = run_cli(capsys, "gc")
    assert status == 0 and f"removed {shm / name}" in out and "freed 1 orphaned" in out
    assert _files(shm) == []
    status, out = run_cli(capsys, "gc", "--json")
    assert json.loads(out)["count"] == 0
    assert run_cli(capsys, "doctor")[0] == 0


def test_gc_rule_on_names_alone(shm, capsys):
    """Files whose names decide: a dead creator and program (pid + start time that never ran)
    is collected; a live creator's file, another uid's file, and malformed names are kept."""
    me = os.getpid()
    with open(f"/proc/{me}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    uid = os.getuid()
    hexid = "ab" * 16
    dead = f"tensormp-{uid}-{me}-{start + 2}-{me}-{start + 2}-{hexid}"  # pid reused: not us
    alive = f"tensormp-{uid}-{me}-{start}-{me}-{start}-{hexid}"
    other_uid = f"tensormp-{uid + 1}-{me}-{start + 1}-{me}-{start + 1}-{hexid}"
    same_program = f"tensormp-{uid}-999999-1-{me}-{start + 1}-{'cd' * 16}"  # program alive:
    live_sibling = f"tensormp-{uid}-{me}-{start}-{me}-{start + 1}-{'ef' * 16}"  # a live creator
    keep = [alive, other_uid, same_program, live_sibling, "tensormp-junk", f"{dead}-x"]
    for name in [dead, *keep]:
        with open(shm / name, "wb") as f:
            f.write(b"x" * 100)
    status, out = run_cli(capsys, "gc", "--json")
    result = json.loads(out)
    assert status == 0 and result["by"] == "cli"
    assert result["freed"] == [{"name": dead, "size": 100}] and result["bytes"] == 100
    assert sorted(os.listdir(shm)) == sorted(keep)
    rows = {r["name"]: r for r in ls_json(capsys)["segments"] if r["kind"] == "file"}
    assert set(rows) == {alive, same_program, live_sibling}
    assert rows[alive]["reason"] == "creator alive"
    assert "program" in rows[same_program]["reason"]


def test_gc_asks_the_daemon(shm, capsys):
    """With a daemon serving the directory: ls shows its in-flight count, gc asks it and a
    live program's segment stays; after the program is killed the daemon removes it."""
    maker, maker_pid = _start(MAKER, "file_system", "queue", shm=shm)
    try:
        (name,) = _files(shm)
        listing = ls_json(capsys)
        assert listing["daemon"] is not None and listing["daemon"]["pid"] > 0
        (row,) = [r for r in listing["segments"] if r["kind"] == "file"]
        assert row["in_flight"] == 1 and row["status"] == "live" and row["creator_alive"]
        status, out = run_cli(capsys, "gc", "--json")
        result = json.loads(out)
        assert status == 0 and result["by"] == "daemon" and result["count"] == 0
        status, out = run_cli(capsys, "gc")
        assert "by the cleanup daemon" in out
        assert _files(shm) == [name]
    finally:
        _stop(maker)
    assert wait_for(lambda: not _files(shm), 10.0), "the daemon did not collect the orphan"


def test_module_and_console_script(shm):
    """``python -m tensormp`` and the ``tensormp`` console script run the same CLI."""
    out = subprocess.run(
        [sys.executable, "-m", "tensormp", "ls", "--json"], env=_env(shm), capture_output=True,
        timeout=30, text=True,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["shm_dir"] == str(shm)
    script = os.path.join(os.path.dirname(sys.executable), "tensormp")
    if not os.path.exists(script):
        script = shutil.which("tensormp")
    if script is None:
        pytest.skip("the tensormp console script is not installed (pip install -e .)")
    out = subprocess.run([script, "doctor"], env=_env(shm), capture_output=True, timeout=30,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 problem(s)" in out.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_doctor_warns_on_docker_sized_shm(tmp_path):
    """A 64 MiB tmpfs (Docker's default /dev/shm), mounted in a private mount namespace."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    small = tmp_path / "small"
    small.mkdir()
    script = (
        f"mount -t tmpfs -o size=64m tmpfs {small} && "
        f"TENSORMP_SHM_DIR={small} {sys.executable} -m tensormp doctor --json"
    )
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, timeout=30,
                         text=True, env=_env(small))
    if out.returncode not in (0, 1) or not out.stdout:
        pytest.skip(f"cannot mount a tmpfs in a new mount namespace here: {out.stderr.strip()}")
    report = json.loads(out.stdout)
    size = next(c for c in report["checks"] if c["check"] == "shm_size")
    assert size["status"] == "WARN" and size["data"]["total_bytes"] == 64 << 20
    assert "--shm-size=8g" in size["fix"] and "file_descriptor" in size["fix"]
    assert report["exit_status"] == 0 == out.returncode  # a warning, not a problem
    assert not os.listdir(small)  # the mount was private to the namespace
