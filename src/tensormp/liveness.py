"""Process identity: a ``(pid, start time)`` pair names a process for good (pids are reused,
start times are not). The release protocol (``memory/release.py``), the ``file_system``
strategy's names and the CLI's scans all decide liveness with it.

Imports nothing of tensormp: every layer may use it.
"""

from __future__ import annotations

__all__ = ["process_start_time", "process_alive"]


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it has exited (or is a
    zombie, which holds no memory any more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22 of the whole line


def process_alive(pid: int, start: int) -> bool:
    """True while the process ``(pid, start)`` lives (a reused pid does not count)."""
    return pid > 0 and process_start_time(pid) == start
