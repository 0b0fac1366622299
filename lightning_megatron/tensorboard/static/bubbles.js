// The tab's "Pipeline bubbles" card: per pipeline stage, how long each step waited for a neighbour (bubble) and
// moved bytes (transfer), from the report's `bubbles` (scan.analysis.bubbles), beside the schedule's theoretical bubble
// fraction. A stacked bar per stage shows both as shares of the stage's pipeline time, with the theory marked.

import { h, num, pct, swatch } from "./common.js";

const BUBBLE = "#DD8452";
const TRANSFER = "#4C72B0";

function share(value) {
  return `${Math.max(0, Math.min(100, 100 * (value || 0))).toFixed(2)}%`;
}

export class BubblesView {
  constructor() {
    this.body = h("div", { id: "megascan-bubbles-body" });
    this.section = h("section", { class: "ms-card", id: "megascan-bubbles", hidden: true }, h("h2", { text: "Pipeline bubbles" }), this.body);
  }

  render(report) {
    const bubbles = report && report.bubbles;
    this.section.hidden = !(bubbles && (bubbles.stages || []).length);
    if (this.section.hidden) {
      this.body.replaceChildren();
      return;
    }
    const theory = bubbles.theoretical_fraction;
    const measured = bubbles.measured_fraction;
    const m = bubbles.microbatches;
    const summary = h(
      "p",
      { class: "ms-small", id: "megascan-bubbles-summary" },
      `${bubbles.schedule}, P=${bubbles.pipeline_size}, V=${bubbles.virtual_pipeline_size}, M=${m === null || m === undefined ? "?" : m}: `,
      h("strong", { text: `bubble fraction ${measured === null || measured === undefined ? "n/a" : pct(measured)}` }),
      ` measured (median over stages) vs ${theory === null || theory === undefined ? "n/a" : pct(theory)} in theory ${bubbles.theoretical_formula || ""}`,
      ` · clocks aligned within ±${num(bubbles.clock_uncertainty_us, 0)} µs (the bubble's range)`,
    );
    const note = h(
      "p",
      { class: "ms-muted ms-small" },
      swatch(BUBBLE, "bubble"),
      ": the time a pipeline send or receive waited for its peer to post the matching operation (a neighbour still " +
        "computing, or the schedule's warm-up and cool-down). ",
      swatch(TRANSFER, "transfer"),
      ": the rest of the operation, moving the bytes. The black mark is the schedule's theoretical bubble fraction.",
    );
    const columns = ["Stage", "Ranks", "Bubble (ms/step)", "Range", "Transfer (ms/step)", "Pipeline (ms)", "Bubble", "Transfer", "Share of pipeline time"];
    const rows = bubbles.stages.map((s) =>
      h(
        "tr",
        { class: "ms-bubble-stage", "data-stage": s.stage },
        h("td", { text: `pp${s.stage}` }),
        h("td", { text: (s.ranks || []).join(", ") }),
        h("td", { class: "ms-num", text: num(s.bubble_ms) }),
        h("td", { class: "ms-num ms-muted", text: `${num(s.bubble_ms_low)}–${num(s.bubble_ms_high)}` }),
        h("td", { class: "ms-num", text: num(s.transfer_ms) }),
        h("td", { class: "ms-num", text: num(s.pipeline_ms) }),
        h("td", { class: "ms-num", text: s.bubble_fraction === null ? "–" : pct(s.bubble_fraction) }),
        h("td", { class: "ms-num", text: s.transfer_fraction === null ? "–" : pct(s.transfer_fraction) }),
        h("td", { style: "min-width: 220px" }, this.bar(s, theory)),
      ),
    );
    const table = h(
      "table",
      { class: "ms-table", id: "megascan-bubbles-table" },
      h("thead", {}, h("tr", {}, columns.map((t) => h("th", { text: t })))),
      h("tbody", {}, rows),
    );
    this.body.replaceChildren(summary, table, note);
  }

  bar(stage, theory) {
    const title = `bubble ${pct(stage.bubble_fraction || 0)}, transfer ${pct(stage.transfer_fraction || 0)} of the pipeline time` +
      (theory === null || theory === undefined ? "" : `; theory ${pct(theory)}`);
    return h(
      "div",
      { class: "ms-bubble-bar", title, style: "position: relative; height: 12px; background: #eceff3; border-radius: 2px; display: flex" },
      h("div", { style: `width: ${share(stage.bubble_fraction)}; background: ${BUBBLE}` }),
      h("div", { style: `width: ${share(stage.transfer_fraction)}; background: ${TRANSFER}` }),
      theory === null || theory === undefined
        ? null
        : h("div", { style: `position: absolute; left: ${share(theory)}; top: -2px; bottom: -2px; width: 2px; background: #212121` }),
    );
  }
}
