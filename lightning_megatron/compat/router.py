"""A hook point on an MoE router's logits, between its gating linear and its top-k.

Why: megatron-core's ``TopKRouter.forward`` computes ``logits = self.gating(input)`` and hands them straight to
``self.routing(logits)`` inside one module call, so no module boundary carries the logits: a forward hook on the
router sees its input (the hidden states) and its output (the top-k probabilities and the routing map), never what
the top-k chose from. MegaScope needs that tensor to capture it (``blocks.L.moe.hook_router_logits``) and to
perturb it before the choice (noise on the logits, an expert whose logit is ``-inf`` and so is never chosen).

``logits_site(router)`` gives the router's ``RouterLogitsSite``, an identity module that hooks attach to, and on
first use sets the router *instance's* ``gating`` to one that passes the logits through that site when it has hooks
(otherwise the logits go straight on: one dictionary lookup per router call). The class and every other router are
left alone; the site is not a submodule (no state-dict entries, nothing for the optimizer or checkpoints), and the
wrapper is a bound method, so a deep copy of the model gets its own site and gating.
"""

from __future__ import annotations

import types

import torch

__all__ = ["RouterLogitsSite", "logits_site"]

_SITE = "_megascope_logits_site"


class RouterLogitsSite(torch.nn.Module):
    """Identity on one router's logits ``[s, b, experts]``; forward hooks on it read or replace them."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


def _gating(self: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    logits = type(self).gating(self, input)
    site = self.__dict__[_SITE]
    return site(logits) if site._forward_hooks or site._forward_pre_hooks else logits


def logits_site(router: torch.nn.Module) -> RouterLogitsSite:
    """The logits site of ``router`` (a megatron-core ``TopKRouter``), installed on first use (idempotent)."""
    site = router.__dict__.get(_SITE)
    if site is None:
        site = RouterLogitsSite()
        object.__setattr__(router, _SITE, site)  # not registered as a submodule
        object.__setattr__(router, "gating", types.MethodType(_gating, router))
    return site
