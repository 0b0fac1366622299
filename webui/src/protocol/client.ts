// The connection to the server that served this page: Socket.IO over websocket only, the token in the
// connect auth, one "request" event per request and "event" events back (lightning_megatron.scope.server).
import type { ClientRequest, ErrorEvent, ServerEvent } from "./schema.gen";
import { defaultTransport, type Transport } from "./transport";

export type ConnectionState = "connecting" | "connected" | "disconnected" | "unauthorized";

/** A request without the fields the client fills in (v, id). */
export type RequestBody = ClientRequest extends infer R
  ? R extends ClientRequest
    ? Omit<R, "v" | "id">
    : never
  : never;

/** Reads the token from a page address and the address without it (for history.replaceState). */
export function takeToken(href: string): { token: string; clean: string } {
  const url = new URL(href);
  const token = url.searchParams.get("token") ?? "";
  url.searchParams.delete("token");
  const search = url.searchParams.toString();
  return { token, clean: url.pathname + (search ? `?${search}` : "") + url.hash };
}

export class RequestError extends Error {
  readonly event: ErrorEvent | null;
  constructor(message: string, event: ErrorEvent | null = null) {
    super(message);
    this.event = event;
  }
}

const SLICE_MS = 5;
const FRAME_BUDGET_MS = 10;

function now(): number {
  return typeof performance !== "undefined" ? performance.now() : Date.now();
}

/** Run `f` in a new task (after the browser has had a chance to render). */
function yieldToBrowser(f: () => void): void {
  if (typeof MessageChannel !== "undefined") {
    const channel = new MessageChannel();
    channel.port1.onmessage = () => f();
    channel.port2.postMessage(null);
  } else setTimeout(f, 0);
}

/** Run `f` once the next frame has been rendered (soon, in a hidden tab, where frames do not run). */
function afterNextFrame(f: () => void): void {
  if (typeof requestAnimationFrame !== "function" || (typeof document !== "undefined" && document.hidden)) {
    setTimeout(f, 16);
    return;
  }
  requestAnimationFrame(() => yieldToBrowser(f));
}

/** Events that end a request: each request gets exactly one. */
const FINAL = new Set(["pong", "info", "ack", "finish", "error"]);

interface Pending {
  resolve: (event: ServerEvent) => void;
  reject: (error: RequestError) => void;
  onEvent?: (event: ServerEvent) => void;
}

export interface ClientHandlers {
  state(state: ConnectionState, detail: string): void;
  /** Events no request is waiting for (training broadcasts, stray errors, dropped counts). */
  broadcast(event: ServerEvent): void;
}

export class ScopeClient {
  private transport: Transport | null = null;
  private readonly pending = new Map<string, Pending>();
  private counter = 0;
  private readonly prefix = Math.random().toString(36).slice(2, 6);
  state: ConnectionState = "connecting";

  constructor(
    private readonly token: string,
    private readonly handlers: ClientHandlers,
    private readonly url?: string,
    private readonly makeTransport: () => Transport = defaultTransport,
  ) {}

  connect(): void {
    this.transport?.close();
    const transport = this.makeTransport();
    this.transport = transport;
    this.setState("connecting", "");
    transport.connect(
      this.url,
      {
        transports: ["websocket"],
        auth: { token: this.token },
        reconnectionDelay: 500,
        reconnectionDelayMax: 4000,
        timeout: 10000,
      },
      {
        state: (state, detail) => this.enqueue(() => this.onTransportState(state, detail)),
        events: (events) => {
          for (const event of events) this.inbox.push(event);
          this.drain();
        },
      },
    );
  }

  private onTransportState(state: string, detail: string): void {
    if (state === "connect") this.setState("connected", "");
    else if (state === "disconnect") {
      this.failPending("the connection closed");
      const text =
        detail === "io server disconnect"
          ? "the server closed the connection"
          : detail === "io client disconnect"
            ? "disconnected"
            : "lost the connection; reconnecting…";
      this.setState("disconnected", text);
    } else if (detail === "unauthorized") {
      this.setState("unauthorized", "the server refused the token; open the address `scope serve` printed");
    } else {
      this.setState("disconnected", `cannot reach the server (${detail}); retrying…`);
    }
  }

