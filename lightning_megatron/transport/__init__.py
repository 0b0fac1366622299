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

``create_transport(name, link_delay=LinkDelay(...))`` (or a mapping, from a YAML config) wraps the transport in
:class:`~lightning_megatron.transport.delay.DelayedTransport`: messages on the chosen links reach the receiver
late, reproducibly, while the sender goes on (for evaluating schedules on slow or jittery links).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Optional, Union

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.transport.base import MAX_TAG, PeerLost, SendHandle, Transport, TransportError, TransportTimeout
from lightning_megatron.transport.delay import DelayedTransport, LinkDelay

__all__ = [
    "MAX_TAG",
    "DelayedTransport",
    "LinkDelay",
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


def create_transport(
    name: str, *, link_delay: Optional[Union[LinkDelay, Mapping[str, Any]]] = None, **kwargs: Any
) -> Transport:
    """``create_transport("shm", device="cpu", timeout=60)``: see :class:`Transport` for the arguments.

    ``link_delay``: a :class:`LinkDelay` (or a mapping of its fields) wraps the transport in a
    :class:`DelayedTransport` that delivers messages on the chosen links late; None (default): no wrapper."""
    spec = None if link_delay is None else LinkDelay.coerce(link_delay)  # a bad spec fails before anything opens
    transport = transport_class(name)(**kwargs)
    if spec is None:
        return transport
    try:
        return DelayedTransport(transport, spec)
    except BaseException:
        transport.close()
        raise
