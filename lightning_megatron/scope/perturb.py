"""``perturb``: inject noise, bit flips or stuck values into weights, computations or the residual stream.

Contract::

    with perturb(module, "blocks.2.hook_resid_post", kind="gaussian", strength=0.1, seed=0):
        ...  # generation, training steps, validation: the model computes the perturbed function

Rules that keep training correct (MegatronApp's weight noise ran under ``no_grad`` and cut gradients):

* **Noise is a function of (seed, step, microbatch, layer, site) and the absolute position**, drawn for the
  *full* (TP1) tensor and cut to each rank's shard (``scope.layout``). So activation recomputation, every TP
  rank holding a replicated tensor, every layout, and a KV-cache decode step (which sees one position)
  against a full recompute all see the same noise. Weights take noise per (seed, step, layer, site).
  Under context parallelism the noise of the whole sequence is cut into each rank's two load-balanced chunks
  (``ShardLayout.context_part``) before its tensor-parallel shard: every position gets the value it gets at CP1.
* **Activations**: the replacement is ``f(x)`` with the noise detached, so the gradient is that of the
  perturbed function (multiplicative noise and masks scale or zero it); bit flips have no derivative and use
  a straight-through estimator (the forward gives the flipped value bit for bit, the backward the gradient of x).
* **Weights** are never edited: for the duration of the module's forward its ``weight`` attribute is the
  tensor ``w + n`` (``w`` stays a parameter, gradients flow through the addition to it), restored by an
  always-called forward hook. Checkpoints, the optimizer and the gradient buffers only ever see clean ``w``.
* **Off is exact**: leaving the context removes every hook; ``strength=0`` computes ``x + 0·n`` (gaussian),
  ``x·1`` (uniform) or nothing (masks, flips): outputs and gradients are bit-identical to no perturbation.

Kinds (``strength`` means): ``gaussian`` x + s·N(0,1); ``uniform`` x·U(1-s, 1+s); ``bitflip`` each element
has one random bit of its dtype flipped with probability s; ``zero`` each element is zeroed with probability
s; ``stuck`` each element is set to ``value`` with probability s; ``disable`` (router logits only) sets the logits
of ``experts`` to ``-inf``, so the router never chooses them (their weight is 0; the gradient of those logits is 0).
``layers`` and ``heads`` narrow a site (heads are the tensor's own: query heads for q and z, key/value heads for k
and v); ``experts`` narrows ``blocks.L.moe.hook_router_logits`` to those experts' logits (noise on one expert's
logit moves tokens to or from it alone).
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope.sites import ProbePoint, chunks_of, match_points, probe_points
from lightning_megatron.scope.tap import Tap, strategy_of

__all__ = ["KINDS", "Perturbation", "Perturber", "noise_draws", "out_of_range", "perturb", "requested"]

Kind = Literal["gaussian", "uniform", "bitflip", "zero", "stuck", "disable"]
KINDS: tuple[str, ...] = ("gaussian", "uniform", "bitflip", "zero", "stuck", "disable")
_ROUTER_LOGITS = "moe.hook_router_logits"
_INT_VIEWS = {8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}


@dataclass(frozen=True)
class Perturbation:
    site: str
    """A probe name or glob (``blocks.*.hook_resid_post``), or a group: ``storage``, ``calculation``, ``system``."""
    kind: Kind = "gaussian"
    strength: float = 0.0
    seed: int = 0
    layers: Optional[tuple[int, ...]] = None
    heads: Optional[tuple[int, ...]] = None
    value: float = 0.0
    """The stuck-at value (``kind="stuck"``)."""
    experts: Optional[tuple[int, ...]] = None
    """Router logits only: the experts whose logits are perturbed (``kind="disable"``: the disabled experts)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise MegatronConfigError(f"Perturbation(kind={self.kind!r}): choose one of {list(KINDS)}.")
        strength = float(self.strength)
        if not strength >= 0 or strength == float("inf"):
            raise MegatronConfigError(f"Perturbation(strength={self.strength!r}) must be a finite number >= 0.")
        if self.kind in ("bitflip", "zero", "stuck") and strength > 1:
            raise MegatronConfigError(
                f"Perturbation(kind={self.kind!r}, strength={strength}): strength is a probability per element, in [0, 1]."
            )
        object.__setattr__(self, "strength", strength)
        if self.kind == "disable" and not self.experts:
            raise MegatronConfigError(
                "Perturbation(kind='disable') needs experts=[...]: the experts whose router logits become -inf "
                "(site: blocks.L.moe.hook_router_logits)."
            )
        for name in ("layers", "heads", "experts"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(int(v) for v in value))

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Perturbation:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(spec) - known)
        if unknown:
            raise MegatronConfigError(f"a perturbation takes {sorted(known)}; unknown fields: {unknown}.")
        return cls(**spec)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}


