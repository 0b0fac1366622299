"""Training throughput: this strategy (per layer spec) vs a raw megatron-core loop vs plain `transformers`.

    python benchmarks/throughput.py --out benchmarks/results/throughput.json       # every case that fits
    python benchmarks/throughput.py --only gpt-1.3b/tp2 --profile profile.txt      # + torch.profiler tables
    python benchmarks/throughput.py --only gpt2-medium/1gpu --runners strategy-sdpa hf
    python benchmarks/throughput.py --cpu-dry-run --out /tmp/throughput.json        # tiny shapes, checks plumbing
    python benchmarks/throughput.py --only gpt-1.3b/tp2 --runners strategy-sdpa --fusion-ab   # A/B in one fit
    python benchmarks/throughput.py --only gpt2-medium/1gpu --runners strategy-sdpa hf-bf16 --repeat 3 \
        --variants '{"": {}, "-eager": {"strategy_options": {"cuda_graphs": false}}}'  # alternated, medians

Every case runs in its own processes (``torchrun --standalone``), one after another, so runs do not share
memory or caches. Each reports the median step time over the measured steps (after warm-up), tokens per
second, model TFLOP/s per GPU by Megatron-LM's formula (``num_floating_point_operations``), and the peak
memory of the busiest GPU.

``--variants`` runs the strategy (and raw-loop) runners under several settings in one launch, ``--repeat N`` goes
over all cases N times, reversing the order every other round (GPU speed drifts between machines and over
minutes: ratios are only fair within a launch, and alternation spreads the drift). A run then reports the medians
over its rounds (each round kept under ``rounds``), and ``ratios_to_<baseline>`` the per-round TFLOP/s ratios to
``--baseline`` (default ``hf-bf16``) with their median.

``--fusion-ab``: the strategy runners alternate blocks of two steps without and with
``gradient_accumulation_fusion`` in one fit (the weight-gradient GEMM accumulating into fp32 ``main_grad``), so
the two are compared on one model in one launch; both medians and the speed-up are reported.

Runners:
* ``strategy-<spec>``: ``Trainer(strategy=MegatronAppStrategy(...))`` with ``GPTModule(layer_spec=<spec>)``, with
  the defaults: on one GPU the step replayed as a CUDA graph, and with it the fused norms and bias gradients
  (``cuda_graphs=False`` in ``--strategy-options`` for the eager step).
* ``mcore-<spec>``: the same model in a hand-written megatron-core loop (``get_forward_backward_func`` +
  megatron-core DDP + megatron-core optimizer), the baseline the strategy must match (≥ 0.98×).
* ``hf``: ``transformers``' own model (``GPT2LMHeadModel``, or ``LlamaForCausalLM`` for the Llama shape) with SDPA
  attention, autocast bf16 (fp32 weights and optimizer, the same numerics as the other runners) and fused AdamW
  (1 GPU only); vocabulary padded to a multiple of 128 like megatron-core's, so every runner does the same FLOPs.
* ``hf-bf16``: the same with bf16 weights and optimizer states and no autocast: the fastest plain PyTorch
  loop (at the cost of bf16 weight updates).

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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

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
RUNNERS = ["strategy-local", "strategy-sdpa", "mcore-local", "mcore-sdpa", "hf", "hf-bf16"]
WARMUP, MEASURED = 5, 10
PROFILED = 2  # extra steps after the measured ones, under torch.profiler, with --profile


class StepProfiler:
    """Profiles the steps after the measured ones (so profiling never slows a measured step) on rank 0."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.enabled = bool(spec.get("profile")) and int(os.environ.get("RANK", 0)) == 0
        self.path = Path(spec["result_dir"], "profile.txt")
        self.profiler: Any = None
        self.first = self.total_steps(spec) - PROFILED  # the profiled steps come after every measured one

    @staticmethod
    def total_steps(spec: dict[str, Any]) -> int:
        measured = 2 * MEASURED if spec.get("fusion_ab") else MEASURED  # A/B: both variants get MEASURED steps
        return WARMUP + measured + (PROFILED if spec.get("profile") else 0)

    def step_started(self, step: int) -> None:
        if self.enabled and step == self.first:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()

    def step_ended(self, step: int) -> None:
        if self.profiler is not None and step == self.first + PROFILED - 1:
            _synchronize()
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            sort = "self_cuda_time_total" if any(e.self_device_time_total for e in averages) else "self_cpu_time_total"
            host = averages.table(sort_by="self_cpu_time_total", row_limit=25)
            self.path.write_text(
                f"{PROFILED} steps, sorted by {sort}\n{averages.table(sort_by=sort, row_limit=60)}\n"
                f"{PROFILED} steps, sorted by self_cpu_time_total (the host's share)\n{host}"
            )
            self.profiler = None


