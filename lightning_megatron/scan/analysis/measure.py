"""What the MegaScan rank files say each rank did: per-rank, per-step measurements for ``scan.analysis.detect``.

The contract: rank files in, numbers out. Reading a trace directory gives one ``RankTrace`` per rank (its
coordinates, host, clock offset to rank 0 and spans of the finished steps analysed); the functions below turn
those into what detection compares, and every one of them only measures: which numbers are slow is decided in
``scan.analysis.detect``. Problems with the input (missing or cut rank files, unfinished steps, unmatched sends) are
appended to a ``notes`` list, in the order they are found, for the report's warnings.

* **clocks**: a rank's offset to rank 0 (its *aligned* clock) is the median ``offset_us`` of its
  ``megascan.clock`` records, its uncertainty the median ``uncertainty_us`` (a ± bound, taken as two standard
  deviations by ``clock_sigma``);
* **steps**: a rank's steps are those it finished (its ``step`` span was written, so every span inside it was
  too; a truncated file's last step is partial), less the first ``skip_steps`` of the run;
* **net compute** (``net_compute``): per op (``cat: compute``, one key per name and model chunk) or layer part
  (``compute.layer``), a span's time minus the part of it spent inside blocking communication or data waits *on
  that rank* (the union of its ``collective`` spans that are not ``async``, its ``p2p`` and its ``data``
  spans): a fast tensor-parallel peer that waits inside the all-reduce for a slow one has a long span but
  normal net compute;
* **collective arrivals** (``collective_arrivals``): per instance ``(group, seq)`` the member with the latest
  start on the aligned clock arrived last, and imposed on every other member a wait of ``last start - its
  start``;
* **transfers** (``link_transfers``): a p2p send ``{peer: Q, seq: k, direction: d}`` on P and the matching
  receive on Q (same step) give a transfer time, by default ``recv end - max(send start, recv start)`` on the
  aligned clock (the transfer cannot start before both sides are there); a send alone in its span measures it
  on one clock instead where that is unambiguous (``transfer_us``). Each transfer records its size, whether it
  rests on two clocks, and whether both ends were alone in their spans (nothing else can have stretched it);
* **step totals** (``step_totals``): per rank and step, the net compute of the step (the same subtraction), how
  many compute spans it summed (identical work has identical counts), and the time the rank spent waiting for
  others (the union of its blocking communication and ``grad-sync`` spans): the per-step sums that a slowdown of
  part of the spans still moves, and who waited for whom without any clock alignment;
* **host-paced spans** (``host_paced``): on GPUs, a span its GPU reached as soon as it was queued and its host
  took most of to queue, or whose GPU kept its host's pace from start to end, lasted as long as the host took:
  transfers and layer parts leave such spans out (what
  the GPU recorder's queue and busy fields say per rank is in ``scan.analysis.gpu_measure``);
* ``summarize``, ``net_compute`` and ``collective_arrivals`` fill each rank's ``RankSummary`` (medians per step).

How long each rank waited per step, for its loader, its host or the other ranks, is measured in ``scan.analysis.waits``.
"""

from __future__ import annotations

import bisect
import math
import statistics
import warnings
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from lightning_megatron.scan.analysis.format import RANK_FILE_PATTERN, list_rank_files, read_rank_file
from lightning_megatron.scan.analysis.report import RankSummary

__all__ = [
    "Link",
    "RankTrace",
    "Transfer",
    "clock_sigma",
    "blocking_waits_per_step",
    "collective_arrivals",
    "covered_length",
    "KEPT_PACE",
    "STARVED_US",
    "host_paced",
    "layer_part",
    "layer_parts_per_step",
    "keep_finished_steps",
    "merge_intervals",
    "link_transfers",
    "net_compute",
    "net_compute_spans",
    "step_of",
    "read_traces",
    "StepTotal",
    "step_totals",
    "unjudged_ranks",
    "summarize",
    "transfer_us",
    "waits_for_others",
]

Link = tuple[int, int, str]  # an ordered link: (sending rank, receiving rank, direction)


# ----------------------------------------------------------------------------------------------- reading


