"""What Raincheck needs to know about a model family, in one place per family."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import transformers_coupling as hf


def execution_device(module: torch.nn.Module) -> torch.device:
    """The device `module` computes on.

    A model dispatched with an accelerate ``device_map`` (``from_pretrained(..., device_map=...)`` over several
    devices) runs each mapped module on its hook's ``execution_device`` (its weights may be elsewhere, e.g. offloaded
    to the CPU); otherwise a module computes where its first parameter (or buffer) lives.
    """
    for hook in hf.accelerate_hooks(module):  # one hook, or those of a SequentialHook
        device = getattr(hook, "execution_device", None)
        if device is not None:
            return torch.device(device)  # an int is an accelerator index, as accelerate writes CUDA devices
    for tensor in module.parameters():
        return tensor.device
    for tensor in module.buffers():
        return tensor.device
    return torch.device("cpu")


@dataclass
class VisionFeatures:
    """Vision-tower output for the placeholders of some images or videos, in placeholder order."""

    embeds: torch.Tensor  # [n, H], on the adapter's `input_device`
    deepstack: list[torch.Tensor] | None  # per DeepStack layer [n, H] (on `input_device`), or None
    # features a pruning selector asked for (`want`), per placeholder: {"vision_attention": {block: [n]},
    # "vision_hidden": [n, D_vit]} (see hf_raincheck.pruning.base)
    extras: dict = field(default_factory=dict)

    def split(self, counts: list[int]) -> list["VisionFeatures"]:
        """The features of consecutive groups of ``counts[i]`` placeholders (e.g. each batch row's images, encoded
        in one tower call): every per-placeholder tensor cut along its first dimension."""
        out, start = [], 0
        for n in counts:
            cut = slice(start, start + n)
            extras = {}
            for key, value in self.extras.items():
                if isinstance(value, dict):
                    extras[key] = {k: v[cut] for k, v in value.items()}
                elif torch.is_tensor(value):
                    extras[key] = value[cut]
                else:
                    extras[key] = value
            out.append(VisionFeatures(embeds=self.embeds[cut],
                                      deepstack=None if self.deepstack is None else [f[cut] for f in self.deepstack],
                                      extras=extras))
            start += n
        if start != self.embeds.shape[0]:
            raise RuntimeError(f"VisionFeatures.split: {start} placeholders asked, {self.embeds.shape[0]} held")
        return out


class ModelAdapter:
    """Everything the generation code asks of a model family, declared here once.

    A family's adapter (``hf_raincheck/models/<family>.py``) overrides every method that raises
    `NotImplementedError` here and sets `text`; the others have defaults that fit attention-only models without
    DeepStack. `get_adapter` picks the adapter by the model's ``config.model_type``.

    Attributes:
        family: the family's name (``"qwen3_vl"``...).
        model: the wrapped ``...ForConditionalGeneration`` model.
        text: the decoder's text model (``embed_tokens``, ``layers``, ``rotary_emb``, ``norm``, ``config``), which
            `language_forward` runs layer by layer; set by the family's ``__init__``.
        gdn_glue: a `hf_raincheck.gdn_state.GDNGlue` for families with Gated DeltaNet layers, else None.
    """

    family: str = ""
    text: torch.nn.Module | None = None

    def __init__(self, model):
        self.model = model

    # --- token ids
    @property
    def image_token_id(self) -> int:
        """The image placeholder token's id (the processor writes one per merged patch)."""
        raise NotImplementedError(f"{type(self).__name__} must define image_token_id")

    @property
    def video_token_id(self) -> int:
        """The video placeholder token's id (one per merged patch of each frame)."""
        raise NotImplementedError(f"{type(self).__name__} must define video_token_id")

    def special_token_ids(self) -> set[int]:
        """Template and special token ids that are never part of a question's text (vision start / end, eos,
        pad, bos...): query-guided pruning selectors skip them when they collect the question's tokens."""
        raise NotImplementedError(f"{type(self).__name__} must define special_token_ids")

    # --- modules
    def text_attention_modules(self):
        """The decoder's full-attention modules, in layer order (Raincheck patches their attention function)."""
        raise NotImplementedError(f"{type(self).__name__} must define text_attention_modules")

    def num_cache_layers(self) -> int:
        """Layers of a `DeferredPrefillCache` for this model (one per decoder layer, indexed like them)."""
        raise NotImplementedError(f"{type(self).__name__} must define num_cache_layers")

    def gdn_modules(self) -> dict:
        """Gated DeltaNet (linear-attention) modules by decoder layer index; empty for attention-only models."""
        return {}

    gdn_glue = None  # a `hf_raincheck.gdn_state.GDNGlue` for families with GDN layers

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings ``[..., H]`` of token ids ``[...]``, on `input_device`."""
        raise NotImplementedError(f"{type(self).__name__} must define embed_tokens")

    @property
    def input_device(self) -> torch.device:
        """Where the decoder's inputs start: the input embedding's execution device (with a multi-device
        ``device_map``, accelerate moves hidden states from layer to layer from there)."""
        raise NotImplementedError(f"{type(self).__name__} must define input_device")

    def decoder_devices(self) -> list[torch.device]:
        """Distinct execution devices of the decoder's attention and GDN modules (several: a model split by a
        ``device_map``)."""
        modules = [*self.text_attention_modules(), *self.gdn_modules().values()]
        return list(dict.fromkeys(execution_device(m) for m in modules))

    def deepstack_devices(self) -> list[torch.device]:
        """Execution device of each decoder layer that receives DeepStack features (empty: no DeepStack)."""
        return []

    # --- inputs
    def logical_positions(
        self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, model_inputs=None
    ):
        """``([3, L] positions, rope_delta)`` for a whole conversation, from the model's own M-RoPE code.

        ``model_inputs`` is the whole dict of keyword inputs of the `generate` call (processor outputs), for
        family-specific inputs of the position code (e.g. Qwen2.5-VL's ``second_per_grid_ts``); may be None.
        """
        raise NotImplementedError(f"{type(self).__name__} must define logical_positions")

    def media_token_counts(self, image_grid_thw, video_grid_thw) -> tuple[list[int], list[list[int]]]:
        """Placeholder tokens per image, and per frame of each video (either grid may be None: no such media)."""
        raise NotImplementedError(f"{type(self).__name__} must define media_token_counts")

    def span_grids(self, new_spans, image_grid_thw, video_grid_thw, all_spans) -> list[tuple[int, int, int]]:
        """The merged-token grid ``(1, h, w)`` of each span of `new_spans` (an image, or one video frame), for the
        pruning selectors' spatial layout. `all_spans` are the conversation's spans in order (`new_spans` among
        them), the grids those of the whole conversation."""
        raise NotImplementedError(f"{type(self).__name__} must define span_grids")

    def vision_features(self, modality: str, pixel_values, grid_thw, want: dict | None = None) -> VisionFeatures:
        """Runs the vision tower once. `want` (from `hf_raincheck.pruning.selector_requirements`) asks for
        ``VisionFeatures.extras`` computed in the same pass; adapters without that support leave `want` out of
        their signature (a selector needing it then raises a clear error). Everything returned is on
        `input_device`, wherever the tower runs."""
        raise NotImplementedError(f"{type(self).__name__} must define vision_features")

    @property
    def vision_depth(self) -> int | None:
        """Number of vision-tower blocks (None: no block-level features available)."""
        return None

    def end_of_turn_token_ids(self) -> set[int]:
        """Ids that end a chat turn: the eos ids of the model config and its generation config."""
        ids: set[int] = set()
        config = getattr(self.model, "config", None)
        owners = (config, getattr(config, "text_config", None), getattr(self.model, "generation_config", None))
        for owner in owners:
            value = getattr(owner, "eos_token_id", None)
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    def layer_mask(self, layer_idx: int, mask):
        """The attention mask a decoder layer gets (attention-only models: the visibility mask everywhere)."""
        return mask

    def language_forward(self, embeds, positions, mask, cache, deepstack, backend):
        """Runs the decoder over rows ``embeds [1, q, H]`` and returns final hidden states ``[1, q, H]``.

        transformers' text-model loop (rotary embeddings, decoder layers, final norm) without its mask creation
        and with DeepStack added densely: `hf_raincheck.transformers_coupling.text_decoder_forward`.
        """
        if self.text is None:
            raise NotImplementedError(f"{type(self).__name__} must set `text` (the decoder's text model)")
        return hf.text_decoder_forward(
            self.text, embeds, positions, lambda i: self.layer_mask(i, mask), cache, deepstack, backend
        )

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[1, q, V]`` of final hidden states ``[1, q, H]``."""
        raise NotImplementedError(f"{type(self).__name__} must define lm_head")
