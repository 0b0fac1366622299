import { describe, expect, it } from "vitest";
import { takeToken } from "../src/protocol/client";
import {
  compactList,
  describe as describePerturbation,
  fromPerturbation,
  newRow,
  parseIndexList,
  siteOptions,
  toPerturbation,
} from "../src/state/perturbations";
import { buildGenerate, DEFAULT_SETTINGS, loadSettings, probeSites, type Settings } from "../src/state/settings";
import { layoutLabel, num, ordinal, percent, signed, surprisalColour, ticks, visibleToken } from "../src/state/format";

describe("the token in the address", () => {
  it("is read and removed, keeping the rest of the address", () => {
    expect(takeToken("http://127.0.0.1:5000/?token=abc%2Fdef&x=1#attention")).toEqual({
      token: "abc/def",
      clean: "/?x=1#attention",
    });
    expect(takeToken("http://127.0.0.1:5000/?token=t")).toEqual({ token: "t", clean: "/" });
    expect(takeToken("http://127.0.0.1:5000/").token).toBe("");
  });
});

describe("perturbation rows", () => {
  it("parse layer lists and ranges", () => {
    expect(parseIndexList("")).toBeNull();
    expect(parseIndexList("all")).toBeNull();
    expect(parseIndexList("3, 0 1-2, 5..6")).toEqual([0, 1, 2, 3, 5, 6]);
    expect(() => parseIndexList("2-1")).toThrow(/backwards/);
    expect(() => parseIndexList("x")).toThrow(/not a number/);
    expect(compactList([5, 0, 1, 2, 7])).toBe("0-2, 5, 7");
  });

  it("become protocol Perturbations, checked against the schema's rules and the model", () => {
    const row = newRow({ kind: "gaussian", site: "system", layers: "1-2", strength: 0.5, seed: 3, enabled: true });
    expect(toPerturbation(row, 4)).toEqual({
      site: "system",
      kind: "gaussian",
      strength: 0.5,
      seed: 3,
      enabled: true,
      layers: [1, 2],
    });
    expect(() => toPerturbation({ ...row, layers: "4" }, 4)).toThrow(/layers 0–3/);
    expect(() => toPerturbation({ ...row, kind: "bitflip", strength: 2 })).toThrow(/probability/);
    expect(() => toPerturbation({ ...row, site: "blocks.0;rm -rf" })).toThrow(/site/);
    expect(toPerturbation({ ...row, kind: "stuck", strength: 0.1, value: 7 }).value).toBe(7);
  });

  it("round-trip from the server's active set and read as one line", () => {
    const p = {
      site: "blocks.*.hook_mlp_out",
      kind: "zero" as const,
      strength: 0.01,
      seed: 0,
      layers: [0, 1, 2],
      enabled: true,
    };
    const row = fromPerturbation(p);
    expect(row.layers).toBe("0-2");
    expect(toPerturbation(row)).toEqual(p);
    expect(describePerturbation(p)).toBe("zero 0.01 on blocks.*.hook_mlp_out, layers 0-2");
  });

  it("offer the engine's groups, then each per-layer site as a glob", () => {
    const sites = siteOptions({ storage: ["attn.W_QKV"], system: ["hook_resid_post"] }, [
      "hook_embed",
      "blocks.0.hook_resid_post",
      "blocks.1.hook_resid_post",
      "blocks.0.mlp.W_in",
    ]);
    expect(sites).toEqual(["storage", "system", "hook_embed", "blocks.*.hook_resid_post", "blocks.*.mlp.W_in"]);
  });
});

