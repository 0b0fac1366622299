// Build protocol frames in tests as the server would (little-endian bytes, float16 halves).
import type { ArrayFrame } from "../src/protocol/schema.gen";

/** The IEEE half nearest a number (round to nearest even), as 16 bits. */
export function toHalfBits(value: number): number {
  const f32 = new Float32Array([value]);
  const u32 = new Uint32Array(f32.buffer)[0];
  const sign = (u32 >>> 16) & 0x8000;
  const exp = (u32 >>> 23) & 0xff;
  let mant = u32 & 0x7fffff;
  if (exp === 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  let e = exp - 127 + 15;
  if (e >= 0x1f) return sign | 0x7c00;
  if (e <= 0) {
    if (e < -10) return sign;
    mant = (mant | 0x800000) >>> (1 - e);
    if (mant & 0x1000) mant += 0x2000;
    return sign | (mant >>> 13);
  }
  if (mant & 0x1000) {
    mant += 0x2000;
    if (mant & 0x800000) {
      mant = 0;
      e += 1;
      if (e >= 0x1f) return sign | 0x7c00;
    }
  }
  return sign | (e << 10) | (mant >>> 13);
}

export function f16(values: number[], shape: number[]): ArrayFrame {
  const bits = new Uint16Array(values.map(toHalfBits));
  return { dtype: "float16", shape, data: bits.buffer };
}

export function f32(values: number[], shape: number[]): ArrayFrame {
  return { dtype: "float32", shape, data: new Float32Array(values).buffer };
}

export function i32(values: number[], shape: number[]): ArrayFrame {
  return { dtype: "int32", shape, data: new Int32Array(values).buffer };
}

export function u8(codes: number[], shape: number[], scale: number, offset: number): ArrayFrame {
  return { dtype: "uint8", shape, scale, offset, data: new Uint8Array(codes).buffer };
}

export function range(n: number, f: (i: number) => number = (i) => i): number[] {
  return Array.from({ length: n }, (_, i) => f(i));
}
