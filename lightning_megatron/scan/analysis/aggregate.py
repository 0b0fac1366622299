"""Merge a MegaScan trace directory (one file per rank) into one clock-aligned Chrome trace.

    lightning-megatron scan aggregate runs/trace -o merged.json.gz [--no-refine] [--quiet]

Each rank recorded on its own clock, so the raw files cannot be laid side by side. Aggregation streams the rank
files twice and never holds more than one rank's events (plus the small cross-rank endpoints) in memory:

1. *Scan*: per rank, only metadata, ``megascan.clock`` records and the endpoints of p2p transfers and
   collectives. The clock offset of a rank is the median of its clock records weighted by their precision
   (no record: 0, with a warning). Those offsets are then *refined* with collectives: the members of one
   collective instance (same group and seq) all leave it at the same true moment, so a rank whose ends sit
   consistently early or late has a residual clock error; its median residual is subtracted when it is within
   ``3 × uncertainty + 2 ms`` (unbounded for a rank without clock records: collectives are all it has). The
   residual skew (|end − instance median|, median and p95) before and after is reported, a direct measure of
   how well the timeline lines up. Ranks on one machine (equal ``clock_domain``: they read the same monotonic
   clock) then share one offset, since the true offset between them is zero.
2. *Write*: per rank, its events shifted onto rank 0's clock and sorted (timestamps monotonic per thread, as
   viewers expect), interleaved with flow arrows: every matched p2p send → recv (``cat: p2p``) and, for every
   collective instance, from its last-arriving member, the one everybody waited for, to each other member
   (``cat: collective``); global iteration markers at the step starts of rank 0 (or the lowest rank present);
   and a closing ``megascan.merged`` metadata event with ranks present / missing / truncated, the offsets and
   the residual skew.

Missing and truncated rank files are reported (``warnings`` and a line on stderr) and merged as far as they go.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, TextIO

from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

__all__ = ["aggregate", "register_cli"]

REFINE_SLACK_US = 2000.0  # a refinement beyond 3 × clock uncertainty + this is distrusted (kept off)
REFINE_ITERATIONS = 100
REFINE_TOLERANCE_US = 0.05

# (step, src rank, dst rank, direction, seq): one p2p transfer, as both of its ends describe it.
P2PKey = tuple[int, int, int, str, int]
# (rank, ts, dur, tid) of one endpoint slice, on the rank's own clock.
Endpoint = tuple[int, float, float, Any]


@dataclass
class _Scan:
    """What pass 1 keeps: small, cross-rank, no full event lists."""

    files: dict[int, Path]
    present: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    empty: list[int] = field(default_factory=list)  # present, but without a single span
    unreadable: list[int] = field(default_factory=list)
    info: dict[int, dict[str, Any]] = field(default_factory=dict)
    clocks: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # rank → [(offset, uncertainty)]
    sends: dict[P2PKey, Endpoint] = field(default_factory=dict)
    recvs: dict[P2PKey, Endpoint] = field(default_factory=dict)
    collectives: dict[tuple[tuple[int, ...], int], list[Endpoint]] = field(default_factory=lambda: defaultdict(list))
    # instances whose members cannot be assumed to leave together (see _ends_together)
    unaligned: set[tuple[tuple[int, ...], int]] = field(default_factory=set)
    anchor: Optional[int] = None  # the rank whose step starts become the global iteration markers
    step_starts: dict[int, float] = field(default_factory=dict)  # step → anchor-local ts
    events: int = 0


def _notify(message: str) -> None:
    """A Python warning, for callers and tests; the CLI prints each one once, before its summary (``_run``), not
    between the progress bars' updates."""
    warnings.warn(message, stacklevel=3)


def _progress(items: list[int], enabled: bool, desc: str) -> Iterator[int]:
    if not enabled:
        return iter(items)
    from tqdm.auto import tqdm

    return iter(tqdm(items, desc=desc, unit="rank", file=sys.stderr))


