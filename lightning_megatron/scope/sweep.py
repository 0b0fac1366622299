"""``scope sweep``: which layers are fragile — a seeded perturbation grid against a validation set.

Contract: ``run_sweep(trainer, module, data, grid)`` validates ``module`` once clean and once per cell of
``grid`` (layer × site × kind × strength, ``SweepGrid``) under ``scope.perturb``, at whatever layout the
Trainer runs (every rank calls it; the numbers are global), and returns one ``SweepRow`` per cell with the
validation loss and its change from clean (and, with ``grad_norm=True``, the gradient norm of the first
batch and its change: the silent-data-corruption signature is a spike in both). Perturbations are seeded,
so a sweep is reproducible at any layout. ``write_results`` saves a CSV, a Markdown table and a heat map.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope.perturb import KINDS, Perturbation, perturb

__all__ = ["SweepGrid", "SweepRow", "run_sweep", "write_results"]


@dataclass(frozen=True)
class SweepGrid:
    layers: Sequence[int]
    sites: Sequence[str] = ("system",)
    """Per-layer sites (``hook_resid_post``, ``attn.W_QKV``, ...) or groups (``storage``, ``calculation``, ``system``)."""
    kinds: Sequence[str] = ("gaussian",)
    strengths: Sequence[float] = (1e-2, 1e-1)
    seed: int = 0

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise MegatronConfigError(f"sweep kinds {bad} are not perturbation kinds; choose from {list(KINDS)}.")
        if not self.layers or not self.sites or not self.kinds or not self.strengths:
            raise MegatronConfigError("a sweep needs at least one layer, site, kind and strength.")

    def cells(self) -> Iterable[tuple[int, str, str, float]]:
        return itertools.product(self.layers, self.sites, self.kinds, self.strengths)


@dataclass(frozen=True)
class SweepRow:
    layer: int
    site: str
    kind: str
    strength: float
    val_loss: float
    delta_loss: float
    grad_norm: Optional[float] = None
    delta_grad_norm: Optional[float] = None
    extra: dict[str, Any] = field(default_factory=dict)


def _site_pattern(layer: int, site: str) -> str:
    from lightning_megatron.scope.sites import SITE_GROUPS

    return site if site in SITE_GROUPS else f"blocks.{layer}.{site}"


def _val_loss(trainer: Any, module: Any, data: Any) -> float:
    metrics = trainer.validate(module, data, verbose=False)
    return float(metrics[0]["val_loss"])


def _grad_norm(trainer: Any, module: Any, batch: Any) -> float:
    """The global gradient norm of one batch (every model-parallel shard counted once), without a step."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    for chunk in module.model_chunks:
        chunk.train()
    module.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = trainer.strategy.forward_backward(batch, forward_only=False)
    grads = [
        (p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
        for p in module.parameters()
        if (p.grad is not None or getattr(p, "main_grad", None) is not None)
        and param_is_not_shared(p)
        and param_is_not_tensor_parallel_duplicate(p)
    ]
    group = parallel_state.get_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    # the loss function returns token sums; the strategy divides by the token count at the optimizer step
    norm = float(get_grad_norm_fp32([g.float() for g in grads], grad_stats_parallel_group=group))
    module.zero_grad(set_to_none=True)
    return norm / max(float(out.num_tokens), 1.0)


def run_sweep(
    trainer: Any, module: Any, data: Any, grid: SweepGrid, *, grad_norm: bool = False, progress: bool = True
) -> tuple[float, list[SweepRow]]:
    """The clean validation loss and one row per grid cell (every rank calls this; see the module docstring)."""
    first_batch = next(iter(data)) if grad_norm else None
    clean = _val_loss(trainer, module, data)
    clean_norm = _grad_norm(trainer, module, first_batch) if grad_norm else None
    cells = list(grid.cells())
    rows = []
    bar = _progress(len(cells)) if progress and trainer.is_global_zero else None
    for layer, site, kind, strength in cells:
        pert = Perturbation(_site_pattern(layer, site), kind, strength, grid.seed, layers=(layer,))
        with perturb(module, perturbations=[pert]):
            loss = _val_loss(trainer, module, data)
            norm = _grad_norm(trainer, module, first_batch) if grad_norm else None
        rows.append(
            SweepRow(
                layer,
                site,
                kind,
                strength,
                loss,
                loss - clean,
                norm,
                None if norm is None or clean_norm is None else norm - clean_norm,
            )
        )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return clean, rows


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="perturbation sweep", unit="cell")


def write_results(out_dir: Path, clean: float, rows: Sequence[SweepRow]) -> dict[str, Path]:
    """``sweep.csv``, ``sweep.md`` (a table) and ``sweep.png`` (Δ loss per layer × strength, one panel per
    site and kind) in ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "sweep.csv", "md": out_dir / "sweep.md", "png": out_dir / "sweep.png"}
    fields = [f for f in SweepRow.__dataclass_fields__ if f != "extra"]
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: v for k, v in asdict(row).items() if k != "extra"})
    lines = [
        f"clean validation loss: {clean:.4f}",
        "",
        "| layer | site | kind | strength | val loss | Δ loss | grad norm | Δ grad norm |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        norm = "" if r.grad_norm is None else f"{r.grad_norm:.4g}"
        dnorm = "" if r.delta_grad_norm is None else f"{r.delta_grad_norm:+.4g}"
        lines.append(
            f"| {r.layer} | {r.site} | {r.kind} | {r.strength:g} | {r.val_loss:.4f} | {r.delta_loss:+.4f} | {norm} | {dnorm} |"
        )
    paths["md"].write_text("\n".join(lines) + "\n")
    _plot(paths["png"], clean, rows)
    return paths


def _plot(path: Path, clean: float, rows: Sequence[SweepRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import SymLogNorm

    panels = sorted({(r.site, r.kind) for r in rows})
    layers = sorted({r.layer for r in rows})
    strengths = sorted({r.strength for r in rows})
    cols = min(3, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 0.5 * len(layers) + 2.2 * nrows), squeeze=False)
    values = {(r.site, r.kind, r.layer, r.strength): r.delta_loss for r in rows}
    finite = [abs(v) for v in values.values() if math.isfinite(v)]
    scale = max(finite) if finite and max(finite) > 0 else 1.0
    # a log scale on both sides of 0: a 1e-3 change and a blow-up are both visible; NaN (a diverged model) is grey
    norm = SymLogNorm(linthresh=min(1e-3, scale / 10), vmin=-scale, vmax=scale)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#b0b0b0")
    for ax, (site, kind) in zip(axes.flat, panels):
        grid = [[values.get((site, kind, layer, s), float("nan")) for s in strengths] for layer in layers]
        image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
        ax.set_title(f"{site} · {kind}", fontsize=10)
        ax.set_xticks(range(len(strengths)), [f"{s:g}" for s in strengths], fontsize=8)
        ax.set_yticks(range(len(layers)), [str(layer) for layer in layers], fontsize=8)
        ax.set_xlabel("strength")
        ax.set_ylabel("layer")
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                text = "inf" if v == float("inf") else ("nan" if not math.isfinite(v) else f"{v:+.2g}")
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
        fig.colorbar(image, ax=ax, label="Δ validation loss")
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"MegaScope perturbation sweep (clean loss {clean:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
