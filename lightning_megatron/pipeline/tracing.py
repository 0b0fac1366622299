"""The p2p spans every schedule reports, so MegaScan draws a schedule's messages as it draws megatron-core's.

One helper for every schedule that moves tensors itself (MegaDPP, MegaFBD, one registered from outside):
:func:`traced_p2p` runs the send or receive inside the span megatron-core's timers would name
(``forward-send``, ``backward-recv``, ...) and tells the step's observers which message the span moved. The
message's ``seq`` must be the same on both ends (a transport tag is): a tracer pairs sends with receives by it,
whatever order they ran in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_megatron.pipeline.registry import StepEvents

__all__ = ["traced_p2p"]


def traced_p2p(
    events: StepEvents,
    way: str,
    direction: str,
    action: Callable[[], torch.Tensor],
    *,
    peer: int,
    seq: int,
    microbatch: int,
    stage: int,
) -> torch.Tensor:
    """``action()`` (a send or receive returning the tensor it moves) inside the span ``{direction}-{way}``.

    ``way``: ``"send"`` or ``"recv"``; ``direction``: ``"forward"`` (activations) or ``"backward"`` (gradients);
    ``peer``: the other end's global rank; ``seq``: the message's identity on both ends (its tag); ``microbatch``
    and ``stage``: what the message belongs to. Without observers, just ``action()``."""
    if not events.active:
        return action()
    if way not in ("send", "recv") or direction not in ("forward", "backward"):
        raise ValueError(
            f"traced_p2p: way is 'send' or 'recv' and direction 'forward' or 'backward'; got {way!r}, {direction!r}."
        )
    name = f"{direction}-{way}"
    with events.span(name):
        tensor = action()
        record: dict[str, Any] = {
            "peer": peer,
            "bytes": tensor.numel() * tensor.element_size(),
            "seq": seq,
            "direction": direction,
            "microbatch": microbatch,
            "stage": stage,
        }
        events.messages(name, [record] if way == "send" else [], [record] if way == "recv" else [])
    return tensor
