"""The README stays an entry point, and every benchmark result has a place in the index.

The docs site itself is built with ``mkdocs build --strict`` by ``make docs`` (and in CI); these checks need no
mkdocs and run with the rest of the suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
README_MAX_LINES = 300


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into a page of docs/"
    )


def test_every_result_is_indexed():
    index = (RESULTS / "README.md").read_text()
    linked = set(re.findall(r"\]\(([^)]+)\)", index))
    files = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"}
    assert files, "no results found"
    assert not files - linked, f"not in benchmarks/results/README.md: {sorted(files - linked)}"
    assert not linked - files, f"indexed but missing: {sorted(linked - files)}"
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"]
    assert not loose, f"results outside an area folder: {loose}"


def test_results_index_is_what_the_generator_writes():
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_benchmarks.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def test_references_to_results_exist():
    """A path into benchmarks/results/ quoted in the README or the docs names a file that is there."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = []
    for page in pages:
        for ref in re.findall(r"benchmarks/results/([\w./-]+\.(?:json|png|txt|gz|xz))", page.read_text()):
            if not (RESULTS / ref).exists():
                missing.append(f"{page.relative_to(ROOT)}: {ref}")
    assert not missing, "\n".join(missing)


def test_readme_links_exist():
    """Every relative link of the README names a file of the repository (GitHub renders them as is)."""
    text = (ROOT / "README.md").read_text()
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
