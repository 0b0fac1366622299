"""MegaScope's web UI: the bundle shipped in the package, and the page in a real browser.

* The bundle (``lightning_megatron/scope/static``) is what ``webui/`` builds: its stamp names the sources,
  lockfile and schema it was built from and every bundle file's hash, checked here without Node
  (``.ci/run`` also rebuilds it with Node and compares). A wheel carries the bundle and the schema.
* Debian's Chromium, headless, driven by Playwright (its own browser download cannot work here) against real
  servers on 127.0.0.1, each in a subprocess (``webui_cases.py``): ``lightning-megatron scope serve`` on a
  tiny checkpoint trained for 2 steps, a CPU fit followed by the ``MegaScope`` callback, and a
  GPT-2-medium-shaped replay for the jank measurement. A missing browser fails these tests; it does not
  skip them (set ``LM_CHROMIUM`` to use another binary).

Screenshots of every view go to a temporary folder (``LM_WEBUI_SCREENSHOTS=DIR`` keeps small copies in DIR,
e.g. ``docs/megascope``; ``LM_WEBUI_CHECKPOINT=DIR`` serves that checkpoint instead of the 2-step one, for
screenshots of a trained model).
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from webui_cases import Background, RunQueueWait, cpu_snapshot, foreign_load, main_thread_cpu, stream_events

ROOT = Path(__file__).resolve().parents[1]
WEBUI = ROOT / "webui"
STATIC = ROOT / "lightning_megatron" / "scope" / "static"
SCHEMA = ROOT / "lightning_megatron" / "scope" / "schema" / "megascope-v1.schema.json"
CHROMIUM = os.environ.get("LM_CHROMIUM", "/usr/bin/chromium")
TOKEN = "webui-test-token-0123456789abcdef"
VIEWPORT = {"width": 1400, "height": 880}
LONG_FRAME_MS = 100.0

# -- the bundle: stamp, files, wheel (no Node, no browser) --------------------------------------------------
SOURCE_FILES = ["index.html", "package.json", "package-lock.json", "tsconfig.json", "vite.config.ts"]
SOURCE_DIRS = ["src", "public", "scripts"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def webui_sources() -> dict[str, str]:
    """``webui/scripts/sources.mjs`` in Python: relative path → sha256 of the content (CRLF read as LF)."""
    paths = [WEBUI / name for name in SOURCE_FILES if (WEBUI / name).is_file()]
    for folder in SOURCE_DIRS:
        for path in sorted((WEBUI / folder).rglob("*")):
            rel = path.relative_to(WEBUI)
            if path.is_file() and not any(part.startswith(".") for part in rel.parts):
                paths.append(path)
    return {p.relative_to(WEBUI).as_posix(): _sha256(p.read_bytes().replace(b"\r\n", b"\n")) for p in paths}


def sources_digest(files: dict[str, str]) -> str:
    return _sha256("".join(f"{rel}\0{files[rel]}\n" for rel in sorted(files)).encode())


def bundle_files() -> dict[str, str]:
    return {
        p.relative_to(STATIC).as_posix(): _sha256(p.read_bytes())
        for p in sorted(STATIC.rglob("*"))
        if p.is_file() and p.name != "BUILD_STAMP.json"
    }


def load_stamp() -> dict[str, Any]:
    path = STATIC / "BUILD_STAMP.json"
    assert path.is_file(), "no lightning_megatron/scope/static/BUILD_STAMP.json: build the UI (make webui)"
    return json.loads(path.read_text())


REBUILD = (
    "rebuild the bundle: `make webui` (cd webui && npm ci && npm run build) and commit lightning_megatron/scope/static"
)


def test_bundle_was_built_from_these_sources() -> None:
    """Editing webui/ (or the lockfile, or the protocol schema its types come from) without rebuilding fails."""
    stamp = load_stamp()
    files = webui_sources()
    changed = sorted(f for f in set(files) | set(stamp["sources"]) if files.get(f) != stamp["sources"].get(f))
    assert not changed, f"webui/ changed since the bundle was built ({', '.join(changed)}): {REBUILD}"
    assert stamp["sources_sha256"] == sources_digest(files)
    assert stamp["schema_sha256"] == _sha256(SCHEMA.read_bytes()), f"the protocol schema changed: {REBUILD}"
    assert "package-lock.json" in files, "webui/package-lock.json is committed"


def test_bundle_files_are_the_built_ones() -> None:
    """Every file under static/ is listed in the stamp with its hash (nothing edited by hand, nothing stale),
    and the page obeys the server's CSP: scripts only from /static/, no inline script or handler."""
    stamp = load_stamp()
    assert bundle_files() == stamp["bundle"], REBUILD
    html = (STATIC / "index.html").read_text()
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, flags=re.S)
    assert scripts and all('src="/static/' in attrs and not body.strip() for attrs, body in scripts), html
    assert not re.search(r"\son[a-z]+\s*=", html), "inline event handlers are blocked by the CSP"
    assert "modulepreload" not in html.lower() or "polyfill" not in html.lower()
    assets = [name for name in stamp["bundle"] if name.startswith("assets/")]
    assert any(name.endswith(".js") for name in assets) and any(name.endswith(".css") for name in assets)
    for name in assets:
        if name.endswith(".js"):
            text = (STATIC / name).read_text(errors="replace")
            assert "new Function(" not in text and "eval(" not in text, f"{name}: the CSP forbids eval"


