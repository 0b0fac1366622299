"""Check the built site's API reference: every public class and function of ``lightning_megatron`` has an entry.

Run by ``make docs`` after ``mkdocs build``. It reads the module files (``ast``, nothing imported) for the classes
and functions defined at their top level whose names do not start with ``_``, in modules that are not private,
and looks each up in the site's inventory (``site/objects.inv``, written by mkdocstrings).
"""

from __future__ import annotations

import ast
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def public_names(package: str = "lightning_megatron") -> list[str]:
    names = []
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(part.startswith("_") for part in parts) or parts[-1] == "__main__":
            continue
        module = ".".join(parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith(
                "_"
            ):
                names.append(f"{module}.{node.name}")
    return names


def inventory(site: Path) -> set[str]:
    header_and_body = (site / "objects.inv").read_bytes().split(b"\n", 4)
    return {line.split(" ")[0] for line in zlib.decompress(header_and_body[4]).decode().splitlines()}


def main() -> int:
    site = ROOT / "site"
    if not (site / "objects.inv").exists():
        print("site/objects.inv is missing: run mkdocs build first", file=sys.stderr)
        return 1
    names = public_names()
    missing = sorted(set(names) - inventory(site))
    if missing:
        print("not in the API reference:\n  " + "\n  ".join(missing), file=sys.stderr)
        return 1
    print(f"API reference: all {len(names)} public classes and functions present")
    return 0


if __name__ == "__main__":
    sys.exit(main())
