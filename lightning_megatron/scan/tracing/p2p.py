"""The identity of a traced step's pipeline messages: which peer, which direction, how many bytes, which one.

Contract: ``P2PMessages.begin_step(strategy, batch)`` at each traced step's start; ``args(timer, step)`` gives the
``args`` of the span of one of megatron-core's point-to-point timers (``P2P_TIMERS``): its ``sends`` and ``recvs``,
each ``{"peer", "bytes", "seq", "direction"}``. ``seq`` counts the messages of one (peer, kind, direction) from the
step's start, so the n-th send of one stage and the n-th receive of its neighbour pair up into a flow arrow in
the trace (``scan.analysis``). It is a guess by order (first in, first out); a schedule that knows its messages
replaces it (``MegaScan.p2p_messages``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core import parallel_state
from megatron.core.utils import get_model_config

from lightning_megatron.strategy.listeners import P2P_TIMERS
from lightning_megatron.strategy.microbatch import infer_seq_length

__all__ = ["P2PMessages", "activation_bytes"]


class P2PMessages:
    def __init__(self) -> None:
        self.bytes: Optional[int] = None
        self._seq: dict[tuple[int, str, str], int] = {}

    def begin_step(self, strategy: Any, batch: Any) -> None:
        self.bytes = activation_bytes(strategy, batch)
        self._seq = {}

    def args(self, timer: str, step: int) -> dict[str, Any]:
        neighbours = {
            "next": parallel_state.get_pipeline_model_parallel_next_rank(),
            "prev": parallel_state.get_pipeline_model_parallel_prev_rank(),
        }
        sends, recvs = P2P_TIMERS[timer]

        def messages(kind: str, ends: list[tuple[str, str]]) -> list[dict[str, Any]]:
            out = []
            for neighbour, direction in ends:
                peer = neighbours[neighbour]
                key = (peer, kind, direction)
                seq = self._seq.get(key, 0)
                self._seq[key] = seq + 1
                out.append({"peer": peer, "bytes": self.bytes, "seq": seq, "direction": direction})
            return out

        return {"step": step, "sends": messages("send", sends), "recvs": messages("recv", recvs)}


def activation_bytes(strategy: Any, batch: Any) -> Optional[int]:
    """Bytes of one activation between pipeline stages: [seq (/ TP with SP), micro-batch, hidden]; None when the
    batch does not say its sequence length."""
    config = get_model_config(strategy.wrapped_chunks[0])
    try:
        seq = infer_seq_length(batch)
    except (TypeError, ValueError):
        return None
    if config.sequence_parallel:
        seq //= config.tensor_model_parallel_size
    dtype = config.pipeline_dtype or torch.float32
    return seq * strategy.micro_batch_size * config.hidden_size * torch.finfo(dtype).bits // 8
