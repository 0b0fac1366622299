"""The runners of ``benchmarks/throughput.py``, inside the processes it launches (one ``torchrun`` per case).

Each runner trains one model shape for ``WARMUP + MEASURED`` steps (twice ``MEASURED`` with ``--fusion-ab``, plus
``PROFILED`` with ``--profile``) and returns the measured steps' wall times; :func:`worker` writes them, with the
peak GPU memory, to ``rank<N>.json`` in the case's result directory, where the driver reads them. The driver (what
to launch, the medians and ratios, the report) is ``throughput.py``; this module knows nothing of it.

* ``run_strategy``: ``Trainer(strategy=MegatronAppStrategy(...))`` with ``GPTModule``;
* ``run_mcore``: the same model in a hand-written megatron-core loop;
* ``run_hf``: ``transformers``' own model in a plain PyTorch loop (autocast, or bf16 weights for ``hf-bf16``), and
  its compiled peers of the strategy's FP8 runs (``hf-compile``, ``hf-fp8-<recipe>``: :func:`_peer`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Optional

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


def is_llama(m: dict[str, Any]) -> bool:
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
    if is_llama(m):
        return shape | dict(
            num_query_groups=m["num_query_groups"],
            ffn_hidden_size=m["ffn_hidden_size"],
            position_embedding_type="rope",
            normalization="RMSNorm",
            activation="swiglu",
            add_bias_linear=False,
            **(m.get("moe") or {}),  # experts: GPTModule's MoE arguments (the strategy runners only)
        )
    return shape | dict(activation="gelu_tanh")  # GPT-2's GeLU (fused with its bias on GPUs, as in the mcore runner)


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
            if ab and (trainer.strategy.replays_cuda_graphs or trainer.strategy.fuses_gradient_accumulation):
                raise SystemExit(
                    "--fusion-ab compares eager steps without and with gradient_accumulation_fusion: add "
                    '{"cuda_graphs": false, "gradient_accumulation_fusion": false} to --strategy-options'
                )
            if ab:  # after warm-up, blocks of two steps: without, with, without, ... (same model, same launch)
                from lightning_megatron.layers.wgrad import split_linears

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
            symmetric = trainer.strategy.tp_layers.symmetric_all_reduce  # None again after teardown
            if symmetric is not None:  # what symmetric_ar_type really took: the Python calls (not graph replays)
                spec["symmetric_all_reduce"] = {"calls": symmetric.calls, "fallbacks": symmetric.fallbacks}

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
            if is_llama(m)
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
        position_embedding_type="rope" if is_llama(m) else "learned_absolute",
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
    """``transformers``' model in a plain PyTorch loop: ``hf``/``hf-bf16`` eager, the peers compiled (:func:`_peer`)."""
    import torch

    m, runner = spec["model"], spec["runner"]
    on_cpu = spec["accelerator"] == "cpu"
    pure_bf16 = runner == "hf-bf16"
    peer = runner not in ("hf", "hf-bf16")
    # torchao's Float8Linear casts its input to the *CUDA* autocast dtype only: under CPU autocast its input stays
    # fp32 while its output is bf16, and rowwise_with_gw_hp's bf16 weight-gradient GEMM then mixes the two. The
    # CPU dry run of the peers is fp32 (plumbing only); on GPUs they run under autocast like ``hf``.
    autocast = not pure_bf16 and not (peer and on_cpu)
    device = torch.device("cpu" if on_cpu else "cuda")
    model = _peer(m, runner, on_cpu) if peer else _hf_model(m)
    model = model.to(device, torch.bfloat16 if pure_bf16 else torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=not on_cpu)
    # The peers' loss: HF's causal-LM loss (next-token targets, fp32 logits, mean), compiled as torchtitan
    # compiles its loss, so the fp32 copy of the logits is fused away as in the strategy's cross-entropy.
    loss_fn = _causal_lm_loss if on_cpu or not peer else torch.compile(_causal_lm_loss)
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
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                if peer:
                    loss = loss_fn(model(input_ids=micro, use_cache=False).logits, micro) / nmb
                else:
                    loss = model(input_ids=micro, labels=micro).loss / nmb
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        _synchronize()
        times.append(time.perf_counter() - start)
        profiler.step_ended(step)
    return times[WARMUP : WARMUP + MEASURED]


