"""``tp_comm_overlap``: tensor-parallel communication overlapped with the GEMMs of megatron-core's parallel linear
layers by chunked collective matmul (``layers/collective_matmul.py``, ``layers/tp_overlap.py``).

On CPUs in fp32 (gloo, real forked ranks):

* the three primitives equal the collective and GEMM done whole (float64; uneven chunks, more chunks than rows);
* whole fits with the overlap give the same losses and every step's gradients as megatron-core's own layers
  (within 1e-6): TP2 (GPT-shaped, biases: the all-reduce paths); TP2+SP (Llama-shaped, validating after every
  step: no-grad forwards; GPT-shaped with tied embeddings, whose output layer keeps megatron-core's path, 3
  chunks of 8 tokens); TP2+SP with ``gradient_accumulation_fusion``; TP2×PP2; TP2×PP2×VPP2+SP (interleaved);
  DP2×TP2+SP with the distributed optimizer and ``overlap_grad_reduce`` (megatron-core's DDP hook takes the weight
  gradients the overlapped layers return); TP2×PP2+SP under zb-h1's B/W split (W deferred);
* each fit counts how often each primitive ran, which must be what every linear layer of the rank's stage (the
  tied output layer excepted) taking the overlapped path makes: a layer left on megatron-core's path fails;
* bad settings fail when the strategy is built, naming the parameter; TP 1 warns and turns it off; YAML works.

GPU parity in bf16 and the speed: ``test_tp_overlap_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import dpp_cases as dc
import pytest
import tp_overlap_cases as tc
from test_dpp import assert_close

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.layers.collective_matmul import spans

TP2 = dict(tensor_model_parallel_size=2)
SP = dict(tensor_model_parallel_size=2, sequence_parallel=True)
LAYOUTS: dict[str, tuple[int, dict[str, Any], dict[str, Any]]] = {
    # name: (world size, the layout, the overlap's settings)
    "tp2-gpt": (2, TP2, {}),
    "tp2-sp-llama-validating": (  # validation (no_grad forwards through the overlapped layers) after every step
        2,
        dict(
            SP, model={"num_layers": 2, **dc.llama_model()}, trainer={"limit_val_batches": 1, "val_check_interval": 1}
        ),
        {},
    ),
    "tp2-sp-gpt-tied-chunks3": (
        2,
        dict(SP, model={"num_layers": 2, "share_embeddings_and_output_weights": True}),
        {"tp_comm_overlap_chunks": 3},
    ),
    "tp2-sp-fusion": (2, dict(SP, model={"num_layers": 2}), {"gradient_accumulation_fusion": True}),
    "tp2-pp2": (4, dict(TP2, pipeline_model_parallel_size=2), {}),
    "tp2-pp2-vpp2-sp": (
        4,
        dict(SP, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, model={"num_layers": 4}),
        {},
    ),
    "dp2-tp2-sp-distopt-overlap": (
        4,
        dict(SP, model={"num_layers": 2}, use_distributed_optimizer=True, overlap_grad_reduce=True),
        {},
    ),
    "tp2-pp2-sp-zb-h1": (
        4,
        dict(SP, pipeline_model_parallel_size=2, model={"num_layers": 4, **dc.llama_model()}),
        {"schedule": "zb-h1", "tp_comm_overlap_chunks": 4},
    ),
}


def test_spans() -> None:
    assert spans(8, 2) == [(0, 4), (4, 8)]
    assert spans(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert spans(3, 8) == [(0, 1), (1, 2), (2, 3)]
    assert spans(4, 1) == [(0, 4)]


def test_chunked_collective_matmul_equals_unchunked(ranks: Any) -> None:
    for rank, errors in enumerate(ranks.run(2, tc.primitives, [1, 2, 3, 7])):
        assert len(errors) == 16
        for what, error in errors.items():
            assert error < 1e-12, f"rank {rank} {what}: off by {error}"


def expected_calls(world: int, common: dict[str, Any], coordinates: dict[str, int], steps: int) -> dict[str, int]:
    """How often each primitive must run on a rank if every linear layer takes the overlapped path.

    Per microbatch and transformer layer, two column layers (qkv, fc1) and two row layers (proj, fc2), each with one
    collective in its forward or backward and one in the other (column without SP: none in the forward); the output
    layer (last stage, untied) is a column layer. Validation microbatches run forwards only.
    """
    model, trainer = common.get("model", {}), common.get("trainer", {})
    pipeline = common.get("pipeline_model_parallel_size", 1)
    data_parallel = world // (2 * pipeline)
    layers = model.get("num_layers", 4) // pipeline
    output = int(coordinates["pp"] == pipeline - 1 and not model.get("share_embeddings_and_output_weights", False))
    per_step = 8 // (2 * data_parallel)  # global batch 8, micro batch 2
    train = steps * per_step
    validate = (steps if trainer.get("val_check_interval") == 1 else 0) * trainer.get("limit_val_batches", 0) * per_step
    both, forward = 4 * layers + output, 2 * layers
    if common.get("sequence_parallel"):
        return {
            "all_gather_matmul": train * both + validate * (forward + output),  # column forward, row backward
            "matmul_reduce_scatter": train * both + validate * forward,  # row forward, column backward
            "matmul_all_reduce": 0,
        }
    return {"all_gather_matmul": 0, "matmul_reduce_scatter": 0, "matmul_all_reduce": train * both + validate * forward}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_overlap_matches_megatron_core(ranks: Any, layout: str) -> None:
    world, common, overlap = LAYOUTS[layout]
    want = ranks.run(world, tc.fit_counting, world, steps=2, **common)
    got = ranks.run(world, tc.fit_counting, world, steps=2, tp_comm_overlap=True, **overlap, **common)
    for rank in range(world):
        assert want[rank]["fused_layers"] is None and not any(want[rank]["calls"].values())
        assert got[rank]["fused_layers"], f"rank {rank}: no linear layer was given the overlapped path"
        expected = expected_calls(world, common, got[rank]["coordinates"], steps=2)
        assert got[rank]["calls"] == expected, f"{layout} rank {rank}: primitives ran {got[rank]['calls']}"
        assert_close(got[rank], want[rank], 1e-6, f"tp_comm_overlap {layout} rank {rank}")
        assert len(got[rank]["val_loss"]) == len(want[rank]["val_loss"]) == (2 if "validating" in layout else 0)
        for a, b in zip(got[rank]["val_loss"], want[rank]["val_loss"]):
            assert abs(a - b) <= 1e-6 * abs(b), f"{layout} rank {rank}: val_loss {a} vs {b}"
        if overlap.get("schedule") == "zb-h1":  # the weight gradients did run apart from their backward
            assert any(s.startswith("W") for s in got[rank]["sequence"]), got[rank]["sequence"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(tp_comm_overlap="yes"), ["`tp_comm_overlap`", "true or false", "'yes'"]),
        (dict(tp_comm_overlap=True, tp_comm_overlap_chunks=0), ["`tp_comm_overlap_chunks`", "positive integer"]),
        (dict(tp_comm_overlap=True, tp_comm_overlap_chunks=2.5), ["`tp_comm_overlap_chunks`", "2.5"]),
        (dict(tp_comm_overlap_chunks=True), ["`tp_comm_overlap_chunks`", "True"]),
    ],
)
def test_bad_settings_fail_when_the_strategy_is_built(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(MegatronConfigError) as err:
        MegatronAppStrategy(tensor_model_parallel_size=2, **kwargs)
    for word in words:
        assert word in str(err.value), f"{word!r} not in: {err.value}"


def test_settings() -> None:
    assert MegatronAppStrategy(tensor_model_parallel_size=2).tp_comm_overlap is None  # off by default
    on = MegatronAppStrategy(tensor_model_parallel_size=2, tp_comm_overlap=True, tp_comm_overlap_chunks=4)
    assert on.tp_comm_overlap is not None and on.tp_comm_overlap.chunks == 4
    with pytest.warns(UserWarning, match="nothing to overlap with tensor_model_parallel_size=1"):
        assert MegatronAppStrategy(tp_comm_overlap=True).tp_comm_overlap is None


def test_settings_from_yaml() -> None:
    """The CLI's parser (jsonargparse, as ``lightning-megatron fit --config``) takes both settings from YAML."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    skip = {"accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin"}
    parser.add_class_arguments(MegatronAppStrategy, "strategy", skip=skip)
    config = parser.parse_string("strategy:\n  tensor_model_parallel_size: 2\n  tp_comm_overlap: true\n")
    assert parser.instantiate(config).strategy.tp_comm_overlap.chunks == 2
    with pytest.raises(Exception, match="tp_comm_overlap_chunks"):  # jsonargparse's own type check names it
        parser.parse_string("strategy:\n  tp_comm_overlap: true\n  tp_comm_overlap_chunks: many\n")
