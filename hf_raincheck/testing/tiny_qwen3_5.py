"""Tiny *random* Qwen3.5 checkpoints (Gated DeltaNet + full attention) that load through ``from_pretrained``.

Same processor as the tiny Qwen3-VL (Qwen3.5 checkpoints use ``Qwen3VLProcessor``: tokenizer, PIL image processor
with patch 16 / merge 2, Qwen3-VL video processor, chat template); the model is a
``Qwen3_5ForConditionalGeneration``:

* text: 4 layers ``[linear, linear, linear, full]`` (Qwen3.5's 3:1 pattern), hidden 64, attention 4 query / 2 KV
  heads of dim 16 with the output gate, partial rotary 0.5 with interleaved M-RoPE; GDN 2 key / 4 value heads of
  dim 16, conv kernel 4;
* vision: 2 blocks, hidden 32, patch 16, merge 2, no DeepStack.

GDN decay: random init draws ``A`` in [1, 16] per head, so the state forgets a token within a few steps
(``exp(-A softplus(dt))`` per token) and what a deferred token changes in the live state falls below float noise.
Trained checkpoints keep slow heads; so do these: ``A_log`` ~ U(-5, -1), ``dt_bias`` = -1 (per-token decay
0.99..0.997), so that tests of the state mapping have something to see.
"""

from __future__ import annotations

import os

import torch

from .checkpoint import cached_checkpoint, load_checkpoint, qwen_config, save_checkpoint, seeded_model
from .tiny_qwen3_vl import build_processor

__all__ = ["QWEN3_5_BUILDER_VERSION", "build_tiny_qwen3_5", "load_tiny_qwen3_5", "tiny_qwen3_5", "tiny_qwen3_5_config"]

QWEN3_5_BUILDER_VERSION = 1
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def tiny_qwen3_5_config(tokenizer, hidden_size: int = 64, layer_types=None, **overrides):
    """The ``Qwen3_5Config`` of the tiny model, token ids from `tokenizer` (`overrides`: see `qwen_config`)."""
    from transformers import Qwen3_5Config

    layer_types = list(layer_types or LAYER_TYPES)
    text = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, mrope_section=[2, 1, 1],
                             mrope_interleaved=True, partial_rotary_factor=0.5),
    )
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=64)
    return qwen_config(Qwen3_5Config, tokenizer, text, vision, overrides)


def build_tiny_qwen3_5(save_dir, seed: int = 0, hidden_size: int = 64, **overrides) -> str:
    """Build a tiny random Qwen3.5 checkpoint (model + processor) into `save_dir`; returns `save_dir`."""
    from transformers import Qwen3_5ForConditionalGeneration

    save_dir = os.fspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    processor = build_processor()
    config = tiny_qwen3_5_config(processor.tokenizer, hidden_size=hidden_size, **overrides)
    model = seeded_model(Qwen3_5ForConditionalGeneration, config, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):  # slow decay: see the module docstring
                gdn = layer.linear_attn
                gdn.A_log.copy_(torch.empty(gdn.A_log.shape).uniform_(-5.0, -1.0, generator=generator))
                gdn.dt_bias.fill_(-1.0)
    builder = {
        "builder": "hf_raincheck.testing.build_tiny_qwen3_5",
        "builder_version": QWEN3_5_BUILDER_VERSION,
        "seed": seed,
        "hidden_size": hidden_size,
        "overrides": overrides,
    }
    return save_checkpoint(model, processor, save_dir, builder)


def tiny_qwen3_5(tmp_path=None, seed: int = 0, **build_kwargs):
    """Build (once per directory) and load a tiny Qwen3.5: returns ``(model, processor)``."""
    path = cached_checkpoint("tiny-qwen3_5", build_tiny_qwen3_5, tmp_path, seed, **build_kwargs)
    return load_tiny_qwen3_5(path)


def load_tiny_qwen3_5(path, attn_implementation: str = "sdpa", **from_pretrained_kwargs):
    """Load a checkpoint written by :func:`build_tiny_qwen3_5`: ``(model, processor)``, fp32, eval mode."""
    return load_checkpoint(path, attn_implementation, **from_pretrained_kwargs)
