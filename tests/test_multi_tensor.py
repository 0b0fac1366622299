"""Single-process unit tests (no Trainer, no process group) of compat/multi_tensor.py: torch's foreach kernels in place
of megatron-core's local multi-tensor fallbacks."""

from __future__ import annotations

import pytest
import torch


def test_foreach_multi_tensor_kernels_match_megatron_cores_local_fallbacks() -> None:
    """``compat.multi_tensor``: the same norm and scaled copies as megatron-core's per-tensor fallbacks (whose norm
    synchronises with the device once per tensor), and installed only over those fallbacks."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from lightning_megatron.compat import multi_tensor

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g) for n in (3, 100, 7)] + [torch.randn(5, generator=g).bfloat16()]
    flag = torch.zeros(1, dtype=torch.int)
    ours, _ = multi_tensor.foreach_l2_norm(0, flag, [tensors], False)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float()) for t in tensors]))
    assert ours.shape == (1,) and float(ours) == pytest.approx(float(expected), rel=1e-6)
    assert float(multi_tensor.foreach_l2_norm(0, flag, [[]], False)[0]) == 0.0
    fp32 = tensors[:3]
    for scale in (1.0, 0.25):
        copies = [torch.empty_like(t, dtype=torch.bfloat16) for t in fp32]
        reference = [torch.empty_like(t, dtype=torch.bfloat16) for t in fp32]
        multi_tensor.foreach_scale(0, flag, [fp32, copies], scale)
        utils.local_multi_tensor_scale(0, flag, [fp32, reference], scale)
        assert all(torch.equal(a, b) for a, b in zip(copies, reference))
        in_place = [t.clone() for t in fp32]
        multi_tensor.foreach_scale(0, flag, [in_place, in_place], scale)
        assert all(torch.equal(a, t * scale) for a, t in zip(in_place, fp32))
    assert multi_tensor.install()  # this machine has neither Transformer Engine nor Apex
    assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
    assert (
        clip_grads.multi_tensor_scale_impl is megatron_optimizer.multi_tensor_scale_impl is multi_tensor.foreach_scale
    )
    sentinel = object()  # a kernel from elsewhere (Transformer Engine, Apex) is left alone
    clip_grads.l2_norm_impl = sentinel
    try:
        multi_tensor.install()
        assert clip_grads.l2_norm_impl is sentinel
    finally:
        clip_grads.l2_norm_impl = multi_tensor.foreach_l2_norm
