"""How the ranks of a job meet: on one node, over loopback only.

torch.distributed's ``env://`` rendezvous makes rank 0 host a ``TCPStore`` on every interface (the
unspecified address, ``*:MASTER_PORT``), unauthenticated: anyone who reaches the machine could read and
write the job's keys. A job on one node needs nothing beyond loopback, so there the strategy hosts the store
itself on a socket bound to 127.0.0.1 (handed to the store as ``master_listen_fd``), sets ``MASTER_ADDR`` to
127.0.0.1 (the transports listen on the route to it) and points gloo (``GLOO_SOCKET_IFNAME``) and NCCL's
bootstrap (``NCCL_SOCKET_IFNAME``) at the loopback interface, unless those are set already. Jobs on several
nodes keep ``env://`` (the store on ``MASTER_ADDR:MASTER_PORT``, all interfaces), and so do processes started
by torchrun, whose agent already hosts the store.

Ending: the store lives in rank 0, and NCCL's watchdog in every rank polls it until its process group is
destroyed. If rank 0 exits first, the others log 'Failed to check the "should dump" flag on TCPStore'. At
interpreter exit each rank therefore destroys its process groups (which stops the watchdog) and tells the
store; rank 0 waits (a bounded time) until every other rank has done so before its store goes.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
import time
from typing import Any, Optional

import torch.distributed as dist

from lightning_megatron.loopback import loopback_interface

__all__ = ["init_process_group", "one_node_loopback"]

_log = logging.getLogger(__name__)
_EXIT_KEY = "lightning_megatron/exited"
EXIT_WAIT_S = 15.0
"""How long rank 0 keeps its store at exit for ranks that have not released their process groups."""
_held: Optional[tuple[dist.TCPStore, int, int, int]] = None
_exit_registered = False
_pointed_at_loopback: dict[str, str] = {}
"""The interface variables this module set (a later multi-node job in the same process removes them)."""


def one_node_loopback(num_nodes: int) -> bool:
    """Whether this job's rendezvous stays on loopback: one node, and not under torchrun's agent store."""
    return num_nodes == 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


def init_process_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    num_nodes: int,
    main_address: str,
    main_port: int,
    timeout: datetime.timedelta,
    **kwargs: Any,
) -> None:
    """``torch.distributed.init_process_group`` for the strategy: loopback only on one node (see the module)."""
    global _held, _exit_registered
    if not one_node_loopback(num_nodes):
        for name, value in _pointed_at_loopback.items():  # set by an earlier one-node job of this process
            if os.environ.get(name) == value:
                del os.environ[name]
        _pointed_at_loopback.clear()
        os.environ["MASTER_ADDR"] = main_address
        os.environ["MASTER_PORT"] = str(main_port)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
        return
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(main_port)
    interface = loopback_interface()
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if name not in os.environ:  # the user's choice stands
            os.environ[name] = _pointed_at_loopback[name] = interface
    _held = None  # a store of an earlier, destroyed process group goes now (rank 0: its port is free again)
    store = _loopback_store(rank, world_size, main_port, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    if not _exit_registered:
        atexit.register(_release_at_exit)
        _exit_registered = True
    # Only the latest store: an earlier one goes with its destroyed process group (and frees its port).
    _held = (store, rank, world_size, os.getpid())


def _loopback_store(rank: int, world_size: int, port: int, timeout: datetime.timedelta) -> dist.TCPStore:
    if rank != 0:  # connects, retrying until the timeout while rank 0 starts
        return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(max(128, world_size))
    except OSError as error:
        listener.close()
        raise OSError(
            f"rank 0 cannot listen on 127.0.0.1:{port} for the process group's store ({error}); set MASTER_PORT "
            "to a free port"
        ) from error
    # The store's libuv loop owns the descriptor from here (and closes it): detach it from the Python object.
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=True,
    )


def _release_at_exit() -> None:
    """Destroy this process's groups (stopping NCCL's watchdog), then tell rank 0; rank 0 keeps its store
    until the others are done. Skipped in a child forked from the process that created the store."""
    if _held is None or os.getpid() != _held[3]:
        return
    store, rank, world_size, _ = _held
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (exiting: nothing left to do about it)
        _log.debug("destroying the process groups at exit failed", exc_info=True)
    try:
        if rank != 0:
            store.add(_EXIT_KEY, 1)
            return
        deadline = time.monotonic() + EXIT_WAIT_S
        while store.add(_EXIT_KEY, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001  (rank 0 is gone, or a rank never reached exit)
        _log.debug("the exit handshake on the store failed", exc_info=True)
