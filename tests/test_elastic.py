"""spawn() beyond one machine (issue #13 items 6, 7): real torchrun, real elastic launchers, real
gloo, two "nodes" on 127.0.0.1 inside one private network namespace (root: ``unshare -n``).

Each multi-node case costs 10-25 s on 2 cores (every launcher and worker imports torch, the c10d
rendezvous forms): the default suite has three of them, the rest are marked slow.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from itertools import count
from pathlib import Path

import psutil
import pytest

import tensormp as mp

pytest.importorskip("torch.distributed")

SCRIPTS = Path(__file__).parent / "scripts"
NODE = SCRIPTS / "elastic_node.py"
TORCHRUN_SCRIPT = SCRIPTS / "torchrun_spawn.py"
_ports = count(29500 + os.getpid() % 500)  # every case in its own namespace: any port is free


def _netns_problem() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the nodes run in a private network namespace (unshare -n)"
    for tool in ("unshare", "ip"):
        if shutil.which(tool) is None:
            return f"needs {tool!r} (util-linux, iproute2) for a private network namespace"
    try:
        r = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot make a private network namespace: {e}"
    if r.returncode != 0:
        return f"cannot make a private network namespace: {r.stderr.decode().strip()}"
    return None


_PROBLEM = _netns_problem()
needs_netns = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def run_nodes(tmp_path: Path, commands: list[list[str]], timeout: float) -> list[list[dict]]:
    """Run each command as one node, all in one fresh network namespace where only loopback
    exists; returns each node's JSON lines. Kills the whole session at ``timeout``."""
    lines = ["ip link set lo up"]
    for i, cmd in enumerate(commands):
        lines.append(f"{shlex.join(cmd)} >{tmp_path}/node{i}.out 2>{tmp_path}/node{i}.err &")
    lines.append("wait")
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", "\n".join(lines)],
                            start_new_session=True)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the nodes did not finish within {timeout} s: {_stderr(tmp_path, commands)}")
    out = []
    for i in range(len(commands)):
        text = (tmp_path / f"node{i}.out").read_text()
        out.append([json.loads(line) for line in text.splitlines() if line.startswith("{")])
    return out


def _stderr(tmp_path: Path, commands: list) -> str:
    return "\n".join(
        f"--- node {i} stderr (tail):\n" + (tmp_path / f"node{i}.err").read_text()[-3000:]
        for i in range(len(commands))
    )


def elastic_nodes(tmp_path: Path, mode: str, nprocs: int, timeout: float = 90) -> list[list[dict]]:
    port = next(_ports)
    cmd = [sys.executable, str(NODE), f"127.0.0.1:{port}", f"job-{mode}", mode, str(nprocs),
           str(tmp_path / "flag")]
    return run_nodes(tmp_path, [cmd, cmd], timeout)


def torchrun_nodes(tmp_path: Path, mode: str, timeout: float = 90) -> list[list[dict]]:
    port = next(_ports)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=t-{mode}", "--monitor-interval=0.1",
           str(TORCHRUN_SCRIPT), mode, "1"]
    return run_nodes(tmp_path, [cmd, cmd], timeout)


def outcome(lines: list[dict], tmp_path: Path) -> dict:
    final = [d for d in lines if "ok" in d]
    assert len(final) == 1, f"no outcome from a node: {lines}\n{_stderr(tmp_path, [0, 1])}"
    return final[0]


# -- spawn(nnodes=2): two launchers ---------------------------------------------------------------


