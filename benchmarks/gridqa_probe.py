"""What a shipped GridQA checkpoint's visual tokens hold, and which count questions it misses (CPU, ~2 minutes).

    python benchmarks/gridqa_probe.py --arch qwen3_vl --images 300 --counts 100

1. A linear probe (ridge least squares, 70% / 30% split over tokens) on the visual tokens' hidden states at the
   decoder's input and after each decoder layer, of held-out images: the cell's index (64 classes), row, column,
   colour (7 with "empty") and content (85 classes). High accuracy means the information is linearly there.
2. Greedy accuracy on held-out two-turn dialogues of count questions (through the real processor, own answers in
   the history), split by what is counted (a colour, a shape, digits) and by the true total.

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=("qwen3_vl", "qwen3_5"), default="qwen3_vl")
    parser.add_argument("--images", type=int, default=300, help="held-out images for the probe")
    parser.add_argument("--counts", type=int, default=100, help="held-out two-turn count dialogues (0: skip)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.images < 4:
        parser.error(f"--images must be at least 4, got {args.images}")
    model, processor = load_default(args.arch)
    model = model.float().eval()
    result = {"arch": args.arch, "command": "python benchmarks/gridqa_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "images": args.images, "probe": probe_table(model, processor, args.images)}
    print("| layer | cell (64) | row (8) | column (8) | colour (7) | content (85) |\n| --- | --- | --- | --- | --- | --- |")
    for r in result["probe"]:
        print(f"| {r['layer']} | {r['cell']:.3f} | {r['row']:.3f} | {r['column']:.3f} | {r['colour']:.3f} | {r['content']:.3f} |")
    if args.counts:
        result["counts"] = count_breakdown(model, processor, args.counts)
        print("\n| count questions | accuracy | n |\n| --- | --- | --- |")
        for k, v in result["counts"].items():
            print(f"| {k} | {v['accuracy']:.3f} | {v['n']} |")
    out = args.out or os.path.join(ROOT, "benchmarks", "results", f"gridqa_probe_{args.arch}.json")
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
