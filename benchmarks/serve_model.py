"""The random-weight model that `benchmarks/serve.py --random-weights SHAPE` serves from memory with both servers.

No Hub download and nothing written to disk: a Qwen3-VL of a `shapes.SHAPES` shape (``qwen3-vl-8b``: the real
Qwen3-VL-8B shape; ``tiny``: a CPU smoke shape), built on the device in the requested dtype, with the processor of
the shipped GridQA checkpoint (the only one available offline; `hf_raincheck.gridqa.default_path`):

* Token ids: the config's image / video / vision-start / vision-end / eos / pad / bos ids are the GridQA
  tokenizer's (``<|image_pad|>`` ...), so the processor's prompts drive the model as a real checkpoint's would.
  The vocabulary (embeddings and LM head) keeps the shape's size (151936 for the 8B): decode steps cost what they
  cost; the tokenizer knows only its first ``len(tokenizer)`` ids.
* Answers: the LM head's rows are zero except those of the *answer vocabulary* (`answer_vocabulary`: the
  tokenizer's non-special tokens that are a space and letters, e.g. `` red``, and re-encode to themselves). A zero
  row scores exactly 0 while the answer rows score ~N(0, 1.3); the greedy pick is one of them (all of them
  negative has probability ~2^-60). So every generated id decodes, a decoded answer re-encodes to the same ids
  (the plain server re-tokenizes the history, so both servers see the same prompt lengths), and no answer ends
  early: eos (``<|im_end|>``) and pad are never picked, every answer has exactly ``max_tokens`` tokens in both
  servers. The matmul is the full ``[vocab, hidden]`` product either way.
* Images: the image processor's pixel bounds are set so a square image of ``32 * sqrt(image_tokens)`` pixels a
  side (patch 16, merge 2: one merged token per 32 x 32 pixels) keeps its size: ``image_tokens`` merged visual
  tokens (4096: 2048 x 2048 pixels). `image_tokens_of` counts what the processor actually gives.
"""

from __future__ import annotations

import math

import torch

from shapes import SHAPES


def answer_vocabulary(tokenizer) -> list[int]:
    """Ids of the tokenizer's plain word tokens (a space, then letters) that re-encode to themselves; any sequence
    of them decodes to text that re-encodes to the same ids (the pre-tokenizer splits before each space)."""
    special = set(tokenizer.all_special_ids)
    ids = []
    for i in range(len(tokenizer)):
        if i in special:
            continue
        text = tokenizer.decode([i])
        if len(text) > 1 and text[0] == " " and text[1:].isalpha() and \
                tokenizer.encode(text, add_special_tokens=False) == [i]:
            ids.append(i)
    if len(ids) < 16:
        raise ValueError(f"the tokenizer has only {len(ids)} plain word tokens; the random model needs >= 16")
    return ids


def image_side(image_tokens: int) -> int:
    """Pixels per side of a square image of `image_tokens` merged visual tokens (patch 16, merge 2)."""
    side = math.isqrt(image_tokens)
    if image_tokens < 4 or side * side != image_tokens:
        raise ValueError(f"--image-tokens must be a square number >= 4, got {image_tokens}")
    return 32 * side


def load_processor(image_tokens: int):
    """The GridQA processor, its image bounds opened to `image_tokens` merged tokens and its tokenizer's length
    limit to the model's context."""
    import hf_raincheck.testing  # noqa: F401 - lets AutoProcessor build Qwen3-VL processors without torchvision
    from transformers import AutoProcessor
    from transformers.image_utils import SizeDict

    from hf_raincheck.gridqa import default_path

    processor = AutoProcessor.from_pretrained(default_path())
    ip = processor.image_processor
    if (ip.patch_size, ip.merge_size) != (16, 2):
        raise ValueError(f"expected patch 16 / merge 2 in the GridQA processor, got {ip.patch_size} / {ip.merge_size}")
    pixels = image_side(image_tokens) ** 2
    ip.size = SizeDict(longest_edge=pixels, shortest_edge=min(pixels, 32 * 32 * 4))
    processor.tokenizer.model_max_length = 32768
    return processor


def image_tokens_of(processor, image) -> int:
    """Image tokens in the prompt the chat template builds for `image` (a PIL image) and a question: what both
    servers' requests give the model."""
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return int((out["input_ids"] == image_id).sum())


def build(shape: str, device: str, dtype: torch.dtype, processor):
    """A random-weight Qwen3-VL of `shape` on `device` in `dtype`, its ids those of `processor`'s tokenizer and
    its LM head restricted to the answer vocabulary (module docstring); eval mode, greedy by default."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec = SHAPES.get(shape)
    if spec is None or spec["family"] != "qwen3_vl":
        allowed = [name for name, s in SHAPES.items() if s["family"] == "qwen3_vl"]
        raise ValueError(f"--random-weights must be one of {allowed} (Qwen3-VL shapes: the GridQA processor is a "
                         f"Qwen3-VL processor), got {shape!r}")
    tok = processor.tokenizer
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in (
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"))}
    eos, pad = tok.eos_token_id, tok.pad_token_id
    text = dict(spec["text"])
    vocab = text.pop("vocab_size")
    if vocab < len(tok):
        raise ValueError(f"shape {shape}: vocab_size {vocab} < the tokenizer's {len(tok)} tokens")
    rope = dict(rope_type="default", rope_theta=text.pop("rope_theta"), mrope_section=text.pop("mrope_section"),
                mrope_interleaved=True)
    config = Qwen3VLConfig(
        text_config=dict(text, vocab_size=vocab, rope_parameters=rope, max_position_embeddings=32768,
                         bos_token_id=pad, eos_token_id=eos, pad_token_id=pad),
        vision_config=dict(spec["vision"], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=2304),
        tie_word_embeddings=False, **ids,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default)
    head = model.get_output_embeddings().weight
    if head is model.get_input_embeddings().weight:
        raise RuntimeError("the random model's LM head is tied to its embeddings; it must be its own")
    keep = torch.tensor(answer_vocabulary(tok), device=head.device)
    with torch.no_grad():
        rows = head[keep].clone()
        head.zero_()
        head[keep] = rows
    model.name_or_path = f"random/{shape}"
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = [eos, pad], pad, pad
    gen.do_sample, gen.temperature, gen.top_p, gen.top_k = False, None, None, None
    return model
