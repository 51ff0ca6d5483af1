"""Several conversations in one batch, turn after turn: Full prefill and Raincheck side by side.

    python examples/batch.py                          # 6 held-out GridQA dialogues, the shipped tiny Qwen3-VL (CPU)
    python examples/batch.py --arch qwen3_5 --dialogues 8
    python examples/batch.py --model Qwen/Qwen3-VL-8B-Instruct --image a.jpg --image b.jpg --device cuda

Every turn of every conversation is answered by ONE ``generate`` call for the whole batch: turn 1 starts the
conversations (a left-padded batch, each row its own image, plan and deferred tokens); each later turn continues
the rows whose dialogue goes on, from their row caches (``BatchedDeferredPrefillCache(rows)``, inputs from
`next_turn_inputs` + `batch_inputs`), with what each row left pending folded into its prefill. The rows share every
forward (one prefill, then one decode step per token in which each row feeds its token and carries its own next
deferred chunk). The output checks every row against the GridQA reference and shows the deferred-token accounting
of each row.

With no ``--model`` it plays held-out GridQA dialogues (split ``"demo"``) with the model shipped in
``hf_raincheck/assets``; ``--guard-tokens`` is 0 as in examples/chat.py (restoration from the first decode step).
"""

from __future__ import annotations

import argparse
import time

import torch

from hf_raincheck import BatchedDeferredPrefillCache, RaincheckConfig, enable_raincheck
from hf_raincheck.conversation import batch_inputs, cache_argument, next_turn_inputs, output_cache


def load(args):
    """``(model, processor, conversations)``: each conversation ``(image, questions, references)``."""
    if args.model:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=dtype, device_map=args.device)
        processor = AutoProcessor.from_pretrained(args.model)
        questions = args.question or ["Describe the image.", "What is in its top left corner?"]
        return enable_raincheck(model.eval()), processor, [(image, questions, [None] * len(questions))
                                                           for image in args.image]
    from hf_raincheck.gridqa import load_default, make_dialogue

    model, processor = load_default(args.arch, device=args.device)
    enable_raincheck(model)
    conversations = []
    for index in range(args.first_dialogue, args.first_dialogue + args.dialogues):
        dialogue = make_dialogue(index, "demo")
        conversations.append((dialogue.image(), [t.question for t in dialogue.turns],
                              [t.answer for t in dialogue.turns]))
    return model, processor, conversations


def play(model, processor, conversations, config, max_new_tokens):
    """Plays every conversation, one batched ``generate`` per turn; returns per conversation its answers and
    per-turn records, and the calls' row counts and times."""
    tokenizer = processor.tokenizer
    pad = tokenizer.pad_token_id
    answers = [[] for _ in conversations]
    records = [[] for _ in conversations]
    calls = []
    histories = [None] * len(conversations)  # each row's exact tokens so far (prompt + its answer)
    caches = [None] * len(conversations)
    turns = max(len(q) for _, q, _ in conversations)
    for turn in range(turns):
        rows = [i for i, (_, questions, _) in enumerate(conversations) if turn < len(questions)]
        inputs = []
        for i in rows:
            image, questions, _ = conversations[i]
            if turn == 0:
                message = [{"role": "user", "content": [{"type": "image", "image": image},
                                                        {"type": "text", "text": questions[0]}]}]
                inputs.append(processor.apply_chat_template(message, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True, return_tensors="pt"))
            else:
                inputs.append(next_turn_inputs(processor, histories[i],
                                               [{"role": "user", "content": questions[turn]}]))
        batch = batch_inputs(inputs, pad).to(model.device)
        past = BatchedDeferredPrefillCache([caches[i] for i in rows])
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, **cache_argument(past), raincheck_config=config, do_sample=False,
                                 max_new_tokens=max_new_tokens, return_dict_in_generate=True)
        calls.append((len(rows), time.perf_counter() - start))
        for row, i in enumerate(rows):
            cache = output_cache(out).rows[row]
            prompt = int(inputs[row]["input_ids"].shape[1])
            fed = cache.length - prompt  # the answer's tokens the cache holds (all but the last one generated)
            new = out.sequences[row, batch["input_ids"].shape[1]:]
            history = torch.tensor([cache.token_ids + [int(new[fed])]])
            histories[i], caches[i] = history, cache
            answers[i].append(tokenizer.decode(new[: fed + 1], skip_special_tokens=True).strip())
            records[i].append(cache.turn_stats[-1])
    for cache in caches:
        cache.wait()
    return answers, records, calls


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--arch", default="qwen3_vl", choices=["qwen3_vl", "qwen3_5"],
                        help="which shipped GridQA model (default qwen3_vl)")
    source.add_argument("--model", help="any supported checkpoint (hub id or local path); needs --image")
    parser.add_argument("--image", action="append", help="an image per conversation, for --model (repeat)")
    parser.add_argument("--question", action="append", help="the questions of every conversation, for --model")
    parser.add_argument("--dialogues", type=int, default=6, help="GridQA dialogues in the batch")
    parser.add_argument("--first-dialogue", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--retention", type=float, default=0.3)
    parser.add_argument("--chunk-size", type=int, default=7)
    parser.add_argument("--guard-tokens", type=int, default=0)
    parser.add_argument("--completion", default="blocking", choices=["background", "blocking", "next_turn"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.model and not args.image:
        parser.error("--model needs --image (one per conversation)")
    if (args.image or args.question) and not args.model:
        parser.error("--image / --question go with --model (GridQA asks its own questions)")
    if args.dialogues < 1:
        parser.error("--dialogues must be >= 1")

    model, processor, conversations = load(args)
    policies = {
        "full": RaincheckConfig(policy="full"),
        "raincheck": RaincheckConfig(retention=args.retention, chunk_size=args.chunk_size,
                                     guard_tokens=args.guard_tokens, completion=args.completion),
    }
    print(f"model: {type(model).__name__}, {len(conversations)} conversations in one batch")
    results = {name: play(model, processor, conversations, config, args.max_new_tokens)
               for name, config in policies.items()}
    for name, (_, _, calls) in results.items():
        print(f"{name}: " + ", ".join(f"turn {t + 1}: one call for {n} rows, {s:.2f} s"
                                      for t, (n, s) in enumerate(calls)))
    right = {name: 0 for name in policies}
    total = 0
    for i, (_, questions, references) in enumerate(conversations):
        for turn, question in enumerate(questions):
            print(f"\n[conversation {i + 1}, turn {turn + 1}] user: {question}")
            if references[turn] is not None:
                print(f"[conversation {i + 1}, turn {turn + 1}] reference: {references[turn]}")
                total += 1
            for name in policies:
                answer = results[name][0][i][turn]
                verdict = ""
                if references[turn] is not None:
                    from hf_raincheck.gridqa import is_correct

                    ok = is_correct(answer, references[turn])
                    right[name] += ok
                    verdict = "  [right]" if ok else "  [wrong]"
                print(f"[conversation {i + 1}, turn {turn + 1}] {name:9s}: {answer}{verdict}")
            r = results["raincheck"][1][i][turn]
            print(f"[conversation {i + 1}, turn {turn + 1}] raincheck deferred {r.deferred}, restored: folded into "
                  f"this prefill {r.restored_in_prefill}, in decode steps {r.restored_during_decode}, after the "
                  f"answer {r.restored_after_answer}")
    if total:
        print("\n" + ", ".join(f"{name}: {right[name]}/{total} right" for name in policies))


if __name__ == "__main__":
    main()
