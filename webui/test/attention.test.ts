import { describe, expect, it } from "vitest";
import { AttentionSet } from "../src/state/attention";
import { f16, range, u8 } from "./helpers";

describe("AttentionSet", () => {
  // prompts 1, heads 2: prefill rows 0..2 (keys 3), then row 3 (keys 4)
  function build(): AttentionSet {
    const set = new AttentionSet();
    const prefill = range(2 * 3 * 3, (i) => (i % 9) / 16 + (i >= 9 ? 0.5 : 0));
    set.add(5, null, 0, 3, f16(prefill, [1, 2, 3, 3]));
    set.add(5, null, 3, 4, u8([0, 126, 252, 0, 252, 0, 0, 0], [1, 2, 1, 4], 1 / 252, 0));
    return set;
  }

  it("reads any query → key weight across chunks, per head or averaged", () => {
    const set = build();
    const layer = set.layers.get(5)!;
    expect(layer.heads).toEqual([0, 1]);
    expect(layer.end).toBe(4);
    expect(layer.value(0, 0, 1, 2)).toBeNull(); // key after the query: masked
    expect(layer.value(0, 0, 2, 1)).toBeCloseTo(7 / 16, 3);
    expect(layer.value(0, 1, 2, 1)).toBeCloseTo(7 / 16 + 0.5, 3);
    expect(layer.value(0, -1, 2, 1)).toBeCloseTo(7 / 16 + 0.25, 3);
    expect(layer.value(0, 0, 3, 2)).toBeCloseTo(1, 5);
    expect(layer.value(0, 1, 3, 0)).toBeCloseTo(1, 5);
    expect(layer.value(0, 0, 9, 0)).toBeNull(); // not arrived
  });

  it("decodes only the rows it is asked for", () => {
    const set = build();
    const chunk = set.layers.get(5)!.chunkAt(3)!;
    const row = new Float32Array(4);
    chunk.readRow(0, -1, 3, row);
    expect([...row].map((v) => Math.round(v * 100) / 100)).toEqual([0.5, 0.25, 0.5, 0]);
  });

  it("keeps explicit head ids and refuses a misshaped chunk", () => {
    const set = new AttentionSet();
    set.add(0, [3, 7], 0, 1, f16([1, 1], [1, 2, 1, 1]));
    expect(set.layers.get(0)!.heads).toEqual([3, 7]);
    expect(() => set.add(0, null, 1, 3, f16([1, 1], [1, 1, 1, 2]))).toThrow(RangeError);
    expect(set.layerIds()).toEqual([0]);
  });
});
