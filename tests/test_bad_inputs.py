"""Bad inputs get clear errors naming the argument; high-bit-depth images reach the model scaled, not clipped."""

from __future__ import annotations

import os
import re
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from hf_raincheck import transformers_coupling as hf
from hf_raincheck import DeferredPrefillCache, RaincheckChat, RaincheckConfig, enable_raincheck
from hf_raincheck.conversation import cache_argument
from hf_raincheck.images import eight_bit, open_image
from hf_raincheck.testing import load_tiny_qwen3_5, load_tiny_qwen3_vl, make_image

CFG = RaincheckConfig(retention=0.3, chunk_size=2, guard_tokens=1, completion="blocking")


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    return load_tiny_qwen3_vl(tiny_vl_path)


# ---------------------------------------------------------------- empty images, text that is not Unicode
@pytest.mark.parametrize("size", [(0, 0), (0, 16), (16, 0)])
def test_an_empty_image_is_refused_naming_the_argument(vl, size):
    chat = RaincheckChat(*vl, CFG, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"RaincheckChat\.ask: images is an empty image \({size[0]}x{size[1]} px\)"):
        chat.ask("What is in it?", images=Image.new("RGB", size))
    with pytest.raises(ValueError, match=r"RaincheckChat\.stream: images\[1\] is an empty image"):
        chat.stream("What is in it?", images=[make_image(0), Image.new("RGB", size)])
    assert chat.messages == [] and chat.cache is None  # nothing was sent


@pytest.mark.parametrize("shape", [(0, 32, 32, 3), (4, 0, 32, 3), (4, 32, 0, 3)])
def test_an_empty_video_is_refused_naming_the_argument(vl, shape):
    chat = RaincheckChat(*vl, CFG, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"RaincheckChat\.ask: videos is an empty video \(shape {re.escape(str(shape))}\)"):
        chat.ask("What happens?", videos=np.zeros(shape, dtype=np.uint8))


def test_an_unreadable_image_file_is_refused_naming_the_argument(vl, tmp_path):
    bad = tmp_path / "not_an_image.png"
    bad.write_bytes(b"not a png")
    chat = RaincheckChat(*vl, CFG, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"RaincheckChat\.ask: images cannot be read as an image: .*not_an_image"):
        chat.ask("What is in it?", images=str(bad))


def test_text_with_a_lone_surrogate_is_refused_naming_the_argument(vl):
    chat = RaincheckChat(*vl, CFG, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"RaincheckChat\.ask: text holds a character that is not valid Unicode text "
                                         r"\('\\ud800' at index 3"):
        chat.ask("abc\ud800", images=make_image(0))
    with pytest.raises(ValueError, match=r"RaincheckChat\.stream: text holds a character"):
        chat.stream("\udfff and more")
    with pytest.raises(ValueError, match=r"RaincheckChat: system holds a character"):
        RaincheckChat(*vl, CFG, system="be brief \ud83d")
    assert chat.ask("abc \N{SNOWMAN}", images=make_image(0))  # valid non-ASCII text is fine


# ---------------------------------------------------------------- a cache built for another layer count
@pytest.fixture(scope="module")
def hybrid(tiny_qwen3_5_path):
    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    return enable_raincheck(model), processor


@pytest.mark.parametrize("wrong", [-2, -1, +1, +4])
def test_a_cache_for_another_layer_count_is_refused_naming_num_layers(hybrid, wrong):
    from hf_raincheck.testing import chat_inputs

    model, processor = hybrid
    layers = model.config.get_text_config().num_hidden_layers
    assert layers == 4
    inputs = chat_inputs(processor, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    cache = DeferredPrefillCache(layers + wrong)
    with pytest.raises(ValueError, match=rf"{hf.CACHE_ARGUMENT}: DeferredPrefillCache\(num_layers={layers + wrong}\) does "
                                         rf"not fit this model, which has {layers} decoder layers; build it with "
                                         rf"num_layers={layers}"):
        model.generate(**inputs, **cache_argument(cache), raincheck_config=CFG, max_new_tokens=2)
    assert cache.length == 0
    right = DeferredPrefillCache(layers)
    out = model.generate(**inputs, **cache_argument(right), raincheck_config=CFG, max_new_tokens=2)
    assert right.length == inputs["input_ids"].shape[1] + 1 and out.shape[1] == right.length + 1


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "2", None])
def test_a_cache_needs_a_positive_int_num_layers(value):
    with pytest.raises(ValueError, match=r"DeferredPrefillCache: num_layers must be an int >= 1 \(the model's decoder "
                                         rf"layers\), got {value!r}"):
        DeferredPrefillCache(value)


# ---------------------------------------------------------------- 16-bit, int32 and float images
def gradient(seed: int = 0) -> np.ndarray:
    """An 8-bit grey image (64 x 96) that uses the whole 0..255 range."""
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 256, size=(64, 96), dtype=np.uint8)
    values[0, 0], values[0, 1] = 0, 255
    return values


