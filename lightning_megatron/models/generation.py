"""Autoregressive decoding of megatron-core GPT chunks at any parallel layout (TP, PP, virtual PP, SP).

The contract:

* **Same call on every rank.** Every rank of the job calls ``generate`` with the same prompts, limits,
  sampling settings and seed, and with its own model chunks (``module.model_chunks``: one per virtual
  pipeline stage, in virtual-stage order). All ranks of a model replica run one decode loop in
  lock-step and return the same ``Generation``; data-parallel replicas decode independently (and,
  given the same arguments, identically). Bad arguments raise ``MegatronConfigError`` on every rank
  before any communication.
* **Prompts of different lengths** go in one batch: the loop prefills every row up to the shortest
  prompt, then advances one position at a time; a row whose prompt is not finished takes its prompt's
  own token at that position instead of the sampled one. Each prompt gets up to ``max_new_tokens`` new
  tokens; a row ends early at ``eos_id`` (which it keeps), and the loop ends when every row has ended
  or an ``on_token`` callback asks it to stop.
* **One forward pass** runs every chunk of the pipeline forward-only: model stage ``v * P + p`` is
  virtual stage ``v`` of pipeline rank ``p``; activations ``[seq, batch, hidden]`` (in the config's
  ``pipeline_dtype``) go stage to stage with blocking send/recv on megatron-core's pipeline group; a
  non-first chunk gets its input through ``set_input_tensor``. Every chunk, on every stage, is called
  with keyword arguments ``input_ids``, ``position_ids`` (int64 ``[batch, seq]``: the absolute positions
  this forward computes), ``attention_mask=None`` and ``inference_context``, so forward pre-hooks on
  the chunks (MegaScope's capture) see which positions each forward computes.
* **Sampling** happens on the last pipeline stage: its chunk gathers the vocabulary-parallel logits over
  the tensor-parallel group (``runtime_gather_output``), ids ``>= vocab_size`` (vocabulary padding) are
  dropped, and ``sample_tokens`` applies temperature, top-k and top-p (``temperature=0``: greedy) with a
  ``torch.Generator`` seeded with ``seed``. Every tensor-parallel rank of that stage holds the same fp32
  logits and the same generator, so all draw the same tokens, and the same logits give the same tokens
  at every layout. The new tokens (int64 ``[batch]``) are broadcast from the last pipeline rank to the
  pipeline group.
* **KV cache** (default): megatron-core's ``StaticInferenceContext``. The prefill computes positions
  ``[0, shortest prompt)`` with causal attention; each later forward computes the one new position
  against the cached keys and values (megatron-core turns the causal mask off once
  ``sequence_len_offset > 0``, which is why every forward after the prefill is a single position).
  The context keeps only the last position's logits. ``kv_cache=False`` recomputes the whole context
  for every new token (same results up to floating-point rounding).
* **Sequence parallelism** splits the sequence dimension of activations across tensor-parallel ranks, so
  a one-position forward cannot be split. Under SP there is no KV cache: each new token recomputes the
  whole context, right-padded to a multiple of the tensor-parallel size, and the logits are read at the
  true last position (causal attention makes the padding invisible to the real positions; the padding's
  position ids continue the count, clamped to ``max_sequence_length - 1``). Cost: generating ``n``
  tokens after a prompt of ``m`` computes about ``n * (m + n / 2)`` positions instead of ``m + n``.
* **Callbacks and stopping.** ``on_token(step)`` runs on every rank after each new position with a
  ``GenerationStep`` (position, tokens, which rows are in their prompt or already ended, and the fp32
  logits on the last pipeline stage). It may return True to stop. The stop votes are combined with a
  one-element all-reduce (max) over the model-parallel group every position, so all ranks of a replica
  stop at the same position even if only some ranks pass a callback; the ``eos_id`` check is a pure
  function of the broadcast tokens. A callback that raises on some ranks only leaves the others waiting
  in the next collective (until the process group's timeout): raise on every rank or return True instead.
* The chunks run in eval mode under ``torch.no_grad()`` (an enclosing ``torch.inference_mode()`` works
  too); every submodule's training flag is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Literal, Optional, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.utils import unwrap_model

from lightning_megatron.errors import MegatronConfigError

__all__ = ["Generation", "GenerationStep", "OnToken", "Prompts", "generate", "sample_tokens"]

Prompts = Union[torch.Tensor, Sequence[Sequence[int]]]
"""A ``[batch, seq]`` tensor of token ids (prompts of equal length), or one list of token ids per prompt."""

StopReason = Literal["length", "eos", "callback"]


@dataclass(frozen=True)
class GenerationStep:
    """What ``on_token`` sees after each new position (the same on every rank, except ``logits``)."""

    position: int
    """Absolute position (0-based) of ``tokens`` in every row."""
    tokens: torch.Tensor
    """int64 ``[batch]``: each row's token at ``position``, sampled or (``in_prompt``) the prompt's own."""
    in_prompt: torch.Tensor
    """bool ``[batch]``: the row's prompt supplied this token; nothing was generated for it."""
    done: torch.Tensor
    """bool ``[batch]``: the row had already ended (``eos_id`` or its ``max_new_tokens``); its token here is
    not part of the output."""
    logits: Optional[torch.Tensor]
    """fp32 ``[batch, vocab_size]`` logits that predicted ``position`` (before temperature or filtering) on
    the last pipeline stage; ``None`` on other stages."""


