"""Write the patch inventory page from ``lightning_megatron.compat.inventory`` at every docs build (mkdocs-gen-files),
so the page lists exactly what the code replaces."""

from __future__ import annotations

import mkdocs_gen_files

from lightning_megatron.compat.inventory import markdown_table

HEADER = """# What the project replaces in other projects

Every replacement of a function or attribute of torch, Lightning, megatron-core, python-socketio or
python-engineio that lightning-megatron makes, with why, how the original comes back, and the versions it was
tested with. The table is generated from `lightning_megatron.compat.inventory.PATCHES`;
`tests/test_patch_inventory.py` checks that each target exists in the installed versions and installs and
restores those that can run in one CPU process. A new patch goes into `compat/` and into that table.

"""

with mkdocs_gen_files.open("patches.md", "w") as page:
    page.write(HEADER + markdown_table() + "\n")
