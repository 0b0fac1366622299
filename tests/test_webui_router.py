"""MegaScope's router views in a real browser: Debian's Chromium, headless, against ``lightning-megatron scope serve``
on a tiny mixture-of-experts checkpoint (4 experts, top-2, trained for 2 steps on CPU). The text view tints each
token by the expert a chosen layer's router weighted most (its k experts in the tooltip); the Router tab counts
tokens per expert per layer, and a disabled expert's column drops to zero. ``LM_WEBUI_SCREENSHOTS=docs/megascope``
keeps the screenshots the MegaScope guide shows (see ``test_webui.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from test_webui import Page, generate, prepared_checkpoint, save_shot, scope_serve
from test_webui import browser as browser_fixture  # noqa: F401  (a fixture)
from test_webui import shots as shots_fixture  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def served_moe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scope_serve(prepared_checkpoint(tmp_path_factory.mktemp("webui-moe-model"), "--moe")) as url:
        yield url


def load_table(page: Any) -> dict[int, list[int]]:
    """The Router tab's counts: layer -> tokens per expert."""
    table = page.evaluate(
        """() => Object.fromEntries([...document.querySelectorAll("[data-testid^=load-layer-]")].map((row) => [
            Number(row.dataset.testid.slice("load-layer-".length)),
            [...row.querySelectorAll("td.cell")].map((td) => Number(td.dataset.count))]))"""
    )
    return {int(layer): counts for layer, counts in table.items()}


def test_router_views_show_the_expert_per_token_and_the_load(request: pytest.FixtureRequest, served_moe: str) -> None:
    browser, shots = request.getfixturevalue("browser_fixture"), request.getfixturevalue("shots_fixture")
    ui = Page(browser, served_moe)
    try:
        moe = ui.evaluate("megascope.moe")
        assert moe == {"experts": 4, "topk": 2, "layers": [0, 1]}, moe
        ui.click("[data-testid=tab-text]")
        prompts = ["In the beginning", "And God said"]
        result = generate(ui, prompts, tokens=24)
        assert result["status"] == "done", result
        # the text view: tokens tinted by layer 1's top expert, the tooltip lists both experts with weights
        ui.select_option("[data-testid=expert-layer]", "1")
        ui.wait_for_selector("[data-testid=expert-legend]")
        tokens = ui.locator("[data-testid=output-0] .tok").count()
        tinted = ui.evaluate(
            "() => [...document.querySelectorAll('[data-testid=output-0] .tok')].map((s) => s.dataset.expert)"
        )
        # every token the model read is tinted; the last generated one was never fed back, so it has no route
        assert len(tinted) == tokens and all(e in {"0", "1", "2", "3"} for e in tinted[:-1]), tinted
        assert len(set(tinted)) >= 2, f"every token went to one expert: {tinted}"
        ui.hover("[data-testid=output-0] .tok.gen >> nth=2")
        tip = ui.inner_text("[data-testid=tooltip]")
        assert tip.count("(layer 1)") == 2 and "▸ expert" in tip and "%" in tip, tip
        save_shot(ui, shots, "router-text")
        # the Router tab: tokens per expert per layer; every position of both prompts, 2 experts each
        ui.click("[data-testid=tab-router]")
        ui.wait_for_selector("[data-testid=router-load]")
        clean = load_table(ui)
        # both prompts are routed at every position the model read (the batch's rows run together)
        read = ui.evaluate("megascope.generation.value.probes.bands.get('blocks.0.moe.hook_expert_choice').end")
        assert sorted(clean) == [0, 1]
        for layer, counts in clean.items():
            assert sum(counts) == 2 * len(prompts) * read, (layer, counts, read)
        save_shot(ui, shots, "router")
        # disable expert 0 at layer 1: it gets no token there, the other layer still uses it
        ui.click("[data-testid=tab-text]")
        ui.click("[data-testid=add-perturbation]")
        ui.select_option("[data-testid=perturbation-0-kind]", "disable")
        ui.fill("[data-testid=perturbation-0-site]", "blocks.1.moe.hook_router_logits")
        ui.fill("[data-testid=perturbation-0-experts]", "0")
        ui.check("[data-testid=perturbation-0-enabled]")
        ui.wait_for_selector("[data-testid=perturbations-active]:has-text('1 active')")
        generate(ui, prompts, tokens=24)
        ui.click("[data-testid=tab-router]")
        ui.wait_for_selector("[data-testid=router-load]")
        disabled = load_table(ui)
        assert disabled[1][0] == 0 and sum(disabled[1]) > 0, disabled
        assert disabled[0][0] > 0 or clean[0][0] == 0, (clean, disabled)
        # a bad request is refused with the field named: expert 9 of 4
        ui.click("[data-testid=tab-text]")
        ui.fill("[data-testid=perturbation-0-experts]", "9")
        ui.click("[data-testid=apply-perturbations]")
        error = ui.wait_for_selector("[data-testid=perturbation-error]")
        assert "experts" in error.inner_text() and "9 is not an expert" in error.inner_text(), error.inner_text()
        ui.errors[:] = [e for e in ui.errors if "9 is not an expert" not in e]
        ui.check_clean()
    finally:
        ui.close()
