"""Qwen3-VL adapter: placeholders, M-RoPE positions, vision tower and DeepStack, decoder call."""

from __future__ import annotations

import torch

from .. import transformers_coupling as hf
from ..pruning.base import VISION_ATTENTION, VISION_HIDDEN
from ..pruning.vision import BlockAttentionHooks, pool_merged
from .base import ModelAdapter, VisionFeatures, execution_device


def qwen_vision_attn_qk(attn, args, kwargs):
    """q, k ``[P, heads, head_dim]`` (rotary applied, as the block computes them), ``cu_seqlens`` and the softmax
    scale of a Qwen-VL vision block, from the forward inputs of its attention module ``block.attn`` (for
    `BlockAttentionHooks` on the attention modules; the module's input is the block's ``norm1(hidden_states)``).
    transformers' code: `hf_raincheck.transformers_coupling.vision_attention_qk`.

    Hooking the attention module rather than the block matters under an accelerate ``device_map``: a block's forward
    pre-hooks run before accelerate moves a dispatched block's inputs to its device (and loads offloaded weights);
    inside the block's forward everything is already in place."""
    return hf.vision_attention_qk(attn, args, kwargs)


def qwen_vision_attn_sdpa_input(attn, args, kwargs):
    """The input hidden states ``[P, hidden]`` of a Qwen-VL vision attention module ``block.attn`` whose forward runs
    its attention as one ``F.scaled_dot_product_attention(q, k, v, attn_mask=None, scale=attn.scaling)`` call per
    segment of ``cu_seqlens``, in order, with q, k ``[1, heads, n, head_dim]`` (rotary applied, the values
    `qwen_vision_attn_qk` gives), else None: the ``sdpa_input`` of `BlockAttentionHooks`.

    That is the forward of the pinned transformers' ``Qwen3VLVisionAttention`` (and Qwen2.5-VL's, Qwen3.5's: the same
    code) with ``attn_implementation="sdpa"``; the other implementations (eager, flash_attention_2, ...) never call
    SDPA (None: the hooks recompute q, k). The hooks check the calls cover the ``P`` rows, and fall back to
    `qwen_vision_attn_qk` otherwise; see `hf_raincheck.transformers_coupling.vision_attention_sdpa_input`."""
    return hf.vision_attention_sdpa_input(attn, args, kwargs)


def qwen_vision_block_qk(block, args, kwargs):
    """`qwen_vision_attn_qk` from the forward inputs of the whole block (``hidden_states`` before ``norm1``)."""
    hidden = args[0] if args else kwargs["hidden_states"]
    cu_seqlens = args[1] if len(args) > 1 else kwargs["cu_seqlens"]
    attn_kwargs = dict(kwargs, cu_seqlens=cu_seqlens)
    attn_kwargs.pop("hidden_states", None)
    return qwen_vision_attn_qk(block.attn, (block.norm1(hidden),), attn_kwargs)


