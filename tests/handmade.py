"""Hand-built tiny Qwen3-VL models and inputs (exact control over spans, grids and videos) shared by tests."""

from __future__ import annotations

import os
import sys

import torch
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

sys.path.insert(0, os.path.dirname(__file__))

from helpers import _extend, _text  # noqa: E402,F401  (re-exported: tests import them from here)

VOCAB = 256
IMG, VID, VS, VE = 250, 251, 248, 249
ATOL = 1e-5


def _tiny_model(attn="eager", seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3VLConfig(
        text_config=dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3], mrope_interleaved=True
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
            deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=IMG,
        video_token_id=VID,
        vision_start_token_id=VS,
        vision_end_token_id=VE,
    )
    cfg._attn_implementation = attn
    model = Qwen3VLForConditionalGeneration(cfg).float().eval()
    # random init is small: make logits less flat so greedy decoding is well separated
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _conv(image_grids, texts_between, seed=0):
    """input_ids = text, [VS, IMG*n, VE, text] per image; returns inputs dict."""
    gen = torch.Generator().manual_seed(seed)
    parts = [_text(texts_between[0], gen)]
    pix = []
    for k, (t, h, w) in enumerate(image_grids):
        n_tok = t * h * w // 4
        parts += [torch.tensor([VS]), torch.full((n_tok,), IMG), torch.tensor([VE])]
        parts.append(_text(texts_between[k + 1], gen))
        pix.append(torch.randn(t * h * w, 3 * 2 * 16 * 16, generator=gen))
    ids = torch.cat(parts)[None].long()
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=(ids == IMG).long(),
        pixel_values=torch.cat(pix),
        image_grid_thw=torch.tensor(image_grids, dtype=torch.long),
    )


# ------------------------------------------------------------------------------------------
def _video_conv(seed=0):
    """text, image [1,4,8], text, video of 2 temporal groups [2,4,4] (one span per frame), text."""
    gen = torch.Generator().manual_seed(seed)
    parts = [_text(3, gen), torch.tensor([VS]), torch.full((8,), IMG), torch.tensor([VE]), _text(4, gen)]
    for _ in range(2):  # frames: timestamp text, then the frame span
        parts += [_text(2, gen), torch.tensor([VS]), torch.full((4,), VID), torch.tensor([VE])]
    parts.append(_text(5, gen))
    ids = torch.cat(parts)[None].long()
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=((ids == IMG).long() + 2 * (ids == VID).long()),
        pixel_values=torch.randn(32, 1536, generator=gen),
        image_grid_thw=torch.tensor([[1, 4, 8]]),
        pixel_values_videos=torch.randn(32, 1536, generator=gen),
        video_grid_thw=torch.tensor([[2, 4, 4]]),
    )
