"""Single-process unit tests: the pure logic behind the strategy, checked without a Trainer or process group.

These pin down the contracts the distributed runs rely on (how a batch becomes microbatches, which layouts
and schedules are accepted, which samples each data-parallel rank reads, how Lightning's precision and
optimizer settings are translated), so a regression shows up here in seconds instead of as a hang.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections import OrderedDict, namedtuple
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import GradClipAlgorithmType

import lightning_megatron
from lightning_megatron import MegatronAppStrategy, MegatronConfigError, MegatronPrecision
from lightning_megatron.data.sampler import GlobalBatchSampler, train_sampler
from lightning_megatron.models.specs import SequenceParallelNorm
from lightning_megatron.pipeline import available_schedules, get_schedule, register_schedule, registry
from lightning_megatron.pipeline.megatron_schedules import Interleaved, OneFOneB
from lightning_megatron.strategy.microbatch import batch_size_of, infer_seq_length, split_microbatches
from lightning_megatron.strategy.optimizer import (
    _USER_GROUP,
    StrategyOptimizer,
    _group_overrides,
    _megatron_config_kwargs,
)
from lightning_megatron.strategy.parallel import ParallelLayout
from lightning_megatron.strategy.precision import from_lightning_plugin

Pair = namedtuple("Pair", ["inputs", "targets"])


def _same_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


# -- strategy/microbatch.py --------------------------------------------------------------------------


def test_split_tensor_gives_views_in_order() -> None:
    """Microbatches must be views (no copies of the step's batch) covering the samples in order."""
    batch = torch.arange(24).reshape(6, 4)
    parts = split_microbatches(batch, 2)
    assert [p.shape for p in parts] == [torch.Size([2, 4])] * 3
    assert all(_same_storage(p, batch) for p in parts)
    assert torch.equal(torch.cat(parts), batch)
    parts[1][0, 0] = -1  # writes through: a view, not a copy
    assert batch[2, 0] == -1


def test_split_dict_keeps_type_keys_and_non_tensor_values() -> None:
    """Every tensor of a dict batch is sliced alike; the mapping type, key order and metadata survive."""
    batch = OrderedDict(
        labels=torch.arange(8).reshape(4, 2),
        tokens=torch.arange(8, 16).reshape(4, 2),
        nested={"mask": torch.ones(4, 2)},
        name="shard-3",
    )
    parts = split_microbatches(batch, 2)
    assert len(parts) == 2
    for i, part in enumerate(parts):
        assert type(part) is OrderedDict
        assert list(part) == ["labels", "tokens", "nested", "name"]
        assert torch.equal(part["labels"], batch["labels"][2 * i : 2 * i + 2])
        assert torch.equal(part["tokens"], batch["tokens"][2 * i : 2 * i + 2])
        assert part["nested"]["mask"].shape == (2, 2)
        assert _same_storage(part["tokens"], batch["tokens"])
        assert part["name"] == "shard-3"


def test_split_tuple_list_and_namedtuple_keep_their_type() -> None:
    """Tuples, lists and namedtuples come back as the same container type, fields in place."""
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    for batch in ((x, y), [x, y]):
        parts = split_microbatches(batch, 3)
        assert [type(p) for p in parts] == [type(batch)] * 2
        assert torch.equal(parts[1][0], x[3:]) and torch.equal(parts[1][1], y[3:])
    parts = split_microbatches(Pair(inputs=x, targets=y), 2)
    assert len(parts) == 3
    assert all(isinstance(p, Pair) for p in parts)
    assert torch.equal(parts[2].inputs, x[4:6]) and torch.equal(parts[2].targets, y[4:6])
    assert _same_storage(parts[2].inputs, x)


def test_split_micro_batch_size_equal_to_batch_is_one_microbatch() -> None:
    batch = {"tokens": torch.zeros(4, 3)}
    (only,) = split_microbatches(batch, 4)
    assert only["tokens"].shape == (4, 3)


def test_split_not_a_multiple_of_micro_batch_size() -> None:
    """A short or odd batch must fail loudly (naming micro_batch_size), never drop samples."""
    with pytest.raises(MegatronConfigError, match="micro_batch_size") as info:
        split_microbatches({"tokens": torch.zeros(6, 3)}, 4)
    assert "6 samples" in str(info.value) and "micro_batch_size=4" in str(info.value)


def test_mismatched_leading_dims_are_rejected() -> None:
    """Tensors with different sample counts cannot be split consistently."""
    with pytest.raises(MegatronConfigError, match="first \\(sample\\) dimension") as info:
        split_microbatches({"tokens": torch.zeros(4, 3), "labels": torch.zeros(2, 3)}, 2)
    assert "'2'" in str(info.value) and "'4'" in str(info.value)
    with pytest.raises(MegatronConfigError, match="first \\(sample\\) dimension"):
        batch_size_of((torch.zeros(4), torch.tensor(1.0)))  # a scalar has no sample dimension


def test_batch_without_tensors_is_rejected() -> None:
    with pytest.raises(MegatronConfigError, match="no tensors"):
        split_microbatches({"name": "x", "ids": [1, 2]}, 1)


def test_infer_seq_length() -> None:
    """``tokens`` wins; otherwise the first 2-D tensor; without one the error names the hook to define."""
    tokens, wide = torch.zeros(2, 16), torch.zeros(2, 7)
    assert infer_seq_length({"position_ids": wide, "tokens": tokens}) == 16
    assert infer_seq_length((torch.zeros(2), wide, tokens)) == 7
    assert infer_seq_length({"tokens": [1, 2, 3], "x": torch.zeros(2, 5, 9)}) == 5
    with pytest.raises(MegatronConfigError, match="microbatch_seq_length"):
        infer_seq_length({"labels": torch.zeros(2)})


# -- strategy/parallel.py ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        (dict(tensor=0), ["tensor_model_parallel_size", "0"]),
        (dict(tensor=1.5), ["tensor_model_parallel_size", "1.5"]),
        (dict(pipeline=-1), ["pipeline_model_parallel_size", "-1"]),
        (dict(pipeline=2, virtual_pipeline=0), ["virtual_pipeline_model_parallel_size", "0"]),
        (dict(virtual_pipeline=2), ["virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size"]),
        (dict(sequence_parallel=True), ["sequence_parallel", "tensor_model_parallel_size"]),
    ],
)
def test_layout_rejects_bad_sizes(kwargs: dict[str, Any], names: list[str]) -> None:
    """Each bad size is refused at construction with a message naming the user-facing parameter."""
    with pytest.raises(MegatronConfigError) as info:
        ParallelLayout(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_layout_valid_sizes() -> None:
    layout = ParallelLayout(tensor=2, pipeline=2, virtual_pipeline=3, sequence_parallel=True)
    assert layout.model_parallel_size == 4
    assert layout.num_chunks == 3
    assert ParallelLayout(pipeline=2).num_chunks == 1
    assert layout.data_parallel_size(8) == 2
    assert layout.data_parallel_size(4) == 1


def test_layout_world_size_not_divisible() -> None:
    """Checked before any process group exists, so every rank fails the same way."""
    with pytest.raises(MegatronConfigError) as info:
        ParallelLayout(tensor=2, pipeline=2).data_parallel_size(6)
    message = str(info.value)
    assert "world size 6" in message
    assert "tensor_model_parallel_size" in message and "pipeline_model_parallel_size" in message
    assert "= 4" in message


def test_layout_layers_must_split_over_stages() -> None:
    """Virtual stages count: 6 layers fit 2 pipeline stages but not 2 × 2 virtual ones."""
    ParallelLayout(pipeline=2).check_num_layers(6)
    ParallelLayout(pipeline=2, virtual_pipeline=2).check_num_layers(8)
    with pytest.raises(MegatronConfigError, match="pipeline_model_parallel_size = 4") as info:
        ParallelLayout(pipeline=4).check_num_layers(6)
    assert "6 layers" in str(info.value)
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size") as info:
        ParallelLayout(pipeline=2, virtual_pipeline=2).check_num_layers(6)
    assert "= 4 stages" in str(info.value)


# -- pipeline/registry.py ----------------------------------------------------------------------------


@pytest.fixture
def scratch_registry() -> Iterator[None]:
    """Schedules registered by a test are removed afterwards, and built-ins restored if overridden."""
    saved = dict(registry._REGISTRY)
    yield
    for name in set(registry._REGISTRY) - set(saved):
        del registry._REGISTRY[name]
    registry._REGISTRY.update(saved)


def _fake_schedule(**kwargs: Any) -> list:
    return []


def _other_schedule(**kwargs: Any) -> list:
    return [1]


def test_builtin_schedules_registered() -> None:
    """Importing the package registers megatron-core's two schedules under their documented names."""
    assert {"1f1b", "interleaved"} <= set(available_schedules())
    assert isinstance(get_schedule("1f1b"), OneFOneB)
    assert get_schedule("1f1b").virtual_stages is False
    assert isinstance(get_schedule("interleaved"), Interleaved)
    assert get_schedule("interleaved").virtual_stages is True


@pytest.mark.usefixtures("scratch_registry")
def test_register_get_available() -> None:
    entry = register_schedule("test-sched_a", _fake_schedule, virtual_stages=True, description="for tests")
    assert get_schedule("test-sched_a") is entry
    assert entry.forward_backward is _fake_schedule and entry.virtual_stages and entry.description == "for tests"
    names = available_schedules()
    assert "test-sched_a" in names and names == sorted(names)


@pytest.mark.usefixtures("scratch_registry")
def test_register_duplicate_and_override() -> None:
    """A name clash is refused unless override=True, which replaces the entry."""
    register_schedule("test-dup", _fake_schedule)
    with pytest.raises(ValueError, match="already registered.*override=True"):
        register_schedule("test-dup", _other_schedule)
    assert get_schedule("test-dup").forward_backward is _fake_schedule
    register_schedule("test-dup", _other_schedule, override=True)
    assert get_schedule("test-dup").forward_backward is _other_schedule


@pytest.mark.usefixtures("scratch_registry")
@pytest.mark.parametrize("name", ["", "two words", "a/b", "x!"])
def test_register_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="identifiers"):
        register_schedule(name, _fake_schedule)
    assert name not in registry._REGISTRY


