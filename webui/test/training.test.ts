import { describe, expect, it } from "vitest";
import { TrainingRun } from "../src/state/training";
import { f16, range } from "./helpers";

describe("TrainingRun", () => {
  it("follows steps, state changes and Δ loss under a perturbation", () => {
    const run = new TrainingRun();
    run.apply({ v: 1, type: "train_state", paused: true, steps_left: null, perturbations: [] });
    expect(run.paused).toBe(true);
    run.apply({ v: 1, type: "train_step", step: 0, loss: 5.5, grad_norm: 1.2, paused: false });
    const pert = { site: "system", kind: "gaussian" as const, strength: 0.1 };
    run.apply({
      v: 1,
      type: "train_step",
      step: 1,
      loss: 5.4,
      grad_norm: "NaN",
      paused: false,
      perturbations: [pert],
      clean_loss: 5.3,
      delta_loss: 0.1,
    });
    expect(run.steps.map((s) => s.step)).toEqual([0, 1]);
    expect(run.lastStep?.gradNorm).toBeNaN();
    expect(run.lastStep?.deltaLoss).toBeCloseTo(0.1);
    expect(run.lastStep?.perturbed).toBe(true);
    expect(run.perturbations).toEqual([pert]);
  });

  it("restarts the curve when steps go backwards (a new run)", () => {
    const run = new TrainingRun();
    for (const step of [0, 1, 2, 1]) run.apply({ v: 1, type: "train_step", step, loss: step, paused: false });
    expect(run.steps.map((s) => s.step)).toEqual([0, 1]);
  });

  it("keeps the newest sampled step's probes per microbatch", () => {
    const run = new TrainingRun();
    const probe = (step: number, microbatch: number, name: string) =>
      run.apply({
        v: 1,
        type: "probe",
        step,
        microbatch,
        name,
        layer: 0,
        start: 0,
        end: 3,
        data: f16(range(2 * 3 * 4), [2, 3, 4]),
      });
    probe(4, 0, "blocks.0.hook_resid_post");
    probe(4, 1, "blocks.0.hook_resid_post");
    expect(run.microbatches()).toEqual([0, 1]);
    expect(run.captures.get(1)!.probes.rows).toBe(2);
    probe(5, 0, "blocks.0.hook_resid_post");
    expect(run.captureStep).toBe(5);
    expect(run.microbatches()).toEqual([0]);
    expect(probe(4, 1, "blocks.0.hook_resid_post")).toBe(false); // late: ignored
    expect(run.apply({ v: 1, type: "probe", name: "x", data: f16([1], [1]) })).toBe(false); // not a training probe
  });
});
