"""A GPT language model: megatron-core's ``GPTModel`` as a LightningModule."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, Optional, Union

import torch
import torch.nn.functional as F
from lightning.pytorch.trainer.states import TrainerFn
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import unwrap_model
from typing_extensions import override

from lightning_megatron.compat import gloo_uneven
from lightning_megatron.compat import moe as moe_compat
from lightning_megatron.compat import rope as rope_compat
from lightning_megatron.context.whole_sequences import whole_sequences
from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.kernels.cross_entropy import vocab_parallel_cross_entropy
from lightning_megatron.models.generation import Generation, Prompts, generate
from lightning_megatron.models.init import init_split_invariant_
from lightning_megatron.models.module import MegatronLightningModule
from lightning_megatron.models.moe import (
    AuxLosses,
    MoETokenDispatcher,
    check_expert_layout,
    check_moe,
    forget_aux_losses,
    separate_expert_parameters,
)
from lightning_megatron.models.recompute import (
    RecomputeGranularity,
    RecomputeMethod,
    check_recompute,
    check_recompute_layout,
)
from lightning_megatron.models.specs import LayerSpecName, gpt_block_spec
from lightning_megatron.strategy.parallel import StageSpec
from lightning_megatron.strategy.step import LossFn

__all__ = ["GPTModule", "fused_kernel_fields", "gelu_tanh"]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's ``gelu_new``); a named function so configs stay picklable."""
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": gelu_tanh, "swiglu": F.silu}


def _load_hf_checkpoint(chunks: torch.nn.ModuleList, hf_dir: str) -> None:
    """``convert.hf.load_hf_weights_``. Imported here, not at the top: ``convert.hf`` imports ``models.sharding``,
    which runs this package's ``__init__`` (and so this module) first. ``convert.hf`` never imports this module."""
    from lightning_megatron.convert.hf import load_hf_weights_

    load_hf_weights_(chunks, hf_dir)


def fused_kernel_fields(activation: str, add_bias_linear: bool, position_embedding_type: str = "") -> dict[str, Any]:
    """TransformerConfig fields that switch on megatron-core's fused GPU kernels where the math is unchanged.

    The fused bias-GeLU computes the tanh approximation (and is selected by ``F.gelu``), so it serves
    ``gelu_tanh`` only; the erf GeLU stays unfused. RoPE fusion is ``kernels.rope`` where Transformer Engine is
    absent (``compat.rope``).
    """
    fused: dict[str, Any] = {"cross_entropy_loss_fusion": True, "cross_entropy_fusion_impl": "native"}
    if activation == "gelu_tanh" and add_bias_linear:
        fused.update(bias_activation_fusion=True, activation_func=F.gelu)
    elif activation == "swiglu":
        fused.update(bias_activation_fusion=True)
    if position_embedding_type == "rope":
        fused.update(apply_rope_fusion=True)
    return fused


class _GPTModel(GPTModel):
    """megatron-core's ``GPTModel``, whose language-model loss can be ``kernels.cross_entropy`` (``GPTModule``'s
    ``fused_cross_entropy``); everything else, checkpoints included, is the parent's."""

    single_pass_cross_entropy: bool = False

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not self.single_pass_cross_entropy:
            return super().compute_language_model_loss(labels, logits)
        loss = vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), self.pg_collection.tp)
        return loss.transpose(0, 1).contiguous()  # [s, b] -> [b, s], as the parent returns it


