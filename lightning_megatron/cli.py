"""``lightning-megatron``: LightningCLI over this package's strategy, models and data.

    lightning-megatron fit --config recipes/gpt-tiny-cpu.yaml
    lightning-megatron fit --config recipes/gpt-tiny-cpu.yaml --trainer.max_steps=50
    lightning-megatron validate --config recipes/gpt-tiny-cpu.yaml --ckpt_path=runs/.../last.ckpt
    lightning-megatron preprocess --input corpus.jsonl.gz --output-prefix data/corpus --tokenizer DIR_OR_FILE
    lightning-megatron sample runs/gpt-tiny-cpu/checkpoints/last.ckpt --prompt "And God said"
    lightning-megatron scan aggregate runs/trace -o merged.json.gz    (see lightning_megatron.scan)
    lightning-megatron scope serve runs/gpt-tiny-cpu/checkpoints/last.ckpt (see lightning_megatron.scope)
    lightning-megatron dpp simulate --chunks 2 --delay exponential --delay-mean 1  (will MegaDPP help?)

Models and data modules are given by class (``model: {class_path: ..., init_args: ...}``; the short
names ``GPTModule`` / ``SyntheticTokenDataModule`` work), the strategy by class or by its registered
name (``strategy: megatron``). The resolved configuration is written next to the logs and into every
checkpoint directory (``config.yaml``), so a checkpoint says how it was trained.

What a command prints: a mistake (a missing file, a malformed config or corpus, a layout that does not divide
the processes) ends it with one ``error: ...`` line and exit status 2 (``lightning_megatron.cli_errors``;
``--debug`` or ``LIGHTNING_MEGATRON_DEBUG=1`` for the traceback). ``fit`` shows a progress bar with the step and
the losses and a one-line layout summary (``lightning_megatron.display``) instead of Lightning's defaults, and
none of the third-party notices listed in ``lightning_megatron.compat.quiet``.
"""

from __future__ import annotations

from typing_extensions import override

from lightning_megatron.compat import quiet

quiet.filter_warnings()  # before anything below imports megatron-core, whose import warns

# ruff: noqa: E402
import argparse
import os
import signal
import sys
from typing import Any, Optional

import lightning.pytorch as pl
import yaml
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from lightning_megatron import data as _data  # noqa: F401  (makes short class names resolvable)
from lightning_megatron import models as _models  # noqa: F401
from lightning_megatron.cli_errors import DEBUG_ENV, reporting_user_errors, split_debug_flag
from lightning_megatron.compat.lightning import ScriptLauncher
from lightning_megatron.display import LayoutSummary, step_progress_bar
from lightning_megatron.strategy import MegatronAppStrategy  # registers the "megatron" strategy name
from lightning_megatron.strategy.checkpoint import CONFIG_KEY

__all__ = ["main", "MegatronCLI", "SaveConfigWithCheckpoints"]

_LAUNCHED: list[ScriptLauncher] = []
"""Launchers of a failed Trainer command whose rank processes may still run (see ``_stop_launched_ranks``)."""


class SaveConfigWithCheckpoints(SaveConfigCallback):
    """LightningCLI's config saver, which also puts the resolved config into each checkpoint."""

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CONFIG_KEY] = self.parser.dump(self.config, skip_none=False)


