"""Functions that run inside forked ranks for the MegaScope library tests (see ``distributed.py``)."""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import torch

from lightning_megatron.models import GPTModule
from lightning_megatron.models.loading import prepare
from lightning_megatron.scope import capture, perturb
from lightning_megatron.scope.perturb import Perturbation, noise_draws

GPT2_STYLE = dict(vocab_size=120, seq_length=16, num_layers=4, hidden_size=32, num_attention_heads=4)
LLAMA_STYLE = dict(
    GPT2_STYLE,
    num_query_groups=2,
    activation="swiglu",
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
)
BATCH, SEQ = 4, 12


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 120, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def build(world: int, model: dict[str, Any], **layout: Any) -> tuple[pl.Trainer, GPTModule]:
    """A GPTModule at a layout (split-invariant init: the same weights at every layout), chunks built."""
    module = GPTModule(**{**model, "init_method_std": 0.2})
    trainer = prepare(
        module, devices=world, accelerator="cpu", micro_batch_size=2, strategy_options={"timeout": 60}, **layout
    )
    return trainer, module


def batch_of(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"tokens": ids, "labels": torch.roll(ids, -1, dims=1)}


def captures_at_layout(
    world: int, model: dict[str, Any], names: Any = None, reducers: Any = None, **layout: Any
) -> Optional[dict]:
    """Forward a fixed batch through the pipeline schedule (2 microbatches) and capture ``names``."""
    trainer, module = build(world, model, **layout)
    with capture(module, names, reducers) as cache:
        trainer.strategy.forward_backward(batch_of(tokens()), forward_only=True)
    return {name: cache[name] for name in cache} if cache.is_server else None


def grads(module: GPTModule) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in module.named_parameters():
        grad = getattr(param, "main_grad", None)
        out[name] = (grad if grad is not None else param.grad).detach().clone()
    return out


