"""Missing data is never "nothing abnormal": a rank whose trace holds no spans (cut to 40 bytes, as a crash or a
full disk leaves it) or has no file is named as not judged, in the verdict and in the report's JSON; where no rank
could be judged ``scan detect`` exits non-zero. Warnings come first and once, in ``scan detect`` and in
``scan aggregate`` (whose progress bars must not swallow them), and a skew that could not be measured reads so.
Through the CLI's own entry point, on synthetic traces."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from lightning_megatron.scan.analysis.detect import detect
from lightning_megatron.scan.analysis.format import list_rank_files
from lightning_megatron.scan.analysis.report import DetectionReport
from lightning_megatron.scan.cli import main
from lightning_megatron.scan.evaluation.synthetic import generate_traces


def _cut(trace_dir: Path, *ranks: int) -> None:
    files = list_rank_files(trace_dir)
    for rank in ranks:
        with open(files[rank], "r+b") as stream:
            stream.truncate(40)


@pytest.fixture
def one_rank_cut(tmp_path: Path) -> Path:
    """DP2, 12 steps, rank 1's trace cut to 40 bytes: the opening bracket and part of a first record."""
    generate_traces(tmp_path / "dp2", dp=2, pp=1, tp=1, steps=12)
    _cut(tmp_path / "dp2", 1)
    return tmp_path / "dp2"


def test_detect_names_the_rank_it_could_not_judge(one_rank_cut: Path, capfd: pytest.CaptureFixture[str]) -> None:
    report_path = one_rank_cut / "report.json"
    assert main(["detect", str(one_rank_cut), "--json", str(report_path)]) == 0  # rank 0 was judged
    out = capfd.readouterr().out
    lines = out.splitlines()
    verdict = next(i for i, line in enumerate(lines) if not line.startswith("warning:"))
    assert lines[verdict].startswith("nothing abnormal (1 of 2 ranks judged, 12 steps); not judged: rank 1 ("), out
    assert "no spans in the trace file" in lines[verdict]
    warned = [line for line in lines if line.startswith("warning:")]
    assert warned and not any(line.startswith("warning:") for line in lines[verdict:]), out  # warnings first
    assert len(warned) == len(set(warned)) and "damaged line" in out, out  # once each
    assert "nothing abnormal (2 ranks" not in out
    saved = json.loads(report_path.read_text())
    assert saved["unjudged_ranks"] == {"1": "no spans in the trace file: empty or cut short"}
    assert DetectionReport.from_json(saved).unjudged_ranks == {1: "no spans in the trace file: empty or cut short"}


def test_nothing_judged_is_no_verdict_and_a_failing_exit(one_rank_cut: Path, capfd: pytest.CaptureFixture[str]) -> None:
    _cut(one_rank_cut, 0)
    assert main(["detect", str(one_rank_cut)]) == 1
    out = capfd.readouterr().out
    assert "nothing could be judged (0 of 2 ranks judged); not judged: ranks 0, 1 (" in out, out
    assert "nothing abnormal" not in out


def test_a_missing_rank_file_and_suspects_elsewhere(tmp_path: Path) -> None:
    """A lost rank beside a slow one: the slow one is named, the lost one is listed as not judged."""
    generate_traces(tmp_path, steps=6, slow_ranks={6: 1.4}, missing_ranks=(5,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = detect(tmp_path)
    assert [(s.rank, s.kind) for s in report.suspects] == [(6, "compute")], report.table()
    assert report.unjudged_ranks == {5: "no trace file"} and report.judged_ranks == [0, 1, 2, 3, 4, 6, 7]
    verdict = [line for line in report.table().splitlines() if not line.startswith("warning:")][0]
    assert verdict.startswith("1 suspect(s) in 7 of 8 ranks judged, 6 steps; not judged: rank 5 (no trace file)")
    assert DetectionReport.from_json(report.to_json()) == report


def test_a_complete_trace_reads_as_before(tmp_path: Path) -> None:
    generate_traces(tmp_path, dp=2, pp=1, tp=1, steps=12)
    report = detect(tmp_path)
    assert report.unjudged_ranks == {} and report.judged
    assert report.table() == "nothing abnormal (2 ranks, 12 steps)"


def test_aggregate_prints_each_warning_once_before_its_summary(
    one_rank_cut: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """With its progress bars on (the default), on the same file descriptors a terminal would show."""
    assert main(["aggregate", str(one_rank_cut), "-o", str(tmp_path / "merged.json")]) == 0
    captured = capfd.readouterr()
    both = captured.out + captured.err
    for message in ("truncated or damaged rank file", "no megascan.clock record for rank(s) 1", "no spans in"):
        assert both.count(message) == 1, (message, both)
    warned = [line for line in captured.err.splitlines() if "scan aggregate: warning:" in line]
    prefix = "lightning-megatron scan aggregate: warning:"  # the command line's one error style
    assert len(warned) == 3 and all(line.startswith(prefix) for line in warned), both
    assert "None" not in captured.out, captured.out
    assert "residual clock skew not measured" in captured.out and "2/2 ranks" in captured.out
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["metadata"]["megascan"]["ranks_without_spans"] == [1]
