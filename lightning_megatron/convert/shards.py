"""Hugging Face's safetensors layout, written one tensor at a time.

``save_pretrained`` holds the whole state dict before it splits it into shards; an exporter that assembles a
model from many ranks should not have to. ``ShardWriter`` takes tensors as they are assembled, writes a shard
whenever the next tensor would take it past ``max_shard_size``, and at the end names the files as
``save_pretrained`` does: one ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` with a
``model.safetensors.index.json`` that maps each tensor to its file. The writer's memory is one shard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Union

import torch

__all__ = ["ShardWriter", "parse_size"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: Union[int, str]) -> int:
    """Bytes of ``size``: an int, or a string as ``save_pretrained``'s ``max_shard_size`` takes ("5GB", "500MB")."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, got {size}.")
        return size
    match = _SIZE.match(str(size))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size {size!r}: use a positive number of bytes or a size such as '5GB' or '500MB'.")
    return int(float(match.group(1)) * _UNITS[unit])


class ShardWriter:
    """Collects tensors into shards of at most ``max_shard_size`` bytes (a larger tensor gets a shard of its own)
    and writes them under ``out_dir``. Shards from an earlier export into the same folder are removed on
    ``close``, so a loader never mixes two exports."""

    def __init__(self, out_dir: Union[str, Path], max_shard_size: Union[int, str] = "5GB") -> None:
        self.dir = Path(out_dir)
        self.limit = parse_size(max_shard_size)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # temporary file, tensor names
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in names for _, names in self._written):
            raise ValueError(f"tensor {name!r} was added twice.")
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.limit:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.dir / f".model-part-{len(self._written):05d}.safetensors.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._written.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def discard(self) -> None:
        """Remove the shards written so far (an export that failed leaves the folder as it was)."""
        for tmp, _ in self._written:
            tmp.unlink(missing_ok=True)
        self._written, self._pending, self._pending_bytes = [], {}, 0

    def close(self) -> list[Path]:
        """Write what is pending, name the shards, write the index where there is more than one; returns the
        shard files."""
        if self._pending or not self._written:
            self._flush()
        for old in self.dir.iterdir():
            if old.name == SINGLE or old.name == INDEX or _SHARD.match(old.name):
                old.unlink()
        count = len(self._written)
        if count == 1:
            names = [SINGLE]
        else:
            names = [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        files, weight_map = [], {}
        for (tmp, tensors), name in zip(self._written, names):
            tmp.rename(self.dir / name)
            files.append(self.dir / name)
            weight_map.update({tensor: name for tensor in tensors})
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return files