def _scan_rank(scan: _Scan, rank: int, path: Path) -> None:
    failure: Optional[Exception] = None
    malformed = 0
    timed = 0
    with warnings.catch_warnings(record=True) as caught:  # read_rank_file's own warnings mean "truncated"
        warnings.simplefilter("always")
        try:
            for event in read_rank_file(path):
                scan.events += 1
                timed += event.get("ph") == "X"
                try:
                    _scan_event(scan, rank, event)
                except (KeyError, TypeError, ValueError):  # a malformed event: skipped, the rest still counts
                    malformed += 1
        except Exception as err:  # noqa: BLE001  (an unreadable file must not stop the other 1023)
            failure = err
    if failure is not None:
        _forget(scan, rank)
        scan.unreadable.append(rank)
        _notify(f"rank {rank}: cannot read {path} ({type(failure).__name__}: {failure}); treated as missing")
        return
    scan.present.append(rank)
    reasons = [str(w.message) for w in caught] + ([f"{malformed} malformed event(s)"] if malformed else [])
    if reasons:
        scan.truncated.append(rank)
        _notify(f"rank {rank}: truncated or damaged rank file, merging what it holds ({'; '.join(reasons)})")
    if not timed:
        scan.empty.append(rank)
        _notify(f"rank {rank}: no spans in {path.name} (empty or cut short): nothing of it on the timeline")


def _forget(scan: _Scan, rank: int) -> None:
    """Drop what a rank that turned out unreadable contributed before it failed (rare, so a plain sweep)."""
    for table in (scan.sends, scan.recvs):
        for key in [k for k, endpoint in table.items() if endpoint[0] == rank]:
            del table[key]
    for members in scan.collectives.values():
        members[:] = [m for m in members if m[0] != rank]
    scan.clocks.pop(rank, None)
    scan.info.pop(rank, None)
    if scan.anchor == rank:
        scan.anchor, scan.step_starts = None, {}


def _scan_event(scan: _Scan, rank: int, event: dict[str, Any]) -> None:
    ph = event.get("ph")
    if ph == "M":
        name, args = event.get("name"), event.get("args") or {}
        if name == "megascan.rank":
            scan.info[rank] = args
        elif name == "megascan.clock" and "offset_us" in args:
            scan.clocks.setdefault(rank, []).append((float(args["offset_us"]), float(args.get("uncertainty_us", 0.0))))
        return
    if ph != "X":
        return
    cat, args = event.get("cat"), event.get("args") or {}
    if cat in ("p2p", "ring"):  # pipeline messages, and ring attention's exchanges (their directions differ)
        endpoint = (rank, float(event["ts"]), float(event.get("dur", 0.0)), event.get("tid"))
        step = args.get("step")
        for send in args.get("sends") or ():
            scan.sends[(step, rank, send["peer"], send.get("direction"), send.get("seq"))] = endpoint
        for recv in args.get("recvs") or ():
            scan.recvs[(step, recv["peer"], rank, recv.get("direction"), recv.get("seq"))] = endpoint
    elif cat == "collective" and "group" in args and "seq" in args:
        key = (tuple(args["group"]), int(args["seq"]))
        scan.collectives[key].append((rank, float(event["ts"]), float(event.get("dur", 0.0)), event.get("tid")))
        if not _ends_together(event):
            scan.unaligned.add(key)
    elif cat == "step" and "step" in args:
        if scan.anchor is None:
            scan.anchor = rank  # ranks are scanned in order: the lowest rank with steps
        if scan.anchor == rank:
            scan.step_starts.setdefault(int(args["step"]), float(event["ts"]))


def _weighted_median(values: list[float], weights: list[float]) -> float:
    pairs = sorted(zip(values, weights))
    half, acc = sum(weights) / 2.0, 0.0
    for value, weight in pairs:
        acc += weight
        if acc >= half:
            return value
    return pairs[-1][0]


def _clock_offsets(scan: _Scan) -> tuple[dict[int, float], dict[int, float], list[int]]:
    """Offset and uncertainty per present rank from its clock records; ranks without records get 0."""
    offsets: dict[int, float] = {}
    uncertainty: dict[int, float] = {}
    no_clock: list[int] = []
    for rank in scan.present:
        records = scan.clocks.get(rank)
        if not records:
            offsets[rank], uncertainty[rank] = 0.0, math.inf
            if rank != 0:  # rank 0 is the reference clock: offset 0 by definition
                no_clock.append(rank)
            else:
                uncertainty[rank] = 0.0
            continue
        values = [offset for offset, _ in records]
        weights = [1.0 / max(unc, 1.0) for _, unc in records]
        offsets[rank] = _weighted_median(values, weights)
        uncertainty[rank] = statistics.median(unc for _, unc in records)
    if no_clock:
        _notify(f"no megascan.clock record for rank(s) {_compact(no_clock)}: clock offset 0 before refinement")
    return offsets, uncertainty, no_clock


