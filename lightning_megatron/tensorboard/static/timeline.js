// The timeline of one step in the MegaScan tab, on rank 0's clock (the run merged by scan.analysis.aggregate): a row per
// rank and stream (steps, compute, communication, host, layers), spans coloured by category, and the merged
// trace's flows as arrows: pipeline send → receive, and, on request, collective last arriver → waiting member.

import { CAT_COLORS, compactRanks, getJSON, h, num, setupCanvas, swatch } from "./common.js";

const LEGEND = [
  ["forward", "forward"],
  ["backward", "backward"],
  ["compute.layer", "layer part"],
  ["p2p", "pipeline send/recv"],
  ["ring", "context-parallel ring exchange"],
  ["collective", "collective"],
  ["grad_sync", "gradient sync"],
  ["optimizer", "optimizer"],
  ["data", "data"],
  ["sync", "ranks' per-batch sync"],
  ["step", "step"],
];
const P2P_FLOW = "#1b5e20";
const COLLECTIVE_FLOW = "rgba(196,78,82,.55)";
const FONT = "Roboto, Arial, sans-serif";

function spanColor(span) {
  if (span.cat === "compute") return span.name.startsWith("backward") ? CAT_COLORS.backward : CAT_COLORS.forward;
  return CAT_COLORS[span.cat] || "#9AA5B1";
}

function niceStep(span, target) {
  const raw = span / Math.max(1, target);
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  for (const m of [1, 2, 5, 10]) if (m * power >= raw) return m * power;
  return 10 * power;
}

function arrow(ctx, x1, y1, x2, y2, color) {
  ctx.strokeStyle = color;
  ctx.fillStyle = color;
  ctx.lineWidth = 1.2;
  ctx.beginPath();
  ctx.moveTo(x1, y1);
  ctx.lineTo(x2, y2);
  ctx.stroke();
  const angle = Math.atan2(y2 - y1, x2 - x1);
  ctx.beginPath();
  ctx.moveTo(x2, y2);
  ctx.lineTo(x2 - 6 * Math.cos(angle - 0.4), y2 - 6 * Math.sin(angle - 0.4));
  ctx.lineTo(x2 - 6 * Math.cos(angle + 0.4), y2 - 6 * Math.sin(angle + 0.4));
  ctx.closePath();
  ctx.fill();
}

export class TimelineView {
  // tip: the shared Tooltip; suspects(): Set of suspect ranks
  constructor({ tip, suspects }) {
    this.tip = tip;
    this.suspects = suspects;
    this.data = null;
    this.view = null; // [start, end] in µs from the step's start
    this.focusRank = null;
    this.layout = null;
    this.drag = null;
    this.run = null;
    this.stepSelect = h("select", { id: "megascan-step", "aria-label": "step", onchange: () => this.load(this.run) });
    this.ranksInput = h("input", { type: "text", id: "megascan-ranks", size: 18, placeholder: "e.g. 0-7,12", "aria-label": "ranks" });
    this.ranksInput.addEventListener("keydown", (e) => {
      if (e.key === "Enter") this.load(this.run);
    });
    this.p2pFlows = h("input", { type: "checkbox", checked: true, onchange: () => this.draw() });
    this.collectiveFlows = h("input", { type: "checkbox", onchange: () => this.draw() });
    this.canvas = h("canvas", { id: "megascan-timeline-canvas" });
    this.info = h("div", { class: "ms-muted ms-small" });
    this.section = h(
      "section",
      { class: "ms-card", id: "megascan-timeline" },
      h("h2", { text: "Timeline of one step (aligned clocks)" }),
      h(
        "div",
        { class: "ms-row" },
        h("label", {}, "Step ", this.stepSelect),
        h("label", {}, "Ranks ", this.ranksInput),
        h("button", { text: "Show", onclick: () => this.load(this.run) }),
        h("label", {}, this.p2pFlows, " pipeline flows"),
        h("label", {}, this.collectiveFlows, " collective flows"),
        h("span", { class: "ms-muted ms-small", text: "wheel: zoom · drag: pan · double-click: reset · click a heatmap cell to pick a step" }),
      ),
      h("div", { class: "ms-canvas-wrap" }, this.canvas),
      h(
        "div",
        { class: "ms-legend" },
        LEGEND.map(([cat, label]) => swatch(CAT_COLORS[cat], label)),
        swatch(P2P_FLOW, "p2p flow →"),
        swatch(COLLECTIVE_FLOW, "collective wait →"),
      ),
      this.info,
    );
    this.canvas.addEventListener("mousemove", (e) => this.hover(e));
    this.canvas.addEventListener("mouseleave", () => {
      this.tip.hide();
      this.drag = null;
    });
    this.canvas.addEventListener("wheel", (e) => this.wheel(e), { passive: false });
    this.canvas.addEventListener("mousedown", (e) => {
      this.drag = { x: e.clientX, view: this.view && [...this.view] };
    });
    window.addEventListener("mouseup", () => {
      this.drag = null;
    });
    this.canvas.addEventListener("dblclick", () => {
      if (this.data) this.view = [0, this.data.duration_us];
      this.draw();
    });
  }

