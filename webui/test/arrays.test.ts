import { describe, expect, it } from "vitest";
import { decodeArray, FrameReader, halfToFloat, toNumber } from "../src/protocol/arrays";
import { f16, f32, i32, toHalfBits, u8 } from "./helpers";

describe("float16", () => {
  it("decodes normal, subnormal, signed zero, infinities and NaN bit-exactly", () => {
    expect(halfToFloat(0x3c00)).toBe(1);
    expect(halfToFloat(0xc000)).toBe(-2);
    expect(halfToFloat(0x7bff)).toBe(65504);
    expect(halfToFloat(0x0001)).toBe(2 ** -24);
    expect(Object.is(halfToFloat(0x8000), -0)).toBe(true);
    expect(halfToFloat(0x7c00)).toBe(Infinity);
    expect(halfToFloat(0xfc00)).toBe(-Infinity);
    expect(halfToFloat(0x7e00)).toBeNaN();
    expect(halfToFloat(0x3555)).toBeCloseTo(1 / 3, 3);
  });

  it("round-trips every finite half through a frame", () => {
    const bits = new Uint16Array(65536).map((_, i) => i);
    const { values } = decodeArray({ dtype: "float16", shape: [65536], data: bits.buffer });
    for (let i = 0; i < 65536; i += 97) {
      const v = values[i];
      if (Number.isNaN(v)) expect((i & 0x7c00) === 0x7c00 && (i & 0x3ff) !== 0).toBe(true);
      else expect(toHalfBits(v)).toBe(i === 0x8000 ? 0x8000 : i);
    }
  });

  it("reads a range without decoding the rest", () => {
    const frame = f16([0, 1, 2, 3, 4, 5], [2, 3]);
    const reader = new FrameReader(frame);
    const out = new Float32Array(2);
    reader.read(3, 2, out);
    expect([...out]).toEqual([3, 4]);
    expect(reader.get(5)).toBe(5);
  });
});

describe("other dtypes", () => {
  it("uint8 codes map to offset + code * scale with the three special codes", () => {
    const { values, shape } = decodeArray(u8([0, 1, 252, 253, 254, 255], [6], 0.5, -1));
    expect(shape).toEqual([6]);
    expect([...values.slice(0, 3)]).toEqual([-1, -0.5, 125]);
    expect(values[3]).toBeNaN();
    expect(values[4]).toBe(Infinity);
    expect(values[5]).toBe(-Infinity);
  });

  it("float32 and int32 come back as typed arrays of the right kind", () => {
    expect(decodeArray(f32([1.5, -2], [2])).values).toBeInstanceOf(Float32Array);
    const ids = decodeArray(i32([7, 2147483647], [2]));
    expect(ids.values).toBeInstanceOf(Int32Array);
    expect([...ids.values]).toEqual([7, 2147483647]);
  });

  it("accepts Node Buffers (views with an offset) as well as ArrayBuffers", () => {
    const backing = new Uint8Array(10);
    backing.set(new Uint8Array(new Float32Array([3.25, -1]).buffer), 1); // misaligned on purpose
    const view = backing.subarray(1, 9);
    const { values } = decodeArray({ dtype: "float32", shape: [2], data: view as unknown as ArrayBuffer });
    expect([...values]).toEqual([3.25, -1]);
  });

  it("refuses a frame whose byte count does not match its shape", () => {
    expect(() => decodeArray(f16([1, 2, 3], [2, 2]))).toThrow(RangeError);
  });

  it("reads $defs/Float strings", () => {
    expect(toNumber("NaN")).toBeNaN();
    expect(toNumber("Infinity")).toBe(Infinity);
    expect(toNumber("-Infinity")).toBe(-Infinity);
    expect(toNumber(0.25)).toBe(0.25);
    expect(toNumber(null)).toBeNull();
  });
});

describe("colour maps", async () => {
  const { divergingIndex, divergingIndexer, sequentialIndex } = await import("../src/render/colormap");
  it("the table-driven diverging index matches tanh within one step", () => {
    const index = divergingIndexer(2);
    for (const x of [-100, -3, -0.5, -0.01, 0, 0.01, 0.7, 2, 5, 1e9, Infinity, -Infinity]) {
      expect(Math.abs(index(x) - divergingIndex(x, 2))).toBeLessThanOrEqual(1);
    }
    expect(index(0)).toBe(128);
  });
  it("attention weights map through gamma", () => {
    expect(sequentialIndex(0, 0.5)).toBe(0);
    expect(sequentialIndex(1, 0.5)).toBe(255);
    expect(sequentialIndex(0.25, 0.5)).toBe(128);
  });
});
