"""The model side of ``scope serve``: generation with probes and perturbations, as protocol events.

Contract: every rank of the serving job builds one ``ScopeEngine`` over its model chunks. The serving rank
(global rank 0) hands validated requests to it (``generate``, ``set_perturbations``); with more than one
rank, every rank runs ``run_command_loop()`` in its main thread, and the serving rank's requests travel to
the others over MegaScope's private gloo group (``scope.collect``), so all ranks decode in lock-step. The
serving rank's ``emit`` receives the events of the protocol (``start``, ``token``, ``probe``,
``attention``, ``pca``, ``finish``) with tensors as ``torch.Tensor`` values; the server encodes them.

One generation:

* prompts are tokenized on the serving rank and sent as ids, so every rank decodes the same batch;
* the active perturbations (``set_perturbations``) apply for the whole generation (``scope.perturb``);
* after every new position a collective ``capture.flush()`` brings that position's probes to the serving
  rank, which emits the new token per prompt with its top alternatives (a softmax top-k of the logits),
  each requested probe sliced to the new positions and reduced (``scope.reducers``), and the requested
  attention rows;
* at the end, if asked, a PCA per layer of the residual stream over every position of every prompt.
"""

from __future__ import annotations

import fnmatch
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Optional

import torch

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scope import collect
from lightning_megatron.scope.capture import Capture, Record
from lightning_megatron.scope.perturb import KINDS, Perturbation, perturb, requested
from lightning_megatron.scope.protocol import Array
from lightning_megatron.scope.reducers import Reduced, apply_reducers, parse_reducers
from lightning_megatron.scope.sites import SITE_GROUPS, chunks_of, moe_facts, point_names_of

__all__ = ["DEFAULT_PROBES", "Limits", "ScopeEngine", "StreamedText", "pca_2d"]

Emit = Callable[[dict[str, Any]], None]
ATTENTION_ROWS = 64

DEFAULT_PROBES: tuple[dict[str, Any], ...] = (
    {"name": "blocks.*.hook_resid_post", "reduce": [{"kind": "downsample", "axis": -1, "bins": 64}]},
    {"name": "blocks.*.hook_attn_out", "reduce": [{"kind": "downsample", "axis": -1, "bins": 64}]},
    {"name": "blocks.*.hook_mlp_out", "reduce": [{"kind": "downsample", "axis": -1, "bins": 64}]},
)
"""What the UI shows unless told otherwise: three views of each layer's contribution, 64 bins wide."""


@dataclass(frozen=True)
class Limits:
    max_prompts: int = 8
    max_new_tokens: int = 1024
    max_probes: int = 64
    max_perturbations: int = 16


def pca_2d(points: torch.Tensor) -> torch.Tensor:
    """The first two principal components of ``points`` (``[n, features]``): ``[n, 2]`` coordinates."""
    x = points.float()
    x = x - x.mean(dim=0, keepdim=True)
    if x.shape[0] < 2:
        return torch.zeros(x.shape[0], 2)
    _, _, v = torch.linalg.svd(x, full_matrices=False)
    coords = x @ v[:2].T
    return torch.nn.functional.pad(coords, (0, 2 - coords.shape[1]))


class StreamedText:
    """One row's text token by token, as a reader sees it: each token's share of the row's decoded text.

    Decoding a byte-level token alone gives U+FFFD for a character whose UTF-8 bytes span several tokens, so a
    token's share is the text it adds to the decoding of the tokens before it: a token ending inside a character
    adds nothing, and the token that completes the character adds all of it. Decoding restarts a few tokens back
    (``prefix``), not from the row's start, so a long row costs the same per token; the text before the restart
    point is decoded with the new one, for tokenizers whose spacing depends on the previous token."""

    def __init__(self, decode: Callable[[list[int]], str], ids: Sequence[int] = ()) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.shares = [self.push(int(i)) for i in ids]
        """The prompt's tokens' shares (the ``start`` event's ``tokens``)."""

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        after = self.decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character: shown with the token that completes it
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]


