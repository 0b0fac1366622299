// MegaScan's TensorBoard tab: which rank slows a run down, and what every rank did in one step.
//
// TensorBoard loads this ES module in an iframe (data/plugin_entry.html, with <base href="plugin/megascan/">)
// and calls render(). Plain ES modules (common.js, heatmap.js, timeline.js, bubbles.js beside this one), DOM and canvas:
// no build step, nothing fetched from anywhere but the plugin's own routes. This module holds the page: the
// run selector, the suspects table, the merged trace's download link and the hand-over to Perfetto; the pipeline
// bubbles card (bubbles.js) draws from the same report.

import { BubblesView } from "./bubbles.js";
import { compactRanks, getJSON, h, num, pct, STYLE, Tooltip, url } from "./common.js";
import { HeatmapView } from "./heatmap.js";
import { TimelineView } from "./timeline.js";

const PERFETTO = "https://ui.perfetto.dev";
const MAX_DEFAULT_RANKS = 32; // the timeline shows this many ranks unless asked for others

// The server sends each suspect's line in scan.report's words (evidence_text); this is the fallback for a report
// it could not word, labelled by the fields present (each rule keeps its own: a CPU wait is no data wait).
function evidenceText(s) {
  if (typeof s.evidence_text === "string" && s.evidence_text) return s.evidence_text;
  const e = s.evidence || {};
  if (e.cpu_wait_ms !== undefined && e.median_ms === undefined) {
    return `training thread waited for a CPU ${num(e.cpu_wait_ms)} ms per step vs ${num(e.baseline_ms)} ms on the others`;
  }
  if (s.kind === "compute") {
    let text = `net compute ${num(e.median_ms)} ms vs ${num(e.baseline_ms)} ms on peers`;
    if (e.last_arrival_fraction !== undefined && e.last_arrival_fraction !== null) {
      text += `; last at ${pct(e.last_arrival_fraction)} of its ${e.collective_group} collectives (imposed ${num(e.imposed_wait_ms)} ms)`;
    }
    return text;
  }
  if (s.kind === "link") {
    return `${e.direction || ""} ${s.rank}→${s.peer}: ${num(e.median_us_per_mb, 1)} µs/MB vs ${num(e.baseline_us_per_mb, 1)} µs/MB on ${e.link_class || "peer"} links`;
  }
  if (e.later_ms !== undefined) return `${e.rule || "later steps"}: ${num(e.later_ms)} ms vs ${num(e.earlier_ms)} ms per step`;
  if (s.kind === "data" || e.late_ms !== undefined) return `data-wait ${num(e.median_ms)} ms vs peers ${num(e.baseline_ms)} ms per step`;
  return e.rule ? `${e.rule}: ${num(e.median_ms)} ms vs ${num(e.baseline_ms)} ms` : "";
}

