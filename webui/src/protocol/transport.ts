// How the client reaches the server: Socket.IO in a dedicated worker (WorkerTransport, the default: large
// messages and parsing stay off the page's thread) or on the page itself (DirectTransport: the fallback
// when workers are unavailable).
import { io, type ManagerOptions, type Socket, type SocketOptions } from "socket.io-client";
import type { ServerEvent } from "./schema.gen";

export type TransportState = "connect" | "disconnect" | "connect_error";

export interface TransportHandlers {
  state(state: TransportState, detail: string): void;
  events(events: ServerEvent[]): void;
}

export interface Transport {
  connect(url: string | undefined, options: Partial<ManagerOptions & SocketOptions>, handlers: TransportHandlers): void;
  emit(request: unknown): void;
  reconnect(): void;
  close(): void;
  readonly connected: boolean;
}

export type ToWorker =
  | { kind: "connect"; url?: string; options: Partial<ManagerOptions & SocketOptions> }
  | { kind: "emit"; request: unknown }
  | { kind: "reconnect" }
  | { kind: "close" };

export type FromWorker =
  { kind: "events"; events: ServerEvent[] } | { kind: "state"; state: TransportState; detail: string };

export class DirectTransport implements Transport {
  private socket: Socket | null = null;

  connect(
    url: string | undefined,
    options: Partial<ManagerOptions & SocketOptions>,
    handlers: TransportHandlers,
  ): void {
    this.socket?.close();
    const socket = url ? io(url, options) : io(options);
    this.socket = socket;
    socket.on("connect", () => handlers.state("connect", ""));
    socket.on("disconnect", (reason) => handlers.state("disconnect", reason));
    socket.on("connect_error", (error: Error) => handlers.state("connect_error", error.message));
    socket.on("event", (event: ServerEvent) => handlers.events([event]));
  }

  emit(request: unknown): void {
    this.socket?.emit("request", request);
  }

  reconnect(): void {
    this.socket?.connect();
  }

  close(): void {
    this.socket?.close();
    this.socket = null;
  }

  get connected(): boolean {
    return this.socket?.connected ?? false;
  }
}

export class WorkerTransport implements Transport {
  private worker: Worker;
  private isConnected = false;

  constructor(worker: Worker) {
    this.worker = worker;
  }

  connect(
    url: string | undefined,
    options: Partial<ManagerOptions & SocketOptions>,
    handlers: TransportHandlers,
  ): void {
    this.worker.onmessage = (message: MessageEvent<FromWorker>) => {
      const data = message.data;
      if (data.kind === "events") handlers.events(data.events);
      else {
        this.isConnected = data.state === "connect";
        handlers.state(data.state, data.detail);
      }
    };
    this.worker.onerror = (event) => {
      this.isConnected = false;
      handlers.state("connect_error", `the connection worker failed: ${event.message}`);
    };
    this.post({ kind: "connect", url, options });
  }

  emit(request: unknown): void {
    this.post({ kind: "emit", request });
  }

  reconnect(): void {
    this.post({ kind: "reconnect" });
  }

  close(): void {
    this.post({ kind: "close" });
    this.isConnected = false;
  }

  get connected(): boolean {
    return this.isConnected;
  }

  private post(message: ToWorker): void {
    this.worker.postMessage(message);
  }
}

/** A worker transport where the browser allows one, else the page's own socket (also with ?transport=direct). */
export function defaultTransport(): Transport {
  try {
    const direct =
      typeof location !== "undefined" && new URLSearchParams(location.search).get("transport") === "direct";
    if (typeof Worker !== "undefined" && !direct) {
      const worker = new Worker(new URL("./socket.worker.ts", import.meta.url), {
        type: "module",
        name: "megascope-socket",
      });
      return new WorkerTransport(worker);
    }
  } catch {
    /* fall through */
  }
  return new DirectTransport();
}
