"""MegaScope on a GPU in bf16: captures, the recomputed attention map, perturbations (bit flips in bf16's own
bits) and the engine. Skipped without CUDA; run on the device machine (results in benchmarks/results/)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODEL = dict(
    vocab_size=1000,
    seq_length=128,
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=4,
    activation="swiglu",
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
)


def _build(spec: str):  # noqa: ANN202
    from lightning_megatron.models import GPTModule
    from lightning_megatron.models.loading import prepare

    module = GPTModule(**MODEL, layer_spec=spec, init_method_std=0.05)
    prepare(module, accelerator="gpu", precision="bf16-mixed")
    return module


def _forward(module, ids):  # noqa: ANN001, ANN202
    chunk = module.model_chunks[0]
    chunk.eval()
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        return chunk(input_ids=ids, position_ids=positions, attention_mask=None)


def test_bf16_capture_pattern_and_perturbations_on_gpu() -> None:
    from lightning_megatron.scope import capture, perturb

    ids = torch.randint(0, 1000, (2, 96), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    caches = {}
    for spec in ("local", "sdpa"):
        module = _build(spec)
        with capture(module, ["blocks.*.attn.hook_pattern", "blocks.3.hook_resid_post", "hook_logits"]) as cache:
            clean = _forward(module, ids)
        caches[spec] = cache
        assert cache["blocks.3.hook_resid_post"].dtype == torch.bfloat16
        assert cache["blocks.3.hook_resid_post"].device.type == "cpu"
        for kind, strength in (("gaussian", 0.0), ("bitflip", 0.0), ("uniform", 0.0)):
            with perturb(module, "blocks.1.hook_resid_post", kind, strength):
                assert torch.equal(_forward(module, ids), clean), kind
        with perturb(module, "blocks.1.hook_resid_post", "bitflip", 1e-3, seed=1):
            flipped = _forward(module, ids)
        assert not torch.equal(flipped, clean)
        with perturb(module, "storage", "gaussian", 0.05, seed=2):
            noisy = _forward(module, ids)
        assert not torch.equal(noisy, clean)
        assert torch.equal(_forward(module, ids), clean), "leaving the context restores the model exactly"
    # the recomputed map (sdpa) equals megatron-core's own softmax (local) up to bf16 rounding of q and k
    for layer in range(4):
        name = f"blocks.{layer}.attn.hook_pattern"
        torch.testing.assert_close(caches["sdpa"][name].float(), caches["local"][name].float(), rtol=0, atol=2e-2)


def test_engine_generates_with_probes_on_gpu() -> None:
    from lightning_megatron.scope.engine import DEFAULT_PROBES, ScopeEngine

    class Ids:
        vocab_size, eod_id = 1000, 0

        def encode(self, text: str) -> list[int]:
            return [int(t) for t in text.split()]

        def decode(self, ids) -> str:  # noqa: ANN001
            return " ".join(map(str, ids))

    module = _build("sdpa")
    engine = ScopeEngine(module, Ids())
    events: list[dict] = []
    request = {
        "id": "gpu",
        "prompts": ["1 2 3 4 5", "7 8 9"],
        "max_new_tokens": 8,
        "probes": list(DEFAULT_PROBES),
        "attention": {"layers": [0, 3], "heads": [1]},
        "pca": True,
    }
    engine.generate(request, events.append, lambda: False)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and kinds[-1] == "finish"
    assert kinds.count("token") == 5 + 8 - 3
    assert kinds.count("pca") == 4
    plain = module.generate([[1, 2, 3, 4, 5], [7, 8, 9]], 8, temperature=0)
    assert events[-1]["texts"] == [" ".join(map(str, row)) for row in plain.tokens], "probes do not change the output"
