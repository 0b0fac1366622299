"""PEP 562 lazy attributes for a package ``__init__``: public names imported from their module on first access.

Why: the package and ``lightning_megatron.scan`` must import without torch, Lightning or megatron-core (the
TensorBoard plugin and trace-only tools read JSON), yet keep ``from lightning_megatron import
MegatronAppStrategy`` and ``from lightning_megatron.scan import MegaScan`` working. Imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_attributes"]


def lazy_attributes(namespace: dict[str, Any], names: dict[str, str]) -> tuple[Callable, Callable]:
    """``__getattr__`` and ``__dir__`` for the module whose globals are ``namespace``: each of ``names`` (public
    name → defining module) is imported when first read, then cached in ``namespace``."""
    module_name = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value  # later accesses skip this function
            return value
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
