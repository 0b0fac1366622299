"""Functions that run inside forked ranks for ``test_scan_files.py``: MegaScan fits with a logger, a trace
directory left to its default or given, and Kineto profiling of chosen steps."""

from __future__ import annotations

import os
from typing import Any, Optional

import cases

from lightning_megatron.scan import MegaScan

PP2 = {"pipeline_model_parallel_size": 2}  # two ranks with different coordinates: rank00001-dp0-pp1-tp0
CPU_THRESHOLDS = {"min_slowdown": 0.6, "min_impact": 0.05}  # two ranks on two shared cores (see test_scan.py)


def fit_with_logger(
    root: str,
    logger: Optional[str],
    trace_dir: Optional[str] = None,
    profile_steps: Optional[list[int]] = None,
    version_per_rank: bool = False,
    profiler: Optional[str] = None,
) -> dict[str, Any]:
    """A 2-rank PP2 fit of 4 steps under MegaScan with a ``"tensorboard"`` or ``"csv"`` logger saving under
    ``root/runs`` (None: no logger, ``default_root_dir=root``); returns where MegaScan put its files.
    ``version_per_rank``: each rank's logger names a different version (``seen-by-rankR``), as loggers that
    number versions on their own can when rank 0 made its directory first."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    loggers = {"tensorboard": TensorBoardLogger, "csv": CSVLogger}
    version = f"seen-by-rank{os.environ['RANK']}" if version_per_rank else None  # (set by distributed.py)
    run_logger = loggers[logger](save_dir=f"{root}/runs", name="gpt-tiny-cpu", version=version) if logger else False
    scan = MegaScan(trace_dir, interval=1, window=1, profile_steps=profile_steps, detect_options=CPU_THRESHOLDS)
    trainer = {"logger": run_logger, "default_root_dir": root, "log_every_n_steps": 1, "profiler": profiler}
    cases.fit_gpt(2, steps=4, callbacks=[scan], trainer=trainer, **PP2)
    return {"trace_dir": str(scan.trace_dir), "profiling": scan._profiler is not None and scan._profiler.active}


def fit_failing_while_profiling(root: str) -> dict[str, Any]:
    """Steps 2 and 3 profiled; the fit fails at the end of step 2, with the profiler running."""
    import lightning.pytorch as pl
    import torch

    class Fail(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step - 1 == 2:
                raise RuntimeError("failed in step 2")

    scan = MegaScan(f"{root}/trace", interval=1, window=1, detect=False, profile_steps=[2, 3])
    try:
        cases.fit_gpt(2, steps=4, callbacks=[scan, Fail()], **PP2)
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "profiling": scan._profiler.active, "enabled": torch.autograd._profiler_enabled()}


def refusal(root: str, **kwargs: Any) -> str:
    """The MegatronConfigError message of ``fit_with_logger(root, None, **kwargs)``."""
    from lightning_megatron import MegatronConfigError

    try:
        fit_with_logger(root, None, **kwargs)
    except MegatronConfigError as err:
        return str(err)
    return "no error"
