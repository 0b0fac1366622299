// CI: rebuild the bundle into a temporary folder and compare it, file by file, with the committed one in
// lightning_megatron/scope/static (and the stamp with the sources). Exit 1 with the differences.
import { execFileSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { bundleFiles, SCHEMA, sha256, sources, STATIC, WEBUI } from "./sources.mjs";

const problems = [];
const stampPath = path.join(STATIC, "BUILD_STAMP.json");
const stamp = fs.existsSync(stampPath) ? JSON.parse(fs.readFileSync(stampPath, "utf8")) : null;
if (!stamp) problems.push("no BUILD_STAMP.json in lightning_megatron/scope/static");
const { digest, files } = sources();
if (stamp && stamp.sources_sha256 !== digest) {
  const changed = Object.keys({ ...files, ...stamp.sources }).filter((f) => files[f] !== stamp.sources[f]);
  problems.push(`sources changed since the bundle was built: ${changed.join(", ")}`);
}
if (stamp && stamp.schema_sha256 !== sha256(fs.readFileSync(SCHEMA)))
  problems.push("the protocol schema changed since the bundle was built");

const out = fs.mkdtempSync(path.join(os.tmpdir(), "megascope-bundle-"));
try {
  execFileSync("npx", ["vite", "build", "--logLevel", "warn", "--outDir", out, "--emptyOutDir"], {
    cwd: WEBUI,
    stdio: "inherit",
  });
  const built = bundleFiles(out);
  const committed = bundleFiles(STATIC);
  for (const name of new Set([...Object.keys(built), ...Object.keys(committed)])) {
    if (!(name in committed)) problems.push(`missing from the committed bundle: ${name}`);
    else if (!(name in built)) problems.push(`not produced by a fresh build: ${name}`);
    else if (built[name] !== committed[name]) problems.push(`differs from a fresh build: ${name}`);
  }
} finally {
  fs.rmSync(out, { recursive: true, force: true });
}
if (problems.length) {
  console.error("The committed web UI bundle is not what webui/ builds:\n  " + problems.join("\n  "));
  console.error(
    "Rebuild it: cd webui && npm ci && npm run build (or `make webui`), and commit lightning_megatron/scope/static.",
  );
  process.exit(1);
}
console.log("the committed bundle matches a fresh build of webui/");