PEER_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # hf-fp8-<recipe>: torchao's recipe names


def peer_recipe(runner: str) -> Optional[str]:
    """The float8 recipe of a peer runner (``hf-fp8-rowwise``: ``rowwise``), None for ``hf-compile``."""
    return runner.removeprefix("hf-fp8-") if runner.startswith("hf-fp8-") else None


def _peer(m: dict[str, Any], runner: str, on_cpu: bool) -> Any:
    """The plain PyTorch peer of the strategy's FP8 runs, built as torchtitan builds its single-GPU runs.

    torchtitan trains with FSDP2's mixed precision (fp32 parameters, bf16 compute); on one GPU autocast over fp32
    weights is that, and the numerics of the strategy runners too (bf16 GEMMs, fp32 master weights and AdamW
    states). Then, in torchtitan's order: the ``nn.Linear`` layers to ``Float8Linear`` with torchao's
    ``convert_to_float8_training`` (all but the output layer, and only GEMMs whose sides are multiples of 16,
    torchtitan's filter), and ``torch.compile`` per transformer block, which is what torchtitan compiles: the
    blocks are identical, so one compiled graph serves every layer (a compile of seconds, not of the whole
    model), and the glue around them (embedding, HF's mask and output plumbing) stays eager. ``hf-compile`` is
    the same loop without float8: the peer's bf16 baseline.

    On CPUs (``--cpu-dry-run``) nothing is compiled (inductor's CPU backend needs a C++ toolchain and minutes),
    torchao emulates the float8 GEMMs (``emulate=True``: the same casts and scales, the GEMM in fp32) and the
    loop runs in fp32 (:func:`run_hf` says why).
    """
    model = _hf_model(m)
    _conv1d_to_linear(model)
    recipe = peer_recipe(runner)
    if recipe is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=on_cpu)
        convert_to_float8_training(model, config=config, module_filter_fn=_float8_filter)
        converted = sum(type(module).__name__ == "Float8Linear" for module in model.modules())
        if not converted:
            raise RuntimeError(f"{runner}: convert_to_float8_training converted no linear layer")
    if not on_cpu:
        for block in model.model.layers if is_llama(m) else model.transformer.h:
            block.compile()
    return model


def _float8_filter(module: Any, fqn: str) -> bool:
    """torchtitan's ``module_filter_fn``: not the output layer (the logits feed a softmax over the vocabulary;
    Transformer Engine and this strategy keep it bf16 too), and only GEMMs ``torch._scaled_mm`` takes."""
    return fqn != "lm_head" and module.in_features % 16 == 0 and module.out_features % 16 == 0


def _conv1d_to_linear(model: Any) -> None:
    """GPT-2's ``Conv1D`` layers (``x @ W + b``, ``W`` stored in x out) as ``nn.Linear`` with the transposed weight:
    the same GEMMs, and layers ``convert_to_float8_training`` knows (it swaps ``nn.Linear`` only). Llama has
    none."""
    import torch
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Conv1D):
                linear = torch.nn.Linear(child.weight.shape[0], child.nf, bias=child.bias is not None)
                linear.weight = torch.nn.Parameter(child.weight.detach().t().contiguous())
                if child.bias is not None:
                    linear.bias = child.bias
                setattr(parent, name, linear)


def _causal_lm_loss(logits: Any, tokens: Any) -> Any:
    """``transformers``' causal-LM loss: each position predicts the next token, fp32 logits, mean."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _hf_model(m: dict[str, Any]) -> Any:
    """``transformers``' own model of the shape, SDPA attention, no dropout; the vocabulary padded as megatron-core
    pads it (same FLOPs, fast GEMMs)."""
    padded_vocab = -(-m["vocab_size"] // 128) * 128
    if is_llama(m):
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


def worker(spec: dict[str, Any]) -> None:
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
    for key in ("fused_step_seconds", "symmetric_all_reduce"):
        if key in spec:
            record[key] = spec[key]
    Path(spec["result_dir"], f"rank{rank}.json").write_text(json.dumps(record))
