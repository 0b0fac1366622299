// Probe captures shaped for drawing: one band per probe name (a layer of a site such as hook_resid_post),
// holding per row (a prompt in generation, a sample of the microbatch in training) a [position][feature]
// matrix that grows as positions arrive. Views read the append-only log to paint only what is new.
import { FrameReader } from "../protocol/arrays";
import type { ArrayFrame } from "../protocol/schema.gen";

/** At most this many feature rows per band are kept (wider captures are mean-pooled down to it). */
export const MAX_FEATURES = 128;

const LAYER_NAME = /^blocks\.(\d+)\.(.+)$/;

/** "blocks.3.hook_resid_post" → {layer: 3, site: "hook_resid_post"}; other names are their own site. */
export function splitProbeName(name: string): { layer: number | null; site: string } {
  const match = LAYER_NAME.exec(name);
  return match ? { layer: Number(match[1]), site: match[2] } : { layer: null, site: name };
}

export class ProbeBand {
  readonly name: string;
  readonly site: string;
  readonly layer: number | null;
  /** Features per position as captured (product of the trailing dimensions). */
  readonly sourceFeatures: number;
  /** Features per position as stored and drawn (sourceFeatures pooled to at most MAX_FEATURES). */
  readonly features: number;
  readonly rows: number;
  capacity: number;
  /** One past the last position received. */
  end = 0;
  data: Float32Array[];
  /** Positions received, per row (1 = present). */
  present: Uint8Array[];
  private sumSquares = 0;
  private finiteCount = 0;
  nonFinite = 0;
  /** Smallest and largest finite values so far (a band with no negative value is drawn on a sequential scale). */
  min = Infinity;
  max = -Infinity;

  constructor(name: string, rows: number, sourceFeatures: number, capacity: number) {
    const { layer, site } = splitProbeName(name);
    this.name = name;
    this.site = site;
    this.layer = layer;
    this.rows = rows;
    this.sourceFeatures = sourceFeatures;
    this.features = Math.min(sourceFeatures, MAX_FEATURES);
    this.capacity = Math.max(1, capacity);
    this.data = Array.from({ length: rows }, () => new Float32Array(this.capacity * this.features));
    this.present = Array.from({ length: rows }, () => new Uint8Array(this.capacity));
  }

  /** Root mean square of the finite values so far (the colour scale); 1 before any data. */
  get rms(): number {
    return this.finiteCount > 0 && this.sumSquares > 0 ? Math.sqrt(this.sumSquares / this.finiteCount) : 1;
  }

  /** True when every value so far is ≥ 0 (norms, probabilities): such bands use a sequential scale. */
  get unsigned(): boolean {
    return this.min >= 0;
  }

  /** What the colours of a band depend on; a repaint is due when it moves by more than a quarter. */
  get scaleKey(): number {
    return this.unsigned ? Math.max(1e-12, this.max - this.min) : this.rms;
  }

  ensure(positions: number): boolean {
    if (positions <= this.capacity) return false;
    let capacity = this.capacity;
    while (capacity < positions) capacity *= 2;
    this.data = this.data.map((old) => {
      const grown = new Float32Array(capacity * this.features);
      grown.set(old);
      return grown;
    });
    this.present = this.present.map((old) => {
      const grown = new Uint8Array(capacity);
      grown.set(old);
      return grown;
    });
    this.capacity = capacity;
    return true;
  }

