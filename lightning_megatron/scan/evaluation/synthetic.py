"""Synthetic MegaScan traces with known ground truth: what the offline tools are tested and benchmarked on.

A real multi-node trace cannot say which rank *was* slow, which link *was* degraded or how far each clock
*really* was from rank 0's; a simulated one can. ``generate_traces`` simulates a megatron-core job (tensor,
pipeline and data parallelism, 1F1B pipeline schedule) in true time, then writes what every rank would have
recorded on its own skewed clock, in exactly the format of ``lightning_megatron.scan.analysis.format``.

The simulation, per step:

* every rank waits for data (``data-wait``; ``slow_data`` multiplies it), then runs its stage's 1F1B schedule:
  warm-up forwards, steady one-forward-one-backward, cool-down backwards (backward ≈ 2× forward);
* every forward / backward holds two tensor-parallel ``all_reduce`` collectives over its TP group: each member's
  span starts at its own arrival and ends when the last member has arrived plus the transfer time, so the peers
  of a slow rank show long collectives and the slow rank itself arrives last with a short one;
* activations / gradients travel between adjacent stages as p2p sends and recvs (lane ``tp`` of stage ``pp``
  talks to lane ``tp`` of the next stage). Sends are eager (``isend`` semantics): the send span lasts the
  transfer time, ``bytes / bandwidth × slow_links[(src, dst)]``, and the recv span ends when the data has
  arrived (or right away if it already had);
* after the last backward each rank all-reduces its gradients over its DP group (``grad-sync`` span and the
  ``collective`` inside it), then runs ``optimizer-step``; a ``step N`` span covers the whole step.

A slow rank's compute (forward, backward, optimizer) is ``slow_ranks[rank]`` times longer: in every span by
default; in a random ``slow_fraction`` of its compute spans (partial: contention that hits some kernels); or
only in a random ``slow_step_fraction`` of the steps (bursty: another job that comes and goes). Rank layout is
megatron-core's default order ``tp-cp-ep-dp-pp``: ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``.

With ``gpu_busy`` every compute half runs as four kernels that fill 97 % of it (launch gaps), and each tensor-parallel
all-reduce as an NCCL kernel; a slow rank's kernels are longer, while ``host_paced`` and ``idle_gaps`` stretch
the *gaps* between kernels (the GPU idles, its kernels take as long as ever). Each step is one window: its
kernels go, with the two anchor kernels, onto a profiler clock of their own (offset and 20 ppm fast) and through
``scan.tracing.busy.busy_timeline``, the function the GPU recorder uses, which writes ``busy_us`` on the compute and
layer spans.

    python -m lightning_megatron.scan.evaluation.synthetic /tmp/trace --dp 64 --pp 4 --tp 4 --slow-rank 37:1.5
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from pathlib import Path
from typing import Any, Optional

from lightning_megatron.scan.analysis.format import TID, clock_metadata, rank_file_name, rank_metadata
from lightning_megatron.scan.tracing.busy import ANCHOR_NAME, Activity, busy_timeline

__all__ = ["generate_traces", "rank_of", "coords_of", "main"]

# Bandwidths in bytes per microsecond (1 GB/s = 1000 bytes/µs) and message sizes in bytes: plausible numbers for a
# GPT with hidden size 2048, sequence 2048, micro-batch 1, bf16, so the waits have realistic proportions.
TP_BANDWIDTH = 200_000.0  # NVLink
P2P_BANDWIDTH = 50_000.0  # between pipeline stages
DP_BANDWIDTH = 25_000.0  # across nodes
ACTIVATION_BYTES = 8 * 1024 * 1024
GRAD_BYTES = 64 * 1024 * 1024
DATA_WAIT_US = 200.0
OPTIMIZER_FACTOR = 0.75  # optimizer step, relative to one forward
RECV_OVERHEAD_US = 5.0  # a recv whose data is already there still takes a moment
STEP_GAP_US = 50.0
END_NOISE_US = 1.0  # members of one collective see its end within this much of each other
START_US = 1_000_000.0  # true time of the first step; keeps every local clock positive
DEFAULT_MAX_OFFSET_US = 50_000.0
KERNELS_PER_HALF = 4  # gpu_busy: kernels per compute half (forward or backward halves: attention, MLP)
KERNEL_FILL = 0.97  # ... and the fraction of the half they fill on a healthy rank (the rest: launch gaps)
PROFILER_DRIFT = 20e-6  # the simulated profiler clock runs this much fast against the CUDA events' clock


def rank_of(dp_rank: int, pp_rank: int, tp_rank: int, dp: int, tp: int) -> int:
    """Global rank of a (dp, pp, tp) coordinate in megatron-core's default ``tp-cp-ep-dp-pp`` order."""
    return tp_rank + tp * (dp_rank + dp * pp_rank)


