"""Lightning features under the strategy: clipping, LR schedules, validation, step counting, collectives,
the plain-torch optimizer path."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from cases import fit_gpt
from test_checkpoint import RMSpropGPT
from trainers import quiet_trainer

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.data import SyntheticTokenDataModule
from lightning_megatron.models import GPTModule


def test_gradient_clipping_is_global_and_layout_independent(ranks: Any) -> None:
    """Trainer(gradient_clip_val) clips by the norm over all model-parallel shards, so TP2 clips like one process."""
    clip = {"gradient_clip_val": 0.05}
    single = ranks.run(1, fit_gpt, 1, trainer=clip)[0]
    unclipped = ranks.run(1, fit_gpt, 1)[0]
    tp2 = ranks.run(2, fit_gpt, 2, trainer=clip, tensor_model_parallel_size=2)[0]
    assert min(single["grad_norm"]) > 0.05, "the norms must exceed the threshold for clipping to act"
    assert single["loss"][0] == pytest.approx(unclipped["loss"][0], rel=1e-6)  # same start
    assert abs(single["loss"][-1] - unclipped["loss"][-1]) > 1e-3, "clipping changed nothing"
    assert tp2["loss"] == pytest.approx(single["loss"], rel=1e-5)


class LRProbe(pl.Callback):
    """After each step: the (lr, weight decay) pairs megatron-core's optimizer stepped with, and the user's
    learning rates, which Lightning's scheduler has already advanced to the next step's."""

    def __init__(self) -> None:
        self.next_user: list[list[float]] = []
        self.applied: list[list[tuple[float, float]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        optimizer = trainer.strategy.optimizers[0]
        self.next_user.append([g["lr"] for g in optimizer.user_optimizer.param_groups])
        self.applied.append(sorted({(g["lr"], g["weight_decay"]) for g in optimizer.megatron.param_groups}))


def fit_with_lr_probe(world_size: int, **kwargs: Any) -> dict[str, Any]:
    probe = LRProbe()
    fit_gpt(world_size, callbacks=[probe], model={"warmup_steps": 2, "weight_decay": 0.1}, steps=4, **kwargs)
    return {"next_user": probe.next_user, "applied": probe.applied}


def test_lr_scheduler_drives_megatron_optimizer(ranks: Any) -> None:
    """LambdaLR from configure_optimizers sets the learning rate megatron-core's optimizer steps with,
    for each parameter group with its own weight decay."""
    for result in ranks.run(2, fit_with_lr_probe, 2, pipeline_model_parallel_size=2):
        # warmup (step+1)/2, then cosine over the remaining 2 steps; two groups: decay 0.1 and none.
        expected_lr = [0.5e-2, 1e-2, 1e-2, 0.5e-2]
        for step, applied in enumerate(result["applied"]):
            lr = expected_lr[step]
            assert applied == [(pytest.approx(lr), 0.0), (pytest.approx(lr), 0.1)], (step, applied)
        for step in range(3):
            assert result["next_user"][step] == [pytest.approx(expected_lr[step + 1])] * 2


def test_validation_loss_is_global_and_steps_are_optimizer_steps(ranks: Any) -> None:
    """val_check_interval and limit_val_batches count global batches; val_loss is the same on every rank
    and in every layout (token-weighted over the whole validation run)."""
    trainer = {"val_check_interval": 2, "limit_val_batches": 2}
    single = ranks.run(1, fit_gpt, 1, trainer=trainer)[0]
    pp2 = ranks.run(4, fit_gpt, 4, trainer=trainer, pipeline_model_parallel_size=2)
    assert single["global_step"] == 4 and len(single["loss"]) == 4
    assert len(single["val_loss"]) == 2, "validation after steps 2 and 4"
    for result in pp2:
        assert result["global_step"] == 4
        assert result["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)


def test_plain_torch_optimizer_matches_single_process(ranks: Any) -> None:
    """An optimizer megatron-core lacks (RMSprop) steps on the synchronised gradients, exactly."""
    single = ranks.run(1, fit_gpt, 1, module_cls=RMSpropGPT)[0]
    for result in ranks.run(4, fit_gpt, 4, module_cls=RMSpropGPT, tensor_model_parallel_size=2):
        assert result["loss"] == pytest.approx(single["loss"], rel=1e-5)
        assert result["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-4)


def collectives_after_fit(world_size: int) -> dict[str, Any]:
    """Run inside ranks at TP2 × DP2: the strategy's collectives respect groups."""
    trainer = quiet_trainer(
        devices=world_size,
        strategy=MegatronAppStrategy(tensor_model_parallel_size=2, timeout=60),
        max_steps=1,
    )
    trainer.fit(
        GPTModule(vocab_size=128, seq_length=16, num_layers=2, hidden_size=32),
        SyntheticTokenDataModule(vocab_size=128, seq_length=16),
    )
    strategy = trainer.strategy
    rank = dist.get_rank()
    value = torch.tensor(float(rank))
    world = dist.group.WORLD
    return {
        "coordinates": strategy.parallel.coordinates,
        "sampler": strategy.distributed_sampler_kwargs,
        "reduce_default": float(strategy.reduce(value)),  # mean over the data-parallel group
        "reduce_world_sum": float(strategy.reduce(value, group=world, reduce_op="sum")),
        "reduce_max": float(strategy.reduce(value, reduce_op="max")),
        "gather_default": strategy.all_gather(value).tolist(),
        "broadcast": strategy.broadcast(f"from {rank}", src=3),
        "all_true": strategy.reduce_boolean_decision(rank != 2, all=True),
        "any_true": strategy.reduce_boolean_decision(rank == 2, all=False),
        "barrier": strategy.barrier("done") is None,
    }


def test_collectives_are_group_aware(ranks: Any) -> None:
    results = ranks.run(4, collectives_after_fit, 4)
    for r in results:
        dp_rank = r["coordinates"]["dp"]
        peers = [q for q, other in enumerate(results) if other["coordinates"]["tp"] == r["coordinates"]["tp"]]
        assert r["sampler"] == {"num_replicas": 2, "rank": dp_rank}, "sampling by data-parallel rank only"
        assert r["reduce_default"] == pytest.approx(sum(peers) / 2), "mean over the data-parallel group"
        assert r["reduce_max"] == max(peers)
        assert sorted(r["gather_default"]) == [float(q) for q in peers]
        assert r["reduce_world_sum"] == 0 + 1 + 2 + 3
        assert r["broadcast"] == "from 3"
        assert r["all_true"] is False and r["any_true"] is True, "boolean decisions span all ranks"
        assert r["barrier"]


def _groups_after_layout_changes() -> list[int]:
    from torch.distributed import distributed_c10d

    counts = []
    for layout in ({"tensor_model_parallel_size": 2}, {}, {"tensor_model_parallel_size": 2}, {}):
        fit_gpt(2, steps=1, **layout)
        counts.append(len(distributed_c10d._world.pg_map))  # registered process groups
    return counts


def test_layout_changes_release_the_previous_process_groups(ranks: Any) -> None:
    """megatron-core's destroy_model_parallel forgets its groups but torch keeps them, with a gloo thread and a
    listening socket each: a process that fit at many layouts (this test suite) ran thousands of threads. Without the
    release the registry grew from 21 to 55 groups over these four fits."""
    counts = ranks.run(2, _groups_after_layout_changes)[0]
    assert counts[2] == counts[0] and counts[3] == counts[1], counts
