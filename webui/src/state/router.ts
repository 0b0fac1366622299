// The router of a mixture-of-experts model, as the text view and the load view show it: which experts each token
// went to (blocks.L.moe.hook_expert_choice, highest weight first) with their weights (hook_expert_weights), and how
// many tokens each expert of each layer received. Everything here reads what the server sent and checks it: an
// engine that says nothing about experts, or a capture whose shape or values do not fit the model, is shown as
// absent or as a named problem, never guessed at.
import type { ProbeSet } from "./probes";

export interface MoeFacts {
  experts: number;
  topk: number;
  /** The model's MoE layers (global, 0-based). */
  layers: number[];
}

export const CHOICE_SITE = "moe.hook_expert_choice";
export const WEIGHTS_SITE = "moe.hook_expert_weights";
const MAX_EXPERTS = 4096;

/**
 * The engine's `model.moe` facts (info event), or null for a dense model; throws a RangeError naming the field
 * when they are present but malformed (the server is not trusted to be this version's).
 */
export function moeFacts(model: unknown): MoeFacts | null {
  if (model === null || typeof model !== "object" || !("moe" in model)) return null;
  const moe = (model as { moe: unknown }).moe;
  if (moe === null || typeof moe !== "object") throw new RangeError("info.engine.model.moe: not an object");
  const { experts, topk, layers } = moe as Record<string, unknown>;
  if (!Number.isInteger(experts) || (experts as number) < 2 || (experts as number) > MAX_EXPERTS)
    throw new RangeError(
      `info.engine.model.moe.experts: ${String(experts)} is not an expert count (2..${MAX_EXPERTS})`,
    );
  if (!Number.isInteger(topk) || (topk as number) < 1 || (topk as number) > (experts as number))
    throw new RangeError(`info.engine.model.moe.topk: ${String(topk)} is not in 1..${String(experts)}`);
  if (!Array.isArray(layers) || layers.length === 0 || !layers.every((l) => Number.isInteger(l) && l >= 0))
    throw new RangeError("info.engine.model.moe.layers: not a non-empty list of layer indices");
  return {
    experts: experts as number,
    topk: topk as number,
    layers: [...new Set(layers as number[])].sort((a, b) => a - b),
  };
}

/** The probes a generate request adds to see the router (unreduced: k numbers per token and layer). */
export function routerProbes(): { name: string }[] {
  return [{ name: `blocks.*.${CHOICE_SITE}` }, { name: `blocks.*.${WEIGHTS_SITE}` }];
}

export interface TokenRoute {
  /** Chosen experts, highest weight first (a slot a capacity limit dropped is left out). */
  experts: number[];
  /** Their weights (null where no weights were captured). */
  weights: (number | null)[];
}

/**
 * The experts of one token at one layer, or null when not captured. Values that are not experts of this model
 * (a corrupt or foreign capture) make it throw, naming the probe and the position.
 */
export function routeAt(
  probes: ProbeSet,
  moe: MoeFacts,
  layer: number,
  row: number,
  position: number,
): TokenRoute | null {
  const choice = probes.bands.get(`blocks.${layer}.${CHOICE_SITE}`);
  if (choice === undefined) return null;
  if (choice.sourceFeatures !== moe.topk)
    throw new RangeError(
      `blocks.${layer}.${CHOICE_SITE}: ${choice.sourceFeatures} experts per token, the model routes to ${moe.topk}`,
    );
  const weights = probes.bands.get(`blocks.${layer}.${WEIGHTS_SITE}`);
  const route: TokenRoute = { experts: [], weights: [] };
  for (let j = 0; j < moe.topk; j++) {
    const raw = choice.value(row, position, j);
    if (raw === null) return null;
    const expert = Math.round(raw);
    if (expert === -1) continue; // dropped by a capacity limit
    if (!(expert >= 0 && expert < moe.experts) || Math.abs(raw - expert) > 1e-3)
      throw new RangeError(
        `blocks.${layer}.${CHOICE_SITE} at position ${position}: ${raw} is not an expert (0..${moe.experts - 1})`,
      );
    route.experts.push(expert);
    route.weights.push(weights?.sourceFeatures === moe.topk ? weights.value(row, position, j) : null);
  }
  return route;
}

export interface LayerLoad {
  layer: number;
  /** Tokens routed to each expert (a token counts once for each of its k experts). */
  tokens: number[];
  total: number;
}

/** Tokens per expert per MoE layer over every captured token of every row; layers without captures are left out. */
export function loadPerExpert(probes: ProbeSet, moe: MoeFacts): LayerLoad[] {
  const out: LayerLoad[] = [];
  for (const layer of moe.layers) {
    const band = probes.bands.get(`blocks.${layer}.${CHOICE_SITE}`);
    if (band === undefined) continue;
    const tokens = new Array<number>(moe.experts).fill(0);
    let total = 0;
    for (let row = 0; row < band.rows; row++) {
      for (let position = 0; position < band.end; position++) {
        const route = routeAt(probes, moe, layer, row, position);
        if (route === null) continue;
        for (const e of route.experts) tokens[e]++;
        total += route.experts.length;
      }
    }
    out.push({ layer, tokens, total });
  }
  return out;
}

/** A distinct colour per expert (evenly spaced hues; readable under dark text at this lightness). */
export function expertColour(expert: number, experts: number, dark = false): string {
  const hue = Math.round((360 * expert) / Math.max(1, experts) + 20) % 360;
  return dark ? `hsl(${hue} 45% 32%)` : `hsl(${hue} 75% 82%)`;
}
