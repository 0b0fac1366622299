import { inject, reactive } from "vue";
import type { Scope } from "./scope";

export const SCOPE_KEY = Symbol("scope");

export function useScope(): Scope {
  const scope = inject<Scope>(SCOPE_KEY);
  if (!scope) throw new Error("no Scope provided");
  return scope;
}

/** The one floating tooltip (hover details for tokens, heat map cells, points). */
export const tip = reactive({
  visible: false,
  x: 0,
  y: 0,
  title: "",
  rows: [] as [string, string][],
});

export function showTip(x: number, y: number, title: string, rows: [string, string][]): void {
  tip.visible = true;
  tip.x = x;
  tip.y = y;
  tip.title = title;
  tip.rows = rows;
}

export function hideTip(): void {
  tip.visible = false;
}
