"""Tiny *random* Qwen3-VL checkpoints that load through the real ``from_pretrained`` paths.

Nothing here downloads anything: the tokenizer is trained on the spot (byte-level BPE, like Qwen's),
the model is randomly initialised from a seed, and both are written with ``save_pretrained`` so that
``AutoModelForImageTextToText.from_pretrained`` / ``AutoProcessor.from_pretrained`` load them exactly like a
Hub checkpoint.

What a checkpoint built by :func:`build_tiny_qwen3_vl` contains:

* ``config.json`` + ``model.safetensors`` + ``generation_config.json``: a ``Qwen3VLForConditionalGeneration``
  (text: 2 layers, hidden 64, 4 query / 2 KV heads of dim 16, interleaved M-RoPE; vision: 2 blocks, hidden 32,
  patch 16, spatial merge 2, temporal patch 2, deepstack on both vision blocks), fp32.
* ``tokenizer.json`` / ``tokenizer_config.json``: a real ``Qwen2Tokenizer`` (byte-level BPE with Qwen's
  pre-tokenizer regex, so *any* text tokenizes, no unk token) whose merges were trained on a few hundred common
  English words, plus Qwen's special tokens in Qwen's order (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``,
  ..., ``<|vision_start|>``, ``<|vision_end|>``, ``<|vision_pad|>``, ``<|image_pad|>``, ``<|video_pad|>``) and the
  non-special ``<tool_call>``/``<think>``-style tokens.
* ``chat_template.jinja``: the Qwen3-VL chat template structure.
* ``preprocessor_config.json``: ``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` picks for ``qwen3_vl``
  without torchvision), patch 16, merge 2, mean/std 0.5, pixels in [64*64, 256*256]: a 128x128 image becomes an
  8x8 patch grid, i.e. 16 ``<|image_pad|>`` tokens.
* ``video_preprocessor_config.json``: ``Qwen3VLVideoProcessor`` (fps 2, 4..16 frames, per-frame pixel cap on):
  4 frames of 128x128 become a 2x8x8 grid, i.e. two ``<t seconds><|vision_start|><|video_pad|>*16<|vision_end|>``
  spans.

torchvision: transformers 5.23 cannot build a ``Qwen3VLProcessor`` at all without torchvision (its video
processor is torchvision-only, and ``ProcessorMixin`` can't even resolve the video-processor base class), not
even for image-only use (huggingface/transformers#48558). :func:`enable_torchvision_free_processing` (called
when this module is imported) fills that gap *only when torchvision is missing*: it exposes
``VideoProcessorMixin`` where ``ProcessorMixin`` looks for it and registers a subclass of the real
``Qwen3VLVideoProcessor`` whose three torchvision calls (resize, normalize, grayscale->RGB) are done with plain
torch. With torchvision installed it does nothing and the stock classes load.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "BUILDER_VERSION",
    "CHAT_TEMPLATE",
    "IMAGE_SIZE",
    "SPECIAL_TOKENS",
    "build_processor",
    "build_tiny_qwen3_vl",
    "build_tokenizer",
    "chat_inputs",
    "enable_torchvision_free_processing",
    "load_tiny_qwen3_vl",
    "make_image",
    "make_video",
    "tiny_qwen3_vl",
    "tiny_qwen3_vl_config",
]

#: Bump when the checkpoint layout or contents change (part of the cache key of :func:`tiny_qwen3_vl`).
BUILDER_VERSION = 1

#: Default edge of the test images: 128 px -> 8x8 patches of 16 px -> 16 merged vision tokens.
IMAGE_SIZE = (128, 128)

#: Qwen's special tokens, in the order (and so with the relative ids) of the real Qwen3-VL tokenizer.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Added tokens that are *not* special in Qwen's tokenizer (kept by ``skip_special_tokens=True``).
ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

_WORDS = """
the a an this that these those there here it its is are was were be been being am do does did done have has had
having will would can could should may might must shall not no yes and or but if then than so because as of in on
at to from by with without for about into onto over under above below between behind before after during up down
out off near far inside outside around through across along against i you he she we they me him her us them my
your his our their what which who whom whose where when why how all any both each every few many more most other
some such only own same too very just also again once one two three four five six seven eight nine ten eleven
twelve hundred thousand first second third last next left right top bottom middle center corner side front back
image images picture pictures photo photos video videos frame frames clip scene view object objects thing things
person people man woman men women boy girl child children baby dog dogs cat cats bird birds horse cow animal
animals car cars bus truck bike train plane boat road street tree trees flower grass water sky sun cloud clouds
rain snow house building room door window table chair bed wall floor box ball book cup bottle phone computer
screen sign light shadow food apple banana pizza cake color colors colour red green blue yellow orange purple pink
brown black white gray grey dark bright big small large little long short tall high low wide round square
circle triangle line lines shape shapes block blocks pattern text word words letter number numbers count time
day night year old new good bad best better same different first each whole half part full empty open closed hot
cold warm happy sad fast slow hard soft heavy light clear hidden visible moving still describe description explain
show shows shown look looks see seen watch find found tell say says said answer question questions ask think
know want like make made take took give go went come came get got put set use used need try call called play
played run ran walk walked sit sat stand stood hold held move moved change changed start end begin happen
happened appear appears contain contains include includes compare please thanks thank hello hi okay ok sure
maybe probably likely true false correct wrong because while until since where whether either neither
assistant user system model tool response
""".split()

#: Chat template with the structure of Qwen3-VL's (system / tools header, image & video placeholders in user and
#: tool turns, ``add_vision_id``, tool calls in assistant turns, ``add_generation_prompt``).
CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' }}
        {%- if messages[0].content is string %}
            {{- messages[0].content }}
        {%- else %}
            {%- for content in messages[0].content %}
                {%- if 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- for message in messages %}
    {%- if message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content_item in message.content %}
                {%- if 'text' in content_item %}
                    {{- content_item.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and message.content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {%- if message.content is string %}
            {{- message.content }}
        {%- else %}
            {%- for content in message.content %}
                {%- if content.type == 'image' or 'image' in content or 'image_url' in content %}
                    {%- set image_count.value = image_count.value + 1 %}
                    {%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}
                    <|vision_start|><|image_pad|><|vision_end|>
                {%- elif content.type == 'video' or 'video' in content %}
                    {%- set video_count.value = video_count.value + 1 %}
                    {%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}
                    <|vision_start|><|video_pad|><|vision_end|>
                {%- elif 'text' in content %}
                    {{- content.text }}
                {%- endif %}
            {%- endfor %}
        {%- endif %}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Text tower: head_dim 16 -> 8 rotary frequencies. Qwen3-VL uses mrope_section [24, 20, 20] over 64 frequencies
# with *interleaved* layout (T,H,W,T,H,W,... for 60 slots, then T): the scaled-down equivalent over 8 frequencies
# is [4, 2, 2] (H at 1,4; W at 2,5; T at 0,3,6,7). [2, 3, 3] would also sum to 8, but interleaving would then
# silently give W only two slots (slice(2, 9, 3) stops at 8).
_TEXT_DEFAULTS = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    attention_bias=False,
    use_cache=True,
    rope_parameters=dict(rope_type="default", rope_theta=5_000_000.0, mrope_section=[4, 2, 2], mrope_interleaved=True),
)
_VISION_DEFAULTS = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    hidden_act="gelu_pytorch_tanh",
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    # Learned 2-D position table of 8x8 (real: 48x48); bilinearly interpolated to the actual grid.
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1],
)

#: Init std for every Linear/Embedding/Conv of both towers (HF's default is 0.02). Measured on a 2-turn image prompt:
#: with 0.02 the logits have std ~0.16 over the ~2.4k-token vocabulary (mean top-1 probability 0.0007, uniform is
#: 0.0004), i.e. nearly flat; with 0.1 the std is ~0.8, and swapping the image moves the last-position logits by
#: ~3.7, so logit / cache-equivalence comparisons have something to bite on. Greedy tokens vary in both cases.
INITIALIZER_RANGE = 0.1

_IMAGE_MIN_PIXELS = 64 * 64
_IMAGE_MAX_PIXELS = 256 * 256
_VIDEO_MIN_PIXELS = 64 * 64
_VIDEO_MAX_PIXELS = 8 * 128 * 128


# --------------------------------------------------------------------------------------------------------------
# torchvision-free processing
# --------------------------------------------------------------------------------------------------------------


def _torchvision_available() -> bool:
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


@functools.cache
def _torch_only_video_processor_class():
    """Subclass of the real ``Qwen3VLVideoProcessor`` with its torchvision calls done in plain torch.

    It keeps the upstream class name so that ``video_preprocessor_config.json`` names the stock class (a checkpoint
    written here loads the stock class wherever torchvision is installed).
    """
    from transformers.image_utils import ChannelDimension, PILImageResampling
    # Import the submodule itself: attribute access on the lazy ``qwen3_vl`` package yields a torchvision dummy.
    upstream = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")
    from transformers.video_utils import convert_to_rgb

    modes = {
        PILImageResampling.NEAREST: "nearest-exact",
        PILImageResampling.BILINEAR: "bilinear",
        PILImageResampling.BICUBIC: "bicubic",
    }

    class Qwen3VLVideoProcessor(upstream.Qwen3VLVideoProcessor):
        """``transformers``' Qwen3VLVideoProcessor with resize/normalize/grayscale done without torchvision."""

        def convert_to_rgb(self, video):
            if video.shape[-3] == 1:
                video = video.expand(*video.shape[:-3], 3, *video.shape[-2:])
            return convert_to_rgb(video, input_data_format=ChannelDimension.FIRST)

        def normalize(self, image, mean, std, inplace=False, **kwargs):
            mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            if inplace:
                return image.sub_(mean).div_(std)
            return (image - mean) / std

        def resize(self, videos, size, resample, factor, temporal_factor, cap_pixels_per_frame=None, **kwargs):
            # Same size rule as upstream ``Qwen3VLVideoProcessor.resize``; only the interpolation differs in
            # *where* it runs (torchvision's tensor resize is this very ``interpolate(antialias=True)`` call).
            if not size.shortest_edge or not size.longest_edge:
                raise ValueError(f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {size}.")
            num_frames = videos.shape[1]
            max_pixels = size.longest_edge
            if cap_pixels_per_frame:
                frame_cap = self.max_video_tokens * factor * factor
                pixels_per_frame = max(min(frame_cap, size.longest_edge // num_frames), int(size.shortest_edge * 1.05))
                max_pixels = pixels_per_frame * num_frames
            height, width = videos.shape[-2:]
            new_h, new_w = upstream.smart_resize(
                height=height,
                width=width,
                num_frames=num_frames,
                factor=factor,
                temporal_factor=temporal_factor,
                min_pixels=size.shortest_edge,
                max_pixels=max_pixels,
            )
            return _torch_resize(videos, (new_h, new_w), modes.get(resample, "bicubic"))

    # Keep the upstream identity for repr/save: the JSON must say "Qwen3VLVideoProcessor".
    Qwen3VLVideoProcessor.__qualname__ = "Qwen3VLVideoProcessor"
    return Qwen3VLVideoProcessor


def _torch_resize(x: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """``torchvision.transforms.v2.functional.resize(x, size, antialias=True)`` for (..., C, H, W) tensors."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    lead = x.shape[:-3]
    flat = x.reshape(-1, *x.shape[-3:])
    was_uint8 = flat.dtype == torch.uint8
    y = flat.float() if was_uint8 or not flat.is_floating_point() else flat
    kwargs = {} if mode.startswith("nearest") else {"align_corners": False, "antialias": True}
    y = torch.nn.functional.interpolate(y, size=size, mode=mode, **kwargs)
    if was_uint8:
        y = y.round_().clamp_(0, 255).to(torch.uint8)
    return y.reshape(*lead, *y.shape[-3:])


_torchvision_free_enabled = False


def enable_torchvision_free_processing() -> bool:
    """Let ``AutoProcessor.from_pretrained`` build a ``Qwen3VLProcessor`` when torchvision is not installed.

    Idempotent; a no-op (returns False) when torchvision is available. Returns True when the shim is active.
    Two process-global changes, both only reachable where the stock code would raise:

    * ``transformers.VideoProcessorMixin`` is set (only exported with torchvision), so ``ProcessorMixin`` can check
      the class of the video processor;
    * ``AutoVideoProcessor`` gets the torch-only ``Qwen3VLVideoProcessor`` for ``Qwen3VLConfig``.
    """
    global _torchvision_free_enabled
    if _torchvision_free_enabled:
        return True
    if _torchvision_available():
        return False

    import sys

    import transformers
    from transformers import Qwen3VLConfig
    from transformers import processing_utils
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    # ``processing_utils`` resolves class names on its own handle of the ``transformers`` module (a re-executed
    # lazy module, not always ``sys.modules["transformers"]``): expose the mixin on every handle.
    for module in {id(m): m for m in (processing_utils.transformers_module, transformers, sys.modules["transformers"])}.values():
        if "VideoProcessorMixin" not in module.__dict__:
            setattr(module, "VideoProcessorMixin", VideoProcessorMixin)
    AutoVideoProcessor.register(
        Qwen3VLConfig, video_processor_classes={"torchvision": _torch_only_video_processor_class()}, exist_ok=True
    )
    _torchvision_free_enabled = True
    return True


def _video_processor_class():
    if enable_torchvision_free_processing():
        return _torch_only_video_processor_class()
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor


# --------------------------------------------------------------------------------------------------------------
# tokenizer / processor
# --------------------------------------------------------------------------------------------------------------


def _training_corpus() -> list[str]:
    words = list(dict.fromkeys(_WORDS))
    lines: list[str] = []
    for w in words:
        # Each word alone, after a space, and capitalised (sentence starts), so common words become one token.
        lines += [w, " " + w, w.capitalize(), " " + w.capitalize()]
    lines += [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    lines += [str(i) for i in range(10)] + [" " + str(i) for i in range(10)]
    lines += list(".,;:!?'\"()[]{}<>-_/\\*&%$#@+=~`^|") + ["...", "?\n", ".\n", "\n\n", "  "]
    return lines


def build_tokenizer(vocab_size: int = 4096):
    """A real ``Qwen2Tokenizer`` (byte-level BPE, Qwen's pre-tokenizer) trained on a small English word list.

    Deterministic. The BPE vocabulary (256 byte symbols + merges) comes first, then :data:`SPECIAL_TOKENS` and
    :data:`ADDED_TOKENS` in that order, as in Qwen's tokenizer. ``eos_token`` is ``<|im_end|>`` and
    ``pad_token`` ``<|endoftext|>`` (Qwen3-VL's choices); there is no unk token: every string encodes.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    bpe.train_from_iterator(_training_corpus(), trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m) if isinstance(m, (list, tuple)) else tuple(m.split(" ")) for m in model["merges"]]
    for tok in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        vocab[tok] = len(vocab)

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    ids = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, *ADDED_TOKENS])
    base = len(vocab) - len(SPECIAL_TOKENS) - len(ADDED_TOKENS)
    if ids != list(range(base, len(vocab))) or len(tokenizer) != len(vocab):
        raise RuntimeError(f"special token ids not where expected: {ids} (base {base}, len {len(tokenizer)})")
    return tokenizer


def build_image_processor():
    """``Qwen2VLImageProcessorPil`` (no torchvision needed) with Qwen3-VL's patch 16 / merge 2 / mean=std=0.5."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": _IMAGE_MIN_PIXELS, "longest_edge": _IMAGE_MAX_PIXELS},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def build_video_processor():
    """``Qwen3VLVideoProcessor`` (torch-only subclass when torchvision is missing), small pixel budget."""
    cls = _video_processor_class()
    return cls(
        size={"shortest_edge": _VIDEO_MIN_PIXELS, "longest_edge": _VIDEO_MAX_PIXELS},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        fps=2,
        min_frames=4,
        max_frames=16,
        do_sample_frames=True,
        cap_pixels_per_frame=True,
    )


def build_processor(tokenizer=None):
    """A real ``Qwen3VLProcessor`` (tokenizer + PIL image processor + video processor + chat template)."""
    from transformers import Qwen3VLProcessor

    enable_torchvision_free_processing()
    return Qwen3VLProcessor(
        image_processor=build_image_processor(),
        tokenizer=tokenizer if tokenizer is not None else build_tokenizer(),
        video_processor=build_video_processor(),
        chat_template=CHAT_TEMPLATE,
    )


# --------------------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------------------


def tiny_qwen3_vl_config(tokenizer, num_hidden_layers: int = 2, hidden_size: int = 64, **overrides):
    """The ``Qwen3VLConfig`` of the tiny model, with token ids taken from ``tokenizer``.

    ``overrides``: top-level ``Qwen3VLConfig`` fields; ``text_config=`` / ``vision_config=`` dicts are merged into
    the defaults (e.g. ``text_config={"num_key_value_heads": 4}``); ``initializer_range=`` sets both towers.
    """
    from transformers import Qwen3VLConfig

    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    overrides = dict(overrides)
    init = overrides.pop("initializer_range", INITIALIZER_RANGE)
    text = dict(
        _TEXT_DEFAULTS,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers,
        initializer_range=init,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    text.update(overrides.pop("text_config", None) or {})
    vision = dict(_VISION_DEFAULTS, out_hidden_size=text["hidden_size"], initializer_range=init)
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
    config = Qwen3VLConfig(**kwargs)
    config.bos_token_id = ids["<|endoftext|>"]
    config.eos_token_id = ids["<|im_end|>"]
    config.pad_token_id = ids["<|endoftext|>"]
    return config


def build_tiny_qwen3_vl(save_dir, seed: int = 0, num_hidden_layers: int = 2, hidden_size: int = 64, **overrides) -> str:
    """Build a tiny random Qwen3-VL checkpoint (model + processor) into ``save_dir``; returns ``save_dir``.

    ``torch.manual_seed(seed)`` fixes the weights; the tokenizer does not depend on the seed. The model is fp32,
    saved as safetensors with a greedy ``generation_config.json`` (eos = ``<|im_end|>``/``<|endoftext|>``;
    the real checkpoint samples by default, this one does not, so that tests are deterministic).
    See :func:`tiny_qwen3_vl_config` for ``overrides``.
    """
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration

    save_dir = os.fspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    processor = build_processor()
    tokenizer = processor.tokenizer
    config = tiny_qwen3_vl_config(tokenizer, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, **overrides)

    fork_devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()
    model.config.dtype = torch.float32

    eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(save_dir)
    processor.save_pretrained(save_dir)
    with open(os.path.join(save_dir, "tiny_builder.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "builder": "hf_raincheck.testing.build_tiny_qwen3_vl",
                "builder_version": BUILDER_VERSION,
                "seed": seed,
                "num_hidden_layers": num_hidden_layers,
                "hidden_size": hidden_size,
                "overrides": overrides,
            },
            f,
            indent=2,
            default=str,
        )
    return save_dir


_TMP_ROOT: str | None = None


def _tmp_root() -> str:
    global _TMP_ROOT
    if _TMP_ROOT is None:
        _TMP_ROOT = tempfile.mkdtemp(prefix="hf_raincheck_tiny_")
        atexit.register(shutil.rmtree, _TMP_ROOT, True)
    return _TMP_ROOT


def tiny_qwen3_vl(tmp_path=None, seed: int = 0, **build_kwargs):
    """Build (once per directory) and load a tiny Qwen3-VL: returns ``(model, processor)``.

    The checkpoint goes to ``<tmp_path>/tiny-qwen3-vl-seed<seed>[-<hash of build_kwargs>]`` (``tmp_path`` None: a
    per-process temp dir removed at exit) and is reused if already there. ``build_kwargs`` go to
    :func:`build_tiny_qwen3_vl`. Loaded with ``AutoModelForImageTextToText.from_pretrained(path,
    dtype=torch.float32, attn_implementation="sdpa")`` (eval mode) and ``AutoProcessor.from_pretrained(path)``.
    Every call returns a freshly loaded model.
    """
    root = os.fspath(tmp_path) if tmp_path is not None else _tmp_root()
    suffix = ""
    if build_kwargs:
        key = json.dumps(build_kwargs, sort_keys=True, default=str)
        suffix = "-" + hashlib.sha1(key.encode()).hexdigest()[:10]
    path = os.path.join(root, f"tiny-qwen3-vl-seed{seed}{suffix}")
    if not os.path.exists(os.path.join(path, "tiny_builder.json")):
        build_tiny_qwen3_vl(path, seed=seed, **build_kwargs)
    return load_tiny_qwen3_vl(path)


def load_tiny_qwen3_vl(path, attn_implementation: str = "sdpa"):
    """Load a checkpoint written by :func:`build_tiny_qwen3_vl`: ``(model, processor)``, model fp32 in eval mode."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    enable_torchvision_free_processing()
    path = os.fspath(path)
    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.eval()
    processor = AutoProcessor.from_pretrained(path)
    return model, processor


# --------------------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------------------


def make_image(seed: int, size: Sequence[int] = IMAGE_SIZE):
    """A deterministic RGB ``PIL.Image`` of random coloured blocks; ``size`` is (width, height)."""
    from PIL import Image

    width, height = int(size[0]), int(size[1])
    rng = np.random.default_rng(seed)
    block = max(8, min(width, height) // 8)
    gh, gw = math.ceil(height / block), math.ceil(width / block)
    colors = rng.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8)
    pixels = np.repeat(np.repeat(colors, block, axis=0), block, axis=1)[:height, :width]
    return Image.fromarray(np.ascontiguousarray(pixels), mode="RGB")


def make_video(seed: int, num_frames: int = 4, size: Sequence[int] = IMAGE_SIZE) -> np.ndarray:
    """A deterministic video, uint8 array (frames, height, width, 3): blocks that shift a little every frame.

    Pass it as ``{"type": "video", "video": make_video(0)}``. Without metadata the video processor assumes
    24 fps (and warns once), samples ``max(4, ...)`` frames, and stamps ``<0.0 seconds>``-style timestamps.
    """
    base = np.asarray(make_image(seed, size))
    frames = [np.roll(base, shift=4 * t, axis=1) for t in range(num_frames)]
    return np.stack(frames, axis=0)


def chat_inputs(processor, messages, add_generation_prompt: bool = True, **kwargs):
    """``processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")``.

    Contains ``input_ids``, ``attention_mask``, ``mm_token_type_ids`` (0 text, 1 image, 2 video), and
    ``pixel_values``/``image_grid_thw`` and/or ``pixel_values_videos``/``video_grid_thw`` when present.
    """
    return processor.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        **kwargs,
    )
