"""The tiny random Qwen3-VL checkpoints of ``hf_raincheck.testing`` load and run through the real HF paths."""

from __future__ import annotations

import os

import numpy as np
import transformers
import pytest
import torch
from packaging.version import Version
from safetensors.torch import load_file

from hf_raincheck.testing import (
    SPECIAL_TOKENS,
    build_tiny_qwen3_vl,
    chat_inputs,
    make_image,
    make_video,
)
from transformers import (
    AutoConfig,
    AutoModelForImageTextToText,
    AutoProcessor,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.utils import is_torchvision_available

TWO_IMAGE_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {
        "role": "user",
        "content": [
            {"type": "image", "image": make_image(0)},
            {"type": "text", "text": "What color is the top left block?"},
        ],
    },
    {"role": "assistant", "content": [{"type": "text", "text": "It is red."}]},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Now look at this one:"},
            {"type": "image", "image": make_image(1)},
            {"type": "text", "text": "Which picture is brighter?"},
        ],
    },
]

PAD16 = "<|image_pad|>" * 16


def _new_tokens(model, inputs, n=5):
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :]


def test_checkpoint_loads_through_auto_classes(tiny_vl_path):
    files = set(os.listdir(tiny_vl_path))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= files
    assert AutoConfig.from_pretrained(tiny_vl_path).model_type == "qwen3_vl"

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32, attn_implementation="sdpa")
    assert isinstance(model, Qwen3VLForConditionalGeneration)
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    assert isinstance(processor, Qwen3VLProcessor)
    assert type(processor.tokenizer).__name__ == "Qwen2Tokenizer"
    assert type(processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
    if not is_torchvision_available():
        assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"


def test_token_ids_are_wired_into_the_config(tiny_vl):
    model, processor = tiny_vl
    tok = processor.tokenizer
    cfg = model.config
    ids = dict(zip(SPECIAL_TOKENS, tok.convert_tokens_to_ids(list(SPECIAL_TOKENS))))
    assert cfg.image_token_id == ids["<|image_pad|>"] == processor.image_token_id
    assert cfg.video_token_id == ids["<|video_pad|>"] == processor.video_token_id
    assert cfg.vision_start_token_id == ids["<|vision_start|>"]
    assert cfg.vision_end_token_id == ids["<|vision_end|>"]
    assert cfg.text_config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert model.generation_config.pad_token_id == ids["<|endoftext|>"]
    # Qwen's special-token order: consecutive ids after the BPE vocabulary.
    assert list(ids.values()) == list(range(ids["<|endoftext|>"], ids["<|endoftext|>"] + len(SPECIAL_TOKENS)))


def test_tokenizer_encodes_anything_and_common_words_are_single_tokens(tiny_vl):
    tok = tiny_vl[1].tokenizer
    for text in ["What color is the image on the left?", "Quokka zebra 1234 :) ünïcødé 你好\n\tend"]:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text
    for word in ["What", " color", " image", " video", " picture", " describe", " left", " many"]:
        assert len(tok(word)["input_ids"]) == 1, word


def test_chat_template_renders_qwen3_vl_format(tiny_vl):
    processor = tiny_vl[1]
    text = processor.apply_chat_template(TWO_IMAGE_CHAT, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What color is the top left block?<|im_end|>\n"
        "<|im_start|>assistant\nIt is red.<|im_end|>\n"
        "<|im_start|>user\nNow look at this one:<|vision_start|><|image_pad|><|vision_end|>"
        "Which picture is brighter?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = processor.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False, tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"


def test_two_image_conversation_runs_through_generate(tiny_vl):
    model, processor = tiny_vl
    inputs = chat_inputs(processor, TWO_IMAGE_CHAT)
    assert {"input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"} <= set(inputs)
    assert inputs["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]  # 128x128 -> 8x8 patches
    assert inputs["pixel_values"].shape == (128, 3 * 2 * 16 * 16)
    ids, types = inputs["input_ids"][0], inputs["mm_token_type_ids"][0]
    assert ((ids == model.config.image_token_id) == (types == 1)).all()
    assert int((types == 1).sum()) == 32 and int((types == 2).sum()) == 0
    assert PAD16 in processor.decode(ids)

    first = _new_tokens(model, inputs)
    assert first.shape == (5,)
    assert torch.equal(first, _new_tokens(model, inputs))


def test_video_runs_through_generate(tiny_vl):
    model, processor = tiny_vl
    chat = [
        {
            "role": "user",
            "content": [{"type": "video", "video": make_video(0)}, {"type": "text", "text": "What happens?"}],
        }
    ]
    inputs = chat_inputs(processor, chat)
    assert {"mm_token_type_ids", "pixel_values_videos", "video_grid_thw"} <= set(inputs)
    assert inputs["video_grid_thw"].tolist() == [[2, 8, 8]]  # 4 frames -> 2 temporal patches of 8x8
    ids, types = inputs["input_ids"][0], inputs["mm_token_type_ids"][0]
    assert ((ids == model.config.video_token_id) == (types == 2)).all()
    assert int((types == 2).sum()) == 32
    text = processor.decode(ids)
    # transformers 5.23 and 5.24 keep the template's outer <|vision_start|>/<|vision_end|> around the per-frame
    # spans; 5.25's processor replaces them
    per_frame = "<|vision_start|>" + "<|video_pad|>" * 16 + "<|vision_end|>"
    frames = f"<0.0 seconds>{per_frame}<0.1 seconds>{per_frame}"
    outer = Version(transformers.__version__).release < (5, 25)
    assert (f"<|vision_start|>{frames}<|vision_end|>" if outer else f"user\n{frames}What happens?") in text
    assert _new_tokens(model, inputs).shape == (5,)


def test_image_and_video_in_one_turn(tiny_vl):
    model, processor = tiny_vl
    chat = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": make_image(2)},
                {"type": "video", "video": make_video(1, num_frames=8)},
                {"type": "text", "text": "Describe both."},
            ],
        }
    ]
    inputs = chat_inputs(processor, chat)
    # No metadata: the processor assumes 24 fps and samples at 2 fps, floored at min_frames=4 -> 2 temporal patches.
    assert inputs["video_grid_thw"].tolist() == [[2, 8, 8]]
    assert torch.bincount(inputs["mm_token_type_ids"][0], minlength=3)[1:].tolist() == [16, 32]
    assert _new_tokens(model, inputs).shape == (5,)


