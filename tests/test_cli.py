"""The command line: the tiny recipe trains through LightningCLI with Lightning's own launcher (TP2 × PP2
over 4 gloo processes), and the short strategy name works in YAML."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gpt-tiny-cpu.yaml"


def run_cli(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_megatron.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_tiny_recipe_trains_through_the_cli(tmp_path: Path) -> None:
    """The recipe's steps, shortened: tokenize the corpus, train at TP2 × PP2 (the loss falls), sample from the
    checkpoint in one process (it loads at another layout) with the config the checkpoint carries."""
    corpus = ROOT / "recipes" / "data" / "kjv.jsonl.gz"
    prefix = "runs/data/kjv"
    run_cli(
        [
            "preprocess",
            "--input",
            str(corpus),
            "--output-prefix",
            prefix,
            "--tokenizer",
            "train:2048",
            "--append-eod",
            "--quiet",
        ],
        cwd=tmp_path,
    )
    run_cli(
        [
            "fit",
            "--config",
            str(RECIPE),
            "--trainer.max_steps=40",
            "--trainer.val_check_interval=20",
            "--trainer.limit_val_batches=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.dirpath=runs/gpt-tiny-cpu/checkpoints",
            "--trainer.callbacks.every_n_train_steps=20",
        ],
        cwd=tmp_path,
    )
    run_dir = tmp_path / "runs" / "gpt-tiny-cpu"
    with open(next(run_dir.glob("logs/version_*/metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) >= 3 and losses[-1] < losses[0] - 0.5, losses
    assert any(r.get("val_loss") for r in rows), "validation ran"
    checkpoint = run_dir / "checkpoints" / "epoch=0-step=40.ckpt"
    assert (checkpoint / "trainer_state.pt").exists()
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 40
    assert saved["trainer"]["strategy"]["init_args"]["tensor_model_parallel_size"] == 2
    sampled = run_cli(["sample", str(checkpoint), "--prompt", "And God said", "--max-new-tokens", "12"], cwd=tmp_path)
    lines = [line for line in sampled.stdout.splitlines() if line.startswith("--- ")]
    assert (
        len(lines) == 1 and lines[0].startswith("--- And God said") and len(lines[0]) > len("--- And God said") + 5
    ), lines
    check_scope_sweep(checkpoint, tmp_path)
    check_scope_serve(checkpoint, tmp_path)


def check_scope_sweep(checkpoint: Path, cwd: Path) -> None:
    """`scope sweep` on the run's own validation data writes the table, the CSV and the heat map."""
    out = cwd / "sweep"
    args = ["scope", "sweep", str(checkpoint), "--layers", "0", "3", "--sites", "system", "storage"]
    run_cli([*args, "--strengths", "0.5", "--batches", "1", "--grad-norm", "-o", str(out)], cwd=cwd)
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["layer"], r["site"]) for r in rows] == [
        ("0", "system"),
        ("0", "storage"),
        ("3", "system"),
        ("3", "storage"),
    ]
    assert all(float(r["grad_norm"]) > 0 for r in rows)
    assert max(abs(float(r["delta_loss"])) for r in rows) > 1e-3, "a strength-0.5 perturbation moves the loss"
    assert (out / "sweep.png").stat().st_size > 10_000 and "| layer |" in (out / "sweep.md").read_text()


def check_scope_serve(checkpoint: Path, cwd: Path) -> None:
    """`scope serve` at TP2 on two processes answers a real client; a perturbation changes the text and turning
    it off restores it; Ctrl-C ends every rank."""
    import re
    import signal

    from lightning_megatron.scope.client import ScopeClient

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "lightning_megatron.cli", "scope", "serve", str(checkpoint), "--port", "0"]
    command += ["--accelerator", "cpu", "--devices", "2", "--tensor-model-parallel-size", "2"]
    proc = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            found = re.search(r"http://127\.0\.0\.1:\d+/\?token=[\w-]+", line)
            if found:
                url = found.group(0)
                break
        assert url, "the server printed its address"
        request = {"type": "generate", "prompts": ["And God said", "In the"], "max_new_tokens": 8}
        perturbation = {"site": "storage", "kind": "gaussian", "strength": 0.5, "seed": 1, "layers": [0]}
        texts = {}
        with ScopeClient(url) as client:
            for name, perturbations in (("clean", []), ("noisy", [perturbation]), ("off", [])):
                client.send(
                    {
                        "type": "set_perturbations",
                        "id": f"p{name}",
                        "perturbations": [{**p, "enabled": True} for p in perturbations],
                    }
                )
                assert client.next_event(60)["type"] == "ack"
                client.send({"id": name, **request})
                events = list(client.events(timeout=120))
                assert events[-1]["type"] == "finish", events[-1]
                texts[name] = events[-1]["texts"]
        assert texts["clean"][0].startswith("And God said") and texts["noisy"] != texts["clean"]
        assert texts["off"] == texts["clean"]
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0


def test_strategy_by_registered_name(tmp_path: Path) -> None:
    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "strategy": "megatron",
            "max_steps": 2,
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "limit_val_batches": 0,
        },
        "model": {"class_path": "GPTModule", "init_args": {"vocab_size": 128, "seq_length": 16, "num_layers": 2}},
        "data": {"class_path": "SyntheticTokenDataModule", "init_args": {"vocab_size": 128, "seq_length": 16}},
    }
    path = tmp_path / "by-name.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_cli(["fit", "--config", str(path)], cwd=tmp_path, timeout=300)
    assert "max_steps=2" in proc.stdout + proc.stderr
