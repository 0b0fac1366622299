"""Single-process unit tests (no Trainer, no process group) of models/specs.py: the norm layer with sequence
parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_megatron import MegatronConfigError
from lightning_megatron.models.specs import SequenceParallelNorm


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
