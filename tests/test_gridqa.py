"""GridQA: the task generator, the tokenizer / processor / checkpoint plumbing and the fast training batches.

The shipped trained checkpoints are tested in ``test_gridqa_checkpoint.py``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hf_raincheck import gridqa
from hf_raincheck.gridqa import batching, checkpoint, task


@pytest.fixture(scope="module")
def tokenizer():
    return checkpoint.build_tokenizer()


@pytest.fixture(scope="module")
def processor(tokenizer):
    return checkpoint.build_processor(tokenizer)


# ------------------------------------------------------------------------------------------------------------------
# task
# ------------------------------------------------------------------------------------------------------------------


def _content(cells, name):
    r, c = task.ROW_NAMES.index(name[0]), int(name[1:]) - 1
    return int(cells[r, c])


def test_dialogues_are_deterministic_and_splits_differ():
    a, b = task.make_dialogue(7, "test"), task.make_dialogue(7, "test")
    assert np.array_equal(a.cells, b.cells) and [t.__dict__ for t in a.turns] == [t.__dict__ for t in b.turns]
    assert not np.array_equal(task.make_dialogue(7, "train").cells, a.cells)
    with pytest.raises(ValueError):
        task.make_dialogue(0, "validation")


def test_training_kind_weights_change_only_the_kinds_asked():
    same = [task.make_dialogue(i, "train", weights=dict(task.QUESTION_WEIGHTS)) for i in range(20)]
    plain = [task.make_dialogue(i, "train") for i in range(20)]
    assert [[t.__dict__ for t in d.turns] for d in same] == [[t.__dict__ for t in d.turns] for d in plain]
    only_find = [task.make_dialogue(i, "train", weights={k: 0.0 for k in task.QUESTION_WEIGHTS} | {"find": 1.0})
                 for i in range(20)]
    assert {t.kind for d in only_find for t in d.turns} == {"find"}
    for d in only_find:  # the whole-grid find (weight 0 in the default mix) still answers from the grid
        for t in d.turns:
            obj = t.question[len("where is the ") : -1]
            where = [f"{task.ROW_NAMES[r]}{c + 1}" for r in range(8) for c in range(8)
                     if task.describe(int(d.cells[r, c])) == obj]
            assert t.answer == (where[0] if len(where) == 1 else "nowhere") and len(where) <= 1
    assert all(np.array_equal(a.cells, b.cells) for a, b in zip(only_find, plain))  # the grids do not change
    with pytest.raises(ValueError, match=r"weights: unknown question kinds \['where'\]"):
        task.make_dialogue(0, "train", weights={"where": 1.0})
    with pytest.raises(ValueError, match="weights: every weight must be a number >= 0"):
        task.make_dialogue(0, "train", weights={"find": -1.0})
    with pytest.raises(ValueError, match="no question kind left"):
        task.make_dialogue(0, "train", weights={k: 0.0 for k in task.QUESTION_WEIGHTS})


def test_answer_weighted_loss_weighs_every_answer_the_same(monkeypatch):
    import importlib
    import os
    import sys

    monkeypatch.setenv("GRIDQA_ALLOW_FLA", "1")  # importing the script must not hide fla from this process
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    train = importlib.import_module("train_gridqa")
    labels = torch.tensor([[0, 1, 1, 1, 0, 1, 0, 0],   # targets are labels[:, 1:]: answers of 3 and 1 tokens
                           [0, 0, 0, 1, 1, 0, 0, 1]], dtype=torch.bool)  # 2 and 1 tokens, the last one at the end
    w = train.answer_weights(labels)
    assert w.shape == (int(labels[:, 1:].sum()),)
    raw = torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0, 1 / 2, 1 / 2, 1.0])
    torch.testing.assert_close(w, raw * (raw.numel() / raw.sum()))
    assert "fla" not in sys.modules or sys.modules["fla"] is not None


def _train_script(monkeypatch):
    import importlib
    import os

    monkeypatch.setenv("GRIDQA_ALLOW_FLA", "1")  # importing the script must not hide fla from this process
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    return importlib.import_module("train_gridqa")


def test_training_continues_from_a_checkpoint_on_the_next_dialogues(monkeypatch, tmp_path):
    import json

    train = _train_script(monkeypatch)
    tiny = ["--device", "cpu", "--batch", "2", "--eval-dialogues", "2", "--eval-batch", "2", "--tf-dialogues", "2",
            "--workers", "0", "--threads", "1", "--curriculum-steps", "0", "--eval-every", "1000"]
    first, second = tmp_path / "a", tmp_path / "b"
    assert train.main(["--arch", "qwen3_vl", "--steps", "2", "--out", str(first), *tiny]) == 0
    assert train.main(["--arch", "qwen3_vl", "--steps", "1", "--init-from", str(first), "--out", str(second),
                       "--val-dialogues", "3", *tiny]) == 0
    a, b = (json.loads((p / "training_stats.json").read_text()) for p in (first, second))
    assert a["first_dialogue"] == 0 and a["init_from"] is None and a["dialogues_seen"] == 4
    # runs are chosen on the 'val' split, so that the choice does not select on the reported 'test' dialogues
    assert a["val_greedy"] is None and b["val_greedy"]["split"] == "val" and b["val_greedy"]["dialogues"] == 3
    assert b["heldout_greedy"]["split"] == "test" and b["heldout_greedy"]["dialogues"] == 2
    assert b["first_dialogue"] == 4 and b["init_from"]["path"] == str(first) and b["init_from"]["steps"] == 2
    # with a learning rate of 0 the continued run saves exactly the weights it started from
    assert train.main(["--arch", "qwen3_vl", "--steps", "1", "--lr", "0", "--warmup", "0", "--init-from", str(first),
                       "--out", str(tmp_path / "same"), *tiny]) == 0
    from safetensors.torch import load_file

    before, after = (load_file(str(p / "model.safetensors")) for p in (first, tmp_path / "same"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    data = train.TrainBatches(checkpoint.build_tokenizer(), 2, first_dialogue=4)
    encoder = batching.DialogueEncoder(checkpoint.build_tokenizer())
    ids, _ = encoder.batch([task.make_dialogue(i, "train") for i in (4, 5)])
    assert np.array_equal(data[0][0], ids)  # step 0 of the continued run: training dialogues 4 and 5
    with pytest.raises(SystemExit):  # a Qwen3-VL checkpoint cannot start a Qwen3.5 run
        train.main(["--arch", "qwen3_5", "--steps", "1", "--init-from", str(first), "--out", str(tmp_path / "c"),
                    *tiny])


def test_splits_are_disjoint_streams():
    test, val = task.dialogues("test", 0, 20), task.dialogues("val", 0, 20)
    assert {str(d.cells) for d in test}.isdisjoint(str(d.cells) for d in val)
    with pytest.raises(ValueError, match="split must be one of"):
        task.make_dialogue(0, "validation")


def test_answers_follow_from_the_grid():
    kinds = set()
    for d in task.dialogues("test", 0, 60):
        assert 3 <= len(d.turns) <= 4
        rows_seen = set()
        for t in d.turns:
            kinds.add(t.kind)
            if t.kind == "cell":
                name = re.search(r"in ([A-H]\d)\?", t.question).group(1)
                assert t.answer == f"{name} {task.describe(_content(d.cells, name))}"
            elif t.kind in ("row", "column"):
                items = t.answer.split(", ")
                assert len(items) == task.GRID
                for item in items:
                    name, what = item.split(" ", 1)
                    assert what == task.describe(_content(d.cells, name))
            elif t.kind == "count":
                _check_count(d, t)
            elif t.kind == "larger":
                a, b = re.findall(r"([A-H]\d)", t.question)
                da, db = (task.cell_content(_content(d.cells, x))[1] for x in (a, b))
                assert t.answer == f"{a} {da}, {b} {db}, so {a if int(da) > int(db) else b}"
            elif t.kind == "colour":
                a, b = re.findall(r"([A-H]\d)", t.question)
                ca, cb = (task.cell_content(_content(d.cells, x))[0] for x in (a, b))
                assert t.answer == f"{a} {ca}, {b} {cb}, so {'yes' if ca == cb else 'no'}"
            elif t.kind == "search":
                _check_search(d, t)
            # a row question targets a row no earlier turn targeted (the generator's region rule)
            if t.kind in ("row", "cell") or (t.kind == "count" and "row" in t.question):
                assert not (set(t.rows) & rows_seen)
            rows_seen.update(t.rows)
    assert kinds == set(task.QUESTION_KINDS) - {"find"}  # not in the default mix


def _check_count(d, t):
    what, line = re.fullmatch(r"how many (.+) are in (row [A-H]|column [1-8])\?", t.question).groups()
    names = _line_names(line)
    parts = t.answer.split(", ")
    assert len(parts) == task.GRID + 1 and parts[-1].startswith("total ")
    running = 0
    for name, part in zip(names, parts):
        content = task.cell_content(_content(d.cells, name))
        if what.endswith(" things"):  # a colour: each cell's colour is written, then the running count
            word = "empty" if content is None else content[0]
            running += word == what.split()[0]
        else:  # a shape or the digits: each cell's kind
            word = "empty" if content is None else content[1]
            running += word in task.DIGITS if what == "digits" else task.SHAPE_PLURALS.get(word) == what
        assert part == f"{name} {word} {running}"
    assert parts[-1] == f"total {running}"


def _line_names(line):
    return ([f"{line[-1]}{c + 1}" for c in range(8)] if line.startswith("row")
            else [f"{r}{line[-1]}" for r in task.ROW_NAMES])


def _check_search(d, t):
    line, obj = re.fullmatch(r"where in (row [A-H]|column [1-8]) is the (.+)\?", t.question).groups()
    names = _line_names(line)
    holds = [n for n in names if task.describe(_content(d.cells, n)) == obj]
    assert len(holds) <= 1 and obj != "empty"
    scan = ", ".join(f"{n} {task.describe(_content(d.cells, n))} {'yes' if n in holds else 'no'}" for n in names)
    assert t.answer == f"{scan}, so {holds[0] if holds else 'nowhere'}"
    assert t.cells == tuple((task.ROW_NAMES.index(n[0]), int(n[1]) - 1) for n in names)


def test_search_scans_one_line_then_names_the_cell(tokenizer):
    weights = {"search": 1.0} | {k: 0.0 for k in task.QUESTION_WEIGHTS if k != "search"}
    turns = []
    for i in range(200):
        d = task.make_dialogue(i, "train", weights=weights)
        rows_seen, cols_seen = set(), set()
        for t in d.turns:
            assert t.kind == "search"
            _check_search(d, t)
            # each turn scans a line no earlier turn of the dialogue scanned (while there are free ones)
            assert not (set(t.rows) & rows_seen) and not (set(t.cols) & cols_seen)
            rows_seen.update(t.rows)
            cols_seen.update(t.cols)
            turns.append(t)
    nowhere = sum(t.answer.endswith("so nowhere") for t in turns) / len(turns)
    assert 0.1 < nowhere < 0.3  # 15% asked about an absent object, plus lines without a unique one
    assert {t.question.split()[2] for t in turns} == {"row", "column"}
    for t in turns[:50]:  # every word of the kind is one token of the task's tokenizer
        for text in (t.question, t.answer):
            _assert_one_token_per_word(tokenizer, text)
    test_kinds = [t.kind for d in task.dialogues("test", 0, 300) for t in d.turns]
    assert "find" not in test_kinds and 0.12 < test_kinds.count("search") / len(test_kinds) < 0.24


def test_counts_write_each_cells_attribute_then_the_running_count(tokenizer):
    turns = [(d, t) for i in range(150) for d in [task.make_dialogue(i, "train", kinds=["count"] * 3)] for t in d.turns]
    for d, t in turns:
        _check_count(d, t)
    asked = {re.match(r"how many (.+) are", t.question).group(1) for _, t in turns}
    assert {"digits", "circles", "crosses"} <= asked and any(a.endswith(" things") for a in asked)
    for _, t in turns[:40]:
        _assert_one_token_per_word(tokenizer, t.answer)


def test_image_is_one_token_per_cell(processor):
    d = task.make_dialogue(3)
    image = d.image()
    assert image.size == (256, 256)
    assert np.array_equal(np.asarray(image), task.render_cells(d.cells))
    inputs = processor.apply_chat_template(d.messages(upto=1, with_answers=False), add_generation_prompt=True,
                                           tokenize=True, return_dict=True, return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 16, 16]]
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == 64
    # each cell's sprite differs from every other cell id's (legible content, one token each)
    atlas = task.sprite_atlas().reshape(task.NUM_CELL_IDS, -1).astype(np.int16)
    assert len({row.tobytes() for row in atlas}) == task.NUM_CELL_IDS


def test_answers_compare_loosely():
    assert task.is_correct(" C1 Red circle ,C2 empty ", "C1 red circle, C2 empty")
    assert not task.is_correct("C1 red circle", "C1 red square")


# ------------------------------------------------------------------------------------------------------------------
# tokenizer, processor, checkpoints
# ------------------------------------------------------------------------------------------------------------------


def _assert_one_token_per_word(tokenizer, text):
    pieces = tokenizer.tokenize(text)
    # a word or a cell name -> one token; a digit or a cell name after a space -> "Ġ" + it (Qwen's pre-tokenizer
    # splits the space off digits; cell names are added tokens)
    words = re.findall(r"[A-H]\d|\b[A-H]\b|\d|[a-z]+|[,.?]", text)
    names = re.findall(r"[A-H]\d", text)
    assert all(name in pieces for name in names), (text, pieces)
    assert len([p for p in pieces if p != "Ġ"]) == len(words), (text, pieces)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_every_task_word_is_one_token(tokenizer):
    for d in task.dialogues("test", 0, 40):
        for t in d.turns:
            for text in (t.question, t.answer):
                _assert_one_token_per_word(tokenizer, text)
    ids = tokenizer.convert_tokens_to_ids(list(checkpoint.SPECIAL_TOKENS))
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("arch,tok_class,model_class", [
    ("qwen3_vl", "Qwen2Tokenizer", "Qwen3VLForConditionalGeneration"),
    ("qwen3_5", "Qwen3_5Tokenizer", "Qwen3_5ForConditionalGeneration"),
])
def test_checkpoint_round_trip_through_auto_classes(tmp_path, tokenizer, processor, arch, tok_class, model_class):
    from transformers import AutoConfig

    model = checkpoint.build_model(arch, tokenizer, seed=0)
    path = checkpoint.save_checkpoint(model, processor, tmp_path / arch)
    assert AutoConfig.from_pretrained(path).model_type == arch
    loaded, proc = checkpoint.load_checkpoint(path)
    assert type(loaded).__name__ == model_class and loaded.dtype == torch.float32
    assert type(proc).__name__ == "Qwen3VLProcessor" and type(proc.tokenizer).__name__ == tok_class
    if arch == "qwen3_5":
        types = loaded.config.text_config.layer_types
        assert "linear_attention" in types and "full_attention" in types
    else:
        assert loaded.config.vision_config.deepstack_visual_indexes
    d = task.make_dialogue(0)
    text = processor.apply_chat_template(d.messages(), tokenize=False)
    assert proc.tokenizer.encode(text) == tokenizer.encode(text)
    # weights are the bf16-rounded values of the trained fp32 ones
    sd = loaded.state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(sd[name], p.to(torch.bfloat16).float()), name


def test_fast_batches_equal_processor_and_model_positions(tokenizer, processor):
    encoder = batching.DialogueEncoder(tokenizer)
    atlas = batching.PixelAtlas()
    ds = task.dialogues("test", 0, 3)
    model = checkpoint.build_model("qwen3_vl", tokenizer, seed=0).eval()
    for d in ds:
        inputs = processor.apply_chat_template(d.messages(), tokenize=True, return_dict=True, return_tensors="pt")
        ids, labels = encoder.encode(d)
        assert inputs["input_ids"][0].tolist() == ids
        labelled = tokenizer.decode([i for i, keep in zip(ids, labels) if keep])
        assert labelled == "".join(t.answer + "<|im_end|>" for t in d.turns)
        pixel_values, grid = atlas(d.cells[None])
        assert torch.equal(pixel_values, inputs["pixel_values"]) and torch.equal(grid, inputs["image_grid_thw"])
        pos, _ = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
        assert torch.equal(pos, batching.mrope_positions(1, len(ids)))
    ids, _ = encoder.batch(ds)
    pixel_values, grid = atlas(np.stack([d.cells for d in ds]))
    kwargs = dict(input_ids=torch.as_tensor(ids), pixel_values=pixel_values, image_grid_thw=grid,
                  position_ids=batching.mrope_positions(len(ds), ids.shape[1]))
    with torch.no_grad():
        plain = model(**kwargs).logits
        with batching.batched_vision_attention(model):
            fast = model(**kwargs).logits
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------------
# alignment
# ------------------------------------------------------------------------------------------------------------------


def test_alignment_words_name_the_cells_the_questions_mean(tokenizer):
    from hf_raincheck.gridqa import alignment

    words = alignment.alignment_words(tokenizer)
    by_token = {tokenizer.convert_ids_to_tokens(int(t)): i for i, t in enumerate(words.token_ids)}
    # the forms the questions use: "what is in C5?", "list row C.", "list column 4.", "the red circle", "circles"
    for question, token in [("what is in C5?", "C5"), ("list row C.", "ĠC"), ("list column 4.", "4"),
                            ("where in row F is the red 3?", "Ġred"), ("how many circles are in row B?", "Ġcircles")]:
        assert token in tokenizer.convert_ids_to_tokens(tokenizer.encode(question, add_special_tokens=False))
        assert token in by_token
    cells = task.make_dialogue(0, "test").cells
    targets = words.targets(cells[None])[0]  # [W, 64]
    named = lambda token: set(np.flatnonzero(targets[by_token[token]]).tolist())  # noqa: E731
    assert named("C5") == {2 * 8 + 4}
    assert named("ĠC") == set(range(16, 24)) and named("4") == {r * 8 + 3 for r in range(8)}
    red = {k for k in range(64) if task.cell_content(int(cells.reshape(-1)[k])) is not None
           and task.cell_content(int(cells.reshape(-1)[k]))[0] == "red"}
    assert named("Ġred") == red
    circles = {k for k in range(64) if task.cell_content(int(cells.reshape(-1)[k])) is not None
               and task.cell_content(int(cells.reshape(-1)[k]))[1] == "circle"}
    assert named("Ġcircle") == named("Ġcircles") == circles
    assert set(words.groups) == {"cell", "row", "column", "colour", "shape"}


def test_alignment_loss_is_low_for_tokens_near_their_words_and_scores_rank_them():
    from hf_raincheck.gridqa import alignment

    gen = torch.Generator().manual_seed(0)
    words = torch.randn(64, 32, generator=gen)  # one word per cell ("cell names")
    targets = torch.eye(64)[None]  # word w names cell w
    aligned = words[None] + 0.1 * torch.randn(1, 64, 32, generator=gen)
    shuffled = aligned[:, torch.randperm(64, generator=gen)]
    low, high = (alignment.alignment_loss(v, words, targets, tau=0.05) for v in (aligned, shuffled))
    assert low < 0.1 < high
    # words naming no cell of an image are left out of the mean
    partial = targets.clone()
    partial[0, 5:] = 0
    both = alignment.alignment_loss(aligned, words, partial, tau=0.05)
    assert torch.allclose(both, alignment.alignment_loss(aligned, words[:5], targets[:, :5], tau=0.05))


def test_training_with_the_alignment_loss_logs_it(monkeypatch, tmp_path):
    import json

    train = _train_script(monkeypatch)
    out = tmp_path / "a"
    assert train.main(["--arch", "qwen3_vl", "--steps", "2", "--out", str(out), "--device", "cpu", "--batch", "2",
                       "--eval-dialogues", "0", "--tf-dialogues", "2", "--workers", "0", "--threads", "1",
                       "--curriculum-steps", "0", "--eval-every", "2", "--align-weight", "0.5"]) == 0
    stats = json.loads((out / "training_stats.json").read_text())
    assert stats["align_weight"] == 0.5 and stats["align_tau"] == 0.05
    assert stats["log"][-1]["align_loss"] > 0
    assert set(stats["alignment_heldout"]) == {"cell", "row", "column", "colour", "shape"}
    with pytest.raises(SystemExit):
        train.main(["--arch", "qwen3_vl", "--steps", "1", "--out", str(tmp_path / "b"), "--device", "cpu",
                    "--align-weight", "-1"])