  // Incoming events are handled in slices of at most SLICE_MS and at most FRAME_BUDGET_MS between two
  // rendered frames, so a burst (a prefill's thousands of probe events, or a server catching up) never
  // holds the page's thread: the browser renders between slices, and a backlog drains over several frames.
  private readonly inbox: (ServerEvent | (() => void))[] = [];
  private draining = false;
  private waiting = false;
  private usedThisFrame = 0;
  private frameWatch = false;

  private enqueue(action: () => void): void {
    this.inbox.push(action);
    this.drain();
  }

  private drain(): void {
    if (this.draining || this.waiting) return;
    this.draining = true;
    this.watchFrames();
    const started = now();
    let handled = 0;
    try {
      while (handled < this.inbox.length && (handled < 4 || now() - started < SLICE_MS)) {
        const item = this.inbox[handled++];
        if (typeof item === "function") item();
        else this.dispatch(item);
      }
    } finally {
      this.inbox.splice(0, handled);
      this.usedThisFrame += now() - started;
      this.draining = false;
    }
    if (!this.inbox.length) return;
    if (this.usedThisFrame < FRAME_BUDGET_MS) {
      yieldToBrowser(() => this.drain());
    } else {
      this.waiting = true; // resume after the next frame is rendered
      afterNextFrame(() => {
        this.waiting = false;
        this.drain();
      });
    }
  }

  /** Reset the per-frame budget at every rendered frame while events are flowing. */
  private watchFrames(): void {
    if (this.frameWatch || typeof requestAnimationFrame !== "function") return;
    this.frameWatch = true;
    requestAnimationFrame(() => {
      this.frameWatch = false;
      this.usedThisFrame = 0;
    });
  }

  /** Reconnect now (after the server closed the connection, or to retry at once). */
  reconnect(): void {
    if (this.transport && !this.transport.connected) {
      this.setState("connecting", "");
      this.transport.reconnect();
    } else if (!this.transport) this.connect();
  }

  close(): void {
    this.transport?.close();
    this.transport = null;
  }

  get connected(): boolean {
    return this.state === "connected";
  }

  nextId(kind: string): string {
    this.counter += 1;
    return `${kind.slice(0, 3)}-${this.prefix}-${this.counter}`;
  }

  /**
   * Send a request; resolves with its final event (rejects with the error event's message). onEvent sees
   * every event carrying the request's id (start, token, probe, ... for a generation).
   */
  request(
    body: RequestBody,
    onEvent?: (event: ServerEvent) => void,
    id?: string,
  ): { id: string; done: Promise<ServerEvent> } {
    const rid = id ?? this.nextId(body.type);
    const done = new Promise<ServerEvent>((resolve, reject) => {
      if (!this.transport || this.state !== "connected") {
        reject(new RequestError("not connected to the server"));
        return;
      }
      this.pending.set(rid, { resolve, reject, onEvent });
      this.transport.emit({ v: 1, id: rid, ...body });
    });
    return { id: rid, done };
  }

  private dispatch(event: ServerEvent): void {
    const rid = "id" in event ? event.id : undefined;
    const pending = rid !== undefined ? this.pending.get(rid) : undefined;
    if (pending === undefined) {
      this.handlers.broadcast(event);
      return;
    }
    pending.onEvent?.(event);
    if (!FINAL.has(event.type)) return;
    this.pending.delete(rid as string);
    if (event.type === "error") {
      const where = event.field ? ` (${event.field})` : "";
      pending.reject(new RequestError(`${event.code}: ${event.message}${where}`, event));
    } else pending.resolve(event);
  }

  private failPending(message: string): void {
    for (const [, pending] of this.pending) pending.reject(new RequestError(message));
    this.pending.clear();
  }

  private setState(state: ConnectionState, detail: string): void {
    this.state = state;
    this.handlers.state(state, detail);
  }
}
