"""The evaluation's scoring (``benchmarks/megascan_score.score``) and its host record (``benchmarks/host_usage``):
a fault's slowdown is measured against the clean runs of its own launch (machines of one session differ), and
a clean run's suspect is checked against the host probe of the rank it names."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import megascan_score  # noqa: E402
from host_usage import HostUsage  # noqa: E402


def _run(case: str, run: int, launch: int, step_ms: float, suspects=(), faulted=0, hosts=None) -> dict:
    record = {"case": case, "run": run, "launch": launch, "faulted_rank": None if case == "clean" else faulted}
    record.update(step_ms=step_ms, suspects=list(suspects))
    if hosts is not None:
        record["hosts"] = hosts
    return record


def test_a_faults_slowdown_is_against_the_clean_runs_of_its_launch():
    # Launch 0's machine is fast (clean 100 ms) and the fault costs it 20%; launch 2's is slow (clean 150 ms) and
    # the fault costs nothing there. Pooled, the fault's runs (120, 150) would read -4% against the clean
    # median (125): under the bar, and its recall never counted.
    found = [{"rank": 0, "kind": "compute"}]
    records = [
        _run("clean", 0, 0, 100.0),
        _run("gpu-contention", 0, 0, 120.0, found),
        _run("clean", 1, 0, 100.0),
        _run("gpu-contention", 1, 0, 120.0, found),
        _run("clean", 2, 2, 150.0),
        _run("gpu-contention", 2, 2, 150.0),
    ]
    entry = megascan_score.score(records)["gpu-contention"]
    assert entry["job_slowdown"] == 0.2  # the median of the runs' own ratios: 0.2, 0.2, 0.0
    assert entry["recall"] == round(2 / 3, 3)


def test_records_without_a_launch_share_one_baseline():
    records = [_run("clean", 0, 0, 100.0), _run("slow-loader", 0, 0, 130.0, [{"rank": 0, "kind": "data"}])]
    for record in records:
        del record["launch"]
    assert megascan_score.score(records)["slow-loader"]["job_slowdown"] == 0.3


def test_a_clean_suspect_is_set_beside_its_ranks_host_probe():
    hosts = [{"probe_ms": 1.2}, {"probe_ms": 1.0}]
    records = [_run("clean", 0, 0, 100.0, [{"rank": 0, "kind": "host"}], hosts=hosts)]
    assert megascan_score.score(records)["clean"]["suspect_probe_ratios"] == [1.2]


def test_host_usage_records_each_step_and_summarises_the_traced_ones():
    usage = HostUsage()
    usage.on_train_start()
    for _ in range(5):
        usage.on_train_batch_start()
        sum(i * i for i in range(20_000))  # some work for the main thread's CPU clock
        usage.on_train_batch_end()
    summary = usage.summary(skip=2)
    assert len(summary["probe_ms_by_step"]) == 3
    assert summary["probe_ms"] > 0 and summary["main_thread_cpu_ms"] > 0
    assert summary["main_thread_cpu_ms"] <= summary["step_wall_ms"] * 1.05
    if sys.platform == "linux":
        assert summary["cpus"] and summary["preempted_per_step"] is not None


def test_a_suspects_record_keeps_its_evidence_as_json(tmp_path):
    """A result keeps each suspect's rule numbers and attribution, so a wrong suspect of a GPU run can be read
    later without the run's traces (the 4-GPU runs of 2026-11-27 kept neither)."""
    import json
    import warnings

    from lightning_megatron.scan.analysis.detect import detect
    from lightning_megatron.scan.evaluation.synthetic import generate_traces

    generate_traces(tmp_path, dp=2, pp=1, tp=1, steps=10, slow_ranks={1: 1.3}, slow_host={0: 1.5}, gpu_busy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = detect(tmp_path)
    records = [megascan_score.suspect_record(s) for s in report.suspects]
    assert records and all(isinstance(r["evidence"], dict) and r["evidence"] for r in records), records
    assert json.loads(json.dumps(records)) == records  # plain JSON, nothing left that would not round-trip
    assert all("rule" not in r["evidence"] for r in records)  # the rule has its own field
