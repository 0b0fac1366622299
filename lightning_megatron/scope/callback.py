"""``MegaScope``: live probes and perturbations of a training run, from every pipeline stage.

Contract: a Lightning callback for ``MegatronAppStrategy`` runs. Every ``interval`` steps it captures
``window`` steps' probes (``scope.capture``: all pipeline stages, data-parallel rank 0, layout-invariant)
and hands them, with the step's loss and gradient norm, to the serving rank (global rank 0), which serves
them over MegaScope's protocol (``serve=True``: a ``ScopeServer`` on 127.0.0.1 with a token, started at
fit start, its URL printed) and to ``on_step`` if given. Clients may pause, resume or step the run and
change the perturbations: the serving rank collects those commands and broadcasts them at step boundaries
over the private gloo group, so every rank applies the same change before the same step. Perturbations
follow ``scope.perturb``'s rules (exact gradients, clean checkpoints). Under a perturbation the callback logs
``scope/perturbed`` and, on sampled steps, ``scope/clean_loss`` and ``scope/delta_loss`` (one extra
forward-only pass of the same batch without the perturbation) to the Trainer's logger.
"""

from __future__ import annotations

import fnmatch
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope import collect
from lightning_megatron.scope.capture import Capture, Record
from lightning_megatron.scope.perturb import KINDS, Perturbation, Perturber, requested
from lightning_megatron.scope.reducers import parse_reducers
from lightning_megatron.scope.sites import SITE_GROUPS, chunks_of, moe_facts, point_names_of

__all__ = ["DEFAULT_TRAINING_PROBES", "MegaScope"]

DEFAULT_TRAINING_PROBES: tuple[dict[str, Any], ...] = tuple(
    {"name": f"blocks.*.{site}", "reduce": [{"kind": "norm", "axis": -1}]}
    for site in ("hook_resid_post", "hook_attn_out", "hook_mlp_out")
)
"""Per token, the size of each layer's residual stream and of its attention and MLP contributions: the
signal of activation growth and outliers in training, reduced on the GPU to one number per token (a training
step's full activations are gigabytes)."""

_log = logging.getLogger(__name__)


def _model_facts(module: pl.LightningModule, config: Any) -> dict[str, Any]:
    """The model's shape as the UI's header shows it (what the hyperparameters do not say is left out)."""
    facts: dict[str, Any] = {
        "num_layers": int(config.num_layers),
        "hidden_size": int(config.hidden_size),
        "num_heads": int(config.num_attention_heads),
        **moe_facts(config),
    }
    hparams = getattr(module, "hparams", {})
    for name, key in (("seq_length", "max_seq_length"), ("vocab_size", "vocab_size")):
        if isinstance(hparams.get(name), int):
            facts[key] = hparams[name]
    return facts


def _layout_of(config: Any) -> dict[str, Any]:
    """Tensor × pipeline × data parallel sizes of the run (``info.engine.layout``)."""
    from megatron.core import parallel_state

    return {
        "tensor": int(getattr(config, "tensor_model_parallel_size", 1)),
        "pipeline": int(getattr(config, "pipeline_model_parallel_size", 1)),
        "virtual_pipeline": int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1),
        "data": int(parallel_state.get_data_parallel_world_size()) if parallel_state.is_initialized() else 1,
        "sequence_parallel": bool(config.sequence_parallel),
    }


