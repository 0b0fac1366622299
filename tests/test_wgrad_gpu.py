"""The fused weight-gradient GEMM (``layers/wgrad.py``, skipped without CUDA): bf16 activations accumulate
straight into an fp32 ``main_grad`` in one GEMM.

Checked against a float64 reference on fresh random inputs (never zeros), with ``main_grad`` already holding a
random gradient (the accumulation must add, not overwrite), twice in a row: the fused path must be in use, land
within fp32 accumulation error of the reference, and be at least as accurate as megatron-core's unfused
arithmetic (a bf16 GEMM result, then an add). ``LM_RESULTS_DIR``: where the errors go (JSON).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("shape", [(8192, 2048, 2048), (4096, 8192, 2048), (4096, 2048, 50304), (1000, 96, 200)])
def test_fused_gemm_accumulates_into_fp32_main_grad(shape: tuple[int, int, int], tmp_path: Path) -> None:
    from lightning_megatron.layers.wgrad_accumulate import accumulate_weight_grad, fused_accumulation_status

    tokens, fan_in, fan_out = shape
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    weight = torch.nn.Parameter(torch.empty(fan_out, fan_in, device="cuda", dtype=torch.bfloat16))
    start = torch.randn(fan_out, fan_in, device="cuda", generator=g)
    weight.main_grad = start.clone()
    reference = start.double()
    unfused = start.clone()
    for _ in range(2):
        grad_output = torch.randn(tokens, fan_out, device="cuda", generator=g).to(torch.bfloat16)
        total_input = torch.randn(tokens, fan_in, device="cuda", generator=g).to(torch.bfloat16)
        accumulate_weight_grad(weight, grad_output, total_input)
        reference += grad_output.double().t() @ total_input.double()
        unfused += grad_output.t().matmul(total_input).float()  # megatron-core without apex
    torch.cuda.synchronize()
    status = fused_accumulation_status()
    assert status["available"], f"the fused GEMM fell back: {status['why']}"
    assert torch.isfinite(weight.main_grad).all()
    norm = reference.norm()
    fused_error = float((weight.main_grad.double() - reference).norm() / norm)
    unfused_error = float((unfused.double() - reference).norm() / norm)
    out = Path(os.environ.get("LM_RESULTS_DIR", tmp_path)) / "wgrad_fused_gemm_gpu.json"
    rows = json.loads(out.read_text()) if out.exists() else {}
    rows["x".join(map(str, shape))] = {
        "relative_error_fused": fused_error,
        "relative_error_unfused": unfused_error,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    out.write_text(json.dumps(rows, indent=1))
    assert fused_error < 1e-4, (fused_error, unfused_error)  # fp32 accumulation of exact bf16 products
    assert fused_error <= unfused_error, (fused_error, unfused_error)