def test_wheel_carries_the_bundle_and_the_schema(tmp_path: Path) -> None:
    """A wheel built from the tree (pip wheel: the package install, C++ extension included) holds the UI."""
    tree = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info", "build", ".*")
    for name in ("lightning_megatron", "native"):
        shutil.copytree(ROOT / name, tree / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, tree / name)
    out = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(tree)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = out.glob("lightning_megatron-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"lightning_megatron/scope/static/{name}" for name in load_stamp()["bundle"]}
    expected |= {
        "lightning_megatron/scope/static/BUILD_STAMP.json",
        "lightning_megatron/scope/schema/megascope-v1.schema.json",
    }
    assert expected <= names, sorted(expected - names)


def test_replay_stream_follows_the_schema() -> None:
    """The synthetic GPT-2-medium stream of the jank test is made of valid protocol events."""
    from lightning_megatron.scope.protocol import encode_event, validate_event

    request = {"id": "r1", "prompts": ["a", "b"], "max_new_tokens": 3, "attention": {"layers": [0, 23]}, "pca": True}
    kinds: dict[str, int] = {}
    for _, events in stream_events(request):
        for event in events:
            encoded = {**encode_event(event), "v": 1}
            validate_event(encoded)
            kinds[event["type"]] = kinds.get(event["type"], 0) + 1
    # 3 positions: prefill + 2 decode steps; 72 default probe events per forward pass; 24 PCA layers
    assert kinds["token"] == 3 and kinds["probe"] == 3 * 72 and kinds["pca"] == 24 and kinds["finish"] == 1
    assert kinds["attention"] == 2 * (16 + 2)  # prefill rows in 64-row chunks (1,021 queries), then one row each


def test_streamed_text_shows_each_character_whole(tmp_path: Path) -> None:
    """Token by token, a byte-level BPE row's text never shows U+FFFD for a character split over tokens: the
    tokens before the last of its bytes add nothing, that one adds the character, and the shares add up to the
    text (what `scope serve` streams as each token's ``text``)."""
    from lightning_megatron.data.tokenizers import train_bpe_tokenizer
    from lightning_megatron.scope.engine import StreamedText

    tokenizer = train_bpe_tokenizer(["the wroth of the people, and the lord said"] * 50, 300, tmp_path)
    text = "And he was wroth — “Lord” naïve ☃ 日本 and"
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text has characters split over tokens"
    row = StreamedText(tokenizer.decode, ids[:3])  # a prompt, then the rest token by token as generated
    shares = [*row.shares, *(row.push(i) for i in ids[3:])]
    assert "".join(shares) == text
    assert not any("\ufffd" in share for share in shares), shares
    assert "" in shares and "☃" in shares and "日" in shares
    lone = StreamedText(tokenizer.decode, tokenizer.encode("a"))
    assert lone.push(tokenizer.encode("☃")[0]) == "" and lone.push(tokenizer.encode(" ")[0]) == "\ufffd ", (
        "a byte never completed is shown (as U+FFFD) once the next token shows it cannot be"
    )


# -- browser fixtures ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("megascope-screenshots")


def save_shot(page: Any, shots: Path, name: str, full_page: bool = False) -> Path:
    """A screenshot in the test's folder; with LM_WEBUI_SCREENSHOTS also a palette PNG (< 300 KB) there."""
    name = f"ui-{name}"
    path = shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    keep = os.environ.get("LM_WEBUI_SCREENSHOTS")
    if keep:
        target = Path(keep) / f"{name}.png"
        target.parent.mkdir(parents=True, exist_ok=True)
        _small_png(path, target)
        assert target.stat().st_size < 300_000, f"{target} is {target.stat().st_size} bytes"
    return path


def _small_png(source: Path, target: Path, limit: int = 300_000) -> None:
    """The screenshot as is when small enough, else with a 256-colour palette, else also scaled down."""
    from PIL import Image

    with Image.open(source) as image:
        rgb = image.convert("RGB")
        rgb.save(target, optimize=True)
        scale = 1.0
        while target.stat().st_size >= limit and scale > 0.4:
            shown = (
                rgb if scale == 1.0 else rgb.resize((int(rgb.width * scale), int(rgb.height * scale)), Image.LANCZOS)
            )
            shown.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
                target, optimize=True
            )
            scale -= 0.15


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium under Playwright. Missing: the suite fails (the CI installs it; see .ci/run)."""
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set LM_CHROMIUM)", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright for Python is missing: pip install -e '.[dev]'", pytrace=False)
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        yield instance
        instance.close()


CSP_WATCH = """
window.__cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => __cspViolations.push(e.violatedDirective + " " + e.blockedURI));
"""


class Page:
    """A browser page on the UI with its console errors and CSP violations collected."""

    def __init__(self, browser: Any, url: str) -> None:
        self.context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
        self.page = self.context.new_page()
        self.page.set_default_timeout(30_000)
        self.errors: list[str] = []
        self.page.on("pageerror", lambda error: self.errors.append(f"pageerror: {error}"))
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.add_init_script(CSP_WATCH)
        self.response = self.page.goto(url)
        self.page.wait_for_selector("[data-testid=connection][data-state=connected]")
        self.page.wait_for_selector("[data-testid=model]:not(:empty)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.page, name)

    def check_clean(self) -> None:
        violations = self.page.evaluate("window.__cspViolations")
        assert not violations, f"CSP violations: {violations}"
        assert not self.errors, self.errors

    def close(self) -> None:
        self.context.close()


def canvas_ink(page: Any, selector: str) -> float:
    """Fraction of a canvas's pixels that differ from its most common colour (0: blank)."""
    return page.evaluate(
        """(selector) => {
            const c = document.querySelector(selector);
            const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
            const counts = new Map();
            for (let i = 0; i < data.length; i += 4) {
                const key = (data[i] << 16) | (data[i + 1] << 8) | data[i + 2];
                counts.set(key, (counts.get(key) || 0) + 1);
            }
            const top = Math.max(...counts.values());
            return 1 - top / (data.length / 4);
        }""",
        selector,
    )


