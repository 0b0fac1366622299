"""What the schedules that run over a tagged transport (MegaDPP, MegaFBD) share about it.

* When the strategy is built: :func:`check_keys` (no unknown ``schedule_options``) and
  :func:`check_transport_settings` (a known transport name, a mapping of its arguments), each error naming the key.
* When a session opens: :func:`open_transport` resolves ``"auto"`` (``shm`` when the whole job is on one node,
  ``torch`` otherwise), falls back to host memory where the transport cannot move the device's tensors, creates
  the transport and connects it to the session's peers, closing it again if that fails.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from lightning_megatron.errors import MegatronConfigError

__all__ = ["check_keys", "check_transport_settings", "open_transport"]


def check_keys(schedule: str, raw: Mapping[str, Any], options_class: type) -> None:
    known = {f.name for f in fields(options_class)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise MegatronConfigError(
            f"schedule_options for schedule={schedule!r} has unknown keys {unknown}; the keys are {sorted(known)}."
        )


def check_transport_settings(transport: str, transport_options: Any) -> None:
    from lightning_megatron.transport import available_transports, missing_extra

    if transport != "auto" and transport not in available_transports():
        extra = missing_extra(transport)
        raise MegatronConfigError(
            f"schedule_options.transport={transport!r}: "
            + (
                f"not installed here: {extra}."
                if extra
                else f"choose 'auto' or one of {', '.join(available_transports())}."
            )
        )
    if not isinstance(transport_options, Mapping):
        raise MegatronConfigError("schedule_options.transport_options must be a mapping of transport arguments.")


def open_transport(
    name: str, transport_options: Mapping[str, Any], device: torch.device, timeout: float, peers: Iterable[int]
) -> Any:
    """The session's transport, connected to ``peers`` (each of which opens its own with this rank among its peers)."""
    from lightning_megatron.transport import create_transport, transport_class

    if name == "auto":
        one_node = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())) >= dist.get_world_size()
        name = "shm" if one_node else "torch"
    where = device if device.type in transport_class(name).devices else torch.device("cpu")
    transport = create_transport(name, device=where, timeout=timeout, **dict(transport_options))
    try:
        transport.connect(sorted(peers))
    except BaseException:
        transport.close()
        raise
    return transport
