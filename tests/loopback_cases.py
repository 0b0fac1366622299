"""Per-rank bodies of ``test_loopback.py``: each starts one kind of the project's processes' work (a fit with and
without MegaScope, a served model, the transports) and returns the sockets this process listens on meanwhile."""

from __future__ import annotations

import socket
from typing import Any

import lightning.pytorch as pl
import psutil
import torch.distributed as dist
from cases import fit_gpt
from scope_cases import GPT2_STYLE, ByteTokenizer, build

from lightning_megatron.transport import create_transport, missing_extra


def listening(pid: int | None = None) -> list[tuple[str, str, int]]:
    """``(kind, address, port)`` of every listening TCP socket and every unconnected bound UDP socket of ``pid``."""
    found = []
    for conn in psutil.Process(pid).net_connections(kind="inet"):
        if conn.type == socket.SOCK_STREAM and conn.status == psutil.CONN_LISTEN:
            found.append(("tcp", conn.laddr.ip, conn.laddr.port))
        elif conn.type == socket.SOCK_DGRAM and not conn.raddr and conn.laddr:
            found.append(("udp", conn.laddr.ip, conn.laddr.port))
    return found


class _Look(pl.Callback):
    """What this rank listens on after each training step (every socket the fit has opened by then)."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str, int]] = set()

    def on_train_batch_end(self, *args: Any) -> None:
        self.seen.update(listening())


def fit_sockets(world: int, scope: bool, **layout: Any) -> list[tuple[str, str, int]]:
    callbacks: list[Any] = [look := _Look()]
    if scope:
        from lightning_megatron.scope.callback import MegaScope

        callbacks.append(MegaScope(interval=1, command_timeout=0.2))
    fit_gpt(world, steps=2, callbacks=callbacks, **layout)
    return sorted(look.seen)


def serve_sockets(world: int, **layout: Any) -> list[tuple[str, str, int]]:
    """What ``scope serve`` runs on each rank: the model at a layout, the engine, the server on the serving rank."""
    from lightning_megatron.scope import collect
    from lightning_megatron.scope.engine import ScopeEngine
    from lightning_megatron.scope.server import ScopeServer

    _, module = build(world, GPT2_STYLE, **layout)
    engine = ScopeEngine(module, ByteTokenizer())
    collect.scope_group()
    if collect.rank() != 0:
        engine.run_command_loop(idle_seconds=0.2)
        return sorted(set(listening()))
    with ScopeServer(engine):
        seen = listening()
        engine.shutdown()
        engine.run_command_loop(idle_seconds=0.2)
    return sorted(set(seen))


def transport_sockets(names: list[str]) -> dict[str, Any]:
    """Each transport opened and connected to every peer (after a strategy's process group exists)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seen: dict[str, Any] = {}
    for name in names:
        if missing_extra(name):
            seen[name] = "unavailable"
            continue
        try:
            transport = create_transport(name, timeout=30)
        except Exception as error:  # noqa: BLE001  (no such hardware here)
            seen[name] = f"unavailable: {type(error).__name__}"
            continue
        try:
            dist.barrier()
            transport.connect([r for r in range(world) if r != rank])
            seen[name] = sorted(set(listening()))
            dist.barrier()
        finally:
            transport.close()
    return seen
