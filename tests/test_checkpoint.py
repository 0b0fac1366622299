"""Sharded checkpoints: resuming continues exactly like an uninterrupted run, at the saved layout and at
other TP/PP/VPP layouts, for megatron-core's optimizer (plain and distributed) and the plain-torch one.

A run of 6 steps saves after steps 3 and 6; resuming from step 3 must reproduce steps 4-6 of the
uninterrupted run (fp32: 1e-5 relative; the resumed run also restores the LR schedule and the data
position mid-epoch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cases import TINY_MODEL, fit_gpt
from lightning.pytorch.callbacks import ModelCheckpoint
from trainers import quiet_trainer

from lightning_megatron.models import GPTModule

STEPS, SAVE_EVERY = 6, 3
DATA = {"num_train_samples": 64}  # 8 steps per epoch: the resume lands mid-epoch


class RMSpropGPT(GPTModule):
    """An optimizer megatron-core does not implement: the strategy steps it as a plain torch optimizer."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.RMSprop(self.parameters(), lr=1e-3)


def fit(world_size: int, ckpt_dir: Path, resume: str | None = None, **kwargs: Any) -> dict[str, Any]:
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    return fit_gpt(
        world_size,
        steps=STEPS,
        data=DATA,
        model={"warmup_steps": 2},
        trainer={"enable_checkpointing": True},
        callbacks=[saver],
        ckpt_path=resume,
        **kwargs,
    )


def assert_continues(resumed: dict[str, Any], full: dict[str, Any], what: str) -> None:
    tail = full["loss"][SAVE_EVERY:]
    assert len(resumed["loss"]) == len(tail), what
    for step, (got, want) in enumerate(zip(resumed["loss"], tail), start=SAVE_EVERY + 1):
        assert abs(got - want) <= 1e-5 * abs(want), f"{what}: step {step} loss {got} != uninterrupted {want}"
    assert resumed["global_step"] == STEPS


