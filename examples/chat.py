"""A multi-turn chat about one image, answered under Full prefill and under Raincheck, side by side.

    python examples/chat.py                           # the shipped tiny GridQA Qwen3-VL on a generated grid (CPU)
    python examples/chat.py --arch qwen3_5            # the shipped GridQA Qwen3.5 (Gated DeltaNet hybrid)
    python examples/chat.py --model Qwen/Qwen3-VL-8B-Instruct --image photo.jpg --device cuda \\
        --question "What is in the top left corner?" --question "And at the bottom right?"
    python examples/chat.py --tiny-random             # a tiny *random* Qwen3-VL built on the spot (gibberish)

With no arguments it plays a held-out GridQA dialogue (``hf_raincheck.gridqa``, split ``"demo"``: an 8 x 8 grid of
coloured shapes and digits, one visual token per cell, 3-4 questions about different rows and columns; the first
dialogue from ``--dialogue`` on whose first answer lists a row or column) with the model shipped in ``hf_raincheck/assets``.
Each turn is answered twice, through `RaincheckChat`: with ``policy="full"`` (every visual token prefilled) and
with Raincheck (``--retention`` of the tokens prefilled first, the rest restored in ``--chunk-size`` chunks inside
decode steps after ``--guard-tokens`` tokens, whatever is left finished between turns). It prints each answer, the
reference and whether it is right, TTFT, and where the deferred tokens were restored; for a GridQA dialogue also which
of the cells the first question asks about the selector kept for the first prefill.

``--guard-tokens`` is 0 here (the library's default is 16): restoration starts with the first decode step, so the
first answer token comes from the 30% prefill and the rest of a listing reads the restored image. At 30% a
query-aware selector (``mmtok``) keeps the cells a question names (``what is in C5?``) but only a few cells of a row
or column (about one per question word), so a listing needs the restored tokens before it reaches the missing
cells; with 16 guard tokens it reads its first three or four cells before any restoration and is almost always wrong
(``benchmarks/results/quality_aligned.json`` vs ``quality_aligned_guard0.json``).
"""

from __future__ import annotations

import argparse

import torch

from hf_raincheck import RaincheckChat, RaincheckConfig


def gridqa_dialogue(start: int):
    """The first ``"demo"`` dialogue from index ``start`` on whose first answer lists a row or a column."""
    from hf_raincheck.gridqa import make_dialogue

    for index in range(start, start + 1000):
        dialogue = make_dialogue(index, "demo")
        if dialogue.turns[0].kind in ("row", "column"):
            return dialogue
    return make_dialogue(start, "demo")


def load(args):
    """``(model, processor, image, questions, references, asked)``: ``asked`` the ``(row, col)`` cells the first
    GridQA question asks about (``None`` for other images)."""
    if args.tiny_random:
        from hf_raincheck.testing import make_image, tiny_qwen3_vl

        model, processor = tiny_qwen3_vl(seed=args.seed)
        questions = args.question or ["What is in the top left corner?", "And what is at the bottom right?"]
        return model, processor, make_image(args.seed, (256, 256)), questions, [None] * len(questions), None
    if args.model:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype, device_map=args.device)
        processor = AutoProcessor.from_pretrained(args.model)
        if args.image:
            questions = args.question or ["Describe the image.", "What is in its top left corner?"]
            return model.eval(), processor, args.image, questions, [None] * len(questions), None
    else:
        from hf_raincheck.gridqa import load_default

        model, processor = load_default(args.arch, device=args.device)
    dialogue = gridqa_dialogue(args.dialogue)  # a GridQA model (shipped, or --model without --image)
    questions = [t.question for t in dialogue.turns]
    return model, processor, dialogue.image(), questions, [t.answer for t in dialogue.turns], dialogue.turns[0].cells


