"""MegaScan offline tools on synthetic traces with known ground truth: generator, aggregation, validation.

The synthetic job knows which rank was slow and how far every clock really was from rank 0's, so these tests
check results, not just that the tools run: recovered offsets against the true ones, flow counts against the
simulated transfers and collectives, and the validator against planted errors (it must be able to fail).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from lightning_megatron.scan.analysis.aggregate import aggregate, register_cli
from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file
from lightning_megatron.scan.analysis.validate import validate_trace
from lightning_megatron.scan.evaluation.synthetic import coords_of, generate_traces, rank_of
from lightning_megatron.scan.evaluation.synthetic import main as synthetic_main


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as stream:
        return json.load(stream)


def _aggregate_quietly(trace_dir: Path, output: Path, **kwargs: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean trace must not warn
        return aggregate(trace_dir, output, progress=False, **kwargs)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """dp=4 pp=2 tp=2, random clock offsets up to ±50 ms, one slow rank, one slow link, one slow data loader."""
    out = tmp_path_factory.mktemp("job")
    truth = generate_traces(
        out, dp=4, pp=2, tp=2, steps=2, slow_ranks={5: 1.6}, slow_links={(1, 9): 4.0}, slow_data={12: 10.0}, seed=3
    )
    return out, truth


@pytest.fixture(scope="module")
def merged(job: tuple[Path, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("merged") / "merged.json"
    return out, _aggregate_quietly(job[0], out)


# --- generator -------------------------------------------------------------------------------------------------


def test_synthetic_layout_follows_megatron_core_order(job: tuple[Path, dict[str, Any]]) -> None:
    trace_dir, truth = job
    files = list_rank_files(trace_dir)
    assert sorted(files) == list(range(16)) and truth["world_size"] == 16
    assert rank_of(1, 1, 1, dp=4, tp=2) == 1 + 2 * (1 + 4 * 1)
    for rank, path in files.items():
        d, p, t = coords_of(rank, dp=4, tp=2)
        assert path.name == f"rank{rank:05d}-dp{d}-pp{p}-tp{t}.json"
        info = next(e["args"] for e in read_rank_file(path) if e["name"] == "megascan.rank")
        assert (info["dp"], info["pp"], info["tp"], info["world_size"]) == (d, p, t, 16)
        assert info["backend"] == "synthetic" and info["pipeline_size"] == 2
        assert validate_trace(path) == []  # a rank file is itself a valid (array-form, unclosed) trace


def test_synthetic_clock_records_are_truthful(job: tuple[Path, dict[str, Any]]) -> None:
    trace_dir, truth = job
    assert truth["clock_offsets_us"][0] == 0.0
    assert max(abs(v) for v in truth["clock_offsets_us"].values()) > 1000  # really skewed
    for rank, path in list_rank_files(trace_dir).items():
        clocks = [e["args"] for e in read_rank_file(path) if e["name"] == "megascan.clock"]
        assert len(clocks) == 3
        for clock in clocks:
            assert abs(clock["offset_us"] - truth["clock_offsets_us"][rank]) <= clock["uncertainty_us"] + 1e-9


def _spans(trace_dir: Path, rank: int, name: str) -> list[dict[str, Any]]:
    return [e for e in read_rank_file(list_rank_files(trace_dir)[rank]) if e.get("name") == name]


def test_synthetic_slow_things_are_visible(job: tuple[Path, dict[str, Any]]) -> None:
    trace_dir, _ = job
    # Slow rank 5 (tp group [4, 5]): its compute is longer, and its peer waits for it at the TP all_reduces.
    forward = {r: statistics.mean(e["dur"] for e in _spans(trace_dir, r, "forward")) for r in (4, 5)}
    assert forward[5] > 1.3 * statistics.mean(e["dur"] for e in _spans(trace_dir, 0, "forward"))
    tp_wait = {
        r: statistics.mean(e["dur"] for e in _spans(trace_dir, r, "all_reduce") if e["args"]["group_name"] == "tp")
        for r in (4, 5)
    }
    assert tp_wait[4] > 5 * tp_wait[5]  # the fast peer waits, the slow rank arrives last
    # Slow link 1 → 9: rank 1's forward sends (to 9) take ~4x as long as rank 0's (to 8).
    sends = {r: statistics.mean(e["dur"] for e in _spans(trace_dir, r, "forward-send")) for r in (0, 1)}
    assert sends[1] > 3 * sends[0]
    assert all(s["args"]["sends"][0]["peer"] == 9 for s in _spans(trace_dir, 1, "forward-send"))
    # Slow data on rank 12.
    data = {r: statistics.mean(e["dur"] for e in _spans(trace_dir, r, "data-wait")) for r in (12, 13)}
    assert data[12] > 5 * data[13]


def test_synthetic_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert synthetic_main([str(tmp_path), "--dp", "2", "--pp", "2", "--tp", "1", "--slow-rank", "1:2.0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["world_size"] == 4 and len(list_rank_files(tmp_path)) == 4


# --- aggregation -----------------------------------------------------------------------------------------------


def test_merged_trace_validates_and_has_its_parts(merged: tuple[Path, dict], job: tuple[Path, dict]) -> None:
    path, summary = merged
    truth = job[1]
    assert validate_trace(path) == []
    document = _load(path)
    assert document["displayTimeUnit"] == "ms" and document["metadata"]["megascan"] == summary
    events = document["traceEvents"]
    markers = [e for e in events if e["ph"] == "i"]
    assert [m["name"] for m in markers] == ["step 0", "step 1"] and all(m["s"] == "g" for m in markers)
    assert [e for e in events if e.get("name") == "megascan.merged"][0]["args"] == summary
    assert summary["ranks_present"] == 16 and summary["missing_ranks"] == [] and summary["truncated_ranks"] == []
    x_in = sum(1 for r in range(16) for e in read_rank_file(list_rank_files(job[0])[r]) if e["ph"] == "X")
    assert sum(1 for e in events if e["ph"] == "X") == x_in == truth["events"]


def test_flows_pair_up_one_per_transfer_and_waiting_member(merged: tuple[Path, dict], job: tuple[Path, dict]) -> None:
    path, summary = merged
    truth = job[1]
    events = _load(path)["traceEvents"]
    starts = {(e["cat"], e["id"]): e for e in events if e["ph"] == "s"}
    ends = {(e["cat"], e["id"]): e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys()
    assert sum(cat == "p2p" for cat, _ in starts) == truth["p2p_pairs"] == summary["flows"]["p2p"]
    assert sum(cat == "collective" for cat, _ in starts) == truth["collective_flows"] == summary["flows"]["collective"]
    assert (
        summary["flows"]["dropped"] == summary["flows"]["unmatched_sends"] == summary["flows"]["unmatched_recvs"] == 0
    )
    for key, start in starts.items():
        assert ends[key]["ts"] >= start["ts"] and ends[key]["bp"] == "e"
    # A p2p flow goes from a sender to the peer named in its send.
    p2p = [(starts[k]["pid"], ends[k]["pid"]) for k in starts if k[0] == "p2p"]
    assert (1, 9) in p2p and all(abs(coords_of(a, 4, 2)[1] - coords_of(b, 4, 2)[1]) == 1 for a, b in p2p)
    # Collective flows leave the last arriver: slow rank 5 is the one its TP peer (4) waits for, every time.
    tp_sources = [starts[k]["pid"] for k in starts if k[0] == "collective" and ends[k]["pid"] in (4, 5)]
    assert tp_sources.count(5) >= 0.9 * len(tp_sources)


def test_clock_offsets_recovered(merged: tuple[Path, dict], job: tuple[Path, dict], tmp_path: Path) -> None:
    _, summary = merged
    truth = job[1]
    offsets = summary["offsets_us"]
    for rank in range(16):
        error = abs(offsets[rank] - truth["clock_offsets_us"][rank])
        assert error <= truth["clock_uncertainty_us"][rank] + 1e-6, (rank, error)
        if coords_of(rank, 4, 2)[1] == 0:  # rank 0's stage: collectives pin every clock to rank 0's exactly
            assert error < 2.0, (rank, error)
    skew = summary["residual_skew_us"]
    assert skew["after"]["p95"] < 2.0 < skew["before"]["p95"]
    assert skew["after"]["median"] < skew["before"]["median"]
    assert summary["refined"] and summary["refinement_rejected_ranks"] == []
    # Without refinement the clock records alone are within their uncertainty; the skew stays as it was.
    plain = _aggregate_quietly(job[0], tmp_path / "plain.json", refine_clocks=False)
    assert not plain["refined"] and plain["residual_skew_us"]["after"] == plain["residual_skew_us"]["before"]
    for rank in range(16):
        error = abs(plain["offsets_us"][rank] - truth["clock_offsets_us"][rank])
        assert error <= truth["clock_uncertainty_us"][rank] + 1e-6
    assert validate_trace(tmp_path / "plain.json") == []


def _rewrite(path: Path, keep: Any) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(line for line in lines if keep(line)))


def test_missing_clock_records_and_bad_clock_records(tmp_path: Path) -> None:
    truth = generate_traces(tmp_path, dp=4, pp=1, tp=2, seed=5)
    files = list_rank_files(tmp_path)
    _rewrite(files[3], lambda line: "megascan.clock" not in line)  # no clock: refinement alone must place it

    def off_by_10ms(line: str) -> str:
        if "megascan.clock" not in line:
            return line
        event = json.loads(line.rstrip().rstrip(","))
        event["args"]["offset_us"] += 10_000.0
        return json.dumps(event) + ",\n"

    files[6].write_text("".join(off_by_10ms(line) for line in files[6].read_text().splitlines(keepends=True)))
    with pytest.warns(UserWarning) as caught:
        summary = aggregate(tmp_path, tmp_path / "merged.json", progress=False)
    messages = " ".join(str(w.message) for w in caught)
    assert "no megascan.clock record for rank(s) 3" in messages and "rejected" in messages
    assert summary["clock_missing_ranks"] == [3] and summary["refinement_rejected_ranks"] == [6]
    assert abs(summary["offsets_us"][3] - truth["clock_offsets_us"][3]) < 2.0
    assert abs(summary["offsets_us"][6] - truth["clock_offsets_us"][6] - 10_000.0) < 100.0  # distrusted, kept
    assert validate_trace(tmp_path / "merged.json") == []


@pytest.mark.parametrize("gzipped", [False, True])
def test_truncated_and_missing_ranks_warn_and_still_merge(tmp_path: Path, gzipped: bool) -> None:
    trace_dir = tmp_path / "trace"
    truth = generate_traces(trace_dir, dp=2, pp=2, tp=2, gzipped=gzipped, truncate_ranks=(2,), missing_ranks=(5,))
    assert 5 not in list_rank_files(trace_dir)
    output = tmp_path / ("merged.json.gz" if gzipped else "merged.json")
    with pytest.warns(UserWarning) as caught:
        summary = aggregate(trace_dir, output, progress=False)
    messages = " ".join(str(w.message) for w in caught)
    assert "rank 2: truncated" in messages and "missing" in messages and "ranks 5" in messages
    assert summary["missing_ranks"] == [5] and summary["truncated_ranks"] == [2]
    assert summary["ranks_present"] == 7 and summary["offsets_us"][5] is None
    assert summary["flows"]["p2p"] < truth["p2p_pairs"]  # the lost ends draw no arrows
    assert validate_trace(output) == []
    assert _load(output)["metadata"]["megascan"]["missing_ranks"] == [5]


def test_out_of_order_and_malformed_rank_files(tmp_path: Path) -> None:
    """Real writers emit a span when it ends (a step after its forwards): aggregation must sort per thread."""
    import random

    truth = generate_traces(tmp_path / "trace", dp=2, pp=2, tp=1, seed=2)
    path = list_rank_files(tmp_path / "trace")[1]
    lines = path.read_text().splitlines(keepends=True)
    body = lines[1:]
    random.Random(0).shuffle(body)
    ts = json.loads(body[-1].rstrip().rstrip(","))["ts"]
    marks = [{"name": "mark", "ph": ph, "pid": 1, "tid": 3, "ts": ts} for ph in "BE"]  # a zero-length B/E pair
    path.write_text(lines[0] + "".join(body) + "".join(json.dumps(m) + ",\n" for m in marks))
    assert any("before the previous slice event" in e for e in validate_trace(path))  # the raw file is out of order
    summary = _aggregate_quietly(tmp_path / "trace", tmp_path / "merged.json")
    assert validate_trace(tmp_path / "merged.json") == []
    assert summary["flows"]["p2p"] == truth["p2p_pairs"]
    # A malformed event (a send without its peer) is skipped and reported; the rest merges.
    other = list_rank_files(tmp_path / "trace")[0]
    other.write_text(other.read_text().replace('"peer":', '"pear":', 1))
    with pytest.warns(UserWarning, match="1 malformed event"):
        summary = aggregate(tmp_path / "trace", tmp_path / "merged2.json", progress=False)
    assert summary["truncated_ranks"] == [0] and summary["flows"]["p2p"] == truth["p2p_pairs"] - 1
    assert validate_trace(tmp_path / "merged2.json") == []


def test_gzip_in_and_out(tmp_path: Path) -> None:
    truth = generate_traces(tmp_path / "trace", gzipped=True, seed=7)
    assert all(p.name.endswith(".json.gz") for p in list_rank_files(tmp_path / "trace").values())
    summary = _aggregate_quietly(tmp_path / "trace", tmp_path / "merged.json.gz")
    with open(tmp_path / "merged.json.gz", "rb") as stream:
        assert stream.read(2) == b"\x1f\x8b"
    assert validate_trace(tmp_path / "merged.json.gz") == []
    assert summary["flows"]["p2p"] == truth["p2p_pairs"]


def test_aggregate_cli(job: tuple[Path, dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["aggregate", str(job[0]), "-o", str(tmp_path / "m.json.gz"), "--quiet", "--no-refine"])
    assert args.func(args) == 0
    assert "16/16 ranks" in capsys.readouterr().out
    assert validate_trace(tmp_path / "m.json.gz") == []
    empty = parser.parse_args(["aggregate", str(tmp_path), "--quiet"])
    assert empty.func(empty) == 2  # no rank files: a message, not a traceback


def test_aggregation_at_1024_ranks(tmp_path: Path) -> None:
    """1024 ranks (dp=64 pp=4 tp=4) × 2 steps, the benchmark's size: well inside a minute, and valid."""
    truth = generate_traces(tmp_path / "trace", dp=64, pp=4, tp=4, steps=2, slow_ranks={517: 1.5}, seed=11)
    start = time.perf_counter()
    summary = _aggregate_quietly(tmp_path / "trace", tmp_path / "merged.json.gz")
    elapsed = time.perf_counter() - start
    assert elapsed < 60, elapsed
    assert summary["ranks_present"] == 1024
    assert summary["flows"]["p2p"] == truth["p2p_pairs"]
    assert summary["flows"]["collective"] == truth["collective_flows"]
    assert summary["residual_skew_us"]["after"]["p95"] < 2.0
    errors = [abs(summary["offsets_us"][r] - truth["clock_offsets_us"][r]) for r in range(1024)]
    assert all(e <= truth["clock_uncertainty_us"][r] + 1e-6 for r, e in enumerate(errors))
    assert validate_trace(tmp_path / "merged.json.gz") == []


