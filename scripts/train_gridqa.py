"""Train a GridQA checkpoint (tiny Qwen3-VL or Qwen3.5) from scratch and save it like a Hub checkpoint.

    python scripts/train_gridqa.py --arch qwen3_vl --out ckpt/gridqa-qwen3-vl --device cuda --time-budget 300
    python scripts/train_gridqa.py --arch qwen3_5 --out ckpt/gridqa-qwen3_5 --device cuda --steps 3000
    python scripts/train_gridqa.py --arch qwen3_vl --out /tmp/smoke --device cpu --steps 3 --batch 4 --eval-dialogues 4
    python scripts/train_gridqa.py --eval-only hf_raincheck/assets/gridqa-qwen3-vl --device cpu   # re-evaluate
    python scripts/train_gridqa.py --arch qwen3_vl --init-from ckpt/a --curriculum-steps 0 --out ckpt/b ...  # go on

Before the alignment stage (H200, torch 2.11, four runs sharing one GPU, ~440 s of training per stage; commands in each
the shipped checkpoints' ``training_stats.json``, under ``init_from``):

    python scripts/train_gridqa.py --arch qwen3_vl --device cuda --time-budget 440 --eval-dialogues 500 \
        --eval-batch 256 --workers 2 --threads 1 --structured 1.0 --loss answer --batch 128 --lr 1.5e-3 \
        --curriculum-steps 1500 --kind-weights count=0.24,search=0.24 --out STAGE1
    python scripts/train_gridqa.py --arch qwen3_vl --device cuda --time-budget 430 --eval-dialogues 500 \
        --val-dialogues 500 --eval-batch 256 --workers 2 --threads 1 --init-from STAGE1 --curriculum-steps 0 \
        --structured 0 --loss answer --batch 128 --lr 7e-4 --warmup 100 --kind-weights count=0.30,search=0.30 --out OUT
    python scripts/train_gridqa.py --arch qwen3_5 --device cuda --time-budget 440 --eval-dialogues 500 \
        --eval-batch 256 --workers 2 --threads 1 --structured 1.0 --loss answer --batch 64 --lr 1.5e-3 \
        --warmup 300 --curriculum-steps 2400 --kind-weights count=0.24,search=0.24 --seed 1 --out OUT

Qwen3-VL: 1779 + 2005 steps x 128 dialogues, held-out greedy accuracy per turn 0.988 / 0.988 / 0.988 / 0.992 (after
the first stage: 0.956 / 0.920 / 0.944 / 0.947); Qwen3.5: 2245 steps x 64, 0.978 / 0.954 / 0.952 / 0.955. Per
question kind: cell, row, column, larger 100%, same colour 99-100%, count 92.5% (Qwen3-VL) / 100% (Qwen3.5), search
100% (Qwen3-VL) / 78% (Qwen3.5). The second Qwen3-VL stage was chosen among four runs by ``--val-dialogues``
accuracy (the ``"val"`` split), not by the reported test accuracy.

Why the curriculum: from a random init both models sat at the loss of a model that ignores the image for 3000+
steps (several task formats, learning rates, rope_theta 1e4 / 1e6, sparse grids): to answer "what is in C5?" the
model must learn where to look (attention to one of 64 visual tokens) and how to read what it finds (values to
colour / kind logits) at once, and neither gets a gradient without the other. ``--structured`` starts with grids
whose cells are all the same (uniform), or the same along each row / column, where any attention pattern reads
the right content: the read-out forms first, then the lookup, as the share of such grids falls to 0 over
``--curriculum-steps``. With it, held-out accuracy rose from ~12% to ~80% in the same time. Cell names
(``C5``) are single tokens of the tokenizer, so that a lookup needs no composition of two tokens.

Later changes (``benchmarks/results/gridqa_training_runs.json``, README "GridQA"): ``--loss answer`` (every answer
weighs the same), ``--kind-weights`` (the hard kinds asked more often in training), and two changes of the task
itself: "where is the X?" over the whole grid stayed at the share of "nowhere" in every run (a linear probe reads
every cell's position and content from the visual tokens, ``benchmarks/gridqa_probe.py``: the content-addressed
jump to a cell's name never formed), so the default mix asks ``search`` (one line, a yes/no per cell) instead; and
counts write each cell's counted attribute before the tally, after which Qwen3.5 counts colours as well as shapes.

``--align-weight W`` adds the text-visual alignment loss (``hf_raincheck.gridqa.alignment``): each cell's merged
visual token (the placeholder embedding a query-aware selector scores) pulled toward the input embeddings of the
question words that name it (its cell name, row letter, column number, colour, shape), as real VLMs' alignment stage
puts an image region's tokens near the text that describes it. The shipped checkpoints continued the ones above with
it (H200, four runs sharing the GPU, chosen by ``--val-dialogues`` accuracy; ``training_stats.json``):

    python scripts/train_gridqa.py --arch qwen3_vl --init-from PREVIOUS --batch 128 --device cuda --time-budget 320 \
        --eval-dialogues 500 --val-dialogues 500 --eval-batch 256 --workers 2 --threads 1 --curriculum-steps 0 \
        --structured 0 --loss answer --lr 5e-4 --warmup 100 --kind-weights count=0.30,search=0.30 --align-weight 0.1 \
        --out OUT        # Qwen3.5: --arch qwen3_5 --batch 64

Full-image inputs only: the model never sees pruning, selection or Raincheck. Loss: cross-entropy on the assistant tokens (each answer and
the ``<|im_end|>`` that closes it) of whole 3-4 turn dialogues, one image each (``hf_raincheck.gridqa.task``,
split ``"train"``, dialogue ``step * batch + i`` at step ``step``: the data order is fixed by the arguments).
AdamW, linear warm-up then cosine decay to 5%, gradient clipping at 1, fixed seed.

``--steps 0`` (default) sizes the run to ``--time-budget`` seconds: after ``--calibrate`` steps the measured step
time fixes the total step count (and so the schedule); the count is written to the stats, and ``--steps N``
reruns the same schedule. Every ``--eval-every`` steps a teacher-forced check on held-out dialogues (split
``"test"``) logs per-turn exact match; training stops early once every turn is at least ``--stop-at``.

The vision tower's learned position table starts from a strong separable (row + column) random code
(``--position-code-std 1``, see ``gridqa.checkpoint.init_position_code``): every GridQA question needs to know
where a cell is, and with transformers' default init (std 0.02) that information is ~40x below the pixel content.
On the GPU, fla-core is hidden from transformers (its Triton GDN backward refuses Hopper with Triton < 3.7.1):
Qwen3.5's GDN layers take transformers' torch path (``GRIDQA_ALLOW_FLA=1`` lets fla load).

At the end the weights are rounded to bf16 (what is saved), then evaluated with greedy ``generate`` on
``--eval-dialogues`` held-out dialogues through the real processor and chat template, turn after turn with the
model's own earlier answers in the history (batched, left padding; ``--eval-dialogues 0`` skips it, and
``--eval-only CKPT`` runs it later on a saved checkpoint, e.g. on CPU), and saved with ``save_pretrained`` +
``processor.save_pretrained``, with ``training_stats.json`` (steps, wall times, device, held-out accuracy per
turn and per question kind, the loss / accuracy log).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("GRIDQA_ALLOW_FLA") != "1":
    # fla-core 0.6 with Triton < 3.7.1 refuses the GDN backward on Hopper (wrong gradients, its own check raises);
    # hide it so that transformers' Qwen3.5 layers take their torch path (fine for a model this small).
    sys.modules.setdefault("fla", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_raincheck.gridqa import alignment, batching, checkpoint, task  # noqa: E402


class TrainBatches(torch.utils.data.Dataset):
    """Batch ``step``: train dialogues ``first_dialogue + [step * batch, (step + 1) * batch)`` as numpy arrays."""

    def __init__(self, tokenizer, batch: int, length: int = 10**8, allowed=None, turns=None,
                 p_empty_start: float = task.P_EMPTY, curriculum_steps: int = 0, structured: float = 0.0,
                 weights: dict | None = None, first_dialogue: int = 0):
        self.encoder = batching.DialogueEncoder(tokenizer)
        self.first_dialogue = first_dialogue
        self.batch = batch
        self.length = length
        self.allowed = allowed
        self.turns = turns
        self.p_empty_start = p_empty_start
        self.curriculum_steps = curriculum_steps
        self.structured = structured
        self.weights = weights

    def __len__(self):
        return self.length

    def p_empty(self, step: int) -> float:
        """The share of empty cells at ``step``: ``p_empty_start`` falling linearly to the task's over the curriculum."""
        if step >= self.curriculum_steps:
            return task.P_EMPTY
        return self.p_empty_start + (task.P_EMPTY - self.p_empty_start) * step / self.curriculum_steps

    def structures(self, step: int) -> list[str]:
        """Grid structure of each dialogue of batch ``step``: during the curriculum a falling share (from
        ``self.structured``) of uniform / one-per-row / one-per-column grids, whose cells can be read before the
        model can find a cell; ``"random"`` (the task) otherwise."""
        share = 0.0
        if step < self.curriculum_steps:
            share = self.structured * (1.0 - step / self.curriculum_steps)
        rng = np.random.default_rng(np.random.SeedSequence([7, int(step)]))
        u = rng.random(self.batch)
        picks = rng.integers(1, len(task.STRUCTURES), self.batch)
        return [task.STRUCTURES[int(k)] if x < share else "random" for x, k in zip(u, picks)]

    def __getitem__(self, step):
        p_empty = self.p_empty(step)
        first = self.first_dialogue + step * self.batch
        ds = [task.make_dialogue(first + i, "train", num_turns=self.turns, allowed=self.allowed,
                                 p_empty=p_empty if st == "random" else task.P_EMPTY, structure=st,
                                 weights=self.weights)
              for i, st in enumerate(self.structures(step))]
        ids, labels = self.encoder.batch(ds)
        cells = np.stack([d.cells for d in ds])
        return ids, labels, cells


