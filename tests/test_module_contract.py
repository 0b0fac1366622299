"""The LightningModule contract as the README shows it, with a module written from scratch on megatron-core's
GPTModel and local spec (not GPTModule), and the errors for modules that break the contract."""

from __future__ import annotations

from typing import Any

import torch
from cases import fit_gpt
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from lightning_megatron.models import MegatronLightningModule


class MinimalGPT(MegatronLightningModule):
    """The README's example, at test size."""

    def __init__(self, lr: float = 1e-2, **_: Any) -> None:
        super().__init__()
        self.lr = lr

    def config(self, **overrides: Any) -> TransformerConfig:
        fields = dict(num_layers=4, hidden_size=32, num_attention_heads=4, **self.parallel.config_kwargs())
        return TransformerConfig(**{**fields, **overrides})

    def build_chunk(self, stage):  # noqa: ANN001, ANN201
        return GPTModel(
            self.config(),
            get_gpt_layer_local_spec(),
            vocab_size=128,
            max_sequence_length=16,
            pre_process=stage.pre_process,
            post_process=stage.post_process,
            vp_stage=stage.vp_stage,
        )

    def forward_step(self, batch, chunk):  # noqa: ANN001, ANN201
        tokens = batch["tokens"]
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        output = chunk(input_ids=tokens, position_ids=positions, attention_mask=None, labels=batch["labels"])

        def loss_fn(per_token_loss):  # noqa: ANN001, ANN202
            mask = batch["loss_mask"]
            return (per_token_loss * mask).sum(), mask.sum()

        return output, loss_fn

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def test_minimal_module_trains_in_a_pipeline(ranks: Any) -> None:
    results = ranks.run(
        4, fit_gpt, 4, steps=6, module_cls=MinimalGPT, pipeline_model_parallel_size=2, tensor_model_parallel_size=2
    )
    losses = results[0]["loss"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(r["loss"] == losses for r in results), "every rank logs the same global loss"


class BareLossGPT(MinimalGPT):
    def forward_step(self, batch, chunk):  # noqa: ANN001, ANN201
        output, loss_fn = super().forward_step(batch, chunk)
        return output, lambda out: loss_fn(out)[0] / loss_fn(out)[1]  # a mean, not (sum, count)


class NoChunksGPT(MinimalGPT):
    def configure_model(self) -> None:
        self.model = self.build_chunk(self.parallel.stages()[0])


class StrayParameterGPT(MinimalGPT):
    def configure_model(self) -> None:
        super().configure_model()
        self.temperature = torch.nn.Parameter(torch.ones(()))


class WrongConfigGPT(MinimalGPT):
    def config(self, **overrides: Any) -> TransformerConfig:
        return super().config(tensor_model_parallel_size=1)  # ignores the strategy's TP size


def broken_fit(world_size: int, module_cls: type, **strategy: Any) -> tuple[str, str]:
    try:
        fit_gpt(world_size, steps=1, module_cls=module_cls, **strategy)
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)
    return "no error", ""


def test_contract_violations_get_clear_errors(ranks: Any) -> None:
    expectations = {
        BareLossGPT: ("TypeError", "(loss_sum, num_tokens)"),
        NoChunksGPT: ("MegatronConfigError", "self.model_chunks"),
        StrayParameterGPT: ("MegatronConfigError", "temperature"),
        WrongConfigGPT: ("MegatronConfigError", "config_kwargs()"),
    }
    for module_cls, (kind, fragment) in expectations.items():
        results = ranks.run(2, broken_fit, 2, module_cls, tensor_model_parallel_size=2, timeout=60)
        for got_kind, message in results:
            assert got_kind == kind and fragment in message, (module_cls.__name__, got_kind, message)


def greedy_continuation(module: Any) -> Any:
    prompt = torch.arange(5).view(1, 5) % 128
    try:
        return module.generate(prompt, 6, temperature=0).tokens
    except Exception as err:  # noqa: BLE001
        return type(err).__name__, str(err)


def test_generation_is_layout_independent(ranks: Any) -> None:
    """Greedy continuation of the same (untrained, split-invariant) model, right after fit: one process, TP2 and
    PP2 agree (tests/test_generation.py covers the other layouts and the generation options)."""
    untrained = {"lr": 0.0}
    single = ranks.run(1, fit_gpt, 1, steps=1, model=untrained, probe=greedy_continuation)[0]["probe"]
    assert len(single[0]) == 11
    for result in ranks.run(
        2, fit_gpt, 2, steps=1, model=untrained, probe=greedy_continuation, tensor_model_parallel_size=2
    ):
        assert result["probe"] == single
    for result in ranks.run(
        2, fit_gpt, 2, steps=1, model=untrained, probe=greedy_continuation, pipeline_model_parallel_size=2
    ):
        assert result["probe"] == single
