"""Inputs for the tiny checkpoints: deterministic images and videos, and the processor's chat-template call."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["IMAGE_SIZE", "chat_inputs", "make_image", "make_video"]

#: Default edge of the test images: 128 px -> 8x8 patches of 16 px -> 16 merged Qwen3-VL vision tokens (Qwen2.5-VL,
#: patch 14: resized to 140 px -> 10x10 patches -> 25 merged tokens).
IMAGE_SIZE = (128, 128)


def make_image(seed: int, size: Sequence[int] = IMAGE_SIZE):
    """A deterministic RGB ``PIL.Image`` of random coloured blocks; ``size`` is (width, height)."""
    from PIL import Image

    width, height = int(size[0]), int(size[1])
    rng = np.random.default_rng(seed)
    block = max(8, min(width, height) // 8)
    gh, gw = math.ceil(height / block), math.ceil(width / block)
    colors = rng.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8)
    pixels = np.repeat(np.repeat(colors, block, axis=0), block, axis=1)[:height, :width]
    return Image.fromarray(np.ascontiguousarray(pixels), mode="RGB")


def make_video(seed: int, num_frames: int = 4, size: Sequence[int] = IMAGE_SIZE) -> np.ndarray:
    """A deterministic video, uint8 array (frames, height, width, 3): blocks that shift a little every frame.

    Pass it as ``{"type": "video", "video": make_video(0)}``. Without metadata the video processor assumes
    24 fps (and warns once), samples ``max(4, ...)`` frames, and stamps ``<0.0 seconds>``-style timestamps.
    """
    base = np.asarray(make_image(seed, size))
    frames = [np.roll(base, shift=4 * t, axis=1) for t in range(num_frames)]
    return np.stack(frames, axis=0)


def chat_inputs(processor, messages, add_generation_prompt: bool = True, **kwargs):
    """``processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")``.

    Contains ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (0 text, 1 image, 2 video), and
    ``pixel_values``/``image_grid_thw`` and/or ``pixel_values_videos``/``video_grid_thw`` when present.
    """
    return processor.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        **kwargs,
    )
