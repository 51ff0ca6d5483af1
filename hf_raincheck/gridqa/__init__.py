"""GridQA: a synthetic multi-turn visual QA task and the tiny trained Qwen3-VL / Qwen3.5 checkpoints for it.

* :mod:`.task` — grid images (one cell = one merged visual token), dialogues of 3-4 questions, answer checking.
* :mod:`.checkpoint` — tokenizer, processor and model configs; saving / loading like Hub checkpoints.
* :mod:`.batching` — fast training batches equal to what the processor and chat template produce.
* :mod:`.alignment` — which question words name which cells, and the loss of the training stage that puts each
  cell's visual token near those words' embeddings (what a query-aware selector needs to find the asked cells).
* :func:`load_default` — the checkpoint shipped in ``hf_raincheck/assets`` for an architecture.

``scripts/train_gridqa.py`` trains a checkpoint; ``benchmarks/quality.py`` measures Full / Hard / Raincheck on it.
"""

from __future__ import annotations

import os

from .task import Dialogue, Turn, dialogues, draw_grid, is_correct, make_dialogue, normalize_answer

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
#: Directory name of the shipped checkpoint of each architecture, under ``hf_raincheck/assets``.
DEFAULT_CHECKPOINTS = {"qwen3_vl": "gridqa-qwen3-vl", "qwen3_5": "gridqa-qwen3_5"}


def default_path(arch: str = "qwen3_vl") -> str:
    """Path of the shipped checkpoint of ``arch`` (``"qwen3_vl"`` or ``"qwen3_5"``)."""
    if arch not in DEFAULT_CHECKPOINTS:
        raise ValueError(f"arch must be one of {list(DEFAULT_CHECKPOINTS)}, got {arch!r}")
    return os.path.join(ASSETS_DIR, DEFAULT_CHECKPOINTS[arch])


def has_default(arch: str = "qwen3_vl") -> bool:
    return os.path.exists(os.path.join(default_path(arch), "model.safetensors"))


def load_default(arch: str = "qwen3_vl", path: str | None = None, device: str = "cpu", dtype=None,
                 attn_implementation: str = "sdpa"):
    """``(model, processor)`` of the shipped GridQA checkpoint of ``arch`` (or of ``path``), via
    ``AutoModelForImageTextToText`` / ``AutoProcessor``; the model in eval mode, fp32 unless ``dtype`` says otherwise.

    Where torchvision is not installed, this turns on ``hf_raincheck.testing``'s torchvision-free video processor
    (a process-global registration that ``AutoProcessor`` needs to build a ``Qwen3VLProcessor`` at all).
    """
    import torch

    from .checkpoint import load_checkpoint

    path = path or default_path(arch)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"no GridQA checkpoint at {path}; train one with `python scripts/train_gridqa.py --arch {arch} --out {path}`"
        )
    return load_checkpoint(path, device=device, dtype=dtype or torch.float32, attn_implementation=attn_implementation)


__all__ = [
    "ASSETS_DIR",
    "DEFAULT_CHECKPOINTS",
    "Dialogue",
    "Turn",
    "default_path",
    "dialogues",
    "draw_grid",
    "has_default",
    "is_correct",
    "load_default",
    "make_dialogue",
    "normalize_answer",
]