@dataclass
class RankTrace:
    """The parts of one rank file detection uses, on the rank's own clock (``offset_us`` maps to rank 0's)."""

    rank: int
    dp: int = 0
    pp: int = 0
    tp: int = 0
    host: str = "?"
    device: str = "?"  # ``cuda:0``, ``cpu``: as the trainer's root device names it
    world_size: Optional[int] = None
    granularity: Optional[str] = None  # what MegaScan traced at, and why (chosen per job, or set)
    granularity_reason: Optional[str] = None
    offsets: list[float] = field(default_factory=list)
    uncertainties: list[float] = field(default_factory=list)
    spans: list[dict[str, Any]] = field(default_factory=list)
    offset_us: float = 0.0
    uncertainty_us: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)  # its ``megascan.rank`` record (layout, schedule, ...)
    counters: list[dict[str, Any]] = field(default_factory=list)  # ``ph: "C"`` events: tokens per expert

    @property
    def eager_in_place_of_replays(self) -> bool:
        """Whether most of its traced steps ran eagerly where the job replays a CUDA graph (``args.in_place_of_replay``:
        MegaScan's traced steps at TP/DP without ``trace_replays``), so that their host's kernel-by-kernel launch
        pace is not what the job's other steps pay."""
        marks = [bool((s.get("args") or {}).get("in_place_of_replay")) for s in self.spans if s["cat"] == "step"]
        return 2 * sum(marks) > len(marks)

    @property
    def coordinates(self) -> dict[str, Any]:
        """``rank``, ``dp``, ``pp``, ``tp`` and ``host``: where the rank sits, as every per-rank record says it."""
        return {"rank": self.rank, "dp": self.dp, "pp": self.pp, "tp": self.tp, "host": self.host}


def read_traces(trace_dir: Path, notes: list[str], since_step: Optional[int] = None) -> dict[int, RankTrace]:
    """Every rank file of ``trace_dir``, read; ``FileNotFoundError`` when there is none. ``since_step``: keep only
    the spans of that step and later (memory bounded by the steps kept, however long the run).

    Unreadable tails (a crashed run's cut line), ranks without a file and ranks without a clock record are noted."""
    files = list_rank_files(trace_dir)
    if not files:
        raise FileNotFoundError(f"no MegaScan rank files in {trace_dir}")
    traces: dict[int, RankTrace] = {}
    for rank, path in sorted(files.items()):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traces[rank] = _read(path, rank, since_step)
        notes += [str(w.message) for w in caught]
    world = _world_size(traces)
    missing = sorted(set(range(world)) - set(traces))
    if missing:
        notes.append(f"no trace for rank(s) {', '.join(map(str, missing))} of {world}")
    no_clock = sorted(rank for rank, t in traces.items() if not t.offsets)
    if no_clock and len(traces) > 1:
        notes.append(f"no megascan.clock record for rank(s) {', '.join(map(str, no_clock))}: offset 0 assumed")
    return traces


def _world_size(traces: dict[int, RankTrace]) -> int:
    """The job's size: what the rank records say, or at least the highest rank read plus one."""
    return max([t.world_size for t in traces.values() if t.world_size] + [max(traces) + 1])


def unjudged_ranks(traces: dict[int, RankTrace], had_spans: dict[int, bool]) -> dict[int, str]:
    """The ranks of the job that no rule can judge, each with why: no trace file, a file without events (empty or
    cut short: a crash, a full disk), or no finished step to analyse. ``traces`` as ``keep_finished_steps`` left
    them; ``had_spans``: per rank, whether its trace held any span before that.

    Why: a rank without data is not a rank without trouble. The rules compare what they have, so without this a
    job whose slow rank's trace was lost reads "nothing abnormal"; the report names these ranks instead."""
    reasons = {rank: "no trace file" for rank in range(_world_size(traces)) if rank not in traces}
    for rank, trace in traces.items():
        if not trace.spans:
            reasons[rank] = (
                "no finished step to analyse in the trace"
                if had_spans.get(rank)
                else "no spans in the trace file: empty or cut short"
            )
    return dict(sorted(reasons.items()))


