"""Test helpers shared by the test modules of every model family (hand-built inputs, generate calls, reference)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from reference_qwen3_vl import Conversation  # noqa: E402

from hf_raincheck import transformers_coupling as hf  # noqa: E402


#: marks of the Triton kernels' tests: ``gpu`` + ``triton`` (CI deselects them; they run on CUDA, and on the CPU
#: under Triton's interpreter, see conftest.py). The interpreter evaluates masked-off lanes too (log2(0), exp2
#: overflow, 0 / 0 on both sides of a `where`) and takes loop bounds from 1-element arrays, which numpy warns about
TRITON_MARKS = [
    pytest.mark.gpu,
    pytest.mark.triton,
    pytest.mark.filterwarnings(
        "ignore:divide by zero:RuntimeWarning",
        "ignore:overflow:RuntimeWarning",
        "ignore:invalid value encountered:RuntimeWarning",
        "ignore:Conversion of an array with ndim > 0:DeprecationWarning",
    ),
]


def _text(n, gen):
    """``n`` random text token ids in ``[0, 240)`` (below the hand-built models' special ids)."""
    return torch.randint(0, 240, (n,), generator=gen)


def _extend(inputs, new_ids):
    """Conversation extended by (generated / next-turn) text tokens."""
    new_ids = torch.as_tensor(new_ids, dtype=torch.long).view(1, -1)
    out = dict(inputs)
    out["input_ids"] = torch.cat([inputs["input_ids"], new_ids], dim=1)
    out["attention_mask"] = torch.ones_like(out["input_ids"])
    out["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(new_ids)], dim=1)
    return out


def generate(model, inputs, n, cfg=None, past=None, **kw):
    """Greedy ``generate`` of exactly ``n`` tokens with logits, optionally with a Raincheck config and a cache."""
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True, return_dict_in_generate=True)
    kwargs.update(kw)
    if cfg is not None:
        kwargs["raincheck_config"] = cfg
    if past is not None:
        kwargs[hf.CACHE_ARGUMENT] = past  # (the name the installed transformers takes the cache under)
    with torch.no_grad():
        return model.generate(**inputs, **kwargs)


def new_tokens(out, inputs):
    return out.sequences[0, inputs["input_ids"].shape[1] :].tolist()


def plan_of(cache, k=0):
    """``(deferred logical indices, boundary)`` of the cache's ``k``-th plan."""
    plan = cache.plans[k]
    return plan.deferred.tolist(), plan.boundary


@torch.no_grad()
def encode_qwen2_5_vl(model, inputs) -> Conversation:
    """The reference's per-logical-index inputs for Qwen2.5-VL, straight from the model's own pieces (no DeepStack,
    positions from ``get_rope_index`` with ``second_per_grid_ts``). `tests/reference_qwen3_vl.py` is family
    independent except for its encoder; this is its Qwen2.5-VL counterpart. Nothing here uses the package."""
    core = model.model
    image, video = model.config.image_token_id, model.config.video_token_id
    ids = inputs["input_ids"][0]
    embeds = core.get_input_embeddings()(ids).clone()
    for token, pixels, grid, getter in (
        (image, "pixel_values", "image_grid_thw", core.get_image_features),
        (video, "pixel_values_videos", "video_grid_thw", core.get_video_features),
    ):
        if inputs.get(pixels) is not None:
            feats = getter(inputs[pixels], inputs[grid], return_dict=True).pooler_output
            embeds[ids == token] = torch.cat(list(feats))
    mm_token_type_ids = inputs.get("mm_token_type_ids")
    if mm_token_type_ids is None:
        mm_token_type_ids = ((ids == image).long() + 2 * (ids == video).long())[None]
    positions, _ = core.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"),
        second_per_grid_ts=inputs.get("second_per_grid_ts"),
    )
    return Conversation(
        embeds=embeds,
        deepstack=embeds.new_zeros(0, ids.numel(), embeds.shape[-1]),
        visual=(ids == image) | (ids == video),
        positions=positions[:, 0],
        input_ids=ids.clone(),
    )


def whole_conversation(turns: list, input_ids: torch.Tensor) -> dict:
    """Processor outputs of a whole conversation from those of its turns (each turn's new media only)."""
    conv = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [turn[key] for turn in turns if turn.get(key) is not None]
        if parts:
            conv[key] = torch.cat(parts)
    return conv