@pytest.mark.usefixtures("scratch_registry")
def test_unknown_schedule_lists_registered_names() -> None:
    register_schedule("test-listed", _fake_schedule)
    with pytest.raises(MegatronConfigError, match="Unknown pipeline schedule 'nope'") as info:
        get_schedule("nope")
    for name in ("1f1b", "interleaved", "test-listed"):
        assert name in str(info.value)


def test_interleaved_without_virtual_stages_is_refused_at_any_pipeline_size() -> None:
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size"):
        MegatronAppStrategy(schedule="interleaved")


def test_schedule_validate_virtual_stages() -> None:
    """Interleaved needs a virtual size (at PP > 1); 1F1B refuses one. Each message points to the other."""
    one_f, inter = get_schedule("1f1b"), get_schedule("interleaved")
    inter.validate(pipeline=2, virtual=2)
    one_f.validate(pipeline=2, virtual=None)
    one_f.validate(pipeline=1, virtual=None)
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size") as info:
        inter.validate(pipeline=2, virtual=None)
    assert "1f1b" in str(info.value)
    with pytest.raises(MegatronConfigError, match="virtual_pipeline_model_parallel_size=2") as info:
        one_f.validate(pipeline=2, virtual=2)
    assert "interleaved" in str(info.value)


@pytest.mark.parametrize(
    ("count", "fragment"),
    [(1, "at least pipeline_model_parallel_size=2"), (3, "multiple of pipeline_model_parallel_size=2")],
)
def test_interleaved_microbatch_counts(count: int, fragment: str) -> None:
    with pytest.raises(MegatronConfigError, match=fragment) as info:
        get_schedule("interleaved").validate_microbatches(count, pipeline=2, virtual=2)
    assert f"cannot run {count} microbatches" in str(info.value) and "micro_batch_size" in str(info.value)