function evidenceValue(value) {
  if (typeof value === "number") return Number.isInteger(value) ? String(value) : value.toPrecision(4);
  if (value === null || value === undefined) return "–";
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

class MegaScanApp {
  constructor(root) {
    this.runs = [];
    this.run = null;
    this.report = null;
    this.tip = new Tooltip();
    const suspects = () => this.suspectRanks();
    this.heatmap = new HeatmapView({ tip: this.tip, suspects, onPick: (rank, step) => this.pick(rank, step) });
    this.timeline = new TimelineView({ tip: this.tip, suspects });

    this.runSelect = h("select", { id: "megascan-run", "aria-label": "run", onchange: () => this.selectRun(this.runSelect.value) });
    this.download = h("a", { class: "ms-button", id: "megascan-download", text: "Download merged trace", download: "" });
    this.status = h("span", { class: "ms-muted ms-small", id: "megascan-status" });
    const header = h(
      "header",
      { class: "ms-bar" },
      h("h1", { text: "MegaScan" }),
      h("label", {}, "Run ", this.runSelect),
      h("button", { text: "Reload", onclick: () => this.start() }),
      this.download,
      h("button", { id: "megascan-perfetto", text: "Open in Perfetto", onclick: () => this.openInPerfetto() }),
      this.status,
    );
    const note = h("div", {
      class: "ms-muted ms-small",
      text:
        "The merged trace is aligned on rank 0's clock. “Open in Perfetto” opens ui.perfetto.dev in a new tab and hands it the trace " +
        "from this page; it only works when this browser can reach ui.perfetto.dev (and allows the pop-up). Offline, download the trace instead.",
    });
    this.suspectsBody = h("div", { id: "megascan-suspects-body" });
    this.suspects = h("section", { class: "ms-card", id: "megascan-suspects" }, h("h2", { text: "Suspects" }), this.suspectsBody);
    this.bubbles = new BubblesView();
    this.main = h("div", { id: "megascan" }, header, note, this.suspects, this.bubbles.section, this.heatmap.section, this.timeline.section);
    root.replaceChildren(this.main, this.tip.node);
    let pending = null;
    window.addEventListener("resize", () => {
      clearTimeout(pending);
      pending = setTimeout(() => {
        this.heatmap.draw();
        this.timeline.draw();
      }, 120);
    });
  }

  setStatus(text, error = false) {
    this.status.textContent = text;
    this.status.className = `ms-small ${error ? "ms-error" : "ms-muted"}`;
  }

  async start() {
    this.setStatus("loading runs…");
    try {
      this.runs = (await getJSON("runs")).runs;
    } catch (err) {
      this.setStatus(`cannot list runs: ${err.message}`, true);
      return;
    }
    if (!this.runs.length) {
      this.setStatus("");
      this.suspectsBody.replaceChildren(
        h("p", { text: "No MegaScan run under this logdir yet: runs appear when MegaScan writes rank*-dp*-pp*-tp*.json[.gz] files." }),
      );
      return;
    }
    const keep = this.runs.some((r) => r.name === this.run) ? this.run : null;
    const newest = [...this.runs].sort((a, b) => b.updated - a.updated)[0].name;
    this.runSelect.replaceChildren(
      ...this.runs.map((r) => h("option", { value: r.name, text: `${r.name}  (${r.ranks} ranks${r.report ? ", report" : ""})` })),
    );
    this.runSelect.value = keep || newest;
    await this.selectRun(this.runSelect.value);
  }

  async selectRun(name) {
    this.main.dataset.state = "loading"; // "ready" once suspects, heatmap and timeline are drawn (tests wait on it)
    this.run = name;
    this.heatmap.focusRank = this.timeline.focusRank = null;
    this.download.href = url("trace", { run: name, download: 1 });
    this.setStatus(`loading ${name}…`);
    await Promise.all([this.loadSuspects(false), this.heatmap.load(name)]);
    if (name !== this.run) return; // another run was chosen meanwhile
    this.timeline.setSteps(this.heatmap.steps);
    this.timeline.ranksInput.value = this.defaultRanks();
    await this.timeline.load(name);
    if (name !== this.run) return;
    this.setStatus("");
    this.main.dataset.state = "ready";
  }

  defaultRanks() {
    // empty: the server's default (the first ranks); on large runs the suspects first
    const all = this.heatmap.ranks;
    if (all.length <= MAX_DEFAULT_RANKS) return "";
    const chosen = [...this.suspectRanks()].slice(0, MAX_DEFAULT_RANKS);
    for (const rank of all) {
      if (chosen.length >= MAX_DEFAULT_RANKS) break;
      if (!chosen.includes(rank)) chosen.push(rank);
    }
    return compactRanks(chosen);
  }

  suspectRanks() {
    const report = this.report && this.report.report;
    return new Set(report ? report.suspects.map((s) => s.rank) : []);
  }

  focus(rank) {
    this.heatmap.focusRank = this.timeline.focusRank = rank;
    this.heatmap.draw();
    if (this.timeline.include(rank)) this.timeline.load(this.run);
    else this.timeline.draw();
  }

  pick(rank, step) {
    this.timeline.stepSelect.value = String(step);
    this.heatmap.focusRank = this.timeline.focusRank = rank;
    this.heatmap.draw();
    this.timeline.include(rank);
    this.timeline.load(this.run);
  }

  // ----------------------------------------------------------------------------------------------- suspects

  async loadSuspects(detect) {
    const run = this.run;
    this.suspects.dataset.ready = "0";
    this.suspectsBody.replaceChildren(h("p", { class: "ms-muted", text: detect ? "running detection…" : "loading…" }));
    let report = null;
    let failure = null;
    try {
      report = await getJSON("suspects", { run, detect: detect ? 1 : 0 });
    } catch (err) {
      failure = err;
    }
    if (run !== this.run) return;
    this.report = report;
    if (failure) this.suspectsBody.replaceChildren(h("p", { class: "ms-error", text: `cannot load the report: ${failure.message}` }));
    else this.renderSuspects();
    this.bubbles.render(report && report.report);
    this.suspects.dataset.ready = "1";
    this.heatmap.draw();
    this.timeline.draw();
  }

  renderSuspects() {
    const report = this.report.report;
    if (!report) {
      this.suspectsBody.replaceChildren(
        h("p", {}, "This run has no ", h("code", { text: "megascan-report.json" }), " (MegaScan writes it at the end of fit). "),
        h("button", { id: "megascan-detect", text: "Run detection now", onclick: () => this.loadSuspects(true) }),
      );
      return;
    }
    const ranks = Object.keys(report.per_rank || {}).length;
    const steps = (report.steps || []).length;
    const count = report.suspects.length;
    const source = this.report.source === "file" ? "saved by MegaScan (megascan-report.json)" : "computed now by scan.detect";
    const parts = [
      h(
        "p",
        { class: "ms-small" },
        count
          ? h("strong", { class: "ms-error", text: `${count} suspect${count > 1 ? "s" : ""}` })
          : h("strong", { class: "ms-ok", text: "Nothing abnormal" }),
        ` in ${ranks} ranks over ${steps} step${steps === 1 ? "" : "s"} · report ${source}`,
        this.report.stale ? h("span", { class: "ms-warn", text: " · rank files were written after this report" }) : null,
      ),
    ];
    if (count) parts.push(this.suspectsTable(report.suspects));
    if ((report.warnings || []).length) {
      parts.push(
        h(
          "details",
          { class: "ms-small ms-warn" },
          h("summary", { text: `${report.warnings.length} warning${report.warnings.length > 1 ? "s" : ""}` }),
          h("ul", {}, report.warnings.map((w) => h("li", { text: w }))),
        ),
      );
    }
    this.suspectsBody.replaceChildren(...parts);
  }

  suspectsTable(suspects) {
    const columns = ["Rank", "dp · pp · tp", "Host", "Kind", "Slowdown", "Peer", "Impact (ms/step)", "Evidence"];
    const rows = suspects.map((s) =>
      h(
        "tr",
        { class: "ms-suspect", "data-rank": s.rank, title: "highlight in the heatmap and show in the timeline", onclick: () => this.focus(s.rank) },
        h("td", { class: "ms-num", text: String(s.rank) }),
        h("td", { text: `${s.dp} · ${s.pp} · ${s.tp}` }),
        h("td", { text: s.host }),
        h("td", {}, h("span", { class: `ms-kind ${s.kind}`, text: s.kind })),
        h("td", { class: "ms-num", text: `+${(100 * s.slowdown).toFixed(1)}%` }),
        h("td", { class: "ms-num", text: s.peer === null || s.peer === undefined ? "" : String(s.peer) }),
        h("td", { class: "ms-num", text: num((s.evidence || {}).impact_ms) }),
        h(
          "td",
          { class: "ms-evidence-cell" },
          evidenceText(s),
          h(
            "details",
            { class: "ms-evidence" },
            h("summary", { text: "all numbers" }),
            h("dl", {}, Object.entries(s.evidence || {}).flatMap(([k, v]) => [h("dt", { text: k }), h("dd", { text: evidenceValue(v) })])),
          ),
        ),
      ),
    );
    return h(
      "table",
      { class: "ms-table", id: "megascan-suspects-table" },
      h("thead", {}, h("tr", {}, columns.map((t) => h("th", { text: t })))),
      h("tbody", {}, rows),
    );
  }

  // ----------------------------------------------------------------------------------------------- Perfetto

  async openInPerfetto() {
    // Perfetto's documented hand-over: open the UI, PING it until it answers PONG, then post the trace buffer.
    const run = this.run;
    if (!run) return;
    const target = window.open(PERFETTO);
    if (!target) {
      this.setStatus("the browser blocked the pop-up: allow pop-ups for TensorBoard, or download the trace", true);
      return;
    }
    this.setStatus("fetching the merged trace…");
    let buffer;
    try {
      const response = await fetch(url("trace", { run }), { credentials: "same-origin" });
      if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
      buffer = await response.arrayBuffer();
    } catch (err) {
      this.setStatus(`cannot fetch the merged trace: ${err.message}`, true);
      return;
    }
    this.setStatus("waiting for ui.perfetto.dev…");
    let answered = false;
    let timer = null;
    const onMessage = (event) => {
      if (event.origin !== PERFETTO || event.data !== "PONG" || answered) return;
      answered = true;
      clearInterval(timer);
      window.removeEventListener("message", onMessage);
      const fileName = `megascan-${run.replace(/[^\w.-]+/g, "_")}-merged.json`;
      target.postMessage({ perfetto: { buffer, title: `MegaScan · ${run}`, fileName } }, PERFETTO);
      this.setStatus("trace sent to Perfetto (see the new tab)");
    };
    window.addEventListener("message", onMessage);
    timer = setInterval(() => {
      try {
        target.postMessage("PING", PERFETTO);
      } catch (err) {
        /* the tab is still loading */
      }
    }, 150);
    setTimeout(() => {
      if (answered) return;
      clearInterval(timer);
      window.removeEventListener("message", onMessage);
      this.setStatus("ui.perfetto.dev did not answer within 30 s (unreachable from this browser?): use “Download merged trace” instead", true);
    }, 30000);
  }
}

export async function render() {
  document.title = "MegaScan";
  document.head.append(h("style", { text: STYLE }));
  await new MegaScanApp(document.body).start();
}
