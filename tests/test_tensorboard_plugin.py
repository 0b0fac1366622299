"""The ``megascan`` TensorBoard plugin: torch-free import, its routes on synthetic runs (including refused paths),
a real ``tensorboard`` process that lists and serves it, and the tab rendered in headless Chromium (which also
refreshes ``docs/images/tensorboard_megascan.png`` for the README with ``LM_UPDATE_SCREENSHOTS=1``).

The synthetic runs come from ``scan.evaluation.synthetic`` with one slowed rank each, laid out as a Lightning logdir
(``<run>/version_0/megascan/rank*.json``); one has the ``megascan-report.json`` MegaScan writes at fit end, the
other not (the plugin runs detection on request).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tensorboard")
from tensorboard.plugins import base_plugin  # noqa: E402
from werkzeug.test import Client  # noqa: E402

from lightning_megatron.scan.analysis.detect import detect  # noqa: E402
from lightning_megatron.scan.analysis.report import REPORT_FILE  # noqa: E402
from lightning_megatron.scan.evaluation.synthetic import generate_traces  # noqa: E402
from lightning_megatron.tensorboard.plugin import MegaScanPlugin  # noqa: E402

CHROMIUM = os.environ.get("LM_CHROMIUM", "/usr/bin/chromium")
SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "images" / "tensorboard_megascan.png"
MAIN, OTHER = "gpt-synthetic/version_0/megascan", "other/version_0/megascan"
HOST = "host-waits/version_0/megascan"
SLOW_MAIN, SLOW_OTHER, SLOW_HOST = 5, 2, 1
HOST_EVIDENCE = {
    "rule": "training thread's waits for a CPU (run-queue delay) per step against the other ranks'",
    "cpu_wait_ms": 230.05,
    "baseline_ms": 0.42,
    "hit_steps_fraction": 1.0,
    "steps": 3,
    "p_value": 0.002,
    "alpha": 0.0025,
    "peers": 3,
    "impact_ms": 229.63,
    "step_ms": 812.5,
    "later_steps": [2, 3],
    "why_host": "a long reason without spaces:" + "x" * 300,
}


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs under ``logs/`` (the newest, ``MAIN``, with a saved report) and rank files *outside* it that a
    symbolic link inside points to (the plugin must not serve them)."""
    root = tmp_path_factory.mktemp("tb")
    logs = root / "logs"
    generate_traces(logs / OTHER, dp=2, pp=1, tp=2, steps=3, slow_ranks={SLOW_OTHER: 1.6}, seed=2, gzipped=True)
    main = logs / MAIN
    generate_traces(main, dp=2, pp=2, tp=2, steps=4, microbatches=4, slow_ranks={SLOW_MAIN: 1.5}, seed=1)
    (main / REPORT_FILE).write_text(detect(main).to_json())
    # a saved report naming a rank for its training thread's CPU waits (scan.cpu_rules), as a real run writes it
    host = logs / HOST
    generate_traces(host, dp=2, pp=1, tp=2, steps=3, seed=3)
    report = json.loads(detect(host).to_json())
    report["suspects"] = [
        {"rank": SLOW_HOST, "dp": 0, "pp": 0, "tp": 1, "host": "node-a", "kind": "host", "slowdown": 0.28,
         "peer": None, "evidence": HOST_EVIDENCE}
    ]  # fmt: skip
    (host / REPORT_FILE).write_text(json.dumps(report))
    newest = time.time() + 5
    for path in main.iterdir():
        os.utime(path, (newest, newest))
    outside = root / "outside"
    files = generate_traces(outside, dp=1, pp=1, tp=2, steps=1)["files"]
    (logs / "linked-dir").symlink_to(outside, target_is_directory=True)
    (logs / "sneaky").mkdir()
    first = Path(files[0])
    (logs / "sneaky" / first.name).symlink_to(first)
    return logs


@pytest.fixture(scope="module")
def client(logdir: Path) -> Client:
    """The plugin's routes behind a minimal WSGI dispatcher (TensorBoard mounts them under /data/plugin/megascan)."""
    apps = MegaScanPlugin(base_plugin.TBContext(logdir=str(logdir))).get_plugin_apps()

    def app(environ: dict[str, Any], start_response: Any) -> Any:
        route = apps.get(environ.get("PATH_INFO", ""))
        if route is None:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"no such route"]
        return route(environ, start_response)

    return Client(app)


