"""Layout parity on GPUs: every TP/PP/VPP/DP/SP layout must train like one GPU (NCCL, bf16 and fp32).

    python benchmarks/gpu_parity.py --out benchmarks/results/gpu_tests/gpu_parity.json          # all layouts that fit
    python benchmarks/gpu_parity.py --only tp2 pp2 --precision bf16-mixed --out x.json

Each layout is one ``Trainer.fit`` of a small GPT for a few steps, started the way users start it
(Lightning's own launcher re-runs this script once per extra local rank). Every rank records its
per-step ``train_loss`` and ``grad_norm``; the driver compares them with the single-GPU run of the same
precision (same seed, same data, split-invariant initialization) and writes one JSON with the device,
versions, date, command, the per-step values and the largest relative differences.

Tolerances: fp32 (TF32 off) differs only by summation order, so 1e-4 relative; bf16 rounds activations
and gradients differently when layers are split, so 2e-2 relative on the loss and 5e-2 on the grad norm
over 10 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

MODEL = dict(
    vocab_size=1024,
    seq_length=256,
    num_layers=8,
    hidden_size=256,
    num_attention_heads=8,
    activation="gelu_tanh",  # GPT-2's; on GPUs its bias+GeLU runs fused (fuse_kernels)
    lr=1e-3,
    warmup_steps=2,
)
SWIGLU = dict(activation="swiglu", normalization="RMSNorm", add_bias_linear=False, position_embedding_type="rope")
UNFUSED = dict(fuse_kernels=False)
DATA = dict(vocab_size=1024, seq_length=256, global_batch_size=32, num_train_samples=4096, num_val_samples=64)
STEPS = 10
TOLERANCE = {"32-true": {"loss": 1e-4, "grad_norm": 1e-4}, "bf16-mixed": {"loss": 2e-2, "grad_norm": 5e-2}}

# name: (world size, strategy arguments[, model arguments]); a layout is compared with "single", or with
# "single-swiglu" for the Llama-style model.
LAYOUTS: dict[str, tuple] = {
    "single": (1, {}),
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2-sp": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2": (2, dict(pipeline_model_parallel_size=2)),
    "pp2-vpp2": (2, dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "dp2": (2, {}),
    "dp2-distopt": (2, dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)),
    "tp2-pp2": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "tp2-pp2-sp": (4, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True)),
    "tp4-sp": (4, dict(tensor_model_parallel_size=4, sequence_parallel=True)),
    "pp4": (4, dict(pipeline_model_parallel_size=4)),
    "pp4-vpp2": (4, dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)),
    "dp2-tp2-distopt": (4, dict(tensor_model_parallel_size=2, use_distributed_optimizer=True)),
    "dp2-pp2": (4, dict(pipeline_model_parallel_size=2)),
    "dp4-distopt": (4, dict(use_distributed_optimizer=True, overlap_grad_reduce=True)),
    # Fused kernels (bias+GeLU, bias+SwiGLU, cross-entropy) against the unfused path.
    "single-unfused": (1, {}, UNFUSED),
    "tp2-sp-unfused": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), UNFUSED),
    "single-swiglu": (1, {}, SWIGLU),
    "single-swiglu-unfused": (1, {}, {**SWIGLU, **UNFUSED}),
    "tp2-swiglu": (2, dict(tensor_model_parallel_size=2), SWIGLU),
}


def _reference(layout: str) -> str:
    return "single-swiglu" if "swiglu" in layout else "single"


def _run_layout(spec: dict) -> None:
    """Inside the launched processes: fit, and write this rank's record."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from cases import fit_gpt

    world, strategy, *model = LAYOUTS[spec["layout"]]
    record = fit_gpt(
        world,
        steps=STEPS,
        precision=spec["precision"],
        model={**MODEL, **(model[0] if model else {})},
        data=DATA,
        accelerator=spec["accelerator"],
        micro_batch_size=2,
        timeout=300,
        **strategy,
    )
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    Path(spec["result_dir"], f"rank{rank}.json").write_text(json.dumps(record))


def _launch(layout: str, precision: str, workdir: Path, accelerator: str, devices: list[int]) -> dict:
    result_dir = workdir / f"{layout}-{precision}"
    result_dir.mkdir(parents=True, exist_ok=True)
    spec = json.dumps(
        {"layout": layout, "precision": precision, "result_dir": str(result_dir), "accelerator": accelerator}
    )
    env = dict(os.environ)
    if accelerator == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--run", spec], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    elapsed = round(time.perf_counter() - started, 1)
    ranks = sorted(result_dir.glob("rank*.json"))
    if proc.returncode != 0 or len(ranks) != LAYOUTS[layout][0]:
        return {"error": f"exit {proc.returncode}", "log_tail": (proc.stdout + proc.stderr)[-4000:], "seconds": elapsed}
    return {"seconds": elapsed, "ranks": [json.loads(p.read_text()) for p in ranks]}