def _read(path: Path, rank: int, since_step: Optional[int] = None) -> RankTrace:
    trace = RankTrace(rank=rank)
    match = RANK_FILE_PATTERN.match(path.name)
    if match:
        trace.dp, trace.pp, trace.tp = int(match.group(2)), int(match.group(3)), int(match.group(4))
    for event in read_rank_file(path):
        phase = event.get("ph")
        if phase == "X" and "cat" in event:
            if since_step is None or (step_of(event) or 0) >= since_step:
                trace.spans.append(event)
        elif phase == "C":
            trace.counters.append(event)
        elif phase == "M":
            args = event.get("args") or {}
            if event.get("name") == "megascan.rank":
                trace.info = dict(args)
                trace.dp = int(args.get("dp", trace.dp))
                trace.pp = int(args.get("pp", trace.pp))
                trace.tp = int(args.get("tp", trace.tp))
                trace.host = str(args.get("host", trace.host))
                trace.device = str(args.get("device", trace.device))
                if args.get("world_size") is not None:
                    trace.world_size = int(args["world_size"])
                trace.granularity = args.get("granularity", trace.granularity)
                trace.granularity_reason = args.get("granularity_reason", trace.granularity_reason)
            elif event.get("name") == "megascan.clock" and "offset_us" in args:
                trace.offsets.append(float(args["offset_us"]))
                trace.uncertainties.append(float(args.get("uncertainty_us", 0.0)))
    if trace.offsets:
        trace.offset_us = statistics.median(trace.offsets)
        trace.uncertainty_us = statistics.median(trace.uncertainties)
    return trace


def keep_finished_steps(traces: dict[int, RankTrace], skip_steps: int, notes: list[str]) -> list[int]:
    """Drop from every trace the spans outside the steps to analyse (see ``_select_steps``); returns those steps
    (over all ranks, sorted)."""
    steps = _select_steps(traces, skip_steps, notes)
    for trace in traces.values():
        trace.spans = [s for s in trace.spans if step_of(s) in steps.get(trace.rank, set())]
    all_steps = sorted(set().union(*steps.values())) if steps else []
    if not all_steps:
        notes.append("no finished step with spans to analyse")
    return all_steps


def _select_steps(traces: dict[int, RankTrace], skip_steps: int, notes: list[str]) -> dict[int, set[int]]:
    """Per rank, the steps to analyse: those the rank finished (its ``step`` span was written, so every span
    inside the step was written too; a truncated file's last step is partial), less the first ``skip_steps``
    and the profiled ones."""
    every = sorted({step for t in traces.values() for s in t.spans if (step := step_of(s)) is not None})
    skipped = set(every[:skip_steps])
    # steps run under torch.profiler (MegaScan's profile_steps) are slower by the profiler's cost, which is
    # not the same on every rank: no evidence about the ranks themselves
    profiled = {step_of(s) for t in traces.values() for s in t.spans if s["cat"] == "step" and _profiled(s)}
    if profiled:
        notes.append(f"profiled step(s) {sorted(profiled)} left out (torch.profiler slows them)")
        skipped |= profiled
    selected: dict[int, set[int]] = {}
    for rank, trace in traces.items():
        finished = {step_of(s) for s in trace.spans if s["cat"] == "step"} - {None}
        seen = {step_of(s) for s in trace.spans} - {None}
        use = finished if finished else seen
        if finished and seen - finished and max(seen) > max(finished):
            notes.append(f"rank {rank}: step(s) {sorted(seen - finished)} unfinished in its trace, left out")
        selected[rank] = {s for s in use if s is not None} - skipped
    return selected


def _profiled(event: dict[str, Any]) -> bool:
    return bool((event.get("args") or {}).get("profiled"))


