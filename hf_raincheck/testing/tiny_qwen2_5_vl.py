"""Tiny *random* Qwen2.5-VL checkpoints that load through the real ``from_pretrained`` paths.

Same machinery as :mod:`.tiny_qwen3_vl` (tokenizer trained on the spot, seeded random weights, ``save_pretrained``).
What a checkpoint built by :func:`build_tiny_qwen2_5_vl` contains:

* ``config.json`` + ``model.safetensors`` + ``generation_config.json``: a ``Qwen2_5_VLForConditionalGeneration``
  (text: 2 layers, hidden 64, 4 query / 2 KV heads of dim 16, M-RoPE sections [2, 3, 3] (Qwen2.5-VL's
  [16, 24, 24] scaled to 8 frequencies, not interleaved); vision: 2 blocks, hidden 32, patch 14, spatial merge 2,
  temporal patch 2, ``window_size`` 56 px (windows of 2x2 merged tokens, real: 112 px = 4x4) with block 0 windowed and
  block 1 full (``fullatt_block_indexes=[1]``), ``tokens_per_second`` 2), fp32.
* the tokenizer of :mod:`.tokenizer`, and Qwen2.5-VL's chat template (a default system prompt when the chat has
  none).
* ``processor_config.json``, its image processor: ``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` picks
  for ``qwen2_5_vl`` without torchvision), patch 14, merge 2, CLIP mean/std, pixels in [56*56, 256*256]: a 128x128
  image is resized to 140x140, a 10x10 patch grid, i.e. 25 ``<|image_pad|>`` tokens on a 5x5 merged grid, which the
  tower splits into 3x3 windows (the last row and column of windows padded): window order != raster order.
* its video processor: ``Qwen2VLVideoProcessor`` (every frame, as Qwen2.5-VL's default; frames up to 128*128 px):
  4 frames of 128x128 become a 2x8x8 grid (frames resized to 112x112), one run of 2 x 16 ``<|video_pad|>`` tokens.
  The processor also returns ``second_per_grid_ts`` (2 / the video's fps: pass ``VideoMetadata`` through
  ``processor_kwargs={"video_metadata": [...]}``, else 24 fps is assumed).

Without torchvision the processor loads through :func:`~.torchvision_free.enable_torchvision_free_processing`.
"""

from __future__ import annotations

import os

from .checkpoint import cached_checkpoint, load_checkpoint, qwen_config, save_checkpoint, seeded_model
from .tokenizer import build_tokenizer
from .torchvision_free import enable_torchvision_free_processing, qwen2_vl_video_processor_class

__all__ = [
    "QWEN2_5_VL_BUILDER_VERSION",
    "QWEN2_5_VL_CHAT_TEMPLATE",
    "build_qwen2_5_vl_processor",
    "build_tiny_qwen2_5_vl",
    "load_tiny_qwen2_5_vl",
    "tiny_qwen2_5_vl",
    "tiny_qwen2_5_vl_config",
]

#: Bump when the checkpoint layout or contents change (recorded in ``tiny_builder.json``).
QWEN2_5_VL_BUILDER_VERSION = 1

#: Qwen2.5-VL's chat template (the one of the Qwen2-VL / Qwen2.5-VL Instruct checkpoints): a default system prompt,
#: image / video placeholders in any turn, ``add_vision_id``, ``add_generation_prompt``.
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text tower: head_dim 64 / 4 = 16 -> 8 rotary frequencies; Qwen2.5-VL's mrope_section [16, 24, 24] (of 64, in
# blocks T | H | W) scaled to 8 is [2, 3, 3].
_TEXT_DEFAULTS = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    use_cache=True,
    rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, mrope_section=[2, 3, 3]),
)
_VISION_DEFAULTS = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    hidden_act="silu",
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    # 56 px = 2x2 merged tokens per window (real: 112 px = 4x4): the test images' 4x4..9x9 merged grids hold several
    # windows, padded ones included, so window order != raster order.
    window_size=56,
    fullatt_block_indexes=[1],  # block 0 windowed, block 1 full (real: 7, 15, 23, 31 of 32)
    tokens_per_second=2,
)

_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_IMAGE_MIN_PIXELS = 56 * 56
_IMAGE_MAX_PIXELS = 256 * 256
_VIDEO_MIN_PIXELS = 56 * 56
_VIDEO_MAX_PIXELS = 128 * 128  # per frame


