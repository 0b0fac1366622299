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
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import lightning_megatron  # noqa: F401  (registers the "megatron" strategy name)
from lightning_megatron import data as _data  # noqa: F401  (makes short class names resolvable)
from lightning_megatron import models as _models  # noqa: F401
from lightning_megatron.strategy.checkpoint import CONFIG_KEY

__all__ = ["main", "SaveConfigWithCheckpoints"]


class SaveConfigWithCheckpoints(SaveConfigCallback):
    """LightningCLI's config saver, which also puts the resolved config into each checkpoint."""

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CONFIG_KEY] = self.parser.dump(self.config, skip_none=False)


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "preprocess":  # corpus preparation is not a Trainer command
        from lightning_megatron.data.preprocess import main as preprocess

        preprocess(argv[1:])
        return
    if argv and argv[0] == "scan":  # trace aggregation and slow-rank detection
        from lightning_megatron.scan.cli import main as scan

        sys.exit(scan(argv[1:]))
    if argv and argv[0] == "scope":  # MegaScope: serve a model to the web UI, perturbation sweeps
        from lightning_megatron.scope.cli import main as scope

        sys.exit(scope(argv[1:]))
    if argv and argv[0] == "dpp":  # MegaDPP: simulate the dynamic pipeline schedule's policies
        from lightning_megatron.pipeline.dpp.cli import main as dpp

        sys.exit(dpp(argv[1:]))
    if argv and argv[0] == "sample":
        from lightning_megatron.models.sampling import main as sample

        sample(argv[1:])
        return
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_callback=SaveConfigWithCheckpoints,
        save_config_kwargs={"overwrite": True},
        seed_everything_default=1234,
        args=args,
    )


if __name__ == "__main__":
    main()
