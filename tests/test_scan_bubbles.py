"""Pipeline bubbles apart from transfers (``scan.analysis.bubbles``): the arithmetic on hand-written and simulated traces,
then real gloo fits in which a delayed link must grow transfers (not bubbles) and a slow stage its neighbours'
bubbles, under megatron-core's 1F1B (PP2), its interleaved schedule (PP4 x VPP2) and MegaDPP.

Ranks share two CPU cores here, so the fits assert on large effects (tens of milliseconds a message or a step)
and on which stage or link they land, not on precise figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import cases
import pytest

from lightning_megatron.scan.analysis.bubbles import pipeline_bubbles, theoretical_fraction
from lightning_megatron.scan.analysis.detect import detect
from lightning_megatron.scan.analysis.format import clock_metadata, complete, rank_file_name, rank_metadata
from lightning_megatron.scan.analysis.report import DetectionReport, log_to
from lightning_megatron.scan.cli import main as scan_cli
from lightning_megatron.scan.evaluation.synthetic import generate_traces

# -- hand-written traces: the rule itself ---------------------------------------------------------------------------


def _write(
    trace_dir: Path,
    rank: int,
    spans: list[tuple[str, str, float, float, dict[str, Any]]],
    *,
    offset: float = 0.0,
    uncertainty: float = 0.0,
    schedule: str = "1f1b",
) -> None:
    """One rank of a PP2 job; ``spans`` on its own clock (aligned = local + offset), all in step 1."""
    info = {"world_size": 2, "dp": 0, "pp": rank, "tp": 0, "host": "h", "pipeline_size": 2, "schedule": schedule}
    events = rank_metadata(rank, info) + [clock_metadata(rank, offset, uncertainty, 0.0, 8)]
    events.append(complete("step 1", "step", rank, 0, -offset - 1000.0, 5000.0, {"step": 1}))
    for name, cat, start, end, args in spans:
        events.append(complete(name, cat, rank, 2, start - offset, end - start, {"step": 1, **args}))
    trace_dir.mkdir(parents=True, exist_ok=True)
    text = "[\n" + "".join(json.dumps(e) + ",\n" for e in events)
    (trace_dir / rank_file_name(rank, 0, rank, 0)).write_text(text)


def _send(peer: int, seq: int = 0, direction: str = "forward") -> dict[str, Any]:
    return {"sends": [{"peer": peer, "seq": seq, "direction": direction, "bytes": 64}], "recvs": []}


def _recv(peer: int, seq: int = 0, direction: str = "forward") -> dict[str, Any]:
    return {"sends": [], "recvs": [{"peer": peer, "seq": seq, "direction": direction, "bytes": 64}]}


def _stage(bubbles: dict[str, Any], stage: int) -> dict[str, Any]:
    return next(s for s in bubbles["stages"] if s["stage"] == stage)


def test_a_receive_posted_first_waits_for_the_send_then_moves_the_bytes(tmp_path: Path) -> None:
    # aligned clock: rank 1 posts its receive at 100 us, rank 0 its send at 300 us, the data is there at 600 us;
    # rank 1's clock runs 1 ms behind, its offset says so, and each offset is known within +-30 us
    _write(tmp_path, 0, [("forward-send", "p2p", 300.0, 550.0, _send(1))], uncertainty=30.0)
    _write(tmp_path, 1, [("forward-recv", "p2p", 100.0, 600.0, _recv(0))], offset=1000.0, uncertainty=30.0)
    bubbles = pipeline_bubbles(tmp_path)
    receiver = bubbles["ranks"]["1"]
    assert receiver["bubble_ms"] == pytest.approx(0.2) and receiver["transfer_ms"] == pytest.approx(0.3)
    bound = (30.0**2 + 30.0**2) ** 0.5 / 1000
    assert receiver["bubble_ms_low"] == pytest.approx(0.2 - bound, abs=1e-4)
    assert receiver["bubble_ms_high"] == pytest.approx(0.2 + bound, abs=1e-4)
    assert bubbles["clock_uncertainty_us"] == pytest.approx(bound * 1000, abs=0.01)
    # the sender came after its receiver: it waited for no one, its whole span moved bytes
    assert bubbles["ranks"]["0"]["bubble_ms"] == 0.0 and bubbles["ranks"]["0"]["transfer_ms"] == pytest.approx(0.25)
    (link,) = bubbles["links"]
    assert (link["src"], link["dst"], link["direction"], link["messages"]) == (0, 1, "forward", 1)
    assert link["bubble_ms"] == pytest.approx(0.2) and link["transfer_ms_per_message"] == pytest.approx(0.3)
    assert link["steps"] == {"1": {"bubble_ms": 0.2, "transfer_ms": 0.3}}


def test_loose_clocks_are_said_and_bound_the_bubble(tmp_path: Path) -> None:
    _write(tmp_path, 0, [("forward-send", "p2p", 300.0, 550.0, _send(1))], uncertainty=400.0)
    _write(tmp_path, 1, [("forward-recv", "p2p", 100.0, 600.0, _recv(0))], uncertainty=400.0)
    bubbles = pipeline_bubbles(tmp_path)
    (note,) = bubbles["warnings"]
    assert "aligned within ±566 us, more than a message's median transfer (300 us)" in note
    receiver = bubbles["ranks"]["1"]  # the range never leaves [0, the receive's duration]
    assert (receiver["bubble_ms_low"], receiver["bubble_ms"], receiver["bubble_ms_high"]) == (0.0, 0.2, 0.5)


def test_sends_wait_only_for_a_receiver_that_came_during_them(tmp_path: Path) -> None:
    # seq 0: a buffered send (done at 50 us, received at 200 us); seq 1: a rendezvous, the receiver came at 1300 us
    # into a send posted at 1000 us that completed with it at 1400 us
    _write(
        tmp_path,
        0,
        [("forward-send", "p2p", 0.0, 50.0, _send(1, 0)), ("forward-send", "p2p", 1000.0, 1400.0, _send(1, 1))],
    )
    _write(
        tmp_path,
        1,
        [("forward-recv", "p2p", 200.0, 210.0, _recv(0, 0)), ("forward-recv", "p2p", 1300.0, 1400.0, _recv(0, 1))],
    )
    bubbles = pipeline_bubbles(tmp_path)
    assert bubbles["ranks"]["0"]["bubble_ms"] == pytest.approx(0.3)  # the rendezvous send's wait, nothing else
    assert bubbles["ranks"]["0"]["transfer_ms"] == pytest.approx(0.05 + 0.1)
    assert bubbles["ranks"]["1"]["bubble_ms"] == 0.0  # both sends were posted before their receives
    assert bubbles["ranks"]["1"]["transfer_ms"] == pytest.approx(0.01 + 0.1)


def test_a_span_of_several_operations_waited_for_its_latest_peer_once(tmp_path: Path) -> None:
    # rank 1 sends a gradient back and receives the next activation in one span (100-900 us); rank 0 posts the
    # activation's send at 600 us and its receive of the gradient at 200 us
    both = {
        "sends": [{"peer": 0, "seq": 0, "direction": "backward"}],
        "recvs": [{"peer": 0, "seq": 0, "direction": "forward"}],
    }
    _write(
        tmp_path,
        0,
        [
            ("backward-recv", "p2p", 200.0, 300.0, _recv(1, 0, "backward")),
            ("forward-send", "p2p", 600.0, 650.0, _send(1)),
        ],
    )
    _write(tmp_path, 1, [("backward-send-forward-recv", "p2p", 100.0, 900.0, both)])
    rank1 = pipeline_bubbles(tmp_path)["ranks"]["1"]
    assert rank1["bubble_ms"] == pytest.approx(0.5) and rank1["transfer_ms"] == pytest.approx(0.3)


def test_clock_error_never_makes_a_bubble_longer_than_its_receive(tmp_path: Path) -> None:
    _write(tmp_path, 0, [("forward-send", "p2p", 900.0, 950.0, _send(1))])
    _write(tmp_path, 1, [("forward-recv", "p2p", 100.0, 400.0, _recv(0))])  # "sent" after it was received
    rank1 = pipeline_bubbles(tmp_path)["ranks"]["1"]
    assert rank1["bubble_ms"] == pytest.approx(0.3) and rank1["transfer_ms"] == 0.0


def test_megadpp_arrivals_count_the_wait_since_the_previous_span(tmp_path: Path) -> None:
    # MegaDPP marks an arrival (500-501 us); the rank last computed until 100 us, the send was posted at 300 us
    _write(tmp_path, 0, [("forward-send", "p2p", 300.0, 310.0, _send(1))], schedule="dpp")
    compute = ("forward", "compute", 0.0, 100.0, {"microbatch": 0, "chunk": 0})
    _write(tmp_path, 1, [compute, ("forward-recv", "p2p", 500.0, 501.0, _recv(0))], schedule="dpp")
    bubbles = pipeline_bubbles(tmp_path)
    assert bubbles["ranks"]["1"]["bubble_ms"] == pytest.approx(0.2)
    assert bubbles["ranks"]["1"]["transfer_ms"] == pytest.approx(0.201)
    assert bubbles["schedule"] == "dpp" and "MegaDPP" in bubbles["theoretical_formula"]


def test_bubbles_import_no_torch() -> None:
    """Analysis only: the TensorBoard plugin and machines without torch run it (through ``scan.detect`` too)."""
    code = (
        "import sys\n"
        "import lightning_megatron.scan.analysis.bubbles, lightning_megatron.scan.analysis.detect\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'megatron'))\n"
        "assert not heavy, heavy[:10]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_theoretical_fractions() -> None:
    assert theoretical_fraction("1f1b", 4, 8) == (pytest.approx(3 / 11), "(P-1)/(M+P-1)")
    assert theoretical_fraction("interleaved", 4, 8, 2) == (pytest.approx(3 / 19), "(P-1)/(V*M+P-1)")
    assert theoretical_fraction("dpp", 2, 8)[0] == pytest.approx(1 / 9)
    assert theoretical_fraction("dpp", 4, 8, 2)[0] == pytest.approx(3 / 19)
    assert theoretical_fraction("zb-h1", 4, 8)[0] == pytest.approx(3 / 27)
    assert theoretical_fraction("fbd", 2, 8) == (None, "n/a (schedule 'fbd')")
    assert theoretical_fraction("1f1b", 1, 8)[0] is None


# -- simulated 1F1B jobs ---------------------------------------------------------------------------------------------


def _simulated(tmp_path: Path, name: str, **faults: Any) -> dict[str, Any]:
    generate_traces(tmp_path / name, dp=1, pp=4, tp=1, microbatches=8, steps=3, **faults)
    return pipeline_bubbles(tmp_path / name)


def _link(bubbles: dict[str, Any], src: int, dst: int, direction: str, chunk: Optional[int] = 0) -> dict[str, Any]:
    """The link's row (``chunk``: the sending model chunk; None in simulated traces, which do not name it)."""
    rows = [r for r in bubbles["links"] if (r["src"], r["dst"], r["direction"]) == (src, dst, direction)]
    return next(r for r in rows if r["chunk"] in (chunk, None))