def generate(page: Any, prompts: list[str], tokens: int, timeout: float = 60_000) -> dict[str, Any]:
    """Fill the form, press Generate, wait for the end; returns the generation's texts and status."""
    page.evaluate("(n) => { megascope.settings.prompts.splice(n); }", len(prompts))
    for i, text in enumerate(prompts):
        if page.locator(f"[data-testid=prompt-{i}]").count() == 0:
            page.click("[data-testid=add-prompt]")
        page.fill(f"[data-testid=prompt-{i}]", text)
    page.fill("[data-testid=max-new-tokens]", str(tokens))
    before = page.evaluate("megascope.generation.value ? megascope.generation.value.id : null")
    page.click("[data-testid=generate]")
    page.wait_for_function(
        "(before) => { const g = megascope.generation.value; return g && g.id !== before && !g.running; }",
        arg=before,
        timeout=timeout,
    )
    # the views catch up on the next frames
    page.evaluate(
        "new Promise((done) => setTimeout(() => requestAnimationFrame(() => requestAnimationFrame(done)), 100))"
    )
    return page.evaluate(
        """() => { const g = megascope.generation.value;
            return {status: g.status, error: g.error, texts: g.prompts.map((p, i) => g.continuation(i)),
                    ids: g.prompts.map((p) => p.cells.filter((c) => c && !c.inPrompt).map((c) => c.id))}; }"""
    )


# -- a real `scope serve` on a 2-step checkpoint ------------------------------------------------------------
def prepared_checkpoint(out: Path, *flags: str) -> list[str]:
    """Train ``webui_cases.py prepare`` 's tiny model for 2 steps into ``out`` (``--moe``: its mixture of
    experts); the ``scope serve`` arguments of the checkpoint it saved."""
    prepare = Background([str(ROOT / "tests" / "webui_cases.py"), "prepare", str(out), *flags])
    try:
        code = prepare.join(timeout=300)
    finally:
        prepare.stop()
    assert code == 0, prepare.output()
    return [str(out / "ckpt" / "last.ckpt"), "--tokenizer", str(out / "tokenizer.json")]


@contextmanager
def scope_serve(args: list[str]) -> Iterator[str]:
    """``lightning-megatron scope serve ARGS`` (a subprocess) on 127.0.0.1; yields the URL it printed."""
    server = Background(
        ["-m", "lightning_megatron.cli", "scope", "serve", *args, "--port", "0"], env={"LM_SCOPE_TOKEN": TOKEN}
    )
    try:
        match = server.wait_for(r"(http://127\.0\.0\.1:\d+/\?token=\S+)", timeout=300)
        yield match.group(1)
    finally:
        server.proc.terminate()
        server.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The page's server on ``LM_WEBUI_CHECKPOINT``, or on a checkpoint prepared here."""
    checkpoint = os.environ.get("LM_WEBUI_CHECKPOINT")
    args = [checkpoint] if checkpoint else prepared_checkpoint(tmp_path_factory.mktemp("webui-model"))
    with scope_serve(args) as url:
        yield url


@pytest.fixture(scope="module")
def ui(browser: Any, served: str) -> Iterator[Page]:
    page = Page(browser, served)
    # the default probes' sites at 32 bins (a divisor of the small models' hidden sizes)
    page.evaluate(
        "megascope.settings.sites = ['hook_attn_out', 'hook_mlp_out', 'hook_resid_post']; megascope.settings.bins = 32"
    )
    yield page
    page.close()


def test_page_needs_the_token(browser: Any, served: str, shots: Path) -> None:
    """Without the token the server refuses the page (401, 403 when wrong) and no UI code runs; with it the
    page loads, connects, removes the token from the address bar, and the CSP blocks nothing it needs."""
    base = served.split("?")[0]
    for url, status in ((base, 401), (base + "?token=wrong-token-0123456789", 403)):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(url, timeout=10)
        assert refused.value.code == status
        context = browser.new_context(viewport=VIEWPORT)
        page = context.new_page()
        response = page.goto(url)
        assert response.status == status
        assert page.locator("#app").count() == 0 and page.locator("script").count() == 0
        assert ("Open the address" if status == 401 else "Wrong token") in page.inner_text("body")
        if status == 401:
            save_shot(page, shots, "refused")
        context.close()
    page = Page(browser, served)
    try:
        assert page.response.status == 200
        assert "token" not in page.url, page.url
        assert "2 layers" in page.inner_text("[data-testid=model]") or os.environ.get("LM_WEBUI_CHECKPOINT")
        headers = page.response.headers
        assert "script-src 'self'" in headers["content-security-policy"]
        assert page.evaluate("typeof megascope.client") == "object"
        page.check_clean()
    finally:
        page.close()


def test_a_prompt_streams_tokens(ui: Page, shots: Path) -> None:
    """Generated tokens appear one by one (over many frames, not at the end), each with its alternatives."""
    ui.click("[data-testid=tab-text]")
    ui.evaluate(
        """() => {
            window.__arrivals = [];
            new MutationObserver((records) => {
                for (const r of records) for (const n of r.addedNodes)
                    if (n.classList && n.classList.contains("gen")) __arrivals.push(performance.now());
            }).observe(document.querySelector("[data-testid=text-view]"), {childList: true, subtree: true});
        }"""
    )
    result = generate(ui, ["In the beginning", "And God said"], tokens=100)
    assert result["status"] == "done", result
    arrivals = ui.evaluate("__arrivals")
    counts = [len(ids) for ids in result["ids"]]  # 100, or fewer where the model's context ends first
    assert min(counts) >= 20, counts
    for i, count in enumerate(counts):
        assert ui.locator(f"[data-testid=output-{i}] .tok.gen").count() == count
    assert len(arrivals) == sum(counts)
    batches = len({round(t / 8) for t in arrivals})  # distinct ~frames in which tokens were added
    assert batches >= 3, f"tokens arrived in {batches} batches: not streamed"
    assert ui.inner_text("[data-testid=output-0]").startswith("In the beginning")
    # hover a generated token: its probability and the alternatives
    ui.hover("[data-testid=output-0] .tok.gen >> nth=3")
    tip = ui.inner_text("[data-testid=tooltip]")
    assert "position" in tip and "%" in tip, tip
    ui.click("[data-testid=output-0] .tok.gen >> nth=3")
    assert ui.locator("[data-testid=token-detail] .bar").count() == 5  # top-5 alternatives
    save_shot(ui, shots, "text")
    ui.click("[data-testid=theme]")
    ui.wait_for_function("() => document.documentElement.dataset.theme === 'dark'")
    ui.wait_for_timeout(400)  # the colour transitions end
    save_shot(ui, shots, "text-dark")
    ui.click("[data-testid=theme]")
    ui.check_clean()


