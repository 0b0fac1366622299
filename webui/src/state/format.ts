// Number and token formatting shared by the views.

/** A probability as a percentage with sensible precision: 97.3%, 4.12%, 0.031%, <0.001%. */
export function percent(p: number | null | undefined): string {
  if (p === null || p === undefined || Number.isNaN(p)) return "–";
  const v = p * 100;
  if (v >= 10) return `${v.toFixed(1)}%`;
  if (v >= 1) return `${v.toFixed(2)}%`;
  if (v >= 0.001) return `${v.toPrecision(2)}%`;
  return v === 0 ? "0%" : "<0.001%";
}

/** Compact number: 3 significant digits, exponent for very small/large, NaN/inf spelled out. */
export function num(x: number | null | undefined, digits = 3): string {
  if (x === null || x === undefined) return "–";
  if (Number.isNaN(x)) return "NaN";
  if (x === Infinity) return "+inf";
  if (x === -Infinity) return "−inf";
  const a = Math.abs(x);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return x.toExponential(digits - 1).replace("-", "−");
  return Number(x.toPrecision(digits)).toString().replace("-", "−");
}

/** Signed: +0.012, −1.3. */
export function signed(x: number | null | undefined, digits = 3): string {
  if (x === null || x === undefined || Number.isNaN(x)) return num(x, digits);
  return (x > 0 ? "+" : "") + num(x, digits);
}

/** A token's text with its whitespace made visible (for labels and tooltips). */
export function visibleToken(text: string): string {
  if (text === "") return "∅";
  return text.replace(/ /g, "␣").replace(/\n/g, "↵").replace(/\t/g, "⇥").replace(/\r/g, "␍");
}

/** An English ordinal: 1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, 22nd, 111th. */
export function ordinal(n: number): string {
  const tens = Math.abs(n) % 100;
  const suffix = tens >= 11 && tens <= 13 ? "th" : (["th", "st", "nd", "rd"][Math.abs(n) % 10] ?? "th");
  return `${n}${suffix}`;
}

/** A parallel layout as TP×PP×DP (and VPP, SP where used): the shape a run's ranks form. */
export function layoutLabel(layout: Record<string, number | boolean> | undefined): string {
  if (!layout) return "";
  const parts = [`TP${layout.tensor ?? 1}`, `PP${layout.pipeline ?? 1}`];
  if (typeof layout.data === "number") parts.push(`DP${layout.data}`);
  if (typeof layout.virtual_pipeline === "number" && layout.virtual_pipeline > 1)
    parts.push(`VPP${layout.virtual_pipeline}`);
  return parts.join("×") + (layout.sequence_parallel ? " SP" : "");
}

/** Bytes as KiB/MiB. */
export function bytes(n: number): string {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  return `${(n / 1024 / 1024).toFixed(1)} MiB`;
}

/** "nice" axis ticks over [lo, hi]. */
export function ticks(lo: number, hi: number, count = 5): number[] {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [];
  if (hi === lo) return [lo];
  const span = hi - lo;
  const step0 = span / Math.max(1, count);
  const mag = 10 ** Math.floor(Math.log10(step0));
  const norm = step0 / mag;
  const step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * mag;
  const out: number[] = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step)
    out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

/** A token's tint by surprisal (−log2 p): near-certain tokens barely tinted, a 1-in-100 token glows. */
export function surprisalColour(p: number | null): string {
  if (p === null || Number.isNaN(p)) return "";
  const bits = p > 0 ? -Math.log2(Math.min(1, p)) : 16;
  const alpha = Math.min(0.55, 0.04 + 0.07 * bits);
  return `rgba(245, 158, 11, ${alpha.toFixed(3)})`;
}
