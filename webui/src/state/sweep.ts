// `lightning-megatron scope sweep` results (sweep.csv) read in the browser: rows, the clean loss they imply,
// and the panels sweep.png draws: per (site, kind) Δ loss over layer × strength, and for the cells of one expert
// each (mixture-of-experts sweeps, an `expert` column) per (site, kind, strength) Δ loss over layer × expert.
export interface SweepRow {
  layer: number;
  /** The expert whose router logit the cell perturbed; null where the cell is not per expert. */
  expert: number | null;
  site: string;
  kind: string;
  strength: number;
  valLoss: number;
  deltaLoss: number;
  gradNorm: number | null;
  deltaGradNorm: number | null;
}

export interface SweepPanel {
  title: string;
  site: string;
  kind: string;
  /** The one strength of an expert panel (null: a strength panel, or `disable`, which has none). */
  strength: number | null;
  /** What the columns are: strengths, or experts. */
  axis: "strength" | "expert";
  layers: number[];
  columns: number[];
  /** delta[layerIndex][columnIndex]; NaN where the grid has no cell. */
  delta: number[][];
}

export interface Sweep {
  rows: SweepRow[];
  clean: number | null;
  panels: SweepPanel[];
}

/** RFC 4180 CSV (quotes, doubled quotes, CRLF) into rows of fields. */
export function parseCsv(text: string): string[][] {
  const rows: string[][] = [];
  let field = "";
  let row: string[] = [];
  let quoted = false;
  for (let i = 0; i < text.length; i++) {
    const c = text[i];
    if (quoted) {
      if (c === '"') {
        if (text[i + 1] === '"') {
          field += '"';
          i++;
        } else quoted = false;
      } else field += c;
    } else if (c === '"') quoted = true;
    else if (c === ",") {
      row.push(field);
      field = "";
    } else if (c === "\n" || c === "\r") {
      if (c === "\r" && text[i + 1] === "\n") i++;
      row.push(field);
      rows.push(row);
      row = [];
      field = "";
    } else field += c;
  }
  if (field !== "" || row.length > 0) {
    row.push(field);
    rows.push(row);
  }
  return rows.filter((r) => !(r.length === 1 && r[0] === ""));
}

/** Python's float spellings too: nan, inf, -inf. */
export function parseNumber(text: string): number {
  const t = text.trim().toLowerCase();
  if (t === "nan") return NaN;
  if (t === "inf" || t === "infinity" || t === "+inf") return Infinity;
  if (t === "-inf" || t === "-infinity") return -Infinity;
  if (t === "") return NaN;
  return Number(t);
}

const REQUIRED = ["layer", "site", "kind", "strength", "val_loss", "delta_loss"];

export function parseSweep(text: string): Sweep {
  const table = parseCsv(text.replace(/^\uFEFF/, ""));
  if (table.length === 0) throw new Error("the file is empty");
  const header = table[0].map((h) => h.trim());
  const missing = REQUIRED.filter((name) => !header.includes(name));
  if (missing.length) throw new Error(`not a sweep.csv: no column ${missing.join(", ")}`);
  const col = (name: string) => header.indexOf(name);
  const optional = (cells: string[], name: string): number | null => {
    const i = col(name);
    if (i < 0 || cells[i] === undefined || cells[i].trim() === "") return null;
    return parseNumber(cells[i]);
  };
  const rows: SweepRow[] = table.slice(1).map((cells, i) => {
    const layer = parseNumber(cells[col("layer")] ?? "");
    if (!Number.isInteger(layer)) throw new Error(`row ${i + 2}: layer is not an integer`);
    const expert = optional(cells, "expert");
    if (expert !== null && !Number.isInteger(expert)) throw new Error(`row ${i + 2}: expert is not an integer`);
    return {
      layer,
      expert,
      site: (cells[col("site")] ?? "").trim(),
      kind: (cells[col("kind")] ?? "").trim(),
      strength: parseNumber(cells[col("strength")] ?? ""),
      valLoss: parseNumber(cells[col("val_loss")] ?? ""),
      deltaLoss: parseNumber(cells[col("delta_loss")] ?? ""),
      gradNorm: optional(cells, "grad_norm"),
      deltaGradNorm: optional(cells, "delta_grad_norm"),
    };
  });
  return { rows, clean: cleanLoss(rows), panels: panels(rows) };
}

/** val_loss − delta_loss is the clean loss in every row; take it from the first finite one. */
export function cleanLoss(rows: SweepRow[]): number | null {
  for (const r of rows) {
    const clean = r.valLoss - r.deltaLoss;
    if (Number.isFinite(clean)) return clean;
  }
  return null;
}

function grid(
  rows: SweepRow[],
  column: (r: SweepRow) => number,
): { layers: number[]; columns: number[]; delta: number[][] } {
  const layers = [...new Set(rows.map((r) => r.layer))].sort((a, b) => a - b);
  const columns = [...new Set(rows.map(column))].sort((a, b) => a - b);
  const delta = layers.map(() => columns.map(() => NaN));
  for (const r of rows) delta[layers.indexOf(r.layer)][columns.indexOf(column(r))] = r.deltaLoss;
  return { layers, columns, delta };
}

/** The panels in sweep.png's order (lightning_megatron.scope.sweep.panels): strength panels by (site, kind), then
 * expert panels by (site, kind, strength). */
export function panels(rows: SweepRow[]): SweepPanel[] {
  const out: SweepPanel[] = [];
  const dense = rows.filter((r) => r.expert === null);
  for (const key of [...new Set(dense.map((r) => `${r.site}\u0000${r.kind}`))].sort()) {
    const [site, kind] = key.split("\u0000");
    const mine = dense.filter((r) => r.site === site && r.kind === kind);
    out.push({
      title: `${site} · ${kind}`,
      site,
      kind,
      strength: null,
      axis: "strength",
      ...grid(mine, (r) => r.strength),
    });
  }
  const experts = rows.filter((r) => r.expert !== null);
  const keys = [...new Map(experts.map((r) => [`${r.site}\u0000${r.kind}\u0000${r.strength}`, r])).values()].sort(
    (a, b) => a.site.localeCompare(b.site) || a.kind.localeCompare(b.kind) || a.strength - b.strength,
  );
  for (const k of keys) {
    const mine = experts.filter((r) => r.site === k.site && r.kind === k.kind && Object.is(r.strength, k.strength));
    const strength = k.kind === "disable" ? null : k.strength;
    const title = `${k.site} · ${k.kind}` + (strength === null ? "" : ` ${strength}`);
    out.push({ title, site: k.site, kind: k.kind, strength, axis: "expert", ...grid(mine, (r) => r.expert as number) });
  }
  return out;
}

export type SortKey = keyof SweepRow;

/** Rows sorted by a column; NaN last whichever the direction. */
export function sortRows(rows: SweepRow[], key: SortKey, descending: boolean): SweepRow[] {
  return [...rows].sort((a, b) => {
    const x = a[key];
    const y = b[key];
    if (typeof x === "string" || typeof y === "string") {
      const c = String(x).localeCompare(String(y));
      return descending ? -c : c;
    }
    const xn = x === null || Number.isNaN(x);
    const yn = y === null || Number.isNaN(y);
    if (xn || yn) return xn === yn ? 0 : xn ? 1 : -1;
    const c = (x as number) - (y as number);
    return descending ? -c : c;
  });
}
