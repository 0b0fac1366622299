"""How ``megascan_eval.py``'s runs are scored: which kinds name a fault rightly, when a fault slows the job, recall
and precision per case, and detection run again on kept traces (``--rescore``). Apart from the runs themselves, so
that a change of the rules or of the scoring is judged on recorded GPU results without GPU time (see
``megascan_eval.py``'s docstring for the cases and the scoring's definitions)."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["EXPECTED", "SLOWS_THE_JOB", "marked_in_place_of_replays", "rescore", "score", "suspect_record"]

EXPECTED = {  # the kinds that name a fault rightly
    "gpu-contention": {"compute"},
    "gpu-contention-bursty": {"compute"},
    "gpu-memory-contention": {"compute"},
    "cpu-contention": {"host", "compute"},
    "cpu-contention-stress-ng": {"host", "compute"},
    "cpu-quota": {"host", "compute"},
    "cpu-quota-bursty": {"host", "compute"},
    "host-stall": {"host"},
    "host-stall-in-step": {"host"},
    "host-stall-hidden": {"host"},
    "host-stall-exposed": {"host"},
    "slow-loader": {"data"},
    "slow-loader-mild": {"data"},
    "link-delay": {"link"},
}
SLOWS_THE_JOB = 0.10  # a fault whose median step is at least this much above clean must be found


def score(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case: runs, the job's slowdown, recall (or quiet), precision; see the module docstring. A run's
    slowdown is against the clean runs of its own launch (``launch``: one machine; two machines of the same kind
    differed by up to 20% in clean step time), the case's the median of its runs'."""
    clean_by_launch: dict[Any, list[float]] = {}
    for r in records:
        if r["case"] == "clean":
            clean_by_launch.setdefault(r.get("launch"), []).append(r["step_ms"])
    pooled = [ms for times in clean_by_launch.values() for ms in times]

    def ratio(run: dict[str, Any]) -> float:
        base = statistics.median(clean_by_launch.get(run.get("launch")) or pooled)
        return run["step_ms"] / base

    table: dict[str, Any] = {}
    for case in dict.fromkeys(r["case"] for r in records):
        group = [r for r in records if r["case"] == case]
        slowdown = statistics.median(ratio(r) for r in group) - 1.0 if pooled else None
        named = [s for r in group for s in r["suspects"]]
        entry: dict[str, Any] = {"runs": len(group), "job_slowdown": None if slowdown is None else round(slowdown, 4)}
        if case == "clean":
            entry["must_name_nothing"] = True
            entry["runs_with_a_suspect"] = sum(bool(r["suspects"]) for r in group)
            ratios = [_probe_ratio(r, s["rank"]) for r in group for s in r["suspects"]]
            if any(ratio is not None for ratio in ratios):  # runs with HostUsage's probe (from 2026-11-27 14:40)
                entry["suspect_probe_ratios"] = ratios
        else:
            right = [
                sum(1 for s in r["suspects"] if s["rank"] == r["faulted_rank"] and s["kind"] in EXPECTED[case])
                for r in group
            ]
            wrong = [len(r["suspects"]) - n for r, n in zip(group, right)]
            if slowdown is not None and slowdown >= SLOWS_THE_JOB:
                entry["recall"] = round(sum(bool(n) for n in right) / len(group), 3)
                entry["rank_found_any_kind"] = round(
                    sum(any(s["rank"] == r["faulted_rank"] for s in r["suspects"]) for r in group) / len(group), 3
                )
            else:  # below the bar: naming it rightly is allowed, anything else is a false alarm
                entry["slows_the_job_less_than_bar"] = True
                entry["runs_naming_it_rightly"] = sum(bool(n) for n in right)
            entry["runs_with_a_wrong_suspect"] = sum(bool(n) for n in wrong)
            entry["precision"] = round(sum(right) / len(named), 3) if named else None
        kinds: dict[str, int] = {}
        for s in named:
            kinds[s["kind"]] = kinds.get(s["kind"], 0) + 1
        entry["named_kinds"] = kinds
        table[case] = entry
    return table