describe("the generate request", () => {
  const context = { numLayers: 4, defaultProbes: undefined, maxNewTokens: 100 };

  it("is built from the form with defaults, clamps and non-empty prompts", () => {
    const settings: Settings = {
      ...structuredClone(DEFAULT_SETTINGS),
      prompts: ["a", " ", "b"],
      maxNewTokens: 5000,
      topP: 0,
    };
    const r = buildGenerate(settings, context);
    expect(r.prompts).toEqual(["a", "b"]);
    expect(r.max_new_tokens).toBe(100);
    expect(r.top_p).toBe(1);
    expect(r.probes).toBeUndefined(); // the engine's default probes
    expect(r.attention).toEqual({ layers: [0, 3] });
    expect(r.pca).toBe(true);
  });

  it("asks for the chosen sites, downsampled to the chosen bins", () => {
    const settings: Settings = {
      ...structuredClone(DEFAULT_SETTINGS),
      sites: ["hook_resid_post"],
      bins: 32,
      attentionLayers: [],
    };
    const r = buildGenerate(settings, context);
    expect(r.probes).toEqual([
      { name: "blocks.*.hook_resid_post", reduce: [{ kind: "downsample", axis: -1, bins: 32 }] },
    ]);
    expect(r.attention).toBeUndefined();
  });

  it("refuses an empty form", () => {
    expect(() => buildGenerate({ ...structuredClone(DEFAULT_SETTINGS), prompts: [""] }, context)).toThrow(/prompt/);
  });

  it("keeps per-layer activation sites only for heat maps", () => {
    expect(
      probeSites([
        "hook_embed",
        "blocks.0.hook_resid_post",
        "blocks.0.attn.hook_pattern",
        "blocks.0.attn.W_QKV",
        "blocks.1.mlp.hook_post",
      ]),
    ).toEqual(["hook_resid_post", "mlp.hook_post"]);
  });

  it("loads saved settings over the defaults and survives garbage", () => {
    expect(loadSettings({ getItem: () => '{"temperature": 0.7}' }).temperature).toBe(0.7);
    expect(loadSettings({ getItem: () => "{not json" })).toEqual(DEFAULT_SETTINGS);
    expect(loadSettings({ getItem: () => '{"prompts": []}' }).prompts).toEqual(DEFAULT_SETTINGS.prompts);
  });
});

describe("formatting", () => {
  it("writes ordinals and layouts as people read them", () => {
    expect([1, 2, 3, 4, 11, 12, 13, 21, 22, 23, 101, 111, 112].map(ordinal)).toEqual([
      "1st",
      "2nd",
      "3rd",
      "4th",
      "11th",
      "12th",
      "13th",
      "21st",
      "22nd",
      "23rd",
      "101st",
      "111th",
      "112th",
    ]);
    expect(layoutLabel({ tensor: 2, pipeline: 2, data: 1, virtual_pipeline: 1, sequence_parallel: false })).toBe(
      "TP2×PP2×DP1",
    );
    expect(layoutLabel({ tensor: 2, pipeline: 2, virtual_pipeline: 2, sequence_parallel: true })).toBe(
      "TP2×PP2×VPP2 SP",
    );
    expect(layoutLabel(undefined)).toBe("");
  });

  it("prints probabilities, numbers and tokens readably", () => {
    expect(percent(0.973)).toBe("97.3%");
    expect(percent(0.0412)).toBe("4.12%");
    expect(percent(1e-7)).toBe("<0.001%");
    expect(num(NaN)).toBe("NaN");
    expect(num(-Infinity)).toBe("−inf");
    expect(num(0.000123)).toBe("1.23e−4");
    expect(signed(0.5)).toBe("+0.5");
    expect(visibleToken(" a\n")).toBe("␣a↵");
    expect(ticks(0, 1, 5)).toEqual([0, 0.2, 0.4, 0.6000000000000001, 0.8, 1]);
  });

  it("tints unlikely tokens more", () => {
    const alpha = (p: number) => Number(/([\d.]+)\)$/.exec(surprisalColour(p))![1]);
    expect(alpha(0.99)).toBeLessThan(alpha(0.5));
    expect(alpha(0.5)).toBeLessThan(alpha(0.01));
    expect(surprisalColour(null)).toBe("");
  });
});