class ScopeEngine:
    """Generation with probes and perturbations on every rank of a serving job; see the module docstring."""

    def __init__(self, module: Any, tokenizer: Any, *, limits: Limits = Limits(), eos_id: Optional[int] = None) -> None:
        self.module = module
        self.chunks = chunks_of(module)
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_id = eos_id
        self.perturbations: list[Perturbation] = []
        self.last_stats: dict[str, float] = {}
        """The last generation on this rank: ``seconds``, ``positions``, and ``scope_seconds`` spent in
        MegaScope's per-token work (bringing captures to the serving rank, building and emitting events)."""
        self.rank = collect.rank()
        self._commands: queue.Queue[Optional[tuple]] = queue.Queue()
        config = self.chunks[0].config
        hp = module.hparams
        self.num_layers = int(config.num_layers)
        self.info = {
            "mode": "generate",
            "model": {
                "num_layers": self.num_layers,
                "hidden_size": int(config.hidden_size),
                "num_heads": int(config.num_attention_heads),
                "num_query_groups": int(config.num_query_groups or config.num_attention_heads),
                "ffn_hidden_size": int(config.ffn_hidden_size),
                "vocab_size": int(hp.vocab_size),
                "max_seq_length": int(hp.seq_length),
                "layer_spec": str(hp.layer_spec),
                **moe_facts(config),
            },
            "layout": {
                "tensor": int(getattr(config, "tensor_model_parallel_size", 1)),
                "pipeline": int(getattr(config, "pipeline_model_parallel_size", 1)),
                "virtual_pipeline": int(getattr(config, "virtual_pipeline_model_parallel_size", None) or 1),
                "sequence_parallel": bool(config.sequence_parallel),
            },
            "probes": point_names_of(config),
            "default_probes": [dict(p) for p in DEFAULT_PROBES],
            "perturbation_kinds": list(KINDS),
            "perturbation_groups": {name: list(sites) for name, sites in SITE_GROUPS.items()},
            "limits": vars(limits),
        }

    # -- the Engine interface of scope.server --------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {**self.info, "perturbations": [p.to_dict() for p in self.perturbations]}

    def set_perturbations(self, perturbations: Sequence[Mapping[str, Any]]) -> None:
        self.perturbations = requested(perturbations, self.module, limit=self.limits.max_perturbations)

    def control(self, request: Mapping[str, Any]) -> None:
        raise MegatronConfigError(
            "this server serves generation; training controls need a run with the MegaScope callback."
        )

    def generate(self, request: Mapping[str, Any], emit: Emit, cancelled: Callable[[], bool]) -> None:
        if not collect.is_distributed():
            self._generate(self._prepare(request), emit, cancelled)
            return
        done = threading.Event()
        box: dict[str, Any] = {}
        self._commands.put(("generate", self._prepare(request), emit, cancelled, done, box))
        done.wait()
        if "error" in box:
            raise box["error"]

    # -- several ranks: everyone decodes what the serving rank was asked --------------------------------
    def run_command_loop(self, idle_seconds: float = 2.0) -> None:
        """Every rank, main thread: execute the serving rank's commands until ``shutdown()``. Idle rounds keep
        the other ranks' waits short (a broadcast every ``idle_seconds``), so no collective times out."""
        while True:
            local: Optional[tuple] = None
            if self.rank == 0:
                try:
                    local = self._commands.get(timeout=idle_seconds)
                except queue.Empty:
                    local = ("idle",)
            command = collect.broadcast_from(0, None if local is None else local[:2])
            if command is None or command[0] == "shutdown":
                return
            if command[0] != "generate":
                continue
            if self.rank == 0:
                assert local is not None
                _, request, emit, cancelled, done, box = local
                try:
                    self._generate(request, emit, cancelled)
                except BaseException as err:  # noqa: BLE001  (handed to the server's worker thread)
                    box["error"] = err
                finally:
                    done.set()
            else:
                self._generate(command[1], lambda event: None, lambda: False)

    def shutdown(self) -> None:
        """Serving rank: end ``run_command_loop`` on every rank."""
        self._commands.put(("shutdown",))

    # -- one generation --------------------------------------------------------------------------------------
    def _prepare(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Serving rank: tokenize and check against the model (the schema already checked the shapes)."""
        prompts = [self.tokenizer.encode(text) for text in request["prompts"]]
        if not prompts or len(prompts) > self.limits.max_prompts:
            raise MegatronConfigError(f"prompts: 1 to {self.limits.max_prompts} prompts per request.")
        if any(not ids for ids in prompts):
            raise MegatronConfigError("prompts: a prompt encodes to no tokens; type some text.")
        seq = self.info["model"]["max_seq_length"]
        longest = max(len(ids) for ids in prompts)
        if longest >= seq:
            raise MegatronConfigError(f"prompts: the longest prompt has {longest} tokens; the model sees {seq}.")
        max_new = min(int(request.get("max_new_tokens", 32)), seq - longest, self.limits.max_new_tokens)
        probes = list(request.get("probes", DEFAULT_PROBES))
        if len(probes) > self.limits.max_probes:
            raise MegatronConfigError(f"probes: at most {self.limits.max_probes}.")
        attention = request.get("attention") or {}
        for layer in attention.get("layers", []):
            if not 0 <= layer < self.num_layers:
                raise MegatronConfigError(
                    f"attention.layers: {layer} is not a layer of this model (0..{self.num_layers - 1})."
                )
        return {
            "id": request.get("id"),
            "prompts": prompts,
            "max_new_tokens": max_new,
            "temperature": float(request.get("temperature", 0.0)),
            "top_k": int(request.get("top_k", 0)) or None,
            "top_p": float(request.get("top_p", 1.0)),
            "seed": int(request.get("seed", 0)),
            "alternatives": int(request.get("alternatives", 5)),  # 0: none (and no logits capture)
            "probes": [{"name": p["name"], "reduce": list(p.get("reduce", []))} for p in probes],
            "attention": {"layers": list(attention.get("layers", [])), "heads": attention.get("heads")},
            "pca": bool(request.get("pca", False)),
            "perturbations": [p.to_dict() for p in self.perturbations],
        }

    def _generate(self, job: dict[str, Any], emit: Emit, cancelled: Callable[[], bool]) -> None:
        rid = job["id"]
        serving = self.rank == 0
        chains = [(p["name"], parse_reducers(p["reduce"])) for p in job["probes"]]
        layers = job["attention"]["layers"]
        whole = (["hook_logits"] if job["alternatives"] else []) + [
            f"blocks.{layer}.attn.hook_pattern" for layer in layers
        ]
        if job["pca"]:
            whole.append("blocks.*.hook_resid_post")
        # Probes are reduced by the capture (on the device, where possible) unless the engine needs the same
        # tensor whole (alternatives, attention rows, PCA): then the engine reduces a copy.
        needed = {n for n in self.info["probes"] if any(fnmatch.fnmatchcase(n, w) for w in whole)}
        by_capture = {
            name: chain for name, chain in chains if chain and not any(fnmatch.fnmatchcase(n, name) for n in needed)
        }
        names = [name for name, _ in chains] + whole
        heads = job["attention"]["heads"] if layers else None
        # nothing asked: no capture, no hooks at all
        # generation decodes whole sequences on every context-parallel rank (``context.whole_sequences``)
        session = Capture(self.module, names, by_capture, heads=heads, whole_sequences=True) if names else None
        rows = [StreamedText(self.tokenizer.decode, ids) for ids in job["prompts"]] if serving else []
        if serving:
            emit(
                {
                    "type": "start",
                    "id": rid,
                    "prompts": [
                        {"ids": torch.tensor(ids, dtype=torch.int32), "tokens": list(row.shares)}
                        for ids, row in zip(job["prompts"], rows)
                    ],
                    "num_layers": self.num_layers,
                    "perturbations": job["perturbations"],
                }
            )
        streamed = {"end": 0}
        stats = {"scope_seconds": 0.0, "seconds": 0.0, "positions": 0}
        started = time.perf_counter()
        residual: dict[int, list[torch.Tensor]] = {}

        def on_token(step: Any) -> bool:
            decided = time.time()
            begin = time.perf_counter()
            records = session.flush() if session is not None else []
            if serving:
                self._emit_position(
                    rid, step, decided, records, chains, by_capture, job, streamed["end"], emit, residual, rows
                )
            streamed["end"] = step.position
            stats["scope_seconds"] += time.perf_counter() - begin
            return serving and cancelled()

        perturbations = [Perturbation.from_dict(p) for p in job["perturbations"]]
        if session is not None:
            session.attach()
        try:
            with perturb(self.module, perturbations=perturbations) if perturbations else nullcontext():
                result = self.module.generate(
                    job["prompts"],
                    job["max_new_tokens"],
                    temperature=job["temperature"],
                    top_k=job["top_k"],
                    top_p=job["top_p"],
                    seed=job["seed"],
                    eos_id=self.eos_id,
                    on_token=on_token,
                )
        finally:
            if session is not None:
                session.detach()
            stats["seconds"] = time.perf_counter() - started
            stats["positions"] = streamed["end"]
            self.last_stats = stats
        if not serving:
            return
        if job["pca"]:
            for layer in sorted(residual):
                points = torch.cat(residual[layer], dim=1)  # [batch, positions, hidden]
                batch, positions = points.shape[:2]
                emit(
                    {
                        "type": "pca",
                        "id": rid,
                        "layer": layer,
                        "coords": pca_2d(points.reshape(batch * positions, -1)).reshape(batch, positions, 2),
                    }
                )
        emit(
            {
                "type": "finish",
                "id": rid,
                "texts": [self.tokenizer.decode(row) for row in result.tokens],
                "reasons": list(result.stop_reasons),
            }
        )

    def _emit_position(
        self,
        rid: Any,
        step: Any,
        decided: float,
        records: list[Record],
        chains: list[tuple[str, tuple]],
        by_capture: Mapping[str, Any],
        job: dict[str, Any],
        start: int,
        emit: Emit,
        residual: dict[int, list[torch.Tensor]],
        rows: list[StreamedText],
    ) -> None:
        """The token at ``step.position`` (first: it is what a reader waits for), then the new positions
        ``[start, step.position)`` of every record. A token's ``text`` is its share of its row's text
        (``StreamedText``)."""
        end = step.position
        alternatives, chosen = None, None
        # one device-to-host copy (and one wait) for the three per-row facts
        tokens, in_prompt, done = torch.stack([step.tokens, step.in_prompt.long(), step.done.long()]).tolist()
        logits = next((r for r in records if r.name == "hook_logits" and r.end > start), None)
        if logits is not None:
            last = _window(logits, start, end)[:, -1]  # the logits that predicted this position
            probs = last.float().softmax(dim=-1)
            chosen = probs.gather(1, torch.tensor(tokens).view(-1, 1)).view(-1).tolist()  # p of each row's token
            top = probs.topk(min(job["alternatives"], last.shape[-1]), dim=-1)
            alternatives = [
                [{"id": int(i), "text": self._text(int(i)), "p": float(p)} for p, i in zip(ps, ids)]
                for ps, ids in zip(top.values.tolist(), top.indices.tolist())
            ]
        emit(
            {
                "type": "token",
                "id": rid,
                "t": decided,  # when the token was decided: clients measure how long it took to arrive
                "position": end,
                "tokens": [
                    {"id": t, "text": self._share(rows[row], end, t, p, d), "in_prompt": bool(p), "done": bool(d)}
                    | ({} if chosen is None else {"p": chosen[row]})
                    for row, (t, p, d) in enumerate(zip(tokens, in_prompt, done))
                ],
                "alternatives": alternatives or [[] for _ in tokens],
            }
        )
        for record in records:
            if record.end <= start or record is logits:
                continue
            window = _window(record, start, end)
            if record.name.endswith("hook_pattern"):
                # probabilities in [0, 1] as uint8 codes, in events of at most 64 query rows: a long prompt's
                # prefill (896 × 896 × 16 heads) would otherwise be one 26 MB message that holds up the stream
                first = max(start, record.start)
                for row in range(0, window.shape[2], ATTENTION_ROWS):
                    rows = window[:, :, row : row + ATTENTION_ROWS]
                    emit(
                        {
                            "type": "attention",
                            "id": rid,
                            "layer": record.layer,
                            "start": first + row,
                            "end": first + row + rows.shape[2],
                            "heads": job["attention"]["heads"],
                            "data": Array(rows, "uint8", low=0.0, high=1.0),
                        }
                    )
            elif record.name.endswith("hook_resid_post") and job["pca"]:
                residual.setdefault(int(record.layer), []).append(window.float())
            for pattern, chain in chains:
                if fnmatch.fnmatchcase(record.name, pattern):
                    if pattern in by_capture:  # already reduced by the capture
                        reduced = Reduced(window, None if record.extra is None else _window_extra(record, start, end))
                    else:
                        reduced = apply_reducers(window, chain)
                    event = {
                        "type": "probe",
                        "id": rid,
                        "name": record.name,
                        "layer": record.layer,
                        "start": max(start, record.start),
                        "end": end,
                        "data": reduced.tensor,
                    }
                    if reduced.extra is not None:
                        event["extra"] = reduced.extra
                    emit(event)
                    break

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _share(self, row: StreamedText, position: int, token: int, in_prompt: Any, done: Any) -> str:
        """The text of ``token`` at ``position`` of ``row``: the prompt's share, a new token's share, or (an
        ended row's filler, shown nowhere) the token alone."""
        if in_prompt and position < len(row.shares):
            return row.shares[position]
        if done or position != len(row.ids):
            return self._text(token)
        return row.push(token)


def _window_extra(record: Record, start: int, end: int) -> torch.Tensor:
    return _window(Record(**{**vars(record), "tensor": record.extra}), start, end)


def _window(record: Record, start: int, end: int) -> torch.Tensor:
    """The positions ``[max(start, record.start), end)`` of a record (drops SP padding past ``end``)."""
    axis = record.pos_axis if record.pos_axis is not None else 1
    first = max(start, record.start) - record.start
    stop = min(end, record.end) - record.start
    window = record.tensor.narrow(axis, first, max(0, stop - first))
    if record.name.endswith("hook_pattern"):
        window = window[..., : min(end, window.shape[-1])]  # keys: drop SP padding too
    return window
