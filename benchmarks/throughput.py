"""Training throughput: this strategy (per layer spec) vs a raw megatron-core loop vs plain `transformers`.

    python benchmarks/throughput.py --out benchmarks/results/throughput/throughput.json       # every case that fits
    python benchmarks/throughput.py --only gpt-1.3b/tp2 --profile profile.txt      # + torch.profiler tables
    python benchmarks/throughput.py --only gpt2-medium/1gpu --runners strategy-sdpa hf
    python benchmarks/throughput.py --cpu-dry-run --out /tmp/throughput.json        # tiny shapes, checks plumbing
    python benchmarks/throughput.py --only gpt-1.3b/tp2 --runners strategy-sdpa --fusion-ab   # A/B in one fit
    python benchmarks/throughput.py --only gpt2-medium/1gpu --runners strategy-sdpa hf-bf16 --repeat 3 \
        --variants '{"": {}, "-eager": {"strategy_options": {"cuda_graphs": false}}}'  # alternated, medians

FP8 (torchao float8 GEMMs, ``fp8_recipe``): the strategy in bf16, tensorwise and rowwise against the plain PyTorch
peers, Llama 0.85B on one GPU, alternated over three rounds (six launches a round)::

    python benchmarks/throughput.py --only llama-0.85b/1gpu --repeat 3 \
        --runners strategy-sdpa hf-compile hf-fp8-tensorwise hf-fp8-rowwise \
        --variants '{"": {}, "-fp8": {"strategy_options": {"fp8_recipe": "tensorwise"}},
                     "-fp8-rowwise": {"strategy_options": {"fp8_recipe": "rowwise"}}}' \
        --baseline strategy-sdpa hf-compile --out benchmarks/results/throughput/fp8_llama-0.85b.json

and the 1.3B GPT at TP2 and at PP2 (two GPUs; the strategy alone: the peers are single-GPU)::

    python benchmarks/throughput.py --only gpt-1.3b/tp2 gpt-1.3b/pp2 --repeat 3 --runners strategy-sdpa \
        --variants '{"": {}, "-fp8": {"strategy_options": {"fp8_recipe": "tensorwise"}},
                     "-fp8-rowwise": {"strategy_options": {"fp8_recipe": "rowwise"}}}' \
        --baseline strategy-sdpa --out benchmarks/results/throughput/fp8_gpt-1.3b.json

A launch too long for one sitting runs as ``--repeat 1`` several times with ``--append``: the rounds (and the
alternation of their order) go on in the same ``--out``.

Every case runs in its own processes (``torchrun --standalone``), one after another, so runs do not share
memory or caches. Each reports the median step time over the measured steps (after warm-up), tokens per
second, model TFLOP/s per GPU by Megatron-LM's formula (``num_floating_point_operations``), and the peak
memory of the busiest GPU.

``--variants`` runs the strategy (and raw-loop) runners under several settings in one launch (strategy and module
arguments, ``TransformerConfig`` overrides, environment variables such as NCCL's), ``--repeat N`` goes
over all cases N times, reversing the order every other round (GPU speed drifts between machines and over
minutes: ratios are only fair within a launch, and alternation spreads the drift). A run then reports the medians
over its rounds (each round kept under ``rounds``), and ``ratios_to_<baseline>`` the per-round TFLOP/s ratios to
each ``--baseline`` run (default ``hf-bf16``; a runner and its variant label, e.g. ``strategy-sdpa-fp8``) with their
median.

``--fusion-ab``: the strategy runners alternate blocks of two steps without and with
``gradient_accumulation_fusion`` in one fit (the weight-gradient GEMM accumulating into fp32 ``main_grad``), so
the two are compared on one model in one launch; both medians and the speed-up are reported. Eager steps only
(``{"cuda_graphs": false, "gradient_accumulation_fusion": false}`` in ``--strategy-options``): a graph keeps the
layers it was captured with; for graphed steps compare two ``--variants``.

Runners:
* ``strategy-<spec>``: ``Trainer(strategy=MegatronAppStrategy(...))`` with ``GPTModule(layer_spec=<spec>)``, with
  the defaults: on one GPU the step replayed as a CUDA graph, and with it the fused norms and bias gradients and
  the weight-gradient GEMM accumulating into ``main_grad`` (``cuda_graphs=False`` in ``--strategy-options`` for
  the eager step).
* ``mcore-<spec>``: the same model in a hand-written megatron-core loop (``get_forward_backward_func`` +
  megatron-core DDP + megatron-core optimizer), the baseline the strategy must match (≥ 0.98×).
* ``hf``: ``transformers``' own model (``GPT2LMHeadModel``, or ``LlamaForCausalLM`` for the Llama shape) with SDPA
  attention, autocast bf16 (fp32 weights and optimizer, the same numerics as the other runners) and fused AdamW
  (1 GPU only); vocabulary padded to a multiple of 128 like megatron-core's, so every runner does the same FLOPs.
* ``hf-bf16``: the same with bf16 weights and optimizer states and no autocast: the fastest plain PyTorch
  loop (at the cost of bf16 weight updates).
* ``hf-compile``, ``hf-fp8-<recipe>`` (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``): the plain PyTorch
  peers of the FP8 runs, as torchtitan runs plain PyTorch: the ``hf`` model and loop (autocast bf16 over fp32
  weights: torchtitan's FSDP2 mixed precision on one GPU), every transformer block compiled on its own
  (``torch.compile``, as torchtitan compiles: one graph for all the identical blocks) and the loss compiled, and
  for ``hf-fp8-<recipe>`` torchao's ``convert_to_float8_training`` with that recipe on every linear layer but the
  output layer. ``hf-compile`` is the same without float8, the peers' bf16 baseline. Not in the default
  ``--runners``. With ``--cpu-dry-run`` nothing is compiled and torchao emulates the float8 GEMMs.

Models: GPT-2-medium and a Llama-style 0.85B (RMSNorm, SwiGLU, RoPE, GQA, no biases) on one GPU, the 1.3B GPT at
TP2, PP2 and TP2 × PP2. The strategy runners use ``GPTModule(fuse_kernels=True)`` (the default: the fused
bias-activation, this project's single-pass cross-entropy and fused RoPE); the raw loop megatron-core's own fusions
(``bias_activation_fusion``, ``cross_entropy_loss_fusion``). ``--module-options`` and ``--overrides`` switch single
pieces off for an ablation, ``--label`` names such runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)
from throughput_runners import MEASURED, PEER_RECIPES, WARMUP, is_llama, worker  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: model shape, batch, and the layouts to run it at (name: (GPUs, TP, PP)).
MODELS: dict[str, dict[str, Any]] = {
    "gpt2-medium": dict(
        num_layers=24,
        hidden_size=1024,
        num_attention_heads=16,
        seq_length=1024,
        vocab_size=50257,
        micro_batch_size=8,
        num_microbatches=4,
        layouts={"1gpu": (1, 1, 1), "dp2": (2, 1, 1)},
    ),
    # Llama-style (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied output layer): 0.85B parameters.
    "llama-0.85b": dict(
        style="llama",
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=5632,
        seq_length=2048,
        vocab_size=32000,
        micro_batch_size=4,
        num_microbatches=4,
        layouts={"1gpu": (1, 1, 1)},
    ),
    # Mixtral-style (Llama with 8 experts, top-2, in every layer): 1.2B parameters, 0.4B active per token. At one GPU
    # and DP2; expert parallelism is a variant (--variants '{"-ep2": {"strategy_options":
    # {"expert_model_parallel_size": 2}}}'). Its dense peer of equal active FLOPs is "llama-moe-active".
    "mixtral-1.2b": dict(
        style="llama",
        num_layers=16,
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=2816,
        moe=dict(num_moe_experts=8, moe_router_topk=2),
        seq_length=2048,
        vocab_size=32000,
        micro_batch_size=4,
        num_microbatches=4,
        layouts={"1gpu": (1, 1, 1), "dp2": (2, 1, 1)},
    ),
    # The dense model a token of "mixtral-1.2b" costs as much as: each MLP the width of its two experts together.
    "llama-moe-active": dict(
        style="llama",
        num_layers=16,
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=4,
        ffn_hidden_size=2 * 2816,
        seq_length=2048,
        vocab_size=32000,
        micro_batch_size=4,
        num_microbatches=4,
        layouts={"1gpu": (1, 1, 1), "dp2": (2, 1, 1)},
    ),
    "gpt-1.3b": dict(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=2048,
        vocab_size=50257,
        micro_batch_size=4,
        num_microbatches=8,
        layouts={"tp2": (2, 2, 1), "pp2": (2, 1, 2), "tp2-pp2": (4, 2, 2)},
    ),
}
DRY_RUN_MODEL = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    seq_length=64,
    vocab_size=500,
    micro_batch_size=2,
    num_microbatches=2,
    layouts={"1gpu": (1, 1, 1), "tp2": (2, 2, 1)},
)
DRY_RUN_LLAMA = dict(
    style="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=176,
    seq_length=64,
    vocab_size=500,
    micro_batch_size=2,
    num_microbatches=2,
    layouts={"1gpu": (1, 1, 1)},
)
DRY_RUN_MOE = {**DRY_RUN_LLAMA, "moe": dict(num_moe_experts=4, moe_router_topk=2), "layouts": {"dp2": (2, 1, 1)}}
RUNNERS = ["strategy-local", "strategy-sdpa", "mcore-local", "mcore-sdpa", "hf", "hf-bf16"]
# The plain PyTorch peers of the FP8 runs (torchtitan's way: compiled blocks, torchao float8), by name only.
PEERS = ["hf-compile", *(f"hf-fp8-{recipe}" for recipe in PEER_RECIPES)]


def _check_runners(runners: list[str]) -> None:
    """Every ``transformers`` runner name is one this script has (a typo would otherwise fail in each worker)."""
    unknown = [r for r in runners if r.startswith("hf") and r not in ("hf", "hf-bf16", *PEERS)]
    unknown += [r for r in runners if not r.startswith(("hf", "strategy-", "mcore-"))]
    if unknown:
        raise SystemExit(
            f"--runners: unknown {unknown}; use strategy-<layer spec>, mcore-<layer spec>, hf, hf-bf16 or one of "
            f"{PEERS}"
        )


def model_flops_per_step(m: dict[str, Any], global_batch: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for a GPT (GQA, SwiGLU, vocab padded to 128); for an MoE model
    the MLP FLOPs a token really costs (its ``moe_router_topk`` experts, as Megatron-LM counts them) and the router."""
    h, layers, s = m["hidden_size"], m["num_layers"], m["seq_length"]
    heads = m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    ffn = m.get("ffn_hidden_size") or 4 * h
    moe = m.get("moe") or {}
    if moe:  # the experts a token goes to, plus the router's [h, experts] GEMM (a third of a two-GEMM MLP's share)
        ffn = moe.get("moe_ffn_hidden_size", ffn) * moe["moe_router_topk"] + moe["num_moe_experts"] / 3
    gated = 1.5 if is_llama(m) else 1.0  # SwiGLU: three ffn-wide GEMMs instead of two
    vocab = -(-m["vocab_size"] // 128) * 128
    attention = 1 + groups / heads + s / h
    return 12 * global_batch * s * layers * h * h * (attention + ffn / h * gated + vocab / (2 * layers * h))


def _launch(
    name: str, layout: str, runner: str, model: dict, workdir: Path, options: dict[str, Any], label: str = ""
) -> dict[str, Any]:
    """One case in its own processes; ``label`` names its variant (in the profile's heading). The variant's ``env``
    is added to the processes' environment: NCCL, for one, reads its settings when it starts."""
    gpus, tp, pp = model["layouts"][layout]
    result_dir = Path(tempfile.mkdtemp(prefix=f"{name}-{layout}-{runner}-", dir=workdir))
    spec = {"runner": runner, "model": model, "layout": (gpus, tp, pp), "result_dir": str(result_dir), **options}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        __file__,
        "--worker-spec",
        json.dumps(spec),
    ]
    env = {**os.environ, **{k: str(v) for k, v in (options.get("env") or {}).items()}}
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    profile = result_dir / "profile.txt"
    if profile.exists():
        with open(options["profile"], "a") as out:
            out.write(f"\n===== {name}/{layout}/{runner}{label} =====\n{profile.read_text()}\n")
    ranks = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != gpus:
        log = proc.stdout + proc.stderr
        # the worker's own exceptions (torchrun's report of the failure comes after them and says less)
        return {"error": f"exit {proc.returncode}", "raised": raised_exceptions(log)[-8:], "log_tail": log[-3000:]}
    step = statistics.median(max(r["step_seconds"][i] for r in ranks) for i in range(len(ranks[0]["step_seconds"])))
    dp = gpus // (tp * pp)
    gbs = model["micro_batch_size"] * model["num_microbatches"] * dp
    ab = {}
    if all("fused_step_seconds" in r for r in ranks):
        fused = statistics.median(
            max(r["fused_step_seconds"][i] for r in ranks) for i in range(len(ranks[0]["fused_step_seconds"]))
        )
        ab = {
            "fusion_ab": {
                "without_s": step,
                "with_s": fused,
                "speedup": step / fused,
                "alternated": "blocks of 2 steps",
            }
        }
    return {
        **ab,
        "gpus": gpus,
        "tp": tp,
        "pp": pp,
        "global_batch_size": gbs,
        "step_seconds_median": step,
        "tokens_per_second": gbs * model["seq_length"] / step,
        "model_tflops_per_gpu": model_flops_per_step(model, gbs) / step / gpus / 1e12,
        "peak_memory_gib": max(r["peak_memory_gib"] for r in ranks),
        **({"symmetric_all_reduce": ranks[0]["symmetric_all_reduce"]} if "symmetric_all_reduce" in ranks[0] else {}),
    }


