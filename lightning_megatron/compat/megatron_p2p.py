"""Which pipeline messages megatron-core's schedules really send and receive, told to the step's listeners.

Why this exists: megatron-core names its pipeline timers after the *call* (``forward-send-forward-recv``), not after
what the call moves. At the ends of the pipeline and between virtual stages the same call sends without receiving,
receives without sending, or moves nothing, so a tracer that infers messages from timer names pairs sends with the
wrong receives (on PP2 × VPP2, 71–82 of ~170 flows came out "received before sent"). Here the private
``P2PCommunicator._communicate`` (megatron-core 0.16) is wrapped while a :class:`P2PMessages` listener is installed,
and each call reports the operations it posted (peer, bytes, direction, a sequence number per peer and direction
that both ends count alike, and for sends the chunk and microbatch last announced) through the timers'
``messages`` call, the one schedules with their own transports (MegaDPP, MegaFBD) use. Drop it when megatron-core
reports its messages itself. Listed in :mod:`.inventory`; restored by :func:`uninstall`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

__all__ = ["P2PMessages", "follow", "install", "uninstall"]

_ORIGINAL = P2PCommunicator._communicate
_ACTIVE: Optional[P2PMessages] = None


class P2PMessages:
    """A step listener (``strategy.listeners.StepListener``'s interface; not a subclass, so that this module
    imports nothing of the strategy's) keeping what the wrapper needs: the open pipeline span, the last microbatch
    of each phase, the counters."""

    nesting = -1  # outside the tracers: a span's messages are known before a tracer closes it
    graph_safe = True  # host bookkeeping only; a step replayed as a CUDA graph has no pipeline messages (PP 1)

    def __init__(self) -> None:
        self.open: Optional[str] = None
        self.sends: list[dict[str, Any]] = []
        self.recvs: list[dict[str, Any]] = []
        self.last: dict[str, tuple[int, int]] = {}
        self._seq: dict[tuple[int, str, str], int] = {}

    def span_start(self, name: str) -> None:
        if name.endswith(("-send", "-recv")):  # megatron-core's pipeline timers: forward-send-backward-recv, ...
            self.open, self.sends, self.recvs = name, [], []

    def span_stop(self, name: str) -> None:
        if name == self.open:
            self.open = None

    def microbatch(self, phase: str, chunk: int, microbatch: int) -> None:
        self.last[phase] = (chunk, microbatch)

    def p2p_messages(self, name: str, sends: list[dict[str, Any]], recvs: list[dict[str, Any]]) -> None:
        pass

    def graph_capture(self, started: bool) -> None:
        pass

    def graph_replay(self, started: bool) -> None:
        pass

    def record(self, way: str, peer: int, direction: str, tensor: Optional[torch.Tensor]) -> dict[str, Any]:
        key = (peer, way, direction)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
        message: dict[str, Any] = {"peer": peer, "bytes": nbytes, "seq": seq, "direction": direction}
        if way == "send" and direction in self.last:  # what is sent is what the last task of its phase produced
            message["chunk"], message["microbatch"] = self.last[direction]
        return message


def _communicate(self: P2PCommunicator, **kwargs: Any) -> Any:
    result = _ORIGINAL(self, **kwargs)
    recorder = _ACTIVE
    timers = self.config.timers
    if recorder is None or recorder.open is None or timers is None or not hasattr(timers, "messages"):
        return result
    received_prev, received_next = result[0], result[1]
    if kwargs.get("tensor_send_next") is not None:
        recorder.sends.append(recorder.record("send", self.next_rank, "forward", kwargs["tensor_send_next"]))
    if kwargs.get("tensor_send_prev") is not None:
        recorder.sends.append(recorder.record("send", self.prev_rank, "backward", kwargs["tensor_send_prev"]))
    if kwargs.get("recv_prev"):
        recorder.recvs.append(recorder.record("recv", self.prev_rank, "forward", received_prev))
    if kwargs.get("recv_next"):
        recorder.recvs.append(recorder.record("recv", self.next_rank, "backward", received_next))
    timers.messages(recorder.open, list(recorder.sends), list(recorder.recvs))
    return result


def install(recorder: P2PMessages) -> None:
    """Report megatron-core's pipeline messages to ``recorder``'s span (one recorder per process at a time)."""
    global _ACTIVE
    _ACTIVE = recorder
    P2PCommunicator._communicate = _communicate


def uninstall(recorder: P2PMessages) -> None:
    global _ACTIVE
    if _ACTIVE is recorder:
        _ACTIVE = None
        P2PCommunicator._communicate = _ORIGINAL


def follow(listeners: list[Any], recorder: Optional[P2PMessages], active: bool = True) -> Optional[P2PMessages]:
    """Keep a recorder at the front of ``listeners`` (installed) while they hold a listener of the user's and
    ``active``; remove and uninstall it otherwise. Returns the recorder in use (or None)."""
    wanted = active and any(not isinstance(listener, P2PMessages) for listener in listeners)
    if wanted and recorder is None:
        recorder = P2PMessages()
        install(recorder)
        listeners.insert(0, recorder)
    elif not wanted and recorder is not None:
        uninstall(recorder)
        if recorder in listeners:
            listeners.remove(recorder)
        recorder = None
    return recorder
