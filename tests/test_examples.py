"""The examples: Hogwild accuracy, pipeline delivery, failures and Ctrl-C (issue 4).

Every test runs under the autouse leak fixture (``conftest.py``): no fd, memfd, shm file or
child process may outlive it. The Ctrl-C tests run the demo in a subprocess and send it a real
SIGINT.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import tensormp
from tensormp.examples import demo, hogwild, pipeline

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def digits() -> hogwild.Dataset:
    return hogwild.load_data(0)


# -- Hogwild ------------------------------------------------------------------------------------
def test_sgd_step_gradients_match_finite_differences():
    rng = np.random.default_rng(0)
    params = {k: v.copy() for k, v in hogwild.init_params(6, 5, 3, seed=1).items()}
    params = {k: v.astype(np.float64) for k, v in params.items()}
    x = rng.standard_normal((4, 6))
    y = np.array([0, 2, 1, 2])

    def loss(p):
        h = np.maximum(x @ p["W1"] + p["b1"], 0)
        s = h @ p["W2"] + p["b2"]
        s = s - s.max(axis=1, keepdims=True)
        return float(np.mean(np.log(np.exp(s).sum(axis=1)) - s[np.arange(4), y]))

    lr = 1e-3
    stepped = {k: v.copy() for k, v in params.items()}
    ws = {k: v.astype(np.float64) for k, v in hogwild.make_workspace(4, 6, 5, 3).items()}
    ws["mask"] = ws["mask"].astype(bool)
    reported = hogwild.sgd_step(stepped, x, y, lr, ws)
    assert reported == pytest.approx(loss(params), rel=1e-9)
    for name, value in params.items():
        numeric = np.zeros_like(value)
        for i in np.ndindex(value.shape):
            plus = {k: v.copy() for k, v in params.items()}
            minus = {k: v.copy() for k, v in params.items()}
            plus[name][i] += 1e-6
            minus[name][i] -= 1e-6
            numeric[i] = (loss(plus) - loss(minus)) / 2e-6
        step = (value - stepped[name]) / lr  # what sgd_step applied, per unit of lr
        np.testing.assert_allclose(step, numeric, atol=1e-6, err_msg=name)


def test_params_are_shared_memory():
    params = hogwild.init_params(64, 8, 10, seed=0)
    assert all(tensormp.is_shared(p) for p in params.values())
    assert params["W1"].any() and not params["b1"].any()


@pytest.mark.timeout(60)
def test_hogwild_two_workers_reach_90_percent(digits):
    r = hogwild.train(workers=2, epochs=5, hidden=256, batch_size=64, lr=0.1, seed=0, data=digits)
    assert len(r.accuracy) == 5
    assert r.accuracy[-1] >= 0.90, r.accuracy
    assert r.samples == 5 * len(digits.y_train)
    assert r.samples_per_s > 0 and r.median_samples_per_s > 0


@pytest.mark.timeout(60)
def test_hogwild_worker_failure_ends_the_run_with_its_traceback(digits):
    t0 = time.monotonic()
    with pytest.raises(tensormp.ProcessRaisedException) as info:
        hogwild.train(workers=2, epochs=5, hidden=32, data=digits, fail_at=(1, 2))
    assert time.monotonic() - t0 < 30
    err = info.value
    assert err.error_index == 1
    assert "injected failure in worker 1 at epoch 2" in str(err)
    assert "_worker" in str(err)  # the child's traceback, not just its message


# Slow (10-25 s on 2 cores: every worker imports torch): torch Hogwild across two workers to 90 %
# stays in the default suite through test_torch.py's shared-Adam run, the per-worker SGD over a
# shared module through docs/torch.md's Hogwild block (test_readme.py).
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hogwild_torch_two_workers_reach_90_percent(digits):
    pytest.importorskip("torch")
    r = hogwild.train(workers=2, epochs=5, hidden=256, batch_size=64, lr=0.1, seed=0, data=digits,
                      framework="torch")
    assert r.accuracy[-1] >= 0.90, r.accuracy  # the numpy version's bar, same data and start
    assert r.samples == 5 * len(digits.y_train) and r.median_samples_per_s > 0
    assert tensormp.is_shared(r.model)  # the parent's model is the workers' shared memory


def test_hogwild_cli_frameworks():
    parser = hogwild.build_parser()
    opts = parser.parse_args([])
    assert (opts.framework, opts.optimizer) == ("numpy", "sgd")
    assert parser.parse_args(["--framework", "torch", "--optimizer", "adam"]).optimizer == "adam"
    with pytest.raises(SystemExit):
        parser.parse_args(["--framework", "jax"])
    with pytest.raises(SystemExit):
        hogwild.main(["--optimizer", "adam"])  # adam needs --framework torch
    with pytest.raises(ValueError, match="framework"):
        hogwild.train(framework="jax")


# -- pipeline -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_images() -> tuple[np.ndarray, np.ndarray]:
    return pipeline.make_images(16, pad=2)


def _expected_crc(images, labels, batch_id, seed, batch_size, size):
    im = np.empty((batch_size, size, size), np.float32)
    lab = np.empty(batch_size, np.int64)
    ids = np.empty(batch_size, np.int64)
    pipeline.fill_batch(images, labels, batch_id, seed, im, lab, ids)
    return pipeline.batch_crc(im, lab, ids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", pipeline.MODES)
def test_pipeline_delivers_every_batch_exactly_once_intact(mode, small_images):
    images, labels = small_images
    n, batch_size, size, seed = 60, 16, 16, 7
    r = pipeline.run(mode, loaders=2, batches=n, batch_size=batch_size, size=size, slots=3,
                     warmup=4, seed=seed, verify=True, data=small_images)
    assert r.batches == n
    ids = [b for b, _ in r.received]
    assert sorted(ids) == list(range(n)), "each batch exactly once"
    for batch_id, crc in r.received:
        assert crc == _expected_crc(images, labels, batch_id, seed, batch_size, size), batch_id
    assert r.batch_bytes == batch_size * (size * size * 4 + 16)
    if mode == "shared":
        assert r.queue_bytes_per_batch < 1024  # handles, not the batch
        assert r.mapped_growth == 0  # the ring is reused: nothing new mapped after warm-up
    else:
        assert r.queue_bytes_per_batch > r.batch_bytes


def test_fill_batch_is_deterministic_and_crops_inside(small_images):
    images, labels = small_images
    a = _expected_crc(images, labels, 3, 0, 8, 16)
    assert a == _expected_crc(images, labels, 3, 0, 8, 16)
    assert a != _expected_crc(images, labels, 4, 0, 8, 16)
    im = np.empty((8, 16, 16), np.float32)
    lab = np.empty(8, np.int64)
    ids = np.empty(8, np.int64)
    pipeline.fill_batch(images, labels, 3, 0, im, lab, ids)
    np.testing.assert_array_equal(lab, labels[ids])
    assert 0 <= im.min() and im.max() <= 1 and im.any()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", pipeline.MODES)
def test_pipeline_loader_failure_is_reported(mode, small_images):
    # More labels than images: a loader indexes past the images and raises IndexError.
    images, labels = small_images
    with pytest.raises(tensormp.ProcessRaisedException) as info:
        pipeline.run(mode, loaders=2, batches=50, batch_size=64, size=16, slots=2,
                     data=(images[:3], labels))
    assert info.value.exc_type == "IndexError"
    assert "fill_batch" in str(info.value)


def test_pipeline_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        pipeline.run("pickle")
    with pytest.raises(ValueError, match=">= 1"):
        pipeline.run("shared", loaders=0)


# -- demo ----------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_demo_quick_prints_summary_and_writes_png(tmp_path):
    # In a subprocess, as `make demo` runs it (and matplotlib's cached font files stay there).
    out = subprocess.run(
        [sys.executable, "-m", "tensormp.examples.demo", "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=100, check=True,
    ).stdout
    for text in ("Summary", "speed-up", "tensormp shared ring", "stdlib mp.Queue", "ratio"):
        assert text in out
    final = re.search(r"2 worker\(s\): test accuracy ([\d.]+)%", out)
    assert final and float(final.group(1)) >= 90, out
    png = tmp_path / demo.PNG_NAME
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png.resolve()) in out


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _workers_of(pid: int) -> list[psutil.Process]:
    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in kids:
        try:
            if "spawn_main" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE or not p.is_running()
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "phase, target",
    [
        ("[1/3]", "group"),  # Ctrl-C at a terminal: SIGINT to the whole foreground group
        ("[2/3]", "parent"),  # SIGINT to the demo only: it must stop its loaders itself
        pytest.param("[1/3]", "parent", marks=pytest.mark.slow),
        pytest.param("[2/3]", "group", marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_stops_every_process_within_2s(tmp_path, phase, target):
    """A real SIGINT during Hogwild ([1/3]) or the pipeline ([2/3]) of the demo."""
    shm_before = {n for n in os.listdir("/dev/shm") if "tensormp" in n}
    long = ["--epochs", "400"] if phase == "[1/3]" else ["--epochs", "1", "--batches", "1000000"]
    cmd = [sys.executable, "-m", "tensormp.examples.demo", "--quick", *long, "--out",
           str(tmp_path)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    try:
        deadline = time.monotonic() + 40
        seen = []
        while not any(line.startswith(phase) for line in seen):
            assert time.monotonic() < deadline, f"demo never reached {phase}: {seen}"
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            assert line is not None, f"demo ended early: {seen} {proc.stderr.read()}"
            seen.append(line)
        while len(_workers_of(proc.pid)) < 1:  # the phase's processes are up
            assert time.monotonic() < deadline, "no worker process appeared"
            time.sleep(0.02)
        time.sleep(0.3)  # let them get into their loops
        procs = psutil.Process(proc.pid).children(recursive=True)
        assert procs

        t0 = time.monotonic()
        if target == "group":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=10)
        while not all(_gone(p) for p in procs) and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        elapsed = time.monotonic() - t0
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    alive = [p.pid for p in procs if not _gone(p)]
    assert not alive, f"processes left running: {alive}"
    assert elapsed <= 2.0, f"stopping took {elapsed:.2f} s"
    assert rc == 130, stderr
    assert "interrupted (Ctrl-C)" in stderr
    assert "Traceback" not in stderr, stderr
    assert "leaked" not in stderr, stderr  # resource_tracker warnings
    assert {n for n in os.listdir("/dev/shm") if "tensormp" in n} <= shm_before
