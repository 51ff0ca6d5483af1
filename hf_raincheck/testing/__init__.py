"""Test helpers: tiny random Qwen3-VL, Qwen3.5 and Qwen2.5-VL checkpoints that load through the real ``from_pretrained`` paths.

Importing this package calls :func:`enable_torchvision_free_processing` (a no-op when torchvision is installed),
so that ``AutoProcessor.from_pretrained`` can build a ``Qwen3VLProcessor`` / ``Qwen2_5_VLProcessor`` on a CPU-only
machine.
"""

from .tiny_models import (
    BUILDER_VERSION,
    CHAT_TEMPLATE,
    IMAGE_SIZE,
    QWEN2_5_VL_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    build_processor,
    build_qwen2_5_vl_processor,
    build_tiny_qwen2_5_vl,
    build_tiny_qwen3_5,
    build_tiny_qwen3_vl,
    build_tokenizer,
    chat_inputs,
    enable_torchvision_free_processing,
    load_tiny_qwen2_5_vl,
    load_tiny_qwen3_5,
    load_tiny_qwen3_vl,
    make_image,
    make_video,
    tiny_qwen2_5_vl,
    tiny_qwen3_5,
    tiny_qwen2_5_vl_config,
    tiny_qwen3_vl,
    tiny_qwen3_vl_config,
)

enable_torchvision_free_processing()

__all__ = [
    "BUILDER_VERSION",
    "CHAT_TEMPLATE",
    "IMAGE_SIZE",
    "QWEN2_5_VL_CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "build_processor",
    "build_qwen2_5_vl_processor",
    "build_tiny_qwen2_5_vl",
    "build_tiny_qwen3_5",
    "build_tiny_qwen3_vl",
    "build_tokenizer",
    "chat_inputs",
    "enable_torchvision_free_processing",
    "load_tiny_qwen2_5_vl",
    "load_tiny_qwen3_5",
    "load_tiny_qwen3_vl",
    "make_image",
    "make_video",
    "tiny_qwen2_5_vl",
    "tiny_qwen3_5",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen3_vl",
    "tiny_qwen3_vl_config",
]
