"""spawn(), start_processes() and ProcessContext: torch's semantics, and what tensormp adds
(every failure reported, crash stacks, bounded reports, timeouts, lambdas, return values,
Ctrl-C, torch.distributed). Real processes and real signals throughout."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import numpy as np
import psutil
import pytest

import tensormp as mp
from helpers import START_METHODS, read_json_lines, wait_for
from tensormp import _spawn_rank
from tensormp import _spawn_report as wire

# -- functions run by the ranks (top level: importable by spawn children) ---------------------


def _write_rank(i, a):
    a[i] = i + 1


def _is_shared(i, a):
    return bool(mp.is_shared(a))


def _return_view(i, a):
    a[i] = 10 + i
    return {"rank": i, "view": a[i : i + 1], "fresh": np.full(3, i, dtype=np.int16)}


def _raise_on(i, rank, exc_type, message):
    if i == rank:
        raise exc_type(message)


def _exit_on(i, rank, code):
    if i == rank:
        sys.exit(code)


def _crash_here(how):
    if how == "segfault":
        import ctypes

        ctypes.string_at(0)  # a real SIGSEGV
    elif how == "abort":
        os.abort()
    else:
        os.kill(os.getpid(), signal.SIGBUS)
    time.sleep(10)


def _crash_on(i, rank, how):
    if i == rank:
        _crash_here(how)


def _mixed_failures(i):
    if i == 0:
        raise ValueError("first failure")
    if i == 1:
        sys.exit(3)
    if i == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if i == 3:
        raise TypeError("other failure")


def _keyboard_interrupt(i):
    if i == 1:
        raise KeyboardInterrupt


def _huge_message(i):
    raise ValueError("x" * 20_000_000)


def _sleep(i, seconds):
    time.sleep(seconds)


def _unpicklable_result(i):
    return threading.Lock()


def _forge(i, kind):
    """Misbehave on the report channel the way a corrupt or dying child could."""
    sock = _spawn_rank._channel
    if kind == "announce_more":
        fd = wire._memfd_with(b"tensormp-error-report 1\ntype 5\nValue", "forged")
        wire._send(sock, wire._TAG_ERROR + wire._ERROR_HEAD.pack(1 << 30), [fd])
    elif kind == "huge":
        fd = os.memfd_create("forged")
        os.ftruncate(fd, 256 << 20)  # 256 MiB of zeros, announced as such
        wire._send(sock, wire._TAG_ERROR + wire._ERROR_HEAD.pack(256 << 20), [fd])
    elif kind == "garbage":
        wire._send(sock, b"\xff" * 60, [])
    elif kind == "result_without_fds":
        fd = wire._memfd_with(b"\x80\x05N.", "forged")
        wire._send(sock, wire._TAG_RESULT + wire._RESULT_HEAD.pack(4, 5), [fd])
    elif kind == "killed_while_writing":
        fd = os.memfd_create("forged")
        os.write(fd, b"tensormp-error-report 1\ntype 10\nValu")
        os.kill(os.getpid(), signal.SIGKILL)  # before the datagram that would announce it
    os._exit(1)


def _distributed(i):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        t = torch.tensor([float(i + 1)])
        dist.all_reduce(t)
        env = {k: os.environ[k] for k in ("MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
        return t.item(), env, int(os.environ["MASTER_PORT"])
    finally:
        dist.destroy_process_group()


# -- helpers for driver scripts ---------------------------------------------------------------

PRELUDE = r"""
import json, os, signal, sys, time
import tensormp as mp

def emit(**kw):
    os.write(1, (json.dumps(kw) + "\n").encode())  # one write: ranks share stdout
