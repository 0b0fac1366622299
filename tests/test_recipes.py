"""Every GPU recipe in ``recipes/`` trains through the command line on CPUs, as written except for its size.

The recipes are what a user copies first, and the GPU machines are rarely at hand: each one runs here as real
gloo processes with its strategy (TP + SP, PP × VPP under MegaDPP, ...), precision, callbacks (MegaScan
included), logger and data module unchanged, and only the model's shape, the batch, the step count and the
accelerator overridden. What would break a recipe on a GPU machine for a reason a CPU also has (a renamed
argument, an option combination the strategy refuses, a callback that no longer fits) breaks here first.
``recipes/gpt-tiny-cpu.yaml`` has its own, longer test (``tests/test_cli.py``).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from tests.test_cli import ROOT, run_cli

GPU_RECIPES = sorted(p for p in (ROOT / "recipes").glob("*.yaml") if p.name != "gpt-tiny-cpu.yaml")

# A CPU-sized model (4 layers: PP2 × VPP2 needs a multiple of 4, hidden 64) under the recipe's own global batch, so
# its data settings are tested as written (the validation split must hold a global batch). The sequence is cut to
# 256 tokens: at the recipes' 2048, bf16 GEMMs on a CPU without AVX-512 (bf16 arithmetic through fp32, one dot at a
# time) took a TP2 fit of four steps past five minutes.
SHRINK = {
    "--trainer.accelerator": "cpu",
    "--trainer.max_steps": "4",
    "--trainer.val_check_interval": "2",
    "--trainer.limit_val_batches": "1",
    "--trainer.enable_progress_bar": "false",
    "--trainer.log_every_n_steps": "1",
    "--trainer.strategy.init_args.micro_batch_size": "2",
    "--model.init_args.num_layers": "4",
    "--model.init_args.hidden_size": "64",
    "--model.init_args.num_attention_heads": "4",
    "--model.init_args.seq_length": "256",
    "--data.init_args.seq_length": "256",
    "--data.init_args.num_workers": "0",
}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``runs/data/kjv``, prepared as ``make demo`` does (the recipes' default data)."""
    root = tmp_path_factory.mktemp("recipes")
    corpus = ROOT / "recipes" / "data" / "kjv.jsonl.gz"
    prepare = ["preprocess", "--input", str(corpus), "--output-prefix", "runs/data/kjv", "--tokenizer", "train:2048"]
    run_cli([*prepare, "--append-eod", "--quiet"], cwd=root)
    return root


def test_every_gpu_recipe_is_tested() -> None:
    names = {p.name for p in GPU_RECIPES}
    assert {"gpt2-medium-1gpu.yaml", "llama-0.85b-1gpu.yaml", "gpt-1.3b-tp2.yaml", "gpt-1.3b-pp2-dpp.yaml"} <= names
    assert "llama3-8b-tp2.yaml" in names


def check_splits_at_full_length(config: dict, corpus_dir: Path) -> None:
    """At the recipe's own sequence length, which the fit below cuts, the training and validation splits of the
    demo corpus each hold a global batch (a 2% validation split once held 17 sequences of 1024 tokens on a GPU
    machine, fewer than the batch of 32)."""
    from lightning_megatron.data import GPTDataModule

    args = {**config["data"]["init_args"], "num_workers": 0}
    args.update(data_path=str(corpus_dir / args["data_path"]), tokenizer=str(corpus_dir / args["tokenizer"]))
    data = GPTDataModule(**args)
    data.setup("fit")
    for split in ("train", "valid"):
        assert len(data.datasets[split]) >= args["global_batch_size"], (split, len(data.datasets[split]))


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_on_cpu_shrunk(recipe: Path, corpus_dir: Path) -> None:
    config = yaml.safe_load(recipe.read_text())
    trainer, model = config["trainer"], config["model"]["init_args"]
    assert trainer["accelerator"] == "gpu", "a GPU recipe"
    assert model["seq_length"] == config["data"]["init_args"]["seq_length"], "model and data agree on the sequence"
    assert model["vocab_size"] == 2048, "the vocabulary of the tokenizer `make demo` trains"
    strategy = trainer["strategy"]["init_args"]
    devices = strategy.get("tensor_model_parallel_size", 1) * strategy.get("pipeline_model_parallel_size", 1)
    assert trainer["devices"] == devices, "the recipe's devices are its model-parallel size (data parallelism 1)"
    check_splits_at_full_length(config, corpus_dir)
    shrink = dict(SHRINK)
    if model.get("num_query_groups"):
        shrink["--model.init_args.num_query_groups"] = "2"
    if model.get("ffn_hidden_size"):
        shrink["--model.init_args.ffn_hidden_size"] = "176"
    run_cli(["fit", "--config", str(recipe), *(f"{k}={v}" for k, v in shrink.items())], cwd=corpus_dir, timeout=300)

    run_dir = corpus_dir / trainer["default_root_dir"]
    logs = sorted(run_dir.glob("logs/version_*"))[-1]  # this recipe's run (a re-run adds a version)
    with open(logs / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert losses and all(math.isfinite(x) for x in losses + val) and val, rows
    scan = [c for c in trainer["callbacks"] if c["class_path"].endswith("MegaScan")]
    if scan:  # every rank traced, and rank 0 reported at fit end
        traces = sorted((logs / "megascan").glob("rank*.json*"))
        assert len(traces) == devices, traces
        report = json.loads((logs / "megascan" / "megascan-report.json").read_text())
        assert len(report["per_rank"]) == devices and report["steps"], report
