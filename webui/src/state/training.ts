// A live training run followed through train_step / train_state events and the probes of sampled steps.
import { toNumber } from "../protocol/arrays";
import type { Perturbation, ServerEvent } from "../protocol/schema.gen";
import { ProbeSet } from "./probes";

export interface StepPoint {
  step: number;
  loss: number | null;
  gradNorm: number | null;
  cleanLoss: number | null;
  deltaLoss: number | null;
  perturbed: boolean;
  receivedAt: number;
}

export interface Capture {
  step: number;
  microbatch: number;
  probes: ProbeSet;
}

/** Keep at most this many steps (a day-long run at one sampled step per second is 86,400 points). */
export const MAX_STEPS = 100_000;

export class TrainingRun {
  readonly steps: StepPoint[] = [];
  paused: boolean | null = null;
  stepsLeft: number | null = null;
  perturbations: Perturbation[] = [];
  /** The newest sampled step's probes, per microbatch. */
  captures = new Map<number, Capture>();
  captureStep: number | null = null;
  /** Bumped when `captures` is replaced (a new step's first probe). */
  captureGeneration = 0;
  stateChanges = 0;

  apply(event: ServerEvent, now = Date.now()): boolean {
    switch (event.type) {
      case "train_step": {
        const point: StepPoint = {
          step: event.step,
          loss: toNumber(event.loss),
          gradNorm: toNumber(event.grad_norm ?? null),
          cleanLoss: toNumber(event.clean_loss),
          deltaLoss: toNumber(event.delta_loss),
          perturbed: (event.perturbations ?? []).length > 0,
          receivedAt: now,
        };
        const last = this.steps[this.steps.length - 1];
        if (last !== undefined && last.step >= point.step) {
          // a restarted or resumed run: keep the curve monotone in steps
          const keep = this.steps.findIndex((s) => s.step >= point.step);
          this.steps.splice(keep);
        }
        this.steps.push(point);
        if (this.steps.length > MAX_STEPS) this.steps.splice(0, this.steps.length - MAX_STEPS);
        this.paused = event.paused;
        if (event.perturbations !== undefined) this.perturbations = event.perturbations;
        return true;
      }
      case "train_state": {
        this.paused = event.paused;
        this.stepsLeft = event.steps_left ?? null;
        this.perturbations = event.perturbations;
        this.stateChanges++;
        return true;
      }
      case "probe": {
        if (event.step === undefined) return false;
        const microbatch = event.microbatch ?? 0;
        if (this.captureStep === null || event.step > this.captureStep) {
          this.captureStep = event.step;
          this.captures = new Map();
          this.captureGeneration++;
        } else if (event.step < this.captureStep) {
          return false; // a late probe of an older step
        }
        let capture = this.captures.get(microbatch);
        const rows = event.data.shape[0] ?? 1;
        const positions = event.end !== undefined && event.start !== undefined ? event.end - event.start : 0;
        if (capture === undefined) {
          capture = { step: event.step, microbatch, probes: new ProbeSet(rows, Math.max(1, event.end ?? positions)) };
          this.captures.set(microbatch, capture);
        }
        const start = event.start ?? 0;
        const end = event.end ?? start + (event.data.shape[1] ?? 0);
        if (end > start) capture.probes.add(event.name, start, end, event.data);
        return true;
      }
      default:
        return false;
    }
  }

  get lastStep(): StepPoint | undefined {
    return this.steps[this.steps.length - 1];
  }

  /** Microbatches of the newest capture, ascending. */
  microbatches(): number[] {
    return [...this.captures.keys()].sort((a, b) => a - b);
  }
}
