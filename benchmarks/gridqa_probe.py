"""What a shipped GridQA checkpoint's visual tokens hold, and which count questions it misses (CPU, ~2 minutes).

    python benchmarks/gridqa_probe.py --arch qwen3_vl --images 300 --counts 100

1. A linear probe (ridge least squares, 70% / 30% split over tokens) on the visual tokens' hidden states at the
   decoder's input and after each decoder layer, of held-out images: the cell's index (64 classes), row, column,
   colour (7 with "empty") and content (85 classes). High accuracy means the information is linearly there.
2. Greedy accuracy on held-out two-turn dialogues of count questions (through the real processor, own answers in
   the history), split by what is counted (a colour, a shape, digits) and by the true total.

3. Alignment (``--alignment N`` held-out dialogues; what a query-aware selector can use): per word group, how the
   cosine between a question word's input embedding and the 64 merged visual tokens ranks the cells the word names
   (``hf_raincheck.gridqa.alignment.alignment_scores``); per turn-1 question, the share of its asked cells among
   the top-k cells by the best cosine over its words (k = asked cells); and the share of the asked cells that each
   selector's keep set holds (``policy="hard"``, one generated token, ``cache.plan.kept``) per retention, for the
   questions that name their cells and for the questions about a row or column.

Writes ``benchmarks/results/gridqa_probe_<arch>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.gridqa import load_default, task  # noqa: E402


def ridge_probe(x: np.ndarray, y: np.ndarray, classes: int, ridge: float = 1e-2) -> float:
    """Held-out accuracy of a one-vs-all ridge regression from `x` to the classes `y` (first 70% fit, rest test)."""
    n = len(y)
    cut = int(n * 0.7)
    xb = np.c_[x, np.ones(n)]
    targets = np.eye(classes)[y]
    w = np.linalg.solve(xb[:cut].T @ xb[:cut] + ridge * np.eye(xb.shape[1]), xb[:cut].T @ targets[:cut])
    return float(((xb[cut:] @ w).argmax(1) == y[cut:]).mean())


@torch.no_grad()
def visual_states(model, processor, images: int):
    """Per layer (0 = the decoder's input), the visual tokens' hidden states of held-out images 0..images-1, and
    each token's cell contents (the tokens are the 64 cells in row-major order)."""
    layers: dict[int, list[np.ndarray]] = {}
    cells = []
    for i in range(images):
        dialogue = task.make_dialogue(i, "test")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": dialogue.turns[0].question}]}]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=[dialogue.image()], return_tensors="pt")
        out = model(**inputs, output_hidden_states=True)
        where = (inputs["input_ids"][0] == model.config.image_token_id).nonzero()[:, 0]
        if len(where) != task.GRID * task.GRID:
            raise RuntimeError(f"expected {task.GRID * task.GRID} visual tokens, got {len(where)}")
        for layer, hidden in enumerate(out.hidden_states):
            layers.setdefault(layer, []).append(hidden[0, where].float().numpy())
        cells.append(dialogue.cells.reshape(-1))
    return {k: np.concatenate(v) for k, v in layers.items()}, np.concatenate(cells)


def probe_table(model, processor, images: int) -> list[dict]:
    states, content = visual_states(model, processor, images)
    index = np.tile(np.arange(task.GRID * task.GRID), images)
    colour = np.where(content > 0, (content - 1) // len(task.KINDS) + 1, 0)
    rows = []
    for layer, x in states.items():
        rows.append({"layer": layer, "cell": ridge_probe(x, index, task.GRID * task.GRID),
                     "row": ridge_probe(x, index // task.GRID, task.GRID),
                     "column": ridge_probe(x, index % task.GRID, task.GRID),
                     "colour": ridge_probe(x, colour, len(task.COLOUR_NAMES) + 1),
                     "content": ridge_probe(x, content, task.NUM_CELL_IDS)})
    return rows


def count_breakdown(model, processor, dialogues: int) -> dict:
    os.environ.setdefault("GRIDQA_ALLOW_FLA", "1")  # the training script hides fla-core unless told (its backward)
    import train_gridqa

    graded = []
    is_correct = train_gridqa.task.is_correct

    def record(prediction, answer):
        ok = is_correct(prediction, answer)
        graded.append((answer, ok))
        return ok

    ds = [task.make_dialogue(i, "test", kinds=["count", "count"]) for i in range(dialogues)]
    train_gridqa.task.is_correct = record
    try:
        train_gridqa.greedy_eval(model, processor, ds, "cpu", batch=50)
    finally:
        train_gridqa.task.is_correct = is_correct
    turns = [t for d in ds for t in d.turns]  # greedy_eval grades them in this order first (then the wrong ones again)
    groups: dict[str, list[bool]] = {}
    for turn, (answer, ok) in zip(turns, graded):
        assert answer == turn.answer
        label = turn.question.split(" are in")[0].removeprefix("how many ")
        what = "colour" if label.endswith("things") else ("digits" if label == "digits" else "shape")
        total = int(answer.rsplit("total ", 1)[1])
        for key in (f"counting {what}", f"total {min(total, 3)}{'+' if total >= 3 else ''}"):
            groups.setdefault(key, []).append(ok)
    return {k: {"accuracy": float(np.mean(v)), "n": len(v)} for k, v in sorted(groups.items())}


@torch.no_grad()
def alignment_report(model, processor, dialogues: int, selectors, retentions) -> dict:
    """Section 3 of the module docstring, on held-out dialogues ``0 .. dialogues - 1`` (their first turn)."""
    from hf_raincheck import RaincheckConfig, enable_raincheck
    from hf_raincheck.gridqa import alignment, batching

    ds = [task.make_dialogue(i, "test") for i in range(dialogues)]
    cells = np.stack([d.cells for d in ds])
    atlas = batching.PixelAtlas("cpu")
    visual = alignment.visual_tokens(model, atlas, cells)
    words = alignment.alignment_words(processor.tokenizer)
    report = {"dialogues": dialogues, "word_groups": alignment.alignment_scores(model, words, visual, cells)}
    groups = {"named_cells": task.NAMED_CELL_KINDS, "line": task.LINE_KINDS}
    ranked: dict[str, list[float]] = {}
    kept: dict[str, list[float]] = {}
    enable_raincheck(model)
    for d, vis in zip(ds, visual):
        turn = d.turns[0]
        group = next(g for g, kinds in groups.items() if turn.kind in kinds)
        asked = [r * task.GRID + c for r, c in turn.cells]
        messages = [{"role": "user", "content": [{"type": "image", "image": d.image()},
                                                 {"type": "text", "text": turn.question}]}]
        inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True, return_tensors="pt")
        q_ids = processor.tokenizer(turn.question, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        best = alignment.question_similarity(model, q_ids, vis).max(0).values  # [64]
        top = set(best.argsort(descending=True)[: len(asked)].tolist())
        ranked.setdefault(group, []).append(len(top & set(asked)) / len(asked))
        first = int((inputs["input_ids"][0] == model.config.image_token_id).nonzero()[0])
        for sel in selectors:
            for ret in retentions:
                out = model.generate(**inputs, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                                     raincheck_config=RaincheckConfig(policy="hard", retention=ret, pruning=sel))
                keep = {int(k) - first for k in output_cache(out).plan.kept}
                kept.setdefault(f"{group} {sel} {ret}", []).append(sum(a in keep for a in asked) / len(asked))
    report["asked_in_top_k"] = {g: {"share": float(np.mean(v)), "n": len(v)} for g, v in ranked.items()}
    report["asked_kept"] = {k: {"share": float(np.mean(v)), "n": len(v)} for k, v in sorted(kept.items())}
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("qwen3_vl", "qwen3_5"), default="qwen3_vl")
    parser.add_argument("--images", type=int, default=300, help="held-out images for the probe")
    parser.add_argument("--counts", type=int, default=100, help="held-out two-turn count dialogues (0: skip)")
    parser.add_argument("--alignment", type=int, default=0, metavar="N",
                        help="held-out dialogues for the alignment section (0: skip)")
    parser.add_argument("--selectors", nargs="+", default=["mmtok", "uniform", "random"])
    parser.add_argument("--retentions", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    parser.add_argument("--model", default=None, help="checkpoint path (default: the shipped one of --arch)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.images < 4:
        parser.error(f"--images must be at least 4, got {args.images}")
    if args.alignment < 0:
        parser.error(f"--alignment must be >= 0, got {args.alignment}")
    model, processor = load_default(args.arch, path=args.model)
    model = model.float().eval()
    result = {"arch": args.arch, "model": args.model or f"hf_raincheck/assets (load_default('{args.arch}'))",
              "command": "python benchmarks/gridqa_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "images": args.images, "probe": probe_table(model, processor, args.images)}
    print("| layer | cell (64) | row (8) | column (8) | colour (7) | content (85) |\n| --- | --- | --- | --- | --- | --- |")
    for r in result["probe"]:
        print(f"| {r['layer']} | {r['cell']:.3f} | {r['row']:.3f} | {r['column']:.3f} | {r['colour']:.3f} | {r['content']:.3f} |")
    if args.counts:
        result["counts"] = count_breakdown(model, processor, args.counts)
        print("\n| count questions | accuracy | n |\n| --- | --- | --- |")
        for k, v in result["counts"].items():
            print(f"| {k} | {v['accuracy']:.3f} | {v['n']} |")
    if args.alignment:
        result["alignment"] = alignment_report(model, processor, args.alignment, args.selectors, args.retentions)
        a = result["alignment"]
        print("\n| word group | top-1 named | precision@k | chance | n |\n| --- | --- | --- | --- | --- |")
        for g, v in a["word_groups"].items():
            print(f"| {g} | {v['top1']:.3f} | {v['precision']:.3f} | {v['chance']:.3f} | {v['n']} |")
        print("\n| turn-1 questions | asked cells in the top-k by similarity | n |\n| --- | --- | --- |")
        for g, v in a["asked_in_top_k"].items():
            print(f"| {g} | {v['share']:.3f} | {v['n']} |")
        print("\n| questions selector retention | asked cells kept | n |\n| --- | --- | --- |")
        for k, v in a["asked_kept"].items():
            print(f"| {k} | {v['share']:.3f} | {v['n']} |")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"gridqa_probe_{args.arch}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