@needs_netns
@pytest.mark.parametrize("nprocs", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_two_nodes_gloo_all_reduce(tmp_path, nprocs):
    nodes = elastic_nodes(tmp_path, "allreduce", nprocs=nprocs)
    results = [outcome(lines, tmp_path) for lines in nodes]
    assert all(r["ok"] for r in results), results
    values = [v for r in results for v in r["values"]]
    world = 2 * nprocs
    # rank r contributes (r + 1) * 2.0: every rank holds the job's sum
    assert [v["sum"] for v in values] == [float(world * (world + 1))] * world
    assert sorted(v["RANK"] for v in values) == [str(r) for r in range(world)]
    for r in results:  # fn(local_index, ...), in local order; torch's env for the whole job
        assert [v["local_index"] for v in r["values"]] == list(range(nprocs))
        assert [v["LOCAL_RANK"] for v in r["values"]] == [str(i) for i in range(nprocs)]
        assert {v["WORLD_SIZE"] for v in r["values"]} == {str(world)}
        assert all(v["MASTER_ADDR"] for v in r["values"])
    assert all(_gone(v["pid"]) for v in values)


@needs_netns
def test_a_rank_that_raises_fails_every_node_in_bounded_time(tmp_path):
    # ranks 0, 1 on one node, 2, 3 on the other; 1 raises after 2 returned, 0 and 3 sleep 120 s
    nodes = elastic_nodes(tmp_path, "raise", nprocs=2)
    results = [outcome(lines, tmp_path) for lines in nodes]
    raised_at = [d["raised_at"] for lines in nodes for d in lines if "raised_at" in d]
    workers = [d["worker"] for lines in nodes for d in lines if "worker" in d]
    assert len(raised_at) == 1 and len(workers) == 4
    for r in results:  # the same exception on both nodes: rank 1's traceback, rank, node
        assert r["ok"] is False and r["type"] == "ProcessRaisedException", r
        assert r["error_index"] == 1 and r["exc_type"] == "ValueError"
        assert "ValueError: bad batch on global rank 1 (local index 1)" in r["message"]
        assert "in raise_on_rank_1" in r["message"] and "(global rank 1;" in r["message"]
        # the sleeping ranks were stopped, within seconds of rank 1's error
        assert r["at"] - raised_at[0] < 10, (r["at"] - raised_at[0], r)
    assert results[0]["node"] == results[1]["node"]
    assert all(_gone(pid) for pid in workers), "a worker outlived its node"


def test_bad_arguments_are_refused_before_anything_starts():
    def fn(i):
        pass

    with pytest.raises(ValueError, match="needs rdzv_endpoint='host:port'"):
        mp.spawn(fn, nprocs=1, nnodes=2)
    with pytest.raises(ValueError, match="rdzv_endpoint must be 'host:port'"):
        mp.spawn(fn, nprocs=1, nnodes=2, rdzv_endpoint="no-port")
    with pytest.raises(ValueError, match="nnodes must be a positive int"):
        mp.spawn(fn, nprocs=1, nnodes=0, rdzv_endpoint="127.0.0.1:1")
    with pytest.raises(ValueError, match="join=False"):
        mp.spawn(fn, nprocs=1, join=False, nnodes=2, rdzv_endpoint="127.0.0.1:1")
    with pytest.raises(ValueError, match="max_restarts"):
        mp.spawn(fn, nprocs=1, nnodes=2, rdzv_endpoint="127.0.0.1:1", max_restarts=-1)


def test_without_torch_the_error_names_the_extra():
    code = (
        "import sys; sys.modules['torch'] = None\n"  # what an environment without torch sees
        "import tensormp\n"
        "try:\n"
        "    tensormp.spawn(print, nprocs=1, nnodes=1)\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "torch.distributed.elastic" in r.stdout and "tensormp[torch]" in r.stdout, r


# -- torchrun running a one-machine script ---------------------------------------------------------


@needs_netns
def test_torchrun_runs_a_one_machine_spawn_script_unchanged(tmp_path):
    nodes = torchrun_nodes(tmp_path, "allreduce")
    results = [outcome(lines, tmp_path) for lines in nodes]
    assert all(r["ok"] for r in results), results
    # spawn() started no process: fn ran in the process torchrun started, as its rank
    for r in results:
        (value,) = r["values"]
        assert value["pid"] == r["pid"] and value["local_index"] == 0
        assert value["world"] == 2 and value["sum"] == 6.0
        assert len(set(value["helpers"]) - {r["pid"]}) == 2  # a nested spawn() started two
    assert sorted(r["values"][0]["rank"] for r in results) == [0, 1]


# -- slow: more failure kinds -------------------------------------------------------------------


@pytest.mark.slow
@needs_netns
def test_torchrun_a_rank_that_raises_fails_every_node(tmp_path):
    start = time.monotonic()
    nodes = torchrun_nodes(tmp_path, "raise")
    assert time.monotonic() - start < 80  # rank 0 sleeps 120 s: it was ended
    # rank 1's script got ProcessRaisedException; rank 0, sleeping, was ended by the job
    # exchange, and its torchrun reports rank 1's traceback (from the error file).
    outcomes = [[d for d in lines if "ok" in d] for lines in nodes]
    assert sorted(map(len, outcomes)) == [0, 1], nodes
    failed = 0 if outcomes[0] else 1
    (r,) = outcomes[failed]
    assert r["ok"] is False and r["type"] == "ProcessRaisedException" and r["error_index"] == 1
    assert "ValueError: bad batch on global rank 1" in r["message"]
    other = (tmp_path / f"node{1 - failed}.err").read_text()
    assert "ValueError: bad batch on global rank 1" in other, other[-3000:]
    assert "rank      : 0 (local_rank: 0)" in other  # torchrun's summary names the rank it ran


@pytest.mark.slow
@needs_netns
def test_torchrun_nprocs_must_be_the_local_world_size(tmp_path):
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cmd = [torchrun, "--standalone", "--nproc-per-node=1", str(TORCHRUN_SCRIPT), "allreduce", "2"]
    (lines,) = run_nodes(tmp_path, [cmd], 60)
    r = outcome(lines, tmp_path)
    assert r["ok"] is False and r["type"] == "ValueError"
    assert "LOCAL_WORLD_SIZE=1" in r["message"] and "--nproc-per-node=2" in r["message"]


@pytest.mark.slow
@needs_netns
def test_a_rank_killed_by_a_signal_fails_every_node(tmp_path):
    nodes = elastic_nodes(tmp_path, "crash", nprocs=1)
    results = [outcome(lines, tmp_path) for lines in nodes]
    for r in results:
        assert r["type"] == "ProcessExitedException" and r["error_index"] == 1, r
        assert "terminated with signal SIGKILL" in r["message"]
        assert r["seconds"] < 60
    workers = [d["worker"] for lines in nodes for d in lines if "worker" in d]
    assert all(_gone(pid) for pid in workers)


@pytest.mark.slow
@needs_netns
def test_timeout_stops_the_whole_job(tmp_path):
    start = time.monotonic()
    nodes = elastic_nodes(tmp_path, "timeout", nprocs=1)
    results = [outcome(lines, tmp_path) for lines in nodes]
    for r in results:
        assert r["type"] == "ProcessTimeoutError", r
        assert "ran for 3 s" in r["message"]
    assert time.monotonic() - start < 60  # the ranks sleep 120 s
    workers = [d["worker"] for lines in nodes for d in lines if "worker" in d]
    assert all(_gone(pid) for pid in workers)


@pytest.mark.slow
@needs_netns
def test_a_node_alone_gets_a_rendezvous_timeout_naming_the_endpoint(tmp_path):
    code = (
        "import tensormp\n"
        "def fn(i):\n"
        "    pass\n"
        "if __name__ == '__main__':\n"
        "    tensormp.spawn(fn, nprocs=1, nnodes=2, rdzv_endpoint='127.0.0.1:29400', "
        "rdzv_timeout=5)\n"
    )
    script = tmp_path / "alone.py"
    script.write_text(code)
    start = time.monotonic()
    run_nodes(tmp_path, [[sys.executable, str(script)]], 60)
    err = (tmp_path / "node0.err").read_text()
    assert "RendezvousTimeoutError" in err and "2 nodes were to meet at 127.0.0.1:29400" in err
    assert time.monotonic() - start < 45