def _exists_in_model(site: str, config: Any) -> bool:
    """Whether ``site`` names a point of the whole model (this rank holds only its pipeline stage's points)."""
    from lightning_megatron.scope.sites import SITE_GROUPS, point_names_of

    names = point_names_of(config)
    return site in SITE_GROUPS or any(fnmatch.fnmatchcase(name, site) for name in names)


def out_of_range(pert: Perturbation, config: Any) -> Optional[tuple[str, str]]:
    """``(field, message)`` for ``layers`` or ``heads`` that name nothing ``pert.site`` has in this model (they
    would narrow the perturbation to nothing, silently), else None. Judged on the whole model's config, so
    every pipeline stage agrees; ``field`` is ``layers/i`` or ``heads/i``."""
    from lightning_megatron.scope.sites import SITE_GROUPS, point_names_of

    num_layers = int(config.num_layers)
    heads = int(config.num_attention_heads)
    groups = int(config.num_query_groups or heads)
    globs = [f"blocks.*.{site}" for site in SITE_GROUPS[pert.site]] if pert.site in SITE_GROUPS else [pert.site]
    names = [n for n in point_names_of(config) if any(fnmatch.fnmatchcase(n, g) for g in globs)]
    if pert.layers is not None:
        for index, layer in enumerate(pert.layers):
            if not 0 <= layer < num_layers:
                return f"layers/{index}", f"{layer} is not a layer of this model (layers 0..{num_layers - 1})"
        in_layers = [n for n in names if n.startswith("blocks.") and int(n.split(".")[1]) in pert.layers]
        if names and not in_layers:
            return "layers", f"site {pert.site!r} has no point in layers {list(pert.layers)}"
    if pert.experts is not None or pert.kind == "disable":
        wrong = _experts_out_of_range(pert, config, names)
        if wrong is not None:
            return wrong
    if pert.heads is not None:
        # query heads for q, z and the pattern; key/value heads (num_query_groups) for k and v
        limit = groups if any(n.endswith(("attn.hook_k", "attn.hook_v")) for n in names) else heads
        for index, head in enumerate(pert.heads):
            if not 0 <= head < limit:
                return f"heads/{index}", f"{head} is not a head of {pert.site!r} in this model (heads 0..{limit - 1})"
    return None


def _experts_out_of_range(pert: Perturbation, config: Any, names: Sequence[str]) -> Optional[tuple[str, str]]:
    """``experts`` and ``kind="disable"`` act on router logits only, name real experts, and leave each token
    ``moe_router_topk`` experts to choose from."""
    field = "experts" if pert.experts is not None else "kind"
    if not names or not all(n.endswith(_ROUTER_LOGITS) for n in names):
        what = "experts=[...]" if pert.experts is not None else "kind='disable'"
        return field, f"{what} applies to router logits only (site 'blocks.L.{_ROUTER_LOGITS}'), not {pert.site!r}"
    experts, topk = int(config.num_moe_experts), int(config.moe_router_topk)
    for index, expert in enumerate(pert.experts or ()):
        if not 0 <= expert < experts:
            return f"experts/{index}", f"{expert} is not an expert of this model (experts 0..{experts - 1})"
    if pert.kind == "disable" and experts - len(set(pert.experts or ())) < topk:
        return "experts", (
            f"disabling {len(set(pert.experts or ()))} of {experts} experts leaves fewer than "
            f"moe_router_topk={topk} for each token"
        )
    return None