class MegaScope(pl.Callback):
    """Stream probes of sampled training steps and take pause/resume/step/perturbation commands.

    Args:
        probes: ``[{"name": glob, "reduce": [reducer, ...]}, ...]`` (see ``scope.reducers``); default
            (``DEFAULT_TRAINING_PROBES``): the norm per token of every layer's residual stream, attention and
            MLP outputs.
        interval, window, start_step: Capture steps ``s >= start_step`` with
            ``(s - start_step) % interval < window`` (as ``MegaScan``).
        perturbations: Active from the first step (``Perturbation`` objects or mappings).
        serve: Start a ``ScopeServer`` on the serving rank (needs the ``scope`` extra).
        host, port: Where it listens (127.0.0.1 by default; port 0 picks a free one).
        start_paused: Wait for a client's ``resume`` or ``step`` before the first step.
        measure_clean_loss: Under a perturbation, also compute the unperturbed loss of sampled steps.
        on_step: Called on the serving rank with ``(step, records, metrics)`` after each sampled step.
        command_timeout: Seconds a paused run waits between heartbeats (every rank waits in a broadcast).
    """

    def __init__(
        self,
        probes: Optional[Sequence[Mapping[str, Any]]] = None,
        interval: int = 10,
        window: int = 1,
        start_step: int = 0,
        perturbations: Sequence[Any] = (),
        serve: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        start_paused: bool = False,
        measure_clean_loss: bool = True,
        on_step: Optional[Callable[[int, list[Record], dict[str, float]], None]] = None,
        command_timeout: float = 1.0,
    ) -> None:
        if window < 1 or interval < window or start_step < 0:
            raise MegatronConfigError(
                f"MegaScope(interval={interval}, window={window}, start_step={start_step}): need "
                "1 <= window <= interval and start_step >= 0."
            )
        self.probes = [
            {"name": p["name"], "reduce": list(p.get("reduce", []))} for p in (probes or DEFAULT_TRAINING_PROBES)
        ]
        self._chains = [(p["name"], parse_reducers(p["reduce"])) for p in self.probes]
        self.interval, self.window, self.start_step = interval, window, start_step
        self.perturbations = [p if isinstance(p, Perturbation) else Perturbation.from_dict(p) for p in perturbations]
        self.serve, self.host, self.port = serve, host, port
        self.start_paused = start_paused
        self.measure_clean_loss = measure_clean_loss
        self.on_step = on_step
        self.command_timeout = command_timeout
        self.server: Any = None
        self.history: list[dict[str, Any]] = []
        """Serving rank: the metrics of every sampled step (what ``train_step`` events carried)."""
        self._module: Any = None
        self._strategy: Any = None
        self._capture: Optional[Capture] = None
        self._perturber: Optional[Perturber] = None
        self._commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._paused = start_paused
        self._steps_left: Optional[int] = None
        self._info: dict[str, Any] = {}
        self._batch: Any = None
        self._clean_loss: Optional[float] = None

    # -- which steps ----------------------------------------------------------------------------------------
    def is_sampled(self, step: int) -> bool:
        return step >= self.start_step and (step - self.start_step) % self.interval < self.window

    # -- the Engine interface the server talks to (serving rank, server threads) --------------------------
    def describe(self) -> dict[str, Any]:
        return {
            **self._info,
            "paused": self._paused,
            "perturbations": [p.to_dict() for p in self.perturbations],
        }

    def generate(self, request: Mapping[str, Any], emit: Any, cancelled: Any) -> None:
        raise MegatronConfigError(
            "this server follows a training run; generation needs `lightning-megatron scope serve`."
        )

    def set_perturbations(self, perturbations: Sequence[Mapping[str, Any]]) -> None:
        parsed = requested(perturbations, self._module)  # a bad item fails now, in the client's request
        self._commands.put({"action": "perturb", "perturbations": [p.to_dict() for p in parsed]})

    def control(self, request: Mapping[str, Any]) -> None:
        action = request.get("action")
        if action not in ("pause", "resume", "step"):
            raise MegatronConfigError(f"train.action={action!r}: one of 'pause', 'resume', 'step'.")
        self._commands.put({"action": action, "steps": int(request.get("steps", 1))})

    # -- Lightning hooks (every rank) -------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_megatron.strategy import MegatronAppStrategy

        if stage != "fit":
            return
        if not isinstance(trainer.strategy, MegatronAppStrategy):
            raise MegatronConfigError(
                f"MegaScope follows MegatronAppStrategy runs; this Trainer uses {type(trainer.strategy).__name__}. "
                "Pass strategy=MegatronAppStrategy(...) (or strategy='megatron')."
            )
        self._strategy = trainer.strategy

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._module = pl_module
        collect.scope_group()  # collective: every rank is here
        config = chunks_of(pl_module)[0].config
        self._info = {
            "mode": "train",
            "model": _model_facts(pl_module, config),
            "layout": _layout_of(config),
            "probes": point_names_of(config),
            "sampled": {"interval": self.interval, "window": self.window, "start_step": self.start_step},
            "perturbation_kinds": list(KINDS),
            "perturbation_groups": {name: list(sites) for name, sites in SITE_GROUPS.items()},
        }
        self._apply_perturbations(self.perturbations)
        if self.serve and collect.rank() == 0:
            from lightning_megatron.scope.server import ScopeServer

            self.server = ScopeServer(self, host=self.host, port=self.port).start()
            print(f"MegaScope: following the run at {self.server.url}", flush=True)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._sync_commands()
        self._batch, self._clean_loss = None, None
        if self.is_sampled(trainer.global_step):
            self._capture = Capture(pl_module, [name for name, _ in self._chains], dict(self._chains))
            self._capture.attach()
            self._batch = batch

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """The unperturbed loss of a sampled step, with the weights the step's gradients were computed at."""
        if self._batch is None or self._perturber is None or not self.measure_clean_loss:
            return
        perturber, self._perturber = self._perturber, None
        perturber.detach()
        capture, self._capture = self._capture, None
        if capture is not None:
            capture.detach()
        try:
            self._clean_loss = float(trainer.strategy.forward_backward(self._batch, forward_only=True).loss)
        finally:
            perturber.attach()
            self._perturber = perturber
            if capture is not None:
                capture.attach()
                self._capture = capture

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step - 1  # the optimizer step just taken
        if self._capture is None:
            if self._perturber is not None:
                pl_module.log("scope/perturbed", 1.0, on_step=True, batch_size=1)
            return
        session, self._capture = self._capture, None
        session.detach()
        records = session.flush()
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k in ("train_loss", "grad_norm")}
        if self._perturber is not None:
            metrics["perturbed"] = 1.0
            if self._clean_loss is not None:
                metrics["clean_loss"] = self._clean_loss
                metrics["delta_loss"] = metrics.get("train_loss", float("nan")) - self._clean_loss
            for name in ("perturbed", "clean_loss", "delta_loss"):
                if name in metrics:
                    pl_module.log(f"scope/{name}", metrics[name], on_step=True, batch_size=1)
        if collect.rank() == 0:
            self._publish(step, records, metrics)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._capture is not None:
            self._capture.detach()
            self._capture = None
        if self._perturber is not None:
            self._perturber.detach()
            self._perturber = None
        if self.server is not None:
            self.server.stop()
            self.server = None

    # -- commands: decided on the serving rank, applied everywhere at the same step ----------------------
    def _sync_commands(self) -> None:
        """Every rank, before each step: apply the serving rank's commands; while paused, wait here (every
        rank waits in a broadcast that returns at least every ``command_timeout`` seconds)."""
        first = True
        while True:
            command = None
            if collect.rank() == 0:
                if first and self._steps_left is not None:
                    if self._steps_left == 0:
                        command = {"action": "pause"}  # the steps a client asked for are done
                    else:
                        self._steps_left -= 1
                first = False
                command = command or self._next_command()
            command = collect.broadcast_from(0, command)
            if command is not None:
                self._apply(command)
            elif not self._paused:
                return

    def _next_command(self) -> Optional[dict[str, Any]]:
        """Serving rank: the next queued command; while paused, wait for one (an idle round returns None)."""
        try:
            if self._paused:
                return self._commands.get(timeout=self.command_timeout)
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, command: dict[str, Any]) -> None:
        action = command["action"]
        if action == "perturb":
            self._apply_perturbations([Perturbation.from_dict(p) for p in command["perturbations"]])
        elif action == "pause":
            self._paused, self._steps_left = True, None
        elif action == "resume":
            self._paused, self._steps_left = False, None
        elif action == "step":
            self._paused, self._steps_left = False, int(command.get("steps", 1)) - 1  # this step is the first
        if collect.rank() == 0 and self.server is not None:
            self.server.publish(
                {
                    "type": "train_state",
                    "paused": self._paused,
                    "steps_left": self._steps_left,
                    "perturbations": [p.to_dict() for p in self.perturbations],
                }
            )

    def _apply_perturbations(self, perturbations: list[Perturbation]) -> None:
        if self._perturber is not None:
            self._perturber.detach()
            self._perturber = None
        self.perturbations = perturbations
        if perturbations:
            self._perturber = Perturber(self._module, perturbations)
            self._perturber.attach()

    # -- to clients ---------------------------------------------------------------------------------------
    def _publish(self, step: int, records: list[Record], metrics: dict[str, float]) -> None:
        summary = {"step": step, **metrics}
        self.history.append(summary)
        if self.on_step is not None:
            self.on_step(step, records, metrics)
        if self.server is None:
            return
        self.server.publish(
            {
                "type": "train_step",
                "step": step,
                "loss": metrics.get("train_loss"),
                "grad_norm": metrics.get("grad_norm"),
                "paused": self._paused,
                "perturbations": [p.to_dict() for p in self.perturbations],
                **{k: metrics[k] for k in ("clean_loss", "delta_loss") if k in metrics},
            }
        )
        for record in records:  # the capture applied each probe's reducers (on the GPU where it could)
            for pattern, _ in self._chains:
                if fnmatch.fnmatchcase(record.name, pattern):
                    reduced = record.tensor
                    self.server.publish(
                        {
                            "type": "probe",
                            "step": step,
                            "microbatch": record.microbatch,
                            "name": record.name,
                            "layer": record.layer,
                            "start": record.start,
                            "end": record.end,
                            "data": reduced.float() if isinstance(reduced, torch.Tensor) else reduced,
                        }
                    )
                    break

    def __getstate__(self) -> dict[str, Any]:  # the callback may be deep-copied by LightningCLI
        state = dict(self.__dict__)
        state["_commands"] = None
        state["server"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._commands = queue.Queue()
        self._lock = threading.Lock()
