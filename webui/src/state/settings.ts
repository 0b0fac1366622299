// The generation form, kept in localStorage so prompts and settings survive a new session.
import type { GenerateRequest, Probe } from "../protocol/schema.gen";
import { CHOICE_SITE, routerProbes, WEIGHTS_SITE } from "./router";

export interface Settings {
  prompts: string[];
  maxNewTokens: number;
  temperature: number;
  topK: number;
  topP: number;
  seed: number;
  alternatives: number;
  /** Per-layer probe sites to capture (hook_resid_post, ...); null: the engine's default probes. */
  sites: string[] | null;
  bins: number;
  /** Layers whose attention to stream; null: the first and the last layer. */
  attentionLayers: number[] | null;
  pca: boolean;
}

export const DEFAULT_SETTINGS: Settings = {
  prompts: ["In the beginning", "And God said"],
  maxNewTokens: 32,
  temperature: 0,
  topK: 0,
  topP: 1,
  seed: 0,
  alternatives: 5,
  sites: null,
  bins: 64,
  attentionLayers: null,
  pca: true,
};

const KEY = "megascope.settings.v1";

export function loadSettings(storage: Pick<Storage, "getItem"> | null): Settings {
  try {
    const raw = storage?.getItem(KEY);
    if (!raw) return structuredClone(DEFAULT_SETTINGS);
    const saved = JSON.parse(raw) as Partial<Settings>;
    const merged = { ...structuredClone(DEFAULT_SETTINGS), ...saved };
    if (!Array.isArray(merged.prompts) || merged.prompts.length === 0) merged.prompts = [...DEFAULT_SETTINGS.prompts];
    return merged;
  } catch {
    return structuredClone(DEFAULT_SETTINGS);
  }
}

export function saveSettings(storage: Pick<Storage, "setItem"> | null, settings: Settings): void {
  try {
    storage?.setItem(KEY, JSON.stringify(settings));
  } catch {
    /* storage full or disabled: settings just do not persist */
  }
}

/** "blocks.*.hook_resid_post" → "hook_resid_post" (the per-layer site a default probe names). */
export function siteOfPattern(name: string): string | null {
  const match = /^blocks\.\*\.(.+)$/.exec(name);
  return match ? match[1] : null;
}

/** Per-layer sites worth a heat map: activations with a position axis (not weights, not attention patterns). */
export function probeSites(probes: string[] | undefined): string[] {
  const sites = new Set<string>();
  for (const name of probes ?? []) {
    const match = /^blocks\.\d+\.(.+)$/.exec(name);
    if (!match) continue;
    const site = match[1];
    if (site.startsWith("W_") || site.includes(".W_") || site.endsWith("hook_pattern")) continue;
    if (site === CHOICE_SITE || site === WEIGHTS_SITE) continue; // expert indices: the router views show them
    sites.add(site);
  }
  return [...sites];
}

export function defaultAttentionLayers(numLayers: number | null): number[] {
  if (!numLayers) return [0];
  return numLayers > 1 ? [0, numLayers - 1] : [0];
}

export interface RequestContext {
  numLayers: number | null;
  defaultProbes: Probe[] | undefined;
  maxNewTokens: number | null;
  /** A mixture-of-experts model: also capture the experts each token goes to (the router views). */
  moe?: boolean;
}

/** The generate request the form describes (without v/id). */
export function buildGenerate(settings: Settings, context: RequestContext): Omit<GenerateRequest, "v" | "id"> {
  const prompts = settings.prompts.map((p) => p).filter((p) => p.trim().length > 0);
  if (prompts.length === 0) throw new RangeError("type a prompt first");
  if (prompts.length > 8) throw new RangeError("at most 8 prompts");
  const cap = context.maxNewTokens ?? 1024;
  const request: Omit<GenerateRequest, "v" | "id"> = {
    type: "generate",
    prompts,
    max_new_tokens: clampInt(settings.maxNewTokens, 1, Math.min(1024, cap)),
    temperature: clamp(settings.temperature, 0, 5),
    top_k: clampInt(settings.topK, 0, 1000),
    top_p: settings.topP > 0 ? clamp(settings.topP, 0.001, 1) : 1,
    seed: clampInt(settings.seed, 0, 2147483647),
    alternatives: clampInt(settings.alternatives, 0, 50),
    pca: settings.pca,
  };
  if (settings.sites !== null) {
    const bins = clampInt(settings.bins, 1, 4096);
    request.probes = settings.sites.map((site) => ({
      name: `blocks.*.${site}`,
      reduce: [{ kind: "downsample", axis: -1, bins }],
    }));
  }
  if (context.moe) request.probes = [...(request.probes ?? context.defaultProbes ?? []), ...routerProbes()];
  const layers = (settings.attentionLayers ?? defaultAttentionLayers(context.numLayers)).filter(
    (l) => context.numLayers === null || l < context.numLayers,
  );
  if (layers.length > 0) request.attention = { layers: [...new Set(layers)].sort((a, b) => a - b).slice(0, 64) };
  return request;
}

function clamp(x: number, lo: number, hi: number): number {
  return Number.isFinite(x) ? Math.min(hi, Math.max(lo, x)) : lo;
}

function clampInt(x: number, lo: number, hi: number): number {
  return Math.round(clamp(x, lo, hi));
}