def requested(specs: Sequence[Mapping[str, Any]], model: Any, *, limit: Optional[int] = None) -> list[Perturbation]:
    """The active set a ``set_perturbations`` request asks for (items with ``enabled: false`` left out),
    checked against ``model`` now, so a bad item is refused in the client's request and not inside a
    generation or at the next training step: a ``ProtocolError`` whose field points at the item
    (``/perturbations/2/layers/0``) and says the valid range."""
    from lightning_megatron.scope.protocol import ProtocolError

    if limit is not None and len(specs) > limit:
        raise ProtocolError("too_large", "/perturbations", f"at most {limit} perturbations at once")
    config = chunks_of(model)[0].config
    parsed = []
    for index, spec in enumerate(specs):
        where = f"/perturbations/{index}"
        if not spec.get("enabled", True):
            continue
        try:
            pert = Perturbation.from_dict({k: v for k, v in spec.items() if k != "enabled"})
        except MegatronConfigError as error:
            raise ProtocolError("invalid_field", where, str(error)) from None
        wrong = out_of_range(pert, config)
        if wrong is not None:
            raise ProtocolError("invalid_field", f"{where}/{wrong[0]}", wrong[1])
        try:
            Perturber(model, [pert])
        except MegatronConfigError as error:
            raise ProtocolError("bad_request", where, str(error)) from None
        parsed.append(pert)
    return parsed


