// The page's state: the connection, the server's info, the current generation (and a few past ones), a
// live training run, the perturbation rows and the form. Data stores are plain objects (never deep-reactive:
// they hold typed arrays that grow every token); `frame` ticks once per animation frame after changes and
// the views redraw from the stores' logs.
import { markRaw, reactive, ref, shallowRef, watch } from "vue";
import { RequestError, ScopeClient, takeToken, type ConnectionState, type RequestBody } from "../protocol/client";
import type { EngineInfo, InfoEvent, Perturbation, ServerEvent } from "../protocol/schema.gen";
import { Generation } from "./generation";
import { fromPerturbation, newRow, toPerturbation, type PerturbationRow } from "./perturbations";
import { moeFacts, type MoeFacts } from "./router";
import { buildGenerate, loadSettings, saveSettings, siteOfPattern, type Settings } from "./settings";
import { TrainingRun } from "./training";

export interface Notice {
  id: number;
  level: "error" | "warn" | "info";
  text: string;
}

export type EngineFacts = EngineInfo & {
  paused?: boolean;
  sampled?: { interval: number; window: number; start_step: number };
  model?: Record<string, number | string | boolean | object>;
  layout?: Record<string, number | boolean>;
  limits?: Record<string, number>;
};

const HISTORY = 12;
const FRAME_MS = 33;

function now(): number {
  return typeof performance !== "undefined" ? performance.now() : Date.now();
}

export class Scope {
  readonly connection = ref<ConnectionState>("connecting");
  readonly connectionDetail = ref("");
  readonly info = shallowRef<InfoEvent | null>(null);
  readonly generation = shallowRef<Generation | null>(null);
  readonly history = shallowRef<Generation[]>([]);
  readonly training = markRaw(new TrainingRun());
  /** Ticks once per animation frame in which data arrived. */
  readonly frame = ref(0);
  readonly notices = ref<Notice[]>([]);
  readonly settings = reactive<Settings>(loadSettings(storage()));
  readonly rows = reactive<PerturbationRow[]>([]);
  /** The perturbations the server has active (its answer, not the form). */
  readonly active = shallowRef<Perturbation[]>([]);
  readonly applying = ref(false);
  readonly perturbationError = ref("");
  /** Position the pointer rests on in any view (for the cross-view cursor), per prompt. */
  readonly focus = ref<{ prompt: number; position: number } | null>(null);
  readonly hasToken: boolean;
  client: ScopeClient | null = null;
  private scheduled = false;
  private lastTick = 0;
  private noticeId = 0;
  private rowsFromServer = false;

  constructor(href: string, replaceUrl: (clean: string) => void) {
    const { token, clean } = takeToken(href);
    this.hasToken = token.length > 0;
    if (this.hasToken) replaceUrl(clean); // the token leaves the address bar (history, screen shares)
    watch(this.settings, (value) => saveSettings(storage(), value), { deep: true });
    if (!this.hasToken) {
      this.connection.value = "unauthorized";
      this.connectionDetail.value = "this address has no ?token=…; open the address `scope serve` printed";
      return;
    }
    this.client = markRaw(
      new ScopeClient(token, {
        state: (state, detail) => this.onState(state, detail),
        broadcast: (event) => this.onBroadcast(event),
      }),
    );
  }

  start(): void {
    this.client?.connect();
  }

  get engine(): EngineFacts | null {
    return (this.info.value?.engine as EngineFacts | undefined) ?? null;
  }

  get mode(): "generate" | "train" | null {
    return this.engine?.mode ?? null;
  }

  get numLayers(): number | null {
    const n = this.engine?.model?.num_layers;
    return typeof n === "number" ? n : null;
  }

  get numHeads(): number | null {
    const model = this.engine?.model;
    const n = model?.num_heads ?? model?.num_attention_heads;
    return typeof n === "number" ? n : null;
  }

  /** The router facts of a mixture-of-experts model (null: dense, or facts this page cannot read: noticed). */
  get moe(): MoeFacts | null {
    try {
      return moeFacts(this.engine?.model);
    } catch (error) {
      const text = `router view off: ${(error as Error).message}`;
      if (!this.notices.value.some((n) => n.text === text)) this.notify("error", text);
      return null;
    }
  }

  /** Sites the form captures: the user's choice, else the engine's default probes. */
  get selectedSites(): string[] {
    if (this.settings.sites !== null) return this.settings.sites;
    return (this.engine?.default_probes ?? []).map((p) => siteOfPattern(p.name)).filter((s): s is string => s !== null);
  }

  /**
   * Views redraw at most FRAME_MS apart: a stream of 20 tokens/s with 75 events each updates the page at up
   * to 30 Hz, whatever the event rate (each redraw re-uploads every changed canvas to the compositor).
   */
  markDirty(): void {
    if (this.scheduled) return;
    this.scheduled = true;
    const tick = () => {
      this.scheduled = false;
      this.lastTick = now();
      this.frame.value++;
    };
    const wait = Math.max(0, FRAME_MS - (now() - this.lastTick));
    if (typeof requestAnimationFrame === "function" && typeof document !== "undefined" && !document.hidden) {
      if (wait > 4) setTimeout(() => requestAnimationFrame(tick), wait);
      else requestAnimationFrame(tick);
    } else setTimeout(tick, Math.max(wait, 100));
  }

  notify(level: Notice["level"], text: string): void {
    const id = ++this.noticeId;
    this.notices.value = [...this.notices.value.slice(-4), { id, level, text }];
    if (level === "info") setTimeout(() => this.dismiss(id), 5000);
  }

  dismiss(id: number): void {
    this.notices.value = this.notices.value.filter((n) => n.id !== id);
  }

