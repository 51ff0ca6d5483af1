"""Tiny *random* Qwen3-VL checkpoints that load through the real ``from_pretrained`` paths.

Nothing here downloads anything: the tokenizer is trained on the spot (byte-level BPE, like Qwen's),
the model is randomly initialised from a seed, and both are written with ``save_pretrained`` so that
``AutoModelForImageTextToText.from_pretrained`` / ``AutoProcessor.from_pretrained`` load them exactly like a
Hub checkpoint.

What a checkpoint built by :func:`build_tiny_qwen3_vl` contains:

* ``config.json`` + ``model.safetensors`` + ``generation_config.json``: a ``Qwen3VLForConditionalGeneration``
  (text: 2 layers, hidden 64, 4 query / 2 KV heads of dim 16, interleaved M-RoPE; vision: 2 blocks, hidden 32,
  patch 16, spatial merge 2, temporal patch 2, deepstack on both vision blocks), fp32.
* ``tokenizer.json`` / ``tokenizer_config.json``: a real ``Qwen2Tokenizer`` (:mod:`.tokenizer`).
* ``chat_template.jinja``: the Qwen3-VL chat template structure.
* ``processor_config.json``, its image processor: ``Qwen2VLImageProcessorPil`` (what ``AutoImageProcessor`` picks
  for ``qwen3_vl`` without torchvision), patch 16, merge 2, mean/std 0.5, pixels in [64*64, 256*256]: a 128x128
  image becomes an 8x8 patch grid, i.e. 16 ``<|image_pad|>`` tokens.
* its video processor: ``Qwen3VLVideoProcessor`` (fps 2, 4..16 frames, per-frame pixel cap on):
  4 frames of 128x128 become a 2x8x8 grid, i.e. two ``<t seconds><|vision_start|><|video_pad|>*16<|vision_end|>``
  spans.

Without torchvision the processor loads through :func:`~.torchvision_free.enable_torchvision_free_processing`.
"""

from __future__ import annotations

import os

from .checkpoint import cached_checkpoint, load_checkpoint, qwen_config, save_checkpoint, seeded_model
from .tokenizer import build_tokenizer
from .torchvision_free import enable_torchvision_free_processing, qwen3_vl_video_processor_class

__all__ = [
    "BUILDER_VERSION",
    "CHAT_TEMPLATE",
    "build_image_processor",
    "build_processor",
    "build_tiny_qwen3_vl",
    "build_video_processor",
    "load_tiny_qwen3_vl",
    "tiny_qwen3_vl",
    "tiny_qwen3_vl_config",
]

#: Bump when the checkpoint layout or contents change (recorded in ``tiny_builder.json``).
BUILDER_VERSION = 1

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

_IMAGE_MIN_PIXELS = 64 * 64
_IMAGE_MAX_PIXELS = 256 * 256
_VIDEO_MIN_PIXELS = 64 * 64
_VIDEO_MAX_PIXELS = 8 * 128 * 128


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
    cls = qwen3_vl_video_processor_class()
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


def build_processor(tokenizer=None, image_processor=None):
    """A real ``Qwen3VLProcessor`` (tokenizer + PIL image processor + video processor + chat template); the tiny
    models' tokenizer and image processor unless others are given."""
    from transformers import Qwen3VLProcessor

    enable_torchvision_free_processing()
    return Qwen3VLProcessor(
        image_processor=image_processor if image_processor is not None else build_image_processor(),
        tokenizer=tokenizer if tokenizer is not None else build_tokenizer(),
        video_processor=build_video_processor(),
        chat_template=CHAT_TEMPLATE,
    )


def tiny_qwen3_vl_config(tokenizer, num_hidden_layers: int = 2, hidden_size: int = 64, **overrides):
    """The ``Qwen3VLConfig`` of the tiny model, with token ids taken from ``tokenizer``.

    ``overrides``: top-level ``Qwen3VLConfig`` fields; ``text_config=`` / ``vision_config=`` dicts are merged into
    the defaults (e.g. ``text_config={"num_key_value_heads": 4}``); ``initializer_range=`` sets both towers.
    """
    from transformers import Qwen3VLConfig

    text = dict(_TEXT_DEFAULTS, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_hidden_layers)
    return qwen_config(Qwen3VLConfig, tokenizer, text, _VISION_DEFAULTS, overrides)


def build_tiny_qwen3_vl(save_dir, seed: int = 0, num_hidden_layers: int = 2, hidden_size: int = 64, **overrides) -> str:
    """Build a tiny random Qwen3-VL checkpoint (model + processor) into ``save_dir``; returns ``save_dir``.

    ``torch.manual_seed(seed)`` fixes the weights; the tokenizer does not depend on the seed. The model is fp32,
    saved as safetensors with a greedy ``generation_config.json`` (eos = ``<|im_end|>``/``<|endoftext|>``;
    the real checkpoint samples by default, this one does not, so that tests are deterministic).
    See :func:`tiny_qwen3_vl_config` for ``overrides``.
    """
    from transformers import Qwen3VLForConditionalGeneration

    save_dir = os.fspath(save_dir)
    os.makedirs(save_dir, exist_ok=True)
    processor = build_processor()
    config = tiny_qwen3_vl_config(
        processor.tokenizer, num_hidden_layers=num_hidden_layers, hidden_size=hidden_size, **overrides
    )
    model = seeded_model(Qwen3VLForConditionalGeneration, config, seed)
    builder = {
        "builder": "hf_raincheck.testing.build_tiny_qwen3_vl",
        "builder_version": BUILDER_VERSION,
        "seed": seed,
        "num_hidden_layers": num_hidden_layers,
        "hidden_size": hidden_size,
        "overrides": overrides,
    }
    return save_checkpoint(model, processor, save_dir, builder)


def tiny_qwen3_vl(tmp_path=None, seed: int = 0, **build_kwargs):
    """Build (once per directory) and load a tiny Qwen3-VL: returns ``(model, processor)``.

    The checkpoint goes to ``<tmp_path>/tiny-qwen3-vl-seed<seed>[-<hash of build_kwargs>]`` (``tmp_path`` None: a
    per-process temp dir removed at exit) and is reused if already there. ``build_kwargs`` go to
    :func:`build_tiny_qwen3_vl`. Loaded with ``AutoModelForImageTextToText.from_pretrained(path,
    dtype=torch.float32, attn_implementation="sdpa")`` (eval mode) and ``AutoProcessor.from_pretrained(path)``.
    Every call returns a freshly loaded model.
    """
    path = cached_checkpoint("tiny-qwen3-vl", build_tiny_qwen3_vl, tmp_path, seed, **build_kwargs)
    return load_tiny_qwen3_vl(path)


def load_tiny_qwen3_vl(path, attn_implementation: str = "sdpa", **from_pretrained_kwargs):
    """Load a checkpoint written by :func:`build_tiny_qwen3_vl`: ``(model, processor)``, model fp32 in eval mode.

    ``from_pretrained_kwargs`` go to the model's ``from_pretrained`` (e.g. ``device_map=``).
    """
    return load_checkpoint(path, attn_implementation, **from_pretrained_kwargs)
