"""What a person sees from the ``lightning-megatron`` console script.

* A mistake (a missing file, a malformed config or corpus, an empty corpus, a misspelled option, a layout that
  does not divide the processes) ends every command with exactly one ``lightning-megatron COMMAND: error: ...``
  line naming the thing, exit status 2 and no traceback; on a multi-process run the line is printed once. A
  misspelled name (command, option, choice, configuration key, a class's ``init_args`` key) is answered with the
  closest valid one. ``LIGHTNING_MEGATRON_DEBUG=1`` / ``--debug`` bring the traceback back.
* A first run reads cleanly: ``preprocess``, a short ``fit`` of the tiny recipe (TP2 × PP2 on 4 processes) and
  ``sample`` print no third-party warnings, no advertising tips and no ``Total FLOPs: 0``; the progress bar
  shows the step and the losses.

Each command runs the real console script in a subprocess (a usage error answers before torch is imported; a
command that runs imports torch, which takes seconds).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gpt-tiny-cpu.yaml"
CORPUS = ROOT / "recipes" / "data" / "kjv.jsonl.gz"
SCRIPT = Path(sys.executable).with_name("lightning-megatron")


def cli(args: list[str], cwd: Path, *, debug: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``lightning-megatron ARGS`` as a user would: no warning filters of ours in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "LIGHTNING_MEGATRON_DEBUG")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    if debug:
        env["LIGHTNING_MEGATRON_DEBUG"] = "1"
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "lightning_megatron.cli"]
    return subprocess.run(
        [*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


ERROR_LINE = re.compile(r"lightning-megatron(?: [a-z]+)*: error: ")


def assert_one_error_line(proc: subprocess.CompletedProcess, *words: str, prefix: str = "") -> str:
    """The one ``lightning-megatron COMMAND: error: ...`` line of a failed command (starting with ``prefix``)."""
    errors = [line for line in proc.stderr.splitlines() if ERROR_LINE.match(line)]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert errors[0].startswith(prefix), errors[0]
    for word in words:
        assert word in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("mistakes")
    (base / "bad.yaml").write_text("trainer:\n  max_steps: [3\n")
    (base / "bad.jsonl").write_text('{"text": "In the beginning"}\n{"text": oops}\n')
    (base / "empty.jsonl").write_text("\n\n")
    (base / "no-text.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    return base


@pytest.mark.parametrize(
    ("args", "words"),
    [
        pytest.param(["fit", "--config", "missing.yaml"], ["missing.yaml", "does not exist"], id="fit-missing-config"),
        pytest.param(["fit", "--config", "bad.yaml"], ["malformed YAML", "bad.yaml", "line 2"], id="fit-bad-yaml"),
        pytest.param(
            ["fit", "--config", str(RECIPE), "--data.init_args.data_path=nowhere/corpus", "--trainer.devices=1"]
            + [f"--trainer.strategy.init_args.{size}_model_parallel_size=1" for size in ("tensor", "pipeline")],
            ["nowhere/corpus", "preprocess"],
            id="fit-missing-corpus",
        ),
        pytest.param(
            ["preprocess", "--input", "missing.jsonl", "--output-prefix", "out/x", "--tokenizer", "train:300"],
            ["missing.jsonl", "does not exist"],
            id="preprocess-missing-input",
        ),
        pytest.param(
            ["preprocess", "--input", "bad.jsonl", "--output-prefix", "out/x", "--tokenizer", "train:300"],
            ["bad.jsonl:2", "invalid JSON"],
            id="preprocess-bad-jsonl",
        ),
        pytest.param(
            ["preprocess", "--input", "empty.jsonl", "--output-prefix", "out/x", "--tokenizer", "train:300"],
            ["empty.jsonl", "no documents", "nothing to tokenize"],
            id="preprocess-empty-input",
        ),
        pytest.param(
            ["preprocess", "--input", "no-text.jsonl", "--output-prefix", "out/x", "--tokenizer", "train:300"],
            ["no-text.jsonl", "2 document(s) but no text (every 'text' is empty)"],
            id="preprocess-no-text",
        ),
        pytest.param(["sample", "nowhere/last.ckpt"], ["nowhere/last.ckpt", "does not exist"], id="sample-missing"),
        pytest.param(["scope", "serve", "nowhere/last.ckpt"], ["nowhere/last.ckpt", "does not exist"], id="scope"),
        pytest.param(
            ["dpp", "simulate", "--pipeline", "3", "--chunks", "2", "--microbatches", "4", "--seeds", "1"],
            ["microbatches=4", "use 3 or 6"],
            id="dpp-bad-scenario",
        ),
        pytest.param([], ["give a command", "preprocess", "sample"], id="no-command"),
    ],
)
def test_a_mistake_is_one_line(files: Path, args: list[str], words: list[str]) -> None:
    proc = cli(args, cwd=files)
    assert proc.returncode == 2, proc.stderr[-3000:]
    command = " ".join(["lightning-megatron", *args[:1]])
    assert_one_error_line(proc, *words, prefix=f"{command}: error: ")
    assert not (files / "out").exists() or not any((files / "out").iterdir()), "a failed preprocess writes nothing"


@pytest.mark.parametrize("command", ["aggregate", "detect"])
def test_scan_reports_a_missing_trace_directory_in_one_line(files: Path, command: str) -> None:
    """MegaScan's commands report their own mistakes, in the same style."""
    proc = cli(["scan", command, "nowhere"], cwd=files)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert_one_error_line(proc, "nowhere", prefix=f"lightning-megatron scan {command}: error: ")


