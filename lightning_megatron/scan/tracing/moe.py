"""What MegaScan sees inside megatron-core's MoE layers: which exchange an all-to-all is, and tokens per expert.

An MoE layer (``MoELayer``) routes its tokens (``router``), sends each to the rank holding its expert (the
*dispatch*: ``token_dispatch``, an all-to-all over the expert-parallel group), runs its local ``experts`` and sends
the results back (the *combine*: ``token_combine``, another all-to-all). The collective tracer
(``scan.tracing.collectives``) already times every ``all_to_all_single``; this module tells it, through the shared
context (``context["moe"]``), which layer's dispatch or combine a call belongs to and in which direction, so the
span reads ``all_to_all layer 3 dispatch forward``. Only module hooks and identity autograd functions, attached
for the traced windows only (as ``scan.tracing.layers``), no replaced function:

* forward: after the ``router`` runs, the layer's next exchanges are its dispatch; when the ``experts`` start,
  none; after they return, its combine; after the layer returns, none again;
* backward: autograd runs the exchanges' backward in reverse, with no Python of ours around them. Identity
  functions placed where the forward crosses those boundaries (the layer's output, the experts' output and input,
  the layer's input) set the label when the gradient passes them: combine backward from the layer's output to
  the experts' output, dispatch backward from the experts' input to the layer's input.

Tokens per expert: the experts receive ``tokens_per_expert`` (per local expert, from every rank of the
expert-parallel group) as a host tensor from the all-to-all and all-gather dispatchers, whose own
synchronisation copied it there; a device tensor (token dropping with padding) is left unread, since reading it
would add a synchronisation. The counts of a step are summed over its microbatches and written as one Chrome
counter event (``ph: "C"``, cat ``moe``) per MoE layer and step, at the step's start, named
``tokens per expert · layer N`` with one series per global expert id (``expert 5``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Optional

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import unwrap_model

from lightning_megatron.scan.tracing.recorder import SpanRecorder

__all__ = ["MoETracer", "counter_name"]


def counter_name(layer: int) -> str:
    return f"tokens per expert · layer {layer}"


class _Label(torch.autograd.Function):
    """The identity; in backward, sets (or clears, ``label`` None) the context's exchange label first."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, context: dict[str, Any], label: Optional[dict[str, Any]]) -> Any:
        ctx.context, ctx.label = context, label
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        ctx.context["moe"] = ctx.label
        return grad, None, None


def _mark(value: Any, context: dict[str, Any], label: Optional[dict[str, Any]]) -> Any:
    """``value`` (a tensor, or a tuple/list holding some) with every tensor that needs a gradient marked."""
    if isinstance(value, torch.Tensor):
        return _Label.apply(value, context, label) if value.requires_grad else value
    if isinstance(value, (tuple, list)):
        return type(value)(_mark(v, context, label) for v in value)
    return value


class MoETracer:
    """``attach(chunks)`` before a traced window, ``detach()`` after; ``counters(events)`` at the window's end."""

    def __init__(self, recorder: SpanRecorder, context: dict[str, Any]) -> None:
        self.recorder, self.context = recorder, context
        self._handles: list[Any] = []
        self._tokens: dict[tuple[Any, int], dict[int, int]] = defaultdict(lambda: defaultdict(int))

    @staticmethod
    def moe_layers(chunks: Sequence[torch.nn.Module]) -> list[tuple[int, torch.nn.Module]]:
        """(layer number, MoE layer) of every transformer layer whose MLP is megatron-core's ``MoELayer``."""
        from megatron.core.transformer.moe.moe_layer import MoELayer

        found = []
        for chunk in chunks:
            for layer in unwrap_model(chunk).modules():
                if isinstance(layer, TransformerLayer) and isinstance(layer.mlp, MoELayer):
                    found.append((int(layer.layer_number), layer.mlp))
        return found

    def attach(self, chunks: Sequence[torch.nn.Module]) -> None:
        if self._handles:
            return
        for number, moe in self.moe_layers(chunks):
            self._hook(number, moe)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.context["moe"] = None

    def _label(self, layer: int, exchange: str, direction: str) -> dict[str, Any]:
        return {"layer": layer, "exchange": exchange, "direction": direction}

    def _hook(self, layer: int, moe: torch.nn.Module) -> None:
        context, label = self.context, self._label
        experts = list(getattr(moe, "local_expert_indices", []))

        def set_label(value: Optional[dict[str, Any]]):  # noqa: ANN202
            def hook(*_: Any) -> None:
                if self.recorder.active:
                    context["moe"] = value

            return hook

        def layer_input(_: Any, args: tuple, kwargs: dict) -> Any:
            if not self.recorder.active:
                return None
            context["moe"] = None
            return _mark(args, context, None), kwargs  # its gradient arriving: the dispatch's backward is done

        def layer_output(_: Any, __: Any, output: Any) -> Any:
            if not self.recorder.active:
                return None
            context["moe"] = None
            return _mark(output, context, label(layer, "combine", "backward"))

        def experts_input(_: Any, args: tuple) -> Any:
            if not self.recorder.active:
                return None
            context["moe"] = None
            if len(args) > 1:
                self._count(layer, experts, args[1])
            return _mark(args, context, label(layer, "dispatch", "backward"))

        def experts_output(_: Any, __: Any, output: Any) -> Any:
            if not self.recorder.active:
                return None
            context["moe"] = label(layer, "combine", "forward")
            return _mark(output, context, None)  # its gradient arriving: the combine's backward is done

        self._handles += [
            moe.register_forward_pre_hook(layer_input, with_kwargs=True),
            moe.register_forward_hook(layer_output),
            moe.router.register_forward_hook(set_label(label(layer, "dispatch", "forward"))),
            moe.experts.register_forward_pre_hook(experts_input),
            moe.experts.register_forward_hook(experts_output),
        ]

    def _count(self, layer: int, experts: list[int], tokens_per_expert: Any) -> None:
        """Add one microbatch's tokens per local expert, if they are on the host already (module docstring)."""
        if not isinstance(tokens_per_expert, torch.Tensor) or tokens_per_expert.device.type != "cpu":
            return
        counts = tokens_per_expert.reshape(-1).tolist()
        ids = experts if len(experts) == len(counts) else list(range(len(counts)))
        per_expert = self._tokens[(self.context.get("step"), layer)]
        for expert, count in zip(ids, counts):
            per_expert[int(expert)] += int(count)

    def counters(self, events: list[dict[str, Any]], rank: int) -> list[dict[str, Any]]:
        """The window's counter events, one per MoE layer and step, at the step's start (its ``step`` span in
        ``events``; a step without one is dropped), and forget them."""
        starts = {e["args"]["step"]: e["ts"] for e in events if e.get("cat") == "step" and "step" in e.get("args", {})}
        out = []
        for (step, layer), per_expert in sorted(self._tokens.items(), key=lambda item: (str(item[0][0]), item[0][1])):
            if step not in starts:
                continue
            args = {f"expert {expert}": count for expert, count in sorted(per_expert.items())}
            out.append(
                {"name": counter_name(layer), "cat": "moe", "ph": "C", "pid": rank, "tid": 0, "ts": starts[step]}
                | {"args": args}
            )
        self._tokens.clear()
        return out
