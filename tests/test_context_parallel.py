"""``MegatronAppStrategy(context_parallel_size=N)``: a Llama-shaped tiny model (GQA, RoPE, SwiGLU, RMSNorm) trained
with each sequence split over context-parallel ranks must follow one process's losses within 1e-4 (fp32, CPU),
alone and with tensor (and sequence) parallelism, pipeline parallelism (three schedules) and data parallelism with
the distributed optimizer; the loss and token counts are reduced across the
ranks that share a sequence, and gradients over data × context ranks. A checkpoint saved at one context size
resumes at another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import context_cases as cc
import dpp_cases as dc
import pytest
from cases import fit_gpt

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.strategy.parallel import ParallelLayout

MODEL = {"layer_spec": "sdpa", **dc.llama_model()}
LAYOUTS = {
    "cp2": (2, dict(context_parallel_size=2)),
    "cp2-tp2-sp": (4, dict(context_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)),
    "cp2-pp2": (4, dict(context_parallel_size=2, pipeline_model_parallel_size=2)),
    "cp2-pp2-zb": (4, dict(context_parallel_size=2, pipeline_model_parallel_size=2, schedule="zb-h1")),
    "cp2-pp2-dpp": (4, dict(context_parallel_size=2, pipeline_model_parallel_size=2, schedule="dpp")),
    "cp2-dp2-distopt": (4, dict(context_parallel_size=2, use_distributed_optimizer=True)),
}


@pytest.fixture(scope="module")
def one_process(ranks: Any) -> dict[str, Any]:
    return ranks.run(1, fit_gpt, 1, steps=3, model=MODEL, trainer={"val_check_interval": 3, "limit_val_batches": 2})[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_losses_equal_one_process(ranks: Any, one_process: dict[str, Any], layout: str) -> None:
    world, strategy = LAYOUTS[layout]
    results = ranks.run(
        world,
        fit_gpt,
        world,
        steps=3,
        model=MODEL,
        trainer={"val_check_interval": 3, "limit_val_batches": 2},
        **strategy,
    )
    want = one_process["loss"]
    for rank, got in enumerate(results):
        assert len(got["loss"]) == len(want) == 3
        for step, (a, b) in enumerate(zip(got["loss"], want)):
            assert abs(a - b) <= 1e-4 * abs(b), f"{layout} rank {rank}: step {step} loss {a} vs {b}"
        assert got["val_loss"] and abs(got["val_loss"][-1] - one_process["val_loss"][-1]) <= 1e-4 * abs(
            one_process["val_loss"][-1]
        ), f"{layout} rank {rank}: val_loss {got['val_loss']} vs {one_process['val_loss']}"


def test_context_parallel_settings_are_checked() -> None:
    with pytest.raises(MegatronConfigError, match="context_parallel_size"):
        MegatronAppStrategy(context_parallel_size=0)
    with pytest.raises(MegatronConfigError, match="cuda_graphs"):
        MegatronAppStrategy(context_parallel_size=2, cuda_graphs=True)
    with pytest.raises(MegatronConfigError, match="context_parallel_size = 2 × 2 × 2 = 8"):
        ParallelLayout(tensor=2, pipeline=2, context=2).data_parallel_size(12)
    assert ParallelLayout(tensor=2, context=2).data_parallel_size(8) == 2
    with pytest.raises(MegatronConfigError, match="sequence length 12 does not split into 2 × context_parallel_size"):
        ParallelLayout(context=4).check_seq_length(12)
    with pytest.raises(MegatronConfigError, match="multiple of 8"):
        ParallelLayout(tensor=2, sequence_parallel=True, context=2).check_seq_length(12)
    ParallelLayout(context=4).check_seq_length(16)


def test_context_parallel_needs_the_sdpa_spec(ranks: Any) -> None:
    with pytest.raises(Exception, match="needs layer_spec='sdpa'"):
        ranks.run(2, fit_gpt, 2, steps=1, model={"layer_spec": "local"}, context_parallel_size=2)


STEPS, SAVE_EVERY = 6, 3


def fit_saving(world_size: int, ckpt_dir: str, resume: Optional[str] = None, **strategy: Any) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    return fit_gpt(
        world_size,
        steps=STEPS,
        data={"num_train_samples": 64},
        model={**MODEL, "warmup_steps": 2},
        trainer={"enable_checkpointing": True},
        callbacks=[saver],
        ckpt_path=resume,
        **strategy,
    )


@pytest.mark.parametrize(("saved_cp", "resumed_cp"), [(2, 1), (1, 2)], ids=["cp2-to-cp1", "cp1-to-cp2"])
def test_checkpoint_resumes_at_another_context_size(ranks: Any, tmp_path: Path, saved_cp: int, resumed_cp: int) -> None:
    """Weights and optimizer state do not depend on the context split: a checkpoint saved at one context size
    continues at the other as the uninterrupted run (within the rounding that separates the two sizes)."""
    full = ranks.run(saved_cp, fit_saving, saved_cp, str(tmp_path / "saved"), context_parallel_size=saved_cp)[0]
    resume = str(tmp_path / "saved" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    results = ranks.run(
        resumed_cp, fit_saving, resumed_cp, str(tmp_path / "resumed"), resume, context_parallel_size=resumed_cp
    )
    tail = full["loss"][SAVE_EVERY:]
    for rank, resumed in enumerate(results):
        assert resumed["global_step"] == STEPS and len(resumed["loss"]) == len(tail)
        for step, (got, want) in enumerate(zip(resumed["loss"], tail), start=SAVE_EVERY + 1):
            assert abs(got - want) <= 1e-4 * abs(want), f"rank {rank}: step {step} loss {got} != uninterrupted {want}"


def test_generation_at_context_parallel_size_2_equals_one_process(ranks: Any) -> None:
    """Generation runs whole sequences on every context-parallel rank: greedy tokens equal one process's and the
    logits agree within the 1e-4 the two fits differ by, with and without the KV cache."""
    want = ranks.run(1, fit_gpt, 1, steps=2, model=MODEL, probe=cc.greedy_continuation)[0]["probe"]
    for rank, result in enumerate(
        ranks.run(2, fit_gpt, 2, steps=2, model=MODEL, probe=cc.greedy_continuation, context_parallel_size=2)
    ):
        got = result["probe"]
        for kv_cache in (True, False):
            assert got[f"tokens/{kv_cache}"] == want[f"tokens/{kv_cache}"], f"rank {rank} kv_cache={kv_cache}"
            error = float((got[f"logits/{kv_cache}"] - want[f"logits/{kv_cache}"]).abs().max())
            assert error < 1e-4, f"rank {rank} kv_cache={kv_cache}: logits differ by {error:.3g}"
