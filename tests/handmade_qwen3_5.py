"""Hand-built tiny Qwen3.5 (Gated DeltaNet + full attention) sharing `handmade`'s token ids and inputs."""

from __future__ import annotations

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from handmade import IMG, VE, VID, VOCAB, VS

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def tiny_qwen3_5(attn="eager", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = Qwen3_5Config(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=len(LAYER_TYPES),
            layer_types=LAYER_TYPES,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="default",
                rope_theta=10000.0,
                mrope_section=[2, 1, 1],
                mrope_interleaved=True,
                partial_rotary_factor=0.5,
            ),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=256,
        ),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    cfg._attn_implementation = attn
    model = Qwen3_5ForConditionalGeneration(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # less flat logits: greedy decoding well separated
        for layer in model.model.language_model.layers:
            if hasattr(layer, "linear_attn"):
                # random init decays the GDN state by e^-2..e^-20 per token, so a deferred token's effect on the
                # live state would vanish below float noise and tests could not see a wrong join; slow decay
                # (as trained models have on many heads) keeps it visible
                layer.linear_attn.A_log.uniform_(-5.0, -1.0)
                layer.linear_attn.dt_bias.fill_(-1.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
