"""``scope sweep``: which layers (and which experts) are fragile — a seeded perturbation grid against a validation set.

Contract: ``run_sweep(trainer, module, data, grid)`` validates ``module`` once clean and once per cell of
``grid`` (layer × site × kind × strength, ``SweepGrid``) under ``scope.perturb``, at whatever layout the
Trainer runs (every rank calls it; the numbers are global), and returns one ``SweepRow`` per cell with the
validation loss and its change from clean (and, with ``grad_norm=True``, the gradient norm of the first
batch and its change: the silent-data-corruption signature is a spike in both). Perturbations are seeded,
so a sweep is reproducible at any layout. ``write_results`` saves a CSV, a Markdown table and a heat map.

Mixture-of-experts models: ``SweepGrid(experts=[...] or "all", sites=["moe.hook_router_logits"])`` makes the
router-logit cells per expert — ``kind="disable"`` one cell per (layer, expert) (the router never picks that
expert: the question "which expert matters"), noise kinds one cell per (layer, expert, strength) on that
expert's logits alone. Every refusal (experts on a dense model or on other sites, experts that do not exist,
``disable`` without experts) comes from the grid and the model's config before the first validation, so every
rank raises the same error and none is left waiting in a collective.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope.perturb import KINDS, Perturbation, out_of_range, perturb

__all__ = ["CSV_FIELDS", "ROUTER_SITE", "SweepGrid", "SweepRow", "panels", "rank_batches", "run_sweep", "write_results"]

ROUTER_SITE = "moe.hook_router_logits"
"""The one per-layer site that takes ``experts``: the router's logits, one per expert."""


