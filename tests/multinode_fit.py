"""A fit launched as one process per rank by a cluster launcher (torchrun, or SLURM's variables), for
``test_multinode.py``: TP2 × PP2 across two "hosts", traced by MegaScan. Writes ``rank{R}.json`` to OUT_DIR.

    python tests/multinode_fit.py OUT_DIR TRACE_DIR
"""

from __future__ import annotations

import json
import os
import sys

import lightning.pytorch as pl
import torch
from trainers import quiet_trainer

from lightning_megatron import MegatronAppStrategy
from lightning_megatron.data import SyntheticTokenDataModule
from lightning_megatron.models import GPTModule
from lightning_megatron.scan import MegaScan


def main(out_dir: str, trace_dir: str) -> None:
    torch.set_num_threads(1)
    losses: list[float] = []

    class Losses(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: object, outputs: object, *args: object) -> None:
            losses.append(float(trainer.callback_metrics["train_loss"]))

    trainer = quiet_trainer(
        devices=2,
        num_nodes=2,
        strategy=MegatronAppStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, timeout=120),
        max_steps=3,
        callbacks=[Losses(), MegaScan(trace_dir, interval=1, window=1, detect=False)],
    )
    module = GPTModule(vocab_size=128, seq_length=16, num_layers=4, hidden_size=32, num_attention_heads=4, lr=1e-2)
    trainer.fit(module, SyntheticTokenDataModule(vocab_size=128, seq_length=16, global_batch_size=8))
    rank = trainer.global_rank
    environment = type(trainer.strategy.cluster_environment).__name__
    record = {"rank": rank, "node": trainer.node_rank, "losses": losses, "environment": environment}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