@pytest.fixture(scope="module")
def saved_tp2(ranks: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted TP2 run that saved at steps 3 and 6."""
    ckpt_dir = tmp_path_factory.mktemp("tp2")
    return ckpt_dir, ranks.run(2, fit, 2, ckpt_dir, tensor_model_parallel_size=2)[0]


def test_checkpoint_is_a_sharded_directory(saved_tp2: tuple[Path, dict]) -> None:
    ckpt_dir, _ = saved_tp2
    step3 = ckpt_dir / f"epoch=0-step={SAVE_EVERY}.ckpt"
    assert step3.is_dir()
    writers = {f.name.split("_")[2] for f in step3.glob("__*_*.distcp")}  # __<rank>_<file>.distcp
    assert writers == {"0", "1"}, f"each of the 2 ranks writes its own shard files: {writers}"
    assert (step3 / "trainer_state.pt").is_file() and (step3 / "metadata.json").is_file()


@pytest.mark.parametrize(
    ("world_size", "layout"),
    [
        (2, dict(tensor_model_parallel_size=2)),
        (1, {}),
        (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
        (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    ],
    ids=["same-layout", "single-process", "pp2-vpp2", "tp2-pp2"],
)
def test_resume_continues_like_an_uninterrupted_run(
    ranks: Any, saved_tp2: tuple[Path, dict], tmp_path: Path, world_size: int, layout: dict
) -> None:
    ckpt_dir, full = saved_tp2
    resume = str(ckpt_dir / f"epoch=0-step={SAVE_EVERY}.ckpt")
    results = ranks.run(world_size, fit, world_size, tmp_path, resume, **layout)
    for result in results:
        assert_continues(result, full, f"TP2 checkpoint resumed at {layout or 'one process'}")


def test_distributed_optimizer_resumes_across_layouts(ranks: Any, tmp_path: Path) -> None:
    """The distributed optimizer's state is saved reshardable: DP2 → TP2 (still distributed)."""
    full = ranks.run(2, fit, 2, tmp_path / "dp2", use_distributed_optimizer=True)[0]
    resume = str(tmp_path / "dp2" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    for result in ranks.run(
        2, fit, 2, tmp_path / "tp2", resume, tensor_model_parallel_size=2, use_distributed_optimizer=True
    ):
        assert_continues(result, full, "distributed-optimizer DP2 checkpoint resumed at TP2")


def test_bf16_resume(ranks: Any, tmp_path: Path) -> None:
    full = ranks.run(2, fit, 2, tmp_path / "a", precision="bf16-mixed", pipeline_model_parallel_size=2)[0]
    resume = str(tmp_path / "a" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    resumed = ranks.run(2, fit, 2, tmp_path / "b", resume, precision="bf16-mixed", pipeline_model_parallel_size=2)
    assert_continues(resumed[0], full, "bf16 PP2 resume (fp32 master weights restored)")


def test_plain_torch_optimizer_resumes_at_its_layout(ranks: Any, tmp_path: Path) -> None:
    full = ranks.run(2, fit, 2, tmp_path / "a", module_cls=RMSpropGPT, tensor_model_parallel_size=2)[0]
    resume = str(tmp_path / "a" / f"epoch=0-step={SAVE_EVERY}.ckpt")
    resumed = ranks.run(2, fit, 2, tmp_path / "b", resume, module_cls=RMSpropGPT, tensor_model_parallel_size=2)
    assert_continues(resumed[0], full, "RMSprop TP2 resume")


def incomplete_resume(world_size: int, ckpt: str) -> str:
    try:
        fit(world_size, Path(ckpt).parent / "unused", ckpt, tensor_model_parallel_size=2)
    except FileNotFoundError as err:
        return str(err)
    return "no error"


def test_incomplete_checkpoint_is_refused(ranks: Any, saved_tp2: tuple[Path, dict], tmp_path: Path) -> None:
    """A save that died before trainer_state.pt was written must not be resumed from silently."""
    ckpt_dir, _ = saved_tp2
    broken = tmp_path / "broken.ckpt"
    broken.mkdir()
    for f in (ckpt_dir / f"epoch=0-step={SAVE_EVERY}.ckpt").iterdir():
        if f.name != "trainer_state.pt":
            (broken / f.name).write_bytes(f.read_bytes())
    messages = ranks.run(2, incomplete_resume, 2, str(broken))
    assert all("incomplete" in m and "trainer_state.pt" in m for m in messages), messages


def validate_checkpoint(world_size: int, ckpt: str, **strategy: Any) -> float:
    """``trainer.validate(ckpt_path=...)``: loads only the model, at any layout."""

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule

    trainer = quiet_trainer(
        devices=world_size,
        strategy=MegatronAppStrategy(micro_batch_size=2, timeout=60, **strategy),
        limit_val_batches=2,
    )
    module = GPTModule(**{**TINY_MODEL, "lr": 1e-2, "warmup_steps": 2})
    data = SyntheticTokenDataModule(vocab_size=128, seq_length=16, global_batch_size=8, num_val_samples=32, **DATA)
    (metrics,) = trainer.validate(module, data, ckpt_path=ckpt, verbose=False)
    return metrics["val_loss"]


def test_validate_from_checkpoint_at_other_layouts(ranks: Any, saved_tp2: tuple[Path, dict]) -> None:
    ckpt = str(saved_tp2[0] / f"epoch=0-step={SAVE_EVERY}.ckpt")
    reference = ranks.run(2, validate_checkpoint, 2, ckpt, tensor_model_parallel_size=2)
    assert reference[0] == reference[1]
    for world_size, layout in [
        (1, {}),
        (2, {"pipeline_model_parallel_size": 2}),
        (4, {"pipeline_model_parallel_size": 4}),
    ]:
        for value in ranks.run(world_size, validate_checkpoint, world_size, ckpt, **layout):
            assert value == pytest.approx(reference[0], rel=1e-5), layout
