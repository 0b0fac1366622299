"""Text generation inside forked ranks (see ``distributed.py``): one model at one layout, many generations.

Every layout builds the same weights (split-invariant init) with a large ``init_method_std``, so greedy
argmax margins dwarf the fp32 differences between layouts' reduction orders.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from cases import TINY_MODEL
from megatron.core import parallel_state
from megatron.core.utils import unwrap_model

from lightning_megatron import MegatronConfigError
from lightning_megatron.models import GenerationStep, GPTModule
from lightning_megatron.models.loading import prepare

MODEL = {**TINY_MODEL, "seq_length": 32, "init_method_std": 0.5}
PROMPTS = [[5, 17, 99], [3, 1, 4, 1, 5, 9, 2], [42], [7, 7, 7, 7, 8]]
NEW_TOKENS = 6
SAMPLING = {"temperature": 0.9, "top_k": 40, "top_p": 0.9}


def build_module(world_size: int, precision: str = "32-true", **strategy: Any) -> GPTModule:
    """A GPTModule whose chunks are built (and identical across layouts), without training."""
    module = GPTModule(**MODEL)
    prepare(
        module, devices=world_size, accelerator="cpu", precision=precision, strategy_options={"timeout": 60}, **strategy
    )
    return module


class Recorder:
    """An ``on_token`` callback that keeps every step; votes to stop at ``stop_at`` (on this rank)."""

    def __init__(self, stop_at: Optional[int] = None) -> None:
        self.stop_at = stop_at
        self.steps: list[dict[str, Any]] = []

    def __call__(self, step: GenerationStep) -> bool:
        self.steps.append(
            {
                "position": step.position,
                "tokens": step.tokens.tolist(),
                "in_prompt": step.in_prompt.tolist(),
                "done": step.done.tolist(),
                "logits": None if step.logits is None else step.logits.clone(),
            }
        )
        return self.stop_at is not None and step.position >= self.stop_at


def _errors(module: GPTModule) -> dict[str, str]:
    """Each bad argument's error message (every rank must raise before any collective)."""
    bad: dict[str, tuple[Any, int, dict[str, Any]]] = {
        "no prompts": ([], 4, {}),
        "empty prompt": ([[1, 2], []], 4, {}),
        "prompt too long": ([list(range(40))], 1, {}),
        "too many new tokens": (PROMPTS, 30, {}),
        "token outside vocab": ([[1, 200]], 4, {}),
        "float tensor": (torch.zeros(2, 3), 4, {}),
        "text prompt": ("hello", 4, {}),
        "top_p zero": (PROMPTS, 4, {"top_p": 0.0}),
        "top_p above one": (PROMPTS, 4, {"top_p": 1.5}),
        "negative temperature": (PROMPTS, 4, {"temperature": -1.0}),
        "negative top_k": (PROMPTS, 4, {"top_k": -3}),
        "eos outside vocab": (PROMPTS, 4, {"eos_id": 128}),
        "negative max_new_tokens": (PROMPTS, -1, {}),
    }
    messages = {}
    for name, (prompts, new, options) in bad.items():
        try:
            module.generate(prompts, new, **options)
        except MegatronConfigError as err:
            messages[name] = str(err)
        else:
            messages[name] = "no error"
    return messages


def generation_case(world_size: int, **strategy: Any) -> dict[str, Any]:
    module = build_module(world_size, **strategy)
    chunks = [unwrap_model(c) for c in module.model_chunks]
    results: dict[str, Any] = {
        "rank": dist.get_rank(),
        "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    }

    # What forward pre-hooks (MegaScope's capture) see: keyword position_ids on every chunk of every stage.
    seen: list[tuple[int, Any]] = []

    def hook(chunk: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        positions = kwargs.get("position_ids")
        seen.append((chunks.index(chunk), None if positions is None else (positions.dtype, positions.tolist())))

    handles = [c.register_forward_pre_hook(hook, with_kwargs=True) for c in chunks]
    module.model_chunks.train()
    greedy_steps = Recorder()
    greedy = module.generate(PROMPTS, NEW_TOKENS, temperature=0, on_token=greedy_steps)
    for handle in handles:
        handle.remove()
    results["training_restored"] = all(m.training for c in chunks for m in c.modules())
    module.model_chunks.eval()
    results["greedy"] = greedy
    results["greedy_steps"] = greedy_steps.steps
    results["hook_positions"] = seen

    recompute_steps = Recorder()
    results["greedy_recompute"] = module.generate(
        PROMPTS, NEW_TOKENS, temperature=0, kv_cache=False, on_token=recompute_steps
    )
    results["recompute_steps"] = recompute_steps.steps
    results["alone"] = [module.generate([p], NEW_TOKENS, temperature=0).tokens[0] for p in PROMPTS]
    results["eval_kept"] = not any(m.training for c in chunks for m in c.modules())

    square = torch.tensor([[11, 22, 33], [44, 55, 66]])
    results["tensor_prompts"] = module.generate(square, 4, temperature=0).as_tensor().tolist()

    results["sampled"] = module.generate(PROMPTS, NEW_TOKENS, seed=3, **SAMPLING).tokens
    results["sampled_again"] = module.generate(PROMPTS, NEW_TOKENS, seed=3, **SAMPLING).tokens
    results["sampled_other_seed"] = module.generate(PROMPTS, NEW_TOKENS, seed=4, **SAMPLING).tokens
    results["tiny_top_p"] = module.generate(PROMPTS, NEW_TOKENS, seed=5, temperature=1.0, top_p=1e-6).tokens

    # Stop votes from one rank only (global rank 0: the first pipeline stage) stop every rank.
    stop_at = min(len(p) for p in PROMPTS) + 2
    stopping = Recorder(stop_at if dist.get_rank() == 0 else None)
    results["stopped"] = module.generate(PROMPTS, NEW_TOKENS, temperature=0, on_token=stopping)
    results["stopped_positions"] = [s["position"] for s in stopping.steps]

    # eos: the first prompt's third greedy token ends that row; the batch ends when every row has ended.
    eos = greedy.continuations[0][2]
    results["eos_id"] = eos
    results["eos_single"] = module.generate([PROMPTS[0]], NEW_TOKENS, temperature=0, eos_id=eos)
    results["eos_batch"] = module.generate(PROMPTS, NEW_TOKENS, temperature=0, eos_id=eos)

    results["errors"] = _errors(module)
    return results


def half_precision_case(world_size: int, **strategy: Any) -> dict[str, Any]:
    """bf16 weights: activations cross the pipeline in bf16; the logits handed to callbacks are fp32."""
    module = build_module(world_size, precision="bf16-mixed", **strategy)
    steps = Recorder()
    greedy = module.generate(PROMPTS, NEW_TOKENS, temperature=0, on_token=steps)
    logits = [s["logits"] for s in steps.steps if s["logits"] is not None]
    return {
        "greedy": greedy,
        "params_dtype": str(next(module.parameters()).dtype),
        "logits_dtypes": sorted({str(t.dtype) for t in logits}),
    }
