// One generation request and everything its events said: per prompt the tokens by absolute position (with
// the alternatives that predicted them), probes, attention rows, PCA coordinates, how it ended. Events are
// applied in any order within a position; each kind of change is appended to a log that views consume.
import { decodeArray, toNumber } from "../protocol/arrays";
import type { ErrorEvent, GenerateRequest, Perturbation, ServerEvent, TokenChoice } from "../protocol/schema.gen";
import { AttentionSet } from "./attention";
import { ProbeSet } from "./probes";

export interface TokenCell {
  position: number;
  id: number;
  text: string;
  /** The model's probability of this token (null when not reported). */
  p: number | null;
  inPrompt: boolean;
  /** The most likely tokens at this position, from the logits that predicted it. */
  alternatives: Choice[] | null;
}

export interface Choice {
  id: number;
  text: string;
  p: number;
}

export interface PromptRun {
  index: number;
  text: string;
  cells: (TokenCell | undefined)[];
  /** Tokens the prompt encodes to. */
  promptLength: number;
  generated: number;
  finalText: string | null;
  reason: string | null;
}

export interface PcaLayer {
  layer: number;
  prompts: number;
  positions: number;
  coords: Float32Array; // [prompt][position][x, y]
}

export type GenerationStatus = "sent" | "running" | "done" | "stopped" | "error";

export interface TokenUpdate {
  prompt: number;
  position: number;
}

export class Generation {
  readonly id: string;
  readonly request: GenerateRequest;
  status: GenerationStatus = "sent";
  error: ErrorEvent | null = null;
  prompts: PromptRun[] = [];
  numLayers: number | null = null;
  perturbations: Perturbation[] = [];
  readonly probes: ProbeSet;
  readonly attention = new AttentionSet();
  readonly pca = new Map<number, PcaLayer>();
  readonly tokenLog: TokenUpdate[] = [];
  readonly pcaLog: number[] = [];
  /** Highest position with a token event. */
  lastPosition = -1;
  /** Positions the views should make room for. */
  capacity: number;
  events = 0;
  tokenEvents = 0;
  dropped = { probe: 0, attention: 0 };
  /** Delivery latency of token events (ms; same machine: server clock vs ours). */
  latencies: number[] = [];
  readonly startedAt: number;
  finishedAt: number | null = null;
  /** The model's longest sequence (positions never exceed it). */
  readonly maxSeqLength: number | null;
  /** Tokens of the batch's longest prompt (the server's room for new tokens is the context less these). */
  longestPrompt = 0;

  constructor(id: string, request: GenerateRequest, maxSeqLength: number | null = null, now = Date.now()) {
    this.id = id;
    this.request = request;
    this.startedAt = now;
    this.capacity = Math.max(1, (request.max_new_tokens ?? 32) + 1);
    this.maxSeqLength = maxSeqLength;
    this.probes = new ProbeSet(request.prompts.length, this.capacity);
    this.prompts = request.prompts.map((text, index) => ({
      index,
      text,
      cells: [],
      promptLength: 0,
      generated: 0,
      finalText: null,
      reason: null,
    }));
  }

  get running(): boolean {
    return this.status === "sent" || this.status === "running";
  }

  /** Positions with a token in the longest prompt so far. */
  get length(): number {
    let n = 0;
    for (const prompt of this.prompts) n = Math.max(n, prompt.cells.length);
    return n;
  }