class MegatronCLI(LightningCLI):
    """LightningCLI with this package's display defaults, and which remembers the ranks it launched if it fails.

    Defaults, each only where the configuration does not decide: the step progress bar (unless it names a
    progress bar or sets ``enable_progress_bar``), and under ``MegatronAppStrategy`` the one-line
    ``LayoutSummary`` instead of Lightning's model summary (unless it names a ``ModelSummary`` or sets
    ``enable_model_summary``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            trainer = getattr(self, "trainer", None)
            launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
            if isinstance(launcher, ScriptLauncher) and launcher.procs:
                _LAUNCHED.append(launcher)
            raise

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        section = self.config_init.get(str(self.subcommand), self.config_init).get("trainer", {})
        given = section.get("callbacks") or []
        callbacks = list(given) if isinstance(given, list) else [given]
        extra: list[Any] = []
        if section.get("enable_progress_bar") is None and not any(isinstance(c, ProgressBar) for c in callbacks):
            extra.append(step_progress_bar())
        strategy = section.get("strategy")
        ours = isinstance(strategy, MegatronAppStrategy) or strategy == MegatronAppStrategy.strategy_name
        if (
            ours
            and section.get("enable_model_summary") is None
            and not any(isinstance(c, ModelSummary) for c in callbacks)
        ):
            extra.append(LayoutSummary())
            kwargs.setdefault("enable_model_summary", False)
        if extra:
            kwargs["callbacks"] = callbacks + extra
        return super().instantiate_trainer(**kwargs)


def _stop_launched_ranks() -> bool:
    """Kill the rank processes a failed command launched (they would wait for rank 0 until the timeout).

    Lightning does this itself on Ctrl-C only. Returns whether there were any: the caller must then leave at
    once, since Lightning's child-process observer kills this process, with a message about zombies, when it
    sees its children gone.
    """
    procs = [proc for launcher in _LAUNCHED for proc in launcher.procs]
    for launcher in _LAUNCHED:
        launcher.kill(getattr(signal, "SIGKILL", signal.SIGTERM))
    _LAUNCHED.clear()
    return bool(procs)


def _check_config_files(argv: list[str]) -> None:
    """Parse the ``--config`` files first, so a malformed one is reported with its path and line
    (jsonargparse reports the YAML error of ``<unicode string>``)."""
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--config=") else None
        if arg in ("--config", "-c") and i + 1 < len(argv):
            value = argv[i + 1]
        if value is not None and os.path.isfile(value):
            with open(value) as f:
                yaml.safe_load(f)


_OWN_COMMANDS = ("preprocess", "sample", "scan", "scope", "dpp")


def _run(argv: list[str], from_console: bool) -> None:
    command = argv[0] if argv else ""
    if not argv:
        commands = ", ".join([*LightningCLI.subcommands(), *_OWN_COMMANDS])
        raise argparse.ArgumentError(None, f"give a command: {commands}")
    if command == "preprocess":  # corpus preparation is not a Trainer command
        from lightning_megatron.data.preprocess import main as preprocess

        preprocess(argv[1:])
    elif command == "scan":  # trace aggregation and slow-rank detection
        from lightning_megatron.scan.cli import main as scan

        sys.exit(scan(argv[1:]))
    elif command == "scope":  # MegaScope: serve a model to the web UI, perturbation sweeps
        from lightning_megatron.scope.cli import main as scope

        sys.exit(scope(argv[1:]))
    elif command == "dpp":  # MegaDPP: simulate the dynamic pipeline schedule's policies
        from lightning_megatron.pipeline.dpp.cli import main as dpp

        sys.exit(dpp(argv[1:]))
    elif command == "sample":
        from lightning_megatron.models.sampling import main as sample

        sample(argv[1:])
    else:
        _check_config_files(argv)
        # Parse errors raise (and reach the one-line report) instead of printing the whole usage.
        strict = {"exit_on_error": False}
        MegatronCLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_callback=SaveConfigWithCheckpoints,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=1234,
            parser_kwargs={**strict, **{name: dict(strict) for name in LightningCLI.subcommands()}},
            args=None if from_console else argv,  # None: Lightning reads sys.argv, as its launcher does
        )


def main(args: Optional[list[str]] = None) -> None:
    argv, debug = split_debug_flag(sys.argv[1:] if args is None else args)
    if args is None:
        # The launcher re-runs sys.argv for the other ranks: they learn about --debug from the environment.
        sys.argv[1:] = argv
        if debug:
            os.environ[DEBUG_ENV] = "1"
    quiet.quiet_cli_logs()
    command = " ".join(["lightning-megatron", *argv[:1]])
    # From the console a failed run stops the ranks it launched and leaves at once; a Python caller keeps its process.
    stop_others = _stop_launched_ranks if args is None else (lambda: False)
    with reporting_user_errors(command, debug=debug, stop_others=stop_others):
        _run(argv, from_console=args is None)


if __name__ == "__main__":
    main()
