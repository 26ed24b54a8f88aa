"""The ``torch.distributed`` environment of ``spawn(..., distributed=True)`` ranks on one machine.

Each rank gets ``MASTER_ADDR=127.0.0.1`` and a port that was free when ``spawn()`` looked
(``MASTER_PORT``), ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``, its ``RANK`` and ``LOCAL_RANK``,
and ``GLOO_SOCKET_IFNAME=lo`` unless the caller set one: what
``torch.distributed.init_process_group()`` reads. The rank sets them before ``fn`` runs
(``_spawn_rank.py``). ``elastic.py`` picks a rendezvous port with :func:`free_port` too.
"""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "distributed_env"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no socket used when this looked."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distributed_env(nprocs: int) -> dict[str, str]:
    """The variables every rank of ``nprocs`` shares (``RANK`` and ``LOCAL_RANK`` are added per
    rank)."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
    }
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, whatever the host name resolves to
    return env