def test_microbatch_counts_accepted() -> None:
    """Interleaved takes multiples of PP; 1F1B takes any positive count; nobody takes zero."""
    for count in (2, 4, 6):
        get_schedule("interleaved").validate_microbatches(count, pipeline=2, virtual=2)
    get_schedule("interleaved").validate_microbatches(8, pipeline=4, virtual=2)
    with pytest.raises(MegatronConfigError, match="multiple of pipeline_model_parallel_size=4"):
        get_schedule("interleaved").validate_microbatches(6, pipeline=4, virtual=2)
    for count in (1, 3, 7):
        get_schedule("1f1b").validate_microbatches(count, pipeline=2, virtual=None)
    for name in ("1f1b", "interleaved"):
        with pytest.raises(MegatronConfigError, match="at least one microbatch"):
            get_schedule(name).validate_microbatches(0, pipeline=2, virtual=None)


@pytest.mark.usefixtures("scratch_registry")
def test_custom_microbatch_check_reason_is_reported() -> None:
    """A plugged-in schedule's own reason reaches the user in the error."""
    seen: list[tuple[int, int, Optional[int]]] = []

    def even_only(n: int, pipeline: int, virtual: Optional[int]) -> Optional[str]:
        seen.append((n, pipeline, virtual))
        return None if n % 2 == 0 else "this schedule wants an even count"

    schedule = register_schedule("test-even", _fake_schedule, check_microbatches=even_only)
    schedule.validate_microbatches(4, pipeline=3, virtual=None)
    with pytest.raises(MegatronConfigError, match="wants an even count"):
        schedule.validate_microbatches(5, pipeline=3, virtual=None)
    assert seen == [(4, 3, None), (5, 3, None)]


