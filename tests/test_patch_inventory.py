"""The patch inventory (``lightning_megatron.compat.inventory``): every entry names a target that exists in the
installed megatron-core, Lightning and torch, an installer that exists, and a test file that exists; where a
replacement can be installed in this one CPU process without changing it for later tests, it is installed where
the entry says and restored (or put back by hand where the project never restores it)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
import torch
from trainers import quiet_trainer

from lightning_megatron.compat import inventory

ROOT = Path(__file__).resolve().parent.parent


def resolve(spec: str) -> tuple[Any, str, Any]:
    """``package.module:attr.path`` -> (the object holding the last attribute, its name, its value)."""
    module_name, _, path = spec.partition(":")
    holder: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        holder = getattr(holder, parent)
    return holder, name, holder.__dict__[name] if isinstance(holder, type) else getattr(holder, name)


@pytest.mark.parametrize("patch", inventory.PATCHES, ids=lambda p: p.target)
def test_every_entry_names_what_exists(patch: inventory.Patch) -> None:
    holder, name, value = resolve(patch.target)
    assert hasattr(holder, name), patch.target
    for other in patch.also:
        also_holder, also_name, _ = resolve(other)
        assert hasattr(also_holder, also_name), other
    _, _, installer = resolve(patch.installer)
    assert callable(installer), patch.installer
    assert patch.scope in ("process", "fit", "instance"), patch.scope
    assert patch.why and patch.restored and patch.tested
    assert (ROOT / patch.covered_by).is_file(), patch.covered_by
    if patch.scope != "instance" and patch.target.split(":")[0].startswith("megatron"):
        assert callable(value) or value is None, f"{patch.target} is no function in this megatron-core"


def test_the_table_lists_every_entry_once() -> None:
    table = inventory.markdown_table()
    assert len(table.splitlines()) == 2 + len(inventory.PATCHES)
    assert len({p.target for p in inventory.PATCHES}) == len(inventory.PATCHES)


def test_megatron_p2p_installs_on_the_class_and_restores() -> None:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    from lightning_megatron.compat import megatron_p2p

    original = P2PCommunicator.__dict__["_communicate"]
    recorder = megatron_p2p.P2PMessages()
    megatron_p2p.install(recorder)
    try:
        assert P2PCommunicator.__dict__["_communicate"] is megatron_p2p._communicate
    finally:
        megatron_p2p.uninstall(recorder)
    assert P2PCommunicator.__dict__["_communicate"] is original


def test_router_loss_scale_installs_on_the_class_and_restores() -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from lightning_megatron.compat import moe

    original, kept = MoEAuxLossAutoScaler.__dict__["set_loss_scale"], MoEAuxLossAutoScaler.main_loss_backward_scale
    moe.scale_router_loss_gradients(4)
    try:
        assert MoEAuxLossAutoScaler.__dict__["set_loss_scale"].__func__ is moe._set_loss_scale
        MoEAuxLossAutoScaler.main_loss_backward_scale = None
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.5))
        assert float(MoEAuxLossAutoScaler.main_loss_backward_scale) == 2.0
    finally:
        moe.scale_router_loss_gradients(1)
        MoEAuxLossAutoScaler.main_loss_backward_scale = kept
    assert MoEAuxLossAutoScaler.__dict__["set_loss_scale"] is original


def test_symmetric_all_reduce_installs_on_the_module_and_restores() -> None:
    from megatron.core.tensor_parallel import mappings

    from lightning_megatron.compat import symmetric_all_reduce

    original = mappings._reduce
    replacement = symmetric_all_reduce.install(None, "two_shot")
    try:
        assert mappings._reduce is replacement and symmetric_all_reduce.installed_for(None) is replacement
    finally:
        replacement.restore()
    assert mappings._reduce is original


def test_linear_layer_methods_are_set_per_instance_and_restored() -> None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from lightning_megatron.compat import megatron_linear

    layer = torch.nn.Linear(2, 2)  # the mechanism is per instance: any module shows it; the class stays untouched
    class_impl = ColumnParallelLinear.__dict__["_forward_impl"]

    def forward_impl(self: Any, *args: Any) -> str:
        return "ours"

    megatron_linear.replace(layer, forward_impl, forward=lambda self, x: "forward")
    assert megatron_linear.is_replaced(layer) and layer._forward_impl() == "ours" and layer(None) == "forward"
    megatron_linear.restore(layer)
    assert not megatron_linear.is_replaced(layer) and "forward" not in layer.__dict__
    assert ColumnParallelLinear.__dict__["_forward_impl"] is class_impl


@pytest.mark.parametrize("name", ["multi_tensor", "rope"])
def test_process_wide_replacements_install_where_stated(name: str) -> None:
    """These are never restored by the project (same arithmetic, or only filling a missing global): installed
    here, checked, and put back by hand so later tests see megatron-core as they found it."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as megatron_optimizer

    from lightning_megatron.compat import multi_tensor, rope

    saved = [
        (clip_grads, "l2_norm_impl", clip_grads.l2_norm_impl),
        (clip_grads, "multi_tensor_scale_impl", clip_grads.multi_tensor_scale_impl),
        (megatron_optimizer, "multi_tensor_scale_impl", megatron_optimizer.multi_tensor_scale_impl),
        (rope_utils, "fused_apply_rotary_pos_emb", rope_utils.fused_apply_rotary_pos_emb),
    ]
    try:
        if name == "multi_tensor":
            multi_tensor.install()
            assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
            assert megatron_optimizer.multi_tensor_scale_impl is multi_tensor.foreach_scale
        else:
            rope.install()
            from lightning_megatron.kernels.rope import apply_rotary_pos_emb

            assert rope_utils.fused_apply_rotary_pos_emb in (apply_rotary_pos_emb, saved[-1][2])
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def test_step_sync_is_wrapped_on_one_trainers_loop_only() -> None:
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    from lightning_megatron.compat.lightning import announce_step_sync

    trainer, other = quiet_trainer(), quiet_trainer()
    assert announce_step_sync(trainer, [])
    assert "_broadcast_sigterm_tensor" in vars(trainer.fit_loop.epoch_loop)
    assert "_broadcast_sigterm_tensor" not in vars(other.fit_loop.epoch_loop)
    assert "_broadcast_sigterm_tensor" in vars(_TrainingEpochLoop)
