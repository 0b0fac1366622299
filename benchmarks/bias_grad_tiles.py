"""Choose the bias-gradient kernel's tiles (``kernels.bias.TILES``) on this GPU: time candidate tiles against ATen.

    python benchmarks/bias_grad_tiles.py --out benchmarks/results/kernels/bias_grad_tiles_h100.json

For each width, ``bias_grad`` (a column sum of a ``[8192, width]`` bf16 gradient) with every candidate tile and
ATen's ``sum(0)`` are each captured in a CUDA graph of 20 calls and replayed alternately (15 rounds, the order
reversed every other round), so launch costs do not count and clock drift spreads over all cases; the report
gives the median µs per call, the best tile per width and its speed against ATen. The bias-GeLU backward (input
gradient and bias gradient in one pass) is timed at the MLP widths against megatron-core's ``bias_gelu_back``
followed by ATen's sum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROWS = 8192
WIDTHS = [1024, 2048, 3072, 4096, 6144, 8192, 16384]
GELU_WIDTHS = [3072, 4096, 8192, 16384]
CALLS, ROUNDS = 20, 15


# (block_m, block_n, warps, programs per SM): the column sum reads one tensor; the bias-GeLU backward reads two,
# writes one and computes the GeLU derivative on each element, so it wants smaller tiles (fewer registers).
SUM_TILES = [
    (32, 256, 4, 4),  # the tile before the first sweep
    (64, 256, 8, 4),
    (32, 512, 8, 4),
    (64, 128, 4, 8),
    (64, 128, 8, 4),
    (128, 128, 8, 4),
    (128, 128, 8, 8),
    (128, 64, 4, 8),
    (128, 256, 8, 4),
    (256, 128, 8, 4),
    (32, 1024, 8, 2),
]
GELU_TILES = [
    (32, 256, 4, 4),
    (32, 256, 4, 8),
    (16, 256, 4, 8),
    (16, 256, 4, 16),
    (32, 128, 4, 8),
    (32, 128, 4, 16),
    (16, 128, 4, 16),
    (8, 256, 2, 16),
    (32, 256, 8, 8),
    (64, 64, 4, 16),
    (128, 128, 8, 4),
]


def candidates(shapes: list[tuple[int, int, int, int]]) -> dict[str, Any]:
    from lightning_megatron.kernels.bias import Tile

    return {f"m{m}-n{n}-w{w}-s{s}": Tile(m, n, w, s) for m, n, w, s in shapes}


def time_graphed(variants: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Median µs per call of each variant, from CUDA graphs of ``CALLS`` calls replayed alternately."""
    import torch

    graphs = {}
    stream = torch.cuda.Stream()
    for name, fn in variants.items():
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()  # compile and warm up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
        graphs[name] = graph
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(ROUNDS):
        for name in names if round_ % 2 == 0 else names[::-1]:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[name].replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1000.0 / CALLS)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/kernels/bias_grad_tiles.json")
    args = parser.parse_args()

    import torch
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_back

    from lightning_megatron.kernels import bias

    report: dict[str, Any] = {
        "what": f"bias-gradient column sums of [{ROWS}, width] bf16: candidate tiles against ATen's sum(0); CUDA "
        f"graphs of {CALLS} calls, {ROUNDS} alternated rounds, median µs per call",
        **provenance(),
        "device": torch.cuda.get_device_name(),
        "results": {},
    }
    for width in WIDTHS:
        g = torch.randn(ROWS, width, device="cuda").to(torch.bfloat16)
        want = g.double().sum(0)
        variants: dict[str, Callable[[], Any]] = {"aten": lambda g=g: g.sum(0)}
        for name, tile in candidates(SUM_TILES).items():
            got = bias._column_sums(g, None, None, out_dtype=g.dtype, tile=tile)
            error = float((got.double() - want).norm() / want.norm())
            assert error < 1e-2, (width, name, error)
            variants[name] = lambda g=g, tile=tile: bias._column_sums(g, None, None, out_dtype=g.dtype, tile=tile)
        us = time_graphed(variants)
        best = min((name for name in us if name != "aten"), key=us.get)
        report["results"][f"bias_grad/{width}"] = {"us": us, "best": best, "best_over_aten": us["aten"] / us[best]}
        print(width, best, f"{us[best]:.1f} us vs aten {us['aten']:.1f} us", flush=True)
    for width in GELU_WIDTHS:
        g = torch.randn(ROWS, width, device="cuda").to(torch.bfloat16)
        y = torch.randn(ROWS, width, device="cuda").to(torch.bfloat16)
        b = torch.randn(width, device="cuda").to(torch.bfloat16)
        dx = torch.empty_like(y)
        variants = {"megatron+aten": lambda g=g, y=y, b=b: bias_gelu_back(g, b, y).sum(0)}
        for name, tile in candidates(GELU_TILES).items():
            variants[name] = lambda g=g, y=y, b=b, dx=dx, tile=tile: bias._column_sums(
                g, y, b, dx, out_dtype=b.dtype, tile=tile
            )
        us = time_graphed(variants)
        best = min((name for name in us if name != "megatron+aten"), key=us.get)
        report["results"][f"bias_gelu_backward/{width}"] = {
            "us": us,
            "best": best,
            "best_over_unfused": us["megatron+aten"] / us[best],
        }
        print("gelu", width, best, f"{us[best]:.1f} us vs {us['megatron+aten']:.1f} us", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