def step_of(event: dict[str, Any]) -> Optional[int]:
    step = (event.get("args") or {}).get("step")
    return None if step is None else int(step)


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The union of intervals as sorted, disjoint (starts, ends)."""
    starts: list[float] = []
    ends: list[float] = []
    for start, end in sorted(intervals):
        if starts and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def covered_length(start: float, end: float, union: tuple[list[float], list[float]]) -> float:
    """Length of ``[start, end]`` covered by a union from ``merge_intervals``."""
    starts, ends = union
    total = 0.0
    i = bisect.bisect_right(ends, start)
    while i < len(starts) and starts[i] < end:
        total += max(0.0, min(end, ends[i]) - max(start, starts[i]))
        i += 1
    return total


# ----------------------------------------------------------------------------------------------- measuring


def summarize(trace: RankTrace) -> RankSummary:
    """The rank's median step time and data-wait per step (``net_compute`` and ``collective_arrivals`` add theirs)."""
    step_durs = [s["dur"] for s in trace.spans if s["cat"] == "step"]
    data_per_step: dict[int, float] = defaultdict(float)
    for s in trace.spans:
        if s["cat"] == "data":
            data_per_step[step_of(s)] += s["dur"]  # type: ignore[index]
    return RankSummary(
        **trace.coordinates,
        steps=len({step_of(s) for s in trace.spans}),
        step_ms=statistics.median(step_durs) / 1000 if step_durs else None,
        data_ms=statistics.median(data_per_step.values()) / 1000 if data_per_step else None,
    )


def _blocking(span: dict[str, Any]) -> bool:
    """Whether a span is time the rank spent waiting (for peers or input) rather than computing."""
    cat = span["cat"]
    if cat == "collective":
        return not (span.get("args") or {}).get("async", False)
    # collective.wait / ring.wait: blocked in an async collective's (a ring exchange's) wait()
    return cat in ("p2p", "data", "collective.wait", "ring.wait")


def net_compute_spans(trace: RankTrace) -> Iterable[tuple[dict[str, Any], float]]:
    """Each compute or layer span of the rank with its net time (µs): its length less its own waits inside."""
    waits = merge_intervals((s["ts"], s["ts"] + s["dur"]) for s in trace.spans if _blocking(s))
    for s in trace.spans:
        if s["cat"] in ("compute", "compute.layer"):
            yield s, max(s["dur"] - covered_length(s["ts"], s["ts"] + s["dur"], waits), 0.0)


def net_compute(
    traces: dict[int, RankTrace], per_rank: dict[int, RankSummary]
) -> tuple[dict[int, dict[str, list[float]]], dict[int, dict[str, list[float]]]]:
    """Per rank, per op: net compute times (µs) — span length minus its overlap with the rank's own waits."""
    compute: dict[int, dict[str, list[float]]] = {}
    layers: dict[int, dict[str, list[float]]] = {}
    for rank, trace in traces.items():
        by_op: dict[str, list[float]] = defaultdict(list)
        by_layer: dict[str, list[float]] = defaultdict(list)
        op_per_step: dict[int, float] = defaultdict(float)
        layer_per_step: dict[int, float] = defaultdict(float)
        for s, net in net_compute_spans(trace):
            args = s.get("args") or {}
            if s["cat"] == "compute":
                by_op[f"{s['name']} chunk {args.get('chunk', 0)}"].append(net)
                op_per_step[int(args.get("step", -1))] += net
            else:
                key = f"{args.get('direction', '?')} layer {args.get('layer', '?')} {args.get('part', s['name'])}"
                by_layer[key].append(net)
                layer_per_step[int(args.get("step", -1))] += net
        compute[rank] = dict(by_op)
        layers[rank] = dict(by_layer)
        per_step = op_per_step or layer_per_step
        if per_step:
            per_rank[rank].compute_ms = statistics.median(per_step.values()) / 1000
    return compute, layers


def layer_part(span: dict[str, Any]) -> str:
    """A layer span's part merged over layers (``backward mlp``): the same work on every pipeline stage."""
    args = span.get("args") or {}
    return f"{args.get('direction', '?')} {args.get('part', span['name'])}"


