"""What MegaScan sees of context parallelism: ring attention's key/value exchanges, as spans and flows.

Ring attention (``context.ring_attention``) passes each rank's keys and values around the context-parallel ring
while it computes the block in hand, and in the backward the key/value gradients follow them. Those exchanges are
this package's own code, which reports each one to an observer (``set_ring_observer``); this tracer is that
observer for the traced windows only, so untraced steps run without it.

Each exchange is one span (cat ``ring``, named ``ring kv forward`` / ``ring kv backward`` / ``ring dkv backward``)
from its issue to the end of its ``wait()``: on GPUs it overlaps the block's computation, so it is not waiting.
Inside it a ``ring.wait`` span is the time the rank actually blocked in ``wait()`` (its peer's data had not yet
arrived), which detection counts as waiting, as it counts an async collective's wait. The span's ``args`` carry
``sends`` and ``recvs`` in the pipeline messages' format (``{peer, bytes, seq, direction}``, ``direction`` the
span's name, ``seq`` counted per step, peer and direction), so aggregation pairs each send with the receive on
the next rank and draws it as a flow (cat ``ring``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_megatron.context.ring_attention import set_ring_observer
from lightning_megatron.scan.analysis.format import TID
from lightning_megatron.scan.tracing.recorder import Span, SpanRecorder

__all__ = ["RingTracer"]


class RingTracer:
    """``install()`` before a traced window, ``uninstall()`` after; spans go to ``recorder``."""

    def __init__(self, recorder: SpanRecorder, context: dict[str, Any]) -> None:
        self.recorder = recorder
        self.context = context  # the callback keeps context["step"] current
        self._step: Any = None
        self._seq: dict[tuple[int, str, str], int] = {}
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            set_ring_observer(self)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            set_ring_observer(None)
            self._installed = False

    def _next_seq(self, peer: int, kind: str, direction: str) -> int:
        if self.context.get("step") != self._step:
            self._step, self._seq = self.context.get("step"), {}
        key = (peer, kind, direction)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        return seq

    def exchange(self, what: str, send_to: int, recv_from: int, nbytes: int) -> Any:
        if not self.recorder.active:
            return None
        direction = f"ring {what}"
        send = {"peer": send_to, "bytes": nbytes, "seq": self._next_seq(send_to, "send", direction)}
        recv = {"peer": recv_from, "bytes": nbytes, "seq": self._next_seq(recv_from, "recv", direction)}
        args = {
            "step": self.context.get("step"),
            "sends": [{**send, "direction": direction}],
            "recvs": [{**recv, "direction": direction}],
        }
        return self.recorder.open(direction, "ring", TID["communication"], args)

    def wait(self, handle: Any, wait: Callable[[], None]) -> None:
        if not isinstance(handle, Span) or not self.recorder.active:
            wait()
            return
        waiting = self.recorder.open(
            f"{handle.name} wait", "ring.wait", TID["communication"], {"step": handle.args["step"]}
        )
        try:
            wait()
        finally:
            self.recorder.close(waiting)
            self.recorder.close(handle)
