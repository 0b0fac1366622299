"""``lightning-megatron``: the command line of this package.

    lightning-megatron --help                                    every command, a line each
    lightning-megatron fit --config recipes/gpt-tiny-cpu.yaml --trainer.max_steps=50
    lightning-megatron validate --config recipes/gpt-tiny-cpu.yaml --ckpt_path=runs/.../last.ckpt
    lightning-megatron preprocess --input corpus.jsonl.gz --output-prefix data/corpus --tokenizer DIR_OR_FILE
    lightning-megatron sample runs/gpt-tiny-cpu/checkpoints/last.ckpt --prompt "And God said"
    lightning-megatron scan aggregate runs/trace -o merged.json.gz
    lightning-megatron scope serve runs/gpt-tiny-cpu/checkpoints/last.ckpt
    lightning-megatron dpp simulate --chunks 2 --delay exponential --delay-mean 1

The Trainer commands (fit, validate, test, predict) are LightningCLI's (``lightning_megatron.cli_trainer``); the
others parse their arguments with the parsers of ``lightning_megatron.cli_commands``. This module imports
neither torch nor Lightning: ``--help`` and usage errors answer at once, and a command imports what it needs
only when it runs.

What a command prints on a mistake (a missing file, a malformed config or corpus, a misspelled option, a layout
that does not divide the processes): one line ``lightning-megatron COMMAND: error: ...``, with "did you mean"
for a misspelled name, and exit status 2 (``lightning_megatron.cli_errors``; ``--debug`` or
``LIGHTNING_MEGATRON_DEBUG=1`` for the traceback). ``fit`` shows a progress bar with the step and the losses and
a one-line layout summary (``lightning_megatron.display``) instead of Lightning's defaults, and none of the
third-party notices listed in ``lightning_megatron.compat.quiet``.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Optional

from lightning_megatron import __version__
from lightning_megatron.cli_commands import COMMANDS, PROG, RUNNERS, TRAINER_COMMANDS, parse
from lightning_megatron.cli_errors import DEBUG_ENV, reporting_user_errors, split_debug_flag
from lightning_megatron.cli_parser import UsageError, did_you_mean
from lightning_megatron.compat import quiet
from lightning_megatron.lazy import lazy_attributes

if TYPE_CHECKING:
    from lightning_megatron.cli_trainer import MegatronCLI, SaveConfigWithCheckpoints

__all__ = ["MegatronCLI", "SaveConfigWithCheckpoints", "help_text", "main"]

# The LightningCLI classes load Lightning: imported on first access only.
_LAZY = {
    "MegatronCLI": "lightning_megatron.cli_trainer",
    "SaveConfigWithCheckpoints": "lightning_megatron.cli_trainer",
}
__getattr__, __dir__ = lazy_attributes(globals(), _LAZY)

_HELP = ("-h", "--help")
# LightningCLI's own options, which may come before the Trainer command (``-c recipe.yaml fit``)
_TRAINER_OPTIONS = ("-c", "--config", "--print_config")

_EPILOG = f"""\
Run '{PROG} COMMAND --help' for the options of a command.
  --debug      show the traceback of an error (any command; or set LIGHTNING_MEGATRON_DEBUG=1)
  --version    print the version

First run (a tiny GPT on 4 CPU processes, tensor parallel 2 x pipeline parallel 2):
  {PROG} preprocess --input recipes/data/kjv.jsonl.gz --output-prefix runs/data/kjv \\
      --tokenizer train:2048 --append-eod
  {PROG} fit --config recipes/gpt-tiny-cpu.yaml
  {PROG} sample runs/gpt-tiny-cpu/checkpoints/last.ckpt --prompt "And God said\""""


def help_text() -> str:
    """The top-level help: what this is, every command with its line, and a first run."""
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: {PROG} COMMAND [OPTIONS]",
        "",
        "megatron-core tensor, pipeline, data and sequence parallelism as a PyTorch Lightning strategy, with",
        "MegatronApp's tools: MegaScan (tracing, slow-rank detection), MegaScope (probes and perturbations in a",
        "web UI) and MegaDPP (dynamic pipeline schedules).",
        "",
        "commands:",
        *(f"  {name:<{width}}  {line}" for name, line in COMMANDS.items()),
        "",
        _EPILOG,
    ]
    return "\n".join(lines)


def _is_trainer_option(word: str) -> bool:
    return any(word == option or word.startswith(option + "=") for option in _TRAINER_OPTIONS)


def _run(argv: list[str], from_console: bool) -> None:
    if not argv:
        raise UsageError(PROG, f"give a command: {', '.join(COMMANDS)}")
    command = argv[0]
    if command in _HELP:
        print(help_text())
    elif command == "--version":
        print(f"{PROG} {__version__}")
    elif command in RUNNERS:
        args = parse(command, argv[1:])
        module, function = RUNNERS[command].split(":")
        status = getattr(importlib.import_module(module), function)(args)
        if status:
            raise SystemExit(status)
    elif command in TRAINER_COMMANDS or _is_trainer_option(command):
        from lightning_megatron.cli_trainer import run

        run(argv, from_console)
    else:
        what = "option" if command.startswith("-") else "command"
        hint = did_you_mean(command, [*COMMANDS, *_HELP, "--version", *_TRAINER_OPTIONS])
        raise UsageError(PROG, f"unknown {what} {command!r}" + (hint or f"; the commands: {', '.join(COMMANDS)}"))


def _stop_launched_ranks() -> bool:
    """Stop the rank processes a failed Trainer command launched; whether there were any."""
    trainer = sys.modules.get("lightning_megatron.cli_trainer")  # not loaded: no Trainer command ran
    return trainer.stop_launched_ranks() if trainer is not None else False


def main(args: Optional[list[str]] = None) -> None:
    argv, debug = split_debug_flag(sys.argv[1:] if args is None else args)
    if args is None:
        # The launcher re-runs sys.argv for the other ranks: they learn about --debug from the environment.
        sys.argv[1:] = argv
        if debug:
            os.environ[DEBUG_ENV] = "1"
    quiet.quiet_cli_logs()
    command = f"{PROG} {argv[0]}" if argv and argv[0] in COMMANDS else PROG
    # From the console a failed run stops the ranks it launched and leaves at once; a Python caller keeps its process.
    stop_others = _stop_launched_ranks if args is None else (lambda: False)
    with reporting_user_errors(command, debug=debug, stop_others=stop_others):
        _run(argv, from_console=args is None)


if __name__ == "__main__":
    main()