def test_probe_heatmaps_and_pca(ui: Page, shots: Path) -> None:
    """The per-layer heat maps of the default probes and the PCA scatter are drawn (canvas pixels)."""
    if not ui.evaluate("megascope.generation.value && !megascope.generation.value.running"):
        generate(ui, ["In the beginning", "And God said"], tokens=24)
    ui.click("[data-testid=tab-probes]")
    for site in ("hook_resid_post", "hook_attn_out", "hook_mlp_out"):
        selector = f"[data-testid=heatmap-{site}]"
        ui.wait_for_selector(selector)
        ui.wait_for_function("(s) => { const c = document.querySelector(s); return c && c.width > 40; }", arg=selector)
        ui.wait_for_timeout(300)
        assert canvas_ink(ui, selector) > 0.3, site
    ui.hover("[data-testid=heatmap-hook_resid_post]", position={"x": 30, "y": 10})
    assert "value" in ui.inner_text("[data-testid=tooltip]")
    save_shot(ui, shots, "probes")
    ui.click("[data-testid=tab-pca]")
    ui.wait_for_selector("[data-testid=pca-canvas]")
    ui.wait_for_timeout(300)
    assert canvas_ink(ui, "[data-testid=pca-canvas]") > 0.002
    save_shot(ui, shots, "pca")
    ui.check_clean()


def test_attention_matrix_for_a_chosen_layer_and_head(ui: Page, shots: Path) -> None:
    """The attention tab draws the chosen layer and head; hovering a cell names the token pair and weight."""
    if not ui.evaluate("megascope.generation.value && !megascope.generation.value.running"):
        generate(ui, ["In the beginning", "And God said"], tokens=24)
    ui.click("[data-testid=tab-attention]")
    layers = ui.eval_on_selector_all("[data-testid=attention-layer] option", "os => os.map(o => o.value)")
    assert len(layers) >= 2, layers  # the first and the last layer by default
    ui.select_option("[data-testid=attention-layer]", layers[-1])
    ui.select_option("[data-testid=attention-head]", "2")
    ui.wait_for_timeout(400)
    assert canvas_ink(ui, "[data-testid=attention-canvas]") > 0.05
    box = ui.locator("[data-testid=attention-canvas]").bounding_box()
    # a cell of an early key for a later query (the matrix starts after 74 px / 20 px of axis margins)
    ui.mouse.move(box["x"] + 74 + 3, box["y"] + 20 + (box["height"] - 20) * 0.6)
    tip = ui.inner_text("[data-testid=tooltip]")
    assert "query" in tip and "key" in tip and "weight" in tip, tip
    assert re.search(r"weight\s+\d", tip), tip
    head = ui.evaluate("document.querySelector('[data-testid=attention-head]').value")
    assert head == "2"
    save_shot(ui, shots, "attention")
    ui.check_clean()


def test_perturbation_changes_the_output_and_off_restores_it(ui: Page, shots: Path) -> None:
    """Greedy output; a perturbation switched on changes it; switched off, the output is the clean one again.
    A bad site is refused by the server and the panel says which row and why."""
    ui.click("[data-testid=tab-text]")
    prompts = ["In the beginning"]
    clean = generate(ui, prompts, tokens=16)
    assert clean["status"] == "done"
    ui.click("[data-testid=add-perturbation]")
    ui.select_option("[data-testid=perturbation-0-kind]", "gaussian")
    ui.fill("[data-testid=perturbation-0-site]", "system")
    ui.fill("[data-testid=perturbation-0-strength]", "4")
    ui.fill("[data-testid=perturbation-0-seed]", "7")
    ui.check("[data-testid=perturbation-0-enabled]")
    ui.wait_for_selector("[data-testid=perturbations-active]:has-text('1 active')")
    perturbed = generate(ui, prompts, tokens=16)
    assert perturbed["ids"][0] != clean["ids"][0], "the perturbation did not change the output"
    assert "generated under gaussian 4 on system" in ui.inner_text("[data-testid=text-view]")
    ui.locator("[data-testid=perturbations]").scroll_into_view_if_needed()
    save_shot(ui, shots, "perturbation")
    ui.uncheck("[data-testid=perturbation-0-enabled]")
    ui.wait_for_selector("[data-testid=perturbations-active]:has-text('off')")
    restored = generate(ui, prompts, tokens=16)
    assert restored["ids"][0] == clean["ids"][0], "switched off, the output should be the clean one"
    # an error state: heads on a site without heads is refused by the engine; the switch goes back off
    ui.fill("[data-testid=perturbation-0-heads]", "0")
    ui.click("[data-testid=perturbation-0-enabled]")  # (not check(): the refused switch goes back off)
    error = ui.wait_for_selector("[data-testid=perturbation-error]")
    assert "heads" in error.inner_text(), error.inner_text()
    ui.wait_for_function("() => !document.querySelector('[data-testid=perturbation-0-enabled]').checked")
    save_shot(ui, shots, "perturbation-error")
    ui.click("[aria-label='remove perturbation 1']")
    ui.click("[data-testid=apply-perturbations]")
    ui.wait_for_selector("[data-testid=perturbations-active]:has-text('off')")
    ui.check_clean()


