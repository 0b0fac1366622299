"""``tp_comm_overlap`` on 2 GPUs (NCCL, bf16; skipped without them): drives ``benchmarks/tp_overlap.py`` on one TP2
transformer layer of the 1.3B GPT (hidden 2048, sequence 2048, micro batch 4), with and without sequence
parallelism, chunks 1, 2 and 4 (1: the forward's all-gather under this rank's own rows, nothing else chunked).

Parity: the overlapped layer's output, input gradient and every parameter gradient against the plain layer's from
the same weights and inputs, within bf16 tolerance (relative Frobenius error ≤ 2e-2), with the chunked primitives
counted as having run. Speed: the plain and overlapped layers alternated, median per forward+backward of the slower
rank, recorded (not asserted: whether the overlap wins decides its default) in ``$LM_RESULTS_DIR/tp_overlap_2gpu.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 or more GPUs"),
]


def test_overlapped_layer_matches_and_is_timed(tmp_path: Path) -> None:
    out = Path(os.environ.get("LM_RESULTS_DIR", tmp_path)) / "tp_overlap_2gpu.json"
    command = [sys.executable, "benchmarks/tp_overlap.py", "--out", str(out)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.exists(), (proc.stdout[-4000:], proc.stderr[-4000:])
    report = json.loads(out.read_text())
    failed = {k: v for k, v in report["parity"].items() if not v["within_tolerance"]}
    assert proc.returncode == 0 and report["all_within_tolerance"], (failed, proc.stderr[-4000:])
    variants = {f"chunks{c}" for c in (1, 2, 4)}
    assert set(report["parity"]) == {f"{layout}/{v}" for layout in ("tp2", "tp2-sp") for v in variants}
    for layout in ("tp2", "tp2-sp"):
        medians = report["speed"][layout]["median_ms_per_iteration"]
        assert set(medians) == {"off", *variants} and all(ms > 0 for ms in medians.values()), medians
