"""Write the API reference: one page per module of ``lightning_megatron``, found by walking the package.

Run by mkdocs-gen-files (``mkdocs.yml``) at every build, so a module that is added, moved or split appears in the
reference and its navigation without editing any page: the page of ``lightning_megatron/scan/tracing/callback.py`` is
``reference/lightning_megatron/scan/tracing/callback.md`` and holds ``::: lightning_megatron.scan.tracing.callback``. Private
modules (a name that starts with ``_``, compiled extensions) and ``__main__`` are left out; a package's page is
its ``__init__``.
"""

from __future__ import annotations

from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "lightning_megatron"

nav = mkdocs_gen_files.Nav()
for path in sorted((ROOT / PACKAGE).rglob("*.py")):
    module = path.relative_to(ROOT).with_suffix("")
    parts = list(module.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if any(part.startswith("_") for part in parts) or parts[-1] == "__main__":
        continue
    doc_path = Path("reference", *parts).with_suffix(".md")
    if path.name == "__init__.py":
        doc_path = Path("reference", *parts, "index.md")
    nav[tuple(parts)] = doc_path.relative_to("reference").as_posix()
    with mkdocs_gen_files.open(doc_path, "w") as page:
        page.write(f"# `{'.'.join(parts)}`\n\n::: {'.'.join(parts)}\n")
    mkdocs_gen_files.set_edit_path(doc_path, path.relative_to(ROOT))

with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as summary:
    summary.writelines(nav.build_literate_nav())