def test_a_token_url_serves_every_tab_while_the_server_runs(browser: Any, served: str) -> None:
    """The token is the server's, not one page's: a second tab opened with the printed address connects too (the
    page says so where it explains the token, and never calls it one-time)."""
    first, second = Page(browser, served), Page(browser, served)
    try:
        for page in (first, second):
            assert page.get_attribute("[data-testid=connection]", "data-state") == "connected"
            page.check_clean()
    finally:
        first.close()
        second.close()
    bundle = "".join(p.read_text(errors="replace") for p in (STATIC / "assets").glob("*.js"))
    assert "one-time" not in bundle and "as that server runs" in bundle


def test_context_limit_is_said_not_hidden(ui: Page) -> None:
    """More new tokens than the model's context holds: the field says the limit, and the ended generation says
    the context, not the request, stopped it."""
    context = ui.evaluate("megascope.info.value.engine.model.max_seq_length")
    ui.click("[data-testid=tab-text]")
    ui.fill("[data-testid=max-new-tokens]", str(context + 50))
    hint = ui.inner_text("[data-testid=context-hint]")
    assert f"The model sees {context} tokens" in hint and f"at most {context - 1} new ones" in hint, hint
    assert ui.get_attribute("[data-testid=max-new-tokens]", "max") == str(context - 1)
    result = generate(ui, ["In the beginning God created the heaven and the earth"], tokens=context + 50)
    assert result["status"] == "done", result
    given = len(result["ids"][0])
    assert given < context + 50
    badge = ui.locator("[data-testid=reason-0]")
    assert badge.inner_text() == f"context full: {given} of {context + 50}", badge.inner_text()
    assert f"the model sees {context} tokens" in badge.get_attribute("title")
    ui.fill("[data-testid=max-new-tokens]", "16")
    ui.check_clean()


def test_characters_split_over_tokens_stream_whole(ui: Page) -> None:
    """A character whose UTF-8 bytes span several byte-level tokens shows whole, never as U+FFFD pieces."""
    ui.click("[data-testid=tab-text]")
    prompt = "And the naïve café — “wroth” ☃ 日本"
    result = generate(ui, [prompt], tokens=4)
    assert result["status"] == "done", result
    shown = ui.inner_text("[data-testid=output-0]")
    assert shown.startswith(prompt), shown  # (the 2-step model's own bytes after it may well be invalid UTF-8)
    cells = ui.evaluate("megascope.generation.value.prompts[0].cells.filter((c) => c.inPrompt).map((c) => c.text)")
    assert "".join(cells) == prompt and len(cells) > len(prompt.split()), cells
    assert ui.locator("[data-testid=output-0] .tok.part").count() > 0  # bytes shown with their character
    ui.check_clean()


def test_attention_of_a_shorter_prompt_ends_with_it(ui: Page) -> None:
    """In a batch, a shorter prompt's new tokens end before the longer one's: its attention matrix has no rows
    past its end (no "∅" label, no tooltip of a token it does not have)."""
    ui.click("[data-testid=tab-text]")
    ui.evaluate("megascope.settings.attentionLayers = [0]")
    generate(ui, ["And", "In the beginning God created the heaven and the earth"], tokens=6)
    ui.click("[data-testid=tab-attention]")
    ui.select_option("[data-testid=attention-prompt]", "0")
    ui.wait_for_timeout(400)
    short, size = ui.evaluate(
        "[megascope.generation.value.prompts[0].cells.length, megascope.generation.value.capacity]"
    )
    assert short < size, (short, size)
    box = ui.locator("[data-testid=attention-canvas]").bounding_box()
    cell = (box["height"] - 20) / size

    def tip_at(query: int) -> str:
        ui.mouse.move(box["x"] + 74 + cell * 0.5, box["y"] + 20 + (query + 0.5) * cell)
        ui.wait_for_timeout(100)
        tip = ui.locator("[data-testid=tooltip]")
        return tip.inner_text() if tip.is_visible() else ""

    assert "query" in tip_at(short - 1)  # its last token
    for query in range(short, size):
        tip = tip_at(query)
        assert tip == "", f"row {query}, past the prompt's {short} tokens: {tip!r}"
    ui.mouse.move(0, 0)
    ui.evaluate("megascope.settings.attentionLayers = null")
    ui.check_clean()


def test_perturbations_set_by_another_page_show_as_active(browser: Any, served: str, ui: Page) -> None:
    """Two pages on one server: what one applies, the other's panel shows as active (and off again)."""
    other = Page(browser, served)
    try:
        ui.click("[data-testid=tab-text]")
        other.wait_for_selector("[data-testid=perturbations-active]:has-text('off')")
        ui.click("[data-testid=add-perturbation]")
        ui.fill("[data-testid=perturbation-0-site]", "calculation")
        ui.fill("[data-testid=perturbation-0-strength]", "0.5")
        ui.check("[data-testid=perturbation-0-enabled]")
        ui.wait_for_selector("[data-testid=perturbations-active]:has-text('1 active')")
        other.wait_for_selector("[data-testid=perturbations-active]:has-text('1 active')", timeout=10_000)
        assert "calculation" in other.inner_text("[data-testid=perturbations]")
        ui.click("[aria-label='remove perturbation 1']")
        ui.click("[data-testid=apply-perturbations]")
        other.wait_for_selector("[data-testid=perturbations-active]:has-text('off')", timeout=10_000)
        other.check_clean()
        ui.check_clean()
    finally:
        other.close()


