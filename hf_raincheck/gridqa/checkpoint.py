"""Tokenizer, processor and model configs of the GridQA checkpoints; saving and loading them.

* Tokenizer: word-level in effect: a Qwen-style byte-level BPE whose merges were trained to completion on the
  task's words (:func:`hf_raincheck.gridqa.task.words` plus the chat roles), each alone and after a space, so
  every word of a question or answer is one token (a number after a space is two: Qwen's pre-tokenizer splits the
  space off digits) and other text still encodes, byte by byte. The 64 cell names (``A1`` ... ``H8``) are added
  tokens, one token each (Qwen's pre-tokenizer would split ``C5`` into ``C`` and ``5``, and a model would have to
  compose the two before it can look the cell up: the first trained models never learnt to); the space before a
  name is its own ``Ġ`` token. Qwen's special tokens follow, in Qwen's order
  (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ..., ``<|vision_start|>``, ``<|vision_end|>``,
  ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``), then the non-special ``<tool_call>``/``<think>`` tokens.
  ``eos_token`` ``<|im_end|>``, ``pad_token`` ``<|endoftext|>``. Why not a ``tokenizers`` ``WordLevel`` model:
  transformers 5.23 lists ``qwen3_5`` in ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``, so ``AutoTokenizer`` builds
  a ``Qwen3_5Tokenizer`` (byte-level BPE rebuilt from the vocab and merges of ``tokenizer.json``, Qwen's
  pre-tokenizer and decoder forced) for every ``model_type: qwen3_5`` checkpoint, whatever ``tokenizer_config.json``
  says; a WordLevel ``tokenizer.json`` then loads as a broken tokenizer. The BPE file loads correctly as
  ``Qwen2Tokenizer`` (Qwen3-VL) and as ``Qwen3_5Tokenizer`` (Qwen3.5), with identical ids.
* Chat template: the Qwen3-VL structure (:data:`hf_raincheck.testing.tiny_models.CHAT_TEMPLATE`).
* Processor: a real ``Qwen3VLProcessor`` with ``Qwen2VLImageProcessorPil`` (patch 16, merge 2, mean = std = 0.5,
  pixels in [128 * 128, 256 * 256]: a 256 x 256 grid image stays 256 x 256, i.e. 8 x 8 = 64 image tokens, one per
  cell; larger images are scaled down to at most 64 tokens) and the video processor of
  :func:`hf_raincheck.testing.tiny_models.build_video_processor` (reused, not copied).
* Models: ``Qwen3VLForConditionalGeneration`` (full attention, DeepStack) and ``Qwen3_5ForConditionalGeneration``
  (Gated DeltaNet + full attention, ``[lin, lin, full, lin, lin, full]``), a few million parameters each, saved in
  bf16 (``config.dtype`` says float32, so an ``AutoModelForImageTextToText.from_pretrained(path)`` without
  ``dtype=`` computes in fp32: the weights are bf16-rounded fp32 values).
"""

from __future__ import annotations

import json
import os

import torch

from ..testing.tokenizer import ADDED_TOKENS, SPECIAL_TOKENS  # noqa: F401  (Qwen's, in Qwen's order)
from . import task

ARCHS = ("qwen3_vl", "qwen3_5")

ROLE_WORDS = ("system", "user", "assistant", "tool")

MIN_PIXELS = 128 * 128
MAX_PIXELS = task.IMAGE_SIZE * task.IMAGE_SIZE


def _corpus() -> list[str]:
    words = [*ROLE_WORDS, *task.words()]
    return [form for w in words for form in (w, " " + w)]


def build_tokenizer():
    """A real Qwen2-style byte-level BPE tokenizer whose merges make every task word a single token.

    :func:`hf_raincheck.testing.tokenizer.train_qwen2_tokenizer` trained to completion on the task's words (each
    alone and after a space), so that every word of a question or answer is one token, as with a word-level
    tokenizer, while any other text still encodes (byte fallback, no unk token). Deterministic.
    """
    from ..testing.tokenizer import train_qwen2_tokenizer

    from tokenizers import AddedToken

    # vocab_size is never reached: training stops when every word is one symbol
    tokenizer = train_qwen2_tokenizer(_corpus(), vocab_size=100_000, model_max_length=4096)
    tokenizer.add_tokens([AddedToken(name, special=False, normalized=False) for name in task.CELL_NAMES])
    return tokenizer


def build_image_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_processor(tokenizer=None):
    """The tiny models' ``Qwen3VLProcessor`` (chat template, video processor) with the GridQA tokenizer and image
    processor."""
    from ..testing.tiny_qwen3_vl import build_processor as qwen3_vl_processor

    return qwen3_vl_processor(tokenizer if tokenizer is not None else build_tokenizer(), build_image_processor())


#: Model sizes: text hidden 256 (4 layers Qwen3-VL, 6 layers Qwen3.5), vision hidden 128 x 4 blocks; 5.62M / 6.83M
#: parameters, 11.3 / 13.7 MB of bf16 safetensors (25 MB together). The vocabulary is 525 tokens, so nearly all
#: parameters are in the towers. rope_theta 1e4 (not Qwen's 5e6 / 1e7): sequences are < 400 tokens.
TEXT = dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            hidden_act="silu", max_position_embeddings=4096, rms_norm_eps=1e-6, attention_bias=False)
VISION = dict(depth=4, hidden_size=128, intermediate_size=512, num_heads=4, hidden_act="gelu_pytorch_tanh",
              in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
              num_position_embeddings=256)  # 16 x 16 patch grid of a 256 px image: no interpolation


