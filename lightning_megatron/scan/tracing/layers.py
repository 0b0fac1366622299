"""Per-layer spans (``granularity="layer"``: attention and MLP; ``"op"``: every module with parameters).

Module hooks, attached only when asked for: forward pre/post hooks time the forward, full backward
pre/post hooks the backward. Full backward hooks are not free even when they record nothing: they wrap every
part's inputs and outputs in autograd functions, which slows each step they are attached to. MegaScan therefore
attaches them for its traced windows only (``attach``/``detach`` around each window), and chooses ``"layer"``
by default only where nothing else can compare a stage (pure pipeline parallelism).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model

from lightning_megatron.scan.analysis.format import TID
from lightning_megatron.scan.tracing.recorder import Span, SpanRecorder

__all__ = ["Granularity", "LayerTracer", "choose_granularity"]

Granularity = Literal["stage", "layer", "op"]


def choose_granularity(
    setting: Optional[Granularity], pipeline: int, tensor: int, data_parallel: int
) -> tuple[Granularity, str]:
    """The granularity a fit traces at, and why: the user's setting wins; otherwise ``"layer"`` where the ranks
    of a pipeline stage have no peers (no tensor- or data-parallel replica does the same work), because detection
    compares a rank's compute with its stage's peers and, without any, can only compare layer parts across
    stages (a slow stage is otherwise unseen). Layer spans cost a few events per layer and microbatch, so
    layouts with peers keep ``"stage"``."""
    if setting is not None:
        return setting, "set by MegaScan(granularity=...)"
    if pipeline > 1 and tensor * data_parallel == 1:
        return "layer", (
            f"chosen: {pipeline} pipeline stages of one rank each, no peers to compare within a stage, so layer "
            "parts are compared across stages"
        )
    if tensor * data_parallel > 1:
        return "stage", "chosen: every stage has peer ranks to compare with"
    return "stage", "chosen: one process (compared with its own earlier steps)"


class LayerTracer:
    def __init__(self, recorder: SpanRecorder, context: dict[str, Any], ops: bool = False) -> None:
        self.recorder = recorder
        self.context = context
        self.ops = ops
        self.current: Optional[tuple[str, int, int]] = None  # (phase, chunk, microbatch), set by MegaScan
        self._handles: list[Any] = []
        self._open: dict[tuple[int, str], list[Span]] = {}

    def attach(self, chunks: Sequence[torch.nn.Module]) -> None:
        if self._handles:  # attached already
            return
        for chunk in chunks:
            for layer in unwrap_model(chunk).modules():
                if not isinstance(layer, TransformerLayer):
                    continue
                number = int(layer.layer_number)
                parts = {"attention": layer.self_attention, "mlp": layer.mlp}
                if self.ops:
                    parts = {
                        name: module
                        for name, module in layer.named_modules()
                        if name and any(True for _ in module.parameters(recurse=False))
                    }
                for part, module in parts.items():
                    self._hook(module, number, part)

    def _hook(self, module: torch.nn.Module, layer: int, part: str) -> None:
        name = f"layer {layer} {part}"
        cat = "compute.op" if self.ops else "compute.layer"

        def opener(direction: str):  # noqa: ANN202
            def hook(*_: Any) -> None:
                if self.recorder.active:
                    args = {"step": self.context.get("step"), "layer": layer, "part": part, "direction": direction}
                    span = self.recorder.open(f"{name} {direction}", cat, TID["layers"], args)
                    self._open.setdefault((id(module), direction), []).append(span)

            return hook

        def closer(direction: str):  # noqa: ANN202
            def hook(*_: Any) -> None:
                stack = self._open.get((id(module), direction))
                if stack:
                    self.recorder.close(stack.pop())

            return hook

        self._handles += [
            module.register_forward_pre_hook(opener("forward")),
            module.register_forward_hook(closer("forward")),
            module.register_full_backward_pre_hook(opener("backward")),
            module.register_full_backward_hook(closer("backward")),
        ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._open = {}