def play(model, processor, image, questions, config, max_new_tokens):
    """Answers ``questions`` in one chat; returns ``([(answer, TurnStats)], kept)`` (after background completion):
    ``kept`` the image's visual-token indices (0 .. tokens - 1, row-major) prefilled first in turn 1 (all of them
    under Full)."""
    out = []
    kept = None
    with RaincheckChat(model, processor, config, max_new_tokens=max_new_tokens) as chat:
        for turn, question in enumerate(questions):
            answer = chat.ask(question, images=image if turn == 0 else None)
            out.append(answer.strip())
            if turn == 0:
                plan = chat.cache.plan
                kept = None if plan is None else sorted(int(i) - plan.spans[0][0] for i in plan.kept)
        chat.wait()
        return list(zip(out, chat.stats)), kept


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--arch", default="qwen3_vl", choices=["qwen3_vl", "qwen3_5"],
                        help="which shipped GridQA model (default qwen3_vl)")
    source.add_argument("--model", help="any supported checkpoint (hub id or local path)")
    source.add_argument("--tiny-random", action="store_true", help="a tiny random Qwen3-VL (no weights needed)")
    parser.add_argument("--image", help="image file for --model (without it, --model must be a GridQA model)")
    parser.add_argument("--question", action="append", help="a question (repeat for several turns)")
    parser.add_argument("--dialogue", type=int, default=0, help="first GridQA demo dialogue index to consider")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=int, default=7)
    parser.add_argument("--guard-tokens", type=int, default=0,
                        help="decode steps before restoration starts (the library's default is 16; see above)")
    parser.add_argument("--pruning", default="mmtok")
    parser.add_argument("--completion", default="background", choices=["background", "blocking", "next_turn"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.image and not args.model:
        parser.error("--image goes with --model")
    if args.question and not (args.model and args.image) and not args.tiny_random:
        parser.error("--question goes with --model and --image (or --tiny-random); GridQA asks its own questions")

    model, processor, image, questions, references, asked = load(args)
    policies = {
        "full": RaincheckConfig(policy="full"),
        "raincheck": RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size,
                                     guard_tokens=args.guard_tokens, pruning=args.pruning,
                                     completion=args.completion),
    }
    print(f"model: {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters)")
    print(f"raincheck: {policies['raincheck']}")
    results, kept = {}, {}
    for name, config in policies.items():
        results[name], kept[name] = play(model, processor, image, questions, config, args.max_new_tokens)
    if asked is not None and kept["raincheck"] is not None:
        from hf_raincheck.gridqa.task import GRID, ROW_NAMES

        names = [f"{ROW_NAMES[r]}{c + 1}" for r, c in asked]
        held = [n for n, (r, c) in zip(names, asked) if r * GRID + c in kept["raincheck"]]
        print(f"turn 1 selection ({args.pruning}, retention {args.retention}): {len(kept['raincheck'])} of "
              f"{GRID * GRID} visual tokens prefilled first; of the {len(names)} cells the question asks about "
              f"({names[0]}..{names[-1]}) {len(held)} kept: {', '.join(held) or 'none'}")
    right = {name: 0 for name in policies}
    for turn, question in enumerate(questions):
        print(f"\n[turn {turn + 1}] user: {question}")
        if references[turn] is not None:
            print(f"[turn {turn + 1}] reference: {references[turn]}")
        for name in policies:
            answer, s = results[name][turn]
            verdict = ""
            if references[turn] is not None:
                from hf_raincheck.gridqa import is_correct

                ok = is_correct(answer, references[turn])
                right[name] += ok
                verdict = "  [right]" if ok else "  [wrong]"
            print(f"[turn {turn + 1}] {name:9s}: {answer}{verdict}")
            print(f"[turn {turn + 1}] {name:9s}  TTFT {1e3 * s.ttft_s:.1f} ms, {s.new_tokens} tokens | deferred "
                  f"{s.deferred}, restored: folded into this prefill {s.restored_in_prefill}, in decode steps "
                  f"{s.restored_during_decode}, after the answer {s.restored_after_answer}")
    if references[0] is not None:
        print("\n" + ", ".join(f"{name}: {right[name]}/{len(questions)} right" for name in policies))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
