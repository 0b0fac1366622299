// Attention rows as they arrive: per layer, chunks of query rows [start, end) against keys 0..keys-1, shaped
// [prompts, heads, queries, keys]. Chunks stay encoded (a prefill of 1,024 positions × 16 heads is 16M
// values) and only the rows a view shows are decoded.
import { FrameReader } from "../protocol/arrays";
import type { ArrayFrame } from "../protocol/schema.gen";

export class AttentionChunk {
  readonly start: number;
  readonly end: number;
  readonly keys: number;
  readonly prompts: number;
  readonly headCount: number;
  readonly reader: FrameReader;

  constructor(start: number, end: number, frame: ArrayFrame) {
    const [prompts, heads, queries, keys] = frame.shape;
    if (frame.shape.length !== 4 || queries !== end - start) {
      throw new RangeError(`attention rows [${start}, ${end}) arrived with shape [${frame.shape.join(", ")}]`);
    }
    this.start = start;
    this.end = end;
    this.prompts = prompts;
    this.headCount = heads;
    this.keys = keys;
    this.reader = new FrameReader(frame);
  }

  /** Index of element (prompt, head index, query position, key). */
  index(prompt: number, head: number, query: number, key: number): number {
    return ((prompt * this.headCount + head) * (this.end - this.start) + (query - this.start)) * this.keys + key;
  }

  /** Query row `query` of (prompt, head) into out[0..keys). head -1 averages the heads. */
  readRow(prompt: number, head: number, query: number, out: Float32Array, scratch?: Float32Array): void {
    if (head >= 0) {
      this.reader.read(this.index(prompt, head, query, 0), this.keys, out);
      return;
    }
    const tmp = scratch && scratch.length >= this.keys ? scratch : new Float32Array(this.keys);
    out.fill(0, 0, this.keys);
    for (let h = 0; h < this.headCount; h++) {
      this.reader.read(this.index(prompt, h, query, 0), this.keys, tmp);
      for (let k = 0; k < this.keys; k++) out[k] += tmp[k];
    }
    for (let k = 0; k < this.keys; k++) out[k] /= this.headCount;
  }
}

export class AttentionLayer {
  readonly layer: number;
  /** Head ids along the chunks' head axis. */
  heads: number[];
  readonly chunks: AttentionChunk[] = [];
  end = 0;

  constructor(layer: number, heads: number[]) {
    this.layer = layer;
    this.heads = heads;
  }

  add(chunk: AttentionChunk): void {
    // Rows arrive in order; keep the list sorted by start anyway (binary search in chunkAt).
    let i = this.chunks.length;
    while (i > 0 && this.chunks[i - 1].start > chunk.start) i--;
    this.chunks.splice(i, 0, chunk);
    this.end = Math.max(this.end, chunk.end);
  }

  chunkAt(query: number): AttentionChunk | null {
    let lo = 0;
    let hi = this.chunks.length - 1;
    while (lo <= hi) {
      const mid = (lo + hi) >> 1;
      const chunk = this.chunks[mid];
      if (query < chunk.start) hi = mid - 1;
      else if (query >= chunk.end) lo = mid + 1;
      else return chunk;
    }
    return null;
  }

  /** The weight of query → key for (prompt, head index; -1: mean of heads), or null where nothing arrived. */
  value(prompt: number, head: number, query: number, key: number): number | null {
    const chunk = this.chunkAt(query);
    if (chunk === null || prompt >= chunk.prompts || key >= chunk.keys || key > query) return null;
    if (head >= 0) return chunk.reader.get(chunk.index(prompt, head, query, key));
    let sum = 0;
    for (let h = 0; h < chunk.headCount; h++) sum += chunk.reader.get(chunk.index(prompt, h, query, key));
    return sum / chunk.headCount;
  }
}

export interface AttentionUpdate {
  layer: AttentionLayer;
  chunk: AttentionChunk;
}

export class AttentionSet {
  readonly layers = new Map<number, AttentionLayer>();
  readonly log: AttentionUpdate[] = [];

  add(
    layer: number,
    heads: number[] | null | undefined,
    start: number,
    end: number,
    frame: ArrayFrame,
  ): AttentionUpdate {
    const chunk = new AttentionChunk(start, end, frame);
    let entry = this.layers.get(layer);
    const headIds = heads ?? Array.from({ length: chunk.headCount }, (_, h) => h);
    if (entry === undefined) {
      entry = new AttentionLayer(layer, headIds);
      this.layers.set(layer, entry);
    }
    entry.add(chunk);
    const update = { layer: entry, chunk };
    this.log.push(update);
    return update;
  }

  layerIds(): number[] {
    return [...this.layers.keys()].sort((a, b) => a - b);
  }
}