def build_qwen2_5_vl_image_processor():
    """``Qwen2VLImageProcessorPil`` (no torchvision needed) with Qwen2.5-VL's patch 14 / merge 2 / CLIP mean, std."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": _IMAGE_MIN_PIXELS, "longest_edge": _IMAGE_MAX_PIXELS},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
    )


def build_qwen2_5_vl_video_processor():
    """``Qwen2VLVideoProcessor`` (torch-only subclass when torchvision is missing), small pixel budget."""
    cls = qwen2_vl_video_processor_class()
    return cls(
        size={"shortest_edge": _VIDEO_MIN_PIXELS, "longest_edge": _VIDEO_MAX_PIXELS},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=_CLIP_MEAN,
        image_std=_CLIP_STD,
        do_sample_frames=False,  # Qwen2.5-VL's default: every frame (sampling is the caller's job, qwen-vl-utils)
        cap_pixels_per_frame=True,
    )


def build_qwen2_5_vl_processor(tokenizer=None):
    """A real ``Qwen2_5_VLProcessor`` (tokenizer + PIL image processor + video processor + chat template)."""
    from transformers import Qwen2_5_VLProcessor

    enable_torchvision_free_processing()
    return Qwen2_5_VLProcessor(
        image_processor=build_qwen2_5_vl_image_processor(),
        tokenizer=tokenizer if tokenizer is not None else build_tokenizer(),
        video_processor=build_qwen2_5_vl_video_processor(),
        chat_template=QWEN2_5_VL_CHAT_TEMPLATE,
    )


def tiny_qwen2_5_vl_config(tokenizer, num_hidden_layers: int = 2, hidden_size: int = 64, **overrides):
    """The ``Qwen2_5_VLConfig`` of the tiny model, with token ids taken from ``tokenizer``.

    ``overrides``: top-level ``Qwen2_5_VLConfig`` fields; ``text_config=`` / ``vision_config=`` dicts are merged into
    the defaults (e.g. ``vision_config={"window_size": 112}``); ``initializer_range=`` sets both towers.
    """
    from transformers import Qwen2_5_VLConfig

    text = dict(_TEXT_DEFAULTS, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_hidden_layers)
    return qwen_config(Qwen2_5_VLConfig, tokenizer, text, _VISION_DEFAULTS, overrides)


def build_tiny_qwen2_5_vl(
    save_dir, seed: int = 0, num_hidden_layers: int = 2, hidden_size: int = 64, **overrides
) -> str:
    """Build a tiny random Qwen2.5-VL checkpoint (model + processor) into ``save_dir``; returns ``save_dir``.

    ``torch.manual_seed(seed)`` fixes the weights; the tokenizer does not depend on the seed. fp32, safetensors,
    greedy ``generation_config.json`` (eos = ``<|im_end|>``/``<|endoftext|>``). See :func:`tiny_qwen2_5_vl_config`
    for ``overrides``.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    save_dir = os.fspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    processor = build_qwen2_5_vl_processor()
    config = tiny_qwen2_5_vl_config(
        processor.tokenizer, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, **overrides
    )
    model = seeded_model(Qwen2_5_VLForConditionalGeneration, config, seed)
    builder = {
        "builder": "hf_raincheck.testing.build_tiny_qwen2_5_vl",
        "builder_version": QWEN2_5_VL_BUILDER_VERSION,
        "seed": seed,
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "overrides": overrides,
    }
    return save_checkpoint(model, processor, save_dir, builder)


def tiny_qwen2_5_vl(tmp_path=None, seed: int = 0, **build_kwargs):
    """Build (once per directory) and load a tiny Qwen2.5-VL: returns ``(model, processor)`` (see
    :func:`~.tiny_qwen3_vl.tiny_qwen3_vl`; the directory is ``tiny-qwen2_5-vl-seed<seed>[-<hash>]``)."""
    path = cached_checkpoint("tiny-qwen2_5-vl", build_tiny_qwen2_5_vl, tmp_path, seed, **build_kwargs)
    return load_tiny_qwen2_5_vl(path)


def load_tiny_qwen2_5_vl(path, attn_implementation: str = "sdpa", **from_pretrained_kwargs):
    """Load a checkpoint written by :func:`build_tiny_qwen2_5_vl`: ``(model, processor)``, model fp32 in eval mode."""
    return load_checkpoint(path, attn_implementation, **from_pretrained_kwargs)