def layer_parts_per_step(
    traces: dict[int, RankTrace], host_paced_too: bool = False
) -> dict[int, dict[int, dict[str, list[float]]]]:
    """Per rank with layer spans, per step, per layer part (``backward mlp``: merged over the rank's layers):
    the net times (µs) of the spans its GPU, not its host, paced (``host_paced``). A host-paced span lasts as
    long as its host took to queue it, which on a launch-bound forward is most of it: it measures the host.
    ``host_paced_too``: every span; each is then an upper bound of its GPU's time (the GPU's work plus its
    waits for the host), which a baseline may use where its GPU paced too few spans."""
    found: dict[int, dict[int, dict[str, list[float]]]] = {}
    for rank, trace in traces.items():
        per_step: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for s, net in net_compute_spans(trace):
            args = s.get("args") or {}
            if s["cat"] != "compute.layer" or "step" not in args:
                continue
            if not host_paced_too and host_paced(args, s["dur"]):
                continue
            per_step[int(args["step"])][layer_part(s)].append(net)
        if per_step:
            found[rank] = {step: dict(parts) for step, parts in per_step.items()}
    return found


@dataclass
class StepTotal:
    """One rank's step, summed: net compute (µs) and how many compute spans it holds, and its waits (µs)."""

    compute_us: float = 0.0
    spans: int = 0
    wait_us: float = 0.0


def step_totals(traces: dict[int, RankTrace]) -> dict[int, dict[int, StepTotal]]:
    """Per rank, per step: ``StepTotal``. Net compute sums ``compute`` spans, or layer spans where the trace
    has no ``compute`` spans (the two nest; summing both would count the time twice)."""
    totals: dict[int, dict[int, StepTotal]] = {}
    for rank, trace in traces.items():
        has_ops = any(s["cat"] == "compute" for s in trace.spans)
        per_step: dict[int, StepTotal] = defaultdict(StepTotal)
        for s, net in net_compute_spans(trace):
            if (s["cat"] == "compute") == has_ops and (step := step_of(s)) is not None:
                per_step[step].compute_us += net
                per_step[step].spans += 1
        for step, waited in blocking_waits_per_step(trace).items():
            per_step[step].wait_us = waited
        totals[rank] = dict(per_step)
    return totals


def waits_for_others(span: dict[str, Any]) -> bool:
    """Whether a span is the rank waiting for the other ranks: blocking communication and ``grad-sync``."""
    return (_blocking(span) and span["cat"] != "data") or span["cat"] == "grad_sync"


def blocking_waits_per_step(trace: RankTrace) -> dict[int, float]:
    """Per step: how long (µs) the rank waited for the other ranks inside it, the union of its blocking
    communication and ``grad-sync`` spans. Each is a duration on the rank's own clock: comparing them across
    ranks says who waited for whom without any clock alignment."""
    by_step: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s in trace.spans:
        if waits_for_others(s):
            if (step := step_of(s)) is not None:
                by_step[step].append((s["ts"], s["ts"] + s["dur"]))
    waited = {}
    for step, intervals in by_step.items():
        starts, ends = merge_intervals(intervals)
        waited[step] = sum(e - b for b, e in zip(starts, ends))
    return waited


STARVED_US = 30.0  # a GPU that reaches a span within this long after the host queued it was waiting for the host
# A GPU at most this share of a span behind its host at the span's start and at its end kept the host's pace: the
# span lasted as long as the host took to queue it (``host_paced``).
KEPT_PACE = 0.15


def host_paced(args: dict[str, Any], dur: float) -> bool:
    """Whether a GPU span measured its host rather than its GPU work. Either its GPU reached it as soon as it was
    queued (``queued_us`` under 30 µs) and the host then took at least half the span to queue what it holds
    (``enqueue_us``); or its GPU kept pace with the host throughout: at most ``KEPT_PACE`` of the span behind it
    at the start (``queued_us``) and at the end (GPU end - host end = ``queued_us + dur - enqueue_us``).

    A p2p span on a slow host is long because its op was posted late, not because the link was slow; a delayed
    link keeps the GPU in the op long after the host moved on. The second test is for GPUs a few tens of µs
    behind a launch-bound host: in clean GPT PP2 fits the first stage's GPU reached its "GPU-paced" backward
    attention spans 30-100 µs after they were queued, and its host then took 90-95% of each span to queue the
    rest, so those spans timed the host (0.99 ms against the other stage's 0.79 ms, while the kernels' busy time
    was the same, 0.72 ms): the other stage, whose GPU ran behind a full queue, looked 24-36% faster and the first
    stage was named ``compute``. At ``KEPT_PACE`` 0.12 those fits still named it; at 0.22 a host stall started
    to pass for compute in the GPU evaluation's traces: 0.15 is between. A GPU behind a full queue (``queued_us``
    of a large share of the span) stays GPU-paced, also where a full launch queue made its host as slow as the
    GPU (``enqueue_us`` near ``dur``). False without queue fields."""
    queued, enqueue = args.get("queued_us"), args.get("enqueue_us")
    if queued is None or enqueue is None:
        return False
    queued, enqueue = float(queued), float(enqueue)
    if queued < STARVED_US and enqueue >= 0.5 * dur:
        return True
    return queued < KEPT_PACE * dur and queued + dur - enqueue < KEPT_PACE * dur