  /**
   * Store positions [start, start + n) of every row from a frame shaped [rows, n, ...features]
   * (features flattened; pooled when wider than MAX_FEATURES).
   */
  write(start: number, n: number, reader: FrameReader): void {
    this.ensure(start + n);
    const source = this.sourceFeatures;
    const features = this.features;
    const rows = Math.min(this.rows, reader.shape[0] ?? 1);
    let row: Float32Array | null = null;
    for (let b = 0; b < rows; b++) {
      const target = this.data[b];
      const first = start * features;
      if (features === source) {
        // positions are contiguous in both: one decode straight into place
        reader.read(b * n * source, n * source, target, first);
      } else {
        row ??= new Float32Array(source);
        for (let i = 0; i < n; i++) {
          reader.read((b * n + i) * source, source, row);
          const base = (start + i) * features;
          for (let f = 0; f < features; f++) {
            const from = Math.floor((f * source) / features);
            const to = Math.floor(((f + 1) * source) / features);
            let sum = 0;
            for (let j = from; j < to; j++) sum += row[j];
            target[base + f] = sum / (to - from);
          }
        }
      }
      let squares = 0;
      let finite = 0;
      let lo = this.min;
      let hi = this.max;
      const last = first + n * features;
      for (let k = first; k < last; k++) {
        const v = target[k];
        if (v - v === 0) {
          squares += v * v;
          finite++;
          if (v < lo) lo = v;
          if (v > hi) hi = v;
        }
      }
      this.min = lo;
      this.max = hi;
      this.sumSquares += squares;
      this.finiteCount += finite;
      this.nonFinite += n * features - finite;
      this.present[b].fill(1, start, start + n);
    }
    this.end = Math.max(this.end, start + n);
  }

  value(row: number, position: number, feature: number): number | null {
    if (row >= this.rows || position >= this.capacity || !this.present[row][position]) return null;
    return this.data[row][position * this.features + feature];
  }
}

export interface SiteBands {
  site: string;
  /** Bands by layer (null: a probe with no layer, e.g. hook_embed). */
  bands: Map<number | null, ProbeBand>;
}

export interface ProbeUpdate {
  band: ProbeBand;
  start: number;
  end: number;
}

export class ProbeSet {
  readonly sites = new Map<string, SiteBands>();
  readonly bands = new Map<string, ProbeBand>();
  readonly log: ProbeUpdate[] = [];
  /** Positions the views should make room for (grows if more arrive). */
  capacity: number;
  rows: number;
  /** Probe events that could not be shaped as [rows, positions, ...] (listed, not drawn). */
  readonly unshaped = new Map<string, number[]>();

  constructor(rows: number, capacity: number) {
    this.rows = Math.max(1, rows);
    this.capacity = Math.max(1, capacity);
  }

  /** Add positions [start, end) of probe `name` from `frame` ([rows, end - start, ...]). */
  add(name: string, start: number, end: number, frame: ArrayFrame): ProbeUpdate | null {
    const shape = frame.shape;
    const n = end - start;
    if (shape.length < 2 || shape[1] !== n || n <= 0) {
      this.unshaped.set(name, shape.slice());
      return null;
    }
    const reader = new FrameReader(frame);
    let sourceFeatures = 1;
    for (const d of shape.slice(2)) sourceFeatures *= d;
    let band = this.bands.get(name);
    if (band === undefined || band.sourceFeatures !== sourceFeatures) {
      band = new ProbeBand(name, Math.max(this.rows, shape[0]), sourceFeatures, Math.max(this.capacity, end));
      this.bands.set(name, band);
      let site = this.sites.get(band.site);
      if (site === undefined) {
        site = { site: band.site, bands: new Map() };
        this.sites.set(band.site, site);
      }
      site.bands.set(band.layer, band);
    }
    if (end > this.capacity) {
      let capacity = this.capacity;
      while (capacity < end) capacity *= 2;
      this.capacity = capacity;
    }
    band.write(start, n, reader);
    const update = { band, start, end };
    this.log.push(update);
    return update;
  }

  /** Sites in a stable, readable order: the residual stream first, then by name. */
  siteNames(): string[] {
    const order = ["hook_resid_pre", "hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post"];
    return [...this.sites.keys()].sort((a, b) => {
      const ia = order.indexOf(a);
      const ib = order.indexOf(b);
      if (ia !== ib) return (ia < 0 ? order.length : ia) - (ib < 0 ? order.length : ib);
      return a.localeCompare(b);
    });
  }

  /** Layers of a site in ascending order (a layerless band comes first). */
  layersOf(site: string): (number | null)[] {
    const bands = this.sites.get(site);
    if (bands === undefined) return [];
    return [...bands.bands.keys()].sort((a, b) => (a ?? -1) - (b ?? -1));
  }
}
