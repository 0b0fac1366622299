// The bundle is served by lightning_megatron.scope.server under /static/ with a strict CSP (script-src 'self':
// no inline scripts, so no modulepreload polyfill) and committed in the Python package, so `pip install` needs no
// Node. `npm run dev` serves the page with hot reload and proxies Socket.IO to a running `scope serve`
// (MEGASCOPE_SERVER, default http://127.0.0.1:5000): open http://localhost:5173/static/?token=TOKEN.
import { fileURLToPath } from "node:url";
import vue from "@vitejs/plugin-vue";
import { defineConfig } from "vite";

const server = process.env.MEGASCOPE_SERVER ?? "http://127.0.0.1:5000";

export default defineConfig({
  base: "/static/",
  plugins: [vue()],
  build: {
    outDir: fileURLToPath(new URL("../lightning_megatron/scope/static", import.meta.url)),
    emptyOutDir: true,
    modulePreload: { polyfill: false },
    target: "es2022",
    sourcemap: false,
    chunkSizeWarningLimit: 400,
  },
  server: {
    proxy: {
      // The server only accepts its own origin: present the proxied websocket as coming from it.
      "/socket.io": { target: server, ws: true, changeOrigin: true, headers: { origin: server } },
    },
  },
});