def answer_weights(labels: torch.Tensor) -> torch.Tensor:
    """Per target token (``labels[:, 1:]`` true), ``1 / (tokens of its answer)``, scaled so the weights average 1:
    every answer weighs the same in the loss, whatever its length (a two-token "E8" as much as a 40-token
    listing)."""
    mask = labels[:, 1:]
    starts = mask & ~torch.nn.functional.pad(mask[:, :-1], (1, 0))
    run = torch.cumsum(starts.reshape(-1).long(), 0).reshape(mask.shape) - 1  # answer id of each position
    run = run[mask]
    length = torch.bincount(run)
    w = 1.0 / length[run].float()
    return w * (w.numel() / w.sum())


class Alignment:
    """The alignment term of the loss (``--align-weight``): `hf_raincheck.gridqa.alignment` on the merged visual
    tokens of the batch's images (captured from the vision tower's output during the forward)."""

    def __init__(self, tokenizer, weight: float, tau: float, device):
        words = alignment.alignment_words(tokenizer)
        self.weight, self.tau = weight, tau
        self.token_ids = torch.as_tensor(words.token_ids, device=device)
        self.positions = torch.as_tensor(words.positions, device=device, dtype=torch.float32)
        self.contents = torch.as_tensor(words.contents, device=device, dtype=torch.float32)

    def loss(self, model, visual, cells):
        cells = torch.as_tensor(np.asarray(cells), device=visual.device).reshape(-1, batching.IMAGE_TOKENS)
        targets = self.positions[None] * self.contents[:, cells].permute(1, 0, 2)  # [B, W, 64]
        embeddings = model.get_input_embeddings()(self.token_ids)
        return alignment.alignment_loss(visual.reshape(cells.shape[0], batching.IMAGE_TOKENS, -1), embeddings,
                                        targets, self.tau)


