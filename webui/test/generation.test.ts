import { describe, expect, it } from "vitest";
import type { GenerateRequest, ServerEvent } from "../src/protocol/schema.gen";
import { Generation } from "../src/state/generation";
import { f16, i32, range } from "./helpers";

const request: GenerateRequest = { v: 1, type: "generate", id: "g1", prompts: ["ab", "abcd"], max_new_tokens: 3 };

function start(): ServerEvent {
  return {
    v: 1,
    type: "start",
    id: "g1",
    num_layers: 2,
    prompts: [
      { ids: i32([1, 2], [2]), tokens: ["a", "b"] },
      { ids: i32([1, 2, 3, 4], [4]), tokens: ["a", "b", "c", "d"] },
    ],
    perturbations: [],
  };
}

function token(
  position: number,
  texts: [string, string],
  inPrompt: [boolean, boolean],
  done = [false, false],
): ServerEvent {
  return {
    v: 1,
    type: "token",
    id: "g1",
    position,
    t: 1000,
    tokens: texts.map((text, i) => ({ id: 10 + position, text, in_prompt: inPrompt[i], done: done[i] })),
    alternatives: texts.map(() => [
      { id: 10 + position, text: "x", p: 0.6 },
      { id: 99, text: "y", p: "NaN" as const },
    ]),
  };
}

describe("Generation", () => {
  it("says when the model's context, not the request, ended a generation", () => {
    const g = new Generation("g1", { ...request, max_new_tokens: 200 }, 7, 0);
    g.apply(start());
    g.apply(token(2, ["X", "c"], [false, true]));
    g.apply(token(3, ["Y", "d"], [false, true]));
    g.apply(token(4, ["Z", "E"], [false, false]));
    g.apply(token(5, ["W", "F"], [false, false]));
    g.apply(token(6, ["V", "G"], [false, false]));
    g.apply({ v: 1, type: "finish", id: "g1", texts: ["", ""], reasons: ["length", "length"] });
    const ending = g.ending(1);
    expect(ending?.label).toBe("context full: 3 of 200");
    expect(ending?.detail).toContain("the model sees 7 tokens");
    expect(ending?.detail).toContain("longest prompt (4 tokens) leaves room for 3");
    const asked = new Generation("g2", request, 64, 0);
    asked.apply(start());
    asked.apply({ v: 1, type: "finish", id: "g2", texts: ["", ""], reasons: ["length", "eos"] });
    expect(asked.ending(0)?.label).toBe("length");
    expect(asked.ending(1)?.label).toBe("end of text");
  });

  it("lays prompts of different lengths out by absolute position", () => {
    const g = new Generation("g1", request, 64, 0);
    g.apply(start());
    // position 2: prompt 0 generates, prompt 1 still reads its prompt (token event with in_prompt)
    g.apply(token(2, ["X", "c"], [false, true]));
    g.apply(token(3, ["Y", "d"], [false, true]));
    g.apply(token(4, ["Z", "E"], [false, false]));
    expect(g.prompts[0].cells.map((c) => c?.text)).toEqual(["a", "b", "X", "Y", "Z"]);
    expect(g.prompts[1].cells.map((c) => c?.text)).toEqual(["a", "b", "c", "d", "E"]);
    expect(g.prompts[1].cells[2]?.inPrompt).toBe(true);
    expect(g.prompts[1].cells[2]?.alternatives?.length).toBe(2); // a prompt token learns its alternatives
    expect(g.prompts[0].generated).toBe(3);
    expect(g.prompts[1].generated).toBe(1);
    expect(g.continuation(0)).toBe("XYZ");
    expect(g.capacity).toBe(4 + 3); // the longest prompt + max_new_tokens
    expect(g.probes.capacity).toBe(7);
    const capped = new Generation("g2", { ...request, max_new_tokens: 100 }, 16, 0);
    capped.apply(start());
    expect(capped.capacity).toBe(16); // not past the model's context
    expect(capped.probes.capacity).toBe(16);
  });

  it("takes a token's probability from its alternatives and keeps NaN alternatives", () => {
    const g = new Generation("g1", request, null, 0);
    g.apply(start());
    g.apply(token(2, ["X", "c"], [false, true]));
    const cell = g.tokenAt(0, 2)!;
    expect(cell.p).toBe(0.6);
    expect(cell.alternatives?.[1].p).toBeNaN();
  });

  it("skips tokens of prompts that already ended", () => {
    const g = new Generation("g1", request, null, 0);
    g.apply(start());
    g.apply(token(4, ["Q", "E"], [false, false], [true, false]));
    expect(g.prompts[0].cells[4]).toBeUndefined();
    expect(g.prompts[1].cells[4]?.text).toBe("E");
  });

  it("logs every token change once, in order, for the views", () => {
    const g = new Generation("g1", request, null, 0);
    g.apply(start());
    const afterStart = g.tokenLog.length;
    expect(afterStart).toBe(6);
    g.apply(token(2, ["X", "c"], [false, true]));
    expect(g.tokenLog.slice(afterStart)).toEqual([
      { prompt: 0, position: 2 },
      { prompt: 1, position: 2 },
    ]);
  });

  it("ends on finish (stopped when a prompt was cut short) or error", () => {
    const g = new Generation("g1", request, null, 0);
    g.apply(start());
    g.apply({ v: 1, type: "finish", id: "g1", texts: ["abX", "abcd"], reasons: ["length", "callback"] });
    expect(g.status).toBe("stopped");
    expect(g.running).toBe(false);
    expect(g.prompts[0].finalText).toBe("abX");
    const h = new Generation("g2", request, null, 0);
    h.apply({ v: 1, type: "error", id: "g2", code: "busy", message: "a generation is running" });
    expect(h.status).toBe("error");
    expect(h.error?.code).toBe("busy");
  });

  it("routes probes, attention, pca and dropped counts to their stores", () => {
    const g = new Generation("g1", request, null, 0);
    g.apply(start());
    g.apply({
      v: 1,
      type: "probe",
      id: "g1",
      name: "blocks.1.hook_resid_post",
      layer: 1,
      start: 0,
      end: 2,
      data: f16(range(2 * 2 * 4), [2, 2, 4]),
    });
    g.apply({
      v: 1,
      type: "attention",
      id: "g1",
      layer: 0,
      start: 0,
      end: 2,
      heads: null,
      data: f16(
        range(2 * 3 * 2 * 2, () => 0.5),
        [2, 3, 2, 2],
      ),
    });
    g.apply({ v: 1, type: "pca", id: "g1", layer: 1, coords: f16(range(2 * 4 * 2), [2, 4, 2]) });
    g.apply({ v: 1, type: "dropped", id: "g1", counts: { probe: 3 } });
    expect(g.probes.bands.get("blocks.1.hook_resid_post")?.value(1, 1, 3)).toBe(15);
    expect(g.attention.layers.get(0)?.heads).toEqual([0, 1, 2]);
    expect(g.pca.get(1)?.positions).toBe(4);
    expect(g.dropped.probe).toBe(3);
  });

  it("measures delivery latency from the token's server time", () => {
    const g = new Generation("g1", request, null, 0);
    g.apply(start());
    g.apply(token(2, ["X", "c"], [false, true]), 1000 * 1000 + 12);
    expect(g.latencies).toEqual([12]);
  });
});
