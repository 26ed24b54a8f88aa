"""The channel soak of issue 27: a bounded queue under SIGKILLs on a loaded machine.

Two producers and two consumers (spawn) share one ``Queue(maxsize=64)``. A producer puts plain
numpy arrays of random sizes (1 KiB to 8 MiB), each filled with a pattern that names it
(``seed + k`` in word ``k``, the seed made of the producer's tag and the item's number); a
consumer checks every array it gets, keeps a random window of up to 50 of them and checks each
again when it lets it go (a block recycled while a receiver still holds it shows there). Every
``KILL_EVERY`` seconds for ``DURATION`` seconds the root SIGKILLs one random child and starts a
replacement. Then it sets ``stop``, waits for the producers, puts one ``None`` per consumer and
waits for each consumer's last report.

Each phase has a deadline: on expiry the root sends SIGUSR1 to every child (each registered
``faulthandler`` on it, writing to a file of its own) and dumps its own threads, and the run
ends as a stall with every stack in the result.

Meanwhile the root samples, about 4 times a second, the shared memory that the live processes
of the soak hold: memfd bytes (pages allocated, by inode, over fds and mappings) and the bytes
of this program's files in the shm directory. After the soak it waits ``LINGER`` seconds and
counts this program's ``tensormp-*`` files still there.

Run: ``python tests/scripts/channel_soak.py STRATEGY [runs [seed]]``; prints one JSON line per
run. Knobs (environment): ``SOAK_DURATION``, ``SOAK_KILL_EVERY`` (seconds), ``SOAK_PHASE_TIMEOUT``,
and ``SOAK_PAUSE_DAEMON`` / ``SOAK_PAUSE_AT`` (``file_system``: stop the cleanup daemon for that
many seconds from that time on, a daemon starved of CPU).
"""

from __future__ import annotations

import faulthandler
import json
import os
import queue
import random
import signal
import sys
import tempfile
import threading
import time

import numpy as np

import tensormp as mp

MAXSIZE = 64
WINDOW_MAX = 50
SIZE_MIN = 1 << 10
SIZE_MAX = 8 << 20
DURATION = float(os.environ.get("SOAK_DURATION", 20.0))
KILL_EVERY = float(os.environ.get("SOAK_KILL_EVERY", 3.0))
LINGER = 3.0
PHASE_TIMEOUT = float(os.environ.get("SOAK_PHASE_TIMEOUT", 60.0))
PAUSE_AT = float(os.environ.get("SOAK_PAUSE_AT", 6.0))  # seconds any phase after the kills may take before it counts as a stall
WORDS_MAX = SIZE_MAX // 8
ARENA_SLACK = 64 << 20  # free space of partly used arenas, per process (memory/arenas.py)


def _seed(tag: int, i: int) -> int:
    return (tag << 40) | (i << 8) | 0x5A


def _make(rng: random.Random, tag: int, i: int) -> np.ndarray:
    words = rng.randint(SIZE_MIN, SIZE_MAX) // 8
    return np.arange(_seed(tag, i), _seed(tag, i) + words, dtype=np.uint64)


def _ok(item: object, ramp: np.ndarray) -> bool:
    try:
        tag, i, a = item  # type: ignore[misc]
        return bool(
            isinstance(a, np.ndarray) and a.dtype == np.uint64 and 1 <= a.size <= WORDS_MAX
            and mp.is_shared(a)
            and np.array_equal(a - np.uint64(_seed(tag, i)), ramp[: a.size])
        )
    except Exception:
        return False


def _dump_on_usr1(dump_dir: str) -> None:
    f = open(os.path.join(dump_dir, f"{os.getpid()}.txt"), "w")  # noqa: SIM115 - for life
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)


def producer(q, tag, stop, dump_dir):
    _dump_on_usr1(dump_dir)
    rng = random.Random(tag)
    i = 0
    while not stop.value:
        item = (tag, i, _make(rng, tag, i))
        try:
            q.put(item, timeout=0.5)
        except queue.Full:
            continue
        i += 1
    q.close()
    q.join_thread()


def consumer(q, report, seed, dump_dir):
    _dump_on_usr1(dump_dir)
    rng = random.Random(seed)
    ramp = np.arange(WORDS_MAX, dtype=np.uint64)
    window = rng.randint(0, WINDOW_MAX)
    kept: list[tuple[int, int, np.ndarray]] = []
    got = 0
    while True:
        item = q.get()
        if item is None:
            break
        got += 1
        ok = _ok(item, ramp)
        report.send(("item", item[0], item[1], ok) if ok else ("wrong", repr(item)[:200]))
        if ok:
            kept.append(item)
        while len(kept) > window:
            old = kept.pop(rng.randrange(len(kept)))
            if not _ok(old, ramp):
                report.send(("changed", old[0], old[1]))
    for old in kept:
        if not _ok(old, ramp):
            report.send(("changed", old[0], old[1]))
    kept.clear()
    report.send(("done", os.getpid(), got))
    report.close()