# -- usage errors: at once, naming the subcommand, with the closest valid word -----------------------------------


@pytest.mark.parametrize(
    ("args", "prefix", "words"),
    [
        pytest.param(["fitt"], "lightning-megatron", ["unknown command 'fitt'", "did you mean 'fit'?"], id="command"),
        pytest.param(["--hepl"], "lightning-megatron", ["did you mean '--help'?"], id="top-option"),
        pytest.param(
            ["sample", "last.ckpt", "--max-new-tokens", "4", "--sed", "1"],
            "lightning-megatron sample",
            ["unrecognized arguments: --sed 1", "did you mean '--seed'?"],
            id="sample-option",
        ),
        pytest.param(
            ["scope", "servee", "last.ckpt"],
            "lightning-megatron scope",
            ["invalid choice: 'servee'", "did you mean 'serve'?"],
            id="scope-subcommand",
        ),
        pytest.param(
            ["scope", "serve", "last.ckpt", "--prot", "0"],
            "lightning-megatron scope serve",
            ["did you mean '--port'?"],
            id="scope-serve-option",
        ),
        pytest.param(
            ["scope", "sweep", "last.ckpt", "--kinds", "gausian"],
            "lightning-megatron scope sweep",
            ["did you mean 'gaussian'?"],
            id="scope-sweep-choice",
        ),
        pytest.param(
            ["scope", "sweep", "last.ckpt", "--kinds", "disable"],
            "lightning-megatron scope sweep",
            ["--kinds disable needs --experts"],
            id="scope-sweep-disable",
        ),
        pytest.param(
            ["scope", "sweep", "last.ckpt", "--experts", "all", "--sites", "system"],
            "lightning-megatron scope sweep",
            ["sites system have no experts", "--sites moe.hook_router_logits"],
            id="scope-sweep-expert-sites",
        ),
        pytest.param(
            ["scope", "sweep", "last.ckpt", "--experts", "0", "all"],
            "lightning-megatron scope sweep",
            ["--experts takes expert indices (0 1 2 3) or all, not 0 all"],
            id="scope-sweep-experts",
        ),
        pytest.param(
            ["scope", "serve"], "lightning-megatron scope serve", ["give either a checkpoint", "--hf"], id="scope-none"
        ),
        pytest.param(
            ["dpp", "simulate", "--delay", "exponentail"],
            "lightning-megatron dpp simulate",
            ["did you mean 'exponential'?"],
            id="dpp-choice",
        ),
        pytest.param(
            ["dpp", "simulate", "--delay-links", "1_0"], "lightning-megatron dpp simulate", ["SRC-DST"], id="dpp-type"
        ),
        pytest.param(
            ["preprocess", "--input", "corpus.jsonl"],
            "lightning-megatron preprocess",
            ["required: --output-prefix, --tokenizer"],
            id="preprocess-required",
        ),
        pytest.param(
            ["scan", "detect", "runs/trace", "--min-slowdwn", "0.1"],
            "lightning-megatron scan detect",
            ["did you mean '--min-slowdown'?"],
            id="scan-option",
        ),
    ],
)
def test_a_usage_error_names_the_subcommand_and_the_closest_word(
    files: Path, args: list[str], prefix: str, words: list[str]
) -> None:
    """No usage text, no parent's usage: one line, prefixed by the (sub)command that rejected the argument, with
    a pointer to its help."""
    proc = cli(args, cwd=files)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = assert_one_error_line(proc, *words, prefix=f"{prefix}: error: ")
    assert line.endswith(f"(see '{prefix} --help')") and "usage:" not in proc.stderr, proc.stderr


def test_a_misspelled_init_argument_of_the_strategy_gets_the_right_name(files: Path) -> None:
    """jsonargparse's 600-character report of a wrong ``init_args`` key becomes one short line with the name the
    class takes; a misspelled Trainer key likewise."""
    config = ["fit", "--config", str(RECIPE), "--trainer.devices=1"]
    proc = cli([*config, "--trainer.strategy.init_args.tensor_model_paralel_size=2"], cwd=files)
    line = assert_one_error_line(
        proc,
        "trainer.strategy: lightning_megatron.MegatronAppStrategy takes no argument 'tensor_model_paralel_size'",
        "did you mean 'tensor_model_parallel_size'?",
        prefix="lightning-megatron fit: error: ",
    )
    assert len(line) < 250 and proc.returncode == 2, line
    (files / "typo.yaml").write_text(RECIPE.read_text().replace("num_layers:", "num_layer:"))
    proc = cli(["fit", "--config", "typo.yaml"], cwd=files)
    assert_one_error_line(proc, "GPTModule takes no argument 'num_layer'", "did you mean 'num_layers'?")