def test_video_pixels_match_image_pixels_for_a_still_video(tiny_vl):
    # A still 2-frame video and the same picture as an image go through different processors (torch video
    # processor vs PIL image processor); at the native 128x128 size no resampling happens, so they must agree.
    processor = tiny_vl[1]
    image = make_image(5)
    still = np.stack([np.asarray(image)] * 2)
    img = processor.image_processor(images=[image], return_tensors="pt")
    vid = processor.video_processor(videos=[still], do_sample_frames=False, return_tensors="pt")
    assert vid["video_grid_thw"].tolist() == img["image_grid_thw"].tolist() == [[1, 8, 8]]
    torch.testing.assert_close(vid["pixel_values_videos"], img["pixel_values"], atol=1e-5, rtol=0)


def test_text_only_prompt(tiny_vl):
    model, processor = tiny_vl
    inputs = chat_inputs(processor, [{"role": "user", "content": "Tell me a story."}])
    assert "pixel_values" not in inputs
    assert (inputs["mm_token_type_ids"] == 0).all()
    assert _new_tokens(model, inputs).shape == (5,)


def test_random_init_is_not_degenerate(tiny_vl):
    model, processor = tiny_vl

    def logits(seed):
        chat = [{"role": "user", "content": [{"type": "image", "image": make_image(seed)}, {"type": "text", "text": "Describe it."}]}]
        with torch.no_grad():
            return model(**chat_inputs(processor, chat)).logits[0]

    a, b = logits(0), logits(1)
    assert a.std() > 0.3
    assert a.argmax(-1).unique().numel() > a.shape[0] // 2  # greedy choices vary across positions
    assert (a[-1] - b[-1]).abs().max() > 0.1  # the image matters
    gen = _new_tokens(model, chat_inputs(processor, TWO_IMAGE_CHAT), n=8)
    assert len(set(gen.tolist())) > 2


def test_build_is_deterministic_per_seed(tmp_path):
    a = load_file(os.path.join(build_tiny_qwen3_vl(tmp_path / "a", seed=3), "model.safetensors"))
    b = load_file(os.path.join(build_tiny_qwen3_vl(tmp_path / "b", seed=3), "model.safetensors"))
    c = load_file(os.path.join(build_tiny_qwen3_vl(tmp_path / "c", seed=4), "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_overrides_reach_the_config(tmp_path):
    path = build_tiny_qwen3_vl(
        tmp_path / "big", num_hidden_layers=3, hidden_size=96, text_config={"num_key_value_heads": 4}
    )
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.text_config.num_hidden_layers == 3
    assert cfg.text_config.hidden_size == 96 == cfg.vision_config.out_hidden_size
    assert cfg.text_config.num_key_value_heads == 4


@pytest.mark.gpu
def test_tiny_model_generates_on_gpu(tiny_vl_path):
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).cuda().eval()
    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    inputs = chat_inputs(processor, TWO_IMAGE_CHAT).to("cuda")
    assert _new_tokens(model, inputs).shape == (5,)