def loss_and_hits(model, atlas, ids, labels, cells, device, loss_weighting: str = "token", align=None):
    """``(loss, hits, target_mask)``; with ``align`` (an `Alignment`) the loss is the answer loss plus
    ``align.weight`` x the alignment loss, and ``loss.parts`` holds both."""
    ids = torch.as_tensor(ids, device=device)
    labels = torch.as_tensor(labels, device=device)
    pixel_values, grid = atlas(cells)
    positions = batching.mrope_positions(ids.shape[0], ids.shape[1], device)
    captured = []
    hook = None
    if align is not None:
        hook = model.model.visual.register_forward_hook(lambda module, args, out: captured.append(out.pooler_output))
    try:
        hidden = model.model(input_ids=ids, pixel_values=pixel_values, image_grid_thw=grid, position_ids=positions,
                             use_cache=False).last_hidden_state
    finally:
        if hook is not None:
            hook.remove()
    target_mask = labels[:, 1:]
    logits = model.lm_head(hidden[:, :-1][target_mask]).float()
    targets = ids[:, 1:][target_mask]
    if loss_weighting == "answer":
        per_token = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
        loss = (per_token * answer_weights(labels)).mean()
    else:
        loss = torch.nn.functional.cross_entropy(logits, targets)
    parts = {"answer": loss.detach()}
    if align is not None:
        if len(captured) != 1:
            raise RuntimeError(f"expected one vision-tower call per forward, saw {len(captured)}")
        align_loss = align.loss(model, captured[0], cells)
        parts["align"] = align_loss.detach()
        loss = loss + align.weight * align_loss
    return loss, logits.argmax(-1) == targets, target_mask, parts


