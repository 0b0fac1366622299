// Shared by the MegaScan tab's modules: colours, the page's CSS, a DOM builder, requests, number formats, canvas
// set-up and the tooltip. Data from the server only ever enters the page as text (textContent), never as HTML:
// run names, host names and span names come from files on disk.

export const CAT_COLORS = {
  forward: "#4C72B0",
  backward: "#DD8452",
  "compute.layer": "#8172B3",
  "compute.op": "#A89CC8",
  p2p: "#55A868",
  ring: "#2A9D8F",
  "ring.wait": "#8FD3CB",
  collective: "#C44E52",
  grad_sync: "#937860",
  optimizer: "#8C8C8C",
  data: "#CCB974",
  sync: "#64B5CD",
  host: "#B8B8B8",
  step: "#E3E7EC",
};

export const STYLE = `
:root { color-scheme: light; }
body { margin: 0; font: 13px/1.45 Roboto, "Segoe UI", "Helvetica Neue", Arial, sans-serif; color: #212121; background: #f5f6f8; }
#megascan { padding: 14px 18px 40px; max-width: 1600px; }
header.ms-bar { display: flex; flex-wrap: wrap; align-items: center; gap: 10px 14px; margin-bottom: 12px; }
header.ms-bar h1 { font-size: 18px; font-weight: 500; margin: 0 8px 0 0; }
.ms-muted { color: #666; }
.ms-small { font-size: 12px; }
.ms-card { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: 12px 14px; margin-bottom: 14px; }
.ms-card h2 { font-size: 14px; font-weight: 600; margin: 0 0 8px; }
.ms-row { display: flex; flex-wrap: wrap; align-items: center; gap: 8px 12px; margin-bottom: 8px; }
button, select, input { font: inherit; }
button { border: 1px solid #c7ccd3; background: #fff; border-radius: 4px; padding: 3px 10px; cursor: pointer; }
button:hover { background: #eef2f7; }
button.ms-on { background: #1f6feb; border-color: #1f6feb; color: #fff; }
a.ms-button { border: 1px solid #c7ccd3; border-radius: 4px; padding: 3px 10px; color: inherit; text-decoration: none; background: #fff; }
a.ms-button:hover { background: #eef2f7; }
select, input[type=text] { border: 1px solid #c7ccd3; border-radius: 4px; padding: 3px 6px; background: #fff; }
table.ms-table { border-collapse: collapse; width: 100%; }
table.ms-table th { text-align: left; font-weight: 600; color: #444; border-bottom: 2px solid #dde1e6; padding: 5px 8px; white-space: nowrap; }
table.ms-table td { border-bottom: 1px solid #eceff3; padding: 5px 8px; vertical-align: top; }
table.ms-table tr.ms-suspect:hover { background: #f3f7ff; cursor: pointer; }
td.ms-evidence-cell { overflow-wrap: anywhere; min-width: 18em; }
td.ms-num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.ms-kind { display: inline-block; padding: 0 6px; border-radius: 9px; font-size: 12px; background: #fdecea; color: #a4231a; }
.ms-kind.link { background: #e8f4ea; color: #1e6b33; }
.ms-kind.data { background: #fbf5e0; color: #7a5d00; }
.ms-ok { color: #1e6b33; font-weight: 500; }
.ms-warn { color: #8a5300; }
.ms-error { color: #b3261e; }
details.ms-evidence summary { cursor: pointer; color: #555; font-size: 12px; }
details.ms-evidence dl { display: grid; grid-template-columns: max-content minmax(0, 1fr); gap: 0 12px; margin: 4px 0 0; font-size: 12px; }
details.ms-evidence dt { color: #666; }
details.ms-evidence dd { margin: 0; font-variant-numeric: tabular-nums; min-width: 0; overflow-wrap: anywhere; }
.ms-canvas-wrap { position: relative; overflow-x: auto; }
canvas { display: block; }
.ms-legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; color: #444; margin-top: 6px; }
.ms-swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 4px; vertical-align: -1px; }
.ms-tip { position: fixed; z-index: 10; pointer-events: none; background: rgba(33,33,33,.93); color: #fff; font-size: 12px; padding: 6px 8px; border-radius: 4px; max-width: 460px; white-space: pre-wrap; display: none; }
`;

export function h(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

// Routes are relative to the iframe's <base href="plugin/megascan/">, i.e. /data/plugin/megascan/<route>.
export function url(route, params = {}) {
  const target = new URL(route, document.baseURI);
  for (const [key, value] of Object.entries(params)) {
    if (value !== undefined && value !== null && value !== "") target.searchParams.set(key, String(value));
  }
  return target.toString();
}

export async function getJSON(route, params) {
  const response = await fetch(url(route, params), { credentials: "same-origin" });
  let body = {};
  try {
    body = await response.json();
  } catch (err) {
    body = {};
  }
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

export function num(value, digits = 2) {
  return typeof value === "number" && isFinite(value) ? value.toFixed(digits) : "–";
}

export function pct(value) {
  return typeof value === "number" && isFinite(value) ? `${(100 * value).toFixed(0)}%` : "–";
}

export function compactRanks(ranks) {
  const sorted = [...new Set(ranks)].sort((a, b) => a - b);
  const parts = [];
  for (let i = 0; i < sorted.length; ) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
    parts.push(i === j ? `${sorted[i]}` : `${sorted[i]}-${sorted[j]}`);
    i = j + 1;
  }
  return parts.join(",");
}

export function setupCanvas(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return ctx;
}

export function swatch(color, label) {
  return h("span", {}, h("span", { class: "ms-swatch", style: `background:${color}` }), label);
}

export class Tooltip {
  constructor() {
    this.node = h("div", { class: "ms-tip" });
  }

  show(event, text) {
    const tip = this.node;
    tip.textContent = text;
    tip.style.display = "block";
    const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 8);
    const y = Math.min(event.clientY + 14, window.innerHeight - tip.offsetHeight - 8);
    tip.style.left = `${Math.max(4, x)}px`;
    tip.style.top = `${Math.max(4, y)}px`;
  }

  hide() {
    this.node.style.display = "none";
  }
}
