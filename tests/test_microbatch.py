"""Single-process unit tests (no Trainer, no process group) of strategy/microbatch.py: how a batch becomes microbatches
(views in order, container types kept), and the errors for batches that cannot be split."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from lightning_megatron import MegatronConfigError
from lightning_megatron.strategy.microbatch import batch_size_of, infer_seq_length, split_microbatches

Pair = namedtuple("Pair", ["inputs", "targets"])


def _same_storage(view: torch.Tensor, base: torch.Tensor) -> bool:
    return view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


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
