"""Run a recipe as a user would, through the command line, and record what it did.

    python benchmarks/recipe_run.py recipes/gpt2-medium-1gpu.yaml --out benchmarks/results/throughput/recipe_gpt2-medium.json
    python benchmarks/recipe_run.py recipes/gpt-1.3b-tp2.yaml --out r.json -- --trainer.max_steps=200

In a scratch directory (``--workdir``; default a temporary one), the three commands of the recipe's header:
``lightning-megatron preprocess`` (the corpus ``make demo`` prepares), ``lightning-megatron fit --config RECIPE``
(with the overrides after ``--``) and ``lightning-megatron sample`` from the last checkpoint. Recorded beside
the usual provenance: each command's wall time and exit code, the training and validation losses from the CSV
logger, the step time of the steps MegaScan traced (its report: the recipes enable it) as tokens/s and TFLOP/s
per GPU (Megatron-LM's formula, ``throughput.model_flops_per_step``, at the recipe's vocabulary), MegaScan's
verdict, and the sampled text. A failed command stops the run; its output's tail is recorded.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402
from throughput import model_flops_per_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "recipes" / "data" / "kjv.jsonl.gz"


def _run(command: list[str], cwd: Path, record: dict[str, Any], name: str, timeout: float) -> bool:
    started = time.perf_counter()
    cli = [sys.executable, "-m", "lightning_megatron.cli", *command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cli, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    record[name] = {
        "command": "lightning-megatron " + " ".join(command),
        "seconds": round(time.perf_counter() - started, 1),
        "exit_code": proc.returncode,
    }
    if proc.returncode != 0:
        record[name]["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
        print(record[name]["output_tail"], flush=True)
    print(f"{name}: exit {proc.returncode} in {record[name]['seconds']} s", flush=True)
    return proc.returncode == 0


def _losses(log_dir: Path) -> dict[str, list[list[float]]]:
    if not (log_dir / "metrics.csv").exists():
        return {}
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    found: dict[str, list[list[float]]] = {"train_loss": [], "val_loss": []}
    for row in rows:
        for key, series in found.items():
            if row.get(key):
                series.append([int(row["step"]), round(float(row[key]), 4)])
    return found


def _throughput(config: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    model = config["model"]["init_args"]
    data = config["data"]["init_args"]
    shape = dict(model, style="llama" if model.get("activation") == "swiglu" else "gpt")
    gpus = int(config["trainer"]["devices"]) * int(config["trainer"].get("num_nodes", 1))
    step_ms = statistics.median(r["step_ms"] for r in report["per_rank"].values())
    tokens = data["global_batch_size"] * data["seq_length"]
    flops = model_flops_per_step(shape, data["global_batch_size"])
    return {
        "traced_step_ms": round(step_ms, 2),
        "tokens_per_second": round(tokens / step_ms * 1000),
        "tflops_per_gpu": round(flops / (step_ms / 1000) / gpus / 1e12, 1),
        "what": "median over ranks of MegaScan's per-rank step time (its traced steps)",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workdir", type=Path, help="scratch directory (kept); default a temporary one")
    parser.add_argument("--prompt", default="And God said")
    parser.add_argument("--timeout-s", type=float, default=3600)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.overrides = argv[cut + 1 :]  # after --: extra `fit` arguments, e.g. --trainer.max_steps=200
    recipe = args.recipe.resolve()
    config = yaml.safe_load(recipe.read_text())
    record: dict[str, Any] = {"what": f"the recipe {args.recipe} run through the command line", **provenance()}
    record["recipe"] = str(args.recipe)
    record["overrides"] = args.overrides
    with tempfile.TemporaryDirectory() as scratch:
        work = args.workdir or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        data = config["data"]["init_args"]
        ok = (work / f"{data['data_path']}.bin").exists() or _run(
            ["preprocess", "--input", str(CORPUS), "--output-prefix", data["data_path"], "--tokenizer", "train:2048"]
            + ["--append-eod", "--quiet"],
            work,
            record,
            "preprocess",
            args.timeout_s,
        )
        ok = ok and _run(["fit", "--config", str(recipe), *args.overrides], work, record, "fit", args.timeout_s)
        root = work / config["trainer"]["default_root_dir"]
        logs = sorted(root.glob("logs/version_*"))
        if logs:
            record["losses"] = _losses(logs[-1])
            report_path = logs[-1] / "megascan" / "megascan-report.json"
            if report_path.exists():
                report = json.loads(report_path.read_text())
                # the configuration the fit ran with (LightningCLI saves it, overrides applied)
                ran = logs[-1] / "config.yaml"
                record["throughput"] = _throughput(yaml.safe_load(ran.read_text()) if ran.exists() else config, report)
                record["megascan"] = {"suspects": report["suspects"], "warnings": report["warnings"]}
        last = root / "checkpoints" / "last.ckpt"
        if ok and last.exists():
            sample = ["sample", str(last), "--prompt", args.prompt, "--max-new-tokens", "40", "--temperature", "0"]
            started = time.perf_counter()
            cli = [sys.executable, "-m", "lightning_megatron.cli", *sample]
            proc = subprocess.run(cli, cwd=work, capture_output=True, text=True, timeout=args.timeout_s)
            record["sample"] = {
                "command": "lightning-megatron " + " ".join(sample),
                "seconds": round(time.perf_counter() - started, 1),
                "exit_code": proc.returncode,
                "text": [line for line in proc.stdout.splitlines() if line.startswith("--- ")]
                or (proc.stdout + proc.stderr)[-2000:],
            }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(json.dumps({k: record.get(k) for k in ("fit", "throughput", "sample")}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