ROOTED_COLLECTIVES = frozenset({"broadcast", "reduce", "scatter", "gather"})
MAX_PLAUSIBLE_BYTES_PER_US = 5e6  # 5 TB/s: faster than any interconnect, so the span cannot hold the transfer


def _ends_together(event: dict[str, Any]) -> bool:
    """Whether this member's span of a collective ends when the collective does, for every member alike.

    Not so for an async op (its span ends at the launch), a rooted one (a broadcast's root may finish as soon
    as its data is on the wire, before the receivers arrive) and a span too short for its bytes: inside
    ``_coalescing_manager`` (megatron-core's bucketed gradient reduction) a call only queues the op, which is
    launched when the manager exits, so the span holds the queuing and not the transfer."""
    args = event.get("args") or {}
    if args.get("async") or event.get("name") in ROOTED_COLLECTIVES:
        return False
    return float(args.get("bytes") or 0) <= MAX_PLAUSIBLE_BYTES_PER_US * max(float(event.get("dur", 0.0)), 1e-3)


def _instances(scan: _Scan) -> dict[tuple[int, ...], list[list[tuple[int, float]]]]:
    """Group → [(rank, local end) of each member] of every synchronous collective instance with ≥ 2 members seen."""
    out: dict[tuple[int, ...], list[list[tuple[int, float]]]] = defaultdict(list)
    for (group, _seq), members in scan.collectives.items():
        if (group, _seq) not in scan.unaligned and len(members) >= 2:
            out[group].append([(rank, ts + dur) for rank, ts, dur, _ in members])
    return out


def _residuals(
    instances: dict[tuple[int, ...], list[list[tuple[int, float]]]], offsets: dict[int, float]
) -> dict[tuple[int, ...], dict[int, list[float]]]:
    """Group → rank → its end minus the instance's median end (aligned clock), over the group's instances."""
    out: dict[tuple[int, ...], dict[int, list[float]]] = {}
    for group, group_instances in instances.items():
        by_rank: dict[int, list[float]] = defaultdict(list)
        for members in group_instances:
            ends = [end + offsets[rank] for rank, end in members]
            middle = statistics.median(ends)
            for (rank, _), end in zip(members, ends):
                by_rank[rank].append(end - middle)
        out[group] = by_rank
    return out


def _skew(residuals: dict[tuple[int, ...], dict[int, list[float]]]) -> dict[str, Any]:
    """Median, p95 and max of |residual| over every member of every instance: how well clocks line up."""
    values = sorted(abs(v) for by_rank in residuals.values() for rs in by_rank.values() for v in rs)
    if not values:
        return {"median": None, "p95": None, "max": None, "n": 0}
    p95 = values[min(len(values) - 1, math.ceil(0.95 * len(values)) - 1)]
    return {"median": round(statistics.median(values), 3), "p95": round(p95, 3), "max": round(values[-1], 3)} | {
        "n": len(values)
    }