def memory_bound(consumer_kills: int) -> int:
    """Bytes of shared memory the soak's live processes may hold at once (docs/guarantees.md,
    "Memory under kills"): the arrays queued (``MAXSIZE``), kept by the consumers and in the
    hands of each process, the blocks a killed consumer received in its last 50 ms (not yet
    announced: pinned until their creator exits; a few per kill), and per live process the
    cache limit on each side (free blocks, idle foreign mappings) plus the free part of the
    arenas it still uses."""
    arrays = MAXSIZE + 2 * WINDOW_MAX + 4 + 4 * consumer_kills
    return arrays * SIZE_MAX + 4 * (2 * mp.get_cache_limit() + ARENA_SLACK)


# -- what the live processes hold ---------------------------------------------------------------
def held_bytes(pids: list[int], program: tuple[int, int] | None) -> tuple[int, int]:
    """(memfd bytes allocated, held by ``pids`` through fds or mappings; bytes of the named
    segment files of ``program`` in the shm directory)."""
    seen: dict[int, int] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if not os.readlink(path).startswith("/memfd:"):
                    continue
                st = os.stat(path)
            except OSError:
                continue
            seen[st.st_ino] = st.st_blocks * 512
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = [ln for ln in f if "/memfd:" in ln]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            ino = int(parts[4])
            if ino in seen:
                continue
            try:
                st = os.stat(f"/proc/{pid}/map_files/{parts[0]}")
            except OSError:
                continue
            seen[ino] = st.st_blocks * 512
    files = 0
    if program is not None:
        files = sum(f.size for f in _program_files(program))
    return sum(seen.values()), files


def _program_files(program: tuple[int, int]) -> list:
    from tensormp.strategies import names

    return [f for f in names.list_segment_files() if f.program == program]


# -- the root ------------------------------------------------------------------------------------
class Stall(Exception):
    pass


