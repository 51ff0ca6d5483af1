"""What every tiny checkpoint builder shares: seeded init, ``save_pretrained``, the build cache, Auto-class loading."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile

import torch

from .torchvision_free import enable_torchvision_free_processing

__all__ = [
    "INITIALIZER_RANGE",
    "cached_checkpoint",
    "load_checkpoint",
    "qwen_config",
    "save_checkpoint",
    "seeded_model",
]

#: Init std for every Linear/Embedding/Conv of both towers (HF's default is 0.02). Measured on a 2-turn image prompt
#: (Qwen3-VL): with 0.02 the logits have std ~0.16 over the ~2.4k-token vocabulary (mean top-1 probability 0.0007,
#: uniform is 0.0004), i.e. nearly flat; with 0.1 the std is ~0.8, and swapping the image moves the last-position
#: logits by ~3.7, so logit / cache-equivalence comparisons have something to bite on. Greedy tokens vary in both
#: cases.
INITIALIZER_RANGE = 0.1


def qwen_config(config_class, tokenizer, text_defaults: dict, vision_defaults: dict, overrides: dict):
    """A Qwen-VL-family config (``config_class``: ``Qwen3VLConfig``, ``Qwen2_5_VLConfig``, ``Qwen3_5Config``) with
    the token ids of `tokenizer` (Qwen's special tokens), both towers initialised with ``INITIALIZER_RANGE``.

    ``overrides``: top-level config fields; ``text_config=`` / ``vision_config=`` dicts are merged into the defaults;
    ``initializer_range=`` sets both towers. The vision tower's ``out_hidden_size`` follows the text hidden size.
    """
    from .tokenizer import SPECIAL_TOKENS

    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    overrides = dict(overrides)
    init = overrides.pop("initializer_range", INITIALIZER_RANGE)
    text = dict(
        text_defaults,
        vocab_size=len(tokenizer),
        initializer_range=init,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    text.update(overrides.pop("text_config", None) or {})
    vision = dict(vision_defaults, out_hidden_size=text["hidden_size"], initializer_range=init)
    vision.update(overrides.pop("vision_config", None) or {})
    kwargs = dict(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = config_class(**kwargs)
    config.bos_token_id = ids["<|endoftext|>"]
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config


def seeded_model(model_class, config, seed: int):
    """``model_class(config)`` in fp32 eval mode, its random init fixed by `seed` (the global RNG is left as it was)."""
    fork_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
    model.config.dtype = torch.float32
    return model


def save_checkpoint(model, processor, save_dir: str, builder: dict) -> str:
    """Greedy generation config (eos = ``<|im_end|>``/``<|endoftext|>``), ``save_pretrained`` of model and processor,
    and ``tiny_builder.json`` (`builder`: what built it). Returns `save_dir`."""
    from transformers import GenerationConfig

    tokenizer = processor.tokenizer
    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=model.config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(save_dir)
    processor.save_pretrained(save_dir)
    with open(os.path.join(save_dir, "tiny_builder.json"), "w", encoding="utf-8") as f:
        json.dump(builder, f, indent=2, default=str)
    return save_dir


_TMP_ROOT: str | None = None


def _tmp_root() -> str:
    global _TMP_ROOT
    if _TMP_ROOT is None:
        _TMP_ROOT = tempfile.mkdtemp(prefix="hf_raincheck_tiny_")
        atexit.register(shutil.rmtree, _TMP_ROOT, True)
    return _TMP_ROOT


def cached_checkpoint(name: str, build, tmp_path=None, seed: int = 0, **build_kwargs) -> str:
    """``<tmp_path>/<name>-seed<seed>[-<hash of build_kwargs>]``, built with ``build(path, seed=seed, **build_kwargs)``
    unless already there (``tmp_path`` None: a per-process temp dir removed at exit)."""
    root = os.fspath(tmp_path) if tmp_path is not None else _tmp_root()
    suffix = ""
    if build_kwargs:
        key = json.dumps(build_kwargs, sort_keys=True, default=str)
        suffix = "-" + hashlib.sha1(key.encode()).hexdigest()[:10]
    path = os.path.join(root, f"{name}-seed{seed}{suffix}")
    if not os.path.exists(os.path.join(path, "tiny_builder.json")):
        build(path, seed=seed, **build_kwargs)
    return path


def load_checkpoint(path, attn_implementation: str = "sdpa", **from_pretrained_kwargs):
    """``(model, processor)`` through ``AutoModelForImageTextToText`` / ``AutoProcessor``, model fp32 in eval mode.

    ``from_pretrained_kwargs`` go to the model's ``from_pretrained`` (e.g. ``device_map=``).
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    enable_torchvision_free_processing()
    path = os.fspath(path)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation, **from_pretrained_kwargs
    )
    model.eval()
    processor = AutoProcessor.from_pretrained(path)
    return model, processor
