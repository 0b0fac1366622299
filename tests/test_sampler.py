"""Single-process unit tests (no Trainer, no process group) of data/sampler.py: which samples each data-parallel rank
reads, step by step, across epochs and resumes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest

from lightning_megatron import MegatronConfigError
from lightning_megatron.data.sampler import GlobalBatchSampler, train_sampler


def _steps(sampler: GlobalBatchSampler) -> list[list[int]]:
    """The sampler's indices cut into the per-step batches its DataLoader would form."""
    indices = list(sampler)
    size = sampler.local_batch_size
    assert len(indices) % size == 0
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def _global_steps(num_samples: int, dp: int, epoch: int = 0, **kwargs: Any) -> list[list[int]]:
    """Step k's global batch as the union (in rank order) of what every data-parallel rank reads."""
    per_rank = []
    for rank in range(dp):
        sampler = GlobalBatchSampler(num_samples, num_replicas=dp, rank=rank, **kwargs)
        sampler.set_epoch(epoch)
        per_rank.append(_steps(sampler))
    assert len({len(steps) for steps in per_rank}) == 1
    return [sum((steps[k] for steps in per_rank), []) for k in range(len(per_rank[0]))]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_global_batches_do_not_depend_on_dp_size(dp: int, shuffle: bool) -> None:
    """Step k reads the same samples at every data-parallel size, in every epoch."""
    for epoch in (0, 1):
        reference = _global_steps(50, 1, epoch, global_batch_size=8, shuffle=shuffle, seed=3)
        assert len(reference) == 6  # 50 // 8 full steps; the tail is dropped
        assert all(len(step) == 8 for step in reference)
        flat = sum(reference, [])
        assert len(set(flat)) == len(flat)  # no sample twice in an epoch
        assert _global_steps(50, dp, epoch, global_batch_size=8, shuffle=shuffle, seed=3) == reference


def test_shuffle_depends_on_seed_and_epoch() -> None:
    """Guards the DP-invariance test against a trivially unshuffled order."""
    plain = _global_steps(64, 1, global_batch_size=8, shuffle=False)
    assert sum(plain, []) == list(range(64))
    epoch0 = _global_steps(64, 1, 0, global_batch_size=8, shuffle=True, seed=0)
    assert sum(epoch0, []) != list(range(64)) and sorted(sum(epoch0, [])) == list(range(64))
    assert _global_steps(64, 1, 1, global_batch_size=8, shuffle=True, seed=0) != epoch0
    assert _global_steps(64, 1, 0, global_batch_size=8, shuffle=True, seed=1) != epoch0


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("start_step", [0, 1, 4, 5])
def test_start_step_resumes_where_uninterrupted_run_is(dp: int, start_step: int) -> None:
    """A restarted run skips exactly the steps already taken, on every data-parallel rank."""
    for rank in range(dp):
        common = dict(global_batch_size=8, num_replicas=dp, rank=rank, seed=7)
        full = _steps(GlobalBatchSampler(50, **common))
        assert _steps(GlobalBatchSampler(50, start_step=start_step, **common)) == full[start_step:]


@pytest.mark.parametrize(
    ("steps_per_epoch", "start_step", "skipped"),
    [(None, 8, [6, 2, 0]), (None, 6, [6, 0, 0]), (3, 4, [3, 1, 0]), (3, 7, [3, 3, 1])],
)
def test_start_step_across_epoch_boundary(steps_per_epoch: Optional[int], start_step: int, skipped: list[int]) -> None:
    """Resuming in a later epoch (``set_epoch`` as Lightning calls it): finished epochs yield nothing, the
    current one resumes mid-way, and later ones are whole."""
    common = dict(global_batch_size=8, num_replicas=2, rank=1, seed=5, steps_per_epoch=steps_per_epoch)
    uninterrupted = GlobalBatchSampler(50, **common)
    resumed = GlobalBatchSampler(50, start_step=start_step, **common)
    taken = 0
    for epoch, skip in enumerate(skipped):
        uninterrupted.set_epoch(epoch)
        resumed.set_epoch(epoch)
        full = _steps(uninterrupted)
        assert len(full) == (steps_per_epoch or 6)
        got = _steps(resumed)
        assert got == full[skip:]
        taken += len(got)
    assert taken == len(skipped) * (steps_per_epoch or 6) - start_step


