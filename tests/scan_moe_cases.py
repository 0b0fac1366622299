"""Functions that run inside forked ranks for ``test_scan_moe.py``: MoE fits under MegaScan, clean or with one
rank's CPU loaded by ``stress-ng`` (a fault source the project did not write, ``benchmarks/outside_faults.py``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Optional

import cases
import torch
import torch.distributed as dist

from lightning_megatron.scan import MegaScan

MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 48, "num_layers": 2}
CPU_THRESHOLDS = {"min_slowdown": 0.3, "min_impact": 0.05}  # one core per rank, but a shared machine


def pin_rank() -> None:
    """Each rank on a CPU of its own (where there are as many as ranks), one thread: a fault on one rank's CPU then
    competes with that rank alone, as a competitor on one GPU competes with that GPU's rank alone."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= world:
        os.sched_setaffinity(0, [cpus[rank * (len(cpus) // world)]])
    torch.set_num_threads(1)


def moe_fit(
    trace_dir: str,
    world: int,
    *,
    steps: int = 10,
    stress_rank: Optional[int] = None,
    pin: bool = True,
    model: Optional[dict[str, Any]] = None,
    **layout: Any,
) -> dict[str, Any]:
    """An MoE fit traced on every step; ``stress_rank``: stress-ng on that rank's CPU from step 1 on."""
    if pin:
        pin_rank()
    original = dist.all_to_all_single
    scan = MegaScan(trace_dir, interval=1, window=1, detect_options=CPU_THRESHOLDS)
    callbacks: list[Any] = [scan]
    if stress_rank is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from outside_faults import StressNg

        callbacks.append(StressNg(stress_rank, start_step=1))
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