def _run_all(jobs: list[tuple[str, str]], total_devices: int, workdir: Path, accelerator: str, on_done) -> None:  # noqa: ANN001
    """Run launches concurrently on disjoint GPUs (start-up dominates each one), largest first, in order."""
    free = list(range(total_devices))
    lock = threading.Condition()

    def run(job: tuple[str, str], devices: list[int]) -> None:
        try:
            on_done(job, _launch(job[0], job[1], workdir, accelerator, devices))
        finally:
            with lock:
                free.extend(devices)
                free.sort()
                lock.notify_all()

    threads = []
    for job in sorted(jobs, key=lambda j: -LAYOUTS[j[0]][0]):
        need = LAYOUTS[job[0]][0] if accelerator == "gpu" else total_devices
        with lock:  # first come, first served: a large job is never starved by small ones
            lock.wait_for(lambda need=need: len(free) >= need)
            devices = [free.pop(0) for _ in range(need)]
        thread = threading.Thread(target=run, args=(job, devices))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def _max_rel(values: list[float], reference: list[float]) -> float:
    return max(abs(v - r) / max(abs(r), 1e-12) for v, r in zip(values, reference))


def _compare(report: dict) -> None:
    """Compare every run with the single-device run of the same precision (from the recorded per-step values)."""
    for name, entry in sorted(report["runs"].items()):
        layout, precision = name.split("/")
        reference = report["runs"].get(f"{_reference(layout)}/{precision}")
        if layout == _reference(layout) or reference is None or "error" in entry or "error" in reference:
            continue
        tol = TOLERANCE[precision]
        entry["max_rel_diff_loss"] = _max_rel(entry["loss"], reference["loss"])
        entry["max_rel_diff_grad_norm"] = _max_rel(entry["grad_norm"], reference["grad_norm"])
        entry["within_tolerance"] = (
            entry["max_rel_diff_loss"] <= tol["loss"] and entry["max_rel_diff_grad_norm"] <= tol["grad_norm"]
        )
        print(
            f"{precision:>10} {layout:>16}  loss {entry['max_rel_diff_loss']:.2e}  "
            f"grad_norm {entry['max_rel_diff_grad_norm']:.2e}  {'ok' if entry['within_tolerance'] else 'FAIL'}"
        )
    report["all_within_tolerance"] = all(
        r.get("within_tolerance", True) and r.get("ranks_agree", True) and "error" not in r
        for r in report["runs"].values()
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--only", nargs="*", help="layouts to run (default: all that fit on the visible GPUs)")
    parser.add_argument("--precision", nargs="*", default=["bf16-mixed", "32-true"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_tests/gpu_parity.json")
    parser.add_argument("--accelerator", default="gpu", help="'cpu' for a dry run of the driver (with --devices)")
    parser.add_argument("--devices", type=int, help="devices available (default: visible GPUs)")
    parser.add_argument("--append", action="store_true", help="add to the runs already in --out")
    parser.add_argument("--compare", action="store_true", help="only recompute the comparison of the runs in --out")
    args = parser.parse_args()
    if args.run:
        _run_layout(json.loads(args.run))
        return 0
    if args.compare:
        report = json.loads(args.out.read_text())
        _compare(report)
        now = provenance()
        report.setdefault("commands", []).append(
            {
                "command": now["command"],
                "date": now["date"],
                "note": "comparison recomputed from the recorded per-step values (no new measurements)",
            }
        )
        args.out.write_text(json.dumps(report, indent=1))
        return 0 if report["all_within_tolerance"] else 1

    import torch

    gpus = args.devices or torch.cuda.device_count()
    layouts = [n for n in (args.only or LAYOUTS) if LAYOUTS[n][0] <= gpus]
    previous = json.loads(args.out.read_text()).get("runs", {}) if args.append and args.out.exists() else {}
    for reference in sorted({_reference(n) for n in layouts}, reverse=True):
        if reference not in layouts and not all(f"{reference}/{p}" in previous for p in args.precision):
            layouts.insert(0, reference)
    report = json.loads(args.out.read_text()) if args.append and args.out.exists() else {}
    report.update(
        {
            "what": "per-step train_loss and grad_norm of each layout vs one GPU, same seed and data",
            **provenance(),
            "model": MODEL,
            "data": DATA,
            "steps": STEPS,
            "micro_batch_size": 2,
            "tolerance": TOLERANCE,
        }
    )
    report.setdefault("runs", {})
    commands = report.setdefault("commands", [])
    commands.append({"command": report["command"], "date": report["date"]})
    lock = threading.Lock()
    results: dict[tuple[str, str], dict] = {}

    def record(job: tuple[str, str], result: dict) -> None:
        layout, precision = job
        with lock:
            results[job] = result
            world, strategy, *model = LAYOUTS[layout]
            entry = {"world_size": world, "strategy": strategy, "model": model[0] if model else {}}
            entry["seconds"] = result["seconds"]
            if "error" in result:
                entry.update(error=result["error"], log_tail=result["log_tail"])
            else:
                first = result["ranks"][0]
                entry.update(loss=first["loss"], grad_norm=first["grad_norm"])
                entry["ranks_agree"] = all(
                    r["loss"] == first["loss"] and r["grad_norm"] == first["grad_norm"] for r in result["ranks"]
                )
            entry["date"] = report["date"]
            report["runs"][f"{layout}/{precision}"] = entry
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1))  # after every launch: a timeout loses little
            print(f"{precision:>10} {layout:>16}  {entry.get('error', 'done')} ({entry['seconds']}s)", flush=True)

    jobs = [(layout, precision) for precision in args.precision for layout in layouts]
    with tempfile.TemporaryDirectory() as tmp:
        _run_all(jobs, gpus, Path(tmp), args.accelerator, record)

    _compare(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}; all within tolerance: {report['all_within_tolerance']}")
    return 0 if report["all_within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