@dataclass(frozen=True)
class SweepGrid:
    layers: Sequence[int]
    sites: Sequence[str] = ("system",)
    """Per-layer sites (``hook_resid_post``, ``attn.W_QKV``, ...) or groups (``storage``, ``calculation``, ``system``)."""
    kinds: Sequence[str] = ("gaussian",)
    strengths: Sequence[float] = (1e-2, 1e-1)
    seed: int = 0
    experts: Union[None, str, Sequence[int]] = None
    """None (cells are not per expert), expert indices, or ``"all"`` (every expert of the model, see
    ``resolved``); only with ``sites=["moe.hook_router_logits"]``."""

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise MegatronConfigError(f"sweep kinds {bad} are not perturbation kinds; choose from {list(KINDS)}.")
        if not self.layers or not self.sites or not self.kinds or not self.strengths:
            raise MegatronConfigError("a sweep needs at least one layer, site, kind and strength.")
        if isinstance(self.experts, str):
            if self.experts != "all":
                raise MegatronConfigError(
                    f"SweepGrid(experts={self.experts!r}): give expert indices such as [0, 1] or 'all'."
                )
        elif self.experts is not None:
            if not self.experts:
                raise MegatronConfigError("SweepGrid(experts=[]): name at least one expert, or 'all' (or None).")
            object.__setattr__(self, "experts", tuple(int(e) for e in self.experts))
        if self.experts is None and "disable" in self.kinds:
            raise MegatronConfigError(
                "SweepGrid(kinds=[..., 'disable']) needs experts=[...] or experts='all' (on the command line "
                f"--experts 0 1 or --experts all): disable turns off chosen experts at sites=['{ROUTER_SITE}']."
            )
        others = [s for s in self.sites if s != ROUTER_SITE]
        if self.experts is not None and others:
            raise MegatronConfigError(
                f"SweepGrid(experts=...) perturbs the router's logits of chosen experts; sites {others} have no "
                f"experts. Use sites=['{ROUTER_SITE}'] (--sites {ROUTER_SITE}), or sweep the other sites "
                "without experts."
            )

    def resolved(self, config: Any) -> SweepGrid:
        """This grid checked against a model's megatron-core config, ``"all"`` replaced by the expert indices.

        Judged on the whole model's config alone (every rank holds it, whatever its pipeline stage or expert
        shard), so every rank refuses alike, before any validation: experts on a dense model, on a layer with a
        dense MLP or out of range, and any cell ``perturb`` would refuse (out-of-range layers, too many experts
        disabled for ``moe_router_topk``)."""
        from lightning_megatron.scope.sites import moe_layers_of

        grid = self
        if self.experts is not None:
            count = int(getattr(config, "num_moe_experts", None) or 0)
            if not count:
                raise MegatronConfigError(
                    "SweepGrid(experts=...) needs a mixture-of-experts model (num_moe_experts is not set); "
                    "leave experts out for a dense model."
                )
            if self.experts == "all":
                grid = replace(self, experts=tuple(range(count)))
            wrong = [e for e in grid.experts if not 0 <= e < count]  # type: ignore[union-attr]
            if wrong:
                raise MegatronConfigError(
                    f"SweepGrid(experts={list(grid.experts)}): {wrong} are not experts of this model "  # type: ignore[arg-type]
                    f"(experts 0..{count - 1}); or use experts='all'."
                )
        if ROUTER_SITE in self.sites:
            moe = moe_layers_of(config)
            dense = [layer for layer in self.layers if layer not in moe and 0 <= layer < int(config.num_layers)]
            if dense:
                raise MegatronConfigError(
                    f"SweepGrid(layers={list(self.layers)}): layers {dense} have a dense MLP and no router; "
                    f"the mixture-of-experts layers are {moe}."
                )
        for _, _, _, _, _, pert in grid.perturbations():
            wrong_cell = out_of_range(pert, config)
            if wrong_cell is not None:
                name = {"kind": "kinds"}.get(wrong_cell[0].split("/")[0], wrong_cell[0].split("/")[0])
                raise MegatronConfigError(f"SweepGrid({name}=...): {wrong_cell[1]}.")
        return grid

    def cells(self) -> Iterable[tuple[int, str, str, float, Optional[int]]]:
        """``(layer, site, kind, strength, expert)``: per expert when ``experts`` are given, and then one
        ``disable`` cell per (layer, expert) at strength 0 (a disabled expert has no strength)."""
        if self.experts is None:
            for layer, site, kind, strength in itertools.product(self.layers, self.sites, self.kinds, self.strengths):
                yield layer, site, kind, strength, None
            return
        if isinstance(self.experts, str):
            raise MegatronConfigError("SweepGrid(experts='all'): call grid.resolved(config) first (run_sweep does).")
        for layer, site, kind, expert in itertools.product(self.layers, self.sites, self.kinds, self.experts):
            for strength in (0.0,) if kind == "disable" else self.strengths:
                yield layer, site, kind, strength, expert

    def perturbations(self) -> Iterable[tuple[int, str, str, float, Optional[int], Perturbation]]:
        """Each cell with the perturbation it runs under."""
        for layer, site, kind, strength, expert in self.cells():
            experts = None if expert is None else (expert,)
            pert = Perturbation(_site_pattern(layer, site), kind, strength, self.seed, (layer,), experts=experts)  # type: ignore[arg-type]
            yield layer, site, kind, strength, expert, pert


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
    expert: Optional[int] = None
    """The expert whose router logit the cell perturbed (None: the cell is not per expert)."""
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
    from lightning_megatron.scope.sites import chunks_of

    cells = list(grid.resolved(chunks_of(module)[0].config).perturbations())  # refusals first, on every rank
    first_batch = next(iter(data)) if grad_norm else None
    clean = _val_loss(trainer, module, data)
    clean_norm = _grad_norm(trainer, module, first_batch) if grad_norm else None
    rows = []
    bar = _progress(len(cells)) if progress and trainer.is_global_zero else None
    for layer, site, kind, strength, expert, pert in cells:
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
                expert,
            )
        )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return clean, rows


class _RankBatches(torch.utils.data.IterableDataset):
    def __init__(self, batches: Sequence[Any]) -> None:
        self.batches = list(batches)

    def __iter__(self) -> Any:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def rank_batches(batches: Sequence[Any]) -> torch.utils.data.DataLoader:
    """A loader of ``batches`` this rank already read (its own data-parallel share), the same for every cell.

    An iterable dataset, because Lightning gives a map-style loader a ``DistributedSampler`` over the
    data-parallel ranks: a share that was already split would be split again, and each rank would validate on
    half of it."""
    return torch.utils.data.DataLoader(_RankBatches(batches), batch_size=None)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="perturbation sweep", unit="cell")


CSV_FIELDS = ("layer", "expert", "site", "kind", "strength", "val_loss", "delta_loss", "grad_norm", "delta_grad_norm")
"""``sweep.csv``'s columns (``expert`` empty where a cell is not per expert); the web UI reads them by name."""