"""


def _driver(tmp_path, body, *, env=None, name="driver.py"):
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return subprocess.Popen(
        [sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True, cwd=tmp_path, env={**os.environ, **(env or {})},
    )


def _read_lines(proc, n, timeout=60.0):
    out = read_json_lines(proc, n, timeout)
    if len(out) < n:
        proc.kill()
        proc.wait(5)
        pytest.fail(f"driver printed {out} within {timeout} s (rc={proc.returncode}); "
                    f"stderr:\n{proc.stderr.read()}")
    return out


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _all_gone(pids, timeout=5.0):
    return wait_for(lambda: all(_gone(p) for p in pids), timeout)


# -- transfer: args and return values under every start method --------------------------------


@pytest.mark.parametrize("method", START_METHODS)
def test_shared_array_args_are_written_through(method):
    a = mp.zeros(4)
    assert mp.start_processes(_write_rank, args=(a,), nprocs=2, start_method=method) is None
    assert a.tolist() == [1, 2, 0, 0]


@pytest.mark.parametrize("method", START_METHODS)
def test_plain_array_args_arrive_as_shared_views(method):
    shared = mp.start_processes(
        _is_shared, args=(np.arange(5.0),), nprocs=2, start_method=method, return_values=True
    )
    # fork passes arguments by inheritance (stdlib semantics): a plain array is a private copy
    assert shared == ([False, False] if method == "fork" else [True, True])


@pytest.mark.parametrize("method", START_METHODS)
def test_return_values_keep_shared_arrays_shared(method):
    a = mp.zeros(2)
    results = mp.start_processes(
        _return_view, args=(a,), nprocs=2, start_method=method, return_values=True
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert a.tolist() == [10, 11]
    for i, r in enumerate(results):
        assert mp.is_shared(r["view"]) and r["view"].tolist() == [10 + i]
        r["view"][0] = -1  # the same memory as the argument
        assert r["fresh"].dtype == np.int16 and r["fresh"].tolist() == [i] * 3
    assert a.tolist() == [-1, -1]


def test_join_false_context():
    ctx = mp.start_processes(_sleep, args=(0.3,), nprocs=2, join=False, return_values=True)
    assert isinstance(ctx, mp.ProcessContext)
    assert len(set(ctx.pids())) == 2
    assert "running=[0, 1]" in repr(ctx)
    assert ctx.join(timeout=0.01) is False
    deadline = time.monotonic() + 30
    while not ctx.join(timeout=1):
        assert time.monotonic() < deadline
    assert ctx.join() is True
    assert ctx.return_values == [None, None]


def _write_late(i, a):
    time.sleep(0.3)
    a[i] = 1


def test_dropped_context_does_not_stop_the_ranks():
    # torch code may call spawn(join=False) and never join: the ranks must still run fn (the
    # stdlib joins them at exit), even though the report channels are closed under them.
    import gc
    import multiprocessing

    a = mp.zeros(2)
    ctx = mp.start_processes(_write_late, args=(a,), nprocs=2, join=False, return_values=True)
    pids = ctx.pids()
    del ctx
    gc.collect()
    assert wait_for(lambda: a.tolist() == [1, 1], 30)
    assert wait_for(lambda: not multiprocessing.active_children() and all(map(_gone, pids)), 10)


def test_spawn_warns_on_other_start_method_like_torch():
    a = mp.zeros(2)
    with pytest.warns(FutureWarning, match="start_processes"):
        mp.spawn(_write_rank, args=(a,), nprocs=2, start_method="fork")
    assert a.tolist() == [1, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match="nprocs"):
        mp.spawn(_write_rank, nprocs=-1)
    with pytest.raises(TypeError, match="callable"):
        mp.spawn(42)
    with pytest.raises(ValueError, match="timeout"):
        mp.spawn(_write_rank, nprocs=1, timeout=-1)
    with pytest.raises(ValueError, match="context"):
        mp.start_processes(_write_rank, start_method="bogus")


def test_no_processes_is_not_an_error_as_in_torch():
    assert mp.spawn(_write_rank, nprocs=0) is None
    assert mp.start_processes(_write_rank, nprocs=0, start_method="fork") is None
    assert mp.spawn(_write_rank, nprocs=0, return_values=True) == []
    ctx = mp.spawn(_write_rank, nprocs=0, join=False)
    assert isinstance(ctx, mp.ProcessContext) and ctx.pids() == [] and ctx.join() is True
    assert not mp.active_children()


def test_spawn_context_is_torchs_renamed_class_and_warns():
    with pytest.warns(UserWarning, match="SpawnContext is renamed to ProcessContext"):
        ctx = mp.SpawnContext([], [])
    assert isinstance(ctx, mp.ProcessContext) and ctx.join() is True
    # not the stdlib-style context class of the same name, which lives in tensormp.context
    assert mp.SpawnContext is not mp.context.SpawnContext
    assert type(mp.get_context("spawn")) is mp.context.SpawnContext


# -- failures ----------------------------------------------------------------------------------


def test_raised_exception_has_torch_message_and_traceback():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_raise_on, args=(1, ValueError, "bad rank"), nprocs=2)
    e = info.value
    assert str(e).startswith("\n\n-- Process 1 terminated with the following error:\nTraceback")
    assert "in _raise_on" in str(e) and str(e).rstrip().endswith("ValueError: bad rank")
    assert (e.error_index, e.exit_code, e.signal_name) == (1, 1, None)
    assert (e.exc_type, e.exc_message) == ("ValueError", "bad rank")
    assert e.error_pid > 0 and len(e.failures) == 1
    assert isinstance(e, mp.ProcessException) and isinstance(e, mp.TensormpError)


def test_torchs_exception_classes_catch_tensormps_failures():
    """Code written for torch.multiprocessing (a library) that catches torch's classes catches
    tensormp's spawn failures too, once torch is imported; they pickle as tensormp's."""
    pytest.importorskip("torch.multiprocessing")
    torch_mp = sys.modules["torch.multiprocessing.spawn"]  # (the package has no ProcessException)
    for fn, args, torch_cls, ours in (
        (_raise_on, (1, ValueError, "bad rank"), torch_mp.ProcessRaisedException,
         mp.ProcessRaisedException),
        (_exit_on, (1, 3), torch_mp.ProcessExitedException, mp.ProcessExitedException),
    ):
        with pytest.raises(torch_cls) as info:
            mp.spawn(fn, args=args, nprocs=2)
        e = info.value
        assert isinstance(e, ours) and isinstance(e, torch_mp.ProcessException)
        assert type(e).__name__ == ours.__name__ and (e.error_index, e.error_pid) == (1, e.error_pid)
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is ours and str(back) == str(e) and back.exit_code == e.exit_code


def test_exit_code_is_reported_like_torch():
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(_exit_on, args=(1, 3), nprocs=2)
    e = info.value
    assert str(e) == "process 1 terminated with exit code 3"
    assert (e.error_index, e.exit_code, e.signal_name) == (1, 3, None)


@pytest.mark.parametrize(
    "how, name", [("segfault", "SIGSEGV"), ("abort", "SIGABRT"), ("sigbus", "SIGBUS")]
)
def test_crash_by_signal_comes_with_python_stack(how, name):
    with pytest.raises(mp.ProcessExitedException) as info:
        mp.spawn(_crash_on, args=(0, how), nprocs=2)
    e = info.value
    assert str(e) == f"process 0 terminated with signal {name}"  # torch's message
    assert (e.error_index, e.signal_name, e.exit_code) == (0, name, -getattr(signal, name))
    (note,) = e.__notes__  # the child's Python stack, printed after the message
    assert note.startswith(f"-- Python stack of process 0 when it received {name} (faulthandler)")
    assert "in _crash_here" in note and "in _crash_on" in note
    assert e.failures[0].traceback in note


def test_every_failure_is_reported():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_mixed_failures, nprocs=5, grace_period=20)
    e = info.value
    msg = str(e)
    # str(e) is torch's: it ends with the first failure's traceback, and holds nothing else.
    assert e.error_index == 0 and msg.rstrip().endswith("ValueError: first failure")
    assert msg.startswith("\n\n-- Process 0 terminated with the following error:\n")
    assert "other process" not in msg and "TypeError" not in msg
    pids = {f.index: f.pid for f in e.failures}
    assert sorted(pids) == [0, 1, 2, 3]  # rank 4 returned
    by_index = {f.index: f for f in e.failures}
    assert by_index[2].signal_name == "SIGSEGV" and "_mixed_failures" in by_index[2].traceback
    assert by_index[3].exc_type == "TypeError" and "Traceback" in by_index[3].traceback
    # The others, and their stacks, are notes (printed after the message by Python >= 3.11).
    notes = e.__notes__
    assert notes[0].startswith("-- 3 other process(es) failed too:\n")
    assert f"process 1 (pid {pids[1]}): terminated with exit code 3" in notes[0]
    assert f"process 2 (pid {pids[2]}): terminated with signal SIGSEGV" in notes[0]
    assert f"process 3 (pid {pids[3]}): raised TypeError: other failure" in notes[0]
    assert notes[1].startswith("-- Python stack of process 2 when it received SIGSEGV")
    assert "_mixed_failures" in notes[1]
    assert notes[2].startswith("-- Process 3 terminated with the following error:\nTraceback")
    assert notes[2].rstrip().endswith("TypeError: other failure") and len(notes) == 3
    printed = "".join(traceback.format_exception(e))
    assert printed.index("ValueError: first failure") < printed.index("3 other process(es)")


def test_others_are_stopped_after_a_failure():
    t = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.start_processes(_sleep_unless_first, nprocs=3)
    assert time.monotonic() - t < 20  # not the 60 s of sleep
    assert str(info.value).rstrip().endswith("RuntimeError: rank 0 failed")
    assert len(info.value.failures) == 1  # the ranks it stopped are not failures


def _sleep_unless_first(i):
    if i == 0:
        time.sleep(0.2)
        raise RuntimeError("rank 0 failed")
    time.sleep(60)


def test_keyboard_interrupt_raised_by_fn_is_a_failure():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_keyboard_interrupt, nprocs=2)
    assert info.value.error_index == 1 and info.value.exc_type == "KeyboardInterrupt"


def test_unpicklable_return_value_is_reported():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_unpicklable_result, nprocs=1, return_values=True)
    assert "sending the return value to the parent" in str(info.value)
    assert info.value.exc_type == "TypeError"


def test_huge_error_report_is_bounded():
    t = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_huge_message, nprocs=1)
    assert time.monotonic() - t < 30
    msg = str(info.value)
    assert len(msg) < 1 << 20 and "characters omitted" in msg
    assert len(info.value.exc_message) <= 9000


@pytest.mark.parametrize(
    "kind", ["announce_more", "huge", "garbage", "result_without_fds", "killed_while_writing"]
)
def test_forged_or_half_written_reports_never_hang(kind):
    t = time.monotonic()
    with pytest.raises(mp.ProcessException) as info:
        mp.spawn(_forge, args=(kind,), nprocs=1, return_values=True)
    assert time.monotonic() - t < 30
    e = info.value
    msg = "\n".join([str(e), *getattr(e, "__notes__", ())])  # what the printer shows
    if kind == "killed_while_writing":
        assert msg.startswith("process 0 terminated with signal SIGKILL")
    elif kind == "announce_more":
        assert "truncated" in msg
    elif kind == "huge":
        assert "the first 1048576 were read" in msg or "unreadable" in msg
    elif kind == "garbage":
        assert msg.startswith("process 0 terminated with exit code 1") and "unexpected" in msg
    else:
        assert "lost some of its file descriptors" in msg
    assert e.error_index == 0


def test_no_error_files_left_in_the_temp_directory(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = _driver(tmp_path, """
        def fail(i):
            if i == 0:
                raise ValueError("boom")
            os.kill(os.getpid(), signal.SIGSEGV)
        if __name__ == "__main__":
            for method in ("spawn", "fork", "forkserver"):
                try:
                    mp.start_processes(fail, nprocs=2, start_method=method, grace_period=10)
                except mp.ProcessException as e:
                    emit(method=method, failures=len(e.failures))
    """, env={"TMPDIR": str(tmp)})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert [json.loads(line)["failures"] for line in out.splitlines()] == [2, 2, 2]
    assert os.listdir(tmp) == []


def test_timeout_stops_the_ranks_and_raises_timeout_error():
    t = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        mp.spawn(_sleep, args=(60,), nprocs=2, timeout=1.0)
    e = info.value
    assert 1.0 <= time.monotonic() - t < 20
    assert isinstance(e, mp.ProcessTimeoutError) and isinstance(e, mp.TensormpError)
    assert e.running == [0, 1]
    assert "timed out after 1 s" in str(e) and not e.failures
    assert "process 0 (pid " in str(e) and "process 1 (pid " in str(e)


def _python310():
    """A working Python 3.10 interpreter, or None (a pyenv shim on PATH may not work)."""
    import glob
    import shutil

    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.10*/bin/python3.10")))
    for path in [*candidates, shutil.which("python3.10")]:
        if path and subprocess.run([path, "-c", ""], capture_output=True).returncode == 0:
            return path
    return None


PY310 = _python310()


@pytest.mark.skipif(PY310 is None, reason="needs a Python 3.10 interpreter")
def test_on_python_310_the_notes_open_the_message(tmp_path):
    # 3.10's traceback printer ignores __notes__: they lead str(e) there, which still ends with
    # the first failure's traceback (tensormp imports no numpy for this).
    (tmp_path / "driver.py").write_text(textwrap.dedent("""
        import json, os, signal, sys
        import tensormp as mp

        def f(i):
            if i == 0:
                raise ValueError("first")
            os.kill(os.getpid(), signal.SIGSEGV)

        if __name__ == "__main__":
            try:
                mp.spawn(f, nprocs=2, grace_period=20)
            except mp.ProcessRaisedException as e:
                print(json.dumps({"str": str(e), "notes": e.__notes__}))
    """))
    src = os.path.dirname(os.path.dirname(mp.__file__))
    proc = subprocess.run(
        [PY310, str(tmp_path / "driver.py")], capture_output=True, text=True,
        timeout=120, cwd=tmp_path, env={**os.environ, "PYTHONPATH": src},
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    notes, msg = out["notes"], out["str"]
    assert len(notes) == 2 and notes[0].startswith("-- 1 other process(es) failed too:")
    assert notes[1].startswith("-- Python stack of process 1 when it received SIGSEGV")
    assert msg.startswith(notes[0]) and notes[1] in msg
    assert msg.rstrip().endswith("ValueError: first")
    assert "\n\n-- Process 0 terminated with the following error:\n" in msg


def test_exceptions_pickle_with_their_attributes():
    with pytest.raises(mp.ProcessRaisedException) as info:
        mp.spawn(_mixed_failures, nprocs=4, grace_period=20)
    samples = [
        info.value,
        mp.ProcessExitedException("process 1 terminated with signal SIGSEGV", 1, 42, -11, "SIGSEGV"),
        mp.ProcessTimeoutError("timed out", 0, 7, running=[0, 2]),
        mp.ProcessException("x", 3, 9),
    ]
    for e in samples:
        back = pickle.loads(pickle.dumps(e))
        public = getattr(mp, type(e).__name__)  # (with torch loaded, e's may be torch_compatible's)
        assert type(back) is public and isinstance(e, public) and str(back) == str(e)
        for attr in ("error_index", "error_pid", "exit_code", "signal_name", "failures"):
            assert getattr(back, attr) == getattr(e, attr), attr
        assert getattr(back, "__notes__", None) == getattr(e, "__notes__", None)
    assert len(samples[0].__notes__) == 3  # the other failures travel with it
    assert pickle.loads(pickle.dumps(samples[0])).exc_type == "ValueError"
    assert pickle.loads(pickle.dumps(samples[2])).running == [0, 2]
    assert isinstance(samples[2], TimeoutError) and samples[2].errno is None
    # What spawn(nnodes=N) adds to a failure from another node travels too.
    samples[0].__dict__.update(node=1, host="node-b")
    back = pickle.loads(pickle.dumps(samples[0]))
    assert (back.node, back.host) == (1, "node-b") and back.__notes__ == samples[0].__notes__


# -- fn: lambdas, local functions, the main module ---------------------------------------------


def test_lambda_and_local_function():
    a = mp.zeros(2)
    mp.spawn(lambda i, arr: arr.__setitem__(i, 5), args=(a,), nprocs=2)
    assert a.tolist() == [5, 5]
    offset = 7

    def local(i, arr):
        arr[i] = offset + i

    mp.spawn(local, args=(a,), nprocs=2)
    assert a.tolist() == [7, 8]


def test_without_cloudpickle_a_lambda_gets_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cloudpickle", None)
    with pytest.raises(TypeError, match="install cloudpickle"):
        mp.spawn(lambda i: None, nprocs=1)


def test_functions_of_the_main_script(tmp_path):
    proc = _driver(tmp_path, """
        def top(i, a):
            a[i] += 1
        if __name__ == "__main__":
            def guarded(i, a):
                a[i] += 10
            a = mp.zeros(2)
            mp.spawn(top, args=(a,), nprocs=2)
            mp.spawn(guarded, args=(a,), nprocs=2)
            mp.spawn(lambda i, a: a.__setitem__(i, a[i] + 100), args=(a,), nprocs=2)
            emit(a=a.tolist())
    """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out) == {"a": [111, 111]}


def test_missing_main_guard_gets_an_error_that_says_what_to_do(tmp_path):
    proc = _driver(tmp_path, """
        def f(i):
            pass
        mp.spawn(f, nprocs=2)
        emit(done=True)
    """)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and out == ""
    assert "SpawnBootstrapError" in err  # raised in each child, shown on stderr
    assert err.count('under `if __name__ == "__main__":`') >= 2
    assert "failed while starting, before running fn" in err  # the parent's exception


# -- Ctrl-C --------------------------------------------------------------------------------------

CTRL_C_DRIVER = """
    def work(i):
        emit(rank=i, pid=os.getpid())
        while True:
            time.sleep(0.05)
    if __name__ == "__main__":
        mp.spawn(work, nprocs=2, grace_period=3)
