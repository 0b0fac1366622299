"""Text generation (``models.generation``) at every parallel layout, on real forked gloo ranks.

One case per layout builds the same weights and runs every scenario (``generation_cases.generation_case``);
the tests below read its per-rank results. Greedy tokens must match exactly across layouts and between
batched and one-prompt-at-a-time generation; KV-cache logits must match full recompute within 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from generation_cases import NEW_TOKENS, PROMPTS, generation_case, half_precision_case

from lightning_megatron.models.generation import Generation, sample_tokens

LAYOUTS = {
    "single": (1, {}),
    "tp2": (2, {"tensor_model_parallel_size": 2}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp2-vpp2": (2, {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2}),
    "tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "tp2-pp2-vpp2-sp": (
        4,
        {
            "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2,
            "virtual_pipeline_model_parallel_size": 2,
            "sequence_parallel": True,
        },
    ),
}


@pytest.fixture(scope="module")
def layouts(ranks: Any) -> dict[str, list[dict[str, Any]]]:
    """Every layout's per-rank results (computed once for the whole module)."""
    return {name: ranks.run(world, generation_case, world, timeout=300, **kw) for name, (world, kw) in LAYOUTS.items()}


def _same_on_every_rank(results: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in results]
    for rank, value in enumerate(values):
        assert value == values[0], f"{key}: rank {rank} differs from rank 0"
    return values[0]


def test_greedy_is_identical_at_every_layout(layouts: dict[str, list[dict[str, Any]]]) -> None:
    reference = _same_on_every_rank(layouts["single"], "greedy")
    assert isinstance(reference, Generation)
    assert reference.prompt_lengths == [len(p) for p in PROMPTS]
    assert [len(c) for c in reference.continuations] == [NEW_TOKENS] * len(PROMPTS)
    assert reference.stop_reasons == ["length"] * len(PROMPTS)
    assert [row[: len(p)] for row, p in zip(reference.tokens, PROMPTS)] == PROMPTS
    assert len({tuple(c) for c in reference.continuations}) > 1, "a degenerate model proves little"
    for name, results in layouts.items():
        assert _same_on_every_rank(results, "greedy") == reference, name
        assert _same_on_every_rank(results, "tensor_prompts") == layouts["single"][0]["tensor_prompts"]
    assert torch.tensor(layouts["single"][0]["tensor_prompts"]).shape == (2, 3 + 4)


def test_kv_cache_equals_full_recompute(layouts: dict[str, list[dict[str, Any]]]) -> None:
    for name, results in layouts.items():
        for r in results:
            assert r["greedy_recompute"] == r["greedy"], name
            cached, recomputed = r["greedy_steps"], r["recompute_steps"]
            assert [s["position"] for s in cached] == [s["position"] for s in recomputed]
            for a, b in zip(cached, recomputed):
                assert (a["logits"] is None) == (not r["last_stage"])
                if a["logits"] is not None:
                    assert a["logits"].dtype == torch.float32 and a["logits"].shape == (len(PROMPTS), 128)
                    # fp32 rounding only: logits of magnitude ~10 differ by a few ulps (measured: at most 9e-6).
                    torch.testing.assert_close(a["logits"], b["logits"], rtol=1e-5, atol=1e-5)


def test_logits_agree_across_layouts(layouts: dict[str, list[dict[str, Any]]]) -> None:
    """The last stage's logits at every layout are the single process's, up to reduction order."""
    reference = [s["logits"] for s in layouts["single"][0]["greedy_steps"]]
    for name, results in layouts.items():
        for r in results:
            if r["last_stage"]:
                for step, expected in zip(r["greedy_steps"], reference):
                    torch.testing.assert_close(step["logits"], expected, rtol=1e-5, atol=1e-4, msg=name)


def test_batched_prompts_of_different_lengths_match_one_at_a_time(layouts: dict[str, list[dict[str, Any]]]) -> None:
    for name, results in layouts.items():
        for r in results:
            assert r["alone"] == r["greedy"].tokens, name


def test_callback_sees_every_position_and_positions_reach_the_chunks(layouts: dict[str, list[dict[str, Any]]]) -> None:
    shortest, longest = min(map(len, PROMPTS)), max(map(len, PROMPTS))
    for name, results in layouts.items():
        for r in results:
            steps = r["greedy_steps"]
            assert [s["position"] for s in steps] == list(range(shortest, longest + NEW_TOKENS)), name
            for s in steps:
                assert s["in_prompt"] == [len(p) > s["position"] for p in PROMPTS]
                assert s["done"] == [len(p) + NEW_TOKENS <= s["position"] for p in PROMPTS]
                for row, token, done in zip(r["greedy"].tokens, s["tokens"], s["done"]):
                    if not done:
                        assert row[s["position"]] == token
            # Every chunk saw keyword int64 position_ids: the prefill, then one position per step.
            by_chunk: dict[int, list[list[list[int]]]] = {}
            for chunk, positions in r["hook_positions"]:
                assert positions is not None and positions[0] == torch.int64, name
                by_chunk.setdefault(chunk, []).append(positions[1])
            for calls in by_chunk.values():
                assert all(row == call[0] for call in calls for row in call), "every row computes the same positions"
                firsts = [call[0] for call in calls]
                if name.endswith("sp"):  # recompute from 0, right-padded to a multiple of TP
                    assert [f[0] for f in firsts] == [0] * len(calls)
                    assert [len(f) % 2 for f in firsts] == [0] * len(calls)
                else:
                    assert firsts[0] == list(range(shortest))
                    assert firsts[1:] == [[p] for p in range(shortest, longest + NEW_TOKENS - 1)]