class Qwen3VLAdapter(ModelAdapter):
    family = "qwen3_vl"

    def __init__(self, model):
        super().__init__(model)
        self.core = model.model  # Qwen3VLModel
        self.text = self.core.language_model
        self.config = model.config

    @property
    def image_token_id(self) -> int:
        return int(self.config.image_token_id)

    @property
    def video_token_id(self) -> int:
        return int(self.config.video_token_id)

    def special_token_ids(self) -> set[int]:
        """Template/special ids that are never part of a question's text."""
        ids = set()
        for owner in (self.config, self.config.text_config, getattr(self.model, "generation_config", None)):
            for name in ("vision_start_token_id", "vision_end_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
                value = getattr(owner, name, None)
                if isinstance(value, int):
                    ids.add(value)
                elif isinstance(value, (list, tuple)):
                    ids.update(int(v) for v in value)
        return ids

    def span_grids(self, new_spans, image_grid_thw, video_grid_thw, all_spans):
        """Merged-token grid ``(1, h, w)`` of each new span (an image or one video frame)."""
        merge = self.config.vision_config.spatial_merge_size
        grids = {"image": [], "video": []}
        if image_grid_thw is not None:
            grids["image"] = [(1, h // merge, w // merge) for t, h, w in image_grid_thw.tolist() for _ in range(1)]
        if video_grid_thw is not None:
            grids["video"] = [(1, h // merge, w // merge) for t, h, w in video_grid_thw.tolist() for _ in range(t)]
        seen = {"image": 0, "video": 0}
        by_start = {}
        for span in all_spans:
            by_start[span.start] = grids[span.modality][seen[span.modality]]
            seen[span.modality] += 1
        return [by_start[s.start] for s in new_spans]

    def text_attention_modules(self):
        return [layer.self_attn for layer in self.text.layers]

    def num_cache_layers(self) -> int:
        return len(self.text.layers)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.text.embed_tokens(input_ids)

    @property
    def input_device(self) -> torch.device:
        return execution_device(self.text.embed_tokens)

    def deepstack_devices(self) -> list[torch.device]:
        n = len(getattr(self.config.vision_config, "deepstack_visual_indexes", None) or [])
        return [execution_device(self.text.layers[k]) for k in range(n)]

    def logical_positions(
        self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, model_inputs=None
    ):
        if image_grid_thw is None and video_grid_thw is None:
            length = input_ids.shape[1]
            return torch.arange(length).view(1, -1).expand(3, -1).clone(), 0
        positions, deltas = self.core.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=None if video_grid_thw is None else video_grid_thw.clone(),
            attention_mask=attention_mask,
        )
        return positions[:, 0].cpu(), int(deltas.reshape(-1)[0])

    def media_token_counts(self, image_grid_thw, video_grid_thw):
        merge = self.config.vision_config.spatial_merge_size ** 2
        images = [] if image_grid_thw is None else [int(t * h * w) // merge for t, h, w in image_grid_thw.tolist()]
        videos = []
        if video_grid_thw is not None:
            for t, h, w in video_grid_thw.tolist():
                videos.append([int(h * w) // merge] * int(t))
        return images, videos

    @property
    def vision_depth(self) -> int:
        return len(self.core.visual.blocks)

    def _vision_pass(self, modality, pixel_values, grid_thw, want):
        """One vision-tower run; `want` adds per-placeholder extras (see `hf_raincheck.pruning.base`): attention
        received at some blocks (hooks on those blocks' attention modules only; with the Triton kernels and SDPA's
        flash backend, from those blocks' own attention, see `BlockAttentionHooks`) and/or the last block's output,
        pooled over each merged token's patches, put in placeholder (raster) order and on `input_device`."""
        want = want or {}
        visual = self.core.visual
        layers = want.get(VISION_ATTENTION, ())
        attention_modules = [block.attn for block in visual.blocks]
        with BlockAttentionHooks(attention_modules, layers, qwen_vision_attn_qk, qwen_vision_attn_sdpa_input) as hooks:
            if modality == "image":
                out = self.core.get_image_features(pixel_values, grid_thw, return_dict=True)
            else:
                out = self.core.get_video_features(pixel_values, grid_thw, return_dict=True)
        extras = {}
        if layers or want.get(VISION_HIDDEN):
            unit = visual.spatial_merge_unit  # the tower keeps each merged token's patches consecutive
            order = self._extras_order(grid_thw)
            device = self.input_device
            if layers:
                extras[VISION_ATTENTION] = {
                    layer: pool_merged(s, unit, order).to(device) for layer, s in hooks.scores.items()
                }
            if want.get(VISION_HIDDEN):
                extras[VISION_HIDDEN] = pool_merged(out.last_hidden_state, unit, order).to(device)
        return out, extras

    def _extras_order(self, grid_thw):
        """Raster index -> position of the tower's merged-token order (None: the tower runs in raster order)."""
        return None

    def vision_features(self, modality, pixel_values, grid_thw, want=None) -> VisionFeatures:
        out, extras = self._vision_pass(modality, pixel_values, grid_thw, want)
        device = self.input_device  # the tower (and its merger) may run on another device than the embeddings
        embeds = torch.cat(list(out.pooler_output), dim=0).to(device)
        deepstack = None
        if getattr(out, "deepstack_features", None):
            deepstack = [torch.cat(list(feat), dim=0).to(device) for feat in out.deepstack_features]
        return VisionFeatures(embeds=embeds, deepstack=deepstack, extras=extras)

    def lm_head(self, hidden):
        return self.model.lm_head(hidden)
