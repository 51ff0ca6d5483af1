"""Streaming with plain `generate`: a `TextIteratorStreamer`, two turns on one `DeferredPrefillCache`.

    python examples/stream.py --tiny-random                  # a tiny random Qwen3-VL built on the spot (CPU)
    python examples/stream.py --model Qwen/Qwen3-VL-8B-Instruct --image photo.jpg --device cuda

`generate` runs in a thread and the streamer hands out the answer as it is decoded, exactly as without Raincheck.
After each answer the cache reports what the turn deferred and restored (``cache.turn_stats``): during the answer
(fused decode steps) and after it (the background worker, which the next `generate` on the cache preempts).
`next_turn_inputs` appends the second question to the exact tokens the cache holds. `RaincheckChat.stream`
(examples/chat.py) wraps all of this.

The tiny model has random weights: its answers are gibberish; the mechanics are real.
"""

from __future__ import annotations

import argparse
import threading

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, TextIteratorStreamer

from hf_raincheck import RaincheckConfig, enable_raincheck
from hf_raincheck.conversation import cache_argument, next_turn_inputs, output_cache


def load(args):
    if args.tiny_random:
        from hf_raincheck.testing import make_image, tiny_qwen3_vl

        model, processor = tiny_qwen3_vl(seed=args.seed)
        return model, processor, make_image(args.seed, (256, 256))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype, device_map=args.device)
    return model, AutoProcessor.from_pretrained(args.model), args.image


def stream_answer(model, processor, inputs, **generate_kwargs):
    """Prints the answer as it streams; returns `generate`'s output."""
    streamer = TextIteratorStreamer(processor.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}

    def work():
        try:
            result["out"] = model.generate(**inputs, streamer=streamer, return_dict_in_generate=True,
                                           **generate_kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            result["error"] = error
            streamer.end()

    thread = threading.Thread(target=work)
    thread.start()
    for piece in streamer:
        print(piece, end="", flush=True)
    thread.join()
    print()
    if "error" in result:
        raise result["error"]
    return result["out"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tiny-random", action="store_true", help="build a tiny random Qwen3-VL (no download)")
    source.add_argument("--model", help="a supported checkpoint (hub id or local path)")
    parser.add_argument("--image", help="image file or URL for --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=int, default=4)
    parser.add_argument("--guard-tokens", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    if args.model and not args.image:
        parser.error("--model needs --image")

    model, processor, image = load(args)
    enable_raincheck(model)
    config = RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size, guard_tokens=args.guard_tokens)
    kwargs = {"raincheck_config": config, "max_new_tokens": args.max_new_tokens}
    if args.tiny_random:
        kwargs["min_new_tokens"] = args.max_new_tokens  # random weights may stop at once

    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": "What is in the top left corner?"}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt").to(model.device)
    print("[turn 1] ", end="")
    out = stream_answer(model, processor, inputs, **kwargs)
    cache = output_cache(out)
    report(1, cache)

    turn2 = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": "And at the bottom right?"}])
    print("[turn 2] ", end="")
    out = stream_answer(model, processor, turn2.to(model.device), **cache_argument(cache), **kwargs)
    report(2, cache)
    cache.wait()
    print(f"after the background worker: pending {cache.pending}, restored over the cache's life {cache.stats}")
    return 0


def report(turn, cache):
    r = cache.turn_stats[-1]
    print(f"[turn {turn}] deferred {r.deferred} | restored: folded into this prefill {r.restored_in_prefill}, during "
          f"the answer {r.restored_during_decode} | pending when the answer ended {r.pending_at_answer_end}")


if __name__ == "__main__":
    raise SystemExit(main())
