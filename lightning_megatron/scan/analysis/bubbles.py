"""Pipeline bubbles apart from transfers: each p2p wait split into waiting for the peer and moving the bytes.

A pipeline receive lasts from the moment the rank posts it until the data is there, which mixes two things: the
time the sender had not yet posted the matching send (the rank waited for its peer: a *bubble*, the schedule's or
a slow neighbour's) and the time the bytes took once both were there (the *transfer*, the link's). MegaScan's p2p
spans carry the identity of every message (``{peer, seq, direction}``, the same on both ends), and on GPUs their
start is the CUDA event recorded where the stream reached the operation (the post on the GPU's timeline, not the
host's enqueue), so the matching send's post time on the peer splits the receive:

* **bubble** of a receive = ``send post - receive post`` on the aligned clock (``megascan.clock`` offsets),
  clamped to ``[0, receive duration]``; **transfer** = the rest of the receive's duration;
* a span holding several operations (``forward-send-backward-recv``) waited for the latest of its peers: its bubble
  is the largest of its operations' waits, its transfer the rest of the span, so a stage's time is counted once;
* a send waits for its receiver only where the receiver posted *during* the send (a rendezvous: its wait is
  ``receive post - send post``); a receiver that came after the send completed found the data buffered, and the
  send waited for no one;
* MegaDPP (``schedule="dpp"`` / ``"zb-h1"``) takes whatever message arrives: its receive spans mark the arrival,
  and the rank waited for it in the gap since its previous span, which therefore counts as the receive's post.

Per link (sender → receiver, direction, and the sender's model chunk under virtual pipelining) the figures are per
receive: its own wait for the send, and the transfer of its span (in a span of several operations, which one's
bytes took the time cannot be told apart; its waits for other peers stay bubbles). The split rests on two clocks: each cross-rank difference is known within the ± bound of the two ranks'
offsets (``hypot`` of their ``uncertainty_us``), so every bubble is also given at the peers' clocks shifted by
−bound and +bound (``bubble_ms_low`` / ``bubble_ms_high``): a range, not a guess, when the alignment is loose.

The **bubble fraction** of a stage is its bubble per step over its pipeline time per step (from its first to its
last compute or p2p span of the step), beside the schedule's theoretical one: ``(P-1)/(M+P-1)`` for 1F1B,
``(P-1)/(V*M+P-1)`` interleaved with ``V`` virtual stages (``P`` stages, ``M`` microbatches a step). MegaDPP's
order is chosen at run time and has no closed form: megatron-core's schedule of the same layout is shown as the
reference it starts from. ZB-H1 with forward, input-gradient and weight-gradient passes of equal length:
``(P-1)/(3M+P-1)``. MegaFBD: n/a.

Torch-free, as the rest of the analysis: ``pipeline_bubbles(trace_dir)`` or ``measure_bubbles(traces)``, and the
``lightning-megatron scan bubbles TRACE_DIR`` command.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_megatron.scan.analysis.measure import RankTrace, keep_finished_steps, read_traces, step_of
from lightning_megatron.scan.analysis.report import bubble_lines

__all__ = [
    "MessageKey",
    "P2PSplit",
    "measure_bubbles",
    "message_transfers",
    "pipeline_bubbles",
    "register_cli",
    "theoretical_fraction",
]

# schedules whose receive spans mark a message's arrival (the rank waited for any message before, untraced)
_ARRIVAL_SCHEDULES = ("dpp", "zb-h1")


@dataclass
class P2PSplit:
    """One p2p span, split: its time (µs) waiting for the peer(s) and moving bytes, with the bubble's range at the
    peers' clocks shifted by the ± bound of the alignment (``low``, ``high``)."""

    rank: int
    step: int
    start: float  # the post, aligned clock (for MegaDPP's arrivals: the start of the wait before it)
    dur: float
    bubble: float
    transfer: float
    low: float
    high: float
    matched: bool  # at least one of its operations was paired with the peer's


@dataclass
class _RankP2P:
    spans: list[tuple[int, float, float, dict[str, Any]]] = field(default_factory=list)  # (step, start, end, args)


