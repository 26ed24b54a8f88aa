"""The seams of issue #16: strategies as objects recorded in segments and handles, the
allocator's state replaced whole in a fork child, and the table of array libraries."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tensormp as mp
from tensormp import reducers, strategies
from tensormp.errors import HandleError
from tensormp.memory import allocator
from tensormp.memory.allocator import find_block
from tensormp.memory.segment import STRATEGY_AT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def restore_strategy():
    before = mp.get_sharing_strategy()
    yield
    mp.set_sharing_strategy(before)


def _write_both(conn):
    a, b = conn.recv()
    a += 1
    b += 2
    conn.send([find_block(a)[0].segment.strategy.name, find_block(b)[0].segment.strategy.name])


def test_each_segment_keeps_the_strategy_that_made_it(restore_strategy):
    """One message carries arrays of both strategies; the receiver maps each through the
    strategy its handle names, whatever strategy is current."""
    mp.set_sharing_strategy("file_system")
    named = mp.zeros(100)
    mp.set_sharing_strategy("file_descriptor")
    anon = mp.zeros(3 << 18)  # 6 MiB: a segment of its own, made now
    for a, name in ((named, "file_system"), (anon, "file_descriptor")):
        seg = find_block(a)[0].segment
        assert seg.strategy is strategies.by_code(seg.strategy.code)
        assert seg.strategy.name == name
        assert seg.wire(b"")[STRATEGY_AT] == seg.strategy.code
    assert strategies.current().name == "file_descriptor"
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_write_both, args=(theirs,))
    p.start()
    ours.send([named, anon])
    assert ours.recv() == ["file_system", "file_descriptor"]
    p.join(30)
    assert p.exitcode == 0
    assert (named == 1).all() and (anon == 2).all()
    ours.close()
    theirs.close()


def test_a_handle_naming_an_unknown_strategy_is_refused():
    with pytest.raises(HandleError, match="sharing strategy code 0xee"):
        strategies.by_code(0xEE)
    codes = [strategies.by_code(row[0]).code for row in strategies._TABLE.values()]
    assert len(set(codes)) == len(strategies.get_all_sharing_strategies())


def test_fork_child_gets_a_fresh_state():
    a = mp.ones(1000)
    parent_state = allocator._state
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            st = allocator._state
            block = find_block(a)[0]
            ok = (
                st is not parent_state  # replaced whole
                and not st.arenas.arenas  # no free lists or arenas of the parent's
                and st.server is None  # nor its release server
                and block.pinned  # the inherited view stays valid, never recycled
                and block.owner_pid != os.getpid()  # and is not ours to recycle
            )
            b = mp.ones(1000)  # a new block, in an arena of the child's own
            ok = ok and find_block(b)[0].segment is not block.segment and (a == 1).all()
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    assert allocator._state is parent_state
    assert find_block(a)[0].pinned  # alive at the fork: never recycled by the parent


def test_reducer_table_dispatch():
    numpy_helpers = reducers.helpers_for(np.zeros(2))
    assert numpy_helpers is not None and numpy_helpers.__name__ == "tensormp.reducers.numpy"
    assert reducers.helpers_for([1, 2]) is None
    with pytest.raises(TypeError, match=r"share\(\) takes a numpy.ndarray, got builtins.list"):
        mp.share([1, 2])
    assert [lib.module for lib in reducers.LIBRARIES][:1] == ["numpy"]
    for lib in reducers.LIBRARIES:
        assert lib.reducers.startswith("tensormp.reducers.")
        for code in lib.extensions:
            assert code > 0xFFFF  # far from the ranges PEP 307 assigns