def write_results(out_dir: Path, clean: float, rows: Sequence[SweepRow]) -> dict[str, Path]:
    """``sweep.csv``, ``sweep.md`` (a table) and ``sweep.png`` (Δ loss per layer × strength, one panel per
    site and kind; per layer × expert for expert cells, one panel per site, kind and strength) in ``out_dir``;
    returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out_dir / "sweep.csv", "md": out_dir / "sweep.md", "png": out_dir / "sweep.png"}
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: v for k, v in asdict(row).items() if k in CSV_FIELDS})
    per_expert = any(r.expert is not None for r in rows)
    expert_head = ("| expert ", "|---:") if per_expert else ("", "")
    lines = [
        f"clean validation loss: {clean:.4f}",
        "",
        f"| layer {expert_head[0]}| site | kind | strength | val loss | Δ loss | grad norm | Δ grad norm |",
        f"|---:{expert_head[1]}|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        norm = "" if r.grad_norm is None else f"{r.grad_norm:.4g}"
        dnorm = "" if r.delta_grad_norm is None else f"{r.delta_grad_norm:+.4g}"
        expert = ("" if r.expert is None else f"{r.expert} ") + "| " if per_expert else ""
        strength = "–" if r.kind == "disable" else f"{r.strength:g}"
        lines.append(
            f"| {r.layer} | {expert}{r.site} | {r.kind} | {strength} | {r.val_loss:.4f} | {r.delta_loss:+.4f} "
            f"| {norm} | {dnorm} |"
        )
    paths["md"].write_text("\n".join(lines) + "\n")
    _plot(paths["png"], clean, rows)
    return paths


@dataclass(frozen=True)
class _Panel:
    title: str
    layers: list[int]
    columns: list[str]
    column_label: str
    values: list[list[float]]
    """``values[layer index][column index]``, NaN where the grid has no cell."""


def panels(rows: Sequence[SweepRow]) -> list[_Panel]:
    """The heat maps of a sweep: per (site, kind) Δ loss over layer × strength for cells that are not per
    expert (as before experts existed), per (site, kind, strength) Δ loss over layer × expert for expert cells
    (``disable`` has no strength: one panel per site)."""
    out = []
    dense = [r for r in rows if r.expert is None]
    for site, kind in sorted({(r.site, r.kind) for r in dense}):
        mine = [r for r in dense if (r.site, r.kind) == (site, kind)]
        layers, strengths = sorted({r.layer for r in mine}), sorted({r.strength for r in mine})
        values = {(r.layer, r.strength): r.delta_loss for r in mine}
        grid = [[values.get((layer, s), float("nan")) for s in strengths] for layer in layers]
        out.append(_Panel(f"{site} · {kind}", layers, [f"{s:g}" for s in strengths], "strength", grid))
    experts = [r for r in rows if r.expert is not None]
    for site, kind, strength in sorted({(r.site, r.kind, r.strength) for r in experts}):
        mine = [r for r in experts if (r.site, r.kind, r.strength) == (site, kind, strength)]
        layers, columns = sorted({r.layer for r in mine}), sorted({int(r.expert) for r in mine})  # type: ignore[arg-type]
        values = {(r.layer, r.expert): r.delta_loss for r in mine}
        grid = [[values.get((layer, e), float("nan")) for e in columns] for layer in layers]
        title = f"{site} · {kind}" + ("" if kind == "disable" else f" {strength:g}")
        out.append(_Panel(title, layers, [str(e) for e in columns], "expert", grid))
    return out


def _plot(path: Path, clean: float, rows: Sequence[SweepRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import SymLogNorm

    drawn = panels(rows)
    cols = min(3, len(drawn))
    nrows = math.ceil(len(drawn) / cols)
    tallest = max(len(p.layers) for p in drawn)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 0.5 * tallest + 2.2 * nrows), squeeze=False)
    finite = [abs(v) for p in drawn for row in p.values for v in row if math.isfinite(v)]
    scale = max(finite) if finite and max(finite) > 0 else 1.0
    # a log scale on both sides of 0: a 1e-3 change and a blow-up are both visible; NaN (a diverged model) is grey
    norm = SymLogNorm(linthresh=min(1e-3, scale / 10), vmin=-scale, vmax=scale)
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#b0b0b0")
    for ax, panel in zip(axes.flat, drawn):
        image = ax.imshow(panel.values, cmap=cmap, norm=norm, aspect="auto")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xticks(range(len(panel.columns)), panel.columns, fontsize=8)
        ax.set_yticks(range(len(panel.layers)), [str(layer) for layer in panel.layers], fontsize=8)
        ax.set_xlabel(panel.column_label)
        ax.set_ylabel("layer")
        for i, row in enumerate(panel.values):
            for j, v in enumerate(row):
                text = "inf" if v == float("inf") else ("nan" if not math.isfinite(v) else f"{v:+.2g}")
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
        fig.colorbar(image, ax=ax, label="Δ validation loss")
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    fig.suptitle(f"MegaScope perturbation sweep (clean loss {clean:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
