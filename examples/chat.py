"""A two-turn chat about one image with `RaincheckChat`: streamed answers, TTFT/TPOT and restoration per turn.

    python examples/chat.py --tiny-random            # a tiny random Qwen3-VL built on the spot (CPU, seconds)
    python examples/chat.py --model Qwen/Qwen3-VL-8B-Instruct --image photo.jpg --device cuda

The tiny model has random weights: its answers are gibberish, but every mechanism (deferral, fused decode
steps, background completion between turns, the second turn on the same cache) runs exactly as with a real
checkpoint.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

from hf_raincheck import RaincheckChat, RaincheckConfig


def load(args):
    if args.tiny_random:
        from hf_raincheck.testing import make_image, tiny_qwen3_vl

        model, processor = tiny_qwen3_vl(seed=args.seed)
        return model, processor, make_image(args.seed, (256, 256))
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype, device_map=args.device)
    processor = AutoProcessor.from_pretrained(args.model)
    return model, processor, args.image


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
    parser.add_argument("--completion", default="background", choices=["background", "blocking", "next_turn"])
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args(argv)
    if args.model and not args.image:
        parser.error("--model needs --image")

    model, processor, image = load(args)
    config = RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size, guard_tokens=args.guard_tokens,
                             completion=args.completion)
    print(f"model: {type(model).__name__}  config: {config}")
    questions = ["What is in the top left corner?", "And what is at the bottom right?"]
    with RaincheckChat(model, processor, config, max_new_tokens=args.max_new_tokens) as chat:
        for turn, question in enumerate(questions, 1):
            print(f"\n[turn {turn}] user: {question}\n[turn {turn}] assistant: ", end="", flush=True)
            for piece in chat.stream(question, images=image if turn == 1 else None):
                print(piece, end="", flush=True)
            s = chat.stats[-1]
            tpot = "n/a" if s.tpot_s is None else f"{1e3 * s.tpot_s:.1f} ms"
            print(f"\n[turn {turn}] TTFT {1e3 * s.ttft_s:.1f} ms, TPOT {tpot}, {s.new_tokens} tokens | deferred "
                  f"{s.deferred}, restored: folded into this prefill {s.restored_in_prefill}, in decode steps "
                  f"{s.restored_during_decode}; pending when the answer ended {s.pending_at_answer_end}")
        chat.wait()
        for turn, s in enumerate(chat.stats, 1):
            print(f"[turn {turn}] restored after its answer (between turns): {s.restored_after_answer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