# -- data/sampler.py ---------------------------------------------------------------------------------


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


# -- strategy/precision.py ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("plugin", "name", "dtype"),
    [
        (Precision(), "32-true", torch.float32),
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed", torch.bfloat16),
        (MixedPrecision("16-mixed", "cpu"), "16-mixed", torch.float16),
    ],
)
def test_from_lightning_plugin_maps(plugin: Precision, name: str, dtype: torch.dtype) -> None:
    """Trainer(precision=...) builds Lightning's plugin; the strategy must turn it into megatron precision."""
    converted = from_lightning_plugin(plugin)
    assert isinstance(converted, MegatronPrecision)
    assert converted.precision == name and converted.params_dtype == dtype


def test_from_lightning_plugin_passthrough_and_rejections() -> None:
    own = MegatronPrecision("bf16-mixed")
    assert from_lightning_plugin(own) is own
    assert from_lightning_plugin(None) is None
    with pytest.raises(MegatronConfigError, match="precision='bf16-true'") as info:
        from_lightning_plugin(HalfPrecision("bf16-true"))
    assert "bf16-mixed" in str(info.value)
    with pytest.raises(MegatronConfigError, match="DoublePrecision is not supported"):
        from_lightning_plugin(DoublePrecision())


def test_strategy_converts_lightning_precision_plugin() -> None:
    """The setter Lightning's accelerator connector uses yields megatron precision, not autocast."""
    strategy = MegatronAppStrategy()
    assert strategy.precision_plugin.precision == "32-true"
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    assert isinstance(strategy.precision_plugin, MegatronPrecision)
    assert strategy.precision_plugin.params_dtype == torch.bfloat16


def test_megatron_precision_names() -> None:
    assert MegatronPrecision("bf16").precision == "bf16-mixed"
    assert MegatronPrecision(16).precision == "16-mixed"  # type: ignore[arg-type]
    assert MegatronPrecision("32").precision == "32-true"
    for bad in ("64-true", "bf16-true", "transformer-engine"):
        with pytest.raises(MegatronConfigError, match=f"precision='{bad}' is not supported"):
            MegatronPrecision(bad)  # type: ignore[arg-type]


def test_precision_backward_is_a_noop_and_no_autocast() -> None:
    """The schedule already ran backward; a second one would double the gradients."""
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).sum()
    precision = MegatronPrecision("bf16-mixed")
    precision.backward(loss, None, None)
    assert weight.grad is None
    with precision.forward_context():
        assert not torch.is_autocast_enabled("cpu")
    module = torch.nn.Linear(2, 2)
    assert MegatronPrecision().convert_module(module) is module


def test_clip_gradients_sets_clip_grad() -> None:
    """Lightning's gradient_clip_val reaches the optimizer that clips by model-parallel norm."""
    precision = MegatronPrecision()
    target = SimpleNamespace(clip_grad=0.0)
    precision.clip_gradients(target, 1.5)  # type: ignore[arg-type]
    assert target.clip_grad == 1.5
    wrapped = SimpleNamespace(_optimizer=SimpleNamespace(clip_grad=0.0))
    precision.clip_gradients(wrapped, 2, GradClipAlgorithmType.NORM)  # type: ignore[arg-type]
    assert wrapped._optimizer.clip_grad == 2.0 and not hasattr(wrapped, "clip_grad")
    precision.clip_gradients(wrapped, None, "norm")  # type: ignore[arg-type]
    assert wrapped._optimizer.clip_grad == 0.0

    plain = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    precision.clip_gradients(plain, 1.0)
    assert not hasattr(plain, "clip_grad")


