"""Tiny random checkpoints with a real processor, one module per family (kept for imports of this module's names).

- :mod:`.tokenizer`: the ``Qwen2Tokenizer`` trained on the spot, shared by every family;
- :mod:`.torchvision_free`: torch-only video processors so that the processors build without torchvision;
- :mod:`.checkpoint`: seeded init, ``save_pretrained``, the per-directory build cache, Auto-class loading;
- :mod:`.inputs`: deterministic images / videos and the chat-template call;
- :mod:`.tiny_qwen3_vl`, :mod:`.tiny_qwen2_5_vl`: the per-family configs, processors and builders.
"""

from __future__ import annotations

from .checkpoint import INITIALIZER_RANGE
from .inputs import IMAGE_SIZE, chat_inputs, make_image, make_video
from .tiny_qwen2_5_vl import (
    QWEN2_5_VL_BUILDER_VERSION,
    QWEN2_5_VL_CHAT_TEMPLATE,
    build_qwen2_5_vl_processor,
    build_tiny_qwen2_5_vl,
    load_tiny_qwen2_5_vl,
    tiny_qwen2_5_vl,
    tiny_qwen2_5_vl_config,
)
from .tiny_qwen3_5 import build_tiny_qwen3_5, load_tiny_qwen3_5, tiny_qwen3_5, tiny_qwen3_5_config
from .tiny_qwen3_vl import (
    BUILDER_VERSION,
    CHAT_TEMPLATE,
    build_image_processor,
    build_processor,
    build_tiny_qwen3_vl,
    build_video_processor,
    load_tiny_qwen3_vl,
    tiny_qwen3_vl,
    tiny_qwen3_vl_config,
)
from .tokenizer import ADDED_TOKENS, SPECIAL_TOKENS, build_tokenizer
from .torchvision_free import enable_torchvision_free_processing

__all__ = [
    "ADDED_TOKENS",
    "BUILDER_VERSION",
    "CHAT_TEMPLATE",
    "IMAGE_SIZE",
    "INITIALIZER_RANGE",
    "QWEN2_5_VL_BUILDER_VERSION",
    "QWEN2_5_VL_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_image_processor",
    "build_processor",
    "build_qwen2_5_vl_processor",
    "build_tiny_qwen2_5_vl",
    "build_tiny_qwen3_vl",
    "build_tokenizer",
    "build_video_processor",
    "chat_inputs",
    "enable_torchvision_free_processing",
    "load_tiny_qwen2_5_vl",
    "load_tiny_qwen3_vl",
    "make_image",
    "make_video",
    "build_tiny_qwen3_5",
    "load_tiny_qwen3_5",
    "tiny_qwen3_5",
    "tiny_qwen3_5_config",
    "tiny_qwen2_5_vl",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen3_vl",
    "tiny_qwen3_vl_config",
]