def raised_exceptions(log: str) -> list[str]:
    """The exception line that ends each Python traceback in ``log`` (whatever the exception's class is called:
    dynamo's ``FailOnRecompileLimitHit`` has no "Error" in its name), with torch's ``[rankN]:`` prefix removed."""
    raised, in_traceback = [], False
    for line in log.splitlines():
        line = re.sub(r"^\[rank\d+\]: ?", "", line)
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line.startswith((" ", "\t")):
            raised.append(line)
            in_traceback = False
    return raised


def _takes(runner: str, key: str) -> bool:
    """Which runners an option applies to: ``overrides`` and ``env`` to the megatron-core ones too, the others to the
    strategy only."""
    return not runner.startswith("hf") if key in ("overrides", "env") else runner.startswith("strategy")


def _variant_options(options: dict[str, Any], extra: dict[str, Any], runner: str) -> dict[str, Any]:
    """The launch options of one variant: its settings merged over the command line's."""
    unknown = set(extra) - {"overrides", "strategy_options", "module_options", "env"}
    if unknown:
        raise SystemExit(
            f"--variants: unknown keys {sorted(unknown)}; use overrides, strategy_options, module_options, env"
        )
    merged = dict(options)
    for key, value in extra.items():
        merged[key] = {**(options.get(key) or {}), **(value or {})} if _takes(runner, key) else options.get(key)
    return merged


