"""``tp_comm_overlap`` on 2 GPUs: bf16 parity and speed of one tensor-parallel transformer layer of the 1.3B GPT
(hidden 2048, 16 heads, FFN 8192, sequence 2048, micro batch 4, biases, LayerNorm; the project's ``sdpa`` layer
spec), with and without the overlap, at TP2 with and without sequence parallelism.

    python benchmarks/tp_overlap.py --out tp_overlap.json                      # both SP settings, chunks 1, 2, 4
    CUDA_DEVICE_MAX_CONNECTIONS=1 python benchmarks/tp_overlap.py --out x.json # megatron-core's usual setting

Two processes (one per GPU, NCCL) build the same layer (same seed), then:

* parity: one forward and backward without the overlap and one with it, from the same weights, input and output
  gradient; relative Frobenius errors of the output, the input gradient and every weight/bias gradient (bf16: the
  GEMMs are cut differently, so rounding differs) must stay within ``--tolerance``; the chunked primitives must
  have run (counted);
* speed: the plain layer and each overlapped setting take turns (``--rounds`` rounds of ``--iters`` forward and
  backward each, after warm-up); the median time per iteration of each, and the speed-up over the plain layer.

Writes one JSON (rank 0) with the figures and the provenance; exits 1 if parity fails.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

LAYER = dict(hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, seq_length=2048, micro_batch_size=4)
DRY_RUN = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=64, micro_batch_size=2)


def _build(sequence_parallel: bool, layers: int, shape: dict[str, int], device: str) -> Any:
    import torch
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from lightning_megatron.models.specs import gpt_block_spec

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        tensor_model_parallel_size=2,
        sequence_parallel=sequence_parallel,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
    )
    block = TransformerBlock(config, gpt_block_spec("sdpa", config), post_process=False)
    return block.to(device=device, dtype=torch.bfloat16)  # as Float16Module casts it (norms are built in fp32)


class _Layer:
    """The block, its input and output gradient: ``step`` runs one forward and backward (gradients afresh)."""

    def __init__(self, block: Any, x: Any, dy: Any) -> None:
        self.block, self.x, self.dy = block, x, dy
        self.params = dict(block.named_parameters())

    def step(self) -> Any:
        self.x.grad = None
        for p in self.params.values():
            p.grad = None
        out = self.block(hidden_states=self.x, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(self.dy)
        return out

    def overlapped(self, chunks: int) -> Any:
        from lightning_megatron.layers.tp_overlap import TPCommOverlap
        from lightning_megatron.layers.wgrad import split_linears

        # accumulate=False: weight gradients through autograd as megatron-core's (no fused accumulation)
        return split_linears([self.block], overlap=TPCommOverlap(chunks=chunks), accumulate=False)


def _rel(a: Any, b: Any) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from lightning_megatron.layers import tp_overlap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.cpu_dry_run:  # tiny shapes on CPU over gloo: checks the plumbing only
        from lightning_megatron.compat import cpu

        cpu.apply()
        device, shape_of = "cpu", DRY_RUN
        dist.init_process_group("gloo", rank=rank, world_size=2)
    else:
        device, shape_of = "cuda", LAYER
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", rank))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    calls: Counter = Counter()
    for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
        original = getattr(tp_overlap, name)

        def counting(*a: Any, _name: str = name, _fn: Any = original, **k: Any) -> Any:
            calls[_name] += 1
            return _fn(*a, **k)

        setattr(tp_overlap, name, counting)
    report: dict[str, Any] = {"parity": {}, "speed": {}}
    ok = True
    for sequence_parallel in (False, True):
        key = "tp2-sp" if sequence_parallel else "tp2"
        torch.manual_seed(1234)
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        seq = shape_of["seq_length"] // (2 if sequence_parallel else 1)
        g = torch.Generator(device=device).manual_seed(99 + rank if sequence_parallel else 99)  # SP: own tokens
        shape = (seq, shape_of["micro_batch_size"], shape_of["hidden_size"])
        x = torch.randn(shape, device=device, generator=g).to(torch.bfloat16).requires_grad_()
        dy = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
        layer = _Layer(_build(sequence_parallel, args.layers, shape_of, device), x, dy)
        params, step, overlapped = layer.params, layer.step, layer.overlapped

        # parity
        want_out = step().detach().clone()
        want = {"input": layer.x.grad.clone(), **{n: p.grad.clone() for n, p in params.items()}}
        for chunks in args.chunks:
            calls.clear()
            split = overlapped(chunks)
            got_out = step().detach().clone()
            got = {"input": layer.x.grad.clone(), **{n: p.grad.clone() for n, p in params.items()}}
            split.restore()
            errors = {"output": _rel(got_out, want_out), **{n: _rel(got[n], want[n]) for n in want}}
            worst = max(errors.values())
            counted = {name: n for name, n in calls.items() if n}
            # every layer's 2 column and 2 row linears: one collective each in the forward or backward and one in
            # the other (without SP the column forward has none)
            each = 4 * args.layers
            ran = counted == (
                {"all_gather_matmul": each, "matmul_reduce_scatter": each}
                if sequence_parallel
                else {"matmul_all_reduce": each}
            )
            passed = worst <= args.tolerance and ran
            ok = ok and passed
            report["parity"][f"{key}/chunks{chunks}"] = {
                "max_relative_error": worst,
                "relative_errors": errors,
                "primitive_calls": counted,
                "within_tolerance": passed,
            }
        # speed: the plain layer and each chunk count take turns
        variants = ["off", *[f"chunks{c}" for c in args.chunks]]
        times: dict[str, list[float]] = {v: [] for v in variants}
        for round_ in range(args.warmup_rounds + args.rounds):
            order = variants if round_ % 2 == 0 else list(reversed(variants))
            for variant in order:
                split = None if variant == "off" else overlapped(int(variant[len("chunks") :]))
                sync()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.iters):
                    step()
                sync()
                elapsed = (time.perf_counter() - start) / args.iters
                if split is not None:
                    split.restore()
                if round_ >= args.warmup_rounds:
                    times[variant].append(elapsed)
        medians = {v: statistics.median(t) * 1e3 for v, t in times.items()}
        slowest = torch.tensor([medians[v] for v in variants], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the layer is as fast as its slower rank
        medians = dict(zip(variants, slowest.tolist()))
        report["speed"][key] = {
            "median_ms_per_iteration": medians,
            "speedup_over_off": {v: medians["off"] / medians[v] for v in variants if v != "off"},
            "rounds": args.rounds,
            "iterations_per_round": args.iters,
        }
        del layer, params, step, overlapped
        if device == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:  # (a file, not a queue: a spawned process that queued a large object may not exit)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"ok": ok, "report": report}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=1, help="transformer layers in the block (default: one)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tolerance", type=float, default=2e-2, help="largest relative error in bf16")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny shapes on 2 CPU processes (gloo): plumbing")
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2 and not args.cpu_dry_run:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args.out.unlink(missing_ok=True)
    mp.start_processes(_worker, args=(args, port), nprocs=2, join=True, start_method="spawn")
    written = json.loads(args.out.read_text())
    ok, report = written["ok"], written["report"]
    result = {
        "what": "one TP2 transformer layer of the 1.3B GPT (hidden 2048, seq 2048, micro batch 4, bf16), forward + "
        "backward, without and with tp_comm_overlap (chunked collective matmul); median of alternated rounds, "
        "the slower rank's",
        **provenance(),
        "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
        "layer": {
            **(DRY_RUN if args.cpu_dry_run else LAYER),
            "layers": args.layers,
            "spec": "sdpa",
            "bias": True,
            "normalization": "LayerNorm",
        },
        "tolerance": args.tolerance,
        "all_within_tolerance": ok,
        **report,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for key, entry in report["speed"].items():
        shown = ", ".join(f"{v} {ms:.2f} ms" for v, ms in entry["median_ms_per_iteration"].items())
        print(f"{key}: {shown}; speed-up {entry['speedup_over_off']}")
    print(f"wrote {args.out}; parity within tolerance: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