"""


@pytest.mark.parametrize("target", ["process group", "parent only"])
def test_ctrl_c_stops_children_with_one_message(tmp_path, target):
    proc = _driver(tmp_path, CTRL_C_DRIVER)
    pids = [line["pid"] for line in _read_lines(proc, 2)]
    if target == "process group":  # what the terminal does
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT, 1), err
    assert _all_gone(pids), "children still running after Ctrl-C"
    assert err.count("Traceback") == 1, err
    assert "KeyboardInterrupt: tensormp.spawn: interrupted (Ctrl-C); stopped processes" in err


# -- torch.distributed ---------------------------------------------------------------------------


def test_distributed_env_and_gloo_all_reduce():
    pytest.importorskip("torch.distributed")
    results = mp.spawn(_distributed, nprocs=2, distributed=True, return_values=True, timeout=120)
    (s0, env0, port0), (s1, env1, port1) = results
    assert s0 == s1 == 3.0
    assert env0 == {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    assert env1["RANK"] == env1["LOCAL_RANK"] == "1" and port0 == port1 > 0
    assert "MASTER_PORT" not in os.environ or int(os.environ["MASTER_PORT"]) != port0


# -- slow: many fds, races ----------------------------------------------------------------------


def _many_segments(i, n):
    return [mp.empty((1 << 20) + 4096, dtype=np.uint8) for _ in range(n)]


@pytest.mark.slow
def test_return_value_with_more_fds_than_one_message_carries():
    arrays = mp.spawn(_many_segments, args=(300,), nprocs=1, return_values=True)[0]
    assert len(arrays) == 300 and all(mp.is_shared(a) for a in arrays)
    del arrays


@pytest.mark.slow
def test_ctrl_c_at_random_moments(tmp_path):
    for delay in [0.0, 0.1, 0.15] + [0.2 + 0.05 * k for k in range(12)]:
        proc = _driver(tmp_path, CTRL_C_DRIVER)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert err.count("Traceback") <= 1, err
        assert wait_for(lambda sid=proc.pid: not _session_alive(sid), 5.0)


def _session_alive(sid):
    alive = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid and not _gone(p.pid):
                alive.append(p.pid)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass
    return alive


class _SlowToFormat(Exception):
    def __str__(self):
        time.sleep(1.0)  # the report of this failure is being written when SIGTERM comes
        return "formatted slowly"


def _fail_while_another_reports(rank, at):
    time.sleep(max(0.0, at - time.time()))
    if rank == 1:
        raise _SlowToFormat()
    if rank == 2:
        time.sleep(0.3)  # rank 1 is inside its error report now
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(5)


@pytest.mark.timeout(60)
def test_a_rank_reporting_its_failure_is_not_cut_off_by_the_stop():
    """After a first failure the parent SIGTERMs the rest; a rank that has already failed and
    is writing its report still delivers it (it blocks SIGTERM while reporting)."""
    with pytest.raises(mp.ProcessException) as info:
        mp.spawn(_fail_while_another_reports, args=(time.time() + 1.0,), nprocs=3)
    assert sorted(f.index for f in info.value.failures) == [1, 2], info.value
    assert "formatted slowly" in str(info.value)


def _exit_quietly(rank):
    if rank == 1:
        os._exit(0)
    return f"r{rank}"


@pytest.mark.timeout(60)
def test_return_values_of_a_rank_that_never_returned_is_an_error_not_none():
    with pytest.raises(mp.ProcessRaisedException, match="exited with status 0 before fn returned") as info:
        mp.spawn(_exit_quietly, nprocs=2, return_values=True)
    assert info.value.error_index == 1
    assert mp.spawn(_exit_quietly, nprocs=1, return_values=True) == ["r0"]
