import { describe, expect, it } from "vitest";
import { parseCsv, parseSweep, sortRows } from "../src/state/sweep";

// As lightning_megatron.scope.sweep.write_results writes it (csv.DictWriter: Python float reprs, "" for None).
const CSV = [
  "layer,site,kind,strength,val_loss,delta_loss,grad_norm,delta_grad_norm",
  "0,system,gaussian,0.01,4.001,0.001,,",
  "0,system,gaussian,0.1,4.2,0.2,,",
  "1,system,gaussian,0.01,4.0005,0.0005,,",
  "1,system,gaussian,0.1,nan,nan,,",
  "0,storage,bitflip,0.001,inf,inf,,",
  "",
].join("\r\n");

describe("sweep.csv", () => {
  it("parses quoted CSV fields", () => {
    expect(parseCsv('a,"b,c","d""e"\n1,2,3')).toEqual([
      ["a", "b,c", 'd"e'],
      ["1", "2", "3"],
    ]);
  });

  it("reads rows with Python's nan/inf, the clean loss and one panel per site and kind", () => {
    const sweep = parseSweep(CSV);
    expect(sweep.rows).toHaveLength(5);
    expect(sweep.rows[3].valLoss).toBeNaN();
    expect(sweep.rows[4].deltaLoss).toBe(Infinity);
    expect(sweep.rows[0].gradNorm).toBeNull();
    expect(sweep.clean).toBeCloseTo(4.0);
    expect(sweep.panels.map((p) => `${p.site}/${p.kind}`)).toEqual(["storage/bitflip", "system/gaussian"]);
    const system = sweep.panels[1];
    expect(system.layers).toEqual([0, 1]);
    expect(system.axis).toBe("strength");
    expect(system.columns).toEqual([0.01, 0.1]);
    expect(system.delta[0]).toEqual([0.001, 0.2]);
    expect(system.delta[1][1]).toBeNaN();
  });

  it("draws expert cells as layer × expert panels, one per kind and strength", () => {
    // a sweep over experts (scope sweep --experts all --kinds disable gaussian --strengths 1.0)
    const text = [
      "layer,expert,site,kind,strength,val_loss,delta_loss,grad_norm,delta_grad_norm",
      "0,0,moe.hook_router_logits,disable,0.0,4.01,0.01,,",
      "0,1,moe.hook_router_logits,disable,0.0,4.03,0.03,,",
      "2,0,moe.hook_router_logits,disable,0.0,4.02,0.02,,",
      "2,1,moe.hook_router_logits,disable,0.0,4.005,0.005,,",
      "0,0,moe.hook_router_logits,gaussian,1.0,4.1,0.1,,",
      "0,1,moe.hook_router_logits,gaussian,1.0,4.2,0.2,,",
      "",
    ].join("\r\n");
    const sweep = parseSweep(text);
    expect(sweep.rows.map((r) => r.expert)).toEqual([0, 1, 0, 1, 0, 1]);
    expect(sweep.panels.map((p) => p.title)).toEqual([
      "moe.hook_router_logits · disable",
      "moe.hook_router_logits · gaussian 1",
    ]);
    const [disable, noise] = sweep.panels;
    expect([disable.axis, disable.strength, disable.layers, disable.columns]).toEqual(["expert", null, [0, 2], [0, 1]]);
    expect(disable.delta).toEqual([
      [0.01, 0.03],
      [0.02, 0.005],
    ]);
    expect([noise.strength, noise.layers, noise.delta]).toEqual([1, [0], [[0.1, 0.2]]]);
    expect(parseSweep(CSV).rows.every((r) => r.expert === null)).toBe(true);
    expect(() => parseSweep(text.replace("0,1,moe", "0,1.5,moe"))).toThrow(/expert is not an integer/);
  });

  it("sorts by a column with NaN last", () => {
    const sorted = sortRows(parseSweep(CSV).rows, "deltaLoss", true);
    expect(sorted.map((r) => r.deltaLoss)).toEqual([Infinity, 0.2, 0.001, 0.0005, NaN]);
  });

  it("names what is wrong with a file that is not a sweep", () => {
    expect(() => parseSweep("a,b\n1,2")).toThrow(/no column layer/);
    expect(() => parseSweep("")).toThrow(/empty/);
  });
});
