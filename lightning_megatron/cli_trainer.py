"""The Trainer commands of ``lightning-megatron`` (fit, validate, test, predict): LightningCLI over this package's
strategy, models and data.

Imported only when one of those commands runs (it loads Lightning, torch and megatron-core), so the rest of the
command line answers at once. Models and data modules are given by class (the short names ``GPTModule`` /
``SyntheticTokenDataModule`` work), the strategy by class or by its registered name (``strategy: megatron``).
The resolved configuration is written next to the logs and into every checkpoint directory (``config.yaml``),
so a checkpoint says how it was trained. A configuration that names an argument a class does not take is
answered with the closest argument it does take.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import signal
from typing import Any

import lightning.pytorch as pl
import yaml
from lightning.pytorch.callbacks import ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from typing_extensions import override

from lightning_megatron import data as _data  # noqa: F401  (makes short class names resolvable)
from lightning_megatron import models as _models  # noqa: F401
from lightning_megatron.cli_parser import did_you_mean
from lightning_megatron.compat.lightning import ScriptLauncher
from lightning_megatron.display import LayoutSummary, step_progress_bar
from lightning_megatron.strategy import MegatronAppStrategy  # registers the "megatron" strategy name
from lightning_megatron.strategy.checkpoint import CONFIG_KEY

__all__ = ["MegatronCLI", "SaveConfigWithCheckpoints", "explain_parse_error", "run", "stop_launched_ranks"]

_LAUNCHED: list[ScriptLauncher] = []
"""Launchers of a failed Trainer command whose rank processes may still run (see ``stop_launched_ranks``)."""


class SaveConfigWithCheckpoints(SaveConfigCallback):
    """LightningCLI's config saver, which also puts the resolved config into each checkpoint."""

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CONFIG_KEY] = self.parser.dump(self.config, skip_none=False)


class MegatronCLI(LightningCLI):
    """LightningCLI with this package's display defaults, answers with "did you mean" to a misspelled argument,
    and remembers the ranks it launched if it fails.

    Defaults, each only where the configuration does not decide: the step progress bar (unless it names a
    progress bar or sets ``enable_progress_bar``), and under ``MegatronAppStrategy`` the one-line
    ``LayoutSummary`` instead of Lightning's model summary (unless it names a ``ModelSummary`` or sets
    ``enable_model_summary``).
    """

    def __init__(self, *args: Any, command: str = "", **kwargs: Any) -> None:
        self._command = command  # the subcommand, for the suggestions of parse errors
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            trainer = getattr(self, "trainer", None)
            launcher = getattr(getattr(trainer, "strategy", None), "launcher", None)
            if isinstance(launcher, ScriptLauncher) and launcher.procs:
                _LAUNCHED.append(launcher)
            raise

    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:  # jsonargparse's ArgumentError is argparse's
            raise argparse.ArgumentError(None, explain_parse_error(str(err), parser, self._command)) from None

    @override
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


# -- parse errors, shortened and with a suggestion ----------------------------------------------------------------

_CLASS_OPTION = re.compile(r"Problem with given class_path '(?P<cls>[\w.]+)': Option '(?P<key>[\w.]+)' is not accepted")
_PARSER_KEY = re.compile(r'Parser key "(?P<key>[\w.]+)"')
_NOT_ACCEPTED = re.compile(r"does not accept option '(?P<key>[\w.]+)'")


def init_arguments(class_path: str) -> list[str]:
    """The keyword arguments the class at ``class_path`` takes, its base classes' included (``[]`` if the
    class cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return []
    names: list[str] = []
    for klass in inspect.getmro(cls):
        if "__init__" in vars(klass) and klass is not object:
            try:
                parameters = inspect.signature(klass.__init__).parameters.values()
            except (TypeError, ValueError):
                continue
            kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            names += [p.name for p in parameters if p.kind in kinds and p.name != "self"]
    return names


def _subcommand_parser(parser: Any, command: str) -> Any:
    action = getattr(parser, "_subcommands_action", None)
    choices = getattr(action, "choices", None) or {}
    return choices.get(command, parser)


def explain_parse_error(message: str, parser: Any, command: str = "") -> str:
    """jsonargparse's ``message`` in one short line, with the closest valid name for a misspelled one: an
    ``init_args`` key of a class (the strategy's, the model's, ...), a configuration key, or an option."""
    message = " ".join(message.split())
    found = _CLASS_OPTION.search(message)
    if found:
        where = _PARSER_KEY.search(message)
        place = f"{where['key']}: " if where else ""
        hint = did_you_mean(found["key"], init_arguments(found["cls"]))
        return f"{place}{found['cls']} takes no argument {found['key']!r}{hint}"
    sub = _subcommand_parser(parser, command)
    found = _NOT_ACCEPTED.search(message)
    if found:
        keys = [action.dest for action in getattr(sub, "_actions", [])]
        return message + did_you_mean(found["key"], keys)
    if message.lower().startswith("unrecognized arguments: "):
        options = list(getattr(sub, "_option_string_actions", {}))
        for word in message.split(": ", 1)[1].split():
            hint = did_you_mean(word.split("=", 1)[0], options) if word.startswith("-") else ""
            if hint:
                return message + hint
    return message


# -- running ------------------------------------------------------------------------------------------------------


def stop_launched_ranks() -> bool:
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


def run(argv: list[str], from_console: bool) -> None:
    """Run ``lightning-megatron fit|validate|test|predict ...`` (``argv`` starts with the command)."""
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
        command=argv[0] if argv else "",
    )
