"""MegaScan's GPU recorder writes the queue fields that tell a host-paced span from a slow GPU (skipped without
CUDA): every compute span of a traced GPU fit has ``enqueue_us`` and ``queued_us``; a GPU-bound model keeps its
GPU behind a queue (most spans reached well after the host queued them), so its spans are not host-paced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_gpu_spans_carry_enqueue_and_queue_times(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_megatron import MegatronAppStrategy
    from lightning_megatron.data import SyntheticTokenDataModule
    from lightning_megatron.models import GPTModule
    from lightning_megatron.scan import MegaScan
    from lightning_megatron.scan.format import list_rank_files, read_rank_file
    from lightning_megatron.scan.measure import host_pacing, read_traces

    shape = dict(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=2048, vocab_size=32000)
    scan = MegaScan(tmp_path / "trace", interval=1, window=1, detect=False)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        strategy=MegatronAppStrategy(micro_batch_size=2),
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[scan],
    )
    data = SyntheticTokenDataModule(vocab_size=32000, seq_length=2048, global_batch_size=8, num_train_samples=64)
    trainer.fit(GPTModule(**shape, layer_spec="sdpa"), data)
    (path,) = list_rank_files(tmp_path / "trace").values()
    compute = [e for e in read_rank_file(path) if e.get("ph") == "X" and e.get("cat") == "compute"]
    assert compute and all({"enqueue_us", "queued_us"} <= set(e["args"]) for e in compute)
    assert all(e["args"]["enqueue_us"] >= 0 for e in compute)
    pacing = host_pacing(read_traces(tmp_path / "trace", []))
    assert pacing[0] < 0.5, pacing  # a GPU-bound model: the GPU, not the host, paces most spans