def get_json(client: Client, path: str, status: int = 200) -> Any:
    response = client.get(path)
    assert response.status_code == status, (path, response.status_code, response.get_data(as_text=True)[:500])
    assert response.headers.get("X-Content-Type-Options") == "nosniff"
    return json.loads(response.get_data(as_text=True))


# -- (a) import ----------------------------------------------------------------------------------------------


def test_plugin_imports_no_torch_lightning_megatron() -> None:
    """TensorBoard imports every plugin at start: this one must not pull in torch, Lightning or megatron-core."""
    code = (
        "import sys\n"
        "import lightning_megatron.tensorboard.plugin\n"
        "import lightning_megatron.tensorboard.runs\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'lightning', 'megatron'))\n"
        "assert not heavy, heavy[:10]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# -- (b) routes ----------------------------------------------------------------------------------------------


def test_plugin_metadata_and_activity(logdir: Path, tmp_path: Path) -> None:
    plugin = MegaScanPlugin(base_plugin.TBContext(logdir=str(logdir)))
    assert plugin.plugin_name == "megascan"
    assert plugin.frontend_metadata().es_module_path == "/index.js"
    assert plugin.is_active()
    assert not MegaScanPlugin(base_plugin.TBContext(logdir=str(tmp_path))).is_active()
    assert not MegaScanPlugin(base_plugin.TBContext(logdir=None)).is_active()


def test_runs_route_lists_runs_inside_the_logdir_only(client: Client) -> None:
    runs = {run["name"]: run for run in get_json(client, "/runs")["runs"]}
    assert set(runs) == {MAIN, OTHER, HOST}  # not the linked directory, not the directory of a linked rank file
    assert runs[MAIN]["ranks"] == 8 and runs[MAIN]["report"] is True
    assert runs[OTHER]["ranks"] == 4 and runs[OTHER]["report"] is False


def test_suspects_route_names_the_slowed_rank(client: Client) -> None:
    saved = get_json(client, f"/suspects?run={MAIN}")
    assert saved["source"] == "file" and not saved["stale"]
    top = saved["report"]["suspects"][0]
    assert (top["rank"], top["kind"]) == (SLOW_MAIN, "compute")
    assert top["evidence"]["impact_ms"] > 0 and top["slowdown"] > 0.3
    stages = saved["report"]["bubbles"]["stages"]  # PP2: the pipeline bubbles of each stage (scan.analysis.bubbles)
    assert [s["stage"] for s in stages] == [0, 1] and all(s["bubble_ms"] > 0 for s in stages)

    assert "net compute" in top["evidence_text"], top["evidence_text"]  # scan.report's words, for the tab
    host = get_json(client, f"/suspects?run={HOST}")["report"]["suspects"][0]
    assert host["evidence_text"].startswith("training thread waited for a CPU 230.05 ms per step vs 0.42 ms")

    missing = get_json(client, f"/suspects?run={OTHER}")
    assert missing["source"] is None and missing["report"] is None
    detected = get_json(client, f"/suspects?run={OTHER}&detect=1")
    assert detected["source"] == "detected"
    assert [s["rank"] for s in detected["report"]["suspects"]] == [SLOW_OTHER]


def test_heatmap_route_has_ranks_by_steps(client: Client) -> None:
    heat = get_json(client, f"/heatmap?run={MAIN}")
    assert [r["rank"] for r in heat["ranks"]] == list(range(8)) and heat["steps"] == [0, 1, 2, 3]
    assert heat["ranks"][SLOW_MAIN] == {"rank": SLOW_MAIN, "dp": 0, "pp": 1, "tp": 1, "host": "node0"}
    for key in ("step_ms", "compute_ms", "wait_ms", "other_ms"):
        assert len(heat[key]) == 8 and all(len(row) == 4 and None not in row for row in heat[key])
    for i in range(8):
        for j in range(4):
            parts = heat["compute_ms"][i][j] + heat["wait_ms"][i][j] + heat["other_ms"][i][j]
            assert parts == pytest.approx(heat["step_ms"][i][j], rel=1e-3)
    # everybody waits for the slow rank, so step times are alike, but its compute is the longest of its stage
    stage = [r["rank"] for r in heat["ranks"] if r["pp"] == 1]
    compute = {rank: sum(heat["compute_ms"][rank]) for rank in stage}
    assert max(compute, key=compute.get) == SLOW_MAIN
    assert min(heat["wait_ms"][SLOW_MAIN]) < min(min(heat["wait_ms"][r]) for r in stage if r != SLOW_MAIN)


def test_timeline_route_has_spans_and_flows(client: Client) -> None:
    timeline = get_json(client, f"/timeline?run={MAIN}&step=1")
    assert timeline["steps"] == [0, 1, 2, 3] and timeline["available_ranks"] == list(range(8))
    assert {row["rank"] for row in timeline["rows"]} == set(range(8))
    cats = {span["cat"] for span in timeline["spans"]}
    assert {"step", "compute", "p2p", "collective", "optimizer"} <= cats
    assert all(0 <= span["row"] < len(timeline["rows"]) for span in timeline["spans"])
    assert all(-1 <= span["ts"] <= timeline["duration_us"] + 1 for span in timeline["spans"])
    flows = [f for f in timeline["flows"] if f["cat"] == "p2p"]
    assert flows and any(f["cat"] == "collective" for f in timeline["flows"])
    rows = timeline["rows"]
    assert all(rows[f["from"]]["rank"] != rows[f["to"]]["rank"] and f["to_ts"] >= f["from_ts"] for f in flows)

    subset = get_json(client, f"/timeline?run={MAIN}&step=1&ranks=4-5")
    assert {row["rank"] for row in subset["rows"]} == {4, 5} and subset["spans"]
    assert get_json(client, f"/timeline?run={OTHER}&step=0")["spans"]  # a gzipped run


def test_trace_route_serves_the_merged_trace(client: Client) -> None:
    plain = client.get(f"/trace?run={MAIN}&download=1")
    assert plain.status_code == 200 and "attachment" in plain.headers["Content-Disposition"]
    trace = json.loads(plain.get_data())
    merged = [e for e in trace["traceEvents"] if e.get("name") == "megascan.merged"]
    assert merged and merged[0]["args"]["ranks_present"] == 8
    encoded = client.get(f"/trace?run={MAIN}", headers={"Accept-Encoding": "gzip, deflate"})
    assert encoded.headers["Content-Encoding"] == "gzip"
    assert json.loads(gzip.decompress(encoded.get_data()))["traceEvents"]


def test_index_js_is_served(client: Client) -> None:
    response = client.get("/index.js")
    assert response.status_code == 200 and response.mimetype == "application/javascript"
    assert "export async function render" in response.get_data(as_text=True)
    for module in ("common.js", "heatmap.js", "timeline.js", "bubbles.js"):  # what index.js imports
        assert client.get(f"/{module}").status_code == 200


@pytest.mark.parametrize(
    ("query", "status"),
    [
        ("/suspects?run=../..", 400),
        ("/suspects?run=..", 400),
        ("/heatmap?run=/etc", 400),
        ("/heatmap?run=%2Fetc%2Fpasswd", 400),
        (f"/heatmap?run={MAIN}/../../../..", 400),
        ("/timeline?run=gpt-synthetic/./version_0/megascan&step=1", 400),
        ("/trace?run=..%5C..%5Cwindows", 400),
        ("/trace?run=gpt-synthetic%00", 400),
        ("/suspects", 400),
        ("/suspects?run=nope", 404),
        ("/heatmap?run=linked-dir", 404),
        ("/trace?run=sneaky", 404),
        (f"/timeline?run={MAIN}&step=99", 404),
        (f"/timeline?run={MAIN}&step=-1", 400),
        (f"/timeline?run={MAIN}&step=one", 400),
        (f"/timeline?run={MAIN}&step=1&ranks=0-100000", 400),
        (f"/timeline?run={MAIN}&step=1&ranks=0;rm", 400),
    ],
)
def test_refused_arguments(client: Client, query: str, status: int) -> None:
    """Path traversal, absolute paths, runs outside the logdir, unknown runs and malformed numbers."""
    body = get_json(client, query, status)
    assert body["error"]


def test_only_get(client: Client) -> None:
    assert client.post(f"/suspects?run={MAIN}").status_code == 405


# -- (c) a real TensorBoard ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture(scope="module")
def tensorboard(logdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``tensorboard --logdir LOGDIR`` on a free loopback port; its base URL once it answers."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("tensorboard") / "tensorboard.log").open("w")
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1"]
    process = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                log.flush()
                pytest.fail(f"tensorboard exited with {process.returncode}: {Path(log.name).read_text()[-2000:]}")
            try:
                if _fetch(f"{base}/data/plugins_listing")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("tensorboard did not answer within 90 s")
            time.sleep(0.5)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_tensorboard_lists_and_serves_the_plugin(tensorboard: str) -> None:
    status, body = _fetch(f"{tensorboard}/data/plugins_listing")
    listing = json.loads(body)
    assert status == 200 and listing["megascan"]["enabled"] is True
    assert listing["megascan"]["loading_mechanism"] == {
        "type": "IFRAME",
        "module_path": "/data/plugin/megascan/index.js",
    }
    status, body = _fetch(f"{tensorboard}/data/plugin/megascan/index.js")
    assert status == 200 and b"export async function render" in body
    status, body = _fetch(f"{tensorboard}/data/plugin/megascan/runs")
    assert status == 200 and MAIN in {run["name"] for run in json.loads(body)["runs"]}
    assert _fetch(f"{tensorboard}/data/plugin/megascan/heatmap?run=../..")[0] == 400


# -- (d) the tab in a browser --------------------------------------------------------------------------------


def test_tab_renders_in_chromium(tensorboard: str, tmp_path: Path) -> None:
    """The tab as a person sees it: suspects table naming the slowed rank, heatmap and timeline drawn."""
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set LM_CHROMIUM)")
    sync_api = pytest.importorskip("playwright.sync_api")
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        )
        try:
            page = browser.new_page(viewport={"width": 1360, "height": 1180}, device_scale_factor=1)
            page.set_default_timeout(45_000)
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(f"{tensorboard}/#megascan")
            tab = page.frame_locator('iframe[src*="plugin_entry.html?name=megascan"]')
            tab.locator('#megascan[data-state="ready"]').wait_for()
            assert tab.locator("#megascan-run").input_value() == MAIN  # the newest run is shown first
            row = tab.locator(f'#megascan-suspects-table tr[data-rank="{SLOW_MAIN}"]')
            row.wait_for()
            assert row.locator("td").first.inner_text() == str(SLOW_MAIN)
            assert "compute" in row.inner_text()
            assert "step 3" in tab.locator("#megascan-timeline").inner_text()
            bubbles = tab.locator("#megascan-bubbles-table tr.ms-bubble-stage")  # one row a pipeline stage
            assert bubbles.count() == 2 and bubbles.first.locator("td").first.inner_text() == "pp0"
            summary = tab.locator("#megascan-bubbles-summary").inner_text()
            assert "bubble fraction" in summary and "in theory (P-1)/(M+P-1)" in summary, summary
            shot = tmp_path / "tab.png"
            page.screenshot(path=str(shot))
            _all_numbers_are_listed(tab, SLOW_MAIN)
            # a host suspect named for its CPU waits: its evidence says so (not "data-wait")
            tab.locator("#megascan-run").select_option(HOST)
            host_row = tab.locator(f'#megascan-suspects-table tr[data-rank="{SLOW_HOST}"]')
            host_row.wait_for()
            evidence = host_row.locator("td.ms-evidence-cell").inner_text()
            assert "waited for a CPU 230.05 ms per step" in evidence and "data-wait" not in evidence, evidence
            _all_numbers_are_listed(tab, SLOW_HOST)
        finally:
            browser.close()
    assert not errors, errors
    if os.environ.get("LM_UPDATE_SCREENSHOTS"):  # the README's picture changes only when asked (a clean tree)
        _save_small_png(shot, SCREENSHOT)


