import { describe, expect, it } from "vitest";
import { MAX_FEATURES, ProbeSet, splitProbeName } from "../src/state/probes";
import { f16, range } from "./helpers";

describe("ProbeSet", () => {
  it("names layers and sites", () => {
    expect(splitProbeName("blocks.12.attn.hook_q")).toEqual({ layer: 12, site: "attn.hook_q" });
    expect(splitProbeName("hook_embed")).toEqual({ layer: null, site: "hook_embed" });
  });

  it("appends positions per row and grows past its capacity", () => {
    const set = new ProbeSet(2, 2);
    // prefill: positions 0..2 of two prompts, 3 features
    set.add("blocks.0.hook_resid_post", 0, 3, f16(range(2 * 3 * 3), [2, 3, 3]));
    set.add("blocks.0.hook_resid_post", 3, 4, f16([100, 101, 102, 200, 201, 202], [2, 1, 3]));
    const band = set.bands.get("blocks.0.hook_resid_post")!;
    expect(band.capacity).toBeGreaterThanOrEqual(4);
    expect(set.capacity).toBeGreaterThanOrEqual(4);
    expect(band.value(0, 2, 1)).toBe(7);
    expect(band.value(1, 0, 0)).toBe(9);
    expect(band.value(1, 3, 2)).toBe(202);
    expect(band.value(0, 5, 0)).toBeNull(); // not received
    expect(band.end).toBe(4);
    expect(set.log.map((u) => [u.start, u.end])).toEqual([
      [0, 3],
      [3, 4],
    ]);
  });

  it("flattens trailing dimensions and pools wide captures", () => {
    const set = new ProbeSet(1, 1);
    set.add(
      "blocks.0.attn.hook_q",
      0,
      1,
      f16(
        range(4 * 64, () => 1),
        [1, 1, 4, 64],
      ),
    );
    const band = set.bands.get("blocks.0.attn.hook_q")!;
    expect(band.sourceFeatures).toBe(256);
    expect(band.features).toBe(MAX_FEATURES);
    expect(band.value(0, 0, 5)).toBe(1);
  });

  it("tracks the RMS colour scale over finite values and counts NaN", () => {
    const set = new ProbeSet(1, 4);
    set.add("blocks.0.hook_mlp_out", 0, 1, f16([3, -4, NaN, 0], [1, 1, 4]));
    const band = set.bands.get("blocks.0.hook_mlp_out")!;
    expect(band.rms).toBeCloseTo(Math.sqrt(25 / 3));
    expect(band.nonFinite).toBe(1);
  });

  it("knows a band of norms (never negative) from a signed one, and what its colours depend on", () => {
    const set = new ProbeSet(1, 4);
    set.add("blocks.0.hook_resid_post", 0, 2, f16([0.25, 0.5], [1, 2, 1]));
    set.add("blocks.0.hook_mlp_out", 0, 2, f16([-1, 1], [1, 2, 1]));
    const norms = set.bands.get("blocks.0.hook_resid_post")!;
    expect(norms.unsigned).toBe(true);
    expect([norms.min, norms.max]).toEqual([0.25, 0.5]);
    expect(norms.scaleKey).toBe(0.25);
    const signed = set.bands.get("blocks.0.hook_mlp_out")!;
    expect(signed.unsigned).toBe(false);
    expect(signed.scaleKey).toBe(signed.rms);
  });

  it("lists captures it cannot lay out by position instead of drawing them", () => {
    const set = new ProbeSet(1, 4);
    expect(set.add("blocks.0.hook_x", 0, 2, f16([1, 2, 3], [3]))).toBeNull();
    expect(set.unshaped.get("blocks.0.hook_x")).toEqual([3]);
  });

  it("orders sites with the residual stream first and layers ascending", () => {
    const set = new ProbeSet(1, 1);
    for (const name of [
      "blocks.1.hook_resid_post",
      "blocks.0.hook_mlp_out",
      "blocks.0.hook_resid_post",
      "blocks.0.hook_attn_out",
    ]) {
      set.add(name, 0, 1, f16([1], [1, 1, 1]));
    }
    expect(set.siteNames()).toEqual(["hook_attn_out", "hook_mlp_out", "hook_resid_post"]);
    expect(set.layersOf("hook_resid_post")).toEqual([0, 1]);
  });
});
