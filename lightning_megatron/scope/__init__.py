"""MegaScope: probe and perturb a parallel megatron-core model, live, while it generates or trains.

The library (no server needed)::

    from lightning_megatron.scope import capture, perturb

    with capture(module, ["blocks.*.hook_resid_post", "hook_logits"]) as cache:   # names as TransformerLens
        module.generate(prompts, 16)
    with perturb(module, "blocks.3.attn.hook_z", kind="bitflip", strength=1e-3, seed=0):
        trainer.validate(module, data)

``scope.sites`` lists the probe points, ``scope.reducers`` the reductions, ``scope.perturb`` the perturbation
kinds and the rules that keep gradients exact. The server (``lightning-megatron scope serve``), the training
callback (``MegaScope``) and the perturbation sweep build on these two context managers.
"""

from lightning_megatron.scope.capture import Record, ScopeCache, capture
from lightning_megatron.scope.perturb import KINDS, Perturbation, perturb
from lightning_megatron.scope.reducers import Reducer
from lightning_megatron.scope.sites import SITE_GROUPS

__all__ = ["KINDS", "Perturbation", "Record", "Reducer", "SITE_GROUPS", "ScopeCache", "capture", "perturb"]
