// The perturbation panel's rows and the set_perturbations request they make.
import type { Perturbation } from "../protocol/schema.gen";

export type Kind = Perturbation["kind"];

export interface PerturbationRow {
  key: number;
  kind: Kind;
  site: string;
  /** Layers as typed: "0, 2-4"; empty for all layers. */
  layers: string;
  heads: string;
  /** Router logits only: experts as typed ("3", "0-1"); empty for all (disable needs some). */
  experts: string;
  strength: number;
  seed: number;
  value: number;
  enabled: boolean;
}

/** What strength means per kind (perturb.py's contract). */
export const STRENGTH_HELP: Record<string, string> = {
  gaussian: "x + s·N(0, 1)",
  uniform: "x · U(1 − s, 1 + s)",
  bitflip: "probability per element of one flipped bit (0–1)",
  zero: "probability per element of a zero (0–1)",
  stuck: "probability per element of the stuck value (0–1)",
  disable: "the experts' router logits → −∞: never chosen (router logits only; strength unused)",
};

export const PROBABILITY_KINDS = new Set(["bitflip", "zero", "stuck"]);

let nextKey = 1;

export function newRow(partial: Partial<PerturbationRow> = {}): PerturbationRow {
  return {
    key: nextKey++,
    kind: "gaussian",
    site: "system",
    layers: "",
    heads: "",
    experts: "",
    strength: 0.1,
    seed: 0,
    value: 0,
    enabled: false,
    ...partial,
  };
}

/** "0, 2-4, 7" → [0, 2, 3, 4, 7]; "" → null (all). Throws on anything else. */
export function parseIndexList(text: string, limit = 4095): number[] | null {
  const trimmed = text.trim();
  if (trimmed === "" || trimmed === "*" || trimmed.toLowerCase() === "all") return null;
  const out = new Set<number>();
  for (const part of trimmed.split(/[\s,]+/).filter(Boolean)) {
    const range = /^(\d+)\s*(?:-|–|\.\.)\s*(\d+)$/.exec(part);
    if (range) {
      const from = Number(range[1]);
      const to = Number(range[2]);
      if (to < from) throw new RangeError(`"${part}": the range runs backwards`);
      if (to - from > limit) throw new RangeError(`"${part}": too many`);
      for (let i = from; i <= to; i++) out.add(i);
    } else if (/^\d+$/.test(part)) {
      out.add(Number(part));
    } else {
      throw new RangeError(`"${part}" is not a number or a range like 2-5`);
    }
  }
  const list = [...out].sort((a, b) => a - b);
  if (list.some((i) => i > limit)) throw new RangeError(`indices go up to ${limit}`);
  return list;
}

/** A row as the protocol's Perturbation (throws RangeError naming the bad field). */
export function toPerturbation(row: PerturbationRow, numLayers: number | null = null): Perturbation {
  const site = row.site.trim();
  if (!/^[A-Za-z0-9_.*]{1,96}$/.test(site)) throw new RangeError("site: letters, digits, '_', '.', '*' only");
  if (!Number.isFinite(row.strength) || row.strength < 0) throw new RangeError("strength: a number ≥ 0");
  if (PROBABILITY_KINDS.has(row.kind) && row.strength > 1)
    throw new RangeError(`strength: ${row.kind} takes a probability (0–1)`);
  if (row.strength > 1000) throw new RangeError("strength: at most 1000");
  if (!Number.isInteger(row.seed) || row.seed < 0 || row.seed > 2147483647)
    throw new RangeError("seed: an integer ≥ 0");
  const layers = parseIndexList(row.layers);
  if (layers !== null && numLayers !== null && layers.some((l) => l >= numLayers)) {
    throw new RangeError(`layers: this model has layers 0–${numLayers - 1}`);
  }
  const heads = parseIndexList(row.heads);
  const out: Perturbation = { site, kind: row.kind, strength: row.strength, seed: row.seed, enabled: row.enabled };
  if (layers !== null) out.layers = layers;
  if (heads !== null) out.heads = heads;
  const experts = parseIndexList(row.experts);
  if (experts !== null || row.kind === "disable") {
    if (!/(^|\.)moe\.hook_router_logits$/.test(site))
      throw new RangeError("experts: only router logits (blocks.L.moe.hook_router_logits) have experts");
    if (experts === null) throw new RangeError("experts: disable needs the experts to turn off, e.g. 3");
    out.experts = experts;
  }
  if (row.kind === "stuck") {
    if (!Number.isFinite(row.value)) throw new RangeError("value: a number");
    out.value = row.value;
  }
  return out;
}

/** A server-side Perturbation back into an editable row (enabled unless it says otherwise). */
export function fromPerturbation(p: Perturbation): PerturbationRow {
  return newRow({
    kind: p.kind,
    site: p.site,
    layers: p.layers ? compactList(p.layers) : "",
    heads: p.heads ? compactList(p.heads) : "",
    experts: p.experts ? compactList(p.experts) : "",
    strength: p.strength ?? 0,
    seed: p.seed ?? 0,
    value: p.value ?? 0,
    enabled: p.enabled ?? true,
  });
}

/** [0, 1, 2, 5] → "0-2, 5". */
export function compactList(list: readonly number[]): string {
  const sorted = [...new Set(list)].sort((a, b) => a - b);
  const parts: string[] = [];
  for (let i = 0; i < sorted.length;) {
    let j = i;
    while (j + 1 < sorted.length && sorted[j + 1] === sorted[j] + 1) j++;
    parts.push(j > i ? `${sorted[i]}-${sorted[j]}` : String(sorted[i]));
    i = j + 1;
  }
  return parts.join(", ");
}

/** A one-line summary: "gaussian 0.1 on system, layers 2-3". */
export function describe(p: Perturbation): string {
  const where = p.layers && p.layers.length ? `, layers ${compactList(p.layers)}` : "";
  const heads = p.heads && p.heads.length ? `, heads ${compactList(p.heads)}` : "";
  const value = p.kind === "stuck" ? ` → ${p.value}` : "";
  const experts = p.experts && p.experts.length ? `, experts ${compactList(p.experts)}` : "";
  if (p.kind === "disable") return `disable experts ${compactList(p.experts ?? [])} on ${p.site}${where}`;
  return `${p.kind} ${p.strength ?? 0}${value} on ${p.site}${where}${heads}${experts}`;
}

/** Site choices: the engine's groups first, then every per-layer site as a glob over layers. */
export function siteOptions(groups: Record<string, string[]> | undefined, probes: string[] | undefined): string[] {
  const options = Object.keys(groups ?? {});
  const perLayer = new Set<string>();
  for (const name of probes ?? []) {
    const match = /^blocks\.\d+\.(.+)$/.exec(name);
    if (match) perLayer.add(`blocks.*.${match[1]}`);
    else if (!options.includes(name)) perLayer.add(name);
  }
  return [...options, ...perLayer];
}
