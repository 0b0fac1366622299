// Colour lookup tables packed for ImageData's Uint32 view (RGBA bytes in memory order on little-endian
// hosts: 0xAABBGGRR), built per theme so the empty part of a heat map is the panel's own colour.
export type RGB = [number, number, number];

export const LITTLE_ENDIAN = new Uint8Array(new Uint32Array([1]).buffer)[0] === 1;

export function pack([r, g, b]: RGB, a = 255): number {
  return LITTLE_ENDIAN ? ((a << 24) | (b << 16) | (g << 8) | r) >>> 0 : ((r << 24) | (g << 16) | (b << 8) | a) >>> 0;
}

export function hex(color: string): RGB {
  const c = color.replace("#", "");
  const full = c.length === 3 ? [...c].map((x) => x + x).join("") : c;
  return [parseInt(full.slice(0, 2), 16), parseInt(full.slice(2, 4), 16), parseInt(full.slice(4, 6), 16)];
}

/** A table of `size` colours interpolated linearly (in sRGB) through `stops`. */
export function ramp(stops: RGB[], size = 256): Uint32Array {
  const out = new Uint32Array(size);
  for (let i = 0; i < size; i++) {
    const t = (i / (size - 1)) * (stops.length - 1);
    const k = Math.min(stops.length - 2, Math.floor(t));
    const f = t - k;
    const a = stops[k];
    const b = stops[k + 1];
    out[i] = pack([
      Math.round(a[0] + (b[0] - a[0]) * f),
      Math.round(a[1] + (b[1] - a[1]) * f),
      Math.round(a[2] + (b[2] - a[2]) * f),
    ]);
  }
  return out;
}

export interface Palette {
  /** Negative → mid → positive (probe activations, Δ loss). */
  diverging: Uint32Array;
  /** 0 → 1 (attention weights). */
  sequential: Uint32Array;
  /** NaN (a bit flip's signature) stands out in every map. */
  nan: number;
  /** No data yet. */
  empty: number;
  /** Series colours (prompts, curves). */
  series: string[];
}

export function palette(dark: boolean): Palette {
  const diverging = dark
    ? ramp(["#67a9cf", "#2b5d8c", "#1d2a3a", "#1b1e25", "#3d1f24", "#9c3a36", "#f4a582"].map(hex))
    : ramp(["#053061", "#2166ac", "#92c5de", "#f7f7f7", "#f4a582", "#b2182b", "#67001f"].map(hex));
  const sequential = dark
    ? ramp(["#171a21", "#3b0f70", "#8c2981", "#de4968", "#fe9f6d", "#fcfdbf"].map(hex))
    : ramp(["#ffffff", "#dadaeb", "#9e9ac8", "#6a51a3", "#3f007d", "#1c0038"].map(hex));
  return {
    diverging,
    sequential,
    nan: pack(hex("#22d36b")),
    empty: pack(hex(dark ? "#1e222b" : "#f1f3f6")),
    series: dark
      ? ["#7aa2f7", "#f7768e", "#9ece6a", "#e0af68", "#bb9af7", "#2ac3de", "#ff9e64", "#c0caf5"]
      : ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#ea580c", "#475569"],
  };
}

/** Index into a diverging table for value x at scale s (tanh: no hard clipping, outliers saturate softly). */
export function divergingIndex(x: number, scale: number, size = 256): number {
  const t = Math.tanh(x / scale);
  return Math.max(0, Math.min(size - 1, Math.round(((t + 1) / 2) * (size - 1))));
}

const STEPS = 512; // table steps per unit of x / scale
const REACH = 8; // tanh(8) is 1 to 7 digits
let tanhTable: Uint8Array | null = null;

/**
 * The same mapping as divergingIndex for a 256-colour table, through a lookup table (the heat maps colour
 * millions of values when a view opens; Math.tanh per value costs tens of milliseconds there).
 * Returns a function of x; non-finite x maps to the ends (the caller colours NaN itself).
 */
export function divergingIndexer(scale: number): (x: number) => number {
  if (tanhTable === null) {
    tanhTable = new Uint8Array(2 * REACH * STEPS + 1);
    for (let j = 0; j < tanhTable.length; j++) tanhTable[j] = divergingIndex((j - REACH * STEPS) / STEPS, 1, 256);
  }
  const table = tanhTable;
  const k = STEPS / scale;
  const mid = REACH * STEPS;
  const last = table.length - 1;
  return (x: number) => {
    const j = Math.round(x * k) + mid;
    return table[j < 0 ? 0 : j > last ? last : j];
  };
}

/** Index into a sequential table for a weight in [0, 1] with gamma (0.5 shows small weights). */
export function sequentialIndex(w: number, gamma: number, size = 256): number {
  const v = w <= 0 ? 0 : w >= 1 ? 1 : gamma === 1 ? w : w ** gamma;
  return Math.round(v * (size - 1));
}