def test_simulated_1f1b_matches_its_theory_and_tells_slow_links_from_slow_stages(tmp_path: Path) -> None:
    clean = _simulated(tmp_path, "clean")
    assert clean["microbatches"] == 8 and clean["theoretical_fraction"] == pytest.approx(3 / 11, abs=1e-4)
    assert clean["measured_fraction"] == pytest.approx(3 / 11, abs=0.03)
    link = _simulated(tmp_path, "link", slow_links={(1, 2): 5.0})
    for stage in range(4):  # a slower link moves bytes longer; the stages wait for each other as before
        assert _stage(link, stage)["bubble_ms"] < 1.3 * _stage(clean, stage)["bubble_ms"]
    slower = _link(link, 1, 2, "forward")["transfer_ms_per_message"]
    assert slower > 3 * _link(clean, 1, 2, "forward")["transfer_ms_per_message"]
    assert _stage(link, 2)["transfer_ms"] > 2 * _stage(clean, 2)["transfer_ms"]
    slow = _simulated(tmp_path, "slow", slow_ranks={1: 2.0})
    for stage in (0, 2):  # the slow stage's neighbours wait for it
        assert _stage(slow, stage)["bubble_ms"] > 2 * _stage(clean, stage)["bubble_ms"]
        assert _stage(slow, stage)["transfer_ms"] < 2 * _stage(clean, stage)["transfer_ms"]
    assert min(slow["stages"], key=lambda s: s["bubble_fraction"])["stage"] == 1


