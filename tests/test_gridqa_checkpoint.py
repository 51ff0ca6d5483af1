"""The GridQA checkpoints shipped in ``hf_raincheck/assets``: they load like Hub checkpoints, they read the image,
and Raincheck recovers on later turns what hard pruning loses.

Numbers here are floors well below what the checkpoints measure (``training_stats.json``; ``benchmarks/quality.py``
on 500 held-out dialogues), on a few dialogues, so that the test checks the weights and the plumbing, not noise.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from hf_raincheck import RaincheckConfig, enable_raincheck
from hf_raincheck.gridqa import checkpoint, default_path, has_default, load_default, make_dialogue

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

ARCHS = ["qwen3_vl", "qwen3_5"]


@pytest.fixture(scope="module", params=ARCHS)
def shipped(request):
    arch = request.param
    assert has_default(arch), f"no shipped checkpoint at {default_path(arch)}"
    model, processor = load_default(arch)
    enable_raincheck(model)
    return arch, model, processor


@pytest.mark.parametrize("arch", ARCHS)
def test_shipped_checkpoint_is_small_and_loads_through_the_auto_classes(arch):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = default_path(arch)
    size = os.path.getsize(os.path.join(path, "model.safetensors"))
    assert size < 16 * 2**20
    model = AutoModelForImageTextToText.from_pretrained(path)
    processor = AutoProcessor.from_pretrained(path)
    assert model.config.model_type == arch and type(processor).__name__ == "Qwen3VLProcessor"
    assert processor.tokenizer.tokenize(" C5") == ["Ġ", "C5"]  # cell names are single tokens
    with open(os.path.join(path, "training_stats.json"), encoding="utf-8") as f:
        stats = json.load(f)
    assert stats["arch"] == arch and stats["saved_dtype"] == "bfloat16"
    assert stats["heldout_greedy"]["dialogues"] == 500
    # the same weights as the checkpoint code builds (config of this version of the package)
    built = checkpoint.model_config(arch, processor.tokenizer, rope_theta=None)
    assert built.text_config.hidden_size == model.config.text_config.hidden_size


def _first_turn_accuracy(model, processor, kind: str, n: int) -> float:
    from quality import play

    right = 0
    for i in range(n):
        dialogue = make_dialogue(i, "test", kinds=[kind])
        turns, _ = play(model, processor, dialogue, None, max_new_tokens=64)
        right += turns[0][1]
    return right / n


@pytest.mark.parametrize("kind", ["cell", "row", "column", "larger"])
def test_shipped_model_reads_the_image_under_full_prefill(shipped, kind):
    _, model, processor = shipped
    # training_stats: 100% / 99% on these kinds over 500 held-out dialogues (greedy, own answers in the history)
    assert _first_turn_accuracy(model, processor, kind, 8) >= 7 / 8


def test_raincheck_recovers_later_turns_that_hard_pruning_loses(shipped):
    """Turn 2 asks about rows / columns turn 1 did not: hard pruning at 30% loses them, Raincheck restores them."""
    from quality import play

    _, model, processor = shipped
    configs = {
        "full": None,
        "hard": RaincheckConfig(policy="hard", retention=0.3, pruning="mmtok"),
        "raincheck": RaincheckConfig(retention=0.3, pruning="mmtok", chunk_size=7, guard_tokens=16,
                                     completion="blocking"),
    }
    right = {name: 0 for name in configs}
    n = 10
    for i in range(n):
        dialogue = make_dialogue(i, "test", kinds=["cell", "row"])
        for name, config in configs.items():
            turns, _ = play(model, processor, dialogue, config, max_new_tokens=64)
            right[name] += turns[1][1]
    assert right["full"] >= 9, right
    assert right["hard"] <= right["full"] - 4, right  # a row listing misses cells pruned from the first prefill
    assert right["raincheck"] >= right["full"] - 1, right


def test_restored_answers_equal_full_when_retention_is_one(shipped):
    from quality import play

    _, model, processor = shipped
    dialogue = make_dialogue(3, "test")
    full, _ = play(model, processor, dialogue, None, max_new_tokens=64)
    everything, _ = play(model, processor, dialogue, RaincheckConfig(retention=1.0), max_new_tokens=64)
    assert [t[0] for t in everything] == [t[0] for t in full]


def test_shipped_model_answers_in_bf16(shipped):
    """The weights are stored in bf16; a bf16 model gives the same first answer as the fp32 one on a cell question."""
    from quality import play

    arch, model, processor = shipped
    bf16, _ = load_default(arch, dtype=torch.bfloat16)
    enable_raincheck(bf16)
    dialogue = make_dialogue(0, "test", kinds=["cell"])
    assert play(bf16, processor, dialogue, None, 64)[0][0][0] == play(model, processor, dialogue, None, 64)[0][0][0]


def test_shipped_visual_tokens_lie_near_the_words_that_name_their_cells(shipped):
    """The alignment stage: a cell name's input embedding is closest (cosine) to that cell's merged visual token, a
    row letter's / column number's to the cells of that line (benchmarks/results/gridqa_probe_aligned_*.json: 1.000
    for every word group on 100 held-out images; the checkpoints before it: at chance)."""
    import numpy as np

    from hf_raincheck.gridqa import alignment, batching

    _, model, processor = shipped
    cells = np.stack([make_dialogue(i, "test").cells for i in range(8)])
    visual = alignment.visual_tokens(model, batching.PixelAtlas("cpu"), cells)
    scores = alignment.alignment_scores(model, alignment.alignment_words(processor.tokenizer), visual, cells)
    for group in ("cell", "row", "column", "colour", "shape"):
        assert scores[group]["top1"] >= 0.95 and scores[group]["precision"] >= 0.9, (group, scores[group])


def test_query_aware_selection_keeps_the_cells_a_first_question_names(shipped):
    """Turn 1 at 30% under hard pruning: MMTok keeps the cells the question names, so the answer is right
    (quality_aligned.json: 1.000 on the named-cell questions, both archs); uniform selection usually misses them."""
    from quality import play

    _, model, processor = shipped
    right = {"mmtok": 0, "uniform": 0}
    dialogues = [make_dialogue(i, "test", kinds=[kind]) for i in range(4) for kind in ("cell", "colour", "larger")]
    for dialogue in dialogues:
        for selector in right:
            turns, _ = play(model, processor, dialogue, RaincheckConfig(policy="hard", retention=0.3, pruning=selector),
                            max_new_tokens=64)
            right[selector] += turns[0][1]
    assert right["mmtok"] >= len(dialogues) - 1, right
    assert right["uniform"] <= right["mmtok"] - 4, right


def test_decode_time_restoration_completes_a_first_listing(shipped):
    """A first question about a whole column: the 30% prefill holds only a few of its cells (hard pruning gets it
    wrong); restoring from the first decode step on (guard_tokens=0) brings the rest before the answer reaches them
    (quality_aligned_guard0.json: column listings 1.000 of 38, both archs)."""
    from quality import play

    _, model, processor = shipped
    configs = {"hard": RaincheckConfig(policy="hard", retention=0.3, pruning="mmtok"),
               "raincheck": RaincheckConfig(retention=0.3, pruning="mmtok", chunk_size=31, guard_tokens=0,
                                            completion="blocking")}
    right = {name: 0 for name in configs}
    for i in range(5):
        dialogue = make_dialogue(i, "test", kinds=["column"])
        for name, config in configs.items():
            turns, _ = play(model, processor, dialogue, config, max_new_tokens=64)
            right[name] += turns[0][1]
    assert right["hard"] <= 1 and right["raincheck"] >= 4, right