OnToken = Callable[[GenerationStep], Optional[bool]]
"""``on_token(step) -> stop``: return True to stop generating (on every rank)."""


@dataclass(frozen=True)
class Generation:
    """The result of ``generate``: each prompt followed by its continuation."""

    tokens: list[list[int]]
    """Per prompt: the prompt's tokens, then the generated ones."""
    prompt_lengths: list[int]
    stop_reasons: list[StopReason]
    """Per prompt: why it ended: ``"length"`` (``max_new_tokens``), ``"eos"`` (produced ``eos_id``, kept as
    its last token) or ``"callback"`` (``on_token`` stopped generation while the row was still going)."""

    @property
    def continuations(self) -> list[list[int]]:
        """Per prompt: the generated tokens only."""
        return [row[n:] for row, n in zip(self.tokens, self.prompt_lengths)]

    def as_tensor(self, pad_id: Optional[int] = None, device: Optional[torch.device] = None) -> torch.Tensor:
        """``[batch, longest]`` int64; rows of different lengths need ``pad_id`` for their right padding."""
        longest = max(len(row) for row in self.tokens)
        if pad_id is None and any(len(row) != longest for row in self.tokens):
            raise ValueError("The rows have different lengths; pass pad_id to right-pad them into one tensor.")
        padded = [row + [pad_id] * (longest - len(row)) for row in self.tokens]
        return torch.tensor(padded, dtype=torch.long, device=device)


