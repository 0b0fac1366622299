"""Weight initialization that does not depend on how the model is split.

megatron-core draws each rank's weights from a random stream whose position depends on which layers
the rank builds, so the same seed gives a different model at TP2×PP2 than on one GPU. Here every
randomly initialized weight is drawn from its own generator, seeded by the weight's *global* name and
layer number (the keys of megatron-core's sharded state dict), and each rank copies out its own shard.
Any TP/PP/VPP layout therefore starts from the same model, which makes runs comparable across layouts
and lets a layout change be checked for exactness.

The distributions are megatron-core's: normal(0, ``init_method_std``) for weight matrices and
embeddings, scaled by 1/sqrt(2·num_layers) for the two output projections of each layer; biases and
norm parameters keep their (already deterministic) zeros and ones.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch

from lightning_megatron.models.sharding import sharded_tensors

__all__ = ["init_split_invariant_"]

_SCALED_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")
# Random weight matrices: linears', embeddings' and routers' ``weight``, and the MoE shared experts' gate (a [1,
# hidden] matrix megatron-core draws from the default generator, whose position depends on the layout).
_RANDOM = (".weight", ".gate_weight")


def _generator(seed: int, key: str, layer: tuple[int, ...], device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}|{key}|{layer}".encode()).digest()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return generator


@torch.no_grad()
def init_split_invariant_(chunks: Sequence[torch.nn.Module], *, seed: int, std: float, num_layers: int) -> None:
    """Re-draw the random weights of ``chunks`` in place, identically under every parallel layout."""
    output_std = std / math.sqrt(2.0 * num_layers)
    for chunk in chunks:
        for sharded in sharded_tensors(chunk.sharded_state_dict()):
            data = sharded.data
            if not sharded.key.endswith(_RANDOM) or data.dim() < 2 or sharded.flattened_range is not None:
                continue  # biases and norm weights: deterministic already
            prepend = sharded.prepend_axis_num
            layer = tuple(sharded.global_offset[:prepend])
            full_shape = sharded.global_shape[prepend:]
            sigma = output_std if sharded.key.endswith(_SCALED_OUTPUT_PROJECTIONS) else std
            full = torch.empty(full_shape, dtype=torch.float32, device=data.device)
            full.normal_(0.0, sigma, generator=_generator(seed, sharded.key, layer, data.device))
            index = tuple(
                slice(offset, offset + size) for offset, size in zip(sharded.global_offset[prepend:], data.shape)
            )
            data.copy_(full[index])