  setSteps(steps) {
    const previous = this.stepSelect.value;
    this.stepSelect.replaceChildren(...steps.map((s) => h("option", { value: s, text: String(s) })));
    // default: the last step (the first ones often include warm-up); a still valid choice is kept
    if (steps.length) this.stepSelect.value = steps.map(String).includes(previous) ? previous : String(steps[steps.length - 1]);
  }

  shownRanks() {
    return this.data ? [...new Set(this.data.rows.map((r) => r.rank))] : [];
  }

  // puts a rank into the rank list; true when the timeline must be fetched again to show it
  include(rank) {
    const shown = this.shownRanks();
    if (shown.includes(rank)) return false;
    this.ranksInput.value = compactRanks([rank, ...shown].slice(0, 32));
    return true;
  }

  async load(run) {
    this.run = run;
    this.section.dataset.ready = "0";
    if (!this.stepSelect.value) {
      this.info.textContent = "no step to show";
      this.section.dataset.ready = "1";
      return;
    }
    this.info.textContent = "merging the rank files onto one clock…";
    const request = (this.request = { run, step: this.stepSelect.value, ranks: this.ranksInput.value.trim() });
    try {
      const data = await getJSON("timeline", request);
      if (request !== this.request) return; // a newer request is on its way
      this.data = data;
      this.view = [0, data.duration_us];
      this.draw();
    } catch (err) {
      if (request !== this.request) return;
      this.data = null;
      setupCanvas(this.canvas, 10, 10);
      this.info.textContent = `cannot load the timeline: ${err.message}`;
    }
    this.section.dataset.ready = "1";
  }

  computeLayout() {
    const rows = this.data.rows.length;
    const width = Math.max(600, this.section.clientWidth - 30);
    const rowH = rows > 120 ? 9 : 15;
    const left = 190;
    const top = 24;
    return { width, rowH, left, top, plotW: width - left - 10, height: top + rowH * rows + 6 };
  }