def _summarised(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's rounds: the single result as it is, or medians over the rounds that did not fail."""
    if len(results) == 1:
        return results[0]
    good = [r for r in results if "error" not in r]
    summary: dict[str, Any] = {"rounds": results}
    if good:
        for key in ("step_seconds_median", "tokens_per_second", "model_tflops_per_gpu"):
            summary[key] = statistics.median(r[key] for r in good)
        summary["peak_memory_gib"] = max(r["peak_memory_gib"] for r in good)
        keys = ("gpus", "tp", "pp", "global_batch_size", "overrides", "strategy_options", "module_options")
        keys += ("symmetric_all_reduce",)
        summary.update({k: good[0][k] for k in keys if k in good[0]})
    if len(good) < len(results):
        summary["failed_rounds"] = len(results) - len(good)
    return summary


def _shown(result: dict[str, Any]) -> str:
    shown = result.get("error") or (
        f"{result['tokens_per_second']:9.0f} tok/s {result['model_tflops_per_gpu']:7.1f} TFLOP/s/GPU "
        f"{result['peak_memory_gib']:6.1f} GiB"
    )
    if "fusion_ab" in result:
        shown += f"  with gradient_accumulation_fusion: {result['fusion_ab']['speedup']:.3f}x"
    if "symmetric_all_reduce" in result:
        shown += f"  symmetric all-reduces {result['symmetric_all_reduce']}"
    return shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="cases as model/layout, e.g. gpt2-medium/1gpu")
    parser.add_argument("--runners", nargs="*", default=RUNNERS)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU: checks the plumbing only")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/throughput/throughput.json")
    parser.add_argument("--append", action="store_true", help="add to the runs already in --out")
    parser.add_argument("--profile", type=Path, help="append a torch.profiler table of each run to this file")
    parser.add_argument(
        "--overrides", type=json.loads, help="TransformerConfig fields (JSON) for the strategy and mcore runners"
    )
    parser.add_argument(
        "--strategy-options",
        type=json.loads,
        help='MegatronAppStrategy arguments (JSON) for the strategy runners, e.g. {"gradient_accumulation_fusion": true}',
    )
    parser.add_argument(
        "--module-options",
        type=json.loads,
        help='GPTModule arguments (JSON) for the strategy runners, e.g. {"fused_cross_entropy": false}',
    )
    parser.add_argument(
        "--fusion-ab",
        action="store_true",
        help="strategy runners: alternate blocks of steps without and with gradient_accumulation_fusion in one fit",
    )
    parser.add_argument("--label", default="", help="suffix of the run names, e.g. for runs with --overrides")
    parser.add_argument(
        "--variants",
        type=json.loads,
        help='strategy/mcore runs under several settings in one launch: {label: {"strategy_options": ..., '
        '"module_options": ..., "overrides": ..., "env": {VARIABLE: value}}}, e.g. {"": {}, "-eager": '
        '{"strategy_options": {"cuda_graphs": false}}, "-simple": {"env": {"NCCL_PROTO": "Simple"}}}; each on top '
        "of the options above; hf runners run once per round",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds over every case, the order reversed every other round"
    )
    parser.add_argument(
        "--baseline",
        nargs="+",
        default=["hf-bf16"],
        help="runs (runner and variant label, e.g. strategy-sdpa-fp8) the per-round ratios are taken against",
    )
    args = parser.parse_args()
    if args.worker_spec:
        worker(json.loads(args.worker_spec))
        return 0
    _check_runners(args.runners)

    import torch

    accelerator = "cpu" if args.cpu_dry_run else "gpu"
    dry_runs = {"dry-run": DRY_RUN_MODEL, "dry-run-llama": DRY_RUN_LLAMA, "dry-run-moe": DRY_RUN_MOE}
    models = dry_runs if args.cpu_dry_run else MODELS
    available = 2 if args.cpu_dry_run else torch.cuda.device_count()
    report = {
        "what": "training throughput, bf16 (float8 GEMMs where a run says so), synthetic tokens; median step after warm-up",
        **provenance(),
        "warmup_steps": WARMUP,
        "measured_steps": MEASURED,
        "models": models,
        "runs": {},
    }
    rounds: dict[str, list[dict[str, Any]]] = {}
    if args.append and args.out.exists():  # the rounds of the same runs go on (one launch need not run them all)
        previous = json.loads(args.out.read_text())
        report["runs"] = previous["runs"]
        report["commands"] = previous.get("commands", [previous["command"]]) + [report["command"]]
        report.update({k: v for k, v in previous.items() if k.startswith("ratios_to_")})
        rounds = {run: result.get("rounds", [result]) for run, result in previous["runs"].items()}
    options = {
        "accelerator": accelerator,
        "profile": str(args.profile) if args.profile else None,
        "overrides": args.overrides,
        "strategy_options": args.strategy_options,
        "module_options": args.module_options,
        "fusion_ab": args.fusion_ab,
    }
    variants = args.variants or {args.label: {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models.items():
            for layout, (gpus, _, _) in model["layouts"].items():
                if gpus > available or (args.only and f"{name}/{layout}" not in args.only):
                    continue
                cases = [
                    (runner, label, _variant_options(options, extra, runner))
                    for runner in args.runners
                    if not (runner.startswith("hf") and gpus > 1)  # the transformers baseline is single-GPU
                    and not (model.get("moe") and not runner.startswith("strategy"))  # MoE: GPTModule only
                    for label, extra in (variants.items() if not runner.startswith("hf") else [("", {})])
                ]
                done = len(rounds.get(f"{name}/{layout}/{cases[0][0]}{cases[0][1]}", [])) if cases else 0
                for round_index in range(done, done + args.repeat):  # with --append: alternation goes on
                    by_run: dict[str, dict[str, Any]] = {}
                    for runner, label, case_options in cases if round_index % 2 == 0 else cases[::-1]:
                        result = _launch(name, layout, runner, model, Path(tmp), case_options, label)
                        for key in ("overrides", "strategy_options", "module_options", "env"):
                            if case_options.get(key) and _takes(runner, key):
                                result[key] = case_options[key]
                        run = f"{name}/{layout}/{runner}{label}"
                        by_run[run] = result
                        rounds.setdefault(run, []).append(result)
                        report["runs"][run] = _summarised(rounds[run])
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        args.out.write_text(json.dumps(report, indent=1))
                        print(f"{name:>12} {layout:>8} {runner + label:>28}  {_shown(result)}", flush=True)
                    for base in args.baseline:
                        baseline = by_run.get(f"{name}/{layout}/{base}")
                        if not baseline or "error" in baseline:
                            continue
                        ratios = report.setdefault("ratios_to_" + base, {})
                        for run, result in by_run.items():
                            if "error" not in result and not run.endswith("/" + base):
                                per_round = ratios.setdefault(run, {"per_round": []})["per_round"]
                                per_round.append(result["model_tflops_per_gpu"] / baseline["model_tflops_per_gpu"])
                                ratios[run]["median"] = statistics.median(per_round)
                        args.out.write_text(json.dumps(report, indent=1))
    return 0 if all("error" not in r for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