def test_callback_stop_is_agreed_by_every_rank(layouts: dict[str, list[dict[str, Any]]]) -> None:
    stop_at = min(map(len, PROMPTS)) + 2
    for name, results in layouts.items():
        stopped = _same_on_every_rank(results, "stopped")
        assert _same_on_every_rank(results, "stopped_positions")[-1] == stop_at, name
        greedy = results[0]["greedy"]
        assert stopped.tokens == [row[: max(stop_at + 1, len(p))] for row, p in zip(greedy.tokens, PROMPTS)], name
        assert stopped.stop_reasons == ["callback"] * len(PROMPTS)


def test_eos_ends_rows(layouts: dict[str, list[dict[str, Any]]]) -> None:
    for name, results in layouts.items():
        eos = _same_on_every_rank(results, "eos_id")
        greedy = results[0]["greedy"]
        first = greedy.continuations[0]
        single = _same_on_every_rank(results, "eos_single")
        assert single.continuations == [first[: first.index(eos) + 1]] and single.stop_reasons == ["eos"], name
        batch = _same_on_every_rank(results, "eos_batch")
        for row, continuation, reason in zip(batch.continuations, greedy.continuations, batch.stop_reasons):
            if eos in continuation:
                assert row == continuation[: continuation.index(eos) + 1] and reason == "eos"
            else:
                assert row == continuation and reason == "length"


def test_sampling_is_seeded_and_layout_independent(layouts: dict[str, list[dict[str, Any]]]) -> None:
    reference = layouts["single"][0]
    assert reference["sampled"] == reference["sampled_again"]
    assert reference["sampled"] != reference["sampled_other_seed"]
    assert reference["sampled"] != reference["greedy"].tokens
    assert reference["tiny_top_p"] == reference["greedy"].tokens
    for name, results in layouts.items():
        for key in ("sampled", "sampled_other_seed", "tiny_top_p"):
            assert _same_on_every_rank(results, key) == reference[key], (name, key)


def test_training_mode_is_restored(layouts: dict[str, list[dict[str, Any]]]) -> None:
    for results in layouts.values():
        assert all(r["training_restored"] and r["eval_kept"] for r in results)


def test_bad_arguments_raise_clear_errors_on_every_rank(layouts: dict[str, list[dict[str, Any]]]) -> None:
    errors = _same_on_every_rank(layouts["single"], "errors")
    expected_words = {
        "no prompts": "prompts",
        "empty prompt": "prompts[1]",
        "prompt too long": "seq_length",
        "too many new tokens": "max_new_tokens",
        "token outside vocab": "vocab_size",
        "float tensor": "prompts",
        "text prompt": "tokenize",
        "top_p zero": "top_p",
        "top_p above one": "top_p",
        "negative temperature": "temperature",
        "negative top_k": "top_k",
        "eos outside vocab": "eos_id",
        "negative max_new_tokens": "max_new_tokens",
    }
    for name, word in expected_words.items():
        assert word in errors[name], (name, errors[name])
    for name, results in layouts.items():
        assert _same_on_every_rank(results, "errors") == errors, name


def test_half_precision_pipeline(ranks: Any) -> None:
    """bf16 chunks at PP2: activations cross stages in bf16, every rank agrees, the logits are fp32."""
    results = ranks.run(2, half_precision_case, 2, pipeline_model_parallel_size=2, timeout=300)
    greedy = _same_on_every_rank(results, "greedy")
    assert [len(c) for c in greedy.continuations] == [NEW_TOKENS] * len(PROMPTS)
    assert results[0]["params_dtype"] == "torch.bfloat16"
    assert results[0]["logits_dtypes"] == [] and results[1]["logits_dtypes"] == ["torch.float32"]


def test_sample_tokens_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.0]])
    assert sample_tokens(logits, temperature=0).tolist() == [1, 0]
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        assert sample_tokens(logits, top_k=1, generator=g).tolist() == [1, 0]
        assert set(sample_tokens(logits, top_k=2, generator=g).tolist()[:1]) <= {1, 2}
        assert sample_tokens(logits, top_p=1e-6, generator=g).tolist() == [1, 0]
        # top_p=0.5: row 0 keeps {1} (p≈0.51), row 1 keeps {0} (p≈0.73)
        assert sample_tokens(logits, top_p=0.5, generator=g).tolist() == [1, 0]
    draws = [
        sample_tokens(logits, temperature=2.0, generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)
    ]
    again = [
        sample_tokens(logits, temperature=2.0, generator=torch.Generator().manual_seed(s)).tolist() for s in range(2)
    ]
    assert draws == again


def test_sample_tokens_with_vanishing_temperature_or_top_p() -> None:
    """Values the schema allows (temperature, top_p > 0) but fp32 cannot divide by or hold: the most likely
    token, never a NaN probability; logits a perturbation made non-finite still give a token."""
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.0]])
    for temperature, top_p in ((1e-300, 1.0), (5e-324, 0.9), (1.0, 1e-300), (1e-40, 1e-300)):
        g = torch.Generator().manual_seed(0)
        assert sample_tokens(logits, temperature=temperature, top_p=top_p, generator=g).tolist() == [1, 0]
    broken = torch.tensor([[float("nan"), 1.0, float("inf"), 0.0], [float("nan")] * 4])
    assert sample_tokens(broken, temperature=0.7, generator=torch.Generator().manual_seed(0))[0].item() == 2