# --- the validator can fail ------------------------------------------------------------------------------------

GOOD = [
    {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0"}},
    {"name": "outer", "ph": "B", "pid": 0, "tid": 1, "ts": 0},
    {"name": "send", "cat": "p2p", "ph": "X", "pid": 0, "tid": 1, "ts": 1, "dur": 2},
    {"name": "f", "cat": "p2p", "ph": "s", "id": 1, "pid": 0, "tid": 1, "ts": 1.5},
    {"name": "outer", "ph": "E", "pid": 0, "tid": 1, "ts": 4},
    {"name": "recv", "cat": "p2p", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
    {"name": "f", "cat": "p2p", "ph": "f", "bp": "e", "id": 1, "pid": 1, "tid": 1, "ts": 4.5},
    {"name": "step 0", "ph": "i", "s": "g", "pid": 0, "ts": 0},
]


def _write(tmp_path: Path, events: Any, name: str = "t.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(events))
    return path


def _with(change: Any) -> list[dict[str, Any]]:
    events = json.loads(json.dumps(GOOD))
    change(events)
    return events


def test_validator_accepts_good_traces(tmp_path: Path) -> None:
    assert validate_trace(_write(tmp_path, GOOD)) == []
    assert validate_trace(_write(tmp_path, {"traceEvents": GOOD, "displayTimeUnit": "ms"})) == []
    unclosed = tmp_path / "rank.json"  # a rank file being written: no closing bracket
    unclosed.write_text("[\n" + "".join(json.dumps(e) + ",\n" for e in GOOD))
    assert validate_trace(unclosed) == []
    zipped = tmp_path / "t.json.gz"
    zipped.write_bytes(gzip.compress(json.dumps(GOOD).encode()))
    assert validate_trace(zipped) == []


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda ev: ev.pop(4), "never closed by an E"),  # unmatched B
        (lambda ev: ev.insert(1, {"name": "x", "ph": "E", "pid": 0, "tid": 1, "ts": 0}), "E without an open B"),
        (lambda ev: ev.insert(3, {"name": "in", "ph": "B", "pid": 0, "tid": 1, "ts": 3}), "not LIFO"),
        (lambda ev: ev.pop(6), "exactly one 's' and one 'f'"),  # unpaired flow
        (lambda ev: ev.append({**ev[3]}), "exactly one 's' and one 'f'"),  # a second start
        (lambda ev: ev[6].update(ts=1.0, bp="e"), "before it starts"),
        (lambda ev: ev[6].update(pid=7), "bound to no slice"),
        (lambda ev: ev[5].update(ts=-0.4), None),  # still valid: another thread
        (lambda ev: ev[2].update(ts=-1), "before the previous slice event"),  # non-monotonic ts
        (lambda ev: ev[2].update(dur=-1), "dur >= 0"),
        (lambda ev: ev[2].pop("dur"), "dur >= 0"),
        (lambda ev: ev[2].update(ph="Q"), "unknown or missing phase"),
        (lambda ev: ev[2].pop("pid"), "pid"),
        (lambda ev: ev[2].pop("tid"), "tid"),
        (lambda ev: ev[2].pop("ts"), "ts"),
        (lambda ev: ev[2].update(ts="1"), "ts"),
        (lambda ev: ev[0]["args"].pop("name"), "string args.name"),
        (lambda ev: ev[0].pop("args"), "args object"),
        (lambda ev: ev[7].update(s="x"), "instant scope"),
        (lambda ev: ev[3].pop("id"), "missing id"),
    ],
)
def test_validator_catches_planted_errors(tmp_path: Path, change: Any, expected: str | None) -> None:
    errors = validate_trace(_write(tmp_path, _with(change)))
    if expected is None:
        assert errors == []
    else:
        assert errors and any(expected in e for e in errors), errors


