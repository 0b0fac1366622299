"""The weight-gradient split (``"zb-h1"``) vs megatron-core's 1F1B and interleaved schedules: step time, memory.

    torchrun --standalone --nproc-per-node 2 benchmarks/fbd.py --microbatches 8 --out benchmarks/results/schedules/zb_m8.json
    torchrun --standalone --nproc-per-node 2 benchmarks/fbd.py --vpp 2 --microbatches 8 --out ...vpp2.json
    torchrun --standalone --nproc-per-node 2 benchmarks/fbd.py --cpu-dry-run --out /tmp/zb.json   # plumbing

The machinery is ``benchmarks/dpp.py``'s (one model, every case alternated in rounds within one launch, median
step time of ``strategy.forward_backward``, peak GPU memory, the loss of each case on the same batch). Cases:

* PP2: ``1f1b`` (megatron-core, NCCL; the baseline), ``1f1b+fusion`` (the same with
  ``gradient_accumulation_fusion``: the weight-gradient GEMM accumulating into fp32 ``main_grad``, which ``zb-h1``'s
  W tasks use too, so the two effects can be told apart), ``zb-h1`` with each memory setting of
  ``pipeline/dpp/options.py``: ``zb-h1-first-rank`` (activations + pending Ws within the first rank's 1F1B peak,
  counted), ``zb-h1-own-rank`` (each rank within its own, counted), ``zb-h1-budget-1.05`` (the default: own-rank's
  count, and beyond it pending Ws kept layer by layer within 1.05x the most loaded rank's peak memory measured in
  the first step), and ``zb-h1-no-defer`` (W right after its B: the split's own cost, without the reordering).
  Results committed before 2026-11-23's change of default name the first-rank case ``zb-h1``;
* ``--vpp 2`` (PP2 × VPP2): ``interleaved`` (the baseline) and ``dpp`` static with ``split_weight_grads``.

Theory beside each (Qi et al., zero bubble): with forward F, input-gradient B and weight-gradient W per stage
and microbatch, 1F1B's step is (M + P − 1)(F + B + W) and ZB-H1's M(F + B + W) + (P − 1)(F + B − W); with
B ≈ W ≈ F (a backward is about two forwards) the bubble shrinks to a third and the bound is
3(M + P − 1) / (3M + P − 1): 1.154× at M = 4, 1.08× at 8, 1.04× at 16 for P = 2.

``--split``: MegaFBD's rank split instead (forward replicas and backward replicas, both modes, vs data-parallel
training on the same GPUs, with the performance model's prediction beside each measurement; ``fbd_split.py``)::

    torchrun --standalone --nproc-per-node 2 benchmarks/fbd.py --split --microbatches 8 --out ...split.json
    torchrun --standalone --nproc-per-node 4 benchmarks/fbd.py --split --tp 2 ...        # TP2 forward, TP2 backward
    torchrun --standalone --nproc-per-node 4 benchmarks/fbd.py --split --forward-replicas 3 ...   # 3:1 (1: 1:3)

``--nproc-per-node 4`` without ``--split``: PP4 (``zb-h1`` against 1F1B at four stages).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dpp import worker  # noqa: E402  (benchmarks/ is the script's directory)


def zb_cases(forward_s: float) -> list[dict[str, Any]]:
    def zb(name: str, **options: Any) -> dict[str, Any]:
        return dict(name=name, condition="clean", schedule="zb-h1", options=options, baseline="1f1b")

    return [
        dict(name="1f1b", condition="clean", schedule="1f1b", options={}, baseline="1f1b"),
        dict(name="1f1b+fusion", condition="clean", schedule="1f1b", options={}, baseline="1f1b", fused_wgrad=True),
        zb("zb-h1-first-rank", weight_grad_memory="first-rank"),
        zb("zb-h1-own-rank", weight_grad_memory="own-rank"),
        zb("zb-h1-budget-1.05", weight_grad_memory=1.05),
        zb("zb-h1-no-defer", max_deferred_weight_grads=0),
    ]


def vpp_cases(forward_s: float) -> list[dict[str, Any]]:
    split = {"policy": "static", "split_weight_grads": True}
    return [
        dict(name="interleaved", condition="clean", schedule="interleaved", options={}, baseline="interleaved"),
        dict(name="static+split", condition="clean", schedule="dpp", options=split, baseline="interleaved"),
    ]


def theory(microbatches: int, virtual: Any):  # noqa: ANN201
    def extra(rows: list[dict[str, Any]], timings: dict[str, float]) -> dict[str, Any]:
        from lightning_megatron.layers.wgrad_accumulate import fused_accumulation_status

        stages = int(os.environ.get("WORLD_SIZE", 2))  # one pipeline stage per process
        return {
            "fused_wgrad_gemm": fused_accumulation_status(),  # available: False (and why) if it fell back
            "theory": {
                "bubble_fraction_1f1b": round((stages - 1) / (microbatches + stages - 1), 4),
                "zb_h1_over_1f1b_bound": round(3 * (microbatches + stages - 1) / (3 * microbatches + stages - 1), 4)
                if virtual is None
                else None,
                "model": "1F1B (M+P-1)(F+B+W); ZB-H1 M(F+B+W) + (P-1)(F+B-W); B = W = F",
            },
        }

    return extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--vpp", type=int, default=None, help="virtual stages (interleaved vs dpp + split)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cpu-dry-run", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--split", action="store_true", help="the rank split (fbd) vs data parallel")
    parser.add_argument("--tp", type=int, default=1, help="--split: tensor-parallel GPUs in each replica")
    parser.add_argument(
        "--forward-replicas", type=int, default=1, help="--split: the replicas that run forwards (the rest backwards)"
    )
    parser.add_argument(
        "--layer-spec", default=None, help="the layer implementation (models.specs; default: local, sdpa with --split)"
    )
    parser.add_argument("--cases", nargs="*", help="only these cases, by name (default: all of the layout's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("run under torchrun --standalone --nproc-per-node N (see the module docstring)")
    if args.split:
        from fbd_split import split_worker

        args.layer_spec = args.layer_spec or "sdpa"
        split_worker(args)
        return 0
    make = vpp_cases if args.vpp else zb_cases
    if args.cases:
        known = [case["name"] for case in make(0.0)]
        unknown = sorted(set(args.cases) - set(known))
        if unknown:
            parser.error(f"--cases {' '.join(unknown)}: not a case of this layout; choose from {', '.join(known)}")
        if known[0] not in args.cases:
            parser.error(f"--cases: include {known[0]!r}, the baseline every speed-up is measured against")
        every, make = make, lambda forward_s: [case for case in every(forward_s) if case["name"] in args.cases]
    worker(
        args,
        make_cases=make,
        virtual=args.vpp,
        calibrate=False,
        extra_report=theory(args.microbatches, args.vpp),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