  /** Apply one server event answering this generation; returns whether anything changed. */
  apply(event: ServerEvent, now = Date.now()): boolean {
    this.events++;
    switch (event.type) {
      case "start": {
        this.status = "running";
        this.numLayers = event.num_layers ?? null;
        this.perturbations = event.perturbations ?? [];
        let longest = 0;
        event.prompts.forEach((prompt, index) => {
          const ids = decodeArray(prompt.ids).values;
          const run = this.prompts[index] ?? {
            index,
            text: "",
            cells: [],
            promptLength: 0,
            generated: 0,
            finalText: null,
            reason: null,
          };
          this.prompts[index] = run;
          run.promptLength = ids.length;
          run.cells = Array.from(ids, (id, position) => ({
            position,
            id,
            text: prompt.tokens[position] ?? "",
            p: null,
            inPrompt: true,
            alternatives: null,
          }));
          for (let position = 0; position < ids.length; position++) this.tokenLog.push({ prompt: index, position });
          longest = Math.max(longest, ids.length);
        });
        this.longestPrompt = longest;
        let capacity = longest + (this.request.max_new_tokens ?? 32);
        if (this.maxSeqLength !== null) capacity = Math.min(capacity, this.maxSeqLength);
        this.capacity = Math.max(capacity, longest, 1);
        this.probes.capacity = this.capacity; // the constructor's was a guess; bands are created after start
        this.probes.rows = Math.max(1, event.prompts.length);
        return true;
      }
      case "token": {
        this.status = this.status === "sent" ? "running" : this.status;
        this.tokenEvents++;
        const position = event.position;
        this.lastPosition = Math.max(this.lastPosition, position);
        if (position >= this.capacity) this.capacity = position + 1;
        if (typeof event.t === "number") this.latencies.push(Math.max(0, now - event.t * 1000));
        event.tokens.forEach((token, index) => {
          const run = this.prompts[index];
          if (run === undefined || token.done) return; // an ended prompt: not part of its output
          const alternatives = (event.alternatives[index] ?? []).map(choice);
          const existing = run.cells[position];
          const p = toNumber(token.p) ?? alternatives.find((a) => a.id === token.id)?.p ?? null;
          if (existing !== undefined && token.in_prompt) {
            existing.p = p;
            existing.alternatives = alternatives.length ? alternatives : existing.alternatives;
          } else {
            run.cells[position] = {
              position,
              id: token.id,
              text: token.text,
              p,
              inPrompt: Boolean(token.in_prompt),
              alternatives: alternatives.length ? alternatives : null,
            };
            if (!token.in_prompt) run.generated++;
          }
          this.tokenLog.push({ prompt: index, position });
        });
        return true;
      }
      case "probe": {
        if (event.start === undefined || event.end === undefined) {
          this.probes.unshaped.set(event.name, event.data.shape.slice());
          return true;
        }
        this.probes.add(event.name, event.start, event.end, event.data);
        return true;
      }
      case "attention": {
        this.attention.add(event.layer, event.heads, event.start, event.end, event.data);
        return true;
      }
      case "pca": {
        const { shape, values } = decodeArray(event.coords);
        this.pca.set(event.layer, {
          layer: event.layer,
          prompts: shape[0] ?? 0,
          positions: shape[1] ?? 0,
          coords: values instanceof Float32Array ? values : Float32Array.from(values),
        });
        this.pcaLog.push(event.layer);
        return true;
      }
      case "finish": {
        event.texts.forEach((text, index) => {
          if (this.prompts[index]) this.prompts[index].finalText = text;
        });
        event.reasons.forEach((reason, index) => {
          if (this.prompts[index]) this.prompts[index].reason = reason;
        });
        this.status = event.reasons.includes("callback") ? "stopped" : "done";
        this.finishedAt = now;
        return true;
      }
      case "error": {
        this.status = "error";
        this.error = event;
        this.finishedAt = now;
        return true;
      }
      case "dropped": {
        this.dropped.probe += event.counts.probe ?? 0;
        this.dropped.attention += event.counts.attention ?? 0;
        return true;
      }
      default:
        this.events--;
        return false;
    }
  }

  /**
   * Why a prompt's generation ended, in words: "length" says whose length — the number of new tokens asked
   * for, or the model's context, which ends a batch once its longest prompt and the new tokens fill it.
   */
  ending(prompt: number): { label: string; detail: string } | null {
    const run = this.prompts[prompt];
    if (run === undefined || run.reason === null) return null;
    if (run.reason === "eos") return { label: "end of text", detail: "the model wrote its end-of-text token" };
    if (run.reason !== "length") return { label: "stopped", detail: "stopped before the end" };
    const asked = this.request.max_new_tokens ?? 32;
    if (
      this.maxSeqLength !== null &&
      run.generated < asked &&
      this.longestPrompt + run.generated >= this.maxSeqLength
    ) {
      const room = Math.max(0, this.maxSeqLength - this.longestPrompt);
      return {
        label: `context full: ${run.generated} of ${asked}`,
        detail:
          `${asked} new tokens asked, ${run.generated} given: the model sees ${this.maxSeqLength} tokens, and the ` +
          `batch's longest prompt (${this.longestPrompt} tokens) leaves room for ${room} new ones`,
      };
    }
    return { label: "length", detail: `the ${asked} new tokens asked for` };
  }

  /** The generated text of a prompt (tokens after its prompt, concatenated). */
  continuation(prompt: number): string {
    const run = this.prompts[prompt];
    if (run === undefined) return "";
    let text = "";
    for (const cell of run.cells) if (cell !== undefined && !cell.inPrompt) text += cell.text;
    return text;
  }

  tokenAt(prompt: number, position: number): TokenCell | undefined {
    return this.prompts[prompt]?.cells[position];
  }
}

function choice(c: TokenChoice): Choice {
  return { id: c.id, text: c.text, p: toNumber(c.p) ?? NaN };
}
