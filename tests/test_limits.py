"""Limits and failures with real parts: a 64 MiB /dev/shm, fd limits as a non-root user,
SIGKILL of the whole program."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import wait_for

SCRIPTS = Path(__file__).parent / "scripts"
IS_ROOT = os.geteuid() == 0


def _run(cmd, timeout=180, cwd=None):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


# A real non-root user. CAP_DAC_READ_SEARCH only lets it reach an interpreter installed under
# /root; it is not one of the capabilities (CAP_SYS_RESOURCE, CAP_SYS_ADMIN) that lift the
# kernel's per-user cap on fds in flight, which is what makes non-root different here.
_AS_NOBODY = [
    "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
    "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
]
_CAP_SYS_ADMIN, _CAP_SYS_RESOURCE = 1 << 21, 1 << 24


def _drop_privileges_cmd():
    if not IS_ROOT or not shutil.which("setpriv"):
        return None
    probe = subprocess.run(  # the start method's child processes must start as that user too
        [*_AS_NOBODY, sys.executable, "-c",
         "import tensormp as mp\n"
         "if __name__ == '__main__':\n"
         "    p = mp.get_context('spawn').Process(target=print); p.start(); p.join(20)\n"
         "    raise SystemExit(p.exitcode)"],
        capture_output=True, cwd="/", timeout=60)
    return _AS_NOBODY if probe.returncode == 0 else None


@pytest.mark.timeout(200)
@pytest.mark.parametrize("consumer_delay", ["0", "1.5"])
def test_fd_limit_256_as_non_root_user(consumer_delay):
    """5,000 arrays kept by the consumer at RLIMIT_NOFILE=256. With a late consumer the
    producer runs into the kernel's cap on fds in flight (ETOOMANYREFS after 256) and must
    wait for the consumer instead of failing."""
    prefix = _drop_privileges_cmd()
    if prefix is None:
        pytest.skip("needs root, setpriv, and an interpreter the nobody user can run")
    script = str(SCRIPTS / "send_many.py")
    res = _run([*prefix, sys.executable, script, "5000", "256", consumer_delay], cwd="/")
    assert res["uid"] == 65534
    assert not int(res["cap_eff"], 16) & (_CAP_SYS_ADMIN | _CAP_SYS_RESOURCE)
    assert res["ok"] and res["exitcode"] == 0
    assert res["child_fds"] < 64
    assert res["parent_fds_after"] <= res["parent_fds_before"] + 8


@pytest.mark.timeout(200)
def test_fd_limit_256_as_root():
    res = _run([sys.executable, str(SCRIPTS / "send_many.py"), "5000", "256"])
    assert res["ok"] and res["exitcode"] == 0 and res["child_fds"] < 64


@pytest.mark.timeout(200)
@pytest.mark.skipif(not IS_ROOT or not shutil.which("unshare"), reason="needs root and unshare")
def test_256_mib_array_with_64_mib_dev_shm():
    script = (
        "mount -t tmpfs -o size=64m tmpfs /dev/shm && "
        f"exec {sys.executable} {SCRIPTS / 'big_array.py'}"
    )
    res = _run(["unshare", "-m", "sh", "-c", script])
    assert res["shm_total"] == 64 << 20  # the test really ran with a 64 MiB /dev/shm
    assert res["nbytes"] == 256 << 20 and res["sum"] == (64 << 20) / 4096
    assert res["exitcode"] == 0


def _memfd_holders(seg_ids: set[str]) -> dict[int, set[str]]:
    """pid -> the given tensormp memfd segments that process still holds (fd or mapping)."""
    held: dict[int, set[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        names: set[str] = set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    names.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.split(None, 5)[-1].strip() for line in f)
        except OSError:
            continue
        found = {s for s in seg_ids if any(n.startswith("/memfd:tensormp-") and n.split()[0].endswith(f"-{s}") for n in names)}
        if found:
            held[int(pid)] = found
    return held


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_sigkill_whole_program_frees_everything(method):
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "kill_tree.py"), method],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        info = json.loads(proc.stdout.readline())
        segs = set(info["segments"])
        assert segs and _memfd_holders(segs)
        for pid in info["pids"]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(30)
        # Nothing outlives the program: no process (fork server included) holds a segment.
        assert wait_for(lambda: not _memfd_holders(segs), 10.0), _memfd_holders(segs)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
        time.sleep(0.1)


def _memory_cgroup(limit: int):
    """Create a memory cgroup (v1 or v2) limited to ``limit`` bytes; returns (dir, files)."""
    import uuid

    name = f"tensormp-test-{uuid.uuid4().hex[:8]}"
    if os.path.isdir("/sys/fs/cgroup/memory"):
        d = f"/sys/fs/cgroup/memory/{name}"
        limit_file = "memory.limit_in_bytes"
    elif os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        d = f"/sys/fs/cgroup/{name}"
        limit_file = "memory.max"
    else:
        return None
    try:
        os.mkdir(d)
        with open(f"{d}/{limit_file}", "w") as f:
            f.write(str(limit))
    except OSError:
        try:
            os.rmdir(d)
        except OSError:
            pass
        return None
    return d


@pytest.mark.timeout(60)
@pytest.mark.skipif(not IS_ROOT, reason="needs root to make a memory cgroup")
def test_allocation_past_the_cgroup_limit_is_an_oserror_not_an_oom_kill():
    d = _memory_cgroup(300 << 20)
    if d is None:
        pytest.skip("no writable memory cgroup controller here")
    code = (
        "import numpy as np, tensormp as mp\n"
        "try:\n"
        "    mp.empty(512 << 20, dtype=np.uint8)\n"
        "except OSError as e:\n"
        "    print('OSError', e.errno, e)\n"
    )
    try:
        proc = subprocess.run(
            ["sh", "-c", f'echo $$ > {d}/cgroup.procs && exec "$0" -c "$1"', sys.executable, code],
            capture_output=True, text=True, timeout=50,
        )
    finally:
        wait_for(lambda: _rmdir(d), 5.0)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OSError 12 ") and "available" in proc.stdout, proc.stdout


def _rmdir(d: str) -> bool:
    try:
        os.rmdir(d)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
