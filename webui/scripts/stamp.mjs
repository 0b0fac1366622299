// Writes lightning_megatron/scope/static/BUILD_STAMP.json after `vite build`: the fingerprint of the sources
// (and lockfile) the bundle was built from, the schema's, and every bundle file's sha256. The Python test
// suite checks it without Node: a source edited without rebuilding, or a bundle file edited by hand, fails.
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";
import { bundleFiles, SCHEMA, sha256, sources, STATIC } from "./sources.mjs";

const require = createRequire(import.meta.url);
const { digest, files } = sources();
const stamp = {
  format: 1,
  sources_sha256: digest,
  schema_sha256: sha256(fs.readFileSync(SCHEMA)),
  sources: files,
  bundle: bundleFiles(STATIC),
  built_with: { vite: require("vite/package.json").version, vue: require("vue/package.json").version },
};
fs.writeFileSync(path.join(STATIC, "BUILD_STAMP.json"), JSON.stringify(stamp, null, 2) + "\n");
console.log(`stamped ${Object.keys(stamp.bundle).length} bundle files; sources ${digest.slice(0, 12)}`);
