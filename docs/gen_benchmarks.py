"""Index ``benchmarks/results/`` and write the benchmark pages of the docs from the files themselves.

Every result file records how it was made (the command, the date, the device, the software versions), though not
always under the same keys: at the top level, under ``provenance`` or ``versions``, or in the first entry of a
file that holds several runs. This script reads whichever is there and lists what is missing, so a table never
says more than its file does. It is used three ways:

* ``python docs/gen_benchmarks.py`` rewrites ``benchmarks/results/README.md`` (the index and the naming rule);
  ``--check`` exits 1 if that file is not what the results would generate (the test suite runs it).
* Run by mkdocs-gen-files (``mkdocs.yml``), it writes ``benchmarks/index.md`` and one page per area into the site:
  each file's provenance and, where the file holds a table of flat rows, that table.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
INDEX = RESULTS / "README.md"

AREAS = {
    "throughput": "Training throughput of whole steps (1 to 4 GPUs), their Kineto profiles, and the GPU recipes.",
    "schedules": "Pipeline schedules: MegaDPP, zero bubble (ZB-H1) and MegaFBD's rank split against 1F1B.",
    "megascan": "MegaScan: tracing overhead, detection of injected and outside faults, aggregation, traces.",
    "megascope": "MegaScope: probe and perturbation latency, its GPU tests.",
    "transport": "Tagged tensor transports (shm, tcp, ucx, NCCL), UCX phases and settings, NCCL collectives.",
    "fp8": "FP8 training through torchao: throughput against bf16 and the plain PyTorch peer, GPU tests, profiles.",
    "kernels": "Fused kernels, the fused weight-gradient GEMM, symmetric-memory all-reduce.",
    "gpu_tests": "Outcomes of the GPU test runs: parity across layouts, CUDA graphs, optimizer, memory release.",
    "convert": "Hugging Face checkpoints at real model sizes: import, logits against transformers, export, memory.",
}

NAMING_RULE = """\
Each result lives in the folder of its area and is named

    <area>/<benchmark>[_<model>][_<layout>]_<device>[_<date>][_<variant>].<ext>

with `<device>` as `cpu`, `h100` (one GPU) or `2xh200` (GPUs x model), `<layout>` as `tp2`, `pp2`, `dp2`,
`tp2sp`, ... and `<date>` as `YYYY-MM-DD` where a result is one of a series. A JSON result records, beside its
figures, the exact command, the date, the device and the software versions (`benchmarks/provenance.py` writes
them); a figure quoted in the docs names the file it comes from. Files other than JSON (plots, Kineto profile
summaries, archives of traces) sit beside the JSON they belong to. This index is generated:
`python docs/gen_benchmarks.py` rewrites it, and the test suite checks that it lists every file."""

VERSION_KEYS = ("torch", "megatron_core", "lightning", "cuda", "nccl", "python")
REQUIRED = ("command", "date", "device", "torch", "megatron_core")
ATTACHMENT_KINDS = {
    ".png": "plot",
    ".txt": "profile summary (text)",
    ".xz": "archive of traces",
    ".gz": "trace (gzipped JSON)",
}


@dataclass
class Result:
    """What the index says about one file of ``benchmarks/results/``."""

    path: Path
    area: str
    what: str = ""
    command: str = ""
    date: str = ""
    device: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    kind: str = "JSON"

    @property
    def rel(self) -> str:
        return self.path.relative_to(RESULTS).as_posix()


def _first_sentence(text: str, limit: int = 160) -> str:
    """The text up to its first ``.``, ``;`` or ``:`` outside parentheses, at most ``limit`` characters."""
    text = " ".join(str(text).split())
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and char in ".;:" and (i + 1 == len(text) or text[i + 1] == " "):
            text = text[:i]
            break
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _sources(data: Any) -> list[dict[str, Any]]:
    """The dictionaries that may hold provenance, most specific first."""
    if not isinstance(data, dict):
        return []
    found = [data]
    for key in ("provenance", "versions"):
        if isinstance(data.get(key), dict):
            found.append(data[key])
    # A file that holds several runs under names of their own (no provenance at its top level).
    if not any(key in data for key in ("command", "commands", "device", "provenance")):
        found += [value for value in data.values() if isinstance(value, dict)][:1]
    return found


def _lookup(sources: list[dict[str, Any]], *keys: str) -> Any:
    for source in sources:
        for key in keys:
            if source.get(key) not in (None, "", [], {}):
                return source[key]
    return None


def _describe(data: Any) -> str:
    """For a file without a ``what``: its benchmark's name and the settings that tell its cases apart."""
    if not isinstance(data, dict):
        return ""
    name = data.get("benchmark") or data.get("suite") or ""
    settings = data.get("settings") if isinstance(data.get("settings"), dict) else data
    parts = [f"{settings[key]}" for key in ("layout", "mode") if isinstance(settings.get(key), str)]
    for key, label in (("microbatches", "microbatches"), ("layer_spec", "spec"), ("tensor_parallel", "TP")):
        if isinstance(settings.get(key), (int, str)):
            parts.append(f"{label} {settings[key]}")
    return f"{name} benchmark" + (f" ({', '.join(parts)})" if parts else "") if name else ""


