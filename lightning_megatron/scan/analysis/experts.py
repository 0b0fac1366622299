"""The load on the experts of MoE layers, from MegaScan's ``tokens per expert`` counters (``scan.tracing.moe``).

Each rank writes, per MoE layer and traced step, the tokens its local experts received (from every rank of its
expert-parallel group). A layer's load in a step is therefore the sum over ranks of their experts' counts, with
two corrections: ranks of one tensor-parallel group receive the same tokens (the dispatcher gathers them over
the group), so only ``tp == 0`` counts; and expert-data-parallel replicas of an expert each count their own
group's tokens, so their counts add up. The result is what a router's imbalance costs: in a step, the busiest
expert's tokens over the mean (``max/mean``; 1 is even, ``E`` one expert takes all), the median over steps per
layer. Detection reads it from the same ``RankTrace``s (``counters``) and puts it in the report (``experts``,
printed by ``report.expert_lines``).

No rule reads it: an uneven router makes the busiest expert's rank slower, and that rank is named by the compute
rules (a slow expert rank) whatever the cause; this is the context that tells the two apart.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Any, Optional

__all__ = ["COUNTER_PATTERN", "expert_load"]

COUNTER_PATTERN = re.compile(r"^tokens per expert · layer (\d+)$")


def expert_load(traces: dict[int, Any]) -> Optional[dict[str, Any]]:
    """Per MoE layer: experts seen, median tokens per step, median and largest ``max/mean``, the busiest expert and
    the mean tokens per step of each; None without counters. ``traces``: ``measure.RankTrace``s whose spans are
    the analysed steps (a counter is kept where its time is a kept step's start)."""
    load: dict[int, dict[int, dict[int, int]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for trace in traces.values():
        if trace.tp != 0 or not trace.counters:
            continue
        starts = {s["ts"]: s["args"]["step"] for s in trace.spans if s["cat"] == "step" and "step" in s.get("args", {})}
        for counter in trace.counters:
            match = COUNTER_PATTERN.match(str(counter.get("name")))
            step = starts.get(counter.get("ts"))
            if match is None or step is None:
                continue
            per_expert = load[int(match.group(1))][int(step)]
            for series, tokens in (counter.get("args") or {}).items():
                per_expert[int(str(series).removeprefix("expert "))] += int(tokens)
    if not load:
        return None
    layers = {}
    for layer, steps in sorted(load.items()):
        experts = sorted({e for per_expert in steps.values() for e in per_expert})
        ratios, totals = [], []
        sums: dict[int, int] = defaultdict(int)
        for per_expert in steps.values():
            counts = [per_expert.get(e, 0) for e in experts]
            total = sum(counts)
            totals.append(total)
            ratios.append(max(counts) * len(counts) / total if total else 1.0)
            for e in experts:
                sums[e] += per_expert.get(e, 0)
        layers[str(layer)] = {
            "experts": len(experts),
            "steps": len(steps),
            "tokens_per_step": statistics.median(totals),
            "imbalance": round(statistics.median(ratios), 4),
            "imbalance_max": round(max(ratios), 4),
            "busiest_expert": max(experts, key=lambda e: (sums[e], -e)),
            "per_expert": {str(e): round(sums[e] / len(steps), 2) for e in experts},
        }
    return {"layers": layers}
