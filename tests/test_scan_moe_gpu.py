"""MegaScan names a slow expert rank on GPUs (skipped without 2 GPUs): an MoE model (8 experts, top-2) at EP2 on two
GPUs, clean and with another process multiplying matrices on rank 1's GPU (``CompetingProcess(kind="gpu")``, time
slices taken from that rank's kernels, the GPU counterpart of ``test_scan_moe.py``'s CPU limit).

The clean fit names nothing; the shared GPU's rank is named ``compute`` (its net compute, with the all-to-all
waits taken out, and its kernels' busy time longer than its peer's), and its peer is not named: it waits in the
dispatch and combine exchanges, which are blocking collectives now. Both fits trace every exchange of every MoE
layer and write tokens per expert. ``LM_RESULTS_DIR``: where the reports go (``megascan_moe_gpu.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_work import record, run_script

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

_FIT = r"""
import json, sys
sys.path.insert(0, "tests")
from cases import fit_gpt
from lightning_megatron.scan import MegaScan
from lightning_megatron.scan.evaluation.faults import CompetingProcess

mode, trace_dir = sys.argv[1], sys.argv[2]
scan = MegaScan(trace_dir, interval=1, window=1, start_step=2, gpu_busy_every=1)
callbacks = [scan] + ([CompetingProcess(ranks=[1], kind="gpu", start_step=2)] if mode == "shared" else [])
model = dict(
    vocab_size=1024, seq_length=512, num_layers=4, hidden_size=1024, num_attention_heads=8, layer_spec="sdpa",
    num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048, add_bias_linear=False,
)
out = fit_gpt(2, steps=24, precision="bf16-mixed", accelerator="gpu", model=model, callbacks=callbacks,
              data={"vocab_size": 1024, "seq_length": 512, "global_batch_size": 16}, expert_model_parallel_size=2,
              cuda_graphs=False)
report = scan.report
print("RESULT", json.dumps({
    "loss": out["loss"],
    "suspects": [[s.rank, s.kind, s.slowdown] for s in report.suspects],
    "experts": report.experts,
}))
"""


def _fit(tmp_path: Path, mode: str) -> dict[str, Any]:
    script = tmp_path / "moe_fit.py"  # a file: Lightning starts rank 1 by running sys.argv again
    script.write_text(_FIT)
    return run_script(script, mode, str(tmp_path / mode))


def test_a_shared_gpu_at_ep2_is_named_compute_and_a_clean_fit_nothing(tmp_path: Path) -> None:
    from lightning_megatron.scan.analysis.format import list_rank_files, read_rank_file

    results = {mode: _fit(tmp_path, mode) for mode in ("clean", "shared")}
    record("megascan_moe_gpu.json", tmp_path, "ep2", results)
    for mode in results:
        for rank, path in list_rank_files(tmp_path / mode).items():
            names = {e["name"] for e in read_rank_file(path) if e.get("ph") == "X"}
            for layer in (1, 2, 3, 4):
                for exchange in ("dispatch", "combine"):
                    for direction in ("forward", "backward"):
                        assert f"all_to_all layer {layer} {exchange} {direction}" in names, (mode, rank, layer)
        assert sorted(results[mode]["experts"]["layers"]) == ["1", "2", "3", "4"], results[mode]
    assert results["clean"]["suspects"] == [], results
    assert [(rank, kind) for rank, kind, _ in results["shared"]["suspects"]] == [(1, "compute")], results