def _command(value: Any) -> str:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        commands = [str(item) for item in value if item]
        if not commands:
            return ""
        more = f"  (and {len(commands) - 1} more)" if len(commands) > 1 else ""
        return commands[0] + more
    return str(value or "")


def _flat_rows(data: Any) -> list[dict[str, Any]]:
    """The file's first list of flat rows (``results``, ``rows``, ``runs``), for a table of figures."""
    if not isinstance(data, dict):
        return []
    for key in ("results", "rows", "runs"):
        rows = data.get(key)
        if isinstance(rows, list) and rows and all(isinstance(row, dict) for row in rows):
            flat = [{k: v for k, v in row.items() if isinstance(v, (str, int, float, bool))} for row in rows]
            if all(flat):
                return flat
    return []


def read(path: Path) -> Result:
    area = path.relative_to(RESULTS).parts[0] if path.parent != RESULTS else "(none)"
    result = Result(path=path, area=area)
    if path.suffix != ".json":
        result.kind = ATTACHMENT_KINDS.get(path.suffix, path.suffix.lstrip(".") or "file")
        date = re.search(r"\d{4}-\d{2}-\d{2}", path.name)
        result.date = date.group(0) if date else ""
        return result
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        result.what = f"unreadable: {error}"
        result.missing = list(REQUIRED)
        return result
    sources = _sources(data)
    result.what = _first_sentence(_lookup(sources, "what") or _describe(data) or "")
    result.command = _command(_lookup(sources, "command", "commands"))
    result.date = str(_lookup(sources, "date") or "")[:10]
    if not result.date:
        date = re.search(r"\d{4}-\d{2}-\d{2}", path.name)
        result.date = date.group(0) if date else ""
    result.device = str(_lookup(sources, "device") or "")
    result.versions = {key: str(v) for key in VERSION_KEYS if (v := _lookup(sources, key)) is not None}
    found = {"command": result.command, "date": result.date, "device": result.device, **result.versions}
    result.missing = [key for key in REQUIRED if not found.get(key)]
    result.rows = _flat_rows(data)
    return result


def collect() -> list[Result]:
    paths = [p for p in sorted(RESULTS.rglob("*")) if p.is_file() and p != INDEX]
    return [read(path) for path in paths]