def _components(groups: list[tuple[int, ...]]) -> dict[int, int]:
    """Rank → representative of its connected component (ranks linked by sharing a collective group)."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for group in groups:
        root = find(group[0])
        for rank in group[1:]:
            other = find(rank)
            if other != root:
                parent[other] = root
    return {rank: find(rank) for rank in parent}


def _refine(
    residuals: dict[tuple[int, ...], dict[int, list[float]]],
    offsets: dict[int, float],
    uncertainty: dict[int, float],
    has_clock: set[int],
    reference: int,
) -> tuple[dict[int, float], list[int]]:
    """Offsets corrected so collective ends coincide; returns them and the ranks whose correction was rejected.

    Per group, a member's typical deviation ``d[g][r]`` (median over the group's instances, robust to odd
    instances) says how far its clock sits from its group mates'. Corrections ``c`` solve ``c[r] + d[g][r] =
    k[g]`` for every group, by alternating robust updates (``k[g]`` = median over members, ``c[r]`` = median over
    the rank's groups): each group counts once per rank however many instances it has, so the few DP all-reduces
    tie together TP groups that have dozens. Collectives fix clocks only within a connected set of ranks
    (pipeline stages share none): the set holding the reference rank is pinned to it, any other keeps the level
    of its clock records (median correction 0).
    """
    deviation = {
        group: {rank: statistics.median(values) for rank, values in by_rank.items()}
        for group, by_rank in residuals.items()
    }
    groups_of: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for group, members in deviation.items():
        for rank in members:
            groups_of[rank].append(group)
    correction = dict.fromkeys(groups_of, 0.0)
    level: dict[tuple[int, ...], float] = {}
    for _ in range(REFINE_ITERATIONS):
        for group, members in deviation.items():
            level[group] = statistics.median(correction[r] + d for r, d in members.items())
        largest = 0.0
        for rank, groups in groups_of.items():
            new = statistics.median(level[g] - deviation[g][rank] for g in groups)
            largest = max(largest, abs(new - correction[rank]))
            correction[rank] = new
        if largest < REFINE_TOLERANCE_US:
            break
    components: dict[int, list[int]] = defaultdict(list)
    for rank, root in _components(list(deviation)).items():
        components[root].append(rank)
    for ranks in components.values():
        if reference in ranks:
            shift = correction[reference]
        else:
            clocked = [correction[r] for r in ranks if r in has_clock] or [correction[r] for r in ranks]
            shift = statistics.median(clocked)
        for rank in ranks:
            correction[rank] -= shift
    refined, rejected = dict(offsets), []
    for rank, delta in correction.items():
        if abs(delta) <= 3.0 * uncertainty[rank] + REFINE_SLACK_US:  # inf for a rank without clock records
            refined[rank] += delta
        else:
            rejected.append(rank)
    return refined, sorted(rejected)


def _share_clock_domains(scan: _Scan, offsets: dict[int, float], reference: int) -> dict[int, float]:
    """Ranks that read the same clock (one machine: same ``clock_domain``) get one offset: the reference rank's
    for its own machine, else the median of the machine's estimates. Measured offsets and refinement carry errors
    of tens of µs, larger than the gap between a send and its receive on one machine, which made flows point
    backwards; the true offset between them is zero."""
    domains: dict[str, list[int]] = defaultdict(list)
    for rank in offsets:
        domain = (scan.info.get(rank) or {}).get("clock_domain")
        if domain:
            domains[domain].append(rank)
    shared = dict(offsets)
    for ranks in domains.values():
        value = offsets[reference] if reference in ranks else statistics.median(offsets[r] for r in ranks)
        for rank in ranks:
            shared[rank] = value
    return shared


def _compact(ranks: list[int]) -> str:
    """``0-3,7,9-12``: rank lists stay readable at 1024 ranks."""
    parts, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(parts)


def _inside_start(ts: float, dur: float) -> float:
    """A time just inside a slice's start, so the viewer binds a flow to that slice."""
    return ts + min(dur / 2.0, 0.5)


def _inside_end(ts: float, dur: float) -> float:
    return ts + dur - min(dur / 2.0, 0.5)


# A flow end kept until its rank is written: (ts, ph, id, tid, cat, name); tuples, not dicts, because a long trace
# has as many flow ends as events and they all wait in memory for their rank's turn.
FlowEnd = tuple[float, str, int, Any, str, str]


def _flow_event(pid: int, end: FlowEnd) -> dict[str, Any]:
    ts, ph, flow_id, tid, cat, name = end
    event = {"name": name, "cat": cat, "ph": ph, "id": flow_id, "pid": pid, "tid": tid, "ts": ts}
    if ph == "f":
        event["bp"] = "e"  # bind to the enclosing slice (the recv / the waiting collective), not the next one
    return event


def _flows(scan: _Scan, offsets: dict[int, float]) -> tuple[dict[int, list[FlowEnd]], dict[str, int]]:
    """Flow ends per rank (aligned time): p2p send → recv (pipeline messages, and ring attention's exchanges as cat
    ``ring``), and collective last arriver → every other member."""
    by_rank: dict[int, list[FlowEnd]] = defaultdict(list)
    counts = {"p2p": 0, "ring": 0, "collective": 0, "dropped": 0, "unmatched_sends": 0, "unmatched_recvs": 0}
    next_id = 1

    def pair(src: Endpoint, dst: Endpoint, cat: str, name: str) -> None:
        nonlocal next_id
        start = _inside_start(src[1] + offsets[src[0]], src[2])
        end = max(_inside_end(dst[1] + offsets[dst[0]], dst[2]), dst[1] + offsets[dst[0]])
        if end < start:  # clocks too far off to draw it forward in time: leave it out rather than lie
            counts["dropped"] += 1
            return
        by_rank[src[0]].append((round(start, 3), "s", next_id, src[3], cat, name))
        by_rank[dst[0]].append((round(end, 3), "f", next_id, dst[3], cat, name))
        counts[cat] += 1
        next_id += 1

    present = set(scan.present)
    for key, send in scan.sends.items():
        recv = scan.recvs.get(key)
        if recv is None:
            counts["unmatched_sends"] += key[2] in present  # a send to a missing rank is not a surprise
            continue
        if str(key[3]).startswith("ring "):  # context parallelism's exchange (scan.tracing.ring)
            pair(send, recv, "ring", str(key[3]))
        else:
            pair(send, recv, "p2p", f"p2p {key[3]}")
    counts["unmatched_recvs"] = sum(1 for key in scan.recvs if key not in scan.sends and key[1] in present)
    for (_group, _seq), members in scan.collectives.items():
        if len(members) < 2:
            continue
        last = max(members, key=lambda m: m[1] + offsets[m[0]])
        for member in members:
            if member is not last:
                pair(last, member, "collective", "collective wait")
    return by_rank, counts


def _open_output(path: Path) -> TextIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".gz"):
        return gzip.open(path, "wt", compresslevel=3)  # type: ignore[return-value]
    return open(path, "w")