@torch.no_grad()
def alignment_check(model, atlas, words, dialogues):
    """`alignment.alignment_scores` of the images of ``dialogues`` (held out)."""
    model.eval()
    cells = np.stack([d.cells for d in dialogues])
    with batching.batched_vision_attention(model):
        scores = alignment.alignment_scores(model, words, alignment.visual_tokens(model, atlas, cells), cells)
    model.train()
    return scores


@torch.no_grad()
def teacher_forced_eval(model, atlas, encoder, dialogues, device, chunk=128):
    """Per-turn share of answers whose every token (and the closing <|im_end|>) is the argmax."""
    model.eval()
    right = np.zeros(4)
    total = np.zeros(4)
    for s in range(0, len(dialogues), chunk):
        part = dialogues[s : s + chunk]
        ids, labels = encoder.batch(part)
        cells = np.stack([d.cells for d in part])
        with batching.batched_vision_attention(model):
            _, hits, mask, _ = loss_and_hits(model, atlas, ids, labels, cells, device)
        hits_full = torch.zeros_like(mask)
        hits_full[mask] = hits
        hits_full, mask = hits_full.cpu().numpy(), mask.cpu().numpy()
        for b in range(len(part)):
            # answers are maximal runs of label positions
            pos = np.flatnonzero(mask[b])
            runs = np.split(pos, np.flatnonzero(np.diff(pos) > 1) + 1)
            for turn, run in enumerate(runs):
                total[turn] += 1
                right[turn] += bool(hits_full[b, run].all())
    model.train()
    return [float(r / t) if t else None for r, t in zip(right, total)]