def collective_arrivals(traces: dict[int, RankTrace], per_rank: dict[int, RankSummary]) -> dict[int, dict[str, Any]]:
    """Per rank and group name: instances, how often the rank started last, and the wait it then imposed.

    One instance is ``(group, seq)``; its members' starts are compared on the aligned clock. The wait imposed by
    the last member is the mean over the other members of ``last start - their start``."""
    instances: dict[tuple[tuple[int, ...], int], dict[int, float]] = defaultdict(dict)
    names: dict[tuple[int, ...], str] = {}
    for rank, trace in traces.items():
        for s in trace.spans:
            if s["cat"] != "collective":
                continue
            args = s.get("args") or {}
            if "group" not in args or "seq" not in args:
                continue
            group = tuple(sorted(int(r) for r in args["group"]))
            names[group] = str(args.get("group_name", "?"))
            instances[(group, int(args["seq"]))][rank] = s["ts"] + trace.offset_us
    stats: dict[int, dict[str, dict[str, float]]] = defaultdict(
        lambda: defaultdict(lambda: {"instances": 0, "last": 0, "imposed_us": 0.0})
    )
    for (group, _seq), starts in instances.items():
        if len(starts) < 2:
            continue
        last = max(starts, key=lambda r: (starts[r], r))
        imposed = statistics.fmean(starts[last] - t for r, t in starts.items() if r != last)
        for rank in starts:
            entry = stats[rank][names[group]]
            entry["instances"] += 1
            entry["group_size"] = len(group)
            if rank == last:
                entry["last"] += 1
                entry["imposed_us"] += imposed
    for rank, by_name in stats.items():
        total = sum(e["instances"] for e in by_name.values())
        last = sum(e["last"] for e in by_name.values())
        imposed = sum(e["imposed_us"] for e in by_name.values())
        if rank in per_rank and total:
            per_rank[rank].collectives = int(total)
            per_rank[rank].last_arrival_fraction = last / total
            per_rank[rank].imposed_wait_ms = imposed / last / 1000 if last else 0.0
    return {rank: dict(by_name) for rank, by_name in stats.items()}


def transfer_us(
    send: tuple[float, float, bool], recv: tuple[float, float], margin: float
) -> tuple[Optional[float], bool]:
    """One transfer's duration (µs) from a matched send (start, end, alone in its span) and receive (start, end)
    on the aligned clock, and whether it rests on the alignment of two clocks; ``None`` when ambiguous.

    The reference is ``recv end - max(send start, recv start)``: the data cannot move before both sides are
    there. Two things spoil it: when the receiver was there first it is a difference across two clocks (only
    known within their uncertainty, tens of µs, the order of a whole activation transfer), and with eager sends
    (the data travels before the receiver posts) a late receiver finds the data already there. When the send is
    alone in its span, its own duration measures the transfer on one clock in both cases (receiver first, or
    send complete before the receiver came), so it is used instead; when the receiver came *during* the send,
    rendezvous semantics (transfer = receive span) and eager ones (transfer = send span) disagree and the
    sample is ambiguous. Spans holding several ops (``send-forward-recv-backward``) use the reference."""
    send_start, send_end, alone = send
    recv_start, recv_end = recv
    gap = recv_start - send_start
    send_dur = send_end - send_start
    if not alone:
        return max(recv_end - max(send_start, recv_start), 0.0), gap < 0
    if gap <= margin or gap >= send_dur + margin:
        return max(send_dur, 0.0), False
    return None, False


