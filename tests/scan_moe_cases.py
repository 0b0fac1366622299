"""Functions that run inside forked ranks for ``test_scan_moe.py``: MoE fits under MegaScan, clean or with one rank
under a CPU limit (the kernel's CFS bandwidth control, what a container's CPU limit is: a fault source the project
did not write, ``benchmarks/outside_faults.CpuQuota``).

Why a limit and not ``stress-ng`` on the rank's CPU: on a machine whose other processes may run on any CPU, the
kernel moves them away from the CPU that ``stress-ng`` loads, onto the other rank's, and both ranks slow alike (seen
on the 2-core test machine: equal compute and run-queue delay on both ranks). A limit stops the process itself,
whatever runs elsewhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import cases
import torch.distributed as dist

from lightning_megatron.scan import MegaScan

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "num_layers": 2, "add_bias_linear": False}
QUOTA_CPUS, QUOTA_PERIOD_MS = 0.15, 10.0  # a container's CPU limit, in short periods: every span is hit alike
CPU_THRESHOLDS = {"min_slowdown": 0.3, "min_impact": 0.05}  # one core per rank, but a shared machine


def moe_fit(
    trace_dir: str,
    world: int,
    *,
    steps: int = 10,
    quota_rank: Optional[int] = None,
    model: Optional[dict[str, Any]] = None,
    **layout: Any,
) -> dict[str, Any]:
    """An MoE fit traced on every step; ``quota_rank``: that rank limited to ``QUOTA_CPUS`` CPUs from step 1 on."""
    original = dist.all_to_all_single
    scan = MegaScan(trace_dir, interval=1, window=1, detect_options=CPU_THRESHOLDS)
    callbacks: list[Any] = [scan]
    if quota_rank is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from outside_faults import CpuQuota

        callbacks.append(CpuQuota(quota_rank, start_step=1, cpus=QUOTA_CPUS, period_ms=QUOTA_PERIOD_MS))
    result = cases.fit_gpt(
        world,
        steps=steps,
        callbacks=callbacks,
        model={"layer_spec": "sdpa", **MOE, **(model or {})},
        trainer={"limit_val_batches": 0},
        **layout,
    )
    return {
        "loss": result["loss"],
        "report": json.loads(scan.report.to_json()) if scan.report is not None else None,
        "restored": dist.all_to_all_single is original,
    }