def _cell(value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def render_index(results: list[Result]) -> str:
    lines = [
        "# Benchmark results",
        "",
        "<!-- Generated by docs/gen_benchmarks.py from the files in this folder: do not edit by hand. -->",
        "",
        NAMING_RULE,
        "",
        "Missing: provenance keys the file does not record (of " + ", ".join(f"`{k}`" for k in REQUIRED) + ").",
        "",
    ]
    for area in sorted({r.area for r in results}):
        members = [r for r in results if r.area == area]
        lines += [f"## {area}", "", AREAS.get(area, ""), ""]
        lines += ["| file | what | device | date | missing |", "|---|---|---|---|---|"]
        for r in members:
            what = r.what if r.kind == "JSON" else r.kind
            missing = ", ".join(r.missing) if r.kind == "JSON" else "-"
            lines.append(
                f"| [{r.path.name}]({r.rel}) | {_cell(what)} | {_cell(r.device)} | {r.date} | {_cell(missing)} |"
            )
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_area(area: str, results: list[Result]) -> str:
    members = [r for r in results if r.area == area]
    lines = [
        f"# {area}",
        "",
        AREAS.get(area, ""),
        "",
        f"Generated from the {len(members)} files of `benchmarks/results/{area}/` by `docs/gen_benchmarks.py`.",
        "",
    ]
    for r in members:
        lines += [f"## {r.path.name}", ""]
        if r.kind != "JSON":
            lines += [f"{r.kind.capitalize()}, `benchmarks/results/{r.rel}`.", ""]
            if r.path.suffix == ".png":
                lines += [f"![{r.path.stem}](files/{r.rel})", ""]
            continue
        if r.what:
            lines += [_cell(r.what) + ".", ""]
        lines += ["| | |", "|---|---|"]
        lines.append(f"| device | {_cell(r.device) or '(not recorded)'} |")
        lines.append(f"| date | {r.date or '(not recorded)'} |")
        versions = ", ".join(f"{k} {v}" for k, v in r.versions.items())
        lines.append(f"| software | {_cell(versions) or '(not recorded)'} |")
        if r.missing:
            lines.append(f"| not recorded | {', '.join(r.missing)} |")
        lines.append("")
        if r.command:
            lines += ["```text", r.command, "```", ""]
        if r.rows:
            columns = list(dict.fromkeys(k for row in r.rows for k in row))[:10]
            lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            for row in r.rows[:40]:
                lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
            if len(r.rows) > 40:
                lines.append(f"\n({len(r.rows) - 40} more rows in the file.)")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_overview(results: list[Result]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Every figure in these docs comes from a file of `benchmarks/results/`, which records the command that",
        "produced it, the device and the software versions. The pages of this section are generated from those files",
        "at each build (`docs/gen_benchmarks.py`); what the figures mean is on the [evaluation](../evaluation/index.md)",
        "pages and in the guides.",
        "",
        "## Naming",
        "",
        NAMING_RULE,
        "",
        "## Areas",
        "",
        "| area | files | |",
        "|---|---|---|",
    ]
    for area in sorted({r.area for r in results}):
        count = sum(r.area == area for r in results)
        lines.append(f"| [{area}]({area}.md) | {count} | {AREAS.get(area, '')} |")
    return "\n".join(lines) + "\n"


def write_site() -> None:
    import mkdocs_gen_files

    results = collect()
    areas = sorted({r.area for r in results})
    with mkdocs_gen_files.open("benchmarks/index.md", "w") as page:
        page.write(render_overview(results))
    for area in areas:
        with mkdocs_gen_files.open(f"benchmarks/{area}.md", "w") as page:
            page.write(render_area(area, results))
    # The plots, so that guide and evaluation pages can show them (benchmarks/files/<area>/<name>.png).
    for r in results:
        if r.path.suffix == ".png":
            with mkdocs_gen_files.open(f"benchmarks/files/{r.rel}", "wb") as image:
                image.write(r.path.read_bytes())
    with mkdocs_gen_files.open("benchmarks/SUMMARY.md", "w") as summary:
        summary.write("* [Overview](index.md)\n" + "".join(f"* [{area}]({area}.md)\n" for area in areas))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if benchmarks/results/README.md is stale")
    args = parser.parse_args(argv)
    text = render_index(collect())
    if args.check:
        current = INDEX.read_text() if INDEX.exists() else ""
        if current != text:
            print(f"{INDEX.relative_to(ROOT)} is stale: run python docs/gen_benchmarks.py", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {INDEX.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "<run_path>":  # mkdocs-gen-files runs its scripts with runpy.run_path
    write_site()
