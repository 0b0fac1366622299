"""MegaScan sees the experts: an MoE fit at EP2 (two forked gloo ranks; EP2 × PP2 on four) traces each MoE layer's
dispatch and combine all-to-all, forward and backward, as named collective spans that the merged trace joins
across ranks with flows; writes tokens per expert per step as counter tracks, summed in the report as the load
per layer; and names a rank under a CPU limit (``outside_faults.CpuQuota``) with the right kind, while a clean run
names nothing.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from scan_moe_cases import moe_fit

from lightning_megatron.scan.analysis.aggregate import aggregate
from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file
from lightning_megatron.scan.analysis.validate import validate_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from outside_faults import cpu_quota_available  # noqa: E402

EXCHANGES = {(ex, d) for ex in ("dispatch", "combine") for d in ("forward", "backward")}


def _events(trace_dir: Path, rank: int) -> list[dict[str, Any]]:
    return list(read_rank_file(list_rank_files(trace_dir)[rank]))


def test_exchanges_are_named_spans_joined_by_flows_with_tokens_per_expert(ranks: Any, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    results = ranks.run(2, moe_fit, str(trace), 2, steps=4, expert_model_parallel_size=2)
    assert all(r["restored"] for r in results)  # all_to_all_single is torch's own again after the windows
    for rank in (0, 1):
        events = _events(trace, rank)
        a2a = [e for e in events if e.get("ph") == "X" and e["name"].startswith("all_to_all layer")]
        seen = Counter((e["args"]["layer"], e["args"]["exchange"], e["args"]["direction"]) for e in a2a)
        for layer in (1, 2):
            for exchange, direction in EXCHANGES:
                assert seen[(layer, exchange, direction)] > 0, (rank, layer, exchange, direction, seen)
        assert all(e["cat"] == "collective" and e["args"]["group_name"] == "ep" for e in a2a)
        # per step and layer: dispatch moves tokens and probabilities (2 exchanges), combine the outputs (1)
        per_step = Counter((e["args"]["step"], e["args"]["layer"], e["args"]["exchange"]) for e in a2a)
        microbatches = 2  # global batch 8 = 2 ranks x micro-batch 2 x 2
        for (_, _, exchange), n in per_step.items():
            assert n == (2 if exchange == "dispatch" else 1) * 2 * microbatches, per_step
        counters = [e for e in events if e.get("ph") == "C"]
        assert {e["name"] for e in counters} == {"tokens per expert · layer 1", "tokens per expert · layer 2"}
        local = {0: {"expert 0", "expert 1"}, 1: {"expert 2", "expert 3"}}[rank]
        assert all(set(e["args"]) == local for e in counters)
        assert len(counters) == 2 * 3  # steps 1-3 traced (start_step=1), two layers
    tokens = 8 * 16 * 2  # every token of a step goes to topk=2 experts: global batch x sequence x 2
    summary = aggregate(trace, tmp_path / "merged.json", progress=False)
    assert summary["flows"]["collective"] > 0
    assert validate_trace(tmp_path / "merged.json") == []
    report = results[0]["report"]
    load = report["experts"]
    assert sorted(load["layers"]) == ["1", "2"]
    for entry in load["layers"].values():
        assert entry["tokens_per_step"] == tokens and entry["imbalance"] >= 1.0 and len(entry["per_expert"]) == 4


LAYOUTS = {"ep2": (2, {}), "ep2-pp2": (4, {"pipeline_model_parallel_size": 2})}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clean_moe_run_names_nothing(ranks: Any, tmp_path: Path, layout: str) -> None:
    world, extra = LAYOUTS[layout]
    results = ranks.run(world, moe_fit, str(tmp_path / "trace"), world, expert_model_parallel_size=2, **extra)
    assert results[0]["report"]["suspects"] == [], results[0]["report"]


needs_cgroups = pytest.mark.skipif(
    not cpu_quota_available(), reason="no writable cgroup with the CPU controller (run as root)"
)


@needs_cgroups
@pytest.mark.parametrize("slow", [1, 0])
def test_an_expert_rank_under_a_cpu_limit_is_named(ranks: Any, tmp_path: Path, slow: int) -> None:
    """The limited rank's training thread waits for a CPU wherever it is (the project names that ``host``, from the
    kernel's run-queue delay: ``scan.analysis.cpu_rules``); its net compute, with the all-to-all waits taken out, is
    the slower one too (before the all-to-all was traced, its peer waited inside its own compute spans and both
    looked alike): that comparison is the suspect's ``compute`` evidence."""
    results = ranks.run(2, moe_fit, str(tmp_path / "trace"), 2, steps=12, quota_rank=slow, expert_model_parallel_size=2)
    report = results[0]["report"]
    assert [(s["rank"], s["kind"]) for s in report["suspects"]] == [(slow, "host")], report
    evidence = report["suspects"][0]["evidence"]
    assert "waits for a CPU" in evidence["rule"] and evidence["compute"]["slowdown"] > 0.3, evidence


@needs_cgroups
def test_an_expert_rank_under_a_cpu_limit_is_named_with_pipeline_stages(ranks: Any, tmp_path: Path) -> None:
    """EP2 x PP2 on four ranks: the limited rank of the second stage is named, against its stage's peer."""
    layout = dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2)
    results = ranks.run(4, moe_fit, str(tmp_path / "trace"), 4, steps=12, quota_rank=3, **layout)
    report = results[0]["report"]
    assert [(s["rank"], s["kind"]) for s in report["suspects"]] == [(3, "host")], report