def theoretical_fraction(
    schedule: Optional[str], pipeline: int, microbatches: Optional[float], virtual: int = 1
) -> tuple[Optional[float], str]:
    """The schedule's bubble fraction for ``pipeline`` stages and ``microbatches`` a step, and its formula (or why
    there is none): ``(P-1)/(M+P-1)`` for 1F1B, ``(P-1)/(V*M+P-1)`` interleaved."""
    if pipeline < 2 or not microbatches:
        return None, "n/a (no pipeline)"
    p, m, v = pipeline, float(microbatches), max(int(virtual or 1), 1)
    if schedule in ("1f1b", "dpp") and v == 1:
        note = "" if schedule == "1f1b" else " (megatron-core's 1F1B: MegaDPP's own order has no closed form)"
        return (p - 1) / (m + p - 1), "(P-1)/(M+P-1)" + note
    if schedule in ("interleaved", "dpp"):
        note = "" if schedule == "interleaved" else " (megatron-core's interleaved: MegaDPP's order has no closed form)"
        return (p - 1) / (v * m + p - 1), "(P-1)/(V*M+P-1)" + note
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1), "(P-1)/(3M+P-1) (ZB-H1, forward = input grad = weight grad)"
    return None, f"n/a (schedule {schedule!r})"


MessageKey = tuple[int, int, str, int, int]  # (sender, receiver, direction, step, seq): one pipeline message


@dataclass
class _Matched:
    """Every p2p span of the traces, split (``splits``: per rank, in span order), and every message whose send and
    receive were both traced (``received``: its link, step, receive span and own wait; ``messages``: its key and
    receive span)."""

    splits: dict[int, list[P2PSplit]]
    received: list[tuple[tuple[int, int, str, Optional[int]], int, int, float]]
    messages: list[tuple[MessageKey, int, int]]  # (key, receiver, index of its receive span)
    unmatched: int
    worst_bound: float


def _match(traces: dict[int, RankTrace]) -> Optional[_Matched]:
    """Pair every send with its receive and split every p2p span into bubble and transfer (module docstring);
    None where the traces hold no pipeline messages."""
    per_rank = {rank: _RankP2P() for rank in traces}
    posts: dict[MessageKey, dict[str, tuple[int, int, float, dict[str, Any]]]] = defaultdict(dict)
    arrival = {rank for rank, t in traces.items() if t.info.get("schedule") in _ARRIVAL_SCHEDULES}
    for rank, trace in traces.items():
        previous_end = _previous_ends(trace) if rank in arrival else {}
        for s in trace.spans:
            if s["cat"] != "p2p" or step_of(s) is None:
                continue
            args = s.get("args") or {}
            start, end = s["ts"] + trace.offset_us, s["ts"] + s["dur"] + trace.offset_us
            recvs = args.get("recvs") or []
            if rank in arrival and recvs and not args.get("sends"):
                start = min(start, previous_end.get(id(s), s["ts"]) + trace.offset_us)
            index = len(per_rank[rank].spans)
            per_rank[rank].spans.append((int(step_of(s)), start, end, args))  # type: ignore[arg-type]
            for way, ops in (("send", args.get("sends") or []), ("recv", recvs)):
                for op in ops:
                    peer = int(op["peer"])
                    src, dst = (rank, peer) if way == "send" else (peer, rank)
                    key = (src, dst, str(op.get("direction", "?")), int(step_of(s)), int(op.get("seq", 0)))  # type: ignore[arg-type]
                    posts[key][way] = (rank, index, start, op)
    if not posts:
        return None
    received: list[tuple[tuple[int, int, str, Optional[int]], int, int, float]] = []  # (link, step, span, bubble)
    messages: list[tuple[MessageKey, int, int]] = []
    waits: dict[tuple[int, int], list[tuple[float, float, bool]]] = defaultdict(list)
    unmatched = 0
    worst_bound = 0.0
    pipeline = max([int(t.info.get("pipeline_size") or 1) for t in traces.values()] + [1])
    for key, ends in posts.items():
        src, dst, direction, step, _seq = key
        if "send" not in ends or "recv" not in ends or src not in traces or dst not in traces:
            unmatched += 1
            continue
        _, send_index, send_post, send_op = ends["send"]
        _, recv_index, recv_post, _ = ends["recv"]
        bound = math.hypot(traces[src].uncertainty_us, traces[dst].uncertainty_us)
        worst_bound = max(worst_bound, bound)
        waits[(dst, recv_index)].append((send_post - recv_post, bound, False))
        send_end = per_rank[src].spans[send_index][2]
        if recv_post < send_end:  # the receiver came during the send (or before it): the send may have waited
            waits[(src, send_index)].append((recv_post - send_post, bound, True))
        _, recv_start, recv_end, _ = per_rank[dst].spans[recv_index]
        bubble = min(max(send_post - recv_post, 0.0), recv_end - recv_start)
        chunk = send_op.get("chunk")
        if chunk is None and send_op.get("stage") is not None:  # MegaDPP names the producing global stage
            chunk = int(send_op["stage"]) // pipeline
        received.append(((src, dst, direction, None if chunk is None else int(chunk)), step, recv_index, bubble))
        messages.append((key, dst, recv_index))
    splits = {rank: _split(rank, p2p, waits) for rank, p2p in per_rank.items()}
    return _Matched(splits, received, messages, unmatched, worst_bound)


