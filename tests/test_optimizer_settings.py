"""Single-process unit tests (no Trainer, no process group) of strategy/optimizer.py: the user's torch optimizer
translated to megatron-core's settings and parameter-group overrides."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_megatron import MegatronConfigError
from lightning_megatron.strategy.optimizer import (
    _USER_GROUP,
    _group_overrides,
    _megatron_config_kwargs,
)


def _params(n: int = 1) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2, 2)) for _ in range(n)]


def test_megatron_kwargs_adam_coupled_weight_decay() -> None:
    """torch Adam adds weight decay to the gradient (L2), so megatron-core must not decouple it."""
    kwargs, reason = _megatron_config_kwargs(
        torch.optim.Adam(_params(), lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    )
    assert reason == ""
    assert kwargs == {
        "optimizer": "adam",
        "lr": 2e-3,
        "weight_decay": 0.05,
        "adam_beta1": 0.8,
        "adam_beta2": 0.9,
        "adam_eps": 1e-6,
        "decoupled_weight_decay": False,
    }
    decoupled, _ = _megatron_config_kwargs(torch.optim.Adam(_params(), decoupled_weight_decay=True))
    assert decoupled is not None and decoupled["decoupled_weight_decay"] is True


def test_megatron_kwargs_adamw_and_sgd() -> None:
    adamw, _ = _megatron_config_kwargs(torch.optim.AdamW(_params(), lr=1e-3, weight_decay=0.1))
    assert adamw is not None
    assert adamw["optimizer"] == "adam" and adamw["decoupled_weight_decay"] is True
    assert adamw["weight_decay"] == 0.1 and (adamw["adam_beta1"], adamw["adam_beta2"]) == (0.9, 0.999)
    sgd, reason = _megatron_config_kwargs(torch.optim.SGD(_params(), lr=0.1, momentum=0.9, weight_decay=1e-4))
    assert reason == ""
    assert sgd == {"optimizer": "sgd", "lr": 0.1, "weight_decay": 1e-4, "sgd_momentum": 0.9}


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda p: torch.optim.Adam(p, amsgrad=True), "amsgrad"),
        (lambda p: torch.optim.AdamW(p, maximize=True), "maximize"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True), "nesterov"),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
        (lambda p: torch.optim.RMSprop(p), "megatron-core has no RMSprop"),
    ],
)
def test_megatron_kwargs_refusals(make: Any, fragment: str) -> None:
    """What megatron-core cannot reproduce falls back to the torch optimizer, with the reason given."""
    kwargs, reason = _megatron_config_kwargs(make(_params()))
    assert kwargs is None
    assert fragment in reason


def _overrides_by_group(groups: list[dict[str, Any]]) -> tuple[dict[int, dict[str, Any]], dict[int, list[int]]]:
    overrides, representatives = _group_overrides(groups)
    by_group = {}
    for key, override in overrides.items():
        by_group[override[_USER_GROUP]] = {**override, "key": key}
    return by_group, representatives


def test_group_overrides_distinct_groups() -> None:
    """Each user group becomes a megatron-core group with multipliers relative to the largest lr / wd."""
    a, b, c = _params(), _params(), _params()
    groups = [
        {"params": a, "lr": 1e-3, "weight_decay": 0.1},
        {"params": b, "lr": 1e-3, "weight_decay": 0.0},
        {"params": c, "lr": 5e-4, "weight_decay": 0.05},
    ]
    by_group, representatives = _overrides_by_group(groups)
    assert representatives == {0: [0], 1: [1], 2: [2]}
    assert (by_group[0]["lr_mult"], by_group[0]["wd_mult"]) == (1.0, 1.0)
    assert (by_group[1]["lr_mult"], by_group[1]["wd_mult"]) == (1.0, 0.0)
    assert by_group[2]["lr_mult"] == pytest.approx(0.5) and by_group[2]["wd_mult"] == pytest.approx(0.5)
    key = by_group[2]["key"]
    assert key.matches(c[0], "any.name") and not key.matches(a[0], "any.name")


def test_group_overrides_merge_equal_groups() -> None:
    """Groups megatron-core cannot tell apart share one group that matches all their parameters."""
    a, b, c = _params(2), _params(), _params()
    groups = [
        {"params": a, "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
        {"params": b, "lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.95)},
        {"params": c, "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
    ]
    by_group, representatives = _overrides_by_group(groups)
    assert representatives == {0: [0, 2], 1: [1]}
    assert set(by_group) == {0, 1}
    merged = by_group[0]["key"]
    assert all(merged.matches(p, "n") for p in a + c) and not merged.matches(b[0], "n")


def test_group_overrides_zero_weight_decay_everywhere() -> None:
    by_group, _ = _overrides_by_group(
        [{"params": _params(), "lr": 0.1, "weight_decay": 0.0}, {"params": _params(), "lr": 0.05}]
    )
    assert by_group[0]["wd_mult"] == 0.0 and by_group[1]["lr_mult"] == pytest.approx(0.5)


def test_group_overrides_refuse_merging_different_betas() -> None:
    groups = [
        {"params": _params(), "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)},
        {"params": _params(), "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.999)},
    ]
    with pytest.raises(MegatronConfigError, match="groups 0 and 1") as info:
        _group_overrides(groups)
    assert "'betas'" in str(info.value)
