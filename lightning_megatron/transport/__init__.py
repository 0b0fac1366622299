"""Tagged asynchronous tensor transports for dynamic pipeline schedules (MegaDPP, MegaFBD).

``create_transport(name, **kwargs)`` builds one by name; every implementation keeps the contract of
:class:`~lightning_megatron.transport.base.Transport`:

========  ==================================================================================================
``torch``  torch.distributed isend/irecv (NCCL or gloo) with a tag header: works everywhere, the default
``shm``    lock-free rings in POSIX shared memory, one per ordered pair of ranks on a node (native extension)
``tcp``    non-blocking sockets between hosts, addresses exchanged through the rendezvous store (native)
``rdma``   ibverbs RC queue pairs with receive credits (native; compiled where rdma-core headers exist)
========  ==================================================================================================

Implementations are imported when first asked for, so importing this package never loads the extension.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport.base import MAX_TAG, PeerLost, SendHandle, Transport, TransportError, TransportTimeout

__all__ = [
    "MAX_TAG",
    "PeerLost",
    "SendHandle",
    "Transport",
    "TransportError",
    "TransportTimeout",
    "available_transports",
    "create_transport",
    "register_transport",
]

_BUILTIN = {
    "torch": "lightning_megatron.transport.torch_p2p:TorchTransport",
    "shm": "lightning_megatron.transport.shm:ShmTransport",
    "tcp": "lightning_megatron.transport.tcp:TcpTransport",
    "rdma": "lightning_megatron.transport.rdma:RdmaTransport",
}
_REGISTRY: dict[str, Any] = dict(_BUILTIN)


def register_transport(name: str, cls: type[Transport]) -> None:
    """Make ``cls`` available as ``create_transport(name)``."""
    _REGISTRY[name] = cls


def available_transports() -> list[str]:
    return sorted(_REGISTRY)


def transport_class(name: str) -> type[Transport]:
    entry = _REGISTRY.get(name)
    if entry is None:
        raise MegatronConfigError(
            f"transport={name!r} is not known; choose one of {', '.join(available_transports())}."
        )
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = _REGISTRY[name] = getattr(importlib.import_module(module), attr)
    return entry


def create_transport(name: str, **kwargs: Any) -> Transport:
    """``create_transport("shm", device="cpu", timeout=60)``: see :class:`Transport` for the arguments."""
    return transport_class(name)(**kwargs)