def _probe_ratio(run: dict[str, Any], rank: int) -> float | None:
    """How much slower ``rank``'s host ran the fixed probe than its peers' did in ``run`` (1.2: 20% slower); an
    independent check of a ``host`` suspect where nothing was injected (``host_usage.HostUsage``)."""
    probes = [h.get("probe_ms") if h else None for h in run.get("hosts", [])]
    if rank >= len(probes) or probes[rank] is None:
        return None
    others = [p for k, p in enumerate(probes) if k != rank and p is not None]
    return round(probes[rank] / statistics.median(others), 3) if others else None


def rescore(result: dict[str, Any], traces: Path, as_replayed_between: bool = False) -> dict[str, Any]:
    """Detection run again, with today's rules, on the traces a GPU evaluation kept (``--keep-traces``): every
    run whose folder ``TRACES/LAYOUT/CASE-RUN`` exists gets its suspects anew; runs without traces are left
    out. The faults stay what they were, so a change of the rules is judged on real GPU traces without GPU
    time. ``as_replayed_between``: read every traced step as one run eagerly in place of a CUDA-graph replay
    (``args.in_place_of_replay``), as in a job whose untraced steps replay; the evaluation's fits trace every
    step, so nothing replayed in them, and their step times are the eager job's: this asks what the rules would
    say of those same traced steps in the default job, not how that job was slowed."""
    from lightning_megatron.scan.analysis.detect import detect

    out = {**result, "rescored_from": str(traces), "layouts": {}}
    if as_replayed_between:
        out["rescored_as_replayed_between"] = True
    for name, outcome in result["layouts"].items():
        runs = []
        for run in outcome.get("runs", []):
            folder = traces / name / f"{run['case']}-{run['run']}"
            if not folder.is_dir():
                continue
            if as_replayed_between:
                with tempfile.TemporaryDirectory() as marked:
                    report = detect(marked_in_place_of_replays(folder, Path(marked)))
            else:
                report = detect(folder)
            runs.append({**run, "suspects": [suspect_record(s) for s in report.suspects]})
        if runs:
            out["layouts"][name] = {"runs": runs, "score": score(runs)}
    return out


def marked_in_place_of_replays(folder: Path, into: Path) -> Path:
    """A copy of a run's rank files in ``into``, each step span marked ``in_place_of_replay``, unless the job is
    pipelined (the strategy replays no graph at PP > 1: its eager steps are the job's)."""
    from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

    for path in list_rank_files(folder).values():
        events = list(read_rank_file(path))
        info = next((e["args"] for e in events if e.get("name") == "megascan.rank"), {})
        for event in events:
            if event.get("cat") == "step" and event.get("ph") == "X" and info.get("pipeline_size", 1) == 1:
                event.setdefault("args", {})["in_place_of_replay"] = True
        (into / path.name.removesuffix(".gz")).write_text("[\n" + ",\n".join(map(json.dumps, events)) + "\n]\n")
    return into


def suspect_record(s: Any) -> dict[str, Any]:
    """A suspect as a result keeps it: who, what, how much, by which rule, and the rule's and the attribution's
    numbers (``evidence``: scalars and short lists), so a wrong suspect can be read without the run's traces."""
    return {
        "rank": s.rank,
        "kind": s.kind,
        "slowdown": s.slowdown,
        "impact_ms": round(s.impact_ms, 3),
        "rule": s.evidence.get("rule", "per-op medians"),
        "evidence": _plain(s.evidence),
    }


_LEFT_OUT = object()  # a value too large, or of no JSON kind, for a result file


def _plain(evidence: dict[str, Any]) -> dict[str, Any]:
    """The JSON-sized part of a suspect's evidence: numbers (floats to 4 places), strings, and lists or dicts of
    up to 16 such items; the rest (per-op tables, arrays) is left out."""
    out = {str(k): _plain_value(v) for k, v in evidence.items() if k != "rule"}
    return {k: v for k, v in out.items() if v is not _LEFT_OUT}


def _plain_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, (list, tuple)) and len(value) <= 16:
        items = [_plain_value(v) for v in value]
        return _LEFT_OUT if any(v is _LEFT_OUT for v in items) else items
    if isinstance(value, dict) and len(value) <= 16:
        return _plain(value)
    return _LEFT_OUT
