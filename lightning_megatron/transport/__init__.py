"""Tagged asynchronous tensor transports for dynamic pipeline schedules (MegaDPP, MegaFBD).

``create_transport(name, **kwargs)`` builds one by name; every implementation keeps the contract of
:class:`~lightning_megatron.transport.base.Transport`:

========  ==================================================================================================
``torch``  torch.distributed isend/irecv (NCCL or gloo) with a tag header: works everywhere, the default
``shm``    lock-free rings in POSIX shared memory, one per ordered pair of ranks on a node (native extension)
``tcp``    non-blocking sockets between hosts, addresses exchanged through the rendezvous store (native)
``rdma``   ibverbs RC queue pairs with receive credits (native; compiled where rdma-core exists; never run)
``ucx``    UCX active messages, UCX picking the fabric (shared memory, TCP; IB with a UCX built for it)
========  ==================================================================================================

``ucx`` needs UCX's libraries (the ``ucx`` extra): ``available_transports()`` lists it only where they are found
(not loaded), and ``missing_extra("ucx")`` says what to install where they are not.

Implementations are imported when first asked for, so importing this package never loads the extension.

``create_transport(name, link_delay=LinkDelay(...))`` (or a mapping, from a YAML config) wraps the transport in
:class:`~lightning_megatron.transport.delay.DelayedTransport`: messages on the chosen links reach the receiver
late, reproducibly, while the sender goes on (for evaluating schedules on slow or jittery links).
"""

from __future__ import annotations

import ctypes.util
import functools
import importlib
import importlib.util
import os
from collections.abc import Mapping
from typing import Any, Optional, Union

from lightning_megatron.errors import MegatronConfigError, TransportUsageError
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
    "TransportUsageError",
    "available_transports",
    "create_transport",
    "find_libucp",
    "missing_extra",
    "register_transport",
]

_BUILTIN = {
    "torch": "lightning_megatron.transport.torch_p2p:TorchTransport",
    "shm": "lightning_megatron.transport.shm:ShmTransport",
    "tcp": "lightning_megatron.transport.tcp:TcpTransport",
    "rdma": "lightning_megatron.transport.rdma:RdmaTransport",
    "ucx": "lightning_megatron.transport.ucx:UcxTransport",
}
_REGISTRY: dict[str, Any] = dict(_BUILTIN)


def register_transport(name: str, cls: type[Transport]) -> None:
    """Make ``cls`` available as ``create_transport(name)``."""
    _REGISTRY[name] = cls


@functools.lru_cache(maxsize=1)
def find_libucp() -> Optional[str]:
    """Where UCX's ``libucp`` is, without loading it (nor the native extension): the ``libucx`` wheel's copy (the
    ``ucx`` extra), else a system UCX's soname; None if neither. ``transport.ucx.load_ucx`` loads it."""
    spec = importlib.util.find_spec("libucx")
    if spec is not None and spec.origin:
        path = os.path.join(os.path.dirname(spec.origin), "lib", "libucp.so")
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("ucp")


_INSTALLED = {"ucx": lambda: find_libucp() is not None}
"""Built-in transports that need an optional dependency (the extra of the same name): listed by
``available_transports`` only where it is installed."""


def missing_extra(name: str) -> Optional[str]:
    """The command that installs what transport ``name`` needs, where that is missing; else None."""
    if name in _INSTALLED and not _INSTALLED[name]():
        return f"pip install 'lightning-megatron[{name}]'"
    return None


def available_transports() -> list[str]:
    return sorted(name for name in _REGISTRY if name not in _INSTALLED or _INSTALLED[name]())


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
