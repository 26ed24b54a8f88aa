"""Helpers the tests import (``from helpers import wait_for``); the fixtures stay in
``conftest.py``, which pytest loads by itself."""

from __future__ import annotations

import os
import time

START_METHODS = ["spawn", "fork", "forkserver"]
STRATEGIES = ["file_descriptor", "file_system"]


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.02) -> bool:
    """Poll ``predicate`` until true or ``timeout`` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def read_json_lines(proc, n: int, timeout: float = 60.0) -> list:
    """Up to ``n`` JSON lines from ``proc.stdout`` within ``timeout`` seconds (fewer at EOF or
    timeout). Reads the raw fd: select() cannot see lines that a buffered readline() already
    pulled in, so two lines arriving together would otherwise hang."""
    import json
    import select

    out: list = []
    fd = proc.stdout.fileno()
    pending = b""
    deadline = time.monotonic() + timeout
    while True:
        while b"\n" in pending and len(out) < n:
            line, pending = pending.split(b"\n", 1)
            out.append(json.loads(line))
        if len(out) >= n:
            return out
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            return out
        pending += chunk