def run(strategy: str, seed: int, duration: float = DURATION) -> dict:
    mp.set_sharing_strategy(strategy)
    ctx = mp.get_context("spawn")
    from tensormp.strategies import program

    prog = program() if strategy == "file_system" else None
    dump_dir = tempfile.mkdtemp(prefix="soak-dumps-")
    rng = random.Random(seed)
    q = ctx.Queue(MAXSIZE)
    stop = ctx.RawValue("i", 0)
    report_r, report_w = ctx.Pipe(duplex=False)
    producers: list = []
    consumers: list = []
    tags = iter(range(1, 1 << 20))
    received: list[tuple[int, int]] = []
    wrong: list = []
    done: dict[int, int] = {}
    peak = {"memfd": 0, "files": 0, "total": 0}
    phase = ["start"]

    def start(role: str) -> None:
        if role == "p":
            p = ctx.Process(target=producer, args=(q, next(tags), stop, dump_dir), daemon=True)
            p.start()
            producers.append(p)
        else:
            p = ctx.Process(target=consumer, args=(q, report_w, rng.getrandbits(32), dump_dir),
                            daemon=True)
            p.start()
            consumers.append(p)

    def pump(until: float) -> None:
        """Read reports and sample memory until ``until`` (monotonic)."""
        next_sample = 0.0
        while True:
            now = time.monotonic()
            if now >= next_sample:
                pids = [os.getpid()] + [p.pid for p in producers + consumers if p.pid]
                memfd, files = held_bytes(pids, prog)
                peak["memfd"] = max(peak["memfd"], memfd)
                peak["files"] = max(peak["files"], files)
                peak["total"] = max(peak["total"], memfd + files)
                next_sample = now + 0.25
            left = until - time.monotonic()
            if left <= 0:
                return
            if report_r.poll(min(left, 0.05)):
                msg = report_r.recv()
                if msg[0] == "item":
                    received.append((msg[1], msg[2]))
                elif msg[0] == "done":
                    done[msg[1]] = msg[2]
                else:
                    wrong.append(msg)

    phases: dict[str, float] = {}

    def wait_for(what: str, cond, timeout: float = PHASE_TIMEOUT) -> None:
        phase[0] = what
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise Stall(what)
            pump(time.monotonic() + 0.1)

    t0 = time.monotonic()
    kills = {"p": 0, "c": 0}
    result: dict = {"strategy": strategy, "seed": seed}
    try:
        for role in "ppcc":
            start(role)
        next_kill = t0 + KILL_EVERY
        pause = float(os.environ.get("SOAK_PAUSE_DAEMON", 0))  # seconds (file_system): a
        daemon_pid = 0  # cleanup daemon starved of CPU, as on a loaded machine
        while next_kill <= t0 + duration:
            if pause and not daemon_pid and next_kill > t0 + PAUSE_AT:
                from tensormp.strategies import _client

                daemon_pid = _client.request("STATE", start=True)["pid"]
                os.kill(daemon_pid, signal.SIGSTOP)
                threading.Timer(pause, os.kill, (daemon_pid, signal.SIGCONT)).start()
            pump(next_kill)
            role = rng.choice("pc")
            pool = producers if role == "p" else consumers
            victim = pool.pop(rng.randrange(len(pool)))
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            kills[role] += 1
            start(role)
            next_kill += KILL_EVERY
        pump(t0 + duration)
        stop.value = 1
        t_stop = time.monotonic()
        for p in producers:
            wait_for(f"producer {p.pid} exit", lambda p=p: p.exitcode is not None)
        phases["producers_exit"] = time.monotonic() - t_stop
        phase[0] = "put(None)"
        for _ in consumers:
            deadline = time.monotonic() + PHASE_TIMEOUT
            while True:
                try:
                    q.put(None, timeout=0.5)
                    break
                except queue.Full:
                    if time.monotonic() > deadline:
                        raise Stall("put(None)") from None
                    pump(time.monotonic() + 0.05)
        phases["nones"] = time.monotonic() - t_stop
        wait_for("consumer results", lambda: len(done) == len(consumers))
        phases["results"] = time.monotonic() - t_stop
        for p in consumers:
            wait_for(f"consumer {p.pid} exit", lambda p=p: p.exitcode is not None)
        phases["consumers_exit"] = time.monotonic() - t_stop
        result["bad_exits"] = [p.exitcode for p in producers + consumers if p.exitcode != 0]
        result["stall"] = None
    except Stall as e:
        result["stall"] = str(e)
        for p in producers + consumers:
            if p.exitcode is None:
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
        with open(os.path.join(dump_dir, f"root-{os.getpid()}.txt"), "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        time.sleep(1.0)
        for p in producers + consumers:
            p.kill()
            p.join(5)
    soak_end = time.monotonic()
    result["soak_s"] = round(soak_end - t0, 1)
    result["kills"] = kills
    result["end_phases_s"] = {k: round(v, 2) for k, v in phases.items()}
    result["received"] = len(received)
    result["duplicates"] = len(received) - len(set(received))
    top: dict[int, int] = {}
    for tag, i in received:
        top[tag] = max(top.get(tag, -1), i)
    result["lost"] = sum(v + 1 for v in top.values()) - len(set(received))
    result["wrong"] = wrong[:10]
    result["wrong_count"] = len(wrong)
    result["done"] = sorted(done.values())
    result["peak_memfd_mib"] = round(peak["memfd"] / 2**20, 1)
    result["peak_files_mib"] = round(peak["files"] / 2**20, 1)
    result["peak_total_mib"] = round(peak["total"] / 2**20, 1)
    result["bound_mib"] = round(memory_bound(kills["c"]) / 2**20, 1)
    report_w.close()
    # Files of this program left LINGER seconds after the soak, the root still running.
    time.sleep(max(0.0, soak_end + LINGER - time.monotonic()))
    if prog is not None:
        left = _program_files(prog)
        result["files_left"] = len(left)
        result["files_left_mib"] = round(sum(f.size for f in left) / 2**20, 1)
    else:
        result["files_left"] = 0
    memfd, _ = held_bytes([os.getpid()], None)
    result["root_memfd_after_mib"] = round(memfd / 2**20, 1)
    q.close()
    report_r.close()
    if result["stall"]:
        dumps = {}
        for name in sorted(os.listdir(dump_dir)):
            with open(os.path.join(dump_dir, name)) as f:
                dumps[name] = f.read()
        result["dumps"] = dumps
        result["phase"] = phase[0]
    for name in os.listdir(dump_dir):
        os.unlink(os.path.join(dump_dir, name))
    os.rmdir(dump_dir)
    result["program"] = list(prog) if prog else None
    return result


def main(argv: list[str]) -> int:
    strategy = argv[0] if argv else "file_descriptor"
    runs = int(argv[1]) if len(argv) > 1 else 1
    seed0 = int(argv[2]) if len(argv) > 2 else random.randrange(1 << 30)
    for k in range(runs):
        print(json.dumps(run(strategy, seed0 + k)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
