"""Qwen2.5-VL adapter: placeholders, M-RoPE positions, vision tower (window-ordered), decoder call.

What differs from Qwen3-VL (whose adapter this one extends for the family-independent parts: token ids,
special ids, span grids, text modules, embeddings, lm head):

- Positions: ``Qwen2_5_VLModel.get_rope_index`` with ``second_per_grid_ts`` (a video's temporal position
  step is ``tokens_per_second * second_per_grid_ts``), taken from the processor outputs of the call. The
  rope delta of generated tokens is ``last prompt position + 1 - L`` (what `generate` does), not the
  ``max + 1 - L`` that get_rope_index returns: the two differ after a video whose temporal positions outrun
  the text that follows it.
- Video: one contiguous run of placeholders per video, no per-frame timestamp text. A temporal grid step
  (``temporal_patch_size`` input frames, ``h * w / merge**2`` tokens) is one span; the run is split into
  ``grid_t`` such spans by the per-frame counts returned by `media_token_counts`.
- No DeepStack. The decoder takes 3-row ``position_ids`` ``[3, 1, q]`` (a 4th leading text row would only
  feed transformers' packed-sequence mask detection, and our 4D mask bypasses mask creation anyway).
- The vision tower runs its blocks on patches in *window order* (`get_vision_window_index`) and returns
  ``pooler_output`` already put back in raster order, which is what Raincheck stores and selectors get as
  ``ctx.embeddings``. Only tower-internal features (``last_hidden_state``, per-block hidden states and
  attentions) are window-ordered; `window_order` / `window_to_raster` / `raster_to_window` convert them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import transformers_coupling as hf
from .base import VisionFeatures
from .qwen3_vl import Qwen3VLAdapter


@dataclass
class WindowOrder:
    """How the Qwen2.5-VL vision tower orders the merged tokens of some images/videos (one ``grid_thw`` call).

    Attributes:
        window_index: ``[n]`` long: the raster index of the merged token at each window-order position
            (``window_ordered = raster_ordered[window_index]``), raster index = placeholder order over the
            media of the call (per media: ``t``, then merged row, then merged column).
        reverse_index: ``[n]`` long, ``argsort(window_index)``: the window-order position of each raster index
            (``raster_ordered = window_ordered[reverse_index]``).
        cu_window_seqlens: ``[windows + 1]`` int32 window boundaries in *patches* (as the tower uses them).
        merge_unit: patches per merged token (``spatial_merge_size ** 2``); the tower's patch-level tensors
            hold the ``merge_unit`` patches of a merged token consecutively.
    """

    window_index: torch.Tensor
    reverse_index: torch.Tensor
    cu_window_seqlens: torch.Tensor
    merge_unit: int

    def _index(self, level: str, reverse: bool) -> torch.Tensor:
        index = self.reverse_index if reverse else self.window_index
        if level == "merged":
            return index
        if level == "patch":
            unit = torch.arange(self.merge_unit, device=index.device)
            return (index[:, None] * self.merge_unit + unit[None, :]).reshape(-1)
        raise ValueError(f"level must be 'merged' or 'patch', got {level!r}")

    def to_raster(self, x: torch.Tensor, dim: int = 0, level: str = "merged") -> torch.Tensor:
        """Reorders `x` along `dim` from window order to raster (placeholder) order."""
        index = self._index(level, reverse=True).to(x.device)
        return x.index_select(dim, index)

    def to_window(self, x: torch.Tensor, dim: int = 0, level: str = "merged") -> torch.Tensor:
        """Reorders `x` along `dim` from raster (placeholder) order to the tower's window order."""
        index = self._index(level, reverse=False).to(x.device)
        return x.index_select(dim, index)


def window_order(vision_config, grid_thw: torch.Tensor) -> WindowOrder:
    """The tower's window order for `grid_thw` (``[n_media, 3]`` in patches), computed as the tower computes it."""
    window_index, cu_window_seqlens = hf.vision_window_index(vision_config, grid_thw)
    return WindowOrder(
        window_index=window_index,
        reverse_index=torch.argsort(window_index),
        cu_window_seqlens=cu_window_seqlens,
        merge_unit=vision_config.spatial_merge_size**2,
    )


def window_to_raster(vision_config, grid_thw, x, dim: int = 0, level: str = "merged") -> torch.Tensor:
    """Window-ordered tower features -> raster (placeholder) order.

    ``level="merged"``: `x` has one entry per merged token along `dim` (e.g. a merger output before its
    reordering). ``level="patch"``: one entry per patch (``last_hidden_state``, block hidden states; for a
    block's attention weights ``[heads, P, P]`` apply it on both ``dim=-2`` and ``dim=-1``).
    """
    return window_order(vision_config, grid_thw).to_raster(x, dim=dim, level=level)


