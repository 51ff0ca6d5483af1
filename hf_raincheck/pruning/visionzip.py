"""`visionzip`: VisionZip-Select, the dominant tokens by received ViT attention (not query-aware).

Yang et al., "VisionZip: Longer is Better but Not Necessary in Vision Language Models" (CVPR 2025); official code
dvlab-research/VisionZip, Qwen2.5-VL port by its authors (vendored in JulietChoo/VisionSelector
``qwen-evaluation/token_compression/visionzip_official.py``).

Score: the attention each merged token receives in the last ViT block (``ctx.extras["vision_attention"]``:
head mean, summed over the queries of its image / frame, mean over its 2x2 patches, raster order; Qwen's ViT has
no CLS token, so "received" replaces VisionZip's CLS attention). Per span with budget ``b``: keep the ``b``
highest scores, ties to the lowest index.

This is the dominant-token selection only ("VisionZip-Select", the variant the Raincheck paper evaluates). The
full method also merges the remaining tokens into contextual tokens, which rewrites embeddings; Raincheck needs the
deferred tokens' embeddings untouched, so contextual merging is not offered.

Options: ``layer`` (default -1: the last block; 0-based, negative ids count from the end).
"""

from __future__ import annotations

import torch

from .base import VISION_ATTENTION, SelectionContext, assemble, check_int_or_none, register_selector, span_groups
from .hiprune import ranking

DEFAULTS = {"layer": -1}
CHECKS = {"layer": check_int_or_none("layer")}


def _layer(opts: dict) -> int:
    return -1 if opts["layer"] is None else opts["layer"]


@register_selector("visionzip", options=DEFAULTS, checks=CHECKS, requires=lambda opts, depth: {VISION_ATTENTION: [_layer(opts)]})
def select_visionzip(ctx: SelectionContext) -> torch.Tensor:
    opts = select_visionzip.options.resolve(ctx.options)
    layer = _layer(opts)
    chosen = {}
    for (n, budget), members in span_groups(ctx).items():
        scores = torch.stack([ctx.span_vision_attention(m, layer, "visionzip") for m in members]).float()
        top = ranking(scores)[:, :budget]
        chosen.update({m: top[i] for i, m in enumerate(members)})
    return assemble(ctx, chosen)