def _seed_of(*parts: Any) -> int:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Perturber:
    """The hooks of a set of perturbations on one model; ``attach``/``detach`` (``perturb`` does both)."""

    def __init__(self, model: Any, perturbations: Sequence[Perturbation]) -> None:
        self.chunks = chunks_of(model)
        self.tap = Tap.of(self.chunks, strategy_of(model))
        self.perturbations = list(perturbations)
        points = probe_points(self.chunks)
        self.targets: list[tuple[Perturbation, ProbePoint]] = []
        for pert in self.perturbations:
            chosen = match_points(points, [pert.site], what="perturb")
            if not chosen and not _exists_in_model(pert.site, self.chunks[0].config):
                raise MegatronConfigError(
                    f"perturb(site={pert.site!r}) matches no probe point of this model; names look like "
                    "'blocks.3.hook_resid_post' or 'blocks.*.attn.W_QKV' (or a group: storage, calculation, system)."
                )
            bad = [p.name for p in chosen if not p.perturbable]
            if bad:
                perturbable = sorted({p.name.split(".", 2)[-1] for p in points if p.perturbable})
                raise MegatronConfigError(
                    f"perturb(site={pert.site!r}): {bad[:3]} cannot be perturbed; perturbable sites are "
                    f"blocks.L.{{{', '.join(perturbable)}}} and hook_embed (or a group: storage, calculation, system)."
                )
            if (pert.experts is not None or pert.kind == "disable") and not all(
                p.name.endswith(_ROUTER_LOGITS) for p in chosen
            ):
                what = "experts=[...]" if pert.experts is not None else "kind='disable'"
                raise MegatronConfigError(
                    f"perturb({what}) needs router-logit sites (blocks.L.{_ROUTER_LOGITS}), not {pert.site!r}."
                )
            if pert.heads is not None and any(p.num_heads is None for p in chosen):
                raise MegatronConfigError(
                    f"perturb(heads=...) needs sites with heads (attn.hook_q/k/v/z), not {pert.site!r}."
                )
            wrong = out_of_range(pert, self.chunks[0].config)
            if wrong is not None:
                raise MegatronConfigError(f"perturb({wrong[0].split('/')[0]}=...): {wrong[1]}.")
            for point in chosen:
                if pert.layers is None or point.layer in pert.layers:
                    self.targets.append((pert, point))
        self._handles: list[Any] = []
        self._noise: dict[tuple, torch.Tensor] = {}
        self._noise_step: Optional[int] = None

    # -- hooks -------------------------------------------------------------------------------------------
    def attach(self) -> None:
        self.tap.acquire()
        for pert, point in self.targets:
            if point.is_weight:
                self._attach_weight(pert, point)
            elif point.when == "pre":
                self._handles.append(
                    point.module.register_forward_pre_hook(self._pre_hook(pert, point), with_kwargs=True, prepend=True)
                )
            else:
                self._handles.append(
                    point.module.register_forward_hook(self._post_hook(pert, point), with_kwargs=True, prepend=True)
                )

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for _, point in self.targets:
            if point.is_weight:
                point.module.__dict__.pop("weight", None)
        self._noise.clear()
        self.tap.release()

    def _pre_hook(self, pert: Perturbation, point: ProbePoint):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            x = point.read(args, kwargs, None)
            return point.write(args, kwargs, None, self._perturbed(pert, point, x))  # type: ignore[misc]

        return hook

    def _post_hook(self, pert: Perturbation, point: ProbePoint):  # noqa: ANN202
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            x = output[0] if isinstance(output, tuple) else output
            return point.write(args, kwargs, output, self._perturbed(pert, point, x))  # type: ignore[misc]

        return hook

    def _attach_weight(self, pert: Perturbation, point: ProbePoint) -> None:
        module = point.module
        if getattr(module, "gradient_accumulation_fusion", False):
            raise MegatronConfigError(
                f"perturb({point.name}): weight noise needs gradient_accumulation_fusion=False (the fused wgrad "
                "kernel writes to weight.main_grad directly)."
            )

        def swap_in(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            weight = module._parameters["weight"]
            noise = self._noise_for(pert, point, tuple(weight.shape), weight.device, positions=None)
            module.__dict__["weight"] = _apply(pert, weight, noise, None)

        def swap_out(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            module.__dict__.pop("weight", None)

        self._handles.append(module.register_forward_pre_hook(swap_in, with_kwargs=True, prepend=True))
        self._handles.append(module.register_forward_hook(swap_out, with_kwargs=True, always_call=True))

    # -- noise ---------------------------------------------------------------------------------------------
    def _perturbed(self, pert: Perturbation, point: ProbePoint, x: torch.Tensor) -> torch.Tensor:
        layout = point.layout
        extent = x.shape[layout.seq_dim] if layout.seq_dim is not None else 0
        positions = self.tap.positions_for_seq(extent, layout.sequence_parallel_split)
        noise = self._noise_for(pert, point, tuple(x.shape), x.device, positions)
        if pert.heads is not None:
            mask = self._head_mask(pert, point, x)
        elif pert.experts is not None:
            mask = torch.zeros(x.shape[-1], dtype=torch.bool, device=x.device)  # the experts axis is whole
            mask[list(pert.experts)] = True
        else:
            mask = None
        return _apply(pert, x, noise, mask)

    def _noise_for(
        self,
        pert: Perturbation,
        point: ProbePoint,
        local_shape: tuple[int, ...],
        device: torch.device,
        positions: Optional[tuple[int, int]],
    ) -> dict[str, torch.Tensor]:
        """This rank's part of the full tensor's random draws: ``u`` uniform [0,1) (``n`` normal for gaussian,
        ``bit`` indices for bitflip), for the positions being computed."""
        state, facts, layout = self.tap.state, self.tap.facts, point.layout
        if self._noise_step != state.step:
            self._noise.clear()  # noise of earlier steps is never asked again
            self._noise_step = state.step
        full_shape = layout.full_shape(local_shape, facts.tp_size, facts.sequence_parallel)
        # weights: one draw per step; activations: per (data-parallel rank, microbatch) — each holds other samples
        microbatch = None if point.is_weight else (facts.dp_rank, state.microbatch)
        if positions is not None and layout.seq_dim is not None:
            # Draw for every position the model can see, so any window of positions gets the same values.
            full_shape[layout.seq_dim] = max(self.tap.max_positions, positions[1])
        key = (pert, state.step, microbatch, point.name, tuple(full_shape), str(device))
        draws = self._noise.get(key)
        if draws is None:
            draws = noise_draws(pert, point.name, full_shape, state.step, microbatch, device)
            if point.is_weight or not torch.is_grad_enabled():
                # kept for the step (weights: every microbatch) or the generation (every token); training
                # activations are drawn again when recomputed: the same seed gives the same values
                self._noise[key] = draws
        out = {}
        for name, full in draws.items():
            if positions is not None and layout.seq_dim is not None:
                full = full.narrow(layout.seq_dim, positions[0], positions[1] - positions[0])
                full = layout.context_part(full, facts.cp_rank, state.cp_size)
            out[name] = layout.local_part(full, facts.tp_rank, facts.tp_size, facts.sequence_parallel)
        return out

    def _head_mask(self, pert: Perturbation, point: ProbePoint, x: torch.Tensor) -> torch.Tensor:
        """1 on the targeted heads of this rank's shard, broadcastable to ``x``."""
        facts, heads = self.tap.facts, point.num_heads or 1
        full = torch.zeros(heads, dtype=torch.bool, device=x.device)
        chosen = [h for h in pert.heads or () if 0 <= h < heads]
        if len(chosen) != len(pert.heads or ()):
            raise MegatronConfigError(
                f"perturb(heads={list(pert.heads or ())}): {point.name} has heads 0..{heads - 1}."
            )
        full[chosen] = True
        local = full.chunk(facts.tp_size)[facts.tp_rank]
        shape = [1] * x.dim()
        if point.layout.heads is not None:  # heads folded into the last dim ([s, b, heads*d])
            local = local.repeat_interleave(x.shape[-1] // local.numel())
            shape[-1] = local.numel()
        else:
            shape[point.head_dim] = local.numel()  # type: ignore[index]
        return local.view(shape)


class _StraightThrough(torch.autograd.Function):
    """Forward: ``replacement`` exactly (``x + (r - x).detach()`` would round); backward: the gradient of x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, replacement: torch.Tensor) -> torch.Tensor:
        return replacement

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def noise_draws(
    pert: Perturbation,
    name: str,
    full_shape: Sequence[int],
    step: int = 0,
    microbatch: Any = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """The random draws of ``pert`` at probe ``name`` for the *full* tensor (seq dim: every position the model
    can see): ``n`` standard normal (gaussian), else ``u`` uniform in [0, 1) and, for bit flips, ``bit``.
    ``microbatch`` is ``(data-parallel rank, microbatch)`` for activations and ``None`` for weights."""
    if pert.kind == "disable":
        return {}  # no randomness
    generator = torch.Generator(device=device).manual_seed(_seed_of(pert.seed, pert.kind, step, microbatch, name))
    shape = list(full_shape)
    if pert.kind == "gaussian":
        return {"n": torch.randn(shape, generator=generator, device=device)}
    draws = {"u": torch.rand(shape, generator=generator, device=device)}
    if pert.kind == "bitflip":
        # 0..63, taken modulo the dtype's width (8/16/32/64 all divide 64: still uniform)
        draws["bit"] = torch.randint(0, 64, shape, generator=generator, device=device)
    return draws


def _apply(
    pert: Perturbation, x: torch.Tensor, draws: Mapping[str, torch.Tensor], heads: Optional[torch.Tensor]
) -> torch.Tensor:
    s = pert.strength
    if pert.kind == "disable":  # ``heads``: the experts mask; masked_fill passes no gradient to the filled logits
        return x.masked_fill(heads, float("-inf"))  # type: ignore[arg-type]
    if pert.kind == "gaussian":
        noise = draws["n"].to(x.dtype) * s
        return x + (noise if heads is None else noise * heads)
    if pert.kind == "uniform":
        spread = (draws["u"] * 2 - 1) * s
        factor = 1 + (spread if heads is None else spread * heads)
        return x * factor.to(x.dtype)
    hit = draws["u"] < s
    if heads is not None:
        hit = hit & heads
    if pert.kind == "zero":
        return x * (~hit).to(x.dtype)
    if pert.kind == "stuck":
        return torch.where(hit, torch.full_like(x, pert.value), x)
    # bitflip: flip one uniformly chosen bit of the element's own representation; straight-through gradient.
    width = torch.finfo(x.dtype).bits if x.is_floating_point() else torch.iinfo(x.dtype).bits
    as_int = x.detach().contiguous().view(_INT_VIEWS[width])
    bit = draws["bit"] % width
    mask = torch.bitwise_left_shift(torch.ones_like(bit), bit).to(as_int.dtype) * hit.to(as_int.dtype)
    flipped = torch.bitwise_xor(as_int, mask).view(x.dtype)
    return _StraightThrough.apply(x, flipped)


@contextmanager
def perturb(
    model: Any,
    site: Optional[str] = None,
    kind: Kind = "gaussian",
    strength: float = 0.0,
    seed: int = 0,
    *,
    layers: Optional[Sequence[int]] = None,
    heads: Optional[Sequence[int]] = None,
    value: float = 0.0,
    experts: Optional[Sequence[int]] = None,
    perturbations: Sequence[Perturbation | Mapping[str, Any]] = (),
) -> Iterator[Perturber]:
    """Perturb ``site`` (and/or every item of ``perturbations``) while inside; see the module docstring.

    Every rank must enter it (each perturbs its own shard); nothing is communicated.
    """
    items = [p if isinstance(p, Perturbation) else Perturbation.from_dict(p) for p in perturbations]
    if site is not None:
        items.insert(
            0,
            Perturbation(
                site,
                kind,
                strength,
                seed,
                tuple(layers) if layers else None,
                tuple(heads) if heads else None,
                value,
                tuple(experts) if experts is not None else None,
            ),
        )
    if not items:
        raise MegatronConfigError("perturb(): name a site (or pass perturbations=[...]).")
    perturber = Perturber(model, items)
    perturber.attach()
    try:
        yield perturber
    finally:
        perturber.detach()
