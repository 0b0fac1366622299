import { describe, expect, it } from "vitest";
import { ProbeSet } from "../src/state/probes";
import { loadPerExpert, moeFacts, routeAt } from "../src/state/router";
import { buildGenerate, probeSites } from "../src/state/settings";
import { describe as describePerturbation, newRow, toPerturbation } from "../src/state/perturbations";
import { f16, i32 } from "./helpers";

const MOE = { experts: 4, topk: 2, layers: [0, 2] };

function routed(): ProbeSet {
  const set = new ProbeSet(2, 4);
  // two prompts, positions 0..2, top-2 experts per token; prompt 1 position 2 lost a slot to a capacity limit
  set.add("blocks.2.moe.hook_expert_choice", 0, 3, i32([3, 0, 3, 1, 2, 3, 1, 0, 0, 2, 1, -1], [2, 3, 2]));
  set.add(
    "blocks.2.moe.hook_expert_weights",
    0,
    3,
    f16([0.75, 0.25, 0.5, 0.5, 0.625, 0.375, 0.875, 0.125, 0.5, 0.5, 1, 0], [2, 3, 2]),
  );
  return set;
}

describe("router facts", () => {
  it("reads the engine's moe facts, or none for a dense model", () => {
    expect(moeFacts({ num_layers: 4 })).toBeNull();
    expect(moeFacts(undefined)).toBeNull();
    expect(moeFacts({ moe: { experts: 4, topk: 2, layers: [2, 0, 2] } })).toEqual(MOE);
  });

  it("names the field of malformed facts", () => {
    expect(() => moeFacts({ moe: { experts: 1, topk: 1, layers: [0] } })).toThrow(
      /moe\.experts: 1 is not an expert count/,
    );
    expect(() => moeFacts({ moe: { experts: 4, topk: 5, layers: [0] } })).toThrow(/moe\.topk: 5 is not in 1\.\.4/);
    expect(() => moeFacts({ moe: { experts: 4, topk: 2, layers: ["x"] } })).toThrow(/moe\.layers/);
    expect(() => moeFacts({ moe: "all" })).toThrow(/not an object/);
  });
});

describe("expert per token", () => {
  it("gives each token's experts, highest weight first, with their weights", () => {
    const set = routed();
    expect(routeAt(set, MOE, 2, 0, 0)).toEqual({ experts: [3, 0], weights: [0.75, 0.25] });
    expect(routeAt(set, MOE, 2, 1, 2)).toEqual({ experts: [1], weights: [1] }); // the dropped slot is left out
    expect(routeAt(set, MOE, 2, 0, 3)).toBeNull(); // not captured yet
    expect(routeAt(set, MOE, 0, 0, 0)).toBeNull(); // layer not captured
  });

  it("refuses values that are not experts of the model", () => {
    const set = new ProbeSet(1, 2);
    set.add("blocks.0.moe.hook_expert_choice", 0, 1, i32([7, 0], [1, 1, 2]));
    expect(() => routeAt(set, MOE, 0, 0, 0)).toThrow(
      /blocks\.0\.moe\.hook_expert_choice at position 0: 7 is not an expert/,
    );
    const wide = new ProbeSet(1, 2);
    wide.add("blocks.0.moe.hook_expert_choice", 0, 1, i32([0, 1, 2], [1, 1, 3]));
    expect(() => routeAt(wide, MOE, 0, 0, 0)).toThrow(/3 experts per token, the model routes to 2/);
  });

  it("counts tokens per expert per layer", () => {
    const loads = loadPerExpert(routed(), MOE);
    expect(loads).toEqual([{ layer: 2, tokens: [3, 3, 2, 3], total: 11 }]);
  });
});

describe("router requests", () => {
  it("asks for the experts of an MoE model and keeps them out of the heat-map sites", () => {
    const settings = {
      prompts: ["hi"],
      maxNewTokens: 4,
      temperature: 0,
      topK: 0,
      topP: 1,
      seed: 0,
      alternatives: 3,
      sites: null,
      bins: 8,
      attentionLayers: [],
      pca: false,
    } as never;
    const dense = buildGenerate(settings, {
      numLayers: 4,
      defaultProbes: [{ name: "blocks.*.hook_resid_post" }],
      maxNewTokens: null,
    });
    expect(dense.probes).toBeUndefined();
    const moe = buildGenerate(settings, {
      numLayers: 4,
      defaultProbes: [{ name: "blocks.*.hook_resid_post" }],
      maxNewTokens: null,
      moe: true,
    });
    expect(moe.probes?.map((p) => p.name)).toEqual([
      "blocks.*.hook_resid_post",
      "blocks.*.moe.hook_expert_choice",
      "blocks.*.moe.hook_expert_weights",
    ]);
    expect(probeSites(["blocks.0.moe.hook_expert_choice", "blocks.0.moe.hook_router_logits"])).toEqual([
      "moe.hook_router_logits",
    ]);
  });

  it("makes a disabled expert, and refuses experts on other sites", () => {
    const row = newRow({ kind: "disable", site: "blocks.2.moe.hook_router_logits", experts: "3", enabled: true });
    const p = toPerturbation(row, 4);
    expect(p).toMatchObject({ kind: "disable", site: "blocks.2.moe.hook_router_logits", experts: [3] });
    expect(describePerturbation(p)).toBe("disable experts 3 on blocks.2.moe.hook_router_logits");
    expect(() => toPerturbation(newRow({ kind: "disable", site: "blocks.2.moe.hook_router_logits" }))).toThrow(
      /experts: disable needs/,
    );
    expect(() => toPerturbation(newRow({ kind: "gaussian", site: "system", experts: "1" }))).toThrow(
      /only router logits/,
    );
  });
});
