"""Random-weight models of the real shapes (docs/design.md) and synthetic image / video prompts, shared by the benchmarks.

Latency does not depend on weight values, so benchmarks build models from configs; ``tiny*`` shapes run on a
CPU in seconds (smoke runs of every script).
"""

from __future__ import annotations

import torch
from hf_raincheck import RaincheckConfig
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

_QWEN3_VL_8B_TEXT = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=12288, vocab_size=151936, rope_theta=5e6,
                         mrope_section=[24, 20, 20])
_VISION_REAL = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, out_hidden_size=4096)
_QWEN3_5_9B_TEXT = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
                        head_dim=256, intermediate_size=12288, vocab_size=248320, rope_theta=1e7,
                        mrope_section=[11, 11, 10], partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                        linear_num_value_heads=32)

SHAPES = {
    "qwen3-vl-8b": dict(family="qwen3_vl", text=_QWEN3_VL_8B_TEXT,
                        vision=dict(_VISION_REAL, deepstack_visual_indexes=[8, 16, 24])),
    "qwen3.5-9b": dict(family="qwen3_5", text=_QWEN3_5_9B_TEXT, vision=dict(_VISION_REAL)),
    "tiny": dict(
        family="qwen3_vl",
        text=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, vocab_size=1000, rope_theta=1e4, mrope_section=[8, 4, 4]),
        vision=dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=128,
                    deepstack_visual_indexes=[0, 1]),
    ),
    "tiny-qwen3.5": dict(
        family="qwen3_5",
        text=dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  intermediate_size=256, vocab_size=1000, rope_theta=1e4, mrope_section=[2, 1, 1],
                  partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=32,
                  linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4),
        vision=dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, out_hidden_size=128),
    ),
}
IMAGE, VIDEO, VSTART, VEND = 1001, 1002, 1003, 1004


def default_chunk_size(shape: str, chunk_size: int | str = "auto") -> int:
    """The chunk size the package runs on `shape`: ``"auto"`` resolved as `RaincheckConfig.for_model` does (63 with
    Gated DeltaNet layers, else 31), an int as given."""
    return RaincheckConfig(chunk_size=chunk_size).for_model(SHAPES[shape]["family"] == "qwen3_5").chunk_size


def build_model(shape: str, device: str, dtype: torch.dtype, attn: str = "sdpa"):
    """A random-weight model of `shape` on `device` (weights initialised there, in `dtype`)."""
    spec = SHAPES[shape]
    text = dict(spec["text"])
    vocab = max(text.pop("vocab_size"), VEND + 1)
    rope = dict(rope_type="default", rope_theta=text.pop("rope_theta"), mrope_section=text.pop("mrope_section"),
                mrope_interleaved=True)
    if "partial_rotary_factor" in text:
        rope["partial_rotary_factor"] = text.pop("partial_rotary_factor")
    config_cls, model_cls = (
        (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
        if spec["family"] == "qwen3_vl"
        else (Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    )
    config = config_cls(
        text_config=dict(text, vocab_size=vocab, rope_parameters=rope, max_position_embeddings=32768),
        vision_config=dict(spec["vision"], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=2304),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )
    config._attn_implementation = attn
    torch.manual_seed(0)
    with torch.device(device):
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = model_cls(config).eval()
        finally:
            torch.set_default_dtype(default)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    return model


def _text(count: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, 1000, (count,), generator=gen).tolist()


def build_inputs(image_tokens: int, text_before: int, question: int, device: str, dtype: torch.dtype, seed: int = 0):
    """``text, <vision_start>, image (a square grid of `image_tokens` merged tokens), <vision_end>, question``;
    `seed` draws the text tokens and the pixels (another seed: another image)."""
    side = int(round(image_tokens ** 0.5))
    if side * side != image_tokens:
        raise ValueError(f"image_tokens must be a square, got {image_tokens}")
    patches = (2 * side) ** 2
    gen = torch.Generator().manual_seed(seed)
    ids = _text(text_before, gen) + [VSTART] + [IMAGE] * image_tokens + [VEND] + _text(question, gen)
    input_ids = torch.tensor([ids], device=device)
    return dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == IMAGE).int(),
        pixel_values=torch.randn(patches, 3 * 2 * 16 * 16, generator=gen).to(device, dtype),
        image_grid_thw=torch.tensor([[1, 2 * side, 2 * side]], device=device),
    )


def build_video_inputs(frames: int, side: int, text_before: int, question: int, device: str, dtype: torch.dtype):
    """``text, (<vision_start>, frame, <vision_end>) x T, question``: one video of `frames` frames.

    Two frames make one temporal patch (temporal_patch_size 2), so the video has ``T = frames // 2`` temporal
    groups of ``side x side`` merged tokens (``video_grid_thw = [[T, 2 side, 2 side]]``), each its own span.
    The Qwen3-VL processor also writes a timestamp (``<t seconds>``) before each group; it is plain text and
    left out here: `get_rope_index` only needs the groups to be separate runs of video tokens (the
    ``<vision_start>`` / ``<vision_end>`` around each one).
    """
    if frames < 2 or frames % 2:
        raise ValueError(f"frames must be an even number >= 2 (two frames per temporal patch), got {frames}")
    groups = frames // 2
    gen = torch.Generator().manual_seed(0)
    ids = _text(text_before, gen)
    for _ in range(groups):
        ids += [VSTART] + [VIDEO] * (side * side) + [VEND]
    ids += _text(question, gen)
    input_ids = torch.tensor([ids], device=device)
    patches = groups * (2 * side) ** 2
    return dict(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        mm_token_type_ids=(input_ids == VIDEO).int() * 2,
        pixel_values_videos=torch.randn(patches, 3 * 2 * 16 * 16, generator=gen).to(device, dtype),
        video_grid_thw=torch.tensor([[groups, 2 * side, 2 * side]], device=device),
    )


def split_device_map(model, devices: list) -> dict[str, str]:
    """A ``device_map`` of `model` over `devices` at the granularity ``device_map="auto"`` uses: the vision tower,
    the embeddings and the rotary tables on the first device, the decoder layers in contiguous near-equal groups
    (the first groups one larger when they do not divide), the final norm and ``lm_head`` on the last device."""
    devices = [str(d) for d in devices]
    lm = model.model.language_model
    layers = len(lm.layers)
    if not devices or len(devices) > layers:
        raise ValueError(f"devices: need 1..{layers} devices for {layers} decoder layers, got {devices}")
    device_map = {"model.visual": devices[0]}
    for name, _ in lm.named_children():
        if name != "layers":
            device_map[f"model.language_model.{name}"] = devices[-1] if name == "norm" else devices[0]
    per, extra = divmod(layers, len(devices))
    start = 0
    for i, device in enumerate(devices):
        count = per + (1 if i < extra else 0)
        for j in range(start, start + count):
            device_map[f"model.language_model.layers.{j}"] = device
        start += count
    device_map["lm_head"] = devices[-1]
    return device_map


def dispatch(model, devices: list):
    """`model` dispatched by accelerate over `devices` (``split_device_map``) as ``from_pretrained(device_map=...)``
    does (same `dispatch_model` arguments). One device name repeated (e.g. ``["cpu", "cpu"]``) still installs the
    hooks (``force_hooks``), so a CPU smoke run goes through the same code path as two GPUs."""
    from accelerate import dispatch_model

    device_map = split_device_map(model, devices)
    return dispatch_model(model, device_map=device_map, skip_keys=model._skip_keys_device_placement,
                          force_hooks=len(set(device_map.values())) == 1)