  // -- requests ------------------------------------------------------------------------------------------
  async refreshInfo(): Promise<void> {
    if (!this.client) return;
    try {
      const event = await this.client.request({ type: "info" }).done;
      if (event.type !== "info") return;
      this.applyInfo(event);
      this.rowsFromServer = true;
      this.markDirty();
    } catch (error) {
      this.notify("error", `info: ${(error as Error).message}`);
    }
  }

  /** The server's facts: asked for, or sent to every page when a client changed the perturbations. */
  private applyInfo(event: InfoEvent): void {
    this.info.value = event;
    const engine = event.engine as EngineFacts;
    this.active.value = engine.perturbations ?? [];
    if (engine.mode === "train") {
      if (typeof engine.paused === "boolean" && this.training.paused === null) this.training.paused = engine.paused;
      this.training.perturbations = engine.perturbations ?? [];
    }
    if (!this.rowsFromServer && this.rows.length === 0 && (engine.perturbations ?? []).length > 0) {
      this.rows.splice(0, this.rows.length, ...(engine.perturbations ?? []).map(fromPerturbation));
    }
  }

  generate(): Generation | null {
    if (!this.client) return null;
    const current = this.generation.value;
    if (current?.running) return null;
    let body;
    try {
      body = buildGenerate(this.settings, {
        numLayers: this.numLayers,
        defaultProbes: this.engine?.default_probes,
        maxNewTokens: this.engine?.limits?.max_new_tokens ?? null,
        moe: this.moe !== null,
      });
    } catch (error) {
      this.notify("warn", (error as Error).message);
      return null;
    }
    const id = this.client.nextId("generate");
    const maxSeq = this.engine?.model?.max_seq_length;
    const generation = markRaw(new Generation(id, { v: 1, id, ...body }, typeof maxSeq === "number" ? maxSeq : null));
    if (current) this.history.value = [current, ...this.history.value].slice(0, HISTORY);
    this.generation.value = generation;
    const { done } = this.client.request(
      body as RequestBody,
      (event) => {
        if (generation.apply(event)) this.markDirty();
      },
      id,
    );
    done.catch((error: RequestError) => {
      if (generation.running) {
        generation.status = "error";
        if (generation.error === null) {
          generation.error = { v: 1, type: "error", code: "internal", message: error.message };
        }
      }
      this.markDirty();
    });
    this.markDirty();
    return generation;
  }

  stop(): void {
    this.client?.request({ type: "stop" }).done.catch((error: Error) => this.notify("error", `stop: ${error.message}`));
  }

  train(action: "pause" | "resume" | "step", steps = 1): void {
    const body: RequestBody = action === "step" ? { type: "train", action, steps } : { type: "train", action };
    this.client?.request(body).done.catch((error: Error) => this.notify("error", `${action}: ${error.message}`));
  }

  addRow(partial: Partial<PerturbationRow> = {}): PerturbationRow {
    const row = newRow(partial);
    this.rows.push(row);
    return row;
  }

  removeRow(key: number): void {
    const i = this.rows.findIndex((r) => r.key === key);
    if (i >= 0) this.rows.splice(i, 1);
  }

  /** Send the rows as the server's perturbation set (disabled rows are sent with enabled: false). */
  async applyPerturbations(): Promise<boolean> {
    if (!this.client) return false;
    let perturbations: Perturbation[];
    try {
      perturbations = this.rows.map((row, i) => {
        try {
          return toPerturbation(row, this.numLayers);
        } catch (error) {
          throw new RangeError(`row ${i + 1}: ${(error as Error).message}`);
        }
      });
    } catch (error) {
      this.perturbationError.value = (error as Error).message;
      return false;
    }
    this.applying.value = true;
    this.perturbationError.value = "";
    try {
      await this.client.request({ type: "set_perturbations", perturbations }).done;
      this.active.value = perturbations.filter((p) => p.enabled !== false);
      if (this.mode === "train") this.training.perturbations = this.active.value;
      return true;
    } catch (error) {
      const event = (error as RequestError).event;
      const match = event?.field ? /^\/perturbations\/(\d+)(\/.*)?$/.exec(event.field) : null;
      this.perturbationError.value = match
        ? `row ${Number(match[1]) + 1}${match[2] ? ` ${match[2].slice(1)}` : ""}: ${event?.message}`
        : (error as Error).message;
      return false;
    } finally {
      this.applying.value = false;
      this.markDirty();
    }
  }

  // -- events ----------------------------------------------------------------------------------------------
  private onState(state: ConnectionState, detail: string): void {
    this.connection.value = state;
    this.connectionDetail.value = detail;
    if (state === "connected") void this.refreshInfo();
    const generation = this.generation.value;
    if (state !== "connected" && generation?.running) {
      generation.status = "error";
      generation.error = {
        v: 1,
        type: "error",
        code: "internal",
        message: "the connection closed during the generation",
      };
      this.markDirty();
    }
  }

  private onBroadcast(event: ServerEvent): void {
    switch (event.type) {
      case "train_step":
      case "train_state":
      case "probe":
        if (this.training.apply(event)) {
          if (event.type !== "probe") this.active.value = this.training.perturbations;
          this.markDirty();
        }
        return;
      case "info": // another page changed the perturbations
        this.applyInfo(event);
        this.markDirty();
        return;
      case "attention":
        return; // training runs do not send attention today
      case "dropped": {
        const counts = Object.entries(event.counts).map(([kind, n]) => `${n} ${kind}`);
        this.notify("warn", `the page read too slowly: the server dropped ${counts.join(", ")} events`);
        return;
      }
      case "error":
        this.notify("error", `${event.code}: ${event.message}`);
        return;
      default:
        return;
    }
  }
}

function storage(): Storage | null {
  try {
    return typeof localStorage === "undefined" ? null : localStorage;
  } catch {
    return null;
  }
}