def test_report_json_table_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    generate_traces(tmp_path / "pp", dp=2, pp=2, tp=1, microbatches=4, steps=2)
    report = detect(tmp_path / "pp")
    assert report.bubbles is not None and [s["stage"] for s in report.bubbles["stages"]] == [0, 1]
    assert report.bubbles["stages"][0]["ranks"] == [0, 1]  # both data-parallel replicas of stage 0
    again = DetectionReport.from_json(report.to_json())
    assert again.bubbles == json.loads(json.dumps(report.bubbles))
    text = report.table()
    assert "pipeline bubbles (1f1b, P=2, V=1, M=4)" in text and "in theory (P-1)/(M+P-1)" in text
    metrics = log_to(Logger(), report, step=3)
    assert metrics["megascan/pp1_bubble_ms"] == report.bubbles["stages"][1]["bubble_ms"]
    assert {"megascan/pp0_transfer_ms", "megascan/pp0_bubble_fraction"} <= metrics.keys()
    assert scan_cli(["bubbles", str(tmp_path / "pp"), "--links", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "bubble ms/step" in out and "forward 0->2 (pp0->pp1)" in out
    assert json.loads((tmp_path / "b.json").read_text())["stages"] == json.loads(json.dumps(report.bubbles["stages"]))
    generate_traces(tmp_path / "dp", dp=2, pp=1, tp=1, steps=2)
    assert detect(tmp_path / "dp").bubbles is None and "bubbles" not in detect(tmp_path / "dp").table()
    assert scan_cli(["bubbles", str(tmp_path / "dp")]) == 1
    assert "need pipeline parallelism" in capsys.readouterr().out
    assert scan_cli(["bubbles", str(tmp_path / "none")]) == 2


class Logger:
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass


# -- real fits on gloo ranks -----------------------------------------------------------------------------------------


def bubble_fit(
    trace_dir: str,
    world: int,
    *,
    slow: Optional[int] = None,
    link: Optional[tuple[int, int, float]] = None,
    **strategy: Any,
) -> None:
    """Inside a rank: a short traced fit, the compute of rank ``slow`` 3x slower or ``link`` delayed."""
    from lightning_megatron.scan import LinkDelayInjector, MegaScan, SlowdownInjector

    callbacks: list[Any] = [MegaScan(trace_dir, interval=1, window=1, detect=False)]
    if slow is not None:
        callbacks.append(SlowdownInjector(ranks=[slow], factor=3.0))
    if link is not None:
        callbacks.append(LinkDelayInjector(*link))
    cases.fit_gpt(world, steps=4, callbacks=callbacks, data={"global_batch_size": 16}, **strategy)


def _fit(ranks: Any, tmp_path: Path, name: str, world: int, **kwargs: Any) -> dict[str, Any]:
    ranks.run(world, bubble_fit, str(tmp_path / name), world, timeout=300, **kwargs)
    return pipeline_bubbles(tmp_path / name)


LINK_MS = 20.0

LAYOUTS = {
    "pp2": (2, {"pipeline_model_parallel_size": 2}),
    "pp4-vpp2": (
        4,
        {"pipeline_model_parallel_size": 4, "virtual_pipeline_model_parallel_size": 2, "model": {"num_layers": 8}},
    ),
    "dpp-pp2": (2, {"pipeline_model_parallel_size": 2, "schedule": "dpp"}),
}


def _delayed(layout: str, world: int, strategy: dict[str, Any]) -> dict[str, Any]:
    """Delay rank 0's (PP4: rank 1's) activations to the next stage: MegaDPP in its transport, megatron-core's
    schedules with the injector (a receive completes later)."""
    src = 1 if world == 4 else 0
    if layout.startswith("dpp"):
        delay = {"kind": "constant", "mean_s": LINK_MS / 1000, "links": [[src, src + 1]]}
        return {**strategy, "schedule_options": {"policy": "static", "transport": "shm", "link_delay": delay}}
    return {**strategy, "link": (src, src + 1, LINK_MS)}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_delayed_link_grows_transfers_and_slow_stage_its_neighbours_bubbles(
    ranks: Any, tmp_path: Path, layout: str
) -> None:
    world, strategy = LAYOUTS[layout]
    if layout.startswith("dpp"):
        strategy = {**strategy, "schedule_options": {"policy": "static", "transport": "shm"}}
    clean = _fit(ranks, tmp_path, "clean", world, **strategy)
    virtual = strategy.get("virtual_pipeline_model_parallel_size", 1)
    pipeline = strategy["pipeline_model_parallel_size"]
    assert clean["schedule"] == strategy.get("schedule", "interleaved" if virtual > 1 else "1f1b")
    assert (clean["pipeline_size"], clean["virtual_pipeline_size"], clean["microbatches"]) == (pipeline, virtual, 8)
    assert clean["theoretical_fraction"] == pytest.approx((pipeline - 1) / (virtual * 8 + pipeline - 1), abs=1e-4)
    assert clean["clock_uncertainty_us"] < 1000  # one machine: one clock
    assert [s["stage"] for s in clean["stages"]] == list(range(pipeline))
    assert all(0 <= s["bubble_fraction"] < 1 for s in clean["stages"])

    # a delayed link: its messages take LINK_MS longer to arrive, which is transfer, not waiting for the peer.
    # Under MegaDPP the delay is the transport's: a message travels while its receiver computes, or waits for the
    # message before it, and only what is left of its flight when the receiver turns to it counts (a step's time
    # is counted once), so less of the delay shows per message (the injector of megatron-core's schedules holds
    # the receive itself)
    src = 1 if world == 4 else 0
    # (MegaDPP: per message only that the link grows, 2.9 ms of 20 in a loaded run; the stage total binds)
    share, total_share = (0.05, 0.25) if layout.startswith("dpp") else (0.6, 0.6)
    delayed = _fit(ranks, tmp_path, "link", world, **_delayed(layout, world, strategy))
    for chunk in range(virtual):  # every message of the link, whichever model chunk sent it
        added_per_message = _link(delayed, src, src + 1, "forward", chunk)["transfer_ms_per_message"]
        added_per_message -= _link(clean, src, src + 1, "forward", chunk)["transfer_ms_per_message"]
        assert added_per_message > share * LINK_MS, (chunk, delayed["links"], clean["links"])
    receiver = _stage(delayed, src + 1)
    added = receiver["transfer_ms"] - _stage(clean, src + 1)["transfer_ms"]
    assert added > total_share * LINK_MS * 8, (delayed["stages"], clean["stages"])  # 8 microbatches a chunk and step
    assert receiver["bubble_ms"] - _stage(clean, src + 1)["bubble_ms"] < 0.5 * added

    # a slow stage: its neighbours wait for it
    slow_rank = 1
    slow = _fit(ranks, tmp_path, "slow", world, slow=slow_rank, **strategy)
    neighbours = [s for s in (slow_rank - 1, slow_rank + 1) if 0 <= s < pipeline]
    for stage in neighbours:
        assert _stage(slow, stage)["bubble_ms"] > 1.5 * _stage(clean, stage)["bubble_ms"] + 5, (
            stage,
            slow["stages"],
            clean["stages"],
        )
        assert _stage(slow, stage)["bubble_ms"] > _stage(slow, slow_rank)["bubble_ms"], slow["stages"]
