// What the bundle is built from, and its fingerprint. tests/test_webui.py computes the same in Python
// (webui_sources / sources_digest): keep the two in step.
//   files:  index.html, package.json, package-lock.json, tsconfig.json, vite.config.ts, and every file under
//           src/, public/ and scripts/ (names starting with "." skipped), as POSIX paths relative to webui/;
//   digest: sha256 over the sorted paths of `path NUL sha256(content) LF`, content with CRLF read as LF;
//   schema: sha256 of lightning_megatron/scope/schema/megascope-v1.schema.json (the generated types follow it).
import crypto from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";

export const WEBUI = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
export const SCHEMA = path.resolve(WEBUI, "../lightning_megatron/scope/schema/megascope-v1.schema.json");
export const STATIC = path.resolve(WEBUI, "../lightning_megatron/scope/static");
const TOP = ["index.html", "package.json", "package-lock.json", "tsconfig.json", "vite.config.ts"];
const DIRS = ["src", "public", "scripts"];

function walk(dir, out) {
  if (!fs.existsSync(dir)) return;
  for (const entry of fs.readdirSync(dir, { withFileTypes: true })) {
    if (entry.name.startsWith(".")) continue;
    const full = path.join(dir, entry.name);
    if (entry.isDirectory()) walk(full, out);
    else if (entry.isFile()) out.push(full);
  }
}

export function sha256(buffer) {
  return crypto.createHash("sha256").update(buffer).digest("hex");
}

function normalised(file) {
  const bytes = fs.readFileSync(file);
  return Buffer.from(bytes.toString("latin1").replace(/\r\n/g, "\n"), "latin1");
}

export function sourceFiles() {
  const files = TOP.map((name) => path.join(WEBUI, name)).filter((f) => fs.existsSync(f));
  for (const dir of DIRS) walk(path.join(WEBUI, dir), files);
  return files.map((f) => path.relative(WEBUI, f).split(path.sep).join("/")).sort();
}

export function sources() {
  const files = {};
  for (const rel of sourceFiles()) files[rel] = sha256(normalised(path.join(WEBUI, rel)));
  const digest = sha256(
    Buffer.from(
      Object.keys(files)
        .sort()
        .map((rel) => `${rel}\0${files[rel]}\n`)
        .join(""),
      "utf8",
    ),
  );
  return { digest, files };
}

/** Every file of a built bundle (relative POSIX path → sha256), BUILD_STAMP.json excluded. */
export function bundleFiles(dir) {
  const out = [];
  walk(dir, out);
  const files = {};
  for (const f of out.sort()) {
    const rel = path.relative(dir, f).split(path.sep).join("/");
    if (rel === "BUILD_STAMP.json") continue;
    files[rel] = sha256(fs.readFileSync(f));
  }
  return files;
}