def test_validator_catches_broken_files(tmp_path: Path) -> None:
    text = json.dumps(GOOD)
    (tmp_path / "cut.json").write_text("[\n" + json.dumps(GOOD[0]) + ",\n" + json.dumps(GOOD[1])[:20])
    assert "not valid JSON" in validate_trace(tmp_path / "cut.json")[0]
    (tmp_path / "nan.json").write_text(text.replace('"ts": 0}', '"ts": NaN}', 1))
    assert "NaN is not valid JSON" in validate_trace(tmp_path / "nan.json")[0]
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(text.encode())[:-12])
    assert "gzip" in validate_trace(tmp_path / "cut.json.gz")[0]
    assert "traceEvents" in validate_trace(_write(tmp_path, {"events": GOOD}))[0]
    assert "displayTimeUnit" in validate_trace(_write(tmp_path, {"traceEvents": GOOD, "displayTimeUnit": "s"}))[0]
    assert "top level" in validate_trace(_write(tmp_path, 3))[0]
    many = [{"name": "x", "ph": "Q", "pid": 0, "tid": 0, "ts": 0}] * 500
    errors = validate_trace(_write(tmp_path, many))
    assert len(errors) == 201 and errors[-1] == "... and 300 more errors"


def test_only_collectives_whose_members_leave_together_align_clocks() -> None:
    """Measured on 4 H200s: a 4-byte broadcast's root leaves 16 ms before its receiver arrives, and megatron-core's
    bucketed gradient all-reduce (1.9 GB in a 3 µs span: queued inside ``_coalescing_manager``) ends at the
    launch. Aligning clocks on those ends put 9 ms of false skew into the merged trace."""
    from lightning_megatron.scan.analysis.aggregate import _ends_together

    def op(name: str, nbytes: int, dur: float, **args: object) -> dict:
        return {"name": name, "ph": "X", "dur": dur, "args": {"bytes": nbytes, **args}}

    assert _ends_together(op("all_reduce", 4, 9.8))
    assert _ends_together(op("all_reduce", 1_873_625_088, 37_200.0))  # 50 GB/s: a real transfer
    assert not _ends_together(op("all_reduce", 1_890_385_920, 2.9))  # queued, not transferred
    assert not _ends_together(op("broadcast", 4, 8.6))
    assert not _ends_together(op("all_reduce", 4, 9.8, **{"async": True}))


def test_plot_draws_a_step_of_a_trace_directory(tmp_path: Path) -> None:
    from matplotlib.image import imread

    from lightning_megatron.scan.analysis.plot import plot_timeline
    from lightning_megatron.scan.evaluation.synthetic import generate_traces

    generate_traces(tmp_path / "trace", dp=2, pp=2, tp=1, steps=3, slow_ranks={3: 1.5})
    out = plot_timeline(tmp_path / "trace", tmp_path / "timeline.png", step=1, steps=2)
    image = imread(out)
    assert image.shape[0] > 300 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.1  # something was drawn, not a blank canvas
    with pytest.raises(ValueError, match="traced steps"):
        plot_timeline(tmp_path / "trace", tmp_path / "none.png", step=99)
