// The rank × step heatmap of the MegaScan tab: one metric of each rank's steps as colour (compute, communication
// and waits, step time, other), and beside it each rank's mean split of a step into those parts. In synchronous
// training every rank waits for the slowest, so step times are nearly uniform: the split shows who computes
// longer and who waits for it.

import { getJSON, h, num, setupCanvas, swatch } from "./common.js";

const METRICS = [
  ["compute_ms", "Compute", "Net compute per step: forward, backward, layers and optimizer, less the time inside waits. A slow GPU shows here."],
  ["wait_ms", "Comm. & waits", "Pipeline sends/receives, blocking collectives, gradient sync and data per step: the peers of a slow rank wait longer."],
  ["step_ms", "Step time", "Wall time of the step, the host's gap before it (data fetch included) too. In synchronous training every rank waits for the slowest, so this is nearly uniform."],
  ["other_ms", "Other (host)", "Step time that is neither compute nor communication: host work between the traced spans."],
];
const SPLIT = [
  ["compute_ms", "#4C72B0", "compute"],
  ["wait_ms", "#C44E52", "comm. & waits"],
  ["other_ms", "#B8B8B8", "other"],
];
const VIRIDIS = ["#440154", "#482878", "#3e4989", "#31688e", "#26828e", "#1f9e89", "#35b779", "#6ece58", "#b5de2b", "#fde725"];
const FONT = "11px Roboto, Arial, sans-serif";

function hexRGB(hex) {
  return [1, 3, 5].map((i) => parseInt(hex.slice(i, i + 2), 16));
}