def test_sweep_table_and_plot(ui: Page, shots: Path, tmp_path: Path) -> None:
    """A sweep.csv as `scope sweep` writes it, opened with the file input: table and Δ-loss heat maps."""
    from lightning_megatron.scope.sweep import SweepRow, write_results

    rows = [
        SweepRow(layer, site, "gaussian", s, 4.0 + d, d)
        for layer in range(4)
        for site in ("system", "calculation")
        for s, d in ((0.01, 0.001 * (layer + 1)), (0.1, 0.05 * (layer + 1)), (1.0, 0.9 if layer != 2 else float("nan")))
    ]
    paths = write_results(tmp_path / "sweep", 4.0, rows)
    ui.click("[data-testid=tab-sweep]")
    ui.set_input_files("[data-testid=sweep-file]", str(paths["csv"]))
    ui.wait_for_selector("[data-testid=sweep-table] tbody tr")
    assert ui.locator("[data-testid=sweep-table] tbody tr").count() == len(rows)
    assert "4.0000" in ui.inner_text("[data-testid=sweep-clean]") or "4" in ui.inner_text("[data-testid=sweep-clean]")
    with open(paths["csv"]) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    for i in range(2):
        assert canvas_ink(ui, f"[data-testid=sweep-panel-{i}]") > 0.2
    # sorted by Δ loss, largest first: NaN last
    first = ui.inner_text("[data-testid=sweep-table] tbody tr >> nth=0")
    assert "+0.9" in first, first
    save_shot(ui, shots, "sweep")
    # a sweep over experts: one layer × expert panel per kind (and strength), an expert column in the table
    site = "moe.hook_router_logits"
    experts = [
        SweepRow(layer, site, "disable", 0.0, 4.0 + d, d, expert=e)
        for layer in (0, 2)
        for e, d in enumerate((0.01, 0.2, 0.03, 0.004))
    ]
    experts += [SweepRow(0, site, "gaussian", 1.0, 4.1, 0.1, expert=e) for e in range(4)]
    paths = write_results(tmp_path / "expert-sweep", 4.0, experts)
    ui.set_input_files("[data-testid=sweep-file]", str(paths["csv"]))
    ui.wait_for_function(f"document.querySelectorAll('[data-testid=sweep-table] tbody tr').length === {len(experts)}")
    titles = ui.locator(".panel h3").all_inner_texts()
    assert titles == [f"{site} · disable", f"{site} · gaussian 1"], titles
    assert "expert" in ui.inner_text("[data-testid=sweep-table] thead")
    first = ui.inner_text("[data-testid=sweep-table] tbody tr >> nth=0")  # expert 1 of a layer: Δ 0.2, the largest
    assert "+0.2" in first and "disable" in first and "–" in first, first
    for i in range(2):
        assert canvas_ink(ui, f"[data-testid=sweep-panel-{i}]") > 0.2
    ui.check_clean()


# -- the training panel on a live CPU fit ----------------------------------------------------------------------
def test_training_panel_follows_a_live_fit(browser: Any, shots: Path) -> None:
    """A paused CPU fit with the MegaScope callback: Step runs exactly the steps asked for, Resume runs, Pause
    stops; the loss curve, Δ loss (under a perturbation) and live probes update; when the run ends the page
    says it is disconnected."""
    fit = Background([str(ROOT / "tests" / "webui_cases.py"), "fit-live", "--steps", "2000"])
    page = None
    try:
        url = fit.wait_for(r"MegaScope: following the run at (\S+)", timeout=300).group(1)
        page = Page(browser, url)
        page.wait_for_selector("[data-testid=train-state][data-state=paused]")
        assert page.locator("[data-testid=tab-training]").count() == 1
        assert page.locator("[data-testid=tab-text]").count() == 0  # no generation on a training run
        assert "TP1×PP1×DP1" in page.inner_text("[data-testid=model]"), page.inner_text("[data-testid=model]")
        assert "Probes of every step from step 0" in page.inner_text("[data-testid=training-controls]")
        page.evaluate(  # how a run sampling every 2nd step is described (the server's facts, as it would send them)
            """() => { const info = megascope.info.value; megascope.info.value = {...info,
                engine: {...info.engine, sampled: {interval: 2, window: 1, start_step: 0}}}; }"""
        )
        assert "Probes of every 2nd step from step 0" in page.inner_text("[data-testid=training-controls]")
        page.evaluate(
            """() => { const info = megascope.info.value; megascope.info.value = {...info,
                engine: {...info.engine, sampled: {interval: 1, window: 1, start_step: 0}}}; }"""
        )

        def steps() -> list[int]:
            return page.evaluate("megascope.training.steps.map((s) => s.step)")

        page.click("[data-testid=train-step]")
        page.wait_for_function("() => megascope.training.steps.length >= 1")
        page.wait_for_selector("[data-testid=train-state][data-state=paused]")
        page.fill("[data-testid=train-steps]", "2")
        page.click("[data-testid=train-step]")
        page.wait_for_function("() => megascope.training.steps.length >= 3")
        page.wait_for_timeout(800)
        assert steps() == [0, 1, 2], steps()  # exactly the steps asked for, then paused
        assert page.get_attribute("[data-testid=train-state]", "data-state") == "paused"
        # a perturbation: the next steps report Δ loss
        page.click("[data-testid=add-perturbation]")
        page.fill("[data-testid=perturbation-0-site]", "calculation")
        clipped = page.eval_on_selector("[data-testid=perturbation-0-site]", "(e) => e.scrollWidth - e.clientWidth")
        assert clipped <= 0, f"the site field cuts 'calculation' short by {clipped} px"
        page.fill("[data-testid=perturbation-0-strength]", "0.5")
        page.check("[data-testid=perturbation-0-enabled]")
        page.wait_for_selector("[data-testid=perturbations-active]:has-text('1 active')")
        page.click("[data-testid=train-resume]")
        page.wait_for_selector("[data-testid=train-state][data-state=running]")
        page.wait_for_function("() => megascope.training.steps.length >= 8", timeout=120_000)
        page.click("[data-testid=train-pause]")
        page.wait_for_selector("[data-testid=train-state][data-state=paused]")
        page.wait_for_timeout(300)
        paused_at = len(steps())
        page.wait_for_timeout(1500)
        assert len(steps()) <= paused_at + 1, "the run went on after Pause"
        assert steps() == list(range(len(steps()))), steps()
        deltas = page.evaluate("megascope.training.steps.filter((s) => s.deltaLoss !== null).length")
        assert deltas >= 1, "no Δ loss under the perturbation"
        assert canvas_ink(page, "[data-testid=loss-chart] canvas") > 0.01
        page.wait_for_selector("[data-testid=heatmap-hook_resid_post]")
        page.wait_for_timeout(300)
        assert canvas_ink(page, "[data-testid=heatmap-hook_resid_post]") > 0.3
        assert int(page.get_attribute("[data-testid=training-view]", "data-steps")) == len(steps())
        save_shot(page, shots, "training")
        page.check_clean()
        # the run ends: the page says so
        fit.proc.kill()  # a paused run ignores SIGTERM (Lightning defers it to a step boundary)
        page.wait_for_selector("[data-testid=connection][data-state=disconnected]", timeout=30_000)
        assert page.locator("[data-testid=disconnected]").count() == 1
        page.wait_for_selector("[data-testid=train-state][data-state=ended]")  # not "running", nothing to press
        for button in ("train-pause", "train-resume", "train-step"):
            assert page.is_disabled(f"[data-testid={button}]"), button
        save_shot(page, shots, "disconnected")
    finally:
        if page is not None:
            page.close()
        fit.stop()