def coords_of(rank: int, dp: int, tp: int) -> tuple[int, int, int]:
    """``(dp_rank, pp_rank, tp_rank)`` of a global rank; the inverse of ``rank_of``."""
    return (rank // tp) % dp, rank // (tp * dp), rank % tp


def _schedule(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """The 1F1B op list of one pipeline stage: (op, microbatch) with ops F, B and p2p RF, SF, RB, SB."""
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, microbatches)
    ops: list[tuple[str, int]] = []

    def forward(mb: int) -> None:
        ops.extend(([] if first else [("RF", mb)]) + [("F", mb)] + ([] if last else [("SF", mb)]))

    def backward(mb: int) -> None:
        ops.extend(([] if last else [("RB", mb)]) + [("B", mb)] + ([] if first else [("SB", mb)]))

    for mb in range(warmup):
        forward(mb)
    for j in range(microbatches - warmup):
        forward(warmup + j)
        backward(j)
    for j in range(microbatches - warmup, microbatches):
        backward(j)
    return ops


class _Simulation:
    """The job in true time; per-rank event lines in local time, formatted cheaply (1024 ranks must take seconds)."""

    def __init__(
        self,
        world: int,
        offsets: dict[int, float],
        compute: list[float],
        slow_links: dict[tuple[int, int], float],
        rng: random.Random,
        jitter: float,
        forward_us: float,
    ) -> None:
        self.lines: list[list[str]] = [[] for _ in range(world)]
        self.offsets, self.slow, self.slow_links = offsets, compute, slow_links
        self.compute = list(compute)  # this step's factors (``begin_step``)
        self.rng, self.jitter, self.forward_us = rng, jitter, forward_us
        self.slow_fraction = 1.0
        self.layers_per_stage = 0
        self.slow_part: Optional[tuple[str, str]] = None  # (direction, part) that carries a slow rank's excess
        self.queue: Optional[dict[int, bool]] = None  # GPU queue fields per rank: True = host-paced
        self.sleeping_hosts: set[int] = set()  # idle_gaps: hosts that launch late inside spans (GPU still behind)
        self.queue_rng = random.Random(4099)  # its own stream: the other draws stay those of traces without it
        self.now: list[float] = [START_US] * world  # true time at which each rank is free
        self.idle: Optional[list[float]] = None  # gpu_busy: per rank, the part of its slowdown that is idle GPU time
        self.kernels: dict[tuple[int, int], list[tuple[str, float, float]]] = {}  # (rank, step): true times
        self.pending: list[tuple[int, int, int, tuple[Any, ...]]] = []  # spans awaiting busy_us: rank, line, step
        self.windows: dict[tuple[int, int], tuple[float, float]] = {}  # (rank, step): the step's true start, end
        self.group_seq: dict[tuple[int, ...], int] = {}
        self.counts = {"p2p_pairs": 0, "collectives": 0, "collective_flows": 0}

    def x(self, rank: int, name: str, cat: str, tid: int, start: float, end: float, args: dict[str, Any]) -> None:
        if self.idle is not None and cat in ("compute", "compute.layer"):  # busy_us comes after the step
            step = int(args["step"])
            self.pending.append((rank, len(self.lines[rank]), step, (name, cat, tid, start, end, args)))
            self.lines[rank].append("")
            return
        self.lines[rank].append(self.line(rank, name, cat, tid, start, end, args))

    def line(self, rank: int, name: str, cat: str, tid: int, start: float, end: float, args: dict[str, Any]) -> str:
        ts = start - self.offsets[rank]  # true time → the rank's own clock
        return (
            f'{{"name":"{name}","cat":"{cat}","ph":"X","pid":{rank},"tid":{tid},"ts":{ts:.3f},'
            f'"dur":{max(end - start, 0.0):.3f},"args":{json.dumps(args, separators=(",", ":"))}}}'
        )

    def run_kernels(self, rank: int, step: int, start: float, end: float, factor: float) -> None:
        """``gpu_busy``: the kernels of one compute half from ``start`` to ``end`` (true time), whose slowdown
        ``factor`` is partly idle time (``self.idle``): longer gaps between the kernels, not longer kernels."""
        if self.idle is None:
            return
        idle = self.idle[rank] if factor != 1.0 else 1.0
        slot = (end - start) / KERNELS_PER_HALF
        kernel = slot * KERNEL_FILL / idle
        kernels = self.kernels.setdefault((rank, step), [])
        for i in range(KERNELS_PER_HALF):
            kernels.append(("sm90_xmma_gemm_bf16bf16_bf16f32", start + i * slot, start + i * slot + kernel))

    def busy_lines(self) -> None:
        """Write the spans held for ``busy_us``: each (rank, step) window's kernels, with the two anchors, on a
        profiler clock of its own, through ``scan.tracing.busy.busy_timeline`` (the GPU recorder's path)."""
        timelines = {}
        for (rank, step), (ref, end) in self.windows.items():

            def ns(t: float, ref: float = ref, rank: int = rank) -> int:
                return 10**15 + rank * 10**9 + round((t - ref) * 1000.0 * (1.0 + PROFILER_DRIFT))

            records = [Activity(ANCHOR_NAME, ns(ref - 1.0), ns(ref)), Activity(ANCHOR_NAME, ns(end), ns(end + 1.0))]
            records += [Activity(name, ns(a), ns(b)) for name, a, b in self.kernels.get((rank, step), [])]
            timeline, why = busy_timeline(records, end - ref)
            if timeline is None:
                raise RuntimeError(f"synthetic busy time of rank {rank}, step {step}: {why}")
            timelines[(rank, step)] = (timeline, ref)
        for rank, index, step, (name, cat, tid, start, end, args) in self.pending:
            timeline, ref = timelines[(rank, step)]
            args = {**args, "busy_us": round(timeline.busy(start - ref, end - ref), 1)}
            self.lines[rank][index] = self.line(rank, name, cat, tid, start, end, args)

    def begin_step(self, slow_now: bool) -> None:
        """The slow ranks' factors in this step: all of them, or none (a bursty fault's quiet step)."""
        self.compute = list(self.slow) if slow_now else [1.0] * len(self.slow)

    def factor(self, rank: int) -> float:
        """The compute factor of one span of ``rank``: its slowdown, or with ``slow_fraction`` < 1 only sometimes."""
        factor = self.compute[rank]
        if factor != 1.0 and self.slow_fraction < 1.0 and self.rng.random() >= self.slow_fraction:
            return 1.0
        return factor

    def queue_args(self, rank: int, args: dict[str, Any], duration: float) -> dict[str, Any]:
        """With ``gpu_queue``: what the GPU recorder adds. A host-paced rank's GPU reaches each span as soon as it
        is queued and the host takes the span's whole length to queue it; a GPU-bound one runs behind a queue
        of a few milliseconds, queued in a fraction of the time."""
        if self.queue is None:
            return args
        rng = self.queue_rng
        if self.queue[rank]:
            return {**args, "queued_us": round(rng.uniform(0.0, 10.0), 1), "enqueue_us": round(duration * 0.97, 1)}
        # a host that sleeps between launches inside the span (idle gaps) takes about the span to queue it
        share = 0.9 if rank in self.sleeping_hosts else 0.2
        return {**args, "queued_us": round(rng.uniform(500.0, 3000.0), 1), "enqueue_us": round(duration * share, 1)}

    def layer_spans(
        self, rank: int, stage: int, direction: str, start: float, end: float, step: int, factor: float = 1.0
    ) -> None:
        """``layers_per_stage`` > 0: the span's time in attention and MLP parts of the stage's layers (in
        backward order for a backward), as ``granularity="layer"`` writes them: equal parts, or with
        ``slow_part`` and a span slowed by ``factor`` all of its excess in that part."""
        count = self.layers_per_stage
        if not count:
            return
        numbers = range(stage * count + 1, (stage + 1) * count + 1)
        parts = [(n, p) for n in numbers for p in ("attention", "mlp")]
        if direction == "backward":
            parts.reverse()
        weights = [1.0] * len(parts)
        if self.slow_part is not None and self.slow_part[0] == direction and factor != 1.0:
            slow = [i for i, (_, p) in enumerate(parts) if p == self.slow_part[1]]
            for i in slow:  # the parts' base time is span / factor; the excess goes to the slow parts alone
                weights[i] += (factor - 1.0) * len(parts) / len(slow)
        t0 = start
        for (number, part), weight in zip(parts, weights):
            args = {"step": step, "layer": number, "part": part, "direction": direction}
            t1 = t0 + (end - start) * weight / sum(weights)
            args = self.queue_args(rank, args, t1 - t0)  # a host-paced rank's layer spans are host-paced too
            self.x(rank, f"layer {number} {part}", "compute.layer", TID["compute"], t0, t1, args)
            t0 = t1

    def jit(self, duration: float) -> float:
        return duration * max(0.5, 1.0 + self.jitter * self.rng.gauss(0.0, 1.0)) if self.jitter else duration

    def collective(
        self, members: list[int], arrivals: list[float], nbytes: int, transfer: float, group_name: str, step: int
    ) -> list[float]:
        """Every member waits for the last one; writes each member's span and returns its end (true time)."""
        group = tuple(sorted(members))
        seq = self.group_seq.get(group, 0)
        self.group_seq[group] = seq + 1
        self.counts["collectives"] += 1
        self.counts["collective_flows"] += len(members) - 1
        done = max(arrivals) + transfer
        args = {"step": step, "group": list(group), "group_name": group_name, "seq": seq, "bytes": nbytes}
        args["async"] = False
        ends = []
        for rank, arrival in zip(members, arrivals):
            end = done + self.rng.random() * END_NOISE_US
            self.x(rank, "all_reduce", "collective", TID["communication"], arrival, end, args)
            ends.append(end)
        return ends

    def pipeline(self, step: int, lanes: list[list[int]], schedules: list[list[tuple[str, int]]]) -> None:
        """One DP replica's pipeline for one step (``lanes[stage][tp_rank]`` = rank): each stage advances through
        its 1F1B ops until a recv's data has not been sent yet; sweeps repeat until every stage is done (1F1B with
        eager sends cannot deadlock)."""
        pp, tp, now = len(lanes), len(lanes[0]), self.now
        tp_transfer = 2.0 * (tp - 1) / tp * ACTIVATION_BYTES / TP_BANDWIDTH
        sent: dict[tuple[str, int, int, int], float] = {}  # (direction, src stage, lane, mb) → arrival (true time)
        pointer = [0] * pp
        while any(pointer[s] < len(schedules[s]) for s in range(pp)):
            progressed = False
            for s in range(pp):
                ops = schedules[s]
                while pointer[s] < len(ops):
                    op, mb = ops[pointer[s]]
                    if op in ("RF", "RB"):
                        direction, src = ("forward", s - 1) if op == "RF" else ("backward", s + 1)
                        if (direction, src, 0, mb) not in sent:
                            break
                        for t, rank in enumerate(lanes[s]):
                            end = max(now[rank], sent[(direction, src, t, mb)]) + RECV_OVERHEAD_US
                            recv = {"peer": lanes[src][t], "bytes": ACTIVATION_BYTES, "seq": mb, "direction": direction}
                            args = {"step": step, "recvs": [recv]}
                            self.x(rank, f"{direction}-recv", "p2p", TID["communication"], now[rank], end, args)
                            now[rank] = end
                            self.counts["p2p_pairs"] += 1
                    elif op in ("SF", "SB"):
                        direction, dst = ("forward", s + 1) if op == "SF" else ("backward", s - 1)
                        for t, rank in enumerate(lanes[s]):
                            peer = lanes[dst][t]
                            transfer = self.jit(ACTIVATION_BYTES / P2P_BANDWIDTH) * self.slow_links.get(
                                (rank, peer), 1.0
                            )
                            send = {"peer": peer, "bytes": ACTIVATION_BYTES, "seq": mb, "direction": direction}
                            args = {"step": step, "sends": [send]}
                            self.x(
                                rank,
                                f"{direction}-send",
                                "p2p",
                                TID["communication"],
                                now[rank],
                                now[rank] + transfer,
                                args,
                            )
                            now[rank] += transfer
                            sent[(direction, s, t, mb)] = now[rank]
                    else:  # F or B: two halves of compute, each closed by a TP all_reduce (as attention and MLP are)
                        base = self.forward_us * (1.0 if op == "F" else 2.0)
                        starts = [now[r] for r in lanes[s]]
                        name = "forward" if op == "F" else "backward"
                        hit = self.slow_part is None or self.slow_part[0] == name
                        # a partial slowdown hits whole spans; a slow part only spans of its direction
                        factors = [self.factor(r) if hit else 1.0 for r in lanes[s]]
                        for _half in range(2):
                            arrivals = [now[r] + self.jit(base / 2.0) * f for r, f in zip(lanes[s], factors)]
                            for r, f, arrival in zip(lanes[s], factors, arrivals):
                                self.run_kernels(r, step, now[r], arrival, f)
                            if tp > 1:
                                computed = arrivals
                                arrivals = self.collective(
                                    lanes[s], arrivals, ACTIVATION_BYTES, tp_transfer, "tp", step
                                )
                                for r, a, b in zip(lanes[s], computed, arrivals):  # NCCL spins while it waits
                                    if self.idle is not None:
                                        nccl = ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", a, b)
                                        self.kernels.setdefault((r, step), []).append(nccl)
                            for r, end in zip(lanes[s], arrivals):
                                now[r] = end
                        args = {"step": step, "microbatch": mb, "chunk": 0}
                        for r, start in zip(lanes[s], starts):
                            self.x(
                                r,
                                name,
                                "compute",
                                TID["compute"],
                                start,
                                now[r],
                                self.queue_args(r, args, now[r] - start),
                            )
                        for r, start, f in zip(lanes[s], starts, factors):
                            self.layer_spans(r, s, name, start, now[r], step, f)
                    pointer[s] += 1
                    progressed = True
            if not progressed:
                raise RuntimeError(f"synthetic pipeline deadlocked at {pointer}")


def generate_traces(
    out_dir: str | Path,
    *,
    dp: int = 2,
    pp: int = 2,
    tp: int = 2,
    steps: int = 2,
    microbatches: int = 4,
    slow_ranks: Optional[dict[int, float]] = None,
    slow_links: Optional[dict[tuple[int, int], float]] = None,
    slow_data: Optional[dict[int, float]] = None,
    slow_host: Optional[dict[int, float]] = None,
    host_paced: Optional[dict[int, float]] = None,
    idle_gaps: Optional[dict[int, float]] = None,
    gpu_queue: bool = False,
    gpu_busy: bool = False,
    slow_fraction: float = 1.0,
    slow_step_fraction: float = 1.0,
    slow_from_step: int = 0,
    slow_part: Optional[str] = None,
    layers_per_stage: int = 0,
    clock_offsets_us: Optional[dict[int, float]] = None,
    seed: int = 0,
    gzipped: bool = False,
    jitter: float = 0.02,
    forward_us: float = 2000.0,
    host: str = "node0",
    truncate_ranks: tuple[int, ...] = (),
    missing_ranks: tuple[int, ...] = (),
) -> dict[str, Any]:
    """Simulate a dp × pp × tp job for ``steps`` steps and write one rank file per rank into ``out_dir``.

    ``slow_ranks`` {rank: compute factor} (``slow_fraction``: of the compute spans hit, at random;
    ``slow_step_fraction``: of the steps hit, at random; ``slow_from_step``: none before it; ``slow_part``, e.g.
    ``"backward mlp"``: only spans of that direction are slower, and with layer spans all of the excess is in
    that layer part, as another process time-slicing the GPU does), ``slow_links`` {(src, dst): p2p
    transfer factor},
    ``layers_per_stage`` > 0 adds layer spans (``granularity="layer"``); ``gpu_queue`` writes the GPU
    recorder's ``enqueue_us``/``queued_us`` on compute spans (a GPU running behind a full queue), and
    ``host_paced`` {rank: factor} makes a rank's compute that much longer *because its host is slow*: its GPU
    reaches each span as soon as it is queued (``queued_us`` near 0); ``idle_gaps`` {rank: factor} makes it that
    much longer through gaps between its kernels while its GPU still runs behind a queue at each span's start
    (a host that sleeps between launches inside the spans: the queue fields alone cannot tell); ``gpu_busy`` writes
    ``busy_us`` (module docstring);
    ``slow_data`` {rank: data-wait factor}, ``slow_host`` {rank: factor of the host's gap between steps} (both
    from ``slow_from_step`` on); ``clock_offsets_us`` {rank: offset} sets clocks (local = true − offset; ranks not
    given get 0); by default every rank but 0 gets a random offset within ±50 ms. ``truncate_ranks`` are cut in
    the middle of a line (as by a crash); ``missing_ranks`` are not written at all.

    Returns the ground truth: ``world_size``, ``dp``/``pp``/``tp``, ``ranks`` {rank: {dp, pp, tp}}, the slow
    things as given, ``clock_offsets_us`` {rank: what ``rank0_time - local_time`` really is},
    ``clock_uncertainty_us``, ``files``, and counts the aggregator must reproduce: ``p2p_pairs`` (matched
    send/recv pairs), ``collectives`` (instances) and ``collective_flows`` (Σ members − 1).
    """
    if min(dp, pp, tp, steps, microbatches) < 1:
        raise ValueError("dp, pp, tp, steps and microbatches must all be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    world = dp * pp * tp
    rng = random.Random(seed)
    slow_ranks, slow_links, slow_data = dict(slow_ranks or {}), dict(slow_links or {}), dict(slow_data or {})
    slow_host = dict(slow_host or {})
    host_rng = random.Random(seed + 7919)  # its own stream: the other draws stay those of traces without host gaps
    if clock_offsets_us is None:
        raw = {r: (0.0 if r == 0 else rng.uniform(-DEFAULT_MAX_OFFSET_US, DEFAULT_MAX_OFFSET_US)) for r in range(world)}
    else:
        raw = {r: float(clock_offsets_us.get(r, 0.0)) for r in range(world)}
    # local = true - raw[r]; rank 0's clock is the reference, so the offset a rank should report is relative to it.
    truth_offsets = {r: raw[r] - raw[0] for r in range(world)}
    uncertainty = {r: (0.0 if r == 0 else rng.uniform(20.0, 80.0)) for r in range(world)}
    host_paced, idle_gaps = dict(host_paced or {}), dict(idle_gaps or {})
    idle = [host_paced.get(r, 1.0) * idle_gaps.get(r, 1.0) for r in range(world)]
    factors = [slow_ranks.get(r, 1.0) * idle[r] for r in range(world)]
    sim = _Simulation(world, raw, factors, slow_links, rng, jitter, forward_us)
    if gpu_queue or host_paced:
        sim.queue = {r: r in host_paced for r in range(world)}
        sim.sleeping_hosts = set(idle_gaps)
    if gpu_busy:
        sim.idle = idle
    sim.slow_fraction, sim.layers_per_stage = slow_fraction, layers_per_stage
    if slow_part is not None:
        direction, _, part = slow_part.partition(" ")
        if direction not in ("forward", "backward") or part not in ("attention", "mlp"):
            raise ValueError(f"slow_part={slow_part!r}: expected '<forward|backward> <attention|mlp>'")
        sim.slow_part = (direction, part)
    now = sim.now
    dp_transfer = 2.0 * (dp - 1) / dp * GRAD_BYTES / DP_BANDWIDTH
    schedules = [_schedule(s, pp, microbatches) for s in range(pp)]
    lanes = [[[rank_of(d, s, t, dp, tp) for t in range(tp)] for s in range(pp)] for d in range(dp)]

    for step in range(steps):
        if slow_step_fraction < 1.0 or slow_from_step > 0:
            sim.begin_step(step >= slow_from_step and (slow_step_fraction >= 1.0 or rng.random() < slow_step_fraction))
        for rank in range(world):  # the host's work between two steps (Lightning's hooks, logging)
            if step > 0:
                gap = STEP_GAP_US * max(0.5, 1.0 + jitter * host_rng.gauss(0.0, 1.0))
                gap_end = now[rank] + gap * (slow_host.get(rank, 1.0) if step >= slow_from_step else 1.0)
                sim.x(rank, "host-gap", "host", TID["host"], now[rank], gap_end, {"step": step})
                now[rank] = gap_end
        step_start = list(now)
        for rank in range(world):
            end = now[rank] + sim.jit(DATA_WAIT_US) * (slow_data.get(rank, 1.0) if step >= slow_from_step else 1.0)
            sim.x(rank, "data-wait", "data", TID["host"], now[rank], end, {"step": step})
            now[rank] = end
        for d in range(dp):
            sim.pipeline(step, lanes[d], schedules)
        for s in range(pp):  # gradient all-reduce over each DP group, then the optimizer
            for t in range(tp):
                members = [lanes[d][s][t] for d in range(dp)]
                arrivals = [now[r] for r in members]
                if dp > 1:
                    ends = sim.collective(members, arrivals, GRAD_BYTES, dp_transfer, "dp", step)
                else:
                    ends = [a + 10.0 for a in arrivals]
                for rank, arrival, end in zip(members, arrivals, ends):
                    sim.x(rank, "grad-sync", "grad_sync", TID["host"], arrival, end, {"step": step})
                    opt_end = end + sim.jit(OPTIMIZER_FACTOR * forward_us) * sim.factor(rank)
                    sim.x(rank, "optimizer-step", "optimizer", TID["host"], end, opt_end, {"step": step})
                    sim.x(rank, f"step {step}", "step", TID["steps"], step_start[rank], opt_end, {"step": step})
                    sim.windows[(rank, step)] = (step_start[rank], opt_end)
                    now[rank] = opt_end
    if gpu_busy:
        sim.busy_lines()

    # Files: metadata and clock records first (written at fit start by the real callback), then the events.
    files: dict[int, str] = {}
    missing, truncated = set(missing_ranks), set(truncate_ranks)
    for rank in range(world):
        if rank in missing:
            continue
        d, s, t = coords_of(rank, dp, tp)
        info = {
            "world_size": world,
            "dp": d,
            "pp": s,
            "tp": t,
            "host": host,
            "device": "synthetic",
            "backend": "synthetic",
            "granularity": "layer" if layers_per_stage else "stage",
            "pipeline_size": pp,
            "tensor_size": tp,
            "data_parallel_size": dp,
            "virtual_pipeline_size": None,
            "schedule": "1f1b",
            "start_step": 0,
        }
        head = [json.dumps(e) for e in rank_metadata(rank, info)]
        local_start = START_US - raw[rank]
        for i in range(3):
            noisy = truth_offsets[rank] + (rng.gauss(0.0, uncertainty[rank] / 3.0) if rank else 0.0)
            record = clock_metadata(rank, noisy, uncertainty[rank], local_start + i * 1000.0, 8 if rank else 0)
            head.append(json.dumps(record))
        text = "[\n" + "".join(line + ",\n" for line in head + sim.lines[rank])
        path = out / rank_file_name(rank, d, s, t, gzipped)
        data = text.encode()
        if gzipped:
            data = gzip.compress(data, compresslevel=1)
        if rank in truncated:
            cut = int(len(data) * 0.6)
            if not gzipped:
                while cut < len(data) - 2 and data[cut - 1 : cut] in (b"\n", b","):
                    cut += 3  # land inside a line, not between two
            data = data[:cut]
        path.write_bytes(data)
        files[rank] = str(path)

    return {
        "world_size": world,
        "dp": dp,
        "pp": pp,
        "tp": tp,
        "steps": steps,
        "microbatches": microbatches,
        "ranks": {r: dict(zip(("dp", "pp", "tp"), coords_of(r, dp, tp))) for r in range(world)},
        "slow_ranks": slow_ranks,
        "slow_host": slow_host,
        "slow_fraction": slow_fraction,
        "slow_step_fraction": slow_step_fraction,
        "slow_part": slow_part,
        "slow_links": slow_links,
        "slow_data": slow_data,
        "idle_gaps": idle_gaps,
        "clock_offsets_us": truth_offsets,
        "clock_uncertainty_us": uncertainty,
        "missing_ranks": sorted(missing),
        "truncated_ranks": sorted(truncated),
        "files": files,
        "events": sum(len(lines) for lines in sim.lines),
        **sim.counts,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_megatron.scan.evaluation.synthetic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out_dir")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--slow-rank", action="append", default=[], metavar="RANK:FACTOR")
    parser.add_argument("--slow-link", action="append", default=[], metavar="SRC:DST:FACTOR")
    parser.add_argument("--slow-data", action="append", default=[], metavar="RANK:FACTOR")
    parser.add_argument("--truncate", type=int, action="append", default=[], metavar="RANK")
    parser.add_argument("--missing", type=int, action="append", default=[], metavar="RANK")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jitter", type=float, default=0.02)
    parser.add_argument("--forward-us", type=float, default=2000.0)
    parser.add_argument("--gzip", action="store_true")
    args = parser.parse_args(argv)

    def pairs(items: list[str]) -> dict[int, float]:
        return {int(k): float(v) for k, v in (item.split(":") for item in items)}

    links = {(int(a), int(b)): float(f) for a, b, f in (item.split(":") for item in args.slow_link)}
    truth = generate_traces(
        args.out_dir,
        dp=args.dp,
        pp=args.pp,
        tp=args.tp,
        steps=args.steps,
        microbatches=args.microbatches,
        slow_ranks=pairs(args.slow_rank),
        slow_links=links,
        slow_data=pairs(args.slow_data),
        seed=args.seed,
        gzipped=args.gzip,
        jitter=args.jitter,
        forward_us=args.forward_us,
        truncate_ranks=tuple(args.truncate),
        missing_ranks=tuple(args.missing),
    )
    summary = {k: truth[k] for k in ("world_size", "events", "p2p_pairs", "collectives", "missing_ranks")}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
