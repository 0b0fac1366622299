"""How MegaFBD's ranks are wired: message kinds and tags, who talks to whom, and the link between partners.

* A message's tag packs ``(step, kind, backward replica, microbatch, part)``; the kinds are the constants below.
* :func:`forward_stages`: which stages' forwards the forward replicas run (all in ship mode; in recompute mode all
  but the last, whose output feeds nobody, unless the model has dropout).
* :func:`peers`: every rank a rank exchanges messages with (each pair lists the other, as ``connect`` needs).
* :func:`calibrate`: latency and bandwidth between partners, measured when the session opens, for the
  performance model.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_megatron.pipeline.fbd.roles import Roles
from lightning_megatron.transport import Transport

__all__ = ["CALIBRATE", "dropout_of", "calibrate", "forward_stages", "message_tag", "peers"]

# Message kinds.
ITEM, STAGE_INPUT, RNG, HEADER, DATA, LOSS, CREDIT, ACTIVATION, GRADIENT, SHAPE, CALIBRATE = range(11)
_CALIBRATION_BYTES = (4096, 256 * 2**20)
"""A latency probe and a bandwidth probe (large enough that the link, not the host, takes most of its time)."""
_CALIBRATION_ROUNDS = 3


def message_tag(step: int, kind: int, replica: int, microbatch: int, part: int = 0) -> int:
    return ((((step % 2**20) * 16 + kind) * 2**10 + replica) * 2**16 + microbatch) * 2**8 + part


def dropout_of(config: Any) -> float:
    """The largest dropout probability of megatron-core's ``TransformerConfig`` (0: recomputes draw no masks)."""
    return max(config.hidden_dropout or 0.0, config.attention_dropout or 0.0)


def forward_stages(mode: str, stages: int, dropout: float) -> int:
    """The stages whose forward the forward replicas run: all in ship mode; in recompute mode all but the last
    (its output feeds nobody), unless the model has dropout: then the last one too, so that every backward stage
    recomputes under the RNG state its forward ran with (its masks are the forward's)."""
    return stages if mode == "ship" or dropout > 0 else stages - 1


def peers(roles: Roles, mode: str, forward_stages: int) -> set[int]:
    """Every rank this one exchanges messages with (each pair lists the other)."""
    ship, stage, stages = mode == "ship", roles.stage, roles.stages
    peers: set[int] = set()
    if roles.is_forward:
        if stage < forward_stages:
            for b in roles.partners():
                peers.add(roles.rank(b, stage))
                if not ship and stage + 1 < stages:
                    peers.add(roles.rank(b, stage + 1))
            if stage > 0:
                peers.add(roles.rank(roles.replica, stage - 1))
            if stage + 1 < forward_stages:
                peers.add(roles.rank(roles.replica, stage + 1))
    else:
        for feeder in roles.feeders(roles.replica):
            if stage < forward_stages:
                peers.add(roles.rank(feeder, stage))
            if not ship and stage > 0:
                peers.add(roles.rank(feeder, stage - 1))
        if stage > 0:
            peers.add(roles.rank(roles.replica, stage - 1))
        if stage < stages - 1:
            peers.add(roles.rank(roles.replica, stage + 1))
    peers.discard(dist.get_rank())
    return peers


def _calibration_partner(
    roles: Roles, backward_replica: int, stage: int, forward_stages: int
) -> Optional[tuple[int, int]]:
    """``(forward replica, stage)`` that backward rank ``(backward_replica, stage)`` times the link against (the
    feeder of its first microbatch)."""
    feeder = roles.feeder(backward_replica, 0)
    if stage < forward_stages:
        return feeder, stage
    if stage > 0:
        return feeder, stage - 1
    return None


def calibrate(roles: Roles, forward_stages: int, transport: Transport, timeout: float) -> tuple[float, float]:
    """Latency and bandwidth between partners: round trips of a small and a large message, median of a few."""
    device = transport.device
    parts = range(len(_CALIBRATION_BYTES) * _CALIBRATION_ROUNDS)
    if roles.is_forward:
        for b in roles.partners():
            for stage in (roles.stage, roles.stage + 1):
                partner = _calibration_partner(roles, b, stage, forward_stages) if stage < roles.stages else None
                if partner == (roles.replica, roles.stage):
                    peer = roles.rank(b, stage)
                    for part in parts:
                        echo = transport.recv(peer, message_tag(0, CALIBRATE, b, 0, part), timeout=timeout)
                        transport.isend(peer, message_tag(0, CALIBRATE, b, 1, part), echo).wait(timeout)
        return 0.0, float("inf")
    partner = _calibration_partner(roles, roles.replica, roles.stage, forward_stages)
    if partner is None:
        return 0.0, float("inf")
    peer = roles.rank(*partner)
    seconds: dict[int, list[float]] = {}
    for part in parts:
        nbytes = _CALIBRATION_BYTES[part % len(_CALIBRATION_BYTES)]
        payload = torch.ones(nbytes, dtype=torch.uint8, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        transport.isend(peer, message_tag(0, CALIBRATE, roles.replica, 0, part), payload)
        echo = transport.recv(peer, message_tag(0, CALIBRATE, roles.replica, 1, part), timeout=timeout)
        if echo.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.setdefault(nbytes, []).append((time.perf_counter() - start) / 2)
    small, large = (sorted(seconds[n])[len(seconds[n]) // 2] for n in _CALIBRATION_BYTES)
    extra = _CALIBRATION_BYTES[1] - _CALIBRATION_BYTES[0]
    return small, extra / max(large - small, large / 2, 1e-9)