def test_eight_bit_scales_high_bit_depth_images_instead_of_clipping():
    grey = gradient()
    wide = grey.astype(np.int64) * 257  # the same picture with 16-bit values
    cases = {
        "I;16": Image.fromarray(wide.astype(np.uint16)),  # Pillow's mode for uint16 arrays
        "I (16-bit values)": Image.fromarray(wide.astype(np.int32)),
        "I (8-bit values)": Image.fromarray(grey.astype(np.int32)),
        "I (signed range)": Image.fromarray((grey.astype(np.int32) - 128) * 1000),
        "F (0..1)": Image.fromarray(grey.astype(np.float32) / 255),
        "F (0..255)": Image.fromarray(grey.astype(np.float32)),
        "F (any range)": Image.fromarray(grey.astype(np.float32) * 3.5 - 20),
    }
    assert cases["I;16"].mode == "I;16" and cases["I (16-bit values)"].mode == "I" and cases["F (0..1)"].mode == "F"
    for what, image in cases.items():
        converted = eight_bit(image)
        assert converted.mode == "L" and converted.size == (96, 64), what
        np.testing.assert_array_equal(np.asarray(converted), grey, err_msg=what)
        # what Pillow alone makes of it: clipped (mostly white for 16-bit values)
        if what in ("I;16", "I (16-bit values)"):
            assert (np.asarray(image.convert("RGB"))[..., 0] == 255).mean() > 0.9
    big_endian = Image.frombytes("I;16B", (96, 64), wide.astype(">u2").tobytes())
    np.testing.assert_array_equal(np.asarray(eight_bit(big_endian)), grey)
    flat = Image.fromarray(np.full((4, 4), 70000, dtype=np.int32))  # constant, beyond 16 bits: mid-grey
    assert np.asarray(eight_bit(flat)).tolist() == [[128] * 4] * 4
    rgb = make_image(0)
    assert eight_bit(rgb) is rgb  # 8-bit modes come back unchanged
    nan = np.ones((4, 4), dtype=np.float32)
    nan[1, 1] = np.nan
    with pytest.raises(ValueError, match=r"images\[0\]: a 'F' image with non-finite values \(NaN or inf\)"):
        eight_bit(Image.fromarray(nan), "images[0]")


def test_open_image_scales_a_16_bit_png_and_names_the_argument(tmp_path):
    grey = gradient(1)
    path = tmp_path / "sixteen.png"
    Image.fromarray((grey.astype(np.uint16) * 257)).save(path)
    with Image.open(path) as raw:
        assert raw.mode.startswith("I")  # Pillow opens 16-bit PNGs as "I;16" / "I"
    opened = open_image(path)
    assert opened.mode == "RGB"
    for channel in range(3):
        np.testing.assert_array_equal(np.asarray(opened)[..., channel], grey)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG garbage")
    with pytest.raises(ValueError, match=r"images: .*bad\.png' cannot be read as an image"):
        open_image(bad, "images")


def first_turn_keys(model, processor, image) -> list[torch.Tensor]:
    """The first turn's cached keys (they depend on every pixel the processor received) and its answer."""
    chat = RaincheckChat(model, processor, CFG, max_new_tokens=3, min_new_tokens=3)
    answer = chat.ask("What is in the picture?", images=image)
    keys = [layer.keys[:, :, : chat.cache.length].clone() for layer in chat.cache.layers]
    chat.close()
    return keys, answer


def test_chat_gives_the_model_high_bit_depth_images_scaled(vl, tmp_path):
    model, processor = vl
    grey = np.repeat(np.repeat(gradient(2), 2, axis=0), 2, axis=1)[:128, :128]  # 128 x 128: 16 merged tokens
    expected_keys, expected_answer = first_turn_keys(model, processor, Image.fromarray(grey).convert("RGB"))
    sixteen = tmp_path / "sixteen.png"
    Image.fromarray(grey.astype(np.uint16) * 257).save(sixteen)
    images = {
        "I;16": Image.fromarray(grey.astype(np.uint16) * 257),
        "I": Image.fromarray(grey.astype(np.int32) * 257),
        "F": Image.fromarray(grey.astype(np.float32) / 255),
        "16-bit PNG path": str(sixteen),
    }
    for what, image in images.items():
        keys, answer = first_turn_keys(model, processor, image)
        assert answer == expected_answer, what
        for a, b in zip(keys, expected_keys):
            torch.testing.assert_close(a, b, msg=what)
    # the check can fail: the all-white picture Pillow's clipping makes is another input
    white_keys, _ = first_turn_keys(model, processor, images["I;16"].convert("RGB"))
    assert not all(torch.allclose(a, b) for a, b in zip(white_keys, expected_keys))
    # the session keeps the images as given
    chat = RaincheckChat(model, processor, CFG, max_new_tokens=2)
    chat.ask("And this?", images=images["I;16"])
    assert chat.messages[0]["content"][0]["image"] is images["I;16"]


def test_the_demo_loader_scales_16_bit_images(tmp_path):
    pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e .[demo]")
    sys.path.insert(0, os.path.dirname(__file__))
    from app_support import import_app

    app = import_app()
    grey = np.repeat(np.repeat(gradient(3), 2, axis=0), 2, axis=1)
    path = tmp_path / "sixteen.png"
    Image.fromarray(grey.astype(np.uint16) * 257).save(path)
    loaded = app.load_image(str(path))
    assert loaded.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(loaded)[..., 0], grey)
