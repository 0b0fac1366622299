"""megatron-core's optimizer on a GPU steps with torch's fused Adam, and its checkpoints resume exactly (skipped
without CUDA).

On GPUs the strategy switches the torch AdamW inside megatron-core's optimizer to ``fused=True`` (one kernel
instead of foreach passes) and megatron-core's multi-tensor fallbacks to foreach kernels. The fused kernel keeps
each parameter's ``step`` as a tensor on the GPU, and megatron-core's distributed optimizer restores ``step``
through a path of its own (``compat.megatron``), so both optimizers must still resume like an uninterrupted run:
steps 4-6 after a resume from step 3 equal the uninterrupted run's (fp32: 1e-5 relative; bf16: 1e-3), every
Adam group is fused and every parameter's ``step`` tensor sits on the GPU and says 6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cases import fit_gpt
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from test_checkpoint import DATA, SAVE_EVERY, STEPS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


class AdamState(Callback):
    """The Adam state at the end of training (the strategy releases it at teardown, before ``fit`` returns)."""

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.state = adam_state(trainer.strategy.optimizers[0].megatron)


def adam_state(optimizer: Any) -> dict[str, Any]:
    parts = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    inner = [part.optimizer for part in parts]
    steps = [state["step"] for opt in inner for state in opt.state.values()]
    return {
        "fused": all(group["fused"] for opt in inner for group in opt.param_groups),
        "step_on_gpu": bool(steps) and all(s.is_cuda for s in steps),
        "steps": sorted({float(s) for s in steps}),
    }


@pytest.mark.parametrize(
    ("precision", "distributed", "tolerance"),
    [("32-true", False, 1e-5), ("bf16-mixed", True, 1e-3)],
    ids=["fp32", "bf16-distributed-optimizer"],
)
def test_fused_adam_resumes_like_an_uninterrupted_run(
    precision: str, distributed: bool, tolerance: float, tmp_path: Path
) -> None:
    def fit(ckpt_dir: Path, resume: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        probe = AdamState()
        result = fit_gpt(
            1,
            steps=STEPS,
            data=DATA,
            model={"warmup_steps": 2},
            trainer={"enable_checkpointing": True},
            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_EVERY, save_top_k=-1), probe],
            ckpt_path=resume,
            accelerator="gpu",
            precision=precision,
            use_distributed_optimizer=distributed,
        )
        return result, probe.state

    full, full_state = fit(tmp_path / "a")
    resumed, resumed_state = fit(tmp_path / "b", str(tmp_path / "a" / f"epoch=0-step={SAVE_EVERY}.ckpt"))
    for state in (full_state, resumed_state):
        assert state == {"fused": True, "step_on_gpu": True, "steps": [float(STEPS)]}
    tail = full["loss"][SAVE_EVERY:]
    assert len(resumed["loss"]) == len(tail)
    for got, want in zip(resumed["loss"], tail):
        assert abs(got - want) <= tolerance * abs(want), (resumed["loss"], tail)