def test_init_arguments_cover_the_base_classes() -> None:
    from lightning_megatron.cli_trainer import explain_parse_error, init_arguments

    names = init_arguments("lightning_megatron.MegatronAppStrategy")
    assert {"tensor_model_parallel_size", "micro_batch_size", "timeout"} <= set(names)
    assert init_arguments("lightning_megatron.NoSuchClass") == []
    message = "Problem with given class_path 'x.Y':\n   Option 'z' is not accepted"
    assert explain_parse_error(message, None) == "x.Y takes no argument 'z'"  # no class to suggest from


def test_a_layout_that_does_not_divide_the_processes_is_reported_once(files: Path) -> None:
    """TP2 × PP2 on 3 processes: rank 0 reports it, stops the two ranks it launched (which would report it too),
    and nothing hangs."""
    proc = cli(["fit", "--config", str(RECIPE), "--trainer.devices=3"], cwd=files, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = assert_one_error_line(proc, "world size 3", "2 × 2 = 4", prefix="lightning-megatron fit: error: ")
    assert "error: [rank" not in line and "zombies" not in proc.stderr


@pytest.mark.parametrize("how", ["environment", "flag"])
def test_debug_shows_the_traceback(files: Path, how: str) -> None:
    args = ["sample", "nowhere/last.ckpt"]
    proc = cli(args, cwd=files, debug=True) if how == "environment" else cli(["--debug", *args], cwd=files)
    assert proc.returncode != 0
    assert (
        "Traceback" in proc.stderr and "FileNotFoundError: checkpoint nowhere/last.ckpt does not exist" in proc.stderr
    )


def test_bugs_are_not_mistakes(tmp_path: Path) -> None:
    """Only the user's mistakes lose their traceback: a file missing from the installation is a broken install."""
    from lightning_megatron.cli_errors import describe, is_user_error
    from lightning_megatron.errors import MegatronConfigError

    inside = Path(sys.prefix) / "lib" / "gone.py"
    assert not is_user_error(FileNotFoundError(2, "No such file or directory", str(inside)))
    assert not is_user_error(RuntimeError("a bug")) and not is_user_error(KeyError("x"))
    missing = FileNotFoundError(2, "No such file or directory", str(tmp_path / "corpus.jsonl"))
    assert is_user_error(missing) and describe(missing) == f"{tmp_path / 'corpus.jsonl'}: no such file or directory"
    assert is_user_error(MegatronConfigError("`micro_batch_size` must be\n  positive"))
    assert (
        describe(MegatronConfigError("`micro_batch_size` must be\n  positive")) == "`micro_batch_size` must be positive"
    )


# -- a first run -----------------------------------------------------------------------------------------------------

NOISE = [
    re.compile(r"\w+Warning\b"),  # Python warnings (UserWarning: ..., FutureWarning: ...)
    re.compile(r"\.py:\d+: "),  # any warning's location, including Lightning's category-less format
    re.compile(r"Tip:"),
    re.compile(r"Total FLOPs"),
    re.compile(r"v_num"),
    re.compile(r"Epoch \d+/-"),
    re.compile(r"callbacks used to create the checkpoint"),
    re.compile(r"Traceback"),
]


def assert_clean(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    for pattern in NOISE:
        assert not pattern.search(output), f"{pattern.pattern!r} in:\n{output[-4000:]}"
    return output


def test_a_first_run_reads_cleanly(tmp_path: Path) -> None:
    """`make demo`'s three commands, the fit shortened to 4 steps with a validation after 2."""
    prefix = "runs/data/kjv"
    assert_clean(
        cli(
            ["preprocess", "--input", str(CORPUS), "--output-prefix", prefix, "--tokenizer", "train:2048"]
            + ["--append-eod", "--workers", "2"],
            cwd=tmp_path,
            timeout=120,
        )
    )
    fit = assert_clean(
        cli(
            ["fit", "--config", str(RECIPE), "--trainer.max_steps=4", "--trainer.val_check_interval=2"]
            + ["--trainer.limit_val_batches=1", "--trainer.log_every_n_steps=1"],
            cwd=tmp_path,
            timeout=180,
        )
    )
    assert re.search(r"GPTModule: [\d.]+ [KM] parameters, TP 2 × PP 2 × DP 1 on 4 processes; per rank: stage 0", fit)
    assert re.search(r"step: 4", fit) and re.search(r"train_loss:\s+\d", fit) and re.search(r"val_loss:\s+\d", fit)
    sample = assert_clean(
        cli(
            ["sample", "runs/gpt-tiny-cpu/checkpoints/last.ckpt", "--prompt", "And God said", "--max-new-tokens", "4"],
            cwd=tmp_path,
        )
    )
    assert "--- And God said" in sample
