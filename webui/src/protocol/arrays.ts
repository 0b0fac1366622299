// Binary array frames ($defs/ArrayFrame): little-endian float16 / float32 / int32, or uint8 codes meaning
// offset + code * scale (253 NaN, 254 +Infinity, 255 -Infinity). Browsers have no float16 typed array in
// every version we support, so halves are decoded through a 65,536-entry table (built once, 256 KiB).
import type { ArrayFrame, Float } from "./schema.gen";

export type Values = Float32Array | Int32Array;

export interface Decoded {
  shape: number[];
  values: Values;
}

const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
const ITEM_SIZE: Record<ArrayFrame["dtype"], number> = { float16: 2, float32: 4, int32: 4, uint8: 1 };

let halfTable: Float32Array | null = null;

/** One IEEE 754 half (as its 16 bits) as a number: subnormals, infinities and NaN included. */
export function halfToFloat(bits: number): number {
  const sign = bits & 0x8000 ? -1 : 1;
  const exponent = (bits >> 10) & 0x1f;
  const fraction = bits & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24;
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}

/** Every half's value, indexed by its bits. */
export function float16Table(): Float32Array {
  if (halfTable === null) {
    halfTable = new Float32Array(65536);
    for (let bits = 0; bits < 65536; bits++) halfTable[bits] = halfToFloat(bits);
  }
  return halfTable;
}

/** The 256 values of a uint8 frame's codes. */
export function uint8Table(scale: number, offset: number): Float32Array {
  const table = new Float32Array(256);
  for (let code = 0; code < 253; code++) table[code] = offset + code * scale;
  table[253] = NaN;
  table[254] = Infinity;
  table[255] = -Infinity;
  return table;
}

export function elementCount(shape: readonly number[]): number {
  let n = 1;
  for (const d of shape) n *= d;
  return n;
}

/** The frame's bytes as a Uint8Array (browsers give ArrayBuffers; Node gives Buffers, i.e. views). */
export function bytesOf(data: unknown): Uint8Array {
  if (data instanceof ArrayBuffer) return new Uint8Array(data);
  if (ArrayBuffer.isView(data)) return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  throw new TypeError("an array frame's data is not binary");
}

function checkFrame(frame: ArrayFrame, bytes: Uint8Array): number {
  const size = ITEM_SIZE[frame.dtype];
  if (size === undefined) throw new TypeError(`unknown array dtype ${String(frame.dtype)}`);
  const count = elementCount(frame.shape);
  if (bytes.byteLength !== count * size) {
    throw new RangeError(
      `array frame of shape [${frame.shape.join(", ")}] ${frame.dtype} has ${bytes.byteLength} bytes`,
    );
  }
  return count;
}

/** Raw element view (aligned, host order): Uint16Array for float16, Uint8Array for uint8, else Float32/Int32. */
export function rawView(frame: ArrayFrame): Uint16Array | Uint8Array | Float32Array | Int32Array {
  const bytes = bytesOf(frame.data);
  const count = checkFrame(frame, bytes);
  const size = ITEM_SIZE[frame.dtype];
  if (frame.dtype === "uint8") return bytes;
  let aligned = bytes;
  if (bytes.byteOffset % size !== 0 || !LITTLE_ENDIAN) {
    aligned = new Uint8Array(bytes); // copy to a fresh buffer (aligned)
    if (!LITTLE_ENDIAN) {
      for (let i = 0; i < aligned.length; i += size) aligned.subarray(i, i + size).reverse();
    }
  }
  const Ctor = frame.dtype === "float16" ? Uint16Array : frame.dtype === "float32" ? Float32Array : Int32Array;
  return new Ctor(aligned.buffer as ArrayBuffer, aligned.byteOffset, count);
}

/**
 * A reader that decodes any contiguous range of a frame's elements into a Float32Array, without decoding
 * the rest (attention frames can hold tens of millions of elements; a view only needs one head).
 */
export class FrameReader {
  readonly shape: number[];
  readonly count: number;
  private readonly raw: Uint16Array | Uint8Array | Float32Array | Int32Array;
  private readonly table: Float32Array | null;

  constructor(frame: ArrayFrame) {
    this.shape = frame.shape.slice();
    this.raw = rawView(frame);
    this.count = this.raw.length;
    this.table =
      frame.dtype === "float16"
        ? float16Table()
        : frame.dtype === "uint8"
          ? uint8Table(frame.scale ?? 1, frame.offset ?? 0)
          : null;
  }

  /** out[outOffset + i] = element (start + i), for i < count. */
  read(start: number, count: number, out: Float32Array, outOffset = 0): void {
    const raw = this.raw;
    const table = this.table;
    if (table !== null) {
      for (let i = 0; i < count; i++) out[outOffset + i] = table[raw[start + i]];
    } else {
      for (let i = 0; i < count; i++) out[outOffset + i] = raw[start + i];
    }
  }

  get(index: number): number {
    return this.table !== null ? this.table[this.raw[index]] : this.raw[index];
  }
}

/** The whole frame decoded: Float32Array values for float frames (uint8 included), Int32Array for int32. */
export function decodeArray(frame: ArrayFrame): Decoded {
  const shape = frame.shape.slice();
  if (frame.dtype === "int32") return { shape, values: rawView(frame) as Int32Array };
  if (frame.dtype === "float32") return { shape, values: rawView(frame) as Float32Array };
  const reader = new FrameReader(frame);
  const values = new Float32Array(reader.count);
  reader.read(0, reader.count, values);
  return { shape, values };
}

/** $defs/Float as a number ("NaN", "Infinity", "-Infinity" included); null/undefined stay null. */
export function toNumber(value: Float | null | undefined): number | null {
  if (value === null || value === undefined) return null;
  if (typeof value === "number") return value;
  if (value === "NaN") return NaN;
  if (value === "Infinity") return Infinity;
  if (value === "-Infinity") return -Infinity;
  return null;
}
