"""Checkpoint conversion between ``GPTModule`` and other formats (Hugging Face GPT-2, Llama, Mixtral, Qwen2 and
Qwen2-MoE)."""

from lightning_megatron.convert.hf import export_hf, gpt_kwargs_to_hf_config, hf_config_to_gpt_kwargs, load_hf_weights_

__all__ = ["export_hf", "gpt_kwargs_to_hf_config", "hf_config_to_gpt_kwargs", "load_hf_weights_"]