@dataclass
class Transfer:
    """One matched send and receive: duration (µs), size, step, and what the duration rests on."""

    us: float
    bytes: float
    step: int
    cross_clock: bool  # rests on the alignment of two ranks' clocks
    clean: bool  # both ends alone in their spans: nothing else in either span can have delayed it
    host_paced: bool = False  # an end's span lasted as long as its host took to queue it (see host_paced)


def link_transfers(
    traces: dict[int, RankTrace],
    notes: list[str],
    bubble_free: Optional[dict[tuple[int, int, str, int, int], float]] = None,
) -> dict[Link, list[Transfer]]:
    """Match every p2p send with its receive (same sender, receiver, direction, step and ``seq``) and time the
    transfer (``transfer_us``), per ordered link. Sends without a matching receive (a missing or cut trace on
    the other side) are noted.

    ``bubble_free`` (``bubbles.message_transfers``: per message, its receive span's time less its longest wait
    for any peer) replaces the reference ``recv end - max(send start, recv start)`` where the send shares its span
    with other operations (``transfer_us`` uses the reference there): the reference subtracts only this message's
    wait, so a receive span holding several operations that then waited for another message (the reverse
    direction's, another model chunk's) counted that wait as this link's transfer. A send alone in its span still
    times it on one clock (``transfer_us``)."""
    Key = tuple[int, int, str, int, int]  # (src, dst, direction, step, seq)
    sends: dict[Key, tuple[float, float, bool, float, bool]] = {}
    recvs: dict[Key, tuple[float, float, bool, float, bool]] = {}
    for rank, trace in traces.items():
        for s in trace.spans:
            if s["cat"] != "p2p":
                continue
            args = s.get("args") or {}
            step = int(args.get("step", -1))
            start, end = s["ts"] + trace.offset_us, s["ts"] + s["dur"] + trace.offset_us
            send_ops, recv_ops = args.get("sends") or [], args.get("recvs") or []
            paced = host_paced(args, s["dur"])
            for op in send_ops:
                key = (rank, int(op["peer"]), str(op.get("direction", "?")), step, int(op.get("seq", 0)))
                sends[key] = (start, end, len(send_ops) == 1 and not recv_ops, float(op.get("bytes", 0) or 0), paced)
            for op in recv_ops:
                key = (int(op["peer"]), rank, str(op.get("direction", "?")), step, int(op.get("seq", 0)))
                recvs[key] = (start, end, len(recv_ops) == 1 and not send_ops, float(op.get("bytes", 0) or 0), paced)
    transfers: dict[Link, list[Transfer]] = defaultdict(list)
    unmatched = 0
    for key, (send_start, send_end, send_alone, send_bytes, send_paced) in sends.items():
        src, dst, direction, step, _seq = key
        recv = recvs.get(key)
        if recv is None or src not in traces or dst not in traces:
            unmatched += 1
            continue
        recv_start, recv_end, recv_alone, recv_bytes, recv_paced = recv
        margin = clock_sigma(traces[src], traces[dst])
        us, cross = transfer_us((send_start, send_end, send_alone), (recv_start, recv_end), margin)
        if not send_alone and bubble_free and key in bubble_free:
            us = bubble_free[key]
        if us is not None:
            size = max(send_bytes, recv_bytes, 1.0)
            transfers[(src, dst, direction)].append(
                Transfer(us, size, step, cross, send_alone and recv_alone, send_paced or recv_paced)
            )
    if unmatched:
        notes.append(f"{unmatched} of {len(sends)} p2p sends without a matching receive (missing or cut traces)")
    return dict(transfers)


def clock_sigma(a: RankTrace, b: RankTrace) -> float:
    """Standard deviation (µs) of the error of a difference between two ranks' aligned times.

    ``uncertainty_us`` is a ± bound of a clock offset; it is taken as two standard deviations."""
    return math.hypot(a.uncertainty_us, b.uncertainty_us) / 2.0