def perturbed_gradients(
    world: int, model: dict[str, Any], pert: dict[str, Any], linears: str = "megatron", **layout: Any
) -> dict[str, Any]:
    """Gradients of the loss of one batch (plain autograd through the chunks) under ``perturb`` and under an
    explicit reference that adds the same draws by hand; the clean weights before and after. ``linears``: the
    layers' own backward (``"megatron"``), the strategy's B/W-split one (``"split"``: ``gradient_accumulation_fusion``,
    on by default with graphs) or its overlapped tensor-parallel layers (``"overlap"``: ``tp_comm_overlap``)."""
    trainer, module = build(world, model, **layout)
    chunk = module.model_chunks[0]
    if linears != "megatron":
        from lightning_megatron.layers.tp_overlap import TPCommOverlap
        from lightning_megatron.layers.wgrad import split_linears

        overlap = TPCommOverlap(chunks=2) if linears == "overlap" else None
        assert split_linears([chunk], overlap=overlap).modules, "no linear layer was split"
    ids = tokens(1)
    positions = torch.arange(SEQ).expand_as(ids)

    def loss_and_grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        logits = chunk(input_ids=ids, position_ids=positions, attention_mask=None)
        loss = logits.float().pow(2).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}

    state_before = {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    clean_loss, clean = loss_and_grads()
    with perturb(module, **pert):
        loss, perturbed = loss_and_grads()
        state_inside = {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
    spec = Perturbation(**pert)
    reference_loss, reference = _explicit_reference(module, chunk, spec, loss_and_grads)
    zero_loss, zero = None, None
    with perturb(module, **{**pert, "strength": 0.0}):
        zero_loss, zero = loss_and_grads()
    return {
        "clean_loss": clean_loss,
        "loss": loss,
        "reference_loss": reference_loss,
        "zero_loss": zero_loss,
        "clean": clean,
        "perturbed": perturbed,
        "reference": reference,
        "zero": zero,
        "params": sorted(n for n, p in module.named_parameters()),
        "state_unchanged": all(torch.equal(state_before[k], state_inside[k]) for k in state_before),
    }


def _explicit_reference(module: GPTModule, chunk: torch.nn.Module, spec: Perturbation, run: Any) -> Any:
    """The same perturbation written out by hand (gaussian only), independent of MegaScope's hooks: a plain
    forward hook adding the full-tensor draws (residual stream: replicated), or a weight edited in a copy."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    layer_index = int(spec.site.split(".")[1])
    layer = next(m for m in chunk.decoder.layers if int(m.layer_number) - 1 == layer_index)
    if spec.site.endswith("hook_resid_post"):
        full = noise_draws(
            spec, spec.site, [module.hparams.seq_length, BATCH, module.hparams.hidden_size], microbatch=(0, 0)
        )["n"]

        def add(mod: torch.nn.Module, args: Any, output: Any) -> Any:
            return (output[0] + spec.strength * full[: output[0].shape[0]], *output[1:])

        handle = layer.register_forward_hook(add)
        try:
            return run()
        finally:
            handle.remove()
    # attn.W_QKV: column-parallel, rows split by TP rank; attn.W_O: row-parallel, columns split
    column = spec.site.endswith("W_QKV")
    weight = (layer.self_attention.linear_qkv if column else layer.self_attention.linear_proj).weight
    split_dim = 0 if column else 1
    full_shape = list(weight.shape)
    full_shape[split_dim] *= tp
    draws = noise_draws(spec, spec.site, full_shape, microbatch=None)["n"]
    local = draws.chunk(tp, dim=split_dim)[tp_rank]
    clean = weight.detach().clone()
    loss, grads = None, None
    with torch.no_grad():
        weight.add_(spec.strength * local)
    try:
        loss, grads = run()
    finally:
        with torch.no_grad():
            weight.copy_(clean)
    return loss, grads


class ByteTokenizer:
    """Token id = byte value modulo the model's vocabulary (tests need no trained tokenizer)."""

    vocab_size = 120
    eod_id = 0

    def encode(self, text: str) -> list[int]:
        return [b % 120 for b in text.encode()]

    def decode(self, ids: Any) -> str:
        return "".join(chr(32 + i % 95) for i in ids)


def engine_events(
    world: int, model: dict[str, Any], request: dict[str, Any], perturbations: Any = (), **layout: Any
) -> Any:
    """Run one generation request through ``ScopeEngine`` at a layout (every rank in the command loop, the
    request on the serving rank as the server would give it); the serving rank returns the events."""
    import threading

    from lightning_megatron.scope import collect
    from lightning_megatron.scope.engine import ScopeEngine

    trainer, module = build(world, model, **layout)
    engine = ScopeEngine(module, ByteTokenizer())
    collect.scope_group()
    events: list[dict[str, Any]] = []
    if perturbations:
        engine.set_perturbations(perturbations)
    if not collect.is_distributed():
        engine.generate(request, events.append, lambda: False)
        return events
    if collect.rank() == 0:
        errors: list[BaseException] = []

        def serve() -> None:
            try:
                engine.generate(request, events.append, lambda: False)
            except BaseException as err:  # noqa: BLE001
                errors.append(err)
            finally:
                engine.shutdown()

        thread = threading.Thread(target=serve)
        thread.start()
        engine.run_command_loop(idle_seconds=0.2)
        thread.join()
        if errors:
            raise errors[0]
        return events
    engine.run_command_loop()
    return None


class _Client(pl.Callback):
    """Drives a live MegaScope server from inside the serving rank, as a browser would: once the fit starts,
    a real Socket.IO client connects with the token, sets a perturbation, steps the paused run twice, waits
    for those steps' events, then resumes it."""

    def __init__(self, scope: Any, perturbation: dict[str, Any]) -> None:
        self.scope = scope
        self.perturbation = perturbation
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.thread: Any = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import threading

        if trainer.is_global_zero:
            self.thread = threading.Thread(target=self._drive, daemon=True)
            self.thread.start()

    def _drive(self) -> None:
        from lightning_megatron.scope.client import ScopeClient
        from lightning_megatron.scope.protocol import ProtocolError, validate_event

        def read_until(client: ScopeClient, predicate: Any, timeout: float) -> bool:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    event = client.next_event(max(0.01, deadline - time.monotonic()))
                except TimeoutError:
                    break
                try:
                    validate_event(event)  # what the server sent is what the schema promises
                except ProtocolError as err:
                    self.errors.append(f"{event.get('type')}: {err}")
                self.events.append(event)
                if predicate(event):
                    return True
            return False

        def train_step(step: int) -> Any:
            return lambda e: e.get("type") == "train_step" and e.get("step") == step

        with ScopeClient(self.scope.server.url, decode=False) as client:
            client.send(
                {"type": "set_perturbations", "id": "p1", "perturbations": [{**self.perturbation, "enabled": True}]}
            )
            client.send({"type": "train", "id": "s1", "action": "step", "steps": 2})
            if not read_until(client, train_step(1), 60):
                self.errors.append("no train_step 1")
            read_until(client, lambda e: False, 0.5)  # paused after two steps: nothing more may come
            self.steps_while_paused = sorted({e["step"] for e in self.events if e.get("type") == "train_step"})
            client.send({"type": "train", "id": "r1", "action": "resume"})
            if not read_until(client, train_step(3), 60):
                self.errors.append("no train_step 3")


def fit_with_scope(world: int, model: dict[str, Any], perturbation: dict[str, Any], **layout: Any) -> dict[str, Any]:
    """Four training steps followed (and driven) by a live MegaScope server and client."""
    from cases import fit_gpt

    from lightning_megatron.scope.callback import MegaScope

    records: list[tuple[int, list[str]]] = []
    scope = MegaScope(
        probes=[{"name": "blocks.*.hook_resid_post", "reduce": [{"kind": "mean", "axis": -1}]}],
        interval=1,
        start_paused=True,
        on_step=lambda step, recs, metrics: records.append((step, sorted({r.name for r in recs}))),
        command_timeout=0.2,
    )
    client = _Client(scope, perturbation)
    logged: list[dict[str, float]] = []

    class Metrics(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            logged.append({k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("scope/")})

    result = fit_gpt(world, model=model, steps=4, callbacks=[scope, client, Metrics()], **layout)
    if client.thread is not None:
        client.thread.join(timeout=30)
    out = {"loss": result["loss"], "logged": logged, "history": scope.history, "records": records}
    if client.thread is not None:
        out.update(
            events=[{k: v for k, v in e.items() if k != "data"} for e in client.events],
            errors=client.errors,
            steps_while_paused=getattr(client, "steps_while_paused", None),
            server_stopped=scope.server is None,
        )
    return out


def perturbation_statistics(world: int, model: dict[str, Any], **layout: Any) -> Optional[dict[str, Any]]:
    """For each kind, the perturbed tensor at its own site against the clean one (captured there), and whether
    leaving the context restores the outputs bit for bit."""
    trainer, module = build(world, model, **layout)
    site = "blocks.1.hook_resid_post"
    settings = {"gaussian": 0.3, "uniform": 0.2, "bitflip": 0.05, "zero": 0.25, "stuck": 0.25}

    def run() -> Any:
        with capture(module, [site, "hook_logits"]) as cache:
            trainer.strategy.forward_backward(batch_of(tokens()), forward_only=True)
        return cache

    clean = run()
    out: dict[str, Any] = {}
    for kind, strength in settings.items():
        with perturb(module, site, kind, strength, seed=11, value=7.0):
            noisy = run()
        after = run()
        if clean.is_server:
            out[kind] = {
                "clean": clean[site],
                "noisy": noisy[site],
                "restored": torch.equal(after["hook_logits"], clean["hook_logits"]),
            }
    return out if clean.is_server else None


def typo_errors(world: int, model: dict[str, Any], **layout: Any) -> list[str]:
    """What a mistyped probe name and a mistyped perturbation site get (on every rank, before any collective)."""
    _, module = build(world, model, **layout)
    messages = []
    for enter in (
        lambda: capture(module, ["blocks.1.hook_resid_pots"]),
        lambda: perturb(module, "blocks.9.hook_z", "zero", 1.0),
    ):
        try:
            with enter():
                pass
        except Exception as err:  # noqa: BLE001
            messages.append(f"{type(err).__name__}: {err}")
    return messages


def perturbation_held_during_training(world: int, steps: int, off_at: int, **layout: Any) -> dict[str, Any]:
    """A fit with MegaScope and a gaussian perturbation on ``calculation`` from the first step, switched off by a
    command before step ``off_at``: per step, how many activations the perturbation changed on this rank and by
    how much (a spy on the perturber's own function, which it still runs), and the step's logged metrics."""
    import lightning.pytorch as pl
    from cases import fit_gpt

    from lightning_megatron.scope.callback import MegaScope
    from lightning_megatron.scope.perturb import Perturber

    scope = MegaScope(
        interval=2,
        serve=False,
        perturbations=[{"site": "calculation", "kind": "gaussian", "strength": 1.0, "seed": 5}],
        command_timeout=0.2,
    )
    changed: dict[int, list[float]] = {}
    logged: dict[int, dict[str, float]] = {}
    original = Perturber._perturbed

    def spy(self: Any, pert: Any, point: Any, x: torch.Tensor) -> torch.Tensor:
        out = original(self, pert, point, x)
        if self.tap.state.phase == "forward" and torch.is_grad_enabled():  # the training forwards only
            changed.setdefault(self.tap.state.step, []).append(float((out - x).detach().abs().mean()))
        return out

    class Switch(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
            if trainer.global_step == off_at and trainer.is_global_zero:
                scope.set_perturbations([])  # as a client's set_perturbations: applied before this step

    class Metrics(pl.Callback):  # after MegaScope, which logs its metrics in on_train_batch_end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("scope/")}
            logged[trainer.global_step - 1] = metrics

    Perturber._perturbed = spy  # type: ignore[method-assign]
    try:
        fit_gpt(world, steps=steps, callbacks=[Switch(), scope, Metrics()], **layout)
    finally:
        Perturber._perturbed = original  # type: ignore[method-assign]
    return {"changed": changed, "logged": logged, "history": scope.history}


CP_SEQ = 16  # splits into 2 × CP2 × TP2 chunks (context parallelism with sequence parallelism)
CP_PERTURBATIONS = {
    "resid-gaussian": dict(site="blocks.1.hook_resid_post", kind="gaussian", strength=0.3, seed=5),
    "z-zero": dict(site="blocks.0.attn.hook_z", kind="zero", strength=0.2, seed=3),
    "k-head-gaussian": dict(site="blocks.0.attn.hook_k", kind="gaussian", strength=0.5, seed=2, heads=[1]),
    "weight-gaussian": dict(site="blocks.0.mlp.W_in", kind="gaussian", strength=0.05, seed=7),
}


def without_pattern(name: str) -> bool:
    return not name.endswith("hook_pattern")


def context_parallel_probes(world: int, model: dict[str, Any], **layout: Any) -> dict[str, Any]:
    """At a layout (context parallelism or one process): every capturable point but the attention pattern over a
    fixed batch, the loss under each of ``CP_PERTURBATIONS`` and without, what capturing ``hook_pattern`` in a
    training forward says (alone, and matched with other points), and a greedy generation's captures (whole sequences on every rank, pattern included)."""
    from lightning_megatron.errors import MegatronConfigError

    trainer, module = build(world, model, **layout)
    batch = batch_of(torch.randint(0, 120, (BATCH, CP_SEQ), generator=torch.Generator().manual_seed(3)))
    out: dict[str, Any] = {}
    with capture(module, without_pattern) as cache:
        out["clean_loss"] = float(trainer.strategy.forward_backward(batch, forward_only=True).loss)
    out["captures"] = {name: cache[name] for name in cache} if cache.is_server else None
    out["losses"] = {}
    for label, pert in CP_PERTURBATIONS.items():
        with perturb(module, **pert):
            out["losses"][label] = float(trainer.strategy.forward_backward(batch, forward_only=True).loss)
    try:
        with capture(module, ["blocks.0.attn.hook_pattern"]):
            pass
        out["refusal"] = "captured"
    except MegatronConfigError as err:
        out["refusal"] = str(err)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with capture(module, ["blocks.0.attn.*"]) as cache:
            trainer.strategy.forward_backward(batch, forward_only=True)
    out["attn"] = sorted(cache) if cache.is_server else None
    out["dropped"] = [str(w.message) for w in caught if "not capturing" in str(w.message)]
    names = ["blocks.1.hook_resid_post", "blocks.1.attn.hook_pattern", "hook_logits"]
    with capture(module, names, whole_sequences=True) as cache:
        module.generate([[3, 5, 7, 9, 11], [2, 4, 6, 8, 10]], 3, temperature=0, kv_cache=False)
    out["generated"] = {name: cache[name] for name in cache} if cache.is_server else None
    return out
