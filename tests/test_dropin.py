"""``import tensormp as mp`` in place of ``multiprocessing`` or ``torch.multiprocessing``: the
start method is the stdlib's and reaches children as the stdlib's does, contexts carry the
stdlib's class names, warnings use the stdlib's words, and each deliberate difference listed in
docs/differences.md ("Differences from the stdlib and from torch") behaves as documented. Real
processes throughout; the start-method cases run in a fresh interpreter, since the method is per
program."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys

import pytest

import tensormp as mp
from helpers import START_METHODS

# -- the start method --------------------------------------------------------------------------

START_METHOD_DRIVER = r"""
import json, multiprocessing, multiprocessing.sharedctypes, os, sys
import tensormp as mp

def grandchild(conn):
    conn.send(("grandchild", mp.get_start_method(), multiprocessing.get_start_method()))

def child(conn, value):
    with value.get_lock():  # a stdlib lock made in the parent's default context
        value.value += 1
    g = mp.Process(target=grandchild, args=(conn,))
    g.start()
    g.join()
    conn.send(("child", mp.get_start_method(), multiprocessing.get_start_method(),
               type(mp.get_context()).__name__, g._popen.method, g.exitcode))

if __name__ == "__main__":
    report = {"unset": [mp.get_start_method(allow_none=True),
                        multiprocessing.get_start_method(allow_none=True)]}
    set_through, method = sys.argv[1], sys.argv[2]
    (mp if set_through == "tensormp" else multiprocessing).set_start_method(method)
    report["parent"] = [mp.get_start_method(), multiprocessing.get_start_method(),
                        type(mp.get_context()).__name__]
    try:
        (multiprocessing if set_through == "tensormp" else mp).set_start_method("fork")
    except RuntimeError as e:
        report["second_set"] = str(e)
    value = multiprocessing.sharedctypes.Value("i", 0, lock=True)
    r, w = mp.Pipe(duplex=False)
    p = mp.Process(target=child, args=(w, value))
    p.start()
    report["messages"] = [r.recv(), r.recv()]
    p.join()
    report["exitcode"], report["value"] = p.exitcode, value.value
    print(json.dumps(report))
