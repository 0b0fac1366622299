"""Loss curves of the same fit in bf16 and in each float8 recipe: does FP8 training follow bf16?

    python benchmarks/fp8_loss_curves.py --out benchmarks/results/fp8/loss_curves_gpt-1.3b.json   # 1 GPU, 500 steps
    python benchmarks/fp8_loss_curves.py --recipes bf16 tensorwise --out F.json              # some recipes ...
    python benchmarks/fp8_loss_curves.py --recipes rowwise rowwise_with_gw_hp --out F.json --append  # ... the rest
    python benchmarks/fp8_loss_curves.py --devices 2 --tp 2 --out F.json                      # at TP2
    python benchmarks/fp8_loss_curves.py --cpu-dry-run --out /tmp/fp8_curves.json             # tiny, 5 steps, CPU

The 1.3B GPT of ``throughput.py`` (``--model``: another of its shapes) trains for ``--steps`` on the King James
Bible shipped in ``recipes/data`` (tokenized into ``--data``, a 2,048-token BPE as ``make demo`` makes it, unless
it is there already: the GPU machines need no network), once in bf16 and once per FP8 recipe (``fp8_recipe`` of
``MegatronAppStrategy``: torchao's float8 GEMMs in every tensor-parallel linear layer but the output layer). Each
fit runs in fresh processes (``torchrun --standalone``, as ``throughput.py`` launches), from the same initial
weights (``split_invariant_init``, one ``init_seed``) on the same samples in the same order (one data seed), with
``Trainer(precision="bf16-mixed")``: fp32 master weights and optimizer, so the recipes differ only in the GEMMs.

Every step's training loss is recorded (the global loss the strategy logs, and the gradient norm). The JSON holds
the provenance (device, versions, date, the exact command), the settings, the per-recipe losses, and for each FP8
recipe its mean loss over the last 50 steps as a ratio to bf16's and its largest per-step divergence from bf16
(absolute and relative, with the step); the PNG beside it (``--plot``, default the JSON's name) the curves, and
below them each recipe's relative difference to bf16 per step. ``--append`` adds recipes to an existing ``--out``
(a recipe run again replaces its curve), so a long comparison can be split over several launches.

The corpus is small (1.1 M tokens; 98% of it trains): 500 steps of 8 sequences of 2,048 tokens are about 7.5
epochs, the regime where a 1.3B model starts to memorize it. The comparison is between numerics on one data
stream, not of how well either generalizes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
from provenance import provenance  # noqa: E402
from throughput import MODELS  # noqa: E402
from throughput_runners import _gpt_module_shape  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "recipes" / "data" / "kjv.jsonl.gz"
RECIPES = ["bf16", "tensorwise", "rowwise", "rowwise_with_gw_hp"]  # bf16: no fp8_recipe; the others torchao's
LAST = 50  # steps the final-loss ratio averages over
SEED = 1234
# --cpu-dry-run: a tiny model on the first chapters of the corpus, a 512-token BPE, on the CPU (emulated float8).
DRY_RUN = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, micro_batch_size=2)
DRY_RUN_DOCUMENTS, DRY_RUN_VOCAB = 200, 512


def prepare_corpus(prefix: Path, vocab: int, documents: int | None = None) -> Path:
    """``prefix``.bin/.idx and ``prefix``-tokenizer.json from the shipped corpus (``make demo``'s command), unless
    they are there; ``documents``: only the first ones (the dry run). Returns the tokenizer's path."""
    tokenizer = Path(f"{prefix}-tokenizer.json")
    if Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file() and tokenizer.is_file():
        return tokenizer
    prefix.parent.mkdir(parents=True, exist_ok=True)
    source = CORPUS
    if documents is not None:
        source = prefix.parent / "corpus-head.jsonl"
        with gzip.open(CORPUS, "rt") as full:
            source.write_text("".join(line for _, line in zip(range(documents), full)))
    from lightning_megatron.data.preprocess import preprocess_jsonl  # `lightning-megatron preprocess`'s own

    workers = 1 if documents is not None else min(8, os.cpu_count() or 1)  # a pool costs more than 200 chapters
    preprocess_jsonl(str(source), str(prefix), f"train:{vocab}", append_eod=True, workers=workers, quiet=True)
    return tokenizer


def worker(spec: dict[str, Any]) -> None:
    """One fit (one recipe) in this ``torchrun`` process group; rank 0 writes the losses to ``spec["result"]``."""
    import lightning.pytorch as pl
    import torch

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import GPTDataModule
    from lightning_megatron.models import GPTModule

    pl.seed_everything(SEED)
    rank = int(os.environ.get("RANK", 0))
    record: dict[str, Any] = {"recipe": spec["recipe"], "loss": [], "grad_norm": [], "step_seconds": []}

    def write() -> None:
        if rank == 0:
            Path(spec["result"]).write_text(json.dumps(record))

    class LossRecorder(pl.Callback):
        """The global training loss of every step (logged by ``GPTModule`` on every rank), as it happened."""

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            metrics = trainer.callback_metrics
            record["loss"].append(float(metrics["train_loss"]))  # waits for the step: the times are whole steps
            record["grad_norm"].append(float(metrics["grad_norm"]) if "grad_norm" in metrics else None)
            record["step_seconds"].append(time.perf_counter() - self.start)
            if len(record["loss"]) % 25 == 0:  # a fit that dies later still leaves its curve so far
                write()

    m, recipe = spec["model"], spec["recipe"]
    trainer = pl.Trainer(
        accelerator=spec["accelerator"],
        devices=spec["devices"],
        precision="bf16-mixed",
        strategy=MegatronAppStrategy(
            tensor_model_parallel_size=spec["tp"],
            pipeline_model_parallel_size=spec["pp"],
            micro_batch_size=m["micro_batch_size"],
            fp8_recipe=None if recipe == "bf16" else recipe,
        ),
        max_steps=spec["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[LossRecorder()],
    )
    model = GPTModule(
        **_gpt_module_shape(m),
        layer_spec="sdpa",
        lr=spec["lr"],
        min_lr=spec["lr"] / 10,
        warmup_steps=spec["warmup_steps"],
        weight_decay=0.1,
        init_seed=SEED,
    )
    data = GPTDataModule(
        data_path=spec["data"],
        tokenizer=spec["tokenizer"],
        seq_length=m["seq_length"],
        global_batch_size=spec["global_batch_size"],
        split="98,2,0",
        seed=SEED,
        num_workers=0 if spec["accelerator"] == "cpu" else 2,
    )
    started = time.perf_counter()
    trainer.fit(model, data)
    record["fit_seconds"] = time.perf_counter() - started
    record["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
    write()


def _launch(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One recipe's fit in its own processes; its record, or the error and the log's tail."""
    spec = dict(spec, result=str(workdir / f"{spec['recipe']}.json"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['devices']}"]
    command += [__file__, "--worker-spec", json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=spec["timeout"])
    result = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).exists() else {"loss": []}
    if proc.returncode != 0 or len(result["loss"]) != spec["steps"]:
        log = proc.stdout + proc.stderr
        raised = [line for line in log.splitlines() if line.strip() and "Error" in line and "elastic" not in line]
        result.update(error=f"exit {proc.returncode}", raised=raised[-8:], log_tail=log[-3000:])
    return result


def compare(curves: dict[str, dict[str, Any]], last: int = LAST) -> dict[str, Any]:
    """Each FP8 recipe against bf16, over the steps both recorded: the mean loss of the last ``last`` steps as a
    ratio to bf16's, and the largest per-step divergence (absolute and relative to bf16's loss, with its step)."""
    base = curves.get("bf16", {}).get("loss") or []
    summary: dict[str, Any] = {}
    for recipe, curve in curves.items():
        loss = curve.get("loss") or []
        steps = min(len(loss), len(base))
        if recipe == "bf16" or not steps:
            continue
        window = min(last, steps)
        absolute = [abs(loss[i] - base[i]) for i in range(steps)]
        relative = [absolute[i] / base[i] for i in range(steps)]
        worst = max(range(steps), key=relative.__getitem__)
        summary[recipe] = {
            "steps_compared": steps,
            "final_loss_ratio": statistics.fmean(loss[steps - window : steps])
            / statistics.fmean(base[steps - window : steps]),
            "final_loss_window": window,
            "max_abs_difference": max(absolute),
            "max_relative_difference": relative[worst],
            "max_relative_difference_step": worst + 1,
        }
    return summary


def plot(curves: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """The loss curves, and each FP8 recipe's relative difference to bf16 per step below them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    base = curves.get("bf16", {}).get("loss") or []
    for recipe, curve in curves.items():
        loss = curve.get("loss") or []
        color = f"C{RECIPES.index(recipe)}"  # one colour per recipe in both panels
        top.plot(range(1, len(loss) + 1), loss, label=recipe, linewidth=1, color=color)
        steps = min(len(loss), len(base))
        if recipe != "bf16" and steps:
            diff = [(loss[i] - base[i]) / base[i] * 100 for i in range(steps)]
            bottom.plot(range(1, steps + 1), diff, label=recipe, linewidth=0.8, color=color)
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=10)
    top.legend()
    top.grid(alpha=0.3)
    bottom.axhline(0, color="black", linewidth=0.6)
    bottom.set_ylabel("(loss − bf16) / bf16, %")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    if bottom.lines[1:]:
        bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker-spec", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt-1.3b", choices=sorted(MODELS), help="a model shape of throughput.py")
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, help="default: the model shape's")
    parser.add_argument("--lr", type=float, default=2e-4, help="peak; cosine decay to a tenth (recipes/gpt-1.3b-tp2)")
    parser.add_argument("--warmup-steps", type=int, help="default: a tenth of --steps, at most 40")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument(
        "--data",
        type=Path,
        help="corpus prefix, made if missing (default: runs/data/kjv, make demo's; dry run: a temp)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/fp8/loss_curves.json")
    parser.add_argument("--plot", type=Path, help="the PNG (default: --out with .png)")
    parser.add_argument("--append", action="store_true", help="add these recipes to the curves already in --out")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds one fit may take")
    parser.add_argument("--cpu-dry-run", action="store_true", help="a tiny model for 5 steps on CPUs (plumbing)")
    args = parser.parse_args()
    if args.worker_spec:
        worker(json.loads(args.worker_spec))
        return 0
    from lightning_megatron.data.tokenizers import load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        if args.cpu_dry_run:
            steps, model = min(args.steps, 5), dict(DRY_RUN)
            data = args.data or Path(tmp, "data", "kjv-head")
            tokenizer = prepare_corpus(data, DRY_RUN_VOCAB, DRY_RUN_DOCUMENTS)
        else:
            steps, model = args.steps, dict(MODELS[args.model])
            data = args.data or ROOT / "runs/data/kjv"
            tokenizer = prepare_corpus(data, 2048)
        model["vocab_size"] = load_tokenizer(str(tokenizer)).vocab_size  # the corpus's, not the shape's
        if args.micro_batch_size:
            model["micro_batch_size"] = args.micro_batch_size
        model.pop("layouts", None)
        warmup = args.warmup_steps if args.warmup_steps is not None else min(40, max(1, steps // 10))
        spec = {
            "model": model,
            "steps": steps,
            "global_batch_size": args.global_batch_size,
            "lr": args.lr,
            "warmup_steps": warmup,
            "devices": args.devices,
            "tp": args.tp,
            "pp": args.pp,
            "accelerator": "cpu" if args.cpu_dry_run else "gpu",
            "data": str(data),
            "tokenizer": str(tokenizer),
            "timeout": args.timeout,
        }
        report: dict[str, Any] = {
            "what": "training loss per step, bf16 and each FP8 recipe (torchao float8 GEMMs), same init and data",
            **provenance(),
            "settings": {k: v for k, v in spec.items() if k not in ("tokenizer", "timeout")},
            "curves": {},
        }
        if args.append and args.out.exists():
            previous = json.loads(args.out.read_text())
            if previous["settings"] != report["settings"]:
                raise SystemExit(
                    f"--append: {args.out} holds curves of other settings ({previous['settings']}); "
                    "use the same settings or another --out"
                )
            report["curves"] = previous["curves"]
            report["commands"] = previous.get("commands", [previous["command"]]) + [report["command"]]
        png = args.plot or args.out.with_suffix(".png")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for recipe in args.recipes:
            started = time.perf_counter()
            curve = _launch(dict(spec, recipe=recipe), Path(tmp))
            report["curves"][recipe] = {k: v for k, v in curve.items() if k != "recipe"}
            report["comparison_to_bf16"] = compare(report["curves"])
            args.out.write_text(json.dumps(report, indent=1))
            loss = curve["loss"]
            shown = curve.get("error") or f"loss {loss[0]:.3f} -> {statistics.fmean(loss[-LAST:]):.3f} (last {LAST})"
            print(f"{recipe:>20}  {shown}  {time.perf_counter() - started:.0f} s", flush=True)
        title = f"{args.model if not args.cpu_dry_run else 'dry run'}: {steps} steps, {args.devices} device(s)"
        plot(report["curves"], png, f"{title}, TP{args.tp} PP{args.pp}, {report['device']}")
        for recipe, row in report["comparison_to_bf16"].items():
            print(
                f"{recipe:>20}  final loss / bf16 {row['final_loss_ratio']:.4f}  "
                f"max divergence {row['max_relative_difference']:.2%} at step {row['max_relative_difference_step']}"
            )
    return 0 if all("error" not in c for c in report["curves"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