def test_clip_gradients_through_a_real_lightning_optimizer() -> None:
    """LightningOptimizer copies the wrapped optimizer's attributes; the inner one must get the value."""
    inner = StrategyOptimizer(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    MegatronPrecision().clip_gradients(LightningOptimizer(inner), 0.75)  # type: ignore[arg-type]
    assert inner.clip_grad == 0.75


@pytest.mark.parametrize("algorithm", ["value", GradClipAlgorithmType.VALUE])
def test_clip_gradients_rejects_value_clipping(algorithm: Any) -> None:
    target = SimpleNamespace(clip_grad=0.0)
    with pytest.raises(MegatronConfigError, match="gradient_clip_algorithm='value'"):
        MegatronPrecision().clip_gradients(target, 1.0, algorithm)  # type: ignore[arg-type]
    assert target.clip_grad == 0.0
    MegatronPrecision().clip_gradients(target, 0.0, algorithm)  # type: ignore[arg-type]  # clipping off: fine


# -- strategy/optimizer.py ---------------------------------------------------------------------------


def _params(n: int = 1) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(n)]


def test_megatron_kwargs_adam_coupled_weight_decay() -> None:
    """torch Adam adds weight decay to the gradient (L2), so megatron-core must not decouple it."""
    kwargs, reason = _megatron_config_kwargs(
        torch.optim.Adam(_params(), lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    )
    assert reason == ""
    assert kwargs == {
        "optimizer": "adam",
        "lr": 2e-3,
        "weight_decay": 0.05,
        "adam_beta1": 0.8,
        "adam_beta2": 0.9,
        "adam_eps": 1e-6,
        "decoupled_weight_decay": False,
    }
    decoupled, _ = _megatron_config_kwargs(torch.optim.Adam(_params(), decoupled_weight_decay=True))
    assert decoupled is not None and decoupled["decoupled_weight_decay"] is True


def test_megatron_kwargs_adamw_and_sgd() -> None:
    adamw, _ = _megatron_config_kwargs(torch.optim.AdamW(_params(), lr=1e-3, weight_decay=0.1))
    assert adamw is not None
    assert adamw["optimizer"] == "adam" and adamw["decoupled_weight_decay"] is True
    assert adamw["weight_decay"] == 0.1 and (adamw["adam_beta1"], adamw["adam_beta2"]) == (0.9, 0.999)
    sgd, reason = _megatron_config_kwargs(torch.optim.SGD(_params(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    assert reason == ""
    assert sgd == {"optimizer": "sgd", "lr": 0.1, "weight_decay": 1e-4, "sgd_momentum": 0.9}


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: torch.optim.Adam(p, amsgrad=True), "amsgrad"),
        (lambda p: torch.optim.AdamW(p, maximize=True), "maximize"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "nesterov"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
        (lambda p: torch.optim.RMSprop(p), "megatron-core has no RMSprop"),
    ],
)
def test_megatron_kwargs_refusals(make: Any, fragment: str) -> None:
    """What megatron-core cannot reproduce falls back to the torch optimizer, with the reason given."""
    kwargs, reason = _megatron_config_kwargs(make(_params()))
    assert kwargs is None
    assert fragment in reason


def _overrides_by_group(groups: list[dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], dict[int, list[int]]]:
    overrides, representatives = _group_overrides(groups)
    by_group = {}
    for key, override in overrides.items():
        by_group[override[_USER_GROUP]] = {**override, "key": key}
    return by_group, representatives


def test_group_overrides_distinct_groups() -> None:
    """Each user group becomes a megatron-core group with multipliers relative to the largest lr / wd."""
    a, b, c = _params(), _params(), _params()
    groups = [
        {"params": a, "lr": 1e-3, "weight_decay": 0.1},
        {"params": b, "lr": 1e-3, "weight_decay": 0.0},
        {"params": c, "lr": 5e-4, "weight_decay": 0.05},
    ]
    by_group, representatives = _overrides_by_group(groups)
    assert representatives == {0: [0], 1: [1], 2: [2]}
    assert (by_group[0]["lr_mult"], by_group[0]["wd_mult"]) == (1.0, 1.0)
    assert (by_group[1]["lr_mult"], by_group[1]["wd_mult"]) == (1.0, 0.0)
    assert by_group[2]["lr_mult"] == pytest.approx(0.5) and by_group[2]["wd_mult"] == pytest.approx(0.5)
    key = by_group[2]["key"]
    assert key.matches(c[0], "any.name") and not key.matches(a[0], "any.name")


def test_group_overrides_merge_equal_groups() -> None:
    """Groups megatron-core cannot tell apart share one group that matches all their parameters."""
    a, b, c = _params(2), _params(), _params()
    groups = [
        {"params": a, "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
        {"params": b, "lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.95)},
        {"params": c, "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
    ]
    by_group, representatives = _overrides_by_group(groups)
    assert representatives == {0: [0, 2], 1: [1]}
    assert set(by_group) == {0, 1}
    merged = by_group[0]["key"]
    assert all(merged.matches(p, "n") for p in a + c) and not merged.matches(b[0], "n")


def test_group_overrides_zero_weight_decay_everywhere() -> None:
    by_group, _ = _overrides_by_group(
        [{"params": _params(), "lr": 0.1, "weight_decay": 0.0}, {"params": _params(), "lr": 0.05}]
    )
    assert by_group[0]["wd_mult"] == 0.0 and by_group[1]["lr_mult"] == pytest.approx(0.5)


def test_group_overrides_refuse_merging_different_betas() -> None:
    groups = [
        {"params": _params(), "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
        {"params": _params(), "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.999)},
    ]
    with pytest.raises(MegatronConfigError, match="groups 0 and 1") as info:
        _group_overrides(groups)
    assert "'betas'" in str(info.value)


# -- models/specs.py ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("normalization", "cls"), [("LayerNorm", torch.nn.LayerNorm), ("RMSNorm", torch.nn.RMSNorm)])
@pytest.mark.parametrize("sequence_parallel", [True, False])
def test_sequence_parallel_norm(normalization: str, cls: type, sequence_parallel: bool) -> None:
    """Norm weights must carry the flag megatron-core reads to all-reduce them over the TP group."""
    config = SimpleNamespace(normalization=normalization, sequence_parallel=sequence_parallel)
    norm = SequenceParallelNorm(config, 16, eps=1e-6)  # type: ignore[arg-type]
    assert type(norm) is cls
    assert norm.eps == 1e-6
    assert norm.weight.shape == (16,)
    params = list(norm.parameters())
    assert params and all(p.sequence_parallel is sequence_parallel for p in params)


def test_sequence_parallel_norm_rejects_unknown_normalization() -> None:
    with pytest.raises(MegatronConfigError, match="normalization='BatchNorm'"):
        SequenceParallelNorm(SimpleNamespace(normalization="BatchNorm", sequence_parallel=False), 8)  # type: ignore[arg-type]


# -- lightning_megatron: registration and MegatronAppStrategy(...) ----------------------------------


def test_import_registers_megatron_strategy() -> None:
    """``Trainer(strategy="megatron")`` and ``strategy: megatron`` in YAML rely on this import side effect: with
    ``lightning.pytorch`` already loaded (as here), ``import lightning_megatron`` imports the strategy and
    registers its name at once."""
    saved = StrategyRegistry.pop("megatron", None)
    try:
        assert "megatron" not in StrategyRegistry
        importlib.reload(lightning_megatron)
        assert StrategyRegistry["megatron"]["strategy"] is MegatronAppStrategy
        assert isinstance(StrategyRegistry.get("megatron"), MegatronAppStrategy)
    finally:
        if saved is not None:
            StrategyRegistry["megatron"] = saved


def test_lazy_import_registers_megatron_strategy_on_first_access() -> None:
    """The other import order: ``import lightning_megatron`` first loads neither torch, Lightning nor
    megatron-core (trace readers such as the TensorBoard plugin rely on it); the strategy's first access
    imports ``lightning_megatron.strategy``, which registers ``"megatron"``."""
    code = (
        "import sys\n"
        "import lightning_megatron\n"
        "heavy = sorted({'torch', 'lightning', 'megatron'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
        "assert lightning_megatron.MegatronConfigError.__name__ == 'MegatronConfigError'\n"
        "from lightning_megatron import MegatronAppStrategy\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert StrategyRegistry['megatron']['strategy'] is MegatronAppStrategy\n"
        "assert lightning_megatron.MegatronPrecision.__name__ == 'MegatronPrecision'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_strategy_defaults() -> None:
    strategy = MegatronAppStrategy()
    assert strategy.schedule.name == "1f1b" and strategy.micro_batch_size == 1
    virtual = MegatronAppStrategy(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert virtual.schedule.name == "interleaved"


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        (dict(schedule="zero-bubble"), ["Unknown pipeline schedule 'zero-bubble'", "1f1b", "interleaved"]),
        (dict(pipeline_model_parallel_size=2, schedule="interleaved"), ["virtual_pipeline_model_parallel_size"]),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, schedule="1f1b"),
            ["schedule='1f1b'", "virtual_pipeline_model_parallel_size=2"],
        ),
        (dict(overlap_param_gather=True), ["overlap_param_gather", "use_distributed_optimizer"]),
        (dict(process_group_backend="mpi"), ["process_group_backend", "'mpi'"]),
        (dict(micro_batch_size=0), ["micro_batch_size", "0"]),
        (dict(micro_batch_size=2.0), ["micro_batch_size", "2.0"]),
        (dict(ddp_config={"overlap_grad_reduce": True}), ["ddp_config['overlap_grad_reduce']"]),
        (dict(ddp_config={"bucket_size": 10}), ["ddp_config['bucket_size']"]),
        (dict(tensor_model_parallel_size=0), ["tensor_model_parallel_size"]),
        (dict(sequence_parallel=True), ["sequence_parallel"]),
    ],
)
def test_strategy_constructor_errors(kwargs: dict[str, Any], fragments: list[str]) -> None:
    """Bad arguments fail at construction, on every rank alike, before any process group exists."""
    with pytest.raises(MegatronConfigError) as info:
        MegatronAppStrategy(**kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_strategy_accepts_consistent_arguments() -> None:
    """The counterparts of the refused combinations construct fine (the checks are not over-eager)."""
    MegatronAppStrategy(overlap_param_gather=True, use_distributed_optimizer=True)
    MegatronAppStrategy(process_group_backend="gloo", micro_batch_size=4)
    strategy = MegatronAppStrategy(ddp_config={"check_for_nan_in_grad": True})
    assert strategy._ddp_kwargs["check_for_nan_in_grad"] is True


def test_foreach_multi_tensor_kernels_match_megatron_cores_local_fallbacks() -> None:
    """``compat.multi_tensor``: the same norm and scaled copies as megatron-core's per-tensor fallbacks (whose norm
    synchronises with the device once per tensor), and installed only over those fallbacks."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from lightning_megatron.compat import multi_tensor

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) for n in (3, 100, 7)] + [torch.randn(5, generator=g).bfloat16()]
    flag = torch.zeros(1, dtype=torch.int)
    ours, _ = multi_tensor.foreach_l2_norm(0, flag, [tensors], False)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))
    assert ours.shape == (1,) and float(ours) == pytest.approx(float(expected), rel=1e-6)
    assert float(multi_tensor.foreach_l2_norm(0, flag, [[]], False)[0]) == 0.0
    fp32 = tensors[:3]
    for scale in (1.0, 0.25):
        copies = [torch.empty_like(t, dtype=torch.bfloat16) for t in fp32]
        reference = [torch.empty_like(t, dtype=torch.bfloat16) for t in fp32]
        multi_tensor.foreach_scale(0, flag, [fp32, copies], scale)
        utils.local_multi_tensor_scale(0, flag, [fp32, reference], scale)
        assert all(torch.equal(a, b) for a, b in zip(copies, reference))
        in_place = [t.clone() for t in fp32]
        multi_tensor.foreach_scale(0, flag, [in_place, in_place], scale)
        assert all(torch.equal(a, t * scale) for a, t in zip(in_place, fp32))
    assert multi_tensor.install()  # this machine has neither Transformer Engine nor Apex
    assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
    assert (
        clip_grads.multi_tensor_scale_impl is megatron_optimizer.multi_tensor_scale_impl is multi_tensor.foreach_scale
    )
    sentinel = object()  # a kernel from elsewhere (Transformer Engine, Apex) is left alone
    clip_grads.l2_norm_impl = sentinel
    try:
        multi_tensor.install()
        assert clip_grads.l2_norm_impl is sentinel
    finally:
        clip_grads.l2_norm_impl = multi_tensor.foreach_l2_norm