"""


@pytest.mark.parametrize(
    "set_through, method", [("tensormp", "spawn"), ("multiprocessing", "forkserver")]
)
def test_the_start_method_is_the_stdlibs_and_reaches_children(tmp_path, set_through, method):
    path = tmp_path / "driver.py"
    path.write_text(START_METHOD_DRIVER)
    proc = subprocess.run(
        [sys.executable, str(path), set_through, method], capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    name = {"spawn": "SpawnContext", "forkserver": "ForkServerContext"}[method]
    assert report["unset"] == [None, None]  # neither module has chosen before the program does
    assert report["parent"] == [method, method, name]  # one setting for both modules
    assert report["second_set"] == "context has already been set"
    # The child runs under its parent's method, starts its own children with it, and can use
    # a lock that the stdlib's default context made.
    assert report["messages"] == [
        ["grandchild", method, method],
        ["child", method, method, name, method, 0],
    ]
    assert (report["exitcode"], report["value"]) == (0, 1)


def test_the_default_start_method_is_the_stdlibs():
    assert mp.get_start_method(allow_none=True) == multiprocessing.get_start_method(
        allow_none=True
    )
    assert mp.get_context().get_start_method() == multiprocessing.get_context().get_start_method()


# -- contexts named as the stdlib's ------------------------------------------------------------


@pytest.mark.parametrize("method", START_METHODS)
def test_contexts_are_named_and_typed_as_the_stdlibs(method):
    ctx = mp.get_context(method)
    name = {"fork": "ForkContext", "spawn": "SpawnContext", "forkserver": "ForkServerContext"}
    assert type(ctx).__name__ == name[method]
    assert isinstance(ctx, getattr(multiprocessing.context, name[method]))
    assert ctx.Process.__name__.lower().startswith(method)
    assert ctx.get_context() is ctx and ctx.get_start_method() == method
    with pytest.raises(ValueError, match="concrete context"):
        ctx.set_start_method("spawn")
    for other in START_METHODS:  # a concrete context leads to tensormp's, not the stdlib's
        assert ctx.get_context(other) is mp.get_context(other)
    with pytest.raises(ValueError, match="cannot find context for 'bogus'"):
        ctx.get_context("bogus")


def test_torchs_spawn_context_alias_does_not_clash_with_the_context_class():
    from tensormp import context

    assert issubclass(mp.SpawnContext, mp.ProcessContext)  # torch's renamed class
    assert type(mp.get_context("spawn")) is context.SpawnContext  # the stdlib's name
    assert mp.SpawnContext is not context.SpawnContext


# -- the stdlib's wording ----------------------------------------------------------------------


def test_a_running_pool_dropped_warns_in_the_stdlibs_words():
    pool = mp.get_context("fork").Pool(1)
    try:
        with pytest.warns(ResourceWarning, match=r"^unclosed running multiprocessing pool <"):
            pool.__del__()  # what the garbage collector runs for a pool nobody closed
    finally:
        pool.terminate()
        pool.join()


# -- children outlive their parent only when asked ---------------------------------------------


def _report_parent_death(conn):
    """A grandchild: say whether its parent lives, wait for it to die, say it again."""
    parent = multiprocessing.parent_process()
    conn.send(("alive" if parent.is_alive() else "not alive", os.getpid()))
    parent.join(timeout=30)
    conn.send(("alive" if parent.is_alive() else "not alive", os.getpid()))


def _start_outliving_grandchild(conn, how, method):
    if how == "process":
        g = mp.get_context(method).Process(
            target=_report_parent_death, args=(conn,), die_with_parent=False
        )
    else:
        ctx = mp.get_context(method, die_with_parent=False)
        g = ctx.Process(target=_report_parent_death, args=(conn,))
    assert g.die_with_parent is False
    g.start()
    g.join()  # never returns: the test terminates this process


@pytest.mark.parametrize(
    "how, method", [("process", "spawn"), ("context", "fork"), ("context", "forkserver")]
)
def test_an_opted_out_grandchild_sees_its_parent_die(how, method):
    # The stdlib's semantics, asked for: the child is terminated, the grandchild lives on and
    # notices (a grandchild that dies with its parent would never answer).
    r, w = mp.Pipe(duplex=False)
    p = mp.get_context(method).Process(target=_start_outliving_grandchild, args=(w, how, method))
    p.start()
    w.close()
    try:
        assert r.poll(60), "the grandchild did not start"
        state, grandchild = r.recv()
        assert state == "alive"
        p.terminate()
        p.join(30)
        assert r.poll(30), "the grandchild died with its parent"
        assert r.recv() == ("not alive", grandchild)
    finally:
        p.kill()
        p.join(10)
        r.close()


def test_die_with_parent_is_checked_and_fixed_at_start():
    ctx = mp.get_context("fork")
    p = ctx.Process(target=os.getpid)
    assert p.die_with_parent is True  # the default: children die with their parent
    p.die_with_parent = False
    assert mp.Process(target=os.getpid, die_with_parent=False).die_with_parent is False
    assert mp.get_context(die_with_parent=False).Process(target=os.getpid).die_with_parent is False
    with pytest.raises(TypeError, match="die_with_parent must be True or False"):
        p.die_with_parent = 0
    with pytest.raises(TypeError, match="die_with_parent must be True or False"):
        mp.get_context("spawn", die_with_parent="no")
    p.start()
    try:
        with pytest.raises(ValueError, match="set die_with_parent before start"):
            p.die_with_parent = True
    finally:
        p.join(10)
    assert p.exitcode == 0


# -- deliberate differences from torch (docs/differences.md) -----------------------------------


def test_torch_private_helpers_are_not_provided():
    for name in ("_set_thread_name", "_get_thread_name"):
        with pytest.raises(AttributeError, match=f"no attribute {name!r}"):
            getattr(mp, name)


def test_grad_travels_with_the_tensor():
    torch = pytest.importorskip("torch")
    q = mp.get_context("fork").SimpleQueue()
    t = torch.ones(3, requires_grad=True)
    t.grad = torch.full((3,), 2.0)
    q.put(t)
    got = q.get()
    assert got.requires_grad and got.grad is not None and got.grad.tolist() == [2.0] * 3
    got.grad.add_(1)  # the same memory as the sender's .grad (torch sends no .grad at all)
    assert t.grad.tolist() == [3.0] * 3
    q.close()


def test_non_leaf_refusal_uses_torchs_term():
    torch = pytest.importorskip("torch")
    q = mp.get_context("fork").SimpleQueue()
    with pytest.raises(RuntimeError, match=r"requires_grad.*detach\(\)"):
        q.put(torch.ones(2, requires_grad=True) * 2)
    q.close()


def test_file_system_segments_stay_cached_until_empty_cache():
    from tensormp.memory.allocator import find_block
    from tensormp.strategies import names as naming

    mp.set_sharing_strategy("file_system")
    try:
        a = mp.zeros(300_000)  # 2.3 MiB: a segment of its own
        path = os.path.join(naming.shm_dir(), find_block(a)[0].segment.name)
        del a
        assert os.path.exists(path)  # kept for reuse while this process lives (torch unlinks)
        assert mp.memory_stats()["cached_bytes"] >= 300_000 * 8
        mp.empty_cache()  # gives the space back
        assert not os.path.exists(path)
        old = mp.get_cache_limit()
        mp.set_cache_limit(0)  # or cache nothing at all
        try:
            b = mp.zeros(300_000)
            path = os.path.join(naming.shm_dir(), find_block(b)[0].segment.name)
            del b
            assert not os.path.exists(path)
        finally:
            mp.set_cache_limit(old)
    finally:
        mp.set_sharing_strategy("file_descriptor")


def test_put_raises_pickling_errors_in_the_caller():
    q = mp.get_context("fork").Queue()
    try:
        # What pickle raises for a local lambda; the stdlib's feeder thread would print it
        # and drop the item, leaving the consumer waiting.
        with pytest.raises((pickle.PicklingError, AttributeError), match="lambda"):
            q.put(lambda: 0)
        q.put(1)  # the queue still works
        assert q.get(timeout=10) == 1
    finally:
        q.close()
        q.join_thread()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [1, 100, 70_000, 3 << 20])  # inline, and a memfd payload
def test_bytes_through_a_pipe_as_the_stdlibs(nbytes):
    import threading

    data = os.urandom(nbytes)
    for module in (multiprocessing, mp):  # the stdlib's behaviour is the reference
        a, b = module.Pipe()

        def send_quietly(*args, a=a):
            try:
                a.send_bytes(*args)
            except OSError:  # after "bad message length", the stdlib's reader is closed
                pass

        def send(*args, send_quietly=send_quietly):  # a thread: the stdlib's socket is small
            t = threading.Thread(target=send_quietly, args=args)
            t.start()
            return t

        try:
            t = send(data, 1)  # an offset, as the stdlib
            assert b.recv_bytes() == data[1:]
            t.join()
            t = send(data)
            buf = bytearray(nbytes + 10)
            assert b.recv_bytes_into(buf, 3) == nbytes and bytes(buf[3:3 + nbytes]) == data
            t.join()
            t = send(data)
            with pytest.raises(multiprocessing.BufferTooShort) as info:
                b.recv_bytes_into(bytearray(nbytes - 1))
            assert info.value.args[0] == data, module.__name__
            t.join()
            t = send(data)
            with pytest.raises(OSError, match="bad message length"):
                b.recv_bytes(maxlength=nbytes - 1)
            b.close()  # the rest of that message may still be in the stdlib's socket
            t.join()
        finally:
            a.close()
            b.close()
