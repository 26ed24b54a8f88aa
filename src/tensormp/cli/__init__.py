"""The ``tensormp`` command: ``doctor``, ``ls`` and ``gc`` (also ``python -m tensormp ...``).

Design note
-----------
**What it looks at.** Two kinds of segments exist (``memory/segment.py``):

* *memfd* segments (the default ``file_descriptor`` strategy) have no name in any directory.
  A process holds one as an fd (``/proc/<pid>/fd/<n>`` links to
  ``/memfd:tensormp-<creator pid>-<32 hex> (deleted)``) and/or a mapping (a line of
  ``/proc/<pid>/maps`` with that path and the memfd's inode). The kernel frees one when its last
  fd and mapping are gone, so a memfd can never leak: ``ls`` shows them (identity: the inode;
  size: ``st_size`` through a holder's fd, else the mapping's length) with the live processes
  holding them, ``gc`` never has anything to do with them. The creator is known by pid only
  (memfd names carry no start time), so "creator alive" means "that pid exists".
* *named* segments (the ``file_system`` strategy) are files in the shm directory
  (``$TENSORMP_SHM_DIR`` or ``--shm-dir``, default ``/dev/shm``) whose names carry their creator
  and program (``strategies/file_system.py``). Only these can be orphaned.

**Who decides what is an orphan.** When the cleanup daemon of the shm directory runs
(``strategies/_daemon.py``), ``gc`` asks it (``GC``): it alone knows which files its clients
made (whose messages carry tokens, ``strategies/file_system.py``), and it answers with what it
removed. Otherwise, and for ``ls``,
``doctor`` and ``gc --dry-run`` always, the CLI applies the daemon's rule without the in-flight
knowledge (:func:`names.is_orphan` with ``known=False``): a file of this uid is an
orphan when its creator is dead, no live process maps it *or holds an fd to it*, and its program
has ended (its root is dead and no live creator of another file of the same program is seen).
That rule is never less careful than the daemon's, so running it next to a daemon is safe. The
maps are read after the creators were seen dead (as the daemon does), so a process that maps a
file between the two reads is still seen.

**What it never does.** Remove a memfd (impossible), a file of another uid, a file whose name is
not a well-formed tensormp name, or a file a live process holds. It never starts the daemon (a
``request(..., start=False)``), and it only reads ``/proc``; what it cannot read (other users'
processes, when not root) is counted and reported.

**Speed.** Nothing here imports numpy (sizes in human form come from
``memory.segment.format_bytes``; ``memory`` loads the allocator, and numpy, only on use).

**Modules.** ``proc.py`` reads ``/proc`` (fds and mappings of every readable process);
``segments.py`` classifies what it found (one :class:`~tensormp.cli.segments.SegmentRow` per
segment, by the rule above); ``ls.py``, ``gc.py`` and ``doctor.py`` are the commands; this
module parses the command line.

Exit statuses: 0 success (``doctor``: no PROBLEM found), 1 ``doctor`` found a problem, 2 usage.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..strategies import names
from . import doctor, gc, ls

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--shm-dir", default=None, metavar="DIR",
        help="directory of named segments (default: $TENSORMP_SHM_DIR or /dev/shm)",
    )
    common.add_argument("--json", action="store_true", help="machine-readable output")
    parser = argparse.ArgumentParser(
        prog="tensormp",
        description="Inspect and clean up tensormp's shared memory.",
        epilog="Exit status: 0 success, 1 `doctor` found a problem, 2 bad usage.",
    )
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"tensormp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "doctor", parents=[common], help="check this machine's set-up (exit 1 on a problem)",
        description="Check the shm directory, fd limits, memfd support, start methods, the "
        "cleanup daemon and leftover segments. Exit status 0 when no PROBLEM is found, 1 "
        "otherwise (WARN lines do not change it).",
    )
    p.set_defaults(run=doctor.run)
    p = sub.add_parser(
        "ls", parents=[common], help="list live and orphaned segments",
        description="List tensormp's named segments in the shm directory and the memfd segments "
        "held by the processes this user can read, with size, creator, holders and status.",
    )
    p.add_argument("-l", "--full", action="store_true", help="full segment names")
    p.set_defaults(run=ls.run)
    p = sub.add_parser(
        "gc", parents=[common], help="remove orphaned named segments",
        description="Remove the named segments nobody can need any more (asking the cleanup "
        "daemon when one runs): never one a live process holds or whose creator lives.",
    )
    p.add_argument("-n", "--dry-run", action="store_true",
                   help="only print what would be removed")
    p.set_defaults(run=gc.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``tensormp COMMAND ...`` (the console script and ``python -m tensormp``).

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 success; 1 when ``doctor`` found a PROBLEM; 2 bad usage (argparse
        raises ``SystemExit(2)`` itself).
    """
    args = _parser().parse_args(argv)
    if args.shm_dir:
        args.shm_origin = "--shm-dir"
    else:
        args.shm_origin = "TENSORMP_SHM_DIR" if os.environ.get("TENSORMP_SHM_DIR") else "the default"
        args.shm_dir = names.shm_dir()
    if args.command in ("ls", "gc") and args.shm_origin != "the default" and not os.path.isdir(
        args.shm_dir
    ):  # a directory the user named: a typo must not read as "nothing there"
        print(f"tensormp {args.command}: shm directory {args.shm_dir} ({args.shm_origin}) "
              f"{'is not a directory' if os.path.exists(args.shm_dir) else 'does not exist'}",
              file=sys.stderr)
        return 2
    try:
        return int(args.run(args))
    except BrokenPipeError:  # `tensormp ls | head`: silence the flush at exit too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