def message_transfers(traces: dict[int, RankTrace]) -> dict[MessageKey, float]:
    """Per message traced on both ends: the transfer (µs) of its receive span, the span's time less its bubble
    (its longest wait for any of its peers: ``_split``). For ``measure.link_transfers``: a span holding several
    operations waits for the latest of its peers, which is not this link's bytes."""
    matched = _match(traces)
    if matched is None:
        return {}
    return {key: matched.splits[dst][index].transfer for key, dst, index in matched.messages}


def measure_bubbles(traces: dict[int, RankTrace], notes: Optional[list[str]] = None) -> dict[str, Any]:
    """The bubbles of ``traces`` (finished steps only: ``measure.keep_finished_steps``) as a JSON-ready dict:
    ``stages`` (per pipeline stage), ``ranks`` (per rank and step), ``links`` (per sender → receiver) and the
    schedule's theoretical fraction; an empty dict where the traces hold no pipeline messages."""
    own: list[str] = []  # the bubbles' own warnings: in the result, and appended to ``notes``
    matched = _match(traces)
    if matched is None:
        return {}
    if matched.unmatched:
        own.append(f"bubbles: {matched.unmatched} p2p message(s) without both ends traced, left out")
    splits = matched.splits
    # per link: the receive's own wait, and its span's transfer (in a span of several operations the bytes of any
    # of them may be what took the time; the span's waits for its other peers are bubbles, not this link's bytes)
    links: dict[tuple[int, int, str, Optional[int]], dict[int, list[tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for link, step, recv_index, bubble in matched.received:
        links[link][step].append((bubble, splits[link[1]][recv_index].transfer))
    found = _summarise(traces, splits, links, matched.worst_bound, own)
    if notes is not None:
        notes += own
    return found


def _previous_ends(trace: RankTrace) -> dict[int, float]:
    """For each receive span of an arrival schedule: where the rank's previous span of the step ended (its own
    clock), i.e. when it began waiting for whatever arrived."""
    found: dict[int, float] = {}
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    starts: dict[int, float] = {}
    for s in trace.spans:
        if (step := step_of(s)) is None:
            continue
        if s["cat"] in ("compute", "p2p"):
            by_step[step].append(s)
        elif s["cat"] == "step":  # the first receive of a step waited from the step's start
            starts[step] = s["ts"]
    for step, spans in by_step.items():
        last_end = starts.get(step, -math.inf)
        for s in sorted(spans, key=lambda s: (s["ts"], s["dur"])):
            if s["cat"] == "p2p" and last_end > -math.inf:
                found[id(s)] = min(last_end, s["ts"])
            last_end = max(last_end, s["ts"] + s["dur"])
    return found


def _split(rank: int, p2p: _RankP2P, waits: dict[tuple[int, int], list[tuple[float, float, bool]]]) -> list[P2PSplit]:
    out = []
    for index, (step, start, end, _args) in enumerate(p2p.spans):
        dur = max(end - start, 0.0)
        found = waits.get((rank, index), [])

        def waited(shift: float, found: list[tuple[float, float, bool]] = found, dur: float = dur) -> float:
            return min(max([w + shift * b for w, b, _ in found] + [0.0]), dur)

        bubble = waited(0.0)
        out.append(P2PSplit(rank, step, start, dur, bubble, dur - bubble, waited(-1.0), waited(1.0), bool(found)))
    return out


def _median(values: Iterable[float]) -> Optional[float]:
    values = list(values)
    return statistics.median(values) if values else None


def _ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value / 1000.0, 4)


def _pipeline_time(trace: RankTrace, splits: list[P2PSplit]) -> dict[int, float]:
    """Per step: from the rank's first to its last compute or p2p span (µs): the time its pipeline schedule ran
    (from an earlier post where a MegaDPP receive waited from the step's start)."""
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for split in splits:
        first[split.step] = min(first.get(split.step, math.inf), split.start - trace.offset_us)
    for s in trace.spans:
        if s["cat"] in ("compute", "p2p") and (step := step_of(s)) is not None:
            first[step] = min(first.get(step, math.inf), s["ts"])
            last[step] = max(last.get(step, -math.inf), s["ts"] + s["dur"])
    return {step: last[step] - first[step] for step in first}


def _microbatches(traces: dict[int, RankTrace], virtual: int) -> Optional[float]:
    """Microbatches a step: the forward compute spans of a rank's step over its model chunks (median)."""
    counts = []
    for trace in traces.values():
        per_step = Counter(step_of(s) for s in trace.spans if s["cat"] == "compute" and s["name"] == "forward")
        counts += [n / virtual for step, n in per_step.items() if step is not None]
    return _median(counts)


def _summarise(
    traces: dict[int, RankTrace],
    splits: dict[int, list[P2PSplit]],
    links: dict[tuple[int, int, str, Optional[int]], dict[int, list[tuple[float, float]]]],
    worst_bound: float,
    notes: list[str],
) -> dict[str, Any]:
    info = next((t.info for t in traces.values() if t.info), {})
    pipeline = int(info.get("pipeline_size") or (max(t.pp for t in traces.values()) + 1))
    virtual = int(info.get("virtual_pipeline_size") or 1)
    schedule = info.get("schedule")
    assumed = schedule is None
    if assumed:
        schedule = "interleaved" if virtual > 1 else "1f1b"
        notes.append(f"bubbles: the traces do not name their schedule; {schedule!r} assumed for the theory")
    microbatches = _microbatches(traces, virtual)
    theory, formula = theoretical_fraction(schedule, pipeline, microbatches, virtual)
    ranks: dict[str, Any] = {}
    by_stage: dict[int, list[int]] = defaultdict(list)
    for rank, trace in sorted(traces.items()):
        window = _pipeline_time(trace, splits.get(rank, []))
        steps: dict[int, dict[str, float]] = defaultdict(
            lambda: dict.fromkeys(("bubble", "transfer", "low", "high"), 0.0)
        )
        for split in splits.get(rank, []):
            entry = steps[split.step]
            entry["bubble"] += split.bubble
            entry["transfer"] += split.transfer
            entry["low"] += split.low
            entry["high"] += split.high
        if not steps:
            continue
        by_stage[trace.pp].append(rank)
        per_step = {
            str(step): {
                "bubble_ms": _ms(e["bubble"]),
                "transfer_ms": _ms(e["transfer"]),
                "pipeline_ms": _ms(window.get(step)),
                "bubble_fraction": _fraction(e["bubble"], window.get(step)),
            }
            for step, e in sorted(steps.items())
        }
        ranks[str(rank)] = {
            **trace.coordinates,
            "stage": trace.pp,
            **_medians(steps, window),
            "steps": per_step,
        }
    stages = []
    for stage, members in sorted(by_stage.items()):
        rows = [ranks[str(r)] for r in members]
        stages.append(
            {
                "stage": stage,
                "ranks": members,
                **{
                    key: _round(_median(r[key] for r in rows if r[key] is not None))
                    for key in (
                        "bubble_ms",
                        "bubble_ms_low",
                        "bubble_ms_high",
                        "transfer_ms",
                        "pipeline_ms",
                        "bubble_fraction",
                        "transfer_fraction",
                    )
                },
            }
        )
    measured = _median(s["bubble_fraction"] for s in stages if s["bubble_fraction"] is not None)
    typical = _median(t for per_step in links.values() for ms in per_step.values() for _, t in ms)
    if typical is not None and worst_bound > typical:
        notes.append(
            f"bubbles: the clocks are aligned within ±{worst_bound:.0f} us, more than a message's median transfer "
            f"({typical:.0f} us): bubble and transfer are known only within bubble_ms_low..bubble_ms_high"
        )
    link_rows = []
    for (src, dst, direction, chunk), per_step in sorted(links.items(), key=lambda kv: _link_order(kv[0])):
        messages = [m for ms in per_step.values() for m in ms]
        link_rows.append(
            {
                "src": src,
                "dst": dst,
                "src_stage": traces[src].pp,
                "dst_stage": traces[dst].pp,
                "direction": direction,
                "chunk": chunk,
                "messages": len(messages),
                "bubble_ms": _ms(_median(sum(b for b, _ in ms) for ms in per_step.values())),
                "transfer_ms": _ms(_median(sum(t for _, t in ms) for ms in per_step.values())),
                "transfer_ms_per_message": _ms(_median(t for _, t in messages)),
                "bubble_ms_per_message": _ms(_median(b for b, _ in messages)),
                "steps": {
                    str(step): {"bubble_ms": _ms(sum(b for b, _ in ms)), "transfer_ms": _ms(sum(t for _, t in ms))}
                    for step, ms in sorted(per_step.items())
                },
            }
        )
    return {
        "schedule": schedule,
        "schedule_assumed": assumed,
        "pipeline_size": pipeline,
        "virtual_pipeline_size": virtual,
        "microbatches": microbatches,
        "theoretical_fraction": _round(theory),
        "theoretical_formula": formula,
        "measured_fraction": _round(measured),
        "clock_uncertainty_us": round(worst_bound, 2),
        "stages": stages,
        "links": link_rows,
        "ranks": ranks,
        "warnings": notes,
    }


def _link_order(link: tuple[int, int, str, Optional[int]]) -> tuple[int, int, str, int]:
    return link[0], link[1], link[2], -1 if link[3] is None else link[3]


def _fraction(part: float, whole: Optional[float]) -> Optional[float]:
    return None if not whole else round(part / whole, 4)


def _round(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(float(value), 4)


def _medians(steps: dict[int, dict[str, float]], window: dict[int, float]) -> dict[str, Optional[float]]:
    """A rank's medians over steps (ms), and its bubble and transfer fractions of the pipeline time."""

    def median_of(key: str) -> Optional[float]:
        return _ms(_median(e[key] for e in steps.values()))

    return {
        "bubble_ms": median_of("bubble"),
        "bubble_ms_low": median_of("low"),
        "bubble_ms_high": median_of("high"),
        "transfer_ms": median_of("transfer"),
        "pipeline_ms": _ms(_median(window[s] for s in steps if s in window)),
        "bubble_fraction": _round(_median(e["bubble"] / window[s] for s, e in steps.items() if window.get(s))),
        "transfer_fraction": _round(_median(e["transfer"] / window[s] for s, e in steps.items() if window.get(s))),
    }


def pipeline_bubbles(
    trace_dir: Union[str, Path], skip_steps: int = 0, notes: Optional[list[str]] = None
) -> dict[str, Any]:
    """``measure_bubbles`` of a MegaScan trace directory (its finished steps, less the first ``skip_steps``)."""
    notes = notes if notes is not None else []
    traces = read_traces(Path(trace_dir), notes)
    keep_finished_steps(traces, skip_steps, notes)
    return measure_bubbles(traces, notes)


# ----------------------------------------------------------------------------------------------- CLI


def table(bubbles: dict[str, Any], links: bool = False) -> str:
    """The text form of ``measure_bubbles``'s result (the report's table prints the same stage rows)."""
    lines = bubble_lines(bubbles)
    if links and bubbles.get("links"):
        lines.append("")
        lines.append("link                      chunk  messages  bubble ms/step  transfer ms/step  transfer ms/message")
        for row in bubbles["links"]:
            name = f"{row['direction']} {row['src']}->{row['dst']} (pp{row['src_stage']}->pp{row['dst_stage']})"
            chunk = "" if row["chunk"] is None else str(row["chunk"])
            lines.append(
                f"{name:<26}{chunk:<7}{row['messages']:<10}{_cell(row['bubble_ms']):<16}"
                f"{_cell(row['transfer_ms']):<18}{_cell(row['transfer_ms_per_message'])}"
            )
    return "\n".join(lines)


def _cell(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.2f}"


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``bubbles TRACE_DIR [--json OUT.json] [--links]``: pipeline bubbles apart from transfers, per stage."""
    parser = subparsers.add_parser(
        "bubbles",
        help="split pipeline p2p time into bubbles (waiting for the peer) and transfers, per stage and link",
        description="Split every pipeline send and receive of a MegaScan trace directory into the time spent "
        "waiting for the peer (bubble) and the time moving bytes (transfer), per stage, link and step, beside the "
        "schedule's theoretical bubble fraction.",
    )
    parser.add_argument(
        "trace_dir", type=Path, metavar="TRACE_DIR", help="a MegaScan trace directory (one file per rank)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="also write the figures as JSON")
    parser.add_argument("--skip-steps", type=int, default=0, help="leave out the first N steps (warm-up)")
    parser.add_argument("--links", action="store_true", help="also print every link (sender -> receiver)")
    parser.set_defaults(func=_run_cli)
    return parser


def _run_cli(args: argparse.Namespace) -> int:
    notes: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # printed once, below
            found = pipeline_bubbles(args.trace_dir, args.skip_steps, notes)
    except (FileNotFoundError, NotADirectoryError) as err:
        print(f"lightning-megatron scan bubbles: error: {err}", file=sys.stderr)
        return 2
    for note in notes:
        if note not in found.get("warnings", []):  # the table prints those
            print(f"warning: {note}")
    if not found:
        print(f"no pipeline messages in {args.trace_dir}: bubbles need pipeline parallelism (PP > 1)")
        return 1
    print(table(found, links=args.links))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=2) + "\n")
        print(f"bubbles written to {args.json}")
    return 0