# -- sampling -------------------------------------------------------------------------------------
def sample_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One token per row of fp32 ``logits`` ``[batch, vocab]``: argmax if ``temperature == 0``, else a draw
    from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and then to the
    smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus). Ties keep the lower id."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits / temperature
    if not bool(torch.isfinite(scaled).all()):
        # A temperature so small that logits / temperature overflows (or is 0 in fp32), or logits that are not
        # finite (a perturbed model): divide the distances to the best logit in float64, NaN counted as
        # least likely, so the best token keeps probability > 0 and the others shrink towards 0.
        big = torch.finfo(torch.float64).max
        safe = logits.double().nan_to_num(nan=-big, posinf=big, neginf=-big)
        scaled = (safe - safe.max(dim=-1, keepdim=True).values) / temperature
    logits = scaled
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True, stable=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens
        cut = before >= top_p
        cut[..., 0] = False  # the most likely token is always kept (a top_p below fp32's smallest is 0 there)
        ordered = ordered.masked_fill(cut, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


# -- checks ---------------------------------------------------------------------------------------
def _prompt_rows(prompts: Prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.dtype.is_floating_point or prompts.dtype == torch.bool:
            raise MegatronConfigError(
                f"prompts: a tensor of prompts must be [batch, seq] integer token ids, got {prompts.dim()}-D "
                f"{prompts.dtype}; pass a list of token-id lists for prompts of different lengths."
            )
        rows = prompts.tolist()
    else:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise MegatronConfigError(
                f"prompts must be a [batch, seq] tensor or a list of token-id lists, got {type(prompts).__name__}; "
                "tokenize text first."
            )
        rows = []
        for i, row in enumerate(prompts):
            if isinstance(row, torch.Tensor):
                row = row.tolist()
            if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
                raise MegatronConfigError(
                    f"prompts[{i}] must be a list of token ids, got {type(row).__name__}; tokenize text first."
                )
            rows.append(list(row))
    rows = [[int(t) if isinstance(t, Integral) and not isinstance(t, bool) else t for t in row] for row in rows]
    if not rows:
        raise MegatronConfigError("prompts is empty: pass at least one prompt.")
    for i, row in enumerate(rows):
        if not row:
            raise MegatronConfigError(
                f"prompts[{i}] is empty: every prompt needs at least one token (e.g. a BOS/EOS token id)."
            )
        bad = [t for t in row if isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < vocab_size]
        if bad:
            raise MegatronConfigError(
                f"prompts[{i}] has token ids outside [0, vocab_size={vocab_size}): {bad[:5]}; "
                "tokenize with the model's tokenizer."
            )
    return rows


def _check_options(
    rows: list[list[int]],
    max_new_tokens: int,
    *,
    max_sequence_length: int,
    vocab_size: int,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    eos_id: Optional[int],
    seed: int,
) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise MegatronConfigError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}.")
    longest = max(len(row) for row in rows)
    if longest > max_sequence_length:
        index = max(range(len(rows)), key=lambda i: len(rows[i]))
        raise MegatronConfigError(
            f"prompts[{index}] has {longest} tokens, longer than the model's seq_length={max_sequence_length}; "
            "shorten the prompt (keep its last tokens)."
        )
    if longest + max_new_tokens > max_sequence_length:
        raise MegatronConfigError(
            f"max_new_tokens={max_new_tokens} is too large: the longest prompt has {longest} tokens and the model's "
            f"seq_length is {max_sequence_length}, so at most {max_sequence_length - longest} new tokens fit; lower "
            "max_new_tokens or shorten the prompts."
        )
    if not isinstance(temperature, (int, float)) or not 0 <= temperature < float("inf"):
        raise MegatronConfigError(f"temperature must be >= 0 (0 for greedy decoding), got {temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise MegatronConfigError(f"top_k must be a positive integer, or None/0 for no top-k filter, got {top_k!r}.")
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise MegatronConfigError(f"top_p must be in (0, 1] (1 for no nucleus filter), got {top_p!r}.")
    if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int) or not 0 <= eos_id < vocab_size):
        raise MegatronConfigError(f"eos_id must be None or a token id in [0, vocab_size={vocab_size}), got {eos_id!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise MegatronConfigError(f"seed must be an integer, got {seed!r}.")


# -- the pipeline ---------------------------------------------------------------------------------
class _Pipeline:
    """This rank's place in its model replica, read from megatron-core's parallel state."""

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        initialized = parallel_state.model_parallel_is_initialized()
        self.size = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
        self.tensor = parallel_state.get_tensor_model_parallel_world_size() if initialized else 1
        self.model_parallel = self.size * self.tensor
        config = chunks[0].config
        self.sequence_parallel = bool(config.sequence_parallel) and self.tensor > 1
        self.dtype = config.pipeline_dtype or config.params_dtype
        self.hidden = config.hidden_size
        self.is_last = bool(chunks[-1].post_process)
        if self.size > 1:
            self.group = parallel_state.get_pipeline_model_parallel_group()
            self.next_rank = parallel_state.get_pipeline_model_parallel_next_rank()
            self.prev_rank = parallel_state.get_pipeline_model_parallel_prev_rank()
            self.last_rank = parallel_state.get_pipeline_model_parallel_last_rank()

    def forward(
        self,
        chunks: Sequence[torch.nn.Module],
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        context: Optional[StaticInferenceContext],
    ) -> Optional[torch.Tensor]:
        """Run ``input_ids`` through every stage; the last stage's logits ``[batch, seq, padded vocab]``."""
        batch, seq = input_ids.shape
        local_seq = seq // self.tensor if self.sequence_parallel else seq
        output = None
        for chunk in chunks:
            received = None
            if not chunk.pre_process:
                received = torch.empty(local_seq, batch, self.hidden, dtype=self.dtype, device=input_ids.device)
                dist.recv(received, src=self.prev_rank, group=self.group)
            chunk.set_input_tensor(received)
            output = chunk(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=None,
                inference_context=context,
                runtime_gather_output=True,
            )
            if not chunk.post_process:
                dist.send(output.to(self.dtype).contiguous(), dst=self.next_rank, group=self.group)
        return output if self.is_last else None

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The last stage's tokens on every stage."""
        if self.size > 1:
            dist.broadcast(tokens, src=self.last_rank, group=self.group)
        return tokens

    def agree(self, stop: bool, device: torch.device) -> bool:
        """True on every rank of the replica if any rank votes to stop."""
        if self.model_parallel == 1:
            return stop
        vote = torch.tensor([int(stop)], dtype=torch.int32, device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=parallel_state.get_model_parallel_group())
        return bool(vote.item())


class _Decoder:
    """Forward passes over a growing batch of sequences: with the KV cache, or recomputing the context."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        pipeline: _Pipeline,
        tokens: torch.Tensor,
        kv_cache: bool,
        max_sequence_length: int,
        longest_prompt: int,
    ) -> None:
        self.chunks, self.pipeline, self.tokens = chunks, pipeline, tokens
        self.max_sequence_length, self.longest_prompt = max_sequence_length, longest_prompt
        batch, total = tokens.shape
        use_cache = kv_cache and not pipeline.sequence_parallel
        self.context = StaticInferenceContext(batch, total) if use_cache else None

    def logits(self, end: int) -> Optional[torch.Tensor]:
        """Logits (fp32, padded vocabulary) predicting position ``end`` from the tokens before it."""
        tokens = self.tokens
        device = tokens.device
        if self.context is not None:
            start = self.context.sequence_len_offset
            if start >= self.longest_prompt:  # every prompt is in the cache: only generated tokens from here
                self.context.enable_decode_mode()
            input_ids = tokens[:, start:end]
            positions = torch.arange(start, end, device=device)
            last = -1
        else:
            multiple = self.pipeline.tensor if self.pipeline.sequence_parallel else 1
            padded = -(-end // multiple) * multiple
            input_ids = torch.nn.functional.pad(tokens[:, :end], (0, padded - end))
            positions = torch.arange(padded, device=device).clamp(max=self.max_sequence_length - 1)
            last = end - 1
        position_ids = positions.unsqueeze(0).expand(tokens.shape[0], -1)
        output = self.pipeline.forward(self.chunks, input_ids.contiguous(), position_ids.contiguous(), self.context)
        if self.context is not None:
            self.context.increment_sequence_len_offset(end - self.context.sequence_len_offset)
        return None if output is None else output[:, last].float()


# -- generation -----------------------------------------------------------------------------------
@torch.no_grad()
def generate(
    chunks: Sequence[torch.nn.Module],
    prompts: Prompts,
    max_new_tokens: int,
    *,
    vocab_size: int,
    max_sequence_length: Optional[int] = None,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: Optional[int] = None,
    on_token: Optional[OnToken] = None,
    kv_cache: bool = True,
) -> Generation:
    """Continue each prompt by up to ``max_new_tokens`` tokens; call on every rank with the same arguments.

    Args:
        chunks: This rank's megatron-core ``GPTModel`` chunks in virtual-stage order (``module.model_chunks``;
            DDP/``Float16Module`` wrappers are looked through).
        prompts: A ``[batch, seq]`` tensor, or one list of token ids per prompt (lengths may differ).
        max_new_tokens: New tokens per prompt; the longest prompt plus this must fit ``max_sequence_length``.
        vocab_size: The real vocabulary size; padded vocabulary ids are never sampled.
        max_sequence_length: Longest sequence the model takes (default: the chunks' ``max_sequence_length``).
        temperature, top_k, top_p: Sampling (see ``sample_tokens``); ``temperature=0`` is greedy.
        seed: Seeds the sampling generator: the same seed and logits give the same tokens at every layout.
        eos_id: A row ends once it generates this token (kept as its last token).
        on_token: Called on every rank after each new position with a ``GenerationStep``; return True to
            stop (see the module docstring).
        kv_cache: Use megatron-core's static KV cache (ignored under sequence parallelism, which
            recomputes the context for every token); False recomputes the context for every token.
    """
    models = [unwrap_model(chunk) for chunk in chunks]
    if not models or not all(hasattr(m, "set_input_tensor") and hasattr(m, "post_process") for m in models):
        raise MegatronConfigError(
            "chunks must be this rank's megatron-core GPTModel chunks (module.model_chunks), one per virtual "
            "pipeline stage."
        )
    if max_sequence_length is None:
        max_sequence_length = int(models[0].max_sequence_length)
    rows = _prompt_rows(prompts, vocab_size)
    _check_options(
        rows,
        max_new_tokens,
        max_sequence_length=max_sequence_length,
        vocab_size=vocab_size,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        eos_id=eos_id,
        seed=seed,
    )
    lengths = [len(row) for row in rows]
    if max_new_tokens == 0:
        return Generation([list(row) for row in rows], lengths, ["length"] * len(rows))

    device = next(models[0].parameters()).device
    pipeline = _Pipeline(models)
    batch, shortest, total = len(rows), min(lengths), max(lengths) + max_new_tokens
    tokens = torch.zeros(batch, total, dtype=torch.long, device=device)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    prompt_lengths = torch.tensor(lengths, device=device)
    budget_end = prompt_lengths + max_new_tokens  # each row's length once its new tokens are done
    generator = None
    if temperature > 0 and pipeline.is_last:
        generator = torch.Generator(device=device).manual_seed(seed)

    modes = [(m, m.training) for chunk in models for m in chunk.modules()]
    for chunk in models:
        chunk.eval()
    decoder = _Decoder(models, pipeline, tokens, kv_cache, max_sequence_length, max(lengths))
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    ended = torch.tensor(lengths, device=device)  # each row's output length so far
    reasons: list[Optional[StopReason]] = [None] * batch
    try:
        logits = decoder.logits(shortest)
        for position in range(shortest, total):
            in_prompt = prompt_lengths > position
            sampled = torch.empty(batch, dtype=torch.long, device=device)
            if logits is not None:
                logits = logits[:, :vocab_size]
                sampled = sample_tokens(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            sampled = pipeline.share_tokens(sampled)
            step_tokens = torch.where(in_prompt, tokens[:, position], sampled)
            tokens[:, position] = step_tokens
            ended = torch.where(done, ended, ended.clamp(min=position + 1))  # a row keeps at least its prompt
            vote = False
            if on_token is not None:
                step = GenerationStep(position, step_tokens, in_prompt, done.clone(), logits)
                vote = bool(on_token(step))
            is_eos = ~in_prompt & (step_tokens == eos_id) if eos_id is not None else torch.zeros_like(done)
            out_of_budget = budget_end <= position + 1
            for i in torch.nonzero(~done & (is_eos | out_of_budget)).flatten().tolist():
                reasons[i] = "eos" if bool(is_eos[i]) else "length"
            done = done | is_eos | out_of_budget  # all done at the last position, total - 1, at the latest
            if pipeline.agree(vote, device) or bool(done.all()):
                break
            logits = decoder.logits(position + 1)
    finally:
        for chunk in models:
            chunk.set_input_tensor(None)
        for module, training in modes:
            module.training = training
    out = tokens.tolist()
    ends = ended.tolist()
    return Generation(
        tokens=[row[:end] for row, end in zip(out, ends)],
        prompt_lengths=lengths,
        stop_reasons=[reason or "callback" for reason in reasons],
    )
