"""A two-turn chat about one image with Raincheck: TTFT per turn and how the deferred tokens were restored.

    python examples/chat.py --tiny-random            # a tiny random Qwen3-VL built on the spot (CPU, seconds)
    python examples/chat.py --model Qwen/Qwen3-VL-8B-Instruct --image photo.jpg --device cuda

The tiny model has random weights: its answers are gibberish, but every mechanism (deferral, fused decode
steps, completion, the second turn on the returned cache) runs exactly as with a real checkpoint.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor
from transformers.generation.streamers import BaseStreamer

from hf_raincheck import RaincheckConfig, enable_raincheck
from hf_raincheck.conversation import next_turn_inputs


class FirstTokenTimer(BaseStreamer):
    """Records when `generate` hands out its first new token (the first `put` is the prompt)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first = None
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass

    @property
    def ttft_ms(self) -> float:
        return 1000.0 * ((self.first or time.perf_counter()) - self.start)


def restored_total(cache) -> int:
    if cache is None:
        return 0
    return cache.stats.during_decode + cache.stats.after_answer + cache.stats.during_prefill


def load(args):
    if args.tiny_random:
        from hf_raincheck.testing import make_image, tiny_qwen3_vl

        model, processor = tiny_qwen3_vl(seed=args.seed)
        return model, processor, make_image(args.seed, (256, 256))
    from PIL import Image

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype, device_map=args.device)
    processor = AutoProcessor.from_pretrained(args.model)
    return model, processor, Image.open(args.image).convert("RGB")


def run_turn(model, inputs, config, past, max_new_tokens):
    inputs = {k: v.to(model.device) for k, v in inputs.items()}
    timer = FirstTokenTimer()
    out = model.generate(
        **inputs,
        raincheck_config=config,
        past_key_values=past,
        max_new_tokens=max_new_tokens,
        streamer=timer,
        return_dict_in_generate=True,
    )
    return out, out.sequences[0, inputs["input_ids"].shape[1] :], timer.ttft_ms


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tiny-random", action="store_true", help="build a tiny random Qwen3-VL (no download)")
    source.add_argument("--model", help="a Qwen3-VL checkpoint (hub id or local path)")
    parser.add_argument("--image", help="image file for --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=int, default=4)
    parser.add_argument("--guard-tokens", type=int, default=2)
    parser.add_argument("--completion", default="blocking", choices=["blocking", "next_turn"])
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    if args.model and not args.image:
        parser.error("--model needs --image")

    model, processor, image = load(args)
    enable_raincheck(model)
    config = RaincheckConfig(
        retention=args.retention,
        chunk_size=args.chunk_size,
        guard_tokens=args.guard_tokens,
        completion=args.completion,
    )
    print(f"model: {type(model).__name__}  config: {config}")
    questions = ["What is in the top left corner?", "And what is at the bottom right?"]
    out = past = None
    for turn, question in enumerate(questions, 1):
        if turn == 1:
            message = {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}
            inputs = processor.apply_chat_template(
                [message], add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
            )
        else:  # the exact tokens the cache holds, plus the template's rendering of the new message
            inputs = next_turn_inputs(processor, out.sequences, [{"role": "user", "content": question}])
        before = restored_total(past)
        out, answer_ids, ttft = run_turn(model, inputs, config, past, args.max_new_tokens)
        past = out.past_key_values
        plan = past.plan
        print(f"\n[turn {turn}] user: {question}")
        print(f"[turn {turn}] assistant: {processor.decode(answer_ids, skip_special_tokens=True)!r}")
        print(
            f"[turn {turn}] TTFT {ttft:.1f} ms | visual tokens {sum(e - s for s, e in plan.spans)}: "
            f"kept first {plan.kept.numel()}, deferred {plan.total_deferred} | restored this turn "
            f"{restored_total(past) - before} (fused into decode steps: {past.stats.during_decode}, after answers: "
            f"{past.stats.after_answer}, folded into a later prefill: {past.stats.during_prefill}) | "
            f"pending {past.pending}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