# -- speed: a GPT-2-medium-shaped stream at 20 positions per second --------------------------------------------
JANK_WATCH = """
window.__jank = {loaf: [], longtask: [], frames: []};
new PerformanceObserver((list) => { for (const e of list.getEntries()) __jank.loaf.push({
    start: e.startTime, duration: e.duration, blocking: e.blockingDuration,
    scripts: (e.scripts || []).map((s) => `${s.invoker} ${Math.round(s.duration)}ms`)}); })
  .observe({type: "long-animation-frame", buffered: true});
new PerformanceObserver((list) => { for (const e of list.getEntries()) __jank.longtask.push({start: e.startTime, duration: e.duration}); })
  .observe({type: "longtask", buffered: true});
let last = performance.now();
const tick = (t) => { __jank.frames.push([t, t - last]); last = t; requestAnimationFrame(tick); };
requestAnimationFrame(tick);
"""
REPLAY_RATE = 20.0
NOMINAL_EVENTS_PER_SECOND = 1450.0  # 20 positions/s x (72 probes + the token + attention chunks)
REPLAY_NEW_TOKENS = 128  # after a 896-token prompt: 1,024 positions


def replay_once(browser: Any, url: str, trace: Path, shots: Path | None = None) -> dict[str, Any]:
    """One replay in a fresh page: the Text view while the prefill arrives, then Probes, then Attention."""
    context = browser.new_context(viewport=VIEWPORT, device_scale_factor=1)
    page = context.new_page()
    waits = RunQueueWait()
    try:
        page.add_init_script(JANK_WATCH)
        page.goto(url)
        page.wait_for_selector("[data-testid=generate]")
        page.evaluate("megascope.settings.prompts.splice(1); megascope.settings.prompts[0] = 'replay'")
        page.fill("[data-testid=max-new-tokens]", str(REPLAY_NEW_TOKENS))
        page.wait_for_timeout(500)
        browser.start_tracing(page=page, path=str(trace), categories=["toplevel", "blink.user_timing"])
        waits.start()
        cpu_before = cpu_snapshot()
        before = time.monotonic()
        start = page.evaluate("performance.mark('megascope-replay'), performance.now()")
        start_monotonic = (before + time.monotonic()) / 2  # page time `start` on the host's monotonic clock
        page.click("[data-testid=generate]")
        # polled every 100 ms, not every frame: the test's own polling must not load the page
        page.wait_for_function("() => megascope.generation.value.tokenEvents >= 30", timeout=60_000, polling=100)
        page.click("[data-testid=tab-probes]")
        page.wait_for_function("() => megascope.generation.value.tokenEvents >= 70", timeout=60_000, polling=100)
        page.click("[data-testid=tab-attention]")
        page.wait_for_function("() => !megascope.generation.value.running", timeout=120_000, polling=100)
        page.wait_for_timeout(300)
        end = page.evaluate("performance.now()")
        cpu_after = cpu_snapshot()
        waits.stop()
        browser.stop_tracing()
        jank = page.evaluate("__jank")
        gen = page.evaluate(
            """() => { const g = megascope.generation.value;
                return {status: g.status, events: g.events, tokens: g.tokenEvents, seconds: (g.finishedAt - g.startedAt) / 1000,
                        latencies: g.latencies, positions: g.length, attention: g.attention.layerIds(),
                        probes: g.probes.bands.size}; }"""
        )
        ink = canvas_ink(page, "[data-testid=attention-canvas]")
        if shots is not None:  # 1,024 positions: the attention of the last layer, then every layer's probes
            page.select_option("[data-testid=attention-layer]", "23")
            page.wait_for_timeout(500)
            save_shot(page, shots, "replay-attention")
            page.click("[data-testid=tab-probes]")
            page.wait_for_timeout(1500)
            save_shot(page, shots, "replay-probes")
    finally:
        waits.stop()
        context.close()
    loaf = [e for e in jank["loaf"] if start <= e["start"] <= end]
    renderer, cpu_per_frame = main_thread_cpu(trace, "megascope-replay", loaf)
    for frame, cpu in zip(loaf, cpu_per_frame):
        lo = start_monotonic + (frame["start"] - start) / 1000.0
        waited = waits.waited_ms(renderer, lo, lo + frame["duration"] / 1000.0)
        frame["cpu"] = round(cpu, 1)
        frame["run_queue_wait"] = None if waited is None else round(waited, 1)
        frame["duration"] = round(frame["duration"], 1)
        # what the frame would have lasted with a core to itself (unknown: its whole wall time)
        frame["unqueued"] = round(frame["duration"] - (waited or 0.0), 1)
    longtasks = [e for e in jank["longtask"] if start <= e["start"] <= end]
    frames = sorted(d for t, d in jank["frames"] if start <= t <= end)
    latencies = sorted(gen.pop("latencies"))
    return {
        **gen,
        "attention_ink": ink,
        "max_frame_ms": max((e["duration"] for e in loaf), default=0.0),
        "max_frame_cpu_ms": max((e["cpu"] for e in loaf), default=0.0),
        "max_frame_unqueued_ms": max((e["unqueued"] for e in loaf), default=0.0),
        "renderer_sampled": renderer in waits.samples,
        "frames_over_50ms": len(loaf),
        "frames_over_100ms": sorted((e for e in loaf if e["duration"] > LONG_FRAME_MS), key=lambda e: -e["duration"]),
        "max_longtask_ms": max((e["duration"] for e in longtasks), default=0.0),
        "raf_intervals_ms": {
            "count": len(frames),
            "p50": frames[len(frames) // 2] if frames else None,
            "p95": frames[int(len(frames) * 0.95)] if frames else None,
            "max": frames[-1] if frames else None,
        },
        "token_latency_ms": {
            "p50": statistics.median(latencies) if latencies else None,
            "max": latencies[-1] if latencies else None,
        },
        "foreign_load_cores": round(foreign_load(cpu_before, cpu_after), 2),
        "events_per_second": round(gen["events"] / max(gen["seconds"], 1e-6)),
    }


QUIET = 0.3
"""A host whose other processes kept less than this many cores busy during a replay is quiet."""
ATTEMPTS = 5
"""On 2 cores the replay server and Chromium's other processes take turns with the page's thread: about one
replay in three has a frame the scheduler stretched past 100 ms (its CPU time stays under 40 ms)."""


def test_no_long_frames_while_a_gpt2_medium_stream_replays(browser: Any, shots: Path) -> None:
    """24 layers, the default probes (residual / attention out / MLP out, 64 bins: 72 probe events per
    position), top-5 alternatives, all 16 heads of 2 layers' attention, 896 prompt tokens then 128 new ones
    at 20 positions per second (about 1,500 events/s), while the page shows Text, then Probes, then Attention.

    Long-animation-frame entries are read from the page, and a Chromium trace gives the CPU time the
    renderer's main thread spent in each. The page's own work: no frame needs more than 100 ms of CPU.
    What the user sees: no frame longer than 100 ms on a quiet host (other processes busy less than 0.3
    cores during the replay; up to 5 attempts), once the time the renderer's main thread sat runnable in the
    run queue is taken out (``RunQueueWait``: on 2 cores the replay server and Chromium's own processes take
    turns with it and stretched one frame in three past 100 ms while it used under 40 ms of CPU). Wall time
    whole, the run-queue wait and the CPU time of every long frame are reported."""
    replay = Background(
        [str(ROOT / "tests" / "webui_cases.py"), "replay", "--rate", str(REPLAY_RATE)], env={"LM_SCOPE_TOKEN": TOKEN}
    )
    attempts: list[dict[str, Any]] = []
    try:
        url = replay.wait_for(r"MegaScope replay at (\S+)", timeout=120).group(1)
        for attempt in range(ATTEMPTS):
            result = replay_once(browser, url, shots / f"replay-trace-{attempt}.json", shots if attempt == 0 else None)
            attempts.append(result)
            assert result["status"] == "done" and result["tokens"] == REPLAY_NEW_TOKENS, result
            assert result["positions"] == 1024 and result["attention"] == [0, 23] and result["probes"] == 72
            assert result["attention_ink"] > 0.05
            if result["max_frame_unqueued_ms"] <= LONG_FRAME_MS or result["max_frame_cpu_ms"] > LONG_FRAME_MS:
                break
    finally:
        replay.stop()
    (shots / "replay-jank.json").write_text(json.dumps(attempts, indent=2))
    keys = (
        "max_frame_ms",
        "max_frame_unqueued_ms",
        "max_frame_cpu_ms",
        "frames_over_50ms",
        "max_longtask_ms",
        "events_per_second",
        "renderer_sampled",
    )
    summary = [{k: a[k] for k in (*keys, "foreign_load_cores", "token_latency_ms")} for a in attempts]
    print("replay jank:", json.dumps(summary))
    worst_cpu = max(attempts, key=lambda a: a["max_frame_cpu_ms"])
    assert worst_cpu["max_frame_cpu_ms"] <= LONG_FRAME_MS, (
        f"a frame needed over {LONG_FRAME_MS} ms of main-thread CPU: {json.dumps(summary)}; "
        f"{json.dumps(worst_cpu['frames_over_100ms'][:5])}"
    )
    # Wall time (less the run-queue wait) is asserted only where the machine delivered the stream (a quiet host,
    # and the events arrived at >= 70% of their nominal rate): an attempt whose stream was throttled upstream
    # measures the machine, not the page.
    quiet = [
        a
        for a in attempts
        if a["foreign_load_cores"] < QUIET and a["events_per_second"] >= 0.7 * NOMINAL_EVENTS_PER_SECOND
    ]
    if not quiet:
        print(f"replay jank: wall time not asserted (no attempt on a quiet host got the stream at its rate): {summary}")
    if quiet:
        best = min(quiet, key=lambda a: a["max_frame_unqueued_ms"])
        assert best["max_frame_unqueued_ms"] <= LONG_FRAME_MS, (
            f"frames over {LONG_FRAME_MS} ms on a quiet host, run-queue wait taken out: {json.dumps(summary)}; "
            f"{json.dumps(best['frames_over_100ms'][:5])}"
        )
