"""The per-message path of small messages (issue #25): what a 64-byte ``send``/``recv`` costs in
Python calls, and that its shortcuts pickle exactly what the general path does.

Call counts, not times: they do not move with the load of the machine. The bounds leave a
little room; a change that crosses one puts work back on every small message (measured before
the shortcuts: 18 calls per ``Connection.send`` of 64 bytes, 12 per ``recv``).
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import tensormp as mp
from tensormp import reducers

pytestmark = pytest.mark.timeout(60)

PLAIN = [b"x" * 64, "text", 7, 2**70, 1.5, True, None, bytearray(b"ab")]


def _python_calls(fn: Callable[[], Any]) -> int:
    """Python functions ``fn`` calls (``fn`` itself not counted)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls - 1


@pytest.mark.parametrize("obj", [b"x" * 64, (7, 1.5, b"x" * 64)], ids=["bytes", "tuple"])
def test_small_message_costs_few_python_calls(obj):
    a, b = mp.Pipe()
    try:
        for _ in range(3):  # warm: the pickler, the dispatch table, the reducers' imports
            a.send(obj)
            assert b.recv() == obj
        sent = _python_calls(lambda: a.send(obj))
        got: list[Any] = []
        received = _python_calls(lambda: got.append(b.recv()))
        assert got == [obj]
    finally:
        a.close()
        b.close()
    # Now 11 and 6 for bytes (4 of the 11 flush the release records: memory/release.py).
    assert sent <= 13, f"Connection.send of {obj!r} made {sent} Python calls"
    assert received <= 8, f"Connection.recv of {obj!r} made {received} Python calls"


@pytest.mark.parametrize("obj", PLAIN, ids=lambda o: type(o).__name__)
def test_plain_objects_pickle_as_the_general_path(obj):
    msg = reducers.dumps(obj)
    assert msg.data == pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    assert msg.fds == [] and msg.noted == []
    wrapped = reducers.dumps([obj])  # through tensormp's pickler and dispatch table
    assert reducers.loads(wrapped.data, []) == [obj]
    assert reducers.loads(msg.data, []) == obj
    msg.sent()
    wrapped.sent()


def test_a_failed_pickle_leaves_nothing_for_the_next_message():
    class Unpicklable:
        def __reduce__(self) -> Any:
            raise TypeError("not this one")

    big = b"y" * (200 << 10)  # written to the pickler's output before the failure
    with pytest.raises(TypeError, match="not this one"):
        reducers.dumps([big, Unpicklable()])
    msg = reducers.dumps([1, 2])
    assert msg.data == pickle.dumps([1, 2], pickle.HIGHEST_PROTOCOL)
    large = reducers.dumps([big, big])  # over 64 KiB: the pickler writes several chunks
    assert reducers.loads(large.data, []) == [big, big]


def test_an_array_inside_a_small_message_still_crosses_as_a_handle():
    a, b = mp.Pipe()
    try:
        shared = mp.zeros(16, dtype=np.float32)
        a.send((1, b"x" * 64, shared))
        one, raw, got = b.recv()
        assert (one, raw) == (1, b"x" * 64)
        got[3] = 5.0  # the receiver's view is the sender's memory
        assert shared[3] == 5.0
        del got
    finally:
        a.close()
        b.close()


def test_closed_and_one_way_ends_raise_as_the_stdlib():
    r, w = mp.Pipe(duplex=False)
    with pytest.raises(OSError, match="read-only"):
        r.send(b"x")
    with pytest.raises(OSError, match="write-only"):
        w.recv()
    r.close()
    w.close()
    with pytest.raises(OSError, match="closed"):
        w.send(b"x")
    with pytest.raises(OSError, match="closed"):
        r.recv()


def _write_what_comes(conn) -> None:
    payload, arrays = conn.recv()
    for a in arrays:
        a[1] = 7  # the sender's memory
    conn.send(len(payload))
    conn.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_large_message_keeps_the_fds_of_its_arrays(method):
    """A pickle over INLINE_MAX travels in a memfd beside the message's own fds: another
    process must get those fds as the message's (not as queue tokens, which it closes)."""
    ours, theirs = mp.Pipe()
    child = mp.get_context(method).Process(target=_write_what_comes, args=(theirs,))
    child.start()
    theirs.close()
    try:
        arrays = [mp.zeros(16, dtype=np.float32), mp.zeros(1 << 20, dtype=np.uint8)]
        ours.send((b"z" * (200 << 10), arrays))
        assert ours.poll(30), "the child did not answer"
        assert ours.recv() == 200 << 10
        assert [int(a[1]) for a in arrays] == [7, 7]
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
        ours.close()
    assert child.exitcode == 0


def test_bounded_put_costs_few_python_calls_over_an_unbounded_one():
    """A bounded ``Queue.put`` that finds room adds only the ledger's ``W``, its room check and
    the record's count to an unbounded put (measured before: 15 Python calls against 7; now 12:
    no ``_Outgoing`` and no ``_write_now`` hop when the record is written at once)."""
    costs = {}
    for maxsize in (0, 4096):
        q = mp.Queue(maxsize)
        try:
            for _ in range(3):  # warm, as above
                q.put(b"x" * 64)
                assert q.get(timeout=10) == b"x" * 64
            costs[maxsize] = _python_calls(lambda: q.put(b"x" * 64))  # noqa: B023
            assert q.get(timeout=10) == b"x" * 64
        finally:
            q.close()
            q.join_thread()
    assert costs[4096] <= costs[0] + 5, f"Python calls per put (maxsize: calls): {costs}"
