"""``lightning-megatron scan detect``: find the ranks that slow a run down, from MegaScan traces alone.

The contract: a trace directory in, a ``DetectionReport`` out. This module reads the rank files
(``scan.analysis.measure``), builds the ``DetectionContext`` every rule reads (``scan.analysis.rules_common``),
runs the rules in their declared order (``scan.analysis.rules.RULES``: compute in ``compute_rules`` and
``stage_rules``, their attribution in ``attribution``, links in ``link_rules``, waits in ``wait_rules`` and
``cpu_rules``) and holds the CLI; ``scan.analysis.compare`` compares a member with its peers statistically, and
``scan.analysis.report`` holds (and prints, serialises, logs) the result.

In synchronous training one slow GPU, one slow link or one slow data loader delays every rank: the others wait
for it inside collectives and pipeline sends/receives, so their *step* times are all equally long and say
nothing about who is to blame. Detection therefore compares only the time a rank spends on its *own* work with
the time its peers spend on the *same* work, after taking the waiting out:

* **compute**: net compute per op (per layer part when a trace has no per-microbatch spans), compared with the
  ranks of the same pipeline stage (all data- and tensor-parallel ranks with the same ``pp``), which run the
  same layers on equally sized microbatches;
* **links**: per ordered link the median transfer time per byte, compared with the links of the same class
  (direction, and whether both ends share a host: NVLink and network links are not peers). A span holding
  several ops (``send-forward-recv-backward``) can only stretch a transfer (a delayed send to Q also delays the
  receive from Q in it), so where every link of a class has enough transfers with both ends alone in their
  spans, only those are compared; a transfer whose span its host paced (posted late by a slow host) is left
  out. The sender is named, its receiver is ``peer``;
* **compute, per step**: the same net compute summed per step (steps with identical work: the same number of
  spans), each rank against each peer with Wilcoxon's signed-rank test over the steps (``compare``), then the
  10 %-trimmed mean excess over the healthy peers. Per-op medians cannot see a slowdown that hits fewer than
  about half of the spans (bursty contention: 40 % of the spans 50 % longer is 20 % per step); per-step sums
  do, and the paired rank test ignores a one-off burst. A rank is named when it is slower than at least half
  of its peers (p < 0.01 over its peers, Bonferroni) by ``min_slowdown`` and ``min_impact``;
  ``evidence["peers_wait_ms"]`` says how much longer its peers waited in collectives and gradient sync per
  step (who waited for whom, without clocks);
* **compute across stages** (``scan.analysis.stage_rules``): where a stage has a single rank (pipeline
  parallelism alone) and the trace has layer spans (``granularity="layer"``), transformer layer parts (attention, MLP,
  forward and backward) are the same work on every stage: those ranks are compared on them, per part and per step (a
  typical layer), on the spans their GPU paced;
* **compute against itself**: a rank's later steps against its own earlier ones (every split that leaves 8 steps
  on each side; a rank-sum and an exceedance test, family-wise by permutation), for what no peer can show: a
  lone stage without layer spans, one process alone, or every rank at once;
* **data**: the time in ``data`` spans per step compared with the ranks of the same pipeline stage: the
  loader's own fetches (``data-fetch``; traces before it recorded the whole host gap between steps as
  ``data-wait``, which also held Lightning's per-step work and named host slowness "data"); and, as compute,
  each rank against its own earlier steps (a loader that turned slow during the run; one process has no peer);
* **busy, not idle**: where GPU traces carry busy time (``busy_us``, ``scan.tracing.busy``), a compute suspect stays
  ``compute`` only if its kernel time grew too (``attribution.attribute_busy``); an excess of idle GPU time is
  ``host`` where its host queued the work slower, and otherwise dropped with a note;
* **host inside steps**: on GPUs without busy time, a compute suspect whose GPU reached most spans as soon as the
  host queued them (``queued_us``, ``scan.tracing.recorder``) is named ``host``: the host paced it, the GPU waited;
* **host**: the same rule on the host's gaps between steps (``host-gap``: Lightning's per-step work, logging,
  callbacks), less the fetches and the waits at Lightning's per-batch synchronisation of the ranks
  (``step-sync``): a rank whose host is slow (CPU contention) ends them late, or keeps the others waiting at
  that synchronisation (a stall before it ends every rank's gap together: only the waits say who was late,
  clock-free); and against its own earlier steps;
* **host inside steps**: the time a rank's GPU waited for its host between the step's traced spans (a callback
  that blocks before the step ends), by the same two rules, where it costs ``min_slowdown`` of a step; a stall
  before a collective inside the step (the optimizer's all-reduce) ends every peer's step together, so there the
  peers' longer waits inside the step say who was late (``waits.waited_for``, clock-free);
* **host across stages** (``scan.analysis.stage_rules``): ranks alone in their stage compare both kinds of host
  wait with the other lone stages, where the excess costs ``min_slowdown`` of a step;
* **waits for a CPU** (``scan.analysis.cpu_rules``): a rank whose training thread was runnable but had no CPU (the
  kernel's run-queue delay, ``scan.tracing.sched``: another process's time slices, a container's CPU limit) for
  ``min_slowdown`` of a step more than the other ranks', or than in its own earlier steps, is ``host``, wherever
  the lost time fell.

A member is flagged when its excess over the peers' healthy level is at least ``min_slowdown`` *and* its log
ratio to that level is at least ``min_z`` standard errors (timing noise is multiplicative; few or noisy samples
do not raise alarms) *and* it is slower than a healthy peer in at least 80 % of sample pairs (the *probability
of superiority*, a rank statistic: heavy-tailed or two-mode noise, such as CPU contention where an op takes
either 3 ms or 12 ms, can move a median without a consistent slowdown) *and* it costs at least ``min_impact`` of
a step (a data loader 2x slower than its peers' 20 µs does not matter). Suspects are ordered by the time they
cost per step (``evidence["impact_ms"]``), the common currency of compute, link and data slowness. A longer
data-wait only counts where the rank also ended it *later* than its peers (aligned clock): a wait that started
early and ended with the others was spent at a synchronisation point between the batches.

Collectives give independent evidence for compute suspects: a rank that is last in most instances of its
tensor-parallel group, imposing a wait about equal to its compute excess, is the slow one.

Detection cannot blame a rank when its whole peer group is slow (all ranks of a stage), nor a stage whose
groups have a single rank unless the trace has layer spans; a slowdown in fewer than about a third of the steps
is taken for hiccups (on purpose), and the per-step rule needs at least 8 traced steps.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Union

from lightning_megatron.scan.analysis.bubbles import measure_bubbles
from lightning_megatron.scan.analysis.experts import expert_load
from lightning_megatron.scan.analysis.measure import keep_finished_steps, read_traces, unjudged_ranks
from lightning_megatron.scan.analysis.report import DetectionReport
from lightning_megatron.scan.analysis.rules import run_rules
from lightning_megatron.scan.analysis.rules_common import DetectionContext

__all__ = ["detect", "register_cli"]


def detect(
    trace_dir: Union[str, Path],
    *,
    min_slowdown: float = 0.08,
    min_z: float = 3.5,
    min_impact: float = 0.005,
    skip_steps: int = 0,
    since_step: Optional[int] = None,
) -> DetectionReport:
    """Rank the ranks (and links) of a MegaScan trace directory that are slower than their peers.

    ``min_slowdown``: smallest excess over the peers' healthy level that is reported (fraction, 0.08 = 8 %).
    ``min_z``: the log ratio to the baseline must also be this many standard errors (from the samples' MAD);
    with few samples and a lot of noise (CPU test runs) this is the test that binds.
    ``min_impact``: ... and the slowness must cost at least this fraction of the median step time per step.
    ``skip_steps``: leave out the first recorded steps (warm-up). ``since_step``: analyse only that step and
    later (MegaScan's online detection: a sliding window of recent steps, read in bounded memory).
    Besides, a suspect must be slower than a healthy peer in 80 % of sample pairs (see the module docstring).
    Missing or truncated rank files produce warnings (in the report, and as Python warnings), and the ranks left
    without a finished step to analyse are the report's ``unjudged_ranks`` (its verdict names them); a directory
    without rank files raises ``FileNotFoundError``."""
    trace_dir = Path(trace_dir)
    notes: list[str] = []
    traces = read_traces(trace_dir, notes, since_step)
    had_spans = {rank: bool(trace.spans) for rank, trace in traces.items()}
    all_steps = keep_finished_steps(traces, skip_steps, notes)
    # before the rules: their notes keep their order, and measure_bubbles only reads the traces
    bubbles = measure_bubbles(traces, []) or None
    experts = expert_load(traces)
    context = DetectionContext.measure(traces, notes, min_slowdown=min_slowdown, min_z=min_z, min_impact=min_impact)
    suspects = run_rules(context)

    for note in notes:
        warnings.warn(f"megascan detect: {note}", stacklevel=2)
    return DetectionReport(
        trace_dir=str(trace_dir),
        suspects=suspects,
        per_rank=context.per_rank,
        warnings=notes,
        params={
            "min_slowdown": min_slowdown,
            "min_z": min_z,
            "min_impact": min_impact,
            "skip_steps": skip_steps,
            **_granularity(traces),
        },
        steps=all_steps,
        unjudged_ranks=unjudged_ranks(traces, had_spans),
        bubbles=bubbles,
        experts=experts,
    )


def _granularity(traces: dict[int, Any]) -> dict[str, str]:
    """What the ranks were traced at and why (``MegaScan(granularity=None)`` chooses per job), for the report."""
    found = sorted({t.granularity for t in traces.values() if t.granularity})
    if not found:
        return {}
    reasons = sorted({t.granularity_reason for t in traces.values() if t.granularity_reason})
    out = {"granularity": found[0] if len(found) == 1 else ", ".join(found)}
    if reasons:
        out["granularity_reason"] = reasons[0]
    return out


# ----------------------------------------------------------------------------------------------- CLI


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """``detect TRACE_DIR [--json OUT.json] [--min-slowdown 0.08]``: print the warnings, then the verdict and the
    suspects table. Exit code 0 whether or not there are suspects (this is a report, not a check), 1 where no rank
    could be judged (every trace without a finished step: no verdict at all), 2 without rank files."""
    parser = subparsers.add_parser(
        "detect",
        help="rank the slow ranks, links and data loaders of a MegaScan trace directory",
        description="Compare every rank with the ranks doing the same work and name the slow ones.",
    )
    parser.add_argument(
        "trace_dir", type=Path, metavar="TRACE_DIR", help="a MegaScan trace directory (one file per rank)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="OUT.json", help="also write the report as JSON")
    parser.add_argument("--min-slowdown", type=float, default=0.08, help="smallest reported excess (fraction)")
    parser.add_argument("--min-z", type=float, default=3.5, help="standard errors above the baseline (log ratio)")
    parser.add_argument("--min-impact", type=float, default=0.005, help="smallest cost per step (fraction of a step)")
    parser.add_argument("--skip-steps", type=int, default=0, help="leave out the first N steps (warm-up)")
    parser.add_argument("--per-rank", action="store_true", help="also print the per-rank medians")
    parser.set_defaults(func=_run_cli)
    return parser


def _run_cli(args: argparse.Namespace) -> int:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the table repeats the warnings
            report = detect(
                args.trace_dir,
                min_slowdown=args.min_slowdown,
                min_z=args.min_z,
                min_impact=args.min_impact,
                skip_steps=args.skip_steps,
            )
    except (FileNotFoundError, NotADirectoryError) as err:
        print(f"lightning-megatron scan detect: error: {err}", file=sys.stderr)
        return 2
    print(report.table(per_rank=args.per_rank))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(report.to_json() + "\n")
        print(f"report written to {args.json}")
    return 0 if report.judged else 1
