"""Building the next turn's inputs from the exact tokens a cache holds, with the processor's chat template, and
passing the cache back to ``generate`` under the name the installed transformers takes."""

from __future__ import annotations

import torch
from transformers import BatchFeature

from .transformers_coupling import CACHE_ARGUMENT, output_cache

__all__ = ["next_turn_inputs", "batch_inputs", "cache_argument", "output_cache"]

_ANSWER = "RAINCHECK_PREVIOUS_ANSWER"


def next_turn_inputs(processor, sequences: torch.Tensor, new_messages: list[dict], end_of_turn: str | None = None):
    """Model inputs for the next turn of a chat: ``sequences`` (the previous output, prompt + answer) + new messages.

    Re-rendering the whole history through the chat template can tokenize the previous answer differently from
    the tokens that were generated (and cached). This keeps those tokens and renders only what the template
    adds after an assistant answer: the end of the answer's turn, the new messages and the generation prompt.
    Only the new messages' images / videos are processed (a `DeferredPrefillCache` keeps the grids of the media
    it already holds).

    Args:
        processor: the model's processor (its chat template must render an assistant answer verbatim).
        sequences: ``[1, L]`` the previous `generate` output's ``sequences``.
        new_messages: the new chat messages (usually one user message, content as for `apply_chat_template`).
        end_of_turn: the token that closes an assistant turn (default: the tokenizer's ``<|im_end|>``); added
            when the answer stopped without it (e.g. at ``max_new_tokens``).
    """
    tokenizer = processor.tokenizer
    end_of_turn = end_of_turn or "<|im_end|>"
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ANSWER}]
    before = processor.apply_chat_template(probe, tokenize=False)
    after = processor.apply_chat_template(probe + list(new_messages), tokenize=False, add_generation_prompt=True)
    anchor = _ANSWER + end_of_turn
    if anchor not in before or not after.startswith(before[: before.index(anchor) + len(anchor)]):
        raise ValueError(
            "next_turn_inputs: the chat template does not render an assistant answer followed by "
            f"{end_of_turn!r}; pass end_of_turn= for this template"
        )
    suffix = after[before.index(anchor) + len(anchor) :]
    images, videos = [], []
    for message in new_messages:
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image":
                    images.append(part.get("image") or part.get("url") or part.get("path"))
                elif part.get("type") == "video":
                    videos.append(part.get("video") or part.get("url") or part.get("path"))
    kwargs = {"text": [suffix], "return_tensors": "pt"}
    if images:
        kwargs["images"] = images
    if videos:
        kwargs["videos"] = videos
    suffix_inputs = processor(**kwargs)
    end_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    history = sequences.to("cpu")
    if int(history[0, -1]) != end_id:
        history = torch.cat([history, torch.tensor([[end_id]], dtype=history.dtype)], 1)
    inputs = dict(suffix_inputs)
    inputs["input_ids"] = torch.cat([history, suffix_inputs["input_ids"]], 1)
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    if "mm_token_type_ids" in suffix_inputs:
        ids = inputs["input_ids"]
        types = torch.zeros_like(ids)
        types[ids == processor.image_token_id] = 1
        types[ids == getattr(processor, "video_token_id", -1)] = 2
        inputs["mm_token_type_ids"] = types
    return BatchFeature(inputs)


def cache_argument(cache) -> dict:
    """``{name: cache}`` for ``model.generate(**inputs, **cache_argument(cache), ...)``: a returned cache passed back
    under the name the installed transformers' ``generate`` takes (``past_key_values`` in 5.23, ``cache`` from
    5.24, where the old name still works with a ``FutureWarning``). For scripts that run on either version;
    `output_cache(out)` reads a returned cache the same way (``out.past_key_values`` / ``out.cache``)."""
    return {CACHE_ARGUMENT: cache}


def batch_inputs(rows: list, pad_token_id: int) -> BatchFeature:
    """One left-padded batch from per-row model inputs (e.g. each row's `next_turn_inputs`): ``input_ids``,
    ``attention_mask`` and ``mm_token_type_ids`` padded on the left (``pad_token_id``, 0), the media tensors
    (``pixel_values``, grids, ...) concatenated in row order, as the processor lays out a batch. Pass the result
    to ``generate(..., past_key_values=BatchedDeferredPrefillCache(row_caches))`` (`cache_argument`) to continue
    every row at once."""
    if not rows:
        raise ValueError("batch_inputs: rows must be a non-empty list of model inputs")
    width = max(int(r["input_ids"].shape[-1]) for r in rows)
    out: dict = {}
    for key, fill in (("input_ids", pad_token_id), ("attention_mask", 0), ("mm_token_type_ids", 0)):
        if key == "mm_token_type_ids" and not any(key in r for r in rows):
            continue
        padded = []
        for r in rows:
            ids = r["input_ids"].reshape(1, -1)
            value = r.get(key)
            if value is None:
                value = torch.ones_like(ids) if key == "attention_mask" else torch.zeros_like(ids)
            value = value.reshape(1, -1)
            padded.append(torch.cat([value.new_full((1, width - value.shape[1]), fill), value], 1))
        out[key] = torch.cat(padded)
    media = sorted({k for r in rows for k in r if k not in ("input_ids", "attention_mask", "mm_token_type_ids")})
    for key in media:
        parts = [r[key] for r in rows if r.get(key) is not None]
        out[key] = torch.cat([torch.as_tensor(p) for p in parts])
    return BatchFeature(out)
