// The Socket.IO connection, run in a dedicated worker: the browser receives websocket messages on the thread
// that owns the socket, so a large frame (a prefill's attention maps are tens of MB) and Socket.IO's parsing
// never block the page's main thread. Events go to the page in batches, at most one message per few
// milliseconds, with their ArrayBuffers transferred (not copied).
import { io, type Socket } from "socket.io-client";
import type { FromWorker, ToWorker } from "./transport";

const scope = self as unknown as {
  postMessage(message: FromWorker, transfer?: Transferable[]): void;
  onmessage: ((event: MessageEvent<ToWorker>) => void) | null;
};

const BATCH_MS = 4;
/** A batch goes out when it holds this many events or bytes, so no single message is slow to unpack. */
const BATCH_EVENTS = 48;
const BATCH_BYTES = 4 << 20;
let batchBytes = 0;
let socket: Socket | null = null;
let batch: unknown[] = [];
let transfer: ArrayBuffer[] = [];
let timer: ReturnType<typeof setTimeout> | null = null;

function collectBuffers(value: unknown, out: ArrayBuffer[]): void {
  if (value instanceof ArrayBuffer) {
    out.push(value);
  } else if (Array.isArray(value)) {
    for (const item of value) collectBuffers(item, out);
  } else if (value !== null && typeof value === "object") {
    for (const key in value) collectBuffers((value as Record<string, unknown>)[key], out);
  }
}

function flush(): void {
  timer = null;
  if (batch.length === 0) return;
  const events = batch;
  const buffers = [...new Set(transfer)];
  batch = [];
  transfer = [];
  batchBytes = 0;
  scope.postMessage({ kind: "events", events: events as FromWorker extends { events: infer E } ? E : never }, buffers);
}

function state(state: string, detail: string): void {
  flush();
  scope.postMessage({ kind: "state", state, detail } as FromWorker);
}

scope.onmessage = (message: MessageEvent<ToWorker>) => {
  const data = message.data;
  if (data.kind === "connect") {
    socket?.close();
    socket = io(data.url ?? self.location.origin, data.options);
    socket.on("connect", () => state("connect", ""));
    socket.on("disconnect", (reason) => state("disconnect", reason));
    socket.on("connect_error", (error: Error) => state("connect_error", error.message));
    socket.on("event", (event: unknown) => {
      batch.push(event);
      const before = transfer.length;
      collectBuffers(event, transfer);
      for (let i = before; i < transfer.length; i++) batchBytes += transfer[i].byteLength;
      if (batch.length >= BATCH_EVENTS || batchBytes >= BATCH_BYTES) {
        if (timer !== null) clearTimeout(timer);
        flush();
      } else if (timer === null) timer = setTimeout(flush, BATCH_MS);
    });
  } else if (data.kind === "emit") {
    socket?.emit("request", data.request);
  } else if (data.kind === "reconnect") {
    socket?.connect();
  } else if (data.kind === "close") {
    socket?.close();
    socket = null;
  }
};