@torch.no_grad()
def greedy_eval(model, processor, dialogues, device, batch: int = 128, max_new_tokens: int = 64):
    """Greedy ``generate`` through the processor, turn by turn with the model's own answers in the history."""
    model.eval()
    answers = [[] for _ in dialogues]
    for turn in range(max(len(d.turns) for d in dialogues)):
        todo = [i for i, d in enumerate(dialogues) if len(d.turns) > turn]
        for s in range(0, len(todo), batch):
            part = todo[s : s + batch]
            texts, images = [], []
            for i in part:
                d = dialogues[i]
                messages = []
                for j in range(turn + 1):
                    content = [{"type": "text", "text": d.turns[j].question}]
                    if j == 0:
                        content.insert(0, {"type": "image"})
                    messages.append({"role": "user", "content": content})
                    if j < turn:
                        messages.append({"role": "assistant", "content": [{"type": "text", "text": answers[i][j]}]})
                texts.append(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
                images.append(d.image())
            inputs = processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt")
            inputs = inputs.to(device)
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
            new = out[:, inputs["input_ids"].shape[1] :]
            for k, i in enumerate(part):
                answers[i].append(processor.decode(new[k], skip_special_tokens=True).strip())
    per_turn = {}
    per_kind = {}
    for d, ans in zip(dialogues, answers):
        for j, (t, a) in enumerate(zip(d.turns, ans)):
            ok = task.is_correct(a, t.answer)
            per_turn.setdefault(j + 1, []).append(ok)
            per_kind.setdefault(t.kind, []).append(ok)
    wrong = [
        {"index": d.index, "turn": j + 1, "question": t.question, "answer": t.answer, "got": a}
        for d, ans in zip(dialogues, answers)
        for j, (t, a) in enumerate(zip(d.turns, ans))
        if not task.is_correct(a, t.answer)
    ]
    return {
        "per_turn": {str(k): {"accuracy": float(np.mean(v)), "n": len(v)} for k, v in sorted(per_turn.items())},
        "per_kind": {k: {"accuracy": float(np.mean(v)), "n": len(v)} for k, v in sorted(per_kind.items())},
        "overall": float(np.mean([x for v in per_turn.values() for x in v])),
        "examples_wrong": wrong[:20],
    }


def run_heldout_eval(model, processor, args, device, split="test"):
    """Greedy accuracy on the first ``--eval-dialogues`` dialogues of ``split`` (``"test"``: what the README and
    ``benchmarks/quality.py`` report) or ``--val-dialogues`` of ``"val"`` (for choosing between runs, so that the
    choice does not select on the reported dialogues)."""
    count = args.eval_dialogues if split == "test" else args.val_dialogues
    if count <= 0:
        return None, 0.0
    t0 = time.perf_counter()
    result = greedy_eval(model, processor, task.dialogues(split, 0, count), device, batch=args.eval_batch)
    eval_s = time.perf_counter() - t0
    print(f"[{args.arch}] {split} greedy accuracy per turn: "
          f"{ {k: round(v['accuracy'], 4) for k, v in result['per_turn'].items()} } overall {result['overall']:.4f} "
          f"({eval_s:.0f}s on {device})", flush=True)
    heldout = {"split": split, "dialogues": count, "history": "own answers",
               "weights": "the saved bf16 values, computed in fp32", "device": str(device),
               "wall_s": round(eval_s, 1), **result}
    return heldout, eval_s


def eval_only(args):
    """Greedy held-out eval of a saved checkpoint; writes it into the checkpoint's training_stats.json."""
    device = torch.device(args.device)
    model, processor = checkpoint.load_checkpoint(args.eval_only, device=str(device))
    args.arch = model.config.model_type
    heldout, _ = run_heldout_eval(model, processor, args, device)
    val, _ = run_heldout_eval(model, processor, args, device, split="val")
    path = os.path.join(args.eval_only, "training_stats.json")
    stats = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            stats = json.load(f)
    stats["heldout_greedy"] = heldout
    if val is not None:
        stats["val_greedy"] = val
    stats["eval_command"] = "python scripts/train_gridqa.py " + " ".join(sys.argv[1:])
    with open(path, "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2)
        f.write("\n")
    return 0


def parse_kind_weights(parser, text):
    if not text:
        return None
    weights = {}
    for part in text.split(","):
        kind, _, value = part.partition("=")
        try:
            weights[kind.strip()] = float(value)
        except ValueError:
            parser.error(f"--kind-weights: expected KIND=NUMBER pairs separated by commas, got {part!r}")
    try:
        task.check_question_weights(weights)
    except ValueError as e:
        parser.error(f"--kind-weights: {e}")
    return weights


def lr_at(step, total, warmup, peak):
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def read_init_source(parser, args) -> dict:
    """What ``--init-from`` starts from: its path, arch, command and step count (from its ``training_stats.json``),
    and the first training dialogue after the ones it saw."""
    path = os.path.join(args.init_from, "training_stats.json")
    if not os.path.exists(path):
        parser.error(f"--init-from {args.init_from!r}: no training_stats.json there (a checkpoint this script saved)")
    with open(path, encoding="utf-8") as f:
        stats = json.load(f)
    if stats.get("arch") != args.arch:
        parser.error(f"--init-from {args.init_from!r} is a {stats.get('arch')!r} checkpoint, --arch is {args.arch!r}")
    seen = int(stats.get("first_dialogue", 0)) + int(stats["dialogues_seen"])
    return {"path": os.path.abspath(args.init_from), "arch": stats["arch"], "command": stats.get("command"),
            "steps": stats.get("steps"), "init_from": stats.get("init_from"), "next_dialogue": seen}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=checkpoint.ARCHS, default="qwen3_vl")
    parser.add_argument("--out")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=0, help="0: size the run to --time-budget")
    parser.add_argument("--time-budget", type=float, default=300.0, help="seconds of training when --steps 0")
    parser.add_argument("--calibrate", type=int, default=40)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=200, help="warm-up steps")
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--tf-dialogues", type=int, default=256, help="held-out dialogues of the periodic check")
    parser.add_argument("--stop-at", type=float, default=0.995)
    parser.add_argument("--eval-dialogues", type=int, default=500)
    parser.add_argument("--val-dialogues", type=int, default=0,
                        help="also a greedy eval on this many dialogues of the 'val' split (to choose between runs "
                             "without selecting on the reported 'test' dialogues)")
    parser.add_argument("--position-code-std", type=float, default=1.0,
                        help="std of the separable init of the vision position table (0: transformers' init)")
    parser.add_argument("--p-empty-start", type=float, default=task.P_EMPTY,
                        help="curriculum: share of empty cells of the random (unstructured) grids at step 0 (sparse "
                             f"grids first: a few objects to find), falling linearly to the task's {task.P_EMPTY} "
                             "over --curriculum-steps; structured grids keep the task's")
    parser.add_argument("--curriculum-steps", type=int, default=1500, help="0: no curriculum")
    parser.add_argument("--structured", type=float, default=1.0,
                        help="curriculum: share of structured grids (uniform / one cell per row / per column) at "
                             "step 0, falling linearly to 0 over --curriculum-steps")
    parser.add_argument("--rope-theta", type=float, default=None, help="the text model's rope_theta (default: the "
                        "checkpoint config's)")
    parser.add_argument("--kinds", default=None, help="comma-separated question kinds to train on (default: all)")
    parser.add_argument("--turns", type=int, default=None, help="turns per training dialogue (default: 3 or 4)")
    parser.add_argument("--kind-weights", default=None, metavar="KIND=W,...",
                        help="training's sampling weights of question kinds, replacing task.QUESTION_WEIGHTS for the "
                             "kinds named (e.g. count=0.25,find=0.3); evaluation keeps the task's")
    parser.add_argument("--loss", choices=("token", "answer"), default="token",
                        help="token: mean over answer tokens; answer: every answer weighs the same")
    parser.add_argument("--init-from", default=None, metavar="CKPT",
                        help="start from a saved checkpoint's weights (of --arch) instead of a random init, with a "
                             "fresh schedule; training continues the data stream after the dialogues it saw (a run "
                             "longer than one time budget: train, then continue with --curriculum-steps 0)")
    parser.add_argument("--align-weight", type=float, default=0.0,
                        help="weight of the text-visual alignment loss (hf_raincheck.gridqa.alignment): each cell's "
                             "merged visual token pulled toward the input embeddings of the question words that "
                             "name it (0: off)")
    parser.add_argument("--align-tau", type=float, default=0.05, help="temperature of the alignment loss's softmax")
    parser.add_argument("--eval-batch", type=int, default=128)
    parser.add_argument("--eval-only", default=None, metavar="CKPT",
                        help="only run the greedy held-out eval of a saved checkpoint and update its stats")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    if args.align_weight < 0:
        parser.error(f"--align-weight must be >= 0, got {args.align_weight}")
    if args.align_tau <= 0:
        parser.error(f"--align-tau must be > 0, got {args.align_tau}")
    torch.set_num_threads(args.threads)
    if args.eval_only:
        return eval_only(args)
    if not args.out:
        parser.error("--out is required")
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    tokenizer = checkpoint.build_tokenizer()
    processor = checkpoint.build_processor(tokenizer)
    allowed = args.kinds.split(",") if args.kinds else None
    weights = parse_kind_weights(parser, args.kind_weights)
    source = read_init_source(parser, args) if args.init_from else None
    first_dialogue = source["next_dialogue"] if source else 0
    data = TrainBatches(tokenizer, args.batch, allowed=allowed, turns=args.turns, p_empty_start=args.p_empty_start,
                        curriculum_steps=args.curriculum_steps, structured=args.structured,
                        weights=weights, first_dialogue=first_dialogue)
    loader = torch.utils.data.DataLoader(
        data, batch_size=None, shuffle=False, num_workers=args.workers, prefetch_factor=4 if args.workers else None,
        persistent_workers=False,
    )
    batches = iter(loader)

    if source:
        model, _ = checkpoint.load_checkpoint(args.init_from, device=str(device))
    else:
        model = checkpoint.build_model(args.arch, tokenizer, seed=args.seed, position_code_std=args.position_code_std,
                                       rope_theta=args.rope_theta).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    atlas = batching.PixelAtlas(device)
    encoder = batching.DialogueEncoder(tokenizer)
    align = Alignment(tokenizer, args.align_weight, args.align_tau, device) if args.align_weight > 0 else None
    words = alignment.alignment_words(tokenizer)
    # disjoint from the final eval's 0..N
    tf_dialogues = task.dialogues("test", 10**6, args.tf_dialogues, allowed=allowed, num_turns=args.turns)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-8, fused=device.type == "cuda",
    )
    print(f"[{args.arch}] {n_params / 1e6:.2f}M parameters, device {device}, batch {args.batch}", flush=True)

    total = args.steps if args.steps > 0 else None
    log = []
    start = time.perf_counter()
    t_calib = None
    step = 0
    stopped_early = False
    running = []
    while total is None or step < total:
        if total is None and step == args.calibrate:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.perf_counter() - t_calib) / (args.calibrate - 10)
            remaining = args.time_budget - (time.perf_counter() - start)
            total = max(step + 1, step + int(remaining / per_step))
            print(f"[{args.arch}] calibrated: {per_step * 1000:.1f} ms/step -> {total} steps", flush=True)
        if total is None and step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
        lr = lr_at(step, total or 10**9, args.warmup, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, labels, cells = next(batches)
        with batching.batched_vision_attention(model):
            loss, hits, _, parts = loss_and_hits(model, atlas, ids, labels, cells, device, args.loss, align)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running.append(torch.stack([loss.detach(), parts.get("align", torch.zeros((), device=loss.device))]))
        step += 1
        if step % args.eval_every == 0 or step == total:
            mean_loss, mean_align = (float(x) for x in torch.stack(running).mean(0))
            running = []
            acc = teacher_forced_eval(model, atlas, encoder, tf_dialogues, device)
            scores = alignment_check(model, atlas, words, tf_dialogues)
            elapsed = time.perf_counter() - start
            log.append({"step": step, "loss": mean_loss, "align_loss": mean_align if align else None, "lr": lr,
                        "tf_turn_accuracy": acc, "alignment_top1": {g: round(v["top1"], 4) for g, v in scores.items()},
                        "time_s": elapsed})
            print(f"[{args.arch}] step {step}/{total} loss {mean_loss:.4f} align {mean_align:.4f} lr {lr:.2e} "
                  f"tf-acc/turn {acc} align-top1 {log[-1]['alignment_top1']} {elapsed:.0f}s", flush=True)
            if all(a is None or a >= args.stop_at for a in acc) and step < (total or 0):
                print(f"[{args.arch}] every turn >= {args.stop_at}: stopping early", flush=True)
                stopped_early = True
                break
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - start
    del batches, loader

    # what is saved: bf16 weights; evaluate exactly those values (in fp32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    model.eval()
    heldout, eval_s = run_heldout_eval(model, processor, args, device)
    val, val_s = run_heldout_eval(model, processor, args, device, split="val")
    import transformers

    stats = {
        "arch": args.arch,
        "command": "python scripts/train_gridqa.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "steps": step,
        "planned_steps": total,
        "stopped_early": stopped_early,
        "batch_dialogues": args.batch,
        "dialogues_seen": step * args.batch,
        "first_dialogue": first_dialogue,
        "init_from": source,
        "lr": args.lr,
        "loss_weighting": args.loss,
        "align_weight": args.align_weight,
        "align_tau": args.align_tau if args.align_weight > 0 else None,
        "alignment_heldout": alignment_check(model, atlas, words, tf_dialogues),
        "kind_weights": weights,
        "seed": args.seed,
        "parameters": n_params,
        "train_wall_s": round(train_s, 1),
        "eval_wall_s": round(eval_s, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "saved_dtype": "bfloat16",
        "heldout_greedy": heldout,
        "val_greedy": val,
        "val_wall_s": round(val_s, 1),
        "log": log,
    }
    checkpoint.save_checkpoint(model, processor, args.out, stats=stats)
    print(f"[{args.arch}] saved to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