function viridis(t) {
  const x = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(x));
  const a = hexRGB(VIRIDIS[i]);
  const b = hexRGB(VIRIDIS[i + 1]);
  return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * (x - i))).join(",")})`;
}

function mean(values) {
  const finite = values.filter((v) => typeof v === "number");
  return finite.length ? finite.reduce((a, b) => a + b, 0) / finite.length : 0;
}

function range(matrix) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const row of matrix) {
    for (const v of row) {
      if (typeof v !== "number") continue;
      lo = Math.min(lo, v);
      hi = Math.max(hi, v);
    }
  }
  return isFinite(lo) ? [lo, hi] : [0, 1];
}

export class HeatmapView {
  // tip: the shared Tooltip; suspects(): Set of suspect ranks; onPick(rank, step): a cell was clicked
  constructor({ tip, suspects, onPick }) {
    this.tip = tip;
    this.suspects = suspects;
    this.onPick = onPick;
    this.data = null;
    this.metric = "compute_ms";
    this.focusRank = null;
    this.layout = null;
    this.buttons = h(
      "div",
      { class: "ms-row" },
      METRICS.map(([key, label]) => h("button", { text: label, onclick: () => this.setMetric(key) })),
    );
    this.help = h("div", { class: "ms-muted ms-small" });
    this.canvas = h("canvas", { id: "megascan-heatmap-canvas" });
    this.legend = h("div", { class: "ms-legend" });
    this.info = h("div", { class: "ms-muted ms-small" });
    this.section = h(
      "section",
      { class: "ms-card", id: "megascan-heatmap" },
      h("h2", { text: "Step times per rank" }),
      this.buttons,
      this.help,
      h("div", { class: "ms-canvas-wrap" }, this.canvas),
      this.legend,
      this.info,
    );
    this.canvas.addEventListener("mousemove", (e) => this.hover(e));
    this.canvas.addEventListener("mouseleave", () => this.tip.hide());
    this.canvas.addEventListener("click", (e) => this.click(e));
    this.setMetric(this.metric);
  }

  get steps() {
    return this.data ? this.data.steps : [];
  }

  get ranks() {
    return this.data ? this.data.ranks.map((r) => r.rank) : [];
  }

  setMetric(key) {
    this.metric = key;
    [...this.buttons.children].forEach((b, i) => (b.className = METRICS[i][0] === key ? "ms-on" : ""));
    this.help.textContent = METRICS.find((m) => m[0] === key)[2];
    this.draw();
  }

  async load(run) {
    this.section.dataset.ready = "0";
    try {
      this.data = await getJSON("heatmap", { run });
    } catch (err) {
      this.data = null;
      setupCanvas(this.canvas, 10, 10);
      this.legend.replaceChildren();
      this.info.textContent = `cannot load step times: ${err.message}`;
    }
    this.draw();
    this.section.dataset.ready = "1";
  }

  computeLayout() {
    const nRanks = this.data.ranks.length;
    const nSteps = this.data.steps.length;
    const width = Math.max(560, this.section.clientWidth - 30);
    const left = 118;
    const top = 22;
    const bars = 190;
    const cellW = Math.max(2, Math.min(44, (width - left - bars - 24) / Math.max(1, nSteps)));
    const rowH = Math.max(0.5, Math.min(20, 560 / Math.max(1, nRanks)));
    const gridW = cellW * nSteps;
    return { left, top, bars, cellW, rowH, gridW, width: left + gridW + 24 + bars, height: top + rowH * nRanks + 8 };
  }

  draw() {
    const data = this.data;
    if (!data) return;
    if (!data.ranks.length || !data.steps.length) {
      setupCanvas(this.canvas, 10, 10);
      this.info.textContent = "no finished step in the rank files yet";
      return;
    }
    const L = (this.layout = this.computeLayout());
    const ctx = setupCanvas(this.canvas, L.width, L.height);
    const values = data[this.metric];
    const [lo, hi] = range(values);
    const suspects = this.suspects();
    const inset = (size) => (size > 6 ? 1 : 0);
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    ctx.fillStyle = "#555";
    ctx.textAlign = "center";
    const every = Math.ceil(28 / L.cellW);
    data.steps.forEach((step, j) => {
      if (j % every === 0) ctx.fillText(String(step), L.left + (j + 0.5) * L.cellW, 10);
    });
    data.ranks.forEach((info, i) => {
      const y = L.top + i * L.rowH;
      values[i].forEach((v, j) => {
        ctx.fillStyle = typeof v === "number" ? viridis(hi > lo ? (v - lo) / (hi - lo) : 0.5) : "#eceff3";
        ctx.fillRect(L.left + j * L.cellW, y, Math.max(1, L.cellW - inset(L.cellW)), Math.max(0.5, L.rowH - inset(L.rowH)));
      });
      const suspect = suspects.has(info.rank);
      if (L.rowH >= 9) {
        ctx.textAlign = "right";
        ctx.fillStyle = suspect ? "#b3261e" : "#333";
        ctx.font = `${suspect ? "bold " : ""}${FONT}`;
        ctx.fillText(`${suspect ? "● " : ""}r${info.rank}  pp${info.pp ?? "?"} tp${info.tp ?? "?"}`, L.left - 6, y + L.rowH / 2);
      } else if (suspect) {
        ctx.fillStyle = "#b3261e";
        ctx.fillRect(L.left - 8, y, 5, Math.max(1, L.rowH));
      }
      if (info.rank === this.focusRank) {
        ctx.strokeStyle = "#ff1744";
        ctx.lineWidth = 2;
        ctx.strokeRect(L.left - 1, y - 1, L.gridW + 1, L.rowH + 1);
      }
    });
    // each rank's mean split of a step: compute, communication and waits, other
    const x0 = L.left + L.gridW + 24;
    const means = data.ranks.map((_, i) => SPLIT.map(([key]) => mean(data[key][i])));
    const most = means.reduce((top, m) => Math.max(top, m[0] + m[1] + m[2]), 1e-9);
    ctx.textAlign = "left";
    ctx.fillStyle = "#555";
    ctx.font = FONT;
    ctx.fillText("mean split per step", x0, 10);
    means.forEach((m, i) => {
      let x = x0;
      m.forEach((v, k) => {
        const w = (v / most) * (L.bars - 8);
        ctx.fillStyle = SPLIT[k][1];
        ctx.fillRect(x, L.top + i * L.rowH, w, Math.max(0.5, L.rowH - inset(L.rowH)));
        x += w;
      });
    });
    this.legend.replaceChildren(
      h("span", {}, `${METRICS.find((m) => m[0] === this.metric)[1]}: `),
      swatch(viridis(0), `${num(lo)} ms`),
      swatch(viridis(0.5), `${num((lo + hi) / 2)} ms`),
      swatch(viridis(1), `${num(hi)} ms`),
      h("span", {}, "  split: "),
      ...SPLIT.map(([, color, label]) => swatch(color, label)),
    );
    this.info.textContent =
      `${data.ranks.length} ranks × ${data.steps.length} steps` +
      (data.omitted_steps ? ` (the ${data.omitted_steps} earlier steps are not shown)` : "") +
      ". Step times are measured on each rank's own clock; hover a cell for its numbers, click it to show that step below.";
  }

  cellAt(event) {
    const L = this.layout;
    if (!L || !this.data) return null;
    const rect = this.canvas.getBoundingClientRect();
    const j = Math.floor((event.clientX - rect.left - L.left) / L.cellW);
    const i = Math.floor((event.clientY - rect.top - L.top) / L.rowH);
    if (i < 0 || j < 0 || i >= this.data.ranks.length || j >= this.data.steps.length) return null;
    return { i, j };
  }

  hover(event) {
    const cell = this.cellAt(event);
    if (!cell) return this.tip.hide();
    const { i, j } = cell;
    const data = this.data;
    const info = data.ranks[i];
    const v = (key) => num(data[key][i][j]);
    this.tip.show(
      event,
      `rank ${info.rank} (dp${info.dp ?? "?"} pp${info.pp ?? "?"} tp${info.tp ?? "?"}, ${info.host ?? "?"}) · step ${data.steps[j]}\n` +
        `step ${v("step_ms")} ms · compute ${v("compute_ms")} ms\ncomm. & waits ${v("wait_ms")} ms · other ${v("other_ms")} ms`,
    );
  }

  click(event) {
    const cell = this.cellAt(event);
    if (cell) this.onPick(this.data.ranks[cell.i].rank, this.data.steps[cell.j]);
  }
}