def _sort_key(item: tuple[int, dict[str, Any]]) -> tuple[float, int, float, int]:
    """Time order per rank: at one timestamp, slices (``B``/``E`` in file order, so a zero-length pair stays
    paired; ``X`` parents before children) precede flows and instants, which then bind to them."""
    index, event = item
    ph, dur = event.get("ph", ""), event.get("dur", 0.0)
    if ph in ("B", "E"):
        return (event["ts"], 0, 0.0, index)
    if ph == "X":
        return (event["ts"], 0, -dur if isinstance(dur, (int, float)) else 0.0, index)
    return (event["ts"], 1, 0.0, index)


def aggregate(
    trace_dir: str | Path, output: str | Path, *, refine_clocks: bool = True, progress: bool = True
) -> dict[str, Any]:
    """Merge the rank files of ``trace_dir`` into ``output`` (``.json`` or ``.json.gz``) on rank 0's clock.

    Returns the summary also stored as the ``megascan.merged`` event and the file's ``metadata``: ranks present,
    missing and truncated, clock offsets (µs, per rank, ``None`` when missing), the residual clock skew before
    and after refinement, flow counts and the number of events written.
    """
    trace_dir, output = Path(trace_dir), Path(output)
    files = list_rank_files(trace_dir)
    if not files:
        raise FileNotFoundError(f"no MegaScan rank files (rank*-dp*-pp*-tp*.json[.gz]) in {trace_dir}")

    # Pass 1: metadata, clocks and cross-rank endpoints only.
    scan = _Scan(files=files)
    for rank in _progress(sorted(files), progress, "megascan scan "):
        _scan_rank(scan, rank, files[rank])
    if not scan.present:
        raise ValueError(f"none of the {len(files)} rank files in {trace_dir} could be read")
    sizes = [int(info["world_size"]) for info in scan.info.values() if info.get("world_size")]
    world = max(sizes + [max(files) + 1])
    missing = sorted(set(range(world)) - set(scan.present))
    if missing:
        _notify(f"{len(missing)} of {world} rank file(s) missing or unreadable: ranks {_compact(missing)}")

    # Clocks: records, then refinement by collective end times.
    offsets, uncertainty, no_clock = _clock_offsets(scan)
    instances = _instances(scan)
    before = _residuals(instances, offsets)
    rejected: list[int] = []
    refined = bool(refine_clocks and instances)
    if refined:
        reference = 0 if 0 in offsets else min(offsets)
        has_clock = {rank for rank in scan.present if rank in scan.clocks}
        offsets, rejected = _refine(before, offsets, uncertainty, has_clock, reference)
        if rejected:
            _notify(f"clock refinement rejected (beyond 3x uncertainty + 2 ms) for rank(s) {_compact(rejected)}")
    offsets = _share_clock_domains(scan, offsets, 0 if 0 in offsets else min(offsets))
    after = _residuals(instances, offsets)
    collective_instances = len(scan.collectives)
    flows, flow_counts = _flows(scan, offsets)
    skew = {"before": _skew(before), "after": _skew(after)}
    del before, after, instances  # pass 2 needs only the flows and offsets: free the endpoints first
    scan.sends.clear(), scan.recvs.clear(), scan.collectives.clear()
    markers = [
        {"name": f"step {step}", "cat": "iteration", "ph": "i", "s": "g", "pid": scan.anchor, "tid": 0}
        | {"ts": round(ts + offsets[scan.anchor], 3), "args": {"step": step}}
        for step, ts in sorted(scan.step_starts.items())
        if scan.anchor is not None
    ]
    summary: dict[str, Any] = {
        "world_size": world,
        "ranks_present": len(scan.present),
        "missing_ranks": missing,
        "truncated_ranks": sorted(scan.truncated),
        "ranks_without_spans": sorted(scan.empty),
        "clock_missing_ranks": no_clock,
        "refined": refined,
        "refinement_rejected_ranks": rejected,
        "offsets_us": [round(offsets[r], 3) if r in offsets else None for r in range(world)],
        "residual_skew_us": skew,
        "collective_instances": collective_instances,
        "flows": flow_counts,
        "iteration_markers": len(markers),
        "events_in": scan.events,
    }

    # Pass 2: one rank at a time, shifted, sorted, with its flows and markers.
    written = 0
    with _open_output(output) as sink:
        sink.write('{"traceEvents":[\n')
        first = True
        for rank in _progress(scan.present, progress, "megascan write"):
            offset = offsets[rank]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # already reported in pass 1
                events = list(read_rank_file(files[rank]))
            head, timed = [], []
            for event in events:
                if "ts" in event and event.get("ph") != "M":
                    try:
                        event["ts"] = round(float(event["ts"]) + offset, 3)
                    except (TypeError, ValueError):  # not a time: the event cannot be placed
                        continue
                    timed.append(event)
                else:
                    head.append(event)
            timed += [_flow_event(rank, end) for end in flows.pop(rank, ())]
            if rank == scan.anchor:
                timed += markers
            ordered = [event for _, event in sorted(enumerate(timed), key=_sort_key)]
            for event in head + ordered:
                try:
                    line = json.dumps(event, separators=(",", ":"), allow_nan=False)
                except ValueError:  # NaN / inf timestamps are not JSON: drop the event, keep the file valid
                    continue
                sink.write(line if first else ",\n" + line)
                first = False
                written += 1
        anchor = scan.anchor if scan.anchor is not None else scan.present[0]
        summary["events_out"] = written + 1
        merged = {"name": "megascan.merged", "ph": "M", "pid": anchor, "tid": 0, "args": summary}
        sink.write(("" if first else ",\n") + json.dumps(merged, separators=(",", ":")))
        sink.write('\n],\n"displayTimeUnit":"ms",\n"metadata":' + json.dumps({"megascan": summary}) + "}\n")
    return summary