def model_config(arch: str, tokenizer, initializer_range: float = 0.02, rope_theta: float | None = None):
    """The ``Qwen3VLConfig`` / ``Qwen3_5Config`` of a GridQA model, token ids taken from ``tokenizer``."""
    from ..testing.checkpoint import qwen_config

    if arch == "qwen3_vl":
        from transformers import Qwen3VLConfig

        # head_dim 64 -> 32 rotary frequencies; Qwen3-VL's [24, 20, 20] of 64 scaled to [12, 10, 10], interleaved.
        text = dict(TEXT, num_hidden_layers=4,
                    rope_parameters=dict(rope_type="default", rope_theta=10_000.0, mrope_section=[12, 10, 10],
                                         mrope_interleaved=True))
        config_class, vision = Qwen3VLConfig, dict(VISION, deepstack_visual_indexes=[1, 2])
    elif arch == "qwen3_5":
        from transformers import Qwen3_5Config

        # partial rotary 0.5 of head_dim 64 -> 16 frequencies; mrope [6, 5, 5] (Qwen3.5: [11, 11, 10] of 32).
        text = dict(TEXT, num_hidden_layers=6,
                    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
                    linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_num_key_heads=4, linear_num_value_heads=8,
                    rope_parameters=dict(rope_type="default", rope_theta=10_000.0, partial_rotary_factor=0.5,
                                         mrope_section=[6, 5, 5], mrope_interleaved=True))
        config_class, vision = Qwen3_5Config, dict(VISION)
    else:
        raise ValueError(f"arch must be one of {list(ARCHS)}, got {arch!r}")
    if rope_theta is not None:
        text["rope_parameters"]["rope_theta"] = float(rope_theta)
    return qwen_config(config_class, tokenizer, text, vision, {"initializer_range": initializer_range})


def init_position_code(model, seed: int = 0, std: float = 1.0) -> None:
    """Re-initialise the vision tower's learned position table with a separable code: entry (row, col) of the
    16 x 16 patch grid = ``a[row] + b[col]``, ``a``, ``b`` Gaussian with total std ``std``.

    Why: with transformers' default init (std 0.02) the position table is ~40x weaker than the patch embedding of
    an image, so at the start nothing in the visual tokens says where a cell is, and every GridQA question needs
    that (a cell by row / column, a row listing, where an object is). Trained from that init, a 5.6M Qwen3-VL sat at
    the loss of a model that ignores the image (0.85 nats per answer token, ~5% exact answers) for 1900 steps x 128
    dialogues. A strong, separable code makes "row r" and "column c" visible from step 0; the table
    stays trainable.
    """
    table = model.model.visual.pos_embed.weight
    n, dim = table.shape
    side = int(round(n**0.5))
    gen = torch.Generator().manual_seed(1000 + seed)
    rows = torch.randn(side, dim, generator=gen) * (std / 2**0.5)
    cols = torch.randn(side, dim, generator=gen) * (std / 2**0.5)
    with torch.no_grad():
        table.copy_((rows[:, None, :] + cols[None, :, :]).reshape(n, dim).to(table))


def build_model(arch: str, tokenizer, seed: int = 0, position_code_std: float = 1.0, rope_theta: float | None = None):
    """A freshly initialised fp32 GridQA model (``torch.manual_seed(seed)`` fixes the weights).

    ``position_code_std > 0``: :func:`init_position_code` on the vision position table (0: transformers' init).
    """
    from transformers import AutoModelForImageTextToText, GenerationConfig

    config = model_config(arch, tokenizer, rope_theta=rope_theta)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    if position_code_std > 0:
        init_position_code(model, seed, position_code_std)
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id, do_sample=False,
        max_new_tokens=64,
    )
    return model


def save_checkpoint(model, processor, path, stats: dict | None = None, dtype=torch.bfloat16) -> str:
    """``save_pretrained`` of model (weights cast to ``dtype``; ``config.dtype`` stays float32) and processor."""
    import copy

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    out = copy.deepcopy(model).to("cpu", dtype)
    out.save_pretrained(path)
    processor.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    # weights are stored in `dtype`; computing in fp32 is the intended default (CPU demo, exact references)
    cfg["dtype"] = "float32"
    for sub in ("text_config", "vision_config"):
        if isinstance(cfg.get(sub), dict) and "dtype" in cfg[sub]:
            cfg[sub]["dtype"] = "float32"
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    if stats is not None:
        with open(os.path.join(path, "training_stats.json"), "w", encoding="utf-8") as f:
            json.dump(stats, f, indent=2)
            f.write("\n")
    return path


def load_checkpoint(path, device: str = "cpu", dtype=torch.float32, attn_implementation: str = "sdpa"):
    """``(model, processor)`` through ``AutoModelForImageTextToText`` / ``AutoProcessor`` (eval mode)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from ..testing.tiny_models import enable_torchvision_free_processing

    enable_torchvision_free_processing()  # no-op where torchvision is installed
    path = os.fspath(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).eval()
    processor = AutoProcessor.from_pretrained(path)
    return model, processor
