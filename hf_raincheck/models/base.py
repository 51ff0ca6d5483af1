"""What Raincheck needs to know about a model family, in one place per family."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VisionFeatures:
    """Vision-tower output for the placeholders of some images or videos, in placeholder order."""

    embeds: torch.Tensor  # [n, H]
    deepstack: list[torch.Tensor] | None  # per DeepStack layer [n, H], or None


class ModelAdapter:
    """Interface of a per-family adapter. Subclasses implement every method."""

    family: str = ""

    def __init__(self, model):
        self.model = model

    # --- token ids
    @property
    def image_token_id(self) -> int:
        raise NotImplementedError

    @property
    def video_token_id(self) -> int:
        raise NotImplementedError

    # --- modules
    def text_attention_modules(self):
        raise NotImplementedError

    def num_cache_layers(self) -> int:
        raise NotImplementedError

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # --- inputs
    def logical_positions(
        self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, model_inputs=None
    ):
        """``([3, L] positions, rope_delta)`` for a whole conversation, from the model's own M-RoPE code.

        ``model_inputs`` is the whole dict of keyword inputs of the `generate` call (processor outputs), for
        family-specific inputs of the position code (e.g. Qwen2.5-VL's ``second_per_grid_ts``); may be None.
        """
        raise NotImplementedError

    def media_token_counts(self, image_grid_thw, video_grid_thw) -> tuple[list[int], list[list[int]]]:
        """Placeholder tokens per image, and per frame of each video."""
        raise NotImplementedError

    def vision_features(self, modality: str, pixel_values, grid_thw) -> VisionFeatures:
        raise NotImplementedError

    def language_forward(self, embeds, positions, mask, cache, visual_rows, deepstack, backend):
        """Runs the decoder over rows ``embeds [1, q, H]`` and returns final hidden states ``[1, q, H]``."""
        raise NotImplementedError

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
