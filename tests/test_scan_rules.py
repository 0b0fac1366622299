"""Detection as a declared pipeline (``scan.analysis.rules``): one ordered list of rules, each declaring its name,
the suspect kind it names and the earlier rules it reads; one ``DetectionContext`` passed to every rule; the
shared helpers in ``rules_common``. Synthetic traces with known ground truth, as in ``test_scan_detect.py``."""

from __future__ import annotations

import warnings
from pathlib import Path

from lightning_megatron.scan.analysis import compute_rules, rules_common
from lightning_megatron.scan.analysis.detect import detect
from lightning_megatron.scan.analysis.measure import keep_finished_steps, read_traces
from lightning_megatron.scan.analysis.report import KINDS
from lightning_megatron.scan.analysis.rules import RULES, run_rules
from lightning_megatron.scan.analysis.rules_common import DetectionContext
from lightning_megatron.scan.evaluation.synthetic import generate_traces


def test_every_rule_declares_what_it_names_and_reads_only_earlier_rules() -> None:
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names), names
    for position, rule in enumerate(RULES):
        assert set(rule.reads) <= set(names[:position]), (rule.name, set(rule.reads) - set(names[:position]))
        assert any(kind in rule.names for kind in KINDS), rule
        assert callable(rule.run)
    assert names[0] == "compute per op" and names[-1] == "one cause per rank"


def test_shared_helpers_live_in_rules_common_only() -> None:
    for helper in ("make_suspect", "flagged", "peer_groups", "history_evidence", "comparison_evidence"):
        assert getattr(rules_common, helper).__module__ == "lightning_megatron.scan.analysis.rules_common"
        assert helper not in vars(compute_rules).get("__all__", ()), helper


def test_the_pipeline_step_by_step_is_what_detect_reports(tmp_path: Path) -> None:
    """Rank 3 compute 40% slower, link 0->4 2x slower: the rules one at a time on one context name what
    ``detect`` names, and each finding rule's new suspects are of the kind it declares."""
    generate_traces(tmp_path, slow_ranks={3: 1.4}, slow_links={(0, 4): 2.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = detect(tmp_path)
    notes: list[str] = []
    traces = read_traces(tmp_path, notes)
    keep_finished_steps(traces, 0, notes)
    context = DetectionContext.measure(traces, notes)
    found_by = {}
    for rule in RULES:
        before = {id(s) for s in context.suspects}
        rule.apply(context)
        new = [s for s in context.suspects if id(s) not in before]
        if rule.finds:
            assert all(s.kind == rule.names for s in new), (rule.name, new)
            found_by.update({(s.rank, s.kind): rule.name for s in new})
    assert [(s.rank, s.kind, s.peer) for s in run_rules(DetectionContext.measure(traces, []))] == [
        (s.rank, s.kind, s.peer) for s in report.suspects
    ]
    assert {(s.rank, s.kind) for s in report.suspects} == {(3, "compute"), (0, "link")}, report.table()
    assert found_by[(3, "compute")] == "compute per op" and found_by[(0, "link")] == "links"
