"""``scope sweep`` over the experts of a mixture-of-experts model: a disabled expert (or noise on its router
logit) per (layer, expert) cell, the same rows at one process and at EP2, each row the validation loss of the
same perturbation entered by hand; grids the model cannot run refused before any validation, on every rank
(real gloo ranks; the tiny 4-expert, top-2 model of ``test_scope_moe.py``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
from scope_moe_cases import MOE_STYLE, expert_sweep, expert_sweep_refusals

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope.sweep import ROUTER_SITE, SweepGrid, SweepRow, panels, write_results

SITE = f"blocks.{{layer}}.{ROUTER_SITE}"
DISABLE = dict(layers=[0, 2], sites=[ROUTER_SITE], kinds=["disable"], strengths=[0.5, 1.0], experts="all")
HAND = [
    dict(site=SITE.format(layer=2), kind="disable", layers=(2,), experts=(3,)),
    dict(site=SITE.format(layer=0), kind="disable", layers=(0,), experts=(1,)),
]


@pytest.fixture(scope="module")
def one_process(ranks: Any) -> dict:
    return ranks.run(1, expert_sweep, 1, MOE_STYLE, DISABLE, HAND)[0]


def test_a_disable_sweep_has_one_row_per_layer_and_expert(one_process: dict) -> None:
    rows = one_process["rows"]
    assert [(r.layer, r.expert, r.kind, r.strength) for r in rows] == [
        (layer, e, "disable", 0.0) for layer in (0, 2) for e in range(4)
    ], "disable has no strength: one cell per (layer, expert)"
    for row in rows:
        assert math.isfinite(row.val_loss) and row.delta_loss == pytest.approx(row.val_loss - one_process["clean"])
    assert all(abs(r.delta_loss) > 1e-4 for r in rows), "disabling an expert changed nothing"
    assert len({round(r.val_loss, 6) for r in rows}) == len(rows), "every (layer, expert) is its own cell"


def test_a_row_is_the_validation_loss_under_that_expert_disabled_by_hand(one_process: dict) -> None:
    by_cell = {(r.layer, r.expert): r.val_loss for r in one_process["rows"]}
    for spec, hand in zip(HAND, one_process["by_hand"]):
        want = by_cell[(spec["layers"][0], spec["experts"][0])]
        assert hand == pytest.approx(want, rel=1e-6, abs=0), spec


def test_ep2_gives_the_rows_of_one_process(ranks: Any, one_process: dict) -> None:
    results = ranks.run(2, expert_sweep, 2, MOE_STYLE, DISABLE, [], expert_model_parallel_size=2)
    for rank, got in enumerate(results):
        assert got["clean"] == pytest.approx(one_process["clean"], rel=1e-5), rank
        assert len(got["rows"]) == len(one_process["rows"])
        for mine, want in zip(got["rows"], one_process["rows"]):
            assert (mine.layer, mine.expert, mine.kind) == (want.layer, want.expert, want.kind)
            assert mine.val_loss == pytest.approx(want.val_loss, rel=1e-5), (rank, mine, want)


def test_noise_on_one_expert_s_logit_is_a_cell_per_strength(ranks: Any) -> None:
    grid = dict(layers=[2], sites=[ROUTER_SITE], kinds=["gaussian"], strengths=[0.0, 4.0], experts=[1, 3], seed=2)
    hand = [dict(site=SITE.format(layer=2), kind="gaussian", strength=4.0, seed=2, layers=(2,), experts=(3,))]
    got = ranks.run(1, expert_sweep, 1, MOE_STYLE, grid, hand)[0]
    rows = {(r.expert, r.strength): r for r in got["rows"]}
    assert sorted(rows) == [(1, 0.0), (1, 4.0), (3, 0.0), (3, 4.0)]
    assert rows[(1, 0.0)].delta_loss == 0 and rows[(3, 0.0)].delta_loss == 0, "strength 0 is exactly clean"
    assert abs(rows[(3, 4.0)].delta_loss) > 1e-4 and rows[(1, 4.0)].val_loss != rows[(3, 4.0)].val_loss
    assert got["by_hand"][0] == pytest.approx(rows[(3, 4.0)].val_loss, rel=1e-6, abs=0)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, dict(expert_model_parallel_size=2))], ids=["one", "ep2"])
def test_grids_the_model_cannot_run_are_refused_before_validating(ranks: Any, world: int, layout: dict) -> None:
    results = ranks.run(world, expert_sweep_refusals, world, world == 1, **layout)
    assert all(r == results[0] for r in results), "every rank refuses alike"
    got = results[0]
    assert "SweepGrid(experts=[1, 4]): [4] are not experts of this model (experts 0..3)" in got[0], got
    assert "SweepGrid(layers=[0, 1]): layers [1] have a dense MLP and no router" in got[1], got
    assert "mixture-of-experts layers are [0, 2, 3]" in got[1], got
    if world == 1:
        assert "SweepGrid(experts=...) needs a mixture-of-experts model (num_moe_experts is not set)" in got[2], got


@pytest.mark.parametrize(
    "grid,words",
    [
        (dict(kinds=["disable"]), ["kinds=[..., 'disable']) needs experts=", "--experts"]),
        (dict(sites=["system", ROUTER_SITE], experts=[0]), ["sites ['system'] have no experts", ROUTER_SITE]),
        (dict(sites=[ROUTER_SITE], experts="every"), ["experts='every'", "'all'"]),
        (dict(sites=[ROUTER_SITE], experts=[]), ["experts=[]"]),
    ],
    ids=["disable-without-experts", "experts-on-other-sites", "experts-word", "no-experts"],
)
def test_a_grid_refuses_experts_where_they_mean_nothing(grid: dict, words: list[str]) -> None:
    with pytest.raises(MegatronConfigError) as error:
        SweepGrid(layers=[0], **grid)
    for word in words:
        assert word in str(error.value)


def test_results_carry_the_expert_and_draw_layer_by_expert_panels(tmp_path: Path) -> None:
    rows = [
        SweepRow(layer, ROUTER_SITE, kind, s, 4.0 + d, d, expert=e)
        for layer in (0, 2)
        for e in range(4)
        for kind, s, d in (("disable", 0.0, 0.1 * (e + 1) + layer), ("gaussian", 1.0, 0.01 * e))
    ]
    paths = write_results(tmp_path, 4.0, rows)
    with open(paths["csv"]) as f:
        read = list(csv.DictReader(f))
    assert [int(r["expert"]) for r in read] == [r.expert for r in rows]
    assert "| layer | expert | site |" in paths["md"].read_text()
    assert "| 2 | 3 | moe.hook_router_logits | disable | – |" in paths["md"].read_text()
    assert paths["png"].stat().st_size > 10_000
    drawn = panels(rows)
    assert [p.title for p in drawn] == [f"{ROUTER_SITE} · disable", f"{ROUTER_SITE} · gaussian 1"]
    assert drawn[0].layers == [0, 2] and drawn[0].columns == ["0", "1", "2", "3"] and drawn[0].column_label == "expert"
    assert drawn[0].values[1][3] == pytest.approx(2.4)
    dense = panels([SweepRow(1, "system", "gaussian", 0.1, 4.5, 0.5)])
    assert dense[0].column_label == "strength" and dense[0].values == [[0.5]]