def model_flops_per_step(m: dict[str, Any], global_batch: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` for a dense GPT (GQA, SwiGLU, vocab padded to 128)."""
    h, layers, s = m["hidden_size"], m["num_layers"], m["seq_length"]
    heads = m["num_attention_heads"]
    groups = m.get("num_query_groups") or heads
    ffn = m.get("ffn_hidden_size") or 4 * h
    gated = 1.5 if _is_llama(m) else 1.0  # SwiGLU: three ffn-wide GEMMs instead of two
    vocab = -(-m["vocab_size"] // 128) * 128
    attention = 1 + groups / heads + s / h
    return 12 * global_batch * s * layers * h * h * (attention + ffn / h * gated + vocab / (2 * layers * h))


def _is_llama(m: dict[str, Any]) -> bool:
    return m.get("style") == "llama"


def _gpt_module_shape(m: dict[str, Any]) -> dict[str, Any]:
    """``GPTModule`` arguments for a model shape: GPT-2's (tanh GeLU, LayerNorm, learned positions) or Llama's."""
    shape = dict(
        vocab_size=m["vocab_size"],
        seq_length=m["seq_length"],
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"],
    )
    if _is_llama(m):
        return shape | dict(
            num_query_groups=m["num_query_groups"],
            ffn_hidden_size=m["ffn_hidden_size"],
            position_embedding_type="rope",
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
        )
    return shape | dict(activation="gelu_tanh")  # GPT-2's GeLU (fused with its bias on GPUs, as in the mcore runner)


# -- runners (inside the launched processes) -------------------------------------------------------------
def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak_memory_gib() -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def run_strategy(spec: dict[str, Any]) -> list[float]:
    import lightning.pytorch as pl

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule

    m, (gpus, tp, pp) = spec["model"], spec["layout"]
    dp = gpus // (tp * pp)
    gbs = m["micro_batch_size"] * m["num_microbatches"] * dp
    times: list[float] = []
    profiler = StepProfiler(spec)
    steps = StepProfiler.total_steps(spec)

    fused_times: list[float] = []  # --fusion-ab: the steps run with gradient_accumulation_fusion
    ab = bool(spec.get("fusion_ab"))

    class StepTimer(pl.Callback):
        fused: Any = None

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if ab:  # after warm-up, blocks of two steps: without, with, without, ... (same model, same launch)
                from lightning_megatron.pipeline.wgrad import split_linears

                want = trainer.global_step >= WARMUP and (trainer.global_step - WARMUP) // 2 % 2 == 1
                if want and self.fused is None:
                    self.fused = split_linears(trainer.strategy.wrapped_chunks)
                elif not want and self.fused is not None:
                    self.fused.restore()
                    self.fused = None
            _synchronize()
            profiler.step_started(trainer.global_step)
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            _synchronize()
            (fused_times if self.fused is not None else times).append(time.perf_counter() - self.start)
            profiler.step_ended(trainer.global_step - 1)

    timer = StepTimer()
    trainer = pl.Trainer(
        accelerator=spec["accelerator"],
        devices=gpus,
        precision="bf16-mixed",
        strategy=MegatronAppStrategy(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            micro_batch_size=m["micro_batch_size"],
            **(spec.get("strategy_options") or {}),
        ),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[timer],
    )
    model = GPTModule(
        **_gpt_module_shape(m),
        layer_spec=spec["runner"].split("-", 1)[1],
        transformer_config_overrides=spec.get("overrides"),
        **(spec.get("module_options") or {}),
        split_invariant_init=False,
    )
    data = SyntheticTokenDataModule(
        vocab_size=m["vocab_size"],
        seq_length=m["seq_length"],
        global_batch_size=gbs,
        num_train_samples=gbs * steps,
    )
    trainer.fit(model, data)
    if ab:  # handed to _worker beside the return value (the other runners have no A/B)
        spec["fused_step_seconds"] = fused_times[:MEASURED]
    return times[WARMUP : WARMUP + MEASURED]


def run_mcore(spec: dict[str, Any]) -> list[float]:
    """The hand-written megatron-core loop: what a Megatron user writes without Lightning."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lightning_megatron.models.gpt import gelu_tanh
    from lightning_megatron.models.specs import gpt_block_spec

    m, (_, tp, pp) = spec["model"], spec["layout"]
    on_cpu = spec["accelerator"] == "cpu"
    if on_cpu:
        from lightning_megatron.compat import cpu

        cpu.apply()
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("gloo" if on_cpu else "nccl")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    config = TransformerConfig(
        num_layers=m["num_layers"],
        hidden_size=m["hidden_size"],
        num_attention_heads=m["num_attention_heads"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        attention_softmax_in_fp32=True,
        use_cpu_initialization=on_cpu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        batch_p2p_comm=not on_cpu,
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
        # GPT-2's tanh GeLU (or SwiGLU) fused with its bias, and the fused cross-entropy: what Megatron-LM turns on.
        bias_activation_fusion=not on_cpu,
        cross_entropy_loss_fusion=not on_cpu,
        **(
            dict(
                num_query_groups=m["num_query_groups"],
                ffn_hidden_size=m["ffn_hidden_size"],
                normalization="RMSNorm",
                add_bias_linear=False,
                gated_linear_unit=True,
                activation_func=torch.nn.functional.silu,
            )
            if _is_llama(m)
            else dict(activation_func=gelu_tanh if on_cpu else torch.nn.functional.gelu)
        ),
        **(spec.get("overrides") or {}),
    )
    padded_vocab = -(-m["vocab_size"] // 128) * 128
    model = GPTModel(
        config,
        gpt_block_spec(spec["runner"].split("-", 1)[1], config),
        padded_vocab,
        m["seq_length"],
        position_embedding_type="rope" if _is_llama(m) else "learned_absolute",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    ).to(device)
    model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    model = DistributedDataParallel(config, ddp_config, module=model)
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=3e-4, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0), [model]
    )

    mbs, nmb, seq = m["micro_batch_size"], m["num_microbatches"], m["seq_length"]
    # Inputs and labels as separate contiguous tensors, as the strategy's data module hands them over.
    tokens = torch.randint(m["vocab_size"], (nmb, mbs, seq + 1), device=device)
    microbatches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    positions = torch.arange(seq, device=device).expand(mbs, seq)

    def forward_step(data_iterator, chunk):  # noqa: ANN001, ANN202
        inputs, labels = next(data_iterator)
        output = chunk(input_ids=inputs, position_ids=positions, attention_mask=None, labels=labels)

        def loss_fn(per_token_loss):  # noqa: ANN001, ANN202
            return (
                per_token_loss.float().sum(),
                torch.tensor(per_token_loss.numel(), device=device, dtype=torch.int),
                {},
            )

        return output, loss_fn

    forward_backward = get_forward_backward_func()
    times = []
    profiler = StepProfiler(spec)
    for step in range(StepProfiler.total_steps(spec)):
        _synchronize()
        profiler.step_started(step)
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches),
            model=[model],
            num_microbatches=nmb,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        optimizer.step()
        _synchronize()
        times.append(time.perf_counter() - start)
        profiler.step_ended(step)
    return times[WARMUP : WARMUP + MEASURED]


def run_hf(spec: dict[str, Any]) -> list[float]:
    import torch

    m = spec["model"]
    on_cpu = spec["accelerator"] == "cpu"
    pure_bf16 = spec["runner"] == "hf-bf16"
    device = torch.device("cpu" if on_cpu else "cuda")
    model = _hf_model(m).to(device, torch.bfloat16 if pure_bf16 else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=not on_cpu)
    mbs, nmb, seq = m["micro_batch_size"], m["num_microbatches"], m["seq_length"]
    tokens = torch.randint(m["vocab_size"], (nmb, mbs, seq), device=device)
    times = []
    profiler = StepProfiler(spec)
    for step in range(StepProfiler.total_steps(spec)):
        _synchronize()
        profiler.step_started(step)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for micro in tokens:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not pure_bf16):
                loss = model(input_ids=micro, labels=micro).loss / nmb
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        _synchronize()
        times.append(time.perf_counter() - start)
        profiler.step_ended(step)
    return times[WARMUP : WARMUP + MEASURED]


def _hf_model(m: dict[str, Any]) -> Any:
    """``transformers``' own model of the shape, SDPA attention, no dropout; the vocabulary padded as megatron-core
    pads it (same FLOPs, fast GEMMs)."""
    padded_vocab = -(-m["vocab_size"] // 128) * 128
    if _is_llama(m):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            num_hidden_layers=m["num_layers"],
            hidden_size=m["hidden_size"],
            num_attention_heads=m["num_attention_heads"],
            num_key_value_heads=m["num_query_groups"],
            intermediate_size=m["ffn_hidden_size"],
            max_position_embeddings=m["seq_length"],
            vocab_size=padded_vocab,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        return LlamaForCausalLM(config)
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=m["num_layers"],
        n_embd=m["hidden_size"],
        n_head=m["num_attention_heads"],
        n_positions=m["seq_length"],
        vocab_size=padded_vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config)


def _worker(spec: dict[str, Any]) -> None:
    runner = spec["runner"]
    times = (
        run_hf(spec)
        if runner.startswith("hf")
        else run_mcore(spec)
        if runner.startswith("mcore")
        else run_strategy(spec)
    )
    rank = int(os.environ.get("RANK", 0))
    record = {"rank": rank, "step_seconds": times, "peak_memory_gib": _peak_memory_gib()}
    if "fused_step_seconds" in spec:
        record["fused_step_seconds"] = spec["fused_step_seconds"]
    Path(spec["result_dir"], f"rank{rank}.json").write_text(json.dumps(record))


# -- driver ----------------------------------------------------------------------------------------------
def _launch(name: str, layout: str, runner: str, model: dict, workdir: Path, options: dict[str, Any]) -> dict[str, Any]:
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
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    profile = result_dir / "profile.txt"
    if profile.exists():
        with open(options["profile"], "a") as out:
            out.write(f"\n===== {name}/{layout}/{runner} =====\n{profile.read_text()}\n")
    ranks = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != gpus:
        log = proc.stdout + proc.stderr
        # the worker's own exception (torchrun's report of the failure comes after it and says less)
        raised = [line for line in log.splitlines() if line.strip() and "Error" in line and "elastic" not in line]
        return {"error": f"exit {proc.returncode}", "raised": raised[-8:], "log_tail": log[-3000:]}
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
    }


def _takes(runner: str, key: str) -> bool:
    """Which runners an option applies to: ``overrides`` to the megatron-core ones, the others to the strategy."""
    return not runner.startswith("hf") if key == "overrides" else runner.startswith("strategy")


def _variant_options(options: dict[str, Any], extra: dict[str, Any], runner: str) -> dict[str, Any]:
    """The launch options of one variant: its settings merged over the command line's."""
    unknown = set(extra) - {"overrides", "strategy_options", "module_options"}
    if unknown:
        raise SystemExit(f"--variants: unknown keys {sorted(unknown)}; use overrides, strategy_options, module_options")
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
    return shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="cases as model/layout, e.g. gpt2-medium/1gpu")
    parser.add_argument("--runners", nargs="*", default=RUNNERS)
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on CPU: checks the plumbing only")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/throughput.json")
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
        '"module_options": ..., "overrides": ...}}, e.g. {"": {}, "-eager": {"strategy_options": '
        '{"cuda_graphs": false}}}; each on top of the options above; hf runners run once per round',
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="rounds over every case, the order reversed every other round"
    )
    parser.add_argument("--baseline", default="hf-bf16", help="runner the per-round ratios are taken against")
    args = parser.parse_args()
    if args.worker_spec:
        _worker(json.loads(args.worker_spec))
        return 0

    import torch

    accelerator = "cpu" if args.cpu_dry_run else "gpu"
    models = {"dry-run": DRY_RUN_MODEL, "dry-run-llama": DRY_RUN_LLAMA} if args.cpu_dry_run else MODELS
    available = 2 if args.cpu_dry_run else torch.cuda.device_count()
    report = {
        "what": "training throughput, bf16, synthetic tokens; median step after warm-up",
        **provenance(),
        "warmup_steps": WARMUP,
        "measured_steps": MEASURED,
        "models": models,
        "runs": {},
    }
    if args.append and args.out.exists():
        previous = json.loads(args.out.read_text())
        report["runs"] = previous["runs"]
        report["commands"] = previous.get("commands", [previous["command"]]) + [report["command"]]
    options = {
        "accelerator": accelerator,
        "profile": str(args.profile) if args.profile else None,
        "overrides": args.overrides,
        "strategy_options": args.strategy_options,
        "module_options": args.module_options,
        "fusion_ab": args.fusion_ab,
    }
    variants = args.variants or {args.label: {}}
    rounds: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in models.items():
            for layout, (gpus, _, _) in model["layouts"].items():
                if gpus > available or (args.only and f"{name}/{layout}" not in args.only):
                    continue
                cases = [
                    (runner, label, _variant_options(options, extra, runner))
                    for runner in args.runners
                    if not (runner.startswith("hf") and gpus > 1)  # the transformers baseline is single-GPU
                    for label, extra in (variants.items() if not runner.startswith("hf") else [("", {})])
                ]
                for round_index in range(args.repeat):
                    by_run: dict[str, dict[str, Any]] = {}
                    for runner, label, case_options in cases if round_index % 2 == 0 else cases[::-1]:
                        result = _launch(name, layout, runner, model, Path(tmp), case_options)
                        for key in ("overrides", "strategy_options", "module_options"):
                            if case_options.get(key) and _takes(runner, key):
                                result[key] = case_options[key]
                        run = f"{name}/{layout}/{runner}{label}"
                        by_run[run] = result
                        rounds.setdefault(run, []).append(result)
                        report["runs"][run] = _summarised(rounds[run])
                        args.out.parent.mkdir(parents=True, exist_ok=True)
                        args.out.write_text(json.dumps(report, indent=1))
                        print(f"{name:>12} {layout:>8} {runner + label:>28}  {_shown(result)}", flush=True)
                    baseline = by_run.get(f"{name}/{layout}/{args.baseline}")
                    if baseline and "error" not in baseline and args.repeat > 1:
                        ratios = report.setdefault("ratios_to_" + args.baseline, {})
                        for run, result in by_run.items():
                            if "error" not in result and not run.endswith("/" + args.baseline):
                                per_round = ratios.setdefault(run, {"per_round": []})["per_round"]
                                per_round.append(result["model_tflops_per_gpu"] / baseline["model_tflops_per_gpu"])
                                ratios[run]["median"] = statistics.median(per_round)
                        args.out.write_text(json.dumps(report, indent=1))
    return 0 if all("error" not in r for r in report["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