def _all_numbers_are_listed(tab: Any, rank: int) -> None:
    """Expanding a suspect's "all numbers" lists each evidence field as a name and its value, inside the card."""
    row = tab.locator(f'#megascan-suspects-table tr[data-rank="{rank}"]')
    row.locator("details.ms-evidence summary").click()
    listing = row.locator("details.ms-evidence dl")
    listing.wait_for()
    text = listing.inner_text()
    assert "[object" not in text, text[:300]
    names = listing.locator("dt").all_inner_texts()
    assert "impact_ms" in names and listing.locator("dd").count() == len(names), names
    overflow = tab.locator("#megascan-suspects").evaluate("(card) => card.scrollWidth - card.clientWidth")
    assert overflow <= 1, f"the suspects card overflows by {overflow} px"
    row.locator("details.ms-evidence summary").click()  # closed again


def _save_small_png(source: Path, target: Path, limit: int = 300_000) -> None:
    """The screenshot for the README: as is when small, else as a 256-colour palette image."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        from PIL import Image
    except ImportError:
        shutil.copyfile(source, target)
        return
    with Image.open(source) as image:
        rgb = image.convert("RGB")
        rgb.save(target, optimize=True)
        if target.stat().st_size >= limit:
            rgb.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE).save(
                target, optimize=True
            )
