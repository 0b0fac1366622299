"""The command line: the tiny recipe trains through LightningCLI with Lightning's own launcher (TP2 × PP2
over 4 gloo processes), and the short strategy name works in YAML."""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


# -- the help: every command, plain text, every option explained, at once ------------------------------------------

OWN_COMMANDS = ["preprocess", "sample", "scan", "scope", "dpp"]
HELP_CALLS = [["--help"], *([name, "--help"] for name in OWN_COMMANDS)]
HELP_CALLS += [["scan", sub, "--help"] for sub in ("aggregate", "detect", "plot")]
HELP_CALLS += [["scope", "serve", "--help"], ["scope", "sweep", "--help"], ["dpp", "simulate", "--help"]]


def console(args: list[str]) -> subprocess.CompletedProcess:
    """``lightning-megatron ARGS`` through the installed console script when there is one."""
    script = Path(sys.executable).with_name("lightning-megatron")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_megatron.cli"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=120)


def test_the_help_lists_every_command_with_a_line() -> None:
    from lightning_megatron.cli_commands import COMMANDS

    proc = console(["--help"])
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  ") and len(line.split()) > 1]
    assert [name for name in listed if name in COMMANDS] == list(COMMANDS), proc.stdout
    assert set(COMMANDS) == {"fit", "validate", "test", "predict", *OWN_COMMANDS}
    for name, line in COMMANDS.items():
        assert f"  {name}" in proc.stdout and line in proc.stdout
    assert "Lightning Trainer command line tool" not in proc.stdout


@pytest.mark.parametrize("args", HELP_CALLS, ids=" ".join)
def test_help_is_plain_text(args: list[str]) -> None:
    proc = console(args)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: lightning-megatron"), proc.stderr
    assert "``" not in proc.stdout and ":class:" not in proc.stdout and ":mod:" not in proc.stdout, proc.stdout


def _actions(parser: argparse.ArgumentParser, prog: str = "") -> list[tuple[str, argparse.Action]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _actions(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            found.append((prog, action))
    return found


def test_every_option_has_help_and_shows_its_default() -> None:
    from lightning_megatron.cli_commands import parser
    from lightning_megatron.cli_parser import HelpFormatter

    formatter = HelpFormatter("lightning-megatron")
    for command in OWN_COMMANDS:
        for prog, action in _actions(parser(command), command):
            name = "/".join(action.option_strings) or action.dest
            assert action.help, f"{prog} {name}: no help"
            if action.option_strings and action.default is not None and action.default is not False:
                assert "default" in formatter._get_help_string(action), f"{prog} {name}: default not shown"


def test_the_light_parsers_offer_the_library_s_choices() -> None:
    """The parsers repeat a few constants so as not to import torch; they must stay equal to the library's."""
    from lightning_megatron import cli_commands
    from lightning_megatron.pipeline.dpp.scenario import DELAY_KINDS
    from lightning_megatron.scope.perturb import KINDS
    from lightning_megatron.scope.sites import SITE_GROUPS
    from lightning_megatron.scope.sweep import ROUTER_SITE

    assert cli_commands._DELAY_KINDS == DELAY_KINDS
    assert cli_commands._SCOPE_KINDS == KINDS
    assert set(cli_commands._SCOPE_SITES) == set(SITE_GROUPS)
    assert cli_commands._ROUTER_SITE == ROUTER_SITE


@pytest.mark.parametrize(
    "words,experts,sites",
    [
        ([], None, ["system", "calculation", "storage"]),
        (["--experts", "all", "--kinds", "disable"], "all", ["moe.hook_router_logits"]),
        (["--experts", "0", "1", "3"], [0, 1, 3], ["moe.hook_router_logits"]),
        (["--experts", "2", "--sites", "moe.hook_router_logits"], [2], ["moe.hook_router_logits"]),
        (["--sites", "hook_resid_post"], None, ["hook_resid_post"]),
    ],
    ids=["dense", "all", "indices", "router-site", "site"],
)
def test_scope_sweep_parses_experts(words: list[str], experts: object, sites: list[str]) -> None:
    """``--experts all`` or indices reach the sweep as ``"all"`` or ints; with them the sites default to the
    router's logits (the only site that takes experts)."""
    from lightning_megatron.cli_commands import parse

    args = parse("scope", ["sweep", "last.ckpt", *words])
    assert (args.experts, args.sites) == (experts, sites)
    assert args.expert_model_parallel_size == 1


HEAVY = ("torch", "lightning", "megatron", "numpy")
NO_HEAVY_IMPORTS = """
import sys
from lightning_megatron.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
else:
    code = 0
heavy = sorted({name.split(".")[0] for name in sys.modules} & set(%r))
print("HEAVY", heavy, "CODE", code)
"""


@pytest.mark.parametrize(
    "args",
    [*HELP_CALLS, ["fitt"], ["sample", "x", "--sed", "1"], ["scope", "serve"], ["dpp", "simulate", "--delay", "x"]],
    ids=" ".join,
)
def test_help_and_usage_errors_import_no_torch(args: list[str]) -> None:
    """What makes them fast: the answer comes before torch, Lightning or megatron-core would load (numpy, which
    the scan package needs, is allowed there)."""
    code = NO_HEAVY_IMPORTS % (HEAVY,)
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    line = proc.stdout.strip().splitlines()[-1]
    allowed = "['numpy']" if args[0] == "scan" else "[]"
    assert line.startswith(f"HEAVY {allowed} CODE") or line.startswith("HEAVY [] CODE"), proc.stdout + proc.stderr
    assert line.endswith("CODE 0" if "--help" in args else "CODE 2"), line


def test_help_answers_within_a_second_and_a_half() -> None:
    """Measured in a subprocess, as a user runs it: the median of 5 calls of `--help` and of a usage error. The
    target is 1.5 s; the bound leaves room for a loaded 2-core machine."""
    import statistics
    import time

    for args in (["--help"], ["scope", "serve", "--help"], ["sample", "x", "--sed", "1"]):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            proc = console(args)
            times.append(time.perf_counter() - start)
            assert proc.returncode in (0, 2), proc.stderr
        median = statistics.median(times)
        print(f"lightning-megatron {' '.join(args)}: median {median:.2f} s over 5 calls")
        assert median < 3.0, (args, times)