def raster_to_window(vision_config, grid_thw, x, dim: int = 0, level: str = "merged") -> torch.Tensor:
    """Inverse of `window_to_raster`."""
    return window_order(vision_config, grid_thw).to_window(x, dim=dim, level=level)


class Qwen2_5_VLAdapter(Qwen3VLAdapter):
    family = "qwen2_5_vl"

    def logical_positions(
        self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask, model_inputs=None
    ):
        if image_grid_thw is None and video_grid_thw is None:
            length = input_ids.shape[1]
            return torch.arange(length).view(1, -1).expand(3, -1).clone(), 0
        second_per_grid_ts = self._seconds_per_grid(model_inputs, video_grid_thw)
        positions, deltas = self.core.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts,
            attention_mask=attention_mask,
        )
        positions = positions[:, 0].cpu()
        # Decode positions: transformers' generate continues every M-RoPE row from the prompt's last position
        # (+1 per token), and get_rope_index run on the extended conversation agrees. Its returned delta
        # (``max + 1 - L``) does not when a video's temporal positions (spaced by ``tokens_per_second *
        # second_per_grid_ts``) run past the text after it, so derive the delta from the last (text) token.
        return positions, int(positions[:, -1].max()) + 1 - input_ids.shape[1]

    @staticmethod
    def _seconds_per_grid(model_inputs, video_grid_thw):
        """``second_per_grid_ts`` aligned with `video_grid_thw` (the conversation's videos), or None.

        A later turn may pass the processor outputs of its new part only: then `video_grid_thw` (completed from
        the cache) lists the cached videos first and ``second_per_grid_ts`` covers only the new, last ones. The
        cached videos get 1.0: in transformers 5.23 a video's time step moves only its own tokens' temporal
        positions (the text after it advances by ``max(h, w) / merge``), and cached tokens are never
        repositioned (deferred rows keep the positions stored with their plan), so the value is never used.
        """
        seconds = None if model_inputs is None else model_inputs.get("second_per_grid_ts")
        if seconds is None or video_grid_thw is None:
            return None
        seconds = torch.as_tensor(seconds, dtype=torch.float).reshape(-1).cpu()
        n_videos = video_grid_thw.shape[0]
        if seconds.numel() > n_videos:
            raise ValueError(
                f"second_per_grid_ts has {seconds.numel()} entries but the conversation holds {n_videos} videos; "
                "pass the processor outputs of the whole conversation, or of its new part only"
            )
        if seconds.numel() < n_videos:
            seconds = torch.cat([torch.ones(n_videos - seconds.numel()), seconds])
        return seconds

    def media_token_counts(self, image_grid_thw, video_grid_thw):
        """Tokens per image; per video, one entry per temporal grid step (a contiguous frame of ``h*w/merge**2``)."""
        merge = self.config.vision_config.spatial_merge_size**2
        images = [] if image_grid_thw is None else [int(t * h * w) // merge for t, h, w in image_grid_thw.tolist()]
        videos = []
        if video_grid_thw is not None:
            videos = [[int(h * w) // merge] * int(t) for t, h, w in video_grid_thw.tolist()]
        return images, videos

    def vision_features(self, modality, pixel_values, grid_thw, want=None) -> VisionFeatures:
        out, extras = self._vision_pass(modality, pixel_values, grid_thw, want)
        # pooler_output is in raster (placeholder) order: the tower undoes its window order itself; the selector
        # extras (block attention, last_hidden_state) are window-ordered and put back by `_extras_order`
        embeds = torch.cat(list(out.pooler_output), dim=0).to(self.input_device)
        return VisionFeatures(embeds=embeds, deepstack=None, extras=extras)

    def _extras_order(self, grid_thw):
        return self.window_order(grid_thw).reverse_index

    def window_order(self, grid_thw: torch.Tensor) -> WindowOrder:
        """The vision tower's window order for `grid_thw` (see `WindowOrder`)."""
        return window_order(self.config.vision_config, grid_thw)

    def window_to_raster(self, grid_thw, x, dim: int = 0, level: str = "merged") -> torch.Tensor:
        return window_to_raster(self.config.vision_config, grid_thw, x, dim=dim, level=level)

    def raster_to_window(self, grid_thw, x, dim: int = 0, level: str = "merged") -> torch.Tensor:
        return raster_to_window(self.config.vision_config, grid_thw, x, dim=dim, level=level)