class GPTModule(MegatronLightningModule):
    """Decoder-only transformer trained on next-token prediction.

    Batches are dicts with ``tokens`` and ``labels`` (``[batch, seq]`` int64) and optionally
    ``loss_mask`` (which label positions count) and ``position_ids``.

    Args:
        vocab_size: Tokenizer vocabulary size. The embedding is padded up to a multiple of
            ``make_vocab_size_divisible_by`` (the same padding at every tensor-parallel size).
        seq_length: Longest sequence the model sees (size of the learned position table).
        num_layers, hidden_size, num_attention_heads, ffn_hidden_size, num_query_groups: Shape
            (``ffn_hidden_size`` defaults to 4 × hidden; ``num_query_groups`` < heads is GQA).
        position_embedding_type: ``"learned_absolute"`` (GPT-2) or ``"rope"`` (Llama).
        normalization, activation, add_bias_linear: ``LayerNorm``/``gelu``/biases is GPT-2 (whose
            Hugging Face weights use ``gelu_tanh``); ``RMSNorm``/``swiglu``/no biases is Llama.
        add_qkv_bias: A bias on the fused query/key/value projection even when ``add_bias_linear=False``
            (megatron-core's field; Qwen2 and Qwen2-MoE have biases there and nowhere else). Split over
            tensor-parallel ranks with the projection's rows; initialized to zeros like every bias.
        qk_layernorm: A norm over each attention head's query and key, after the projection and before RoPE
            (megatron-core's field; Qwen3's ``q_norm``/``k_norm``): the model's ``normalization`` and
            ``layernorm_epsilon``, one ``[head_dim]`` weight shared by all heads, whole on every tensor-parallel
            rank (its gradient summed over them); initialized to ones like every norm.
        kv_channels: Width of one attention head (default ``hidden_size // num_attention_heads``).
        layernorm_epsilon: Epsilon of every LayerNorm/RMSNorm (Llama checkpoints use 1e-5 or 1e-6).
        rotary_base: RoPE base (``rope_theta``), used with ``position_embedding_type="rope"``.
        mask_padded_vocab: Give the padding rows of the vocabulary (ids >= ``vocab_size``) zero
            probability in the loss, so the loss equals one over the real vocabulary only (what a
            converted checkpoint needs to reproduce its original loss). Off by default: the padded
            rows then take part in the softmax, as in Megatron-LM.
        hf_checkpoint: A local Hugging Face checkpoint directory (``config.json`` + safetensors) whose
            weights ``configure_model`` loads instead of initializing; build the other arguments with
            ``lightning_megatron.convert.hf_config_to_gpt_kwargs``.
        layer_spec: Which implementation of the transformer layer to use (see ``models.specs``).
        fuse_kernels: On GPUs, fused kernels compiled by ``torch.compile`` on first use: megatron-core's
            bias+activation (``gelu_tanh`` with biases, ``swiglu``), the cross-entropy (see
            ``fused_cross_entropy``) and, with RoPE, the rotary embedding (``kernels.rope``, where Transformer
            Engine is absent). Same math as the unfused path; ``activation="gelu"`` (erf) stays unfused, since
            megatron-core's fused GeLU is the tanh approximation. Ignored on CPUs, where compiling costs more than
            it saves.
        fused_cross_entropy: The loss through ``kernels.cross_entropy``, which reads the logits once forward and
            once backward and keeps no fp32 copy of them (megatron-core's fused one keeps the exp of every logit
            in fp32). ``None`` (default): wherever ``fuse_kernels`` applies (GPUs); ``True``: also on CPUs (same
            arithmetic, eager); ``False``: megatron-core's.
        fused_norms: LayerNorm/RMSNorm through ``lightning_megatron.kernels.norms``: on GPUs Triton kernels whose
            backward reads the input and its gradient once for the input, weight and bias gradients (ATen's
            reads them twice); the same function within bf16 rounding. On CPUs the same arithmetic as torch
            ops (no speed-up). Local/sdpa specs only. ``None`` (default), for this and the next two: on where
            the strategy replays the training step as a CUDA graph (by default on one node with PP 1), where the
            three together are faster, and with pipeline stages (PP > 1, eager by design, GPU-bound at the sizes
            people pipeline); off in other eager steps, where their launches cost more host time than they save
            (the measurements: docs/evaluation/throughput.md).
        fused_bias_grad: The bias gradients of the qkv and fc1 linears and of the two bias-dropout-adds through
            ``lightning_megatron.kernels.bias`` (a single-pass column sum; for fc1 with the fused tanh GeLU,
            summed inside the GeLU backward kernel). Bias-dropout-adds with dropout > 0 keep megatron-core's.
            Local/sdpa specs only.
        fused_residual_norm: With ``fused_norms``: each bias-dropout-add (at dropout 0) and the norm after it
            (the pre-MLP norm; the next layer's input norm or the final norm) as one op
            (``kernels.norms.residual_norm``): the forward writes the residual sum and the normalized output in
            one pass; the backward adds the residual gradient, and sums the bias gradient, inside the norm's
            backward kernel.
        recompute_granularity, recompute_method, recompute_num_layers: Activation recomputation, megatron-core's
            fields (``models.recompute``; docs/guides/performance.md). ``"full"`` keeps only the input of each
            checkpointed group of layers and runs the group's forward again in the backward (about one more
            forward per step, for most of the layers' activation memory); it needs ``recompute_method``:
            ``"uniform"`` checkpoints every group of ``recompute_num_layers`` layers of each pipeline stage (or
            virtual stage), ``"block"`` the first ``recompute_num_layers`` layers of each and keeps the rest.
            ``"selective"`` (no method, no count) recomputes core attention only, which saves the
            ``[seq, seq]`` attention matrix of ``layer_spec="local"``; under ``"sdpa"`` it saves almost nothing
            (a warning). ``None`` (default): keep every activation.
        num_moe_experts: Experts of each MoE layer (megatron-core's ``MoELayer``: a top-k router, a token
            dispatcher, the experts; ``models.moe``, docs/guides/moe.md). ``None`` (default): dense MLPs.
        moe_router_topk: Experts each token goes to (Mixtral: 2).
        moe_ffn_hidden_size: Hidden width of one expert (default ``ffn_hidden_size``).
        moe_aux_loss_coeff: Weight of the router's load-balancing loss (added to the gradient inside the layer and
            logged as ``moe/load_balancing_loss``, the mean over MoE layers and microbatches); 0 turns it off.
        moe_token_dispatcher_type: How tokens reach experts on other expert-parallel ranks: ``"alltoall"`` (default;
            each rank sends each expert only its tokens) or ``"allgather"`` (every rank gathers all tokens).
        moe_layer_freq: Which layers are MoE layers: every N-th (``1``: all; ``2``: layers 0, 2, ...) or a list of
            0/1, one per layer.
        moe_grouped_gemm: Run each rank's experts as two grouped GEMMs (``torch._grouped_mm``, bf16;
            ``layers.grouped_experts``) instead of two GEMMs per expert in turn (megatron-core's ``SequentialMLP``,
            the default). The same parameters and checkpoints. Off by default until measured on GPUs. MoE layers
            need ``add_bias_linear=False`` (a megatron-core 0.16.1 bug with expert biases) and, when training at
            TP > 1, ``sequence_parallel=True``.
        moe_shared_expert_intermediate_size: Hidden width of the shared experts, an MLP every token goes through
            beside its routed experts (DeepSeek-MoE, Qwen-MoE; all shared experts together: 2 of width 1408 are
            2816). Not split over expert-parallel ranks: it is a dense MLP (split over TP). ``None``: none.
        moe_shared_expert_gate: Scale the shared experts' output by a learned sigmoid gate per token (Qwen-MoE).
        moe_router_pre_softmax: Route as Qwen-MoE with ``norm_topk_prob=False`` does: softmax over all experts, then
            the top k of those probabilities, not renormalized. ``False`` (default; Mixtral): top k of the logits,
            softmax over the k (the same experts, weights that sum to 1).
        transformer_config_overrides: Extra megatron-core ``TransformerConfig`` fields (for example
            ``{"recompute_modules": ["core_attn", "mlp"]}``), applied last; unknown names are an error, and so
            are the three recompute fields above (pass them as arguments).
        split_invariant_init: Initialize so every parallel layout starts from the same weights.
        lr, min_lr, warmup_steps, weight_decay, betas, eps: AdamW with linear warmup and cosine
            decay to ``min_lr`` at ``trainer.max_steps``; no weight decay on biases and norms.
    """

    graph_safe_forward_step = True  # forward_step and its loss only queue GPU work (tests/test_graphs_gpu.py)

    def __init__(
        self,
        vocab_size: int = 256,
        seq_length: int = 64,
        num_layers: int = 4,
        hidden_size: int = 64,
        num_attention_heads: int = 4,
        ffn_hidden_size: Optional[int] = None,
        num_query_groups: Optional[int] = None,
        position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute",
        normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm",
        activation: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu",
        add_bias_linear: bool = True,
        add_qkv_bias: bool = False,
        qk_layernorm: bool = False,
        share_embeddings_and_output_weights: bool = False,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        init_method_std: float = 0.02,
        make_vocab_size_divisible_by: int = 128,
        kv_channels: Optional[int] = None,
        layernorm_epsilon: float = 1e-5,
        rotary_base: float = 10000.0,
        mask_padded_vocab: bool = False,
        hf_checkpoint: Optional[str] = None,
        layer_spec: LayerSpecName = "local",
        fuse_kernels: bool = True,
        fused_cross_entropy: Optional[bool] = None,
        fused_norms: Optional[bool] = None,
        fused_bias_grad: Optional[bool] = None,
        fused_residual_norm: Optional[bool] = None,
        recompute_granularity: Optional[RecomputeGranularity] = None,
        recompute_method: Optional[RecomputeMethod] = None,
        recompute_num_layers: Optional[int] = None,
        num_moe_experts: Optional[int] = None,
        moe_router_topk: int = 2,
        moe_ffn_hidden_size: Optional[int] = None,
        moe_aux_loss_coeff: float = 1e-2,
        moe_token_dispatcher_type: MoETokenDispatcher = "alltoall",
        moe_layer_freq: Union[int, list[int]] = 1,
        moe_grouped_gemm: bool = False,
        moe_shared_expert_intermediate_size: Optional[int] = None,
        moe_shared_expert_gate: bool = False,
        moe_router_pre_softmax: bool = False,
        transformer_config_overrides: Optional[dict[str, Any]] = None,
        split_invariant_init: bool = True,
        init_seed: int = 1234,
        lr: float = 3e-4,
        min_lr: float = 0.0,
        warmup_steps: int = 0,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Checked here, in the process that builds the module, before any rank starts; the layout's part later.
        for argument in ("add_qkv_bias", "qk_layernorm"):
            if argument in (transformer_config_overrides or {}):
                raise MegatronConfigError(
                    f"transformer_config_overrides sets {argument!r}, a GPTModule argument (export and the layer "
                    f"specs read it there): pass GPTModule({argument}=...) instead."
                )
        self._recompute = check_recompute(
            recompute_granularity,
            recompute_method,
            recompute_num_layers,
            total_layers=num_layers,
            layer_spec=layer_spec,
            overrides=transformer_config_overrides,
        )
        self._moe = check_moe(
            num_moe_experts,
            moe_router_topk=moe_router_topk,
            moe_ffn_hidden_size=moe_ffn_hidden_size,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_token_dispatcher_type=moe_token_dispatcher_type,
            moe_layer_freq=moe_layer_freq,
            moe_grouped_gemm=moe_grouped_gemm,
            add_bias_linear=add_bias_linear,
            moe_shared_expert_intermediate_size=moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=moe_shared_expert_gate,
            moe_router_pre_softmax=moe_router_pre_softmax,
            num_layers=num_layers,
            ffn_hidden_size=ffn_hidden_size or 4 * hidden_size,
            overrides=transformer_config_overrides,
        )
        if self._moe:
            # The dropless dispatcher reads each step's token counts per expert on the host: no CUDA graph.
            self.graph_safe_forward_step = False
        self._config: Optional[TransformerConfig] = None
        self._aux_losses: Optional[AuxLosses] = None

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.hparams.make_vocab_size_divisible_by
        return int(math.ceil(self.hparams.vocab_size / multiple) * multiple)

    def transformer_config(self) -> TransformerConfig:
        """One config shared by all chunks of this rank, with the strategy's parallel settings."""
        if self._config is None:
            hp = self.hparams
            self.parallel.layout.check_num_layers(hp.num_layers)
            layout = self.parallel.layout
            check_expert_layout(
                hp.num_moe_experts,
                layout.expert,
                tensor_parallel=layout.tensor,
                sequence_parallel=layout.sequence_parallel,
                training=self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING,
            )
            if self._moe and self.megatron.replays_cuda_graphs:
                raise MegatronConfigError(
                    "cuda_graphs=True with num_moe_experts: the MoE layer's dispatcher reads the tokens per expert on "
                    "the host every step, which a CUDA graph cannot replay. Leave cuda_graphs unset or False."
                )
            if self._moe and self.megatron.schedule.name == "fbd":
                raise MegatronConfigError(
                    "schedule='fbd' with num_moe_experts: MegaFBD rebuilds a stage's backward by replaying its forward "
                    "elsewhere, and a router picks experts from activations, so the replay would not match (and "
                    "forward and backward replicas would not meet in the experts' all-to-alls). Use '1f1b', 'dpp' "
                    "or 'zb-h1'."
                )
            if hp.make_vocab_size_divisible_by % self.parallel.layout.tensor:
                raise MegatronConfigError(
                    f"make_vocab_size_divisible_by={hp.make_vocab_size_divisible_by} must be a multiple of "
                    f"tensor_model_parallel_size={self.parallel.layout.tensor} so the padded vocabulary splits evenly."
                )
            if hp.activation not in _ACTIVATIONS:
                raise MegatronConfigError(f"activation={hp.activation!r} is not one of {sorted(_ACTIVATIONS)}.")
            swiglu = hp.activation == "swiglu"
            overrides = dict(hp.transformer_config_overrides or {})
            known = {field.name for field in dataclasses.fields(TransformerConfig)}
            unknown = sorted(set(overrides) - known)
            if unknown:
                raise MegatronConfigError(
                    f"transformer_config_overrides has keys that are not TransformerConfig fields: {unknown}; "
                    "see megatron.core.transformer.TransformerConfig for the names."
                )
            fields = dict(
                num_layers=hp.num_layers,
                hidden_size=hp.hidden_size,
                num_attention_heads=hp.num_attention_heads,
                num_query_groups=hp.num_query_groups,
                ffn_hidden_size=hp.ffn_hidden_size or 4 * hp.hidden_size,
                hidden_dropout=hp.hidden_dropout,
                attention_dropout=hp.attention_dropout,
                init_method_std=hp.init_method_std,
                normalization=hp.normalization,
                add_bias_linear=hp.add_bias_linear,
                add_qkv_bias=hp.add_qkv_bias,
                qk_layernorm=hp.qk_layernorm,
                gated_linear_unit=swiglu,
                activation_func=_ACTIVATIONS[hp.activation],
                kv_channels=hp.kv_channels,
                layernorm_epsilon=hp.layernorm_epsilon,
            )
            fused = fused_kernel_fields(hp.activation, hp.add_bias_linear, hp.position_embedding_type)
            fused = fused if hp.fuse_kernels else {}
            # One after the other (not as keywords of one call): an override may name a fused field, and wins.
            fields.update(self.parallel.config_kwargs())
            fields.update({} if self.parallel.on_cpu else fused)
            fields.update(self._recompute)
            fields.update(self._moe)
            fields.update(overrides)
            layout = self.parallel.layout
            where = "virtual pipeline stage" if layout.virtual_pipeline else "pipeline stage"
            check_recompute_layout(self._recompute, hp.num_layers // (layout.pipeline * layout.num_chunks), where)
            if fields.get("apply_rope_fusion"):
                rope_compat.install()
            if self._moe:
                moe_compat.install()
                forget_aux_losses()  # megatron-core's tracker is sized by the last MoE model this process built
                if self.parallel.on_cpu:
                    gloo_uneven.install()
            self._config = TransformerConfig(**fields)
        return self._config

    @override
    def build_chunk(self, stage: StageSpec) -> GPTModel:
        config = self.transformer_config()
        model = _GPTModel(
            config=config,
            transformer_layer_spec=gpt_block_spec(
                self.hparams.layer_spec,
                config,
                vp_stage=stage.vp_stage,
                grouped_experts=bool(self._moe) and self.hparams.moe_grouped_gemm,
                **self._fused_layer_kernels(),
            ),
            vocab_size=self.padded_vocab_size,
            max_sequence_length=self.hparams.seq_length,
            pre_process=stage.pre_process,
            post_process=stage.post_process,
            share_embeddings_and_output_weights=self.hparams.share_embeddings_and_output_weights,
            position_embedding_type=self.hparams.position_embedding_type,
            rotary_base=self.hparams.rotary_base,
            vp_stage=stage.vp_stage,
        )
        model.single_pass_cross_entropy = self._single_pass_cross_entropy()
        if self._moe:
            separate_expert_parameters(model)
        fused_residual_norm = self._fused_layer_kernels()["fused_residual_norm"] or self.hparams.layer_spec.endswith(
            "+fused"
        )
        # Not under full recomputation: most links would cross a checkpoint, where the norm cannot take the
        # hand-over (kernels.norms), and each layer's recompute would leave one for the next layer to keep.
        if fused_residual_norm and self._recompute.get("recompute_granularity") != "full":
            from lightning_megatron.kernels.layers import link_residual_norms

            link_residual_norms(model)  # each layer's MLP bias-dropout-add with the norm after it
        return model

    def _fused_layer_kernels(self) -> dict[str, bool]:
        """``fused_norms``, ``fused_bias_grad`` and ``fused_residual_norm``, each ``None`` resolved: on where the
        step is replayed as a CUDA graph or runs in pipeline stages (see the class docstring), with a local or sdpa
        spec."""
        auto = (
            self.hparams.layer_spec in ("local", "sdpa")
            and not self.parallel.on_cpu
            and (self.megatron.replays_cuda_graphs or self.parallel.layout.pipeline > 1)
        )
        names = ("fused_norms", "fused_bias_grad", "fused_residual_norm")
        chosen = {name: auto if self.hparams[name] is None else bool(self.hparams[name]) for name in names}
        if self.hparams.fused_residual_norm is None and not chosen["fused_norms"]:
            chosen["fused_residual_norm"] = False  # it needs fused norms; only an explicit request is an error
        return chosen

    def _single_pass_cross_entropy(self) -> bool:
        choice = self.hparams.fused_cross_entropy
        if choice is None:
            return self.hparams.fuse_kernels and not self.parallel.on_cpu
        return bool(choice)

    @override
    def configure_model(self) -> None:
        if getattr(self, "model_chunks", None) is not None:
            return
        super().configure_model()
        if self.hparams.hf_checkpoint is not None:
            _load_hf_checkpoint(self.model_chunks, self.hparams.hf_checkpoint)
        elif self.hparams.split_invariant_init:
            init_split_invariant_(
                self.model_chunks,
                seed=self.hparams.init_seed,
                std=self.hparams.init_method_std,
                num_layers=self.hparams.num_layers,
            )

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if not self._moe:
            return super().training_step(batch, batch_idx)
        if self._aux_losses is None:
            self._aux_losses = AuxLosses(self.transformer_config())
        self._aux_losses.clear()  # what validation's forwards left
        loss = super().training_step(batch, batch_idx)
        microbatches = len(batch["tokens"]) // self.megatron.micro_batch_size
        for name, value in self._aux_losses.take(microbatches, loss.device).items():
            self.log(f"moe/{name}", value, batch_size=1)
        return loss

    @override
    def forward_step(self, batch: dict[str, torch.Tensor], chunk: torch.nn.Module) -> tuple[torch.Tensor, LossFn]:
        tokens = batch["tokens"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        labels = batch["labels"]
        loss_mask = batch.get("loss_mask")
        if self.hparams.mask_padded_vocab and unwrap_model(chunk).post_process:
            # Logits out of the chunk; the loss function masks the padded vocabulary before the softmax.
            logits = chunk(input_ids=tokens, position_ids=position_ids, attention_mask=None)
            return logits, self._masked_vocab_loss_fn(labels, loss_mask)
        # Every stage gets the whole microbatch: the first uses the tokens, the last the labels.
        output = chunk(input_ids=tokens, position_ids=position_ids, attention_mask=None, labels=labels)
        return output, self._loss_fn(loss_mask)

    def _masked_vocab_loss_fn(self, labels: torch.Tensor, loss_mask: Optional[torch.Tensor]) -> LossFn:
        token_loss_fn = self._loss_fn(loss_mask)

        def loss_fn(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # logits: [batch, seq, padded_vocab / TP], this tensor-parallel rank's slice of the vocabulary.
            local = logits.shape[-1]
            start = parallel_state.get_tensor_model_parallel_rank() * local
            ids = torch.arange(start, start + local, device=logits.device)
            logits = logits.float().masked_fill(ids >= self.hparams.vocab_size, torch.finfo(torch.float32).min)
            return token_loss_fn(tensor_parallel.vocab_parallel_cross_entropy(logits, labels))

        return loss_fn

    @staticmethod
    def _loss_fn(loss_mask: Optional[torch.Tensor]) -> LossFn:
        def loss_fn(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if loss_mask is None:
                # new_full, not torch.tensor: no host-to-device copy, so a CUDA graph can capture it.
                count = per_token_loss.new_full((), per_token_loss.numel(), dtype=torch.long)
                return per_token_loss.float().sum(), count
            mask = loss_mask.to(per_token_loss.dtype)
            return (per_token_loss.float() * mask).sum(), mask.sum()

        return loss_fn

    def generate(self, prompts: Prompts, max_new_tokens: int, **options: Any) -> Generation:
        """Continue ``prompts`` (a ``[batch, seq]`` tensor or lists of token ids of any lengths) by up to
        ``max_new_tokens`` tokens each, at any parallel layout; call on every rank with the same arguments.

        ``options`` are ``models.generation.generate``'s: ``temperature`` (0: greedy), ``top_k``, ``top_p``,
        ``seed``, ``eos_id``, ``on_token`` (a per-position callback that may stop generation), ``kv_cache``.
        At ``context_parallel_size > 1`` every rank of a context-parallel group decodes the whole sequence itself
        (``context.whole_sequences``): the same tokens as at CP1, computed redundantly.
        """
        with whole_sequences(self.model_chunks):
            return generate(
                self.model_chunks,
                prompts,
                max_new_tokens,
                vocab_size=self.hparams.vocab_size,
                max_sequence_length=self.hparams.seq_length,
                **options,
            )

    @override
    def configure_optimizers(self) -> dict[str, Any]:
        hp = self.hparams
        decay, no_decay = [], []
        for name, param in self.named_parameters():
            if param.requires_grad:
                (no_decay if param.dim() < 2 or name.endswith(".bias") else decay).append(param)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=hp.lr,
            betas=tuple(hp.betas),
            eps=hp.eps,
        )
        total = self.trainer.max_steps if self.trainer.max_steps and self.trainer.max_steps > 0 else None

        def schedule(step: int) -> float:
            if hp.warmup_steps and step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            if total is None or total <= hp.warmup_steps:
                return 1.0
            progress = min(1.0, (step - hp.warmup_steps) / (total - hp.warmup_steps))
            floor = hp.min_lr / hp.lr if hp.lr else 0.0
            return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
