"""``lightning-megatron scope``: serve a model to the MegaScope UI, or sweep perturbations over it.

    lightning-megatron scope serve runs/gpt-tiny-cpu/checkpoints/last.ckpt
    lightning-megatron scope serve --hf ./gpt2 --devices 2 --tensor-model-parallel-size 2
    lightning-megatron scope sweep runs/gpt-tiny-cpu/checkpoints/last.ckpt --layers 0 1 2 3 \\
        --sites system calculation storage --kinds gaussian bitflip --strengths 1e-3 1e-2 1e-1 -o runs/sweep
    lightning-megatron scope sweep runs/moe/checkpoints/last.ckpt --experts all --kinds disable gaussian \\
        --strengths 1.0 --devices 2 --expert-model-parallel-size 2 -o runs/expert-sweep

``serve`` prints a URL with a token, new at each start and good for as long as the server runs, in any tab
or browser that opens it (set ``LM_SCOPE_TOKEN`` to choose it; never a command-line argument, which other users
could read in ``ps``). It listens on 127.0.0.1 unless ``--host`` says otherwise.
With ``--devices N`` Lightning starts the other ranks, which follow the serving rank's requests.
The arguments are defined in :mod:`lightning_megatron.cli_commands` (``--help`` answers without importing torch).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

__all__ = ["main", "run"]


def _load(args: argparse.Namespace, micro_batch_size: int = 1) -> Any:
    from lightning_megatron.models.loading import load_model

    layout = dict(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        expert_model_parallel_size=args.expert_model_parallel_size,
    )
    overrides = {"layer_spec": args.layer_spec} if args.layer_spec else None
    return load_model(
        args.checkpoint,
        hf=args.hf,
        tokenizer=args.tokenizer,
        devices=args.devices,
        accelerator=args.accelerator,
        precision=args.precision,
        micro_batch_size=micro_batch_size,
        model_overrides=overrides,
        **layout,
    )


def _serve(args: argparse.Namespace) -> int:
    """Rank 0 serves; the other ranks follow its commands. Ctrl-C (which a terminal sends to every rank) is
    handled by rank 0 alone: it stops the server and tells the others to leave, so every rank exits cleanly
    (a rank that dies first would make Lightning's launcher kill the rest)."""
    import signal
    import threading

    from lightning_megatron.scope import collect
    from lightning_megatron.scope.engine import ScopeEngine
    from lightning_megatron.scope.server import ScopeServer

    loaded = _load(args)
    engine = ScopeEngine(loaded.module, loaded.tokenizer, eos_id=getattr(loaded.tokenizer, "eod_id", None))
    collect.scope_group()
    if collect.rank() != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine.run_command_loop()
        return 0
    server = ScopeServer(engine, host=args.host, port=args.port, allowed_hosts=args.allowed_host or ())
    server.start()
    print(f"MegaScope is serving {args.checkpoint or args.hf} at\n    {server.url}", flush=True)
    try:
        if collect.is_distributed():
            engine.run_command_loop()
        else:
            threading.Event().wait()
    except KeyboardInterrupt:
        print("\nMegaScope: stopping", flush=True)
    finally:
        server.stop()
        if collect.is_distributed():
            try:
                collect.broadcast_from(0, ("shutdown",))  # the others wait in the command loop's broadcast
            except Exception:  # noqa: BLE001  (a rank already gone: nothing to tell it)
                pass
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from lightning_megatron.scope.sites import chunks_of, moe_layers_of
    from lightning_megatron.scope.sweep import SweepGrid, run_sweep, write_results

    loaded = _load(args, micro_batch_size=args.micro_batch_size)
    data = _validation_data(loaded, args)
    # with --experts only the MoE layers have a router to sweep (moe_layer_freq may leave some layers dense)
    every = moe_layers_of(chunks_of(loaded.module)[0].config) if args.experts is not None else None
    grid = SweepGrid(
        layers=args.layers or every or list(range(loaded.module.hparams.num_layers)),
        sites=args.sites,
        kinds=args.kinds,
        strengths=args.strengths,
        seed=args.seed,
        experts=args.experts,
    )
    clean, rows = run_sweep(loaded.trainer, loaded.module, data, grid, grad_norm=args.grad_norm)
    if loaded.trainer.is_global_zero:
        paths = write_results(Path(args.output), clean, rows)
        print(paths["md"].read_text())
        print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


def _validation_data(loaded: Any, args: argparse.Namespace) -> Any:
    """The run's own validation data (its data module from config.yaml), the first ``--batches`` batches."""
    from itertools import islice

    from lightning_megatron import data as data_package
    from lightning_megatron.errors import MegatronConfigError
    from lightning_megatron.models.loading import class_from_config
    from lightning_megatron.scope.sweep import rank_batches

    section = loaded.config.get("data")
    if not section:
        raise MegatronConfigError(
            "scope sweep needs a checkpoint of a `lightning-megatron fit` run (its data section)."
        )
    datamodule = class_from_config(section, data_package)(**section.get("init_args", {}))
    datamodule.trainer = loaded.trainer
    datamodule.setup("validate")
    return rank_batches(list(islice(iter(datamodule.val_dataloader()), args.batches)))


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``scope serve`` or ``scope sweep``; its exit status."""
    return _serve(args) if args.command == "serve" else _sweep(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from lightning_megatron.cli_commands import parse

    return run(parse("scope", argv))


if __name__ == "__main__":
    sys.exit(main())