def _run(args: argparse.Namespace) -> int:
    output = args.output if args.output is not None else args.trace_dir / "merged.json.gz"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            summary = aggregate(args.trace_dir, output, refine_clocks=not args.no_refine, progress=not args.quiet)
        except (FileNotFoundError, ValueError) as err:
            summary, failure = None, err
    # after the progress bars, each on its own line, once, before the result they qualify
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"lightning-megatron scan aggregate: warning: {message}", file=sys.stderr)
    if summary is None:
        print(f"lightning-megatron scan aggregate: error: {failure}", file=sys.stderr)
        return 2
    print(
        f"{output}: {summary['ranks_present']}/{summary['world_size']} ranks, {summary['events_out']} events, "
        f"{summary['flows']['p2p']} p2p + "
        + (f"{summary['flows']['ring']} ring + " if summary["flows"]["ring"] else "")
        + f"{summary['flows']['collective']} collective flows; "
        + _skew_text(summary["residual_skew_us"])
    )
    return 0


def _skew_text(skew: dict[str, dict[str, Any]]) -> str:
    """The residual clock skew line; without matched flows between ranks there is nothing to measure it on."""
    before, after = skew["before"].get("p95"), skew["after"].get("p95")
    if before is None and after is None:
        return "residual clock skew not measured (no matched p2p or collective between ranks)"
    return f"residual clock skew p95 {_or_na(before)} → {_or_na(after)} µs"


def _or_na(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value}"


def register_cli(subparsers: Any) -> None:
    """Add ``aggregate TRACE_DIR -o OUTPUT [--no-refine] [--quiet]`` to the ``scan`` command's subparsers."""
    parser = subparsers.add_parser(
        "aggregate",
        help="merge per-rank trace files into one clock-aligned Chrome trace",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("trace_dir", type=Path, help="directory of rank*-dp*-pp*-tp*.json[.gz] files")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="merged trace, .json or .json.gz (default TRACE_DIR/merged.json.gz)",
    )
    parser.add_argument("--no-refine", action="store_true", help="use the clock records only, no collective refinement")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=_run)
