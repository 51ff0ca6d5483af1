"""Raincheck through `pipeline("image-text-to-text")`: one question about an image, under Full, Hard and Raincheck.

    python examples/pipeline.py --tiny-random                # a tiny random Qwen3-VL built on the spot (CPU)
    python examples/pipeline.py --model Qwen/Qwen3-VL-8B-Instruct --image photo.jpg --device cuda

`enable_raincheck(pipe)` enables the pipeline's model, whose `generate` then accepts ``raincheck_config`` through
``generate_kwargs``; a top-level ``pipe(..., raincheck_config=cfg)`` raises (transformers would hand it to the
processor, which drops it). ``model.generation_config.raincheck_config = cfg`` sets a default for every call.
A pipeline call is one turn and its cache is dropped when it returns, so deferred tokens left when the answer ends
are useless there: ``completion="next_turn"`` skips restoring them (the default, ``"background"``, would start a
worker that stops as soon as the cache is freed). For several turns on one cache use `RaincheckChat`
(examples/chat.py) or `generate` with `next_turn_inputs` (examples/stream.py).

The tiny model has random weights: its answers are gibberish (and differ between policies); the mechanics are real.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, pipeline

from hf_raincheck import RaincheckConfig, enable_raincheck


def load(args):
    if args.tiny_random:
        from hf_raincheck.testing import make_image, tiny_qwen3_vl

        model, processor = tiny_qwen3_vl(seed=args.seed)
        return model, processor, make_image(args.seed, (256, 256))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype, device_map=args.device)
    return model, AutoProcessor.from_pretrained(args.model), args.image


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tiny-random", action="store_true", help="build a tiny random Qwen3-VL (no download)")
    source.add_argument("--model", help="a supported checkpoint (hub id or local path)")
    parser.add_argument("--image", help="image file or URL for --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    if args.model and not args.image:
        parser.error("--model needs --image")

    model, processor, image = load(args)
    pipe = enable_raincheck(pipeline("image-text-to-text", model=model, processor=processor))
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "Describe the picture."}]}]
    policies = {
        "full": RaincheckConfig(policy="full"),
        "hard": RaincheckConfig(policy="hard", retention=args.retention),
        "raincheck": RaincheckConfig(policy="raincheck", retention=args.retention, completion="next_turn"),
    }
    generate_kwargs = {"max_new_tokens": args.max_new_tokens}
    if args.tiny_random:
        generate_kwargs["min_new_tokens"] = args.max_new_tokens  # random weights may stop at once
    pipe(text=messages, generate_kwargs=dict(generate_kwargs, raincheck_config=policies["full"]))  # warm-up
    for name, config in policies.items():
        start = time.perf_counter()
        out = pipe(text=messages, generate_kwargs=dict(generate_kwargs, raincheck_config=config))
        elapsed = time.perf_counter() - start
        answer = out[0]["generated_text"][-1]["content"]
        print(f"[{name}] {elapsed * 1e3:.0f} ms: {answer!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