  draw() {
    const t = this.data;
    if (!t) return;
    const L = (this.layout = this.computeLayout());
    const ctx = setupCanvas(this.canvas, L.width, L.height);
    const [v0, v1] = this.view;
    const scale = L.plotW / Math.max(1e-9, v1 - v0);
    const X = (ts) => L.left + (ts - v0) * scale;
    // time axis: ms from the step's start
    const tick = niceStep((v1 - v0) / 1000, 8);
    ctx.font = `11px ${FONT}`;
    ctx.textBaseline = "middle";
    ctx.textAlign = "center";
    for (let ms = Math.ceil(v0 / 1000 / tick) * tick; ms <= v1 / 1000; ms += tick) {
      const x = X(ms * 1000);
      ctx.fillStyle = "#f0f2f5";
      ctx.fillRect(x, L.top, 1, L.height - L.top);
      ctx.fillStyle = "#555";
      ctx.fillText(`${+ms.toFixed(3)} ms`, x, 10);
    }
    // rows: a band per rank, a label per stream
    const suspects = this.suspects();
    let previous = null;
    let band = false;
    t.rows.forEach((row, i) => {
      const y = L.top + i * L.rowH;
      if (row.rank !== previous) {
        band = !band;
        previous = row.rank;
      }
      ctx.fillStyle = row.rank === this.focusRank ? "#fff4f4" : band ? "#fafbfc" : "#ffffff";
      ctx.fillRect(L.left, y, L.plotW, L.rowH);
      const info = t.ranks[String(row.rank)] || {};
      const stream = (t.threads[String(row.tid)] || `tid ${row.tid}`).split(" (")[0];
      const suspect = suspects.has(row.rank);
      ctx.textAlign = "right";
      ctx.fillStyle = suspect ? "#b3261e" : "#333";
      ctx.font = `${suspect ? "bold " : ""}${L.rowH > 10 ? 11 : 9}px ${FONT}`;
      ctx.fillText(`${suspect ? "● " : ""}r${row.rank} pp${info.pp ?? "?"} tp${info.tp ?? "?"} · ${stream}`, L.left - 6, y + L.rowH / 2);
    });
    ctx.save();
    ctx.beginPath();
    ctx.rect(L.left, L.top, L.plotW, L.height - L.top);
    ctx.clip();
    ctx.textAlign = "left";
    ctx.font = `10px ${FONT}`;
    for (const span of t.spans) {
      const x = X(span.ts);
      const w = span.dur * scale;
      if (x + w < L.left || x > L.left + L.plotW) continue;
      const y = L.top + span.row * L.rowH + 1;
      ctx.fillStyle = spanColor(span);
      ctx.fillRect(x, y, Math.max(0.75, w), L.rowH - 2);
      if (w > 46 && L.rowH > 10) {
        ctx.fillStyle = span.cat === "step" ? "#333" : "#fff";
        ctx.fillText(span.name.slice(0, Math.floor(w / 6)), Math.max(x, L.left) + 3, y + (L.rowH - 2) / 2);
      }
    }
    for (const flow of t.flows) {
      const p2p = flow.cat === "p2p";
      if (p2p ? !this.p2pFlows.checked : !this.collectiveFlows.checked) continue;
      const y1 = L.top + (flow.from + 0.5) * L.rowH;
      const y2 = L.top + (flow.to + 0.5) * L.rowH;
      arrow(ctx, X(flow.from_ts), y1, X(flow.to_ts), y2, p2p ? P2P_FLOW : COLLECTIVE_FLOW);
    }
    ctx.restore();
    const counts = t.flows.reduce((acc, f) => ((acc[f.cat] = (acc[f.cat] || 0) + 1), acc), {});
    const skew = t.clock_skew_p95_us;
    this.info.textContent =
      `step ${t.step}: ${num(t.duration_us / 1000)} ms across ${Object.keys(t.ranks).length} of ${t.available_ranks.length} ranks · ` +
      `${t.spans.length} spans, ${counts.p2p || 0} pipeline and ${counts.collective || 0} collective flows` +
      (skew !== null && skew !== undefined ? ` · residual clock skew p95 ${num(skew, 1)} µs` : "") +
      (t.truncated ? " · too many spans: the rest were left out, pick fewer ranks" : "");
  }

  spanAt(event) {
    const L = this.layout;
    const t = this.data;
    if (!L || !t) return null;
    const rect = this.canvas.getBoundingClientRect();
    const x = event.clientX - rect.left;
    const row = Math.floor((event.clientY - rect.top - L.top) / L.rowH);
    if (row < 0 || row >= t.rows.length || x < L.left) return null;
    const [v0, v1] = this.view;
    const ts = v0 + ((x - L.left) / L.plotW) * (v1 - v0);
    const slack = (3 / L.plotW) * (v1 - v0);
    let best = null;
    for (const span of t.spans) {
      if (span.row !== row || ts < span.ts - slack || ts > span.ts + span.dur + slack) continue;
      if (!best || span.dur < best.dur) best = span; // the innermost span under the pointer
    }
    return best;
  }

  hover(event) {
    if (this.drag && this.drag.view) {
      const [v0, v1] = this.drag.view;
      const shift = ((event.clientX - this.drag.x) / this.layout.plotW) * (v1 - v0);
      this.view = [v0 - shift, v1 - shift];
      this.draw();
      return;
    }
    const s = this.spanAt(event);
    if (!s) return this.tip.hide();
    const args = Object.keys(s.args || {}).length ? `\n${JSON.stringify(s.args).slice(0, 400)}` : "";
    this.tip.show(event, `${s.name}  [${s.cat}]\nstart ${num(s.ts / 1000, 3)} ms · duration ${num(s.dur / 1000, 3)} ms${args}`);
  }

  wheel(event) {
    if (!this.data) return;
    event.preventDefault();
    const L = this.layout;
    const rect = this.canvas.getBoundingClientRect();
    const [v0, v1] = this.view;
    const frac = Math.min(1, Math.max(0, (event.clientX - rect.left - L.left) / L.plotW));
    const at = v0 + frac * (v1 - v0);
    const span = Math.max(1, Math.min(this.data.duration_us * 4, (v1 - v0) * Math.exp(event.deltaY * 0.0015)));
    this.view = [at - frac * span, at + (1 - frac) * span];
    this.draw();
  }
}