def test_len_is_the_full_epoch_for_this_rank() -> None:
    """Lightning sizes the epoch from ``len``: one rank's share of the (possibly limited) epoch."""
    assert len(GlobalBatchSampler(50, global_batch_size=8)) == 48
    assert len(GlobalBatchSampler(50, global_batch_size=8, num_replicas=2, rank=1)) == 24
    assert len(GlobalBatchSampler(50, global_batch_size=8, steps_per_epoch=100)) == 48  # capped at the data
    resumed = GlobalBatchSampler(50, global_batch_size=8, num_replicas=2, start_step=2)
    assert len(resumed) == 24 and len(list(resumed)) == 16


def test_float_limit_train_batches_resumes_at_the_right_step() -> None:
    """Lightning runs ``int(len(loader) * limit)`` batches per epoch for a float limit; a run resumed in
    epoch 1 after two of them must continue with epoch 1's third global batch."""
    limit = 0.5
    uninterrupted = train_sampler(_trainer_stub(limit), 128, global_batch_size=8, seed=0)
    epoch_batches = int(len(uninterrupted) // uninterrupted.local_batch_size * limit)
    uninterrupted.set_epoch(1)
    resumed = train_sampler(_trainer_stub(limit, global_step=epoch_batches + 2), 128, global_batch_size=8, seed=0)
    resumed.set_epoch(1)
    assert _steps(resumed)[0] == _steps(uninterrupted)[2]


def test_sampler_errors() -> None:
    with pytest.raises(MegatronConfigError, match="global_batch_size=6 must be divisible by the data-parallel size 4"):
        GlobalBatchSampler(64, global_batch_size=6, num_replicas=4)
    with pytest.raises(MegatronConfigError, match="5 samples, fewer than one global batch \\(8\\)"):
        GlobalBatchSampler(5, global_batch_size=8)


def _trainer_stub(limit: Any, global_step: int = 0, replicas: int = 1, rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": replicas, "rank": rank}),
        limit_train_batches=limit,
        global_step=global_step,
    )


@pytest.mark.parametrize(("limit", "steps"), [(3, 3), (100, 8), (1, 1), (1.0, 8), (0.5, 4), (0.3, 2), (0.01, 1)])
def test_train_sampler_honours_limit_train_batches(limit: Any, steps: int) -> None:
    """An int limit counts steps, a float is a fraction of the epoch (at least one step)."""
    sampler = train_sampler(_trainer_stub(limit), 64, global_batch_size=8, seed=0)
    assert sampler.steps_per_epoch == steps
    assert len(_steps(sampler)) == steps


def test_train_sampler_uses_global_step_and_dp_coordinates() -> None:
    """A restored trainer's global_step positions the sampler; DP size and rank come from the strategy."""
    trainer = _trainer_stub(1.0, global_step=3, replicas=2, rank=1)
    sampler = train_sampler(trainer, 64, global_batch_size=8, seed=11, shuffle=True)
    assert (sampler.num_replicas, sampler.rank, sampler.local_batch_size, sampler.start_step) == (2, 1, 4, 3)
    expected = GlobalBatchSampler(64, global_batch_size=8, num_replicas=2, rank=1, seed=11)
    assert _steps(sampler) == _steps(expected)[3:]
    bare = train_sampler(SimpleNamespace(), 64, global_batch_size=8, seed=0)
    assert (bare.num_replicas, bare.rank, bare.start_step, bare.steps_per_epoch) == (1, 0, 0, 8)
