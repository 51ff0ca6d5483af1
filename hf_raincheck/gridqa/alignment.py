"""Text-visual alignment of the GridQA models: which question words name which cells, and the loss that pulls each
cell's merged visual token toward the text embeddings of the words that name it.

A query-aware selector (``mmtok``) scores every visual token by its cosine with the question's *input* embeddings.
That finds the asked region only if the model's visual tokens lie near the text embeddings of what they show, as in
real VLMs after their alignment stage. The GridQA models learn to read cells through attention alone, so nothing
puts a cell's token near the embedding of its name: the alignment loss (``scripts/train_gridqa.py --align-weight``)
does, on full images (no pruning, no selection).

Words and the cells they name (:func:`alignment_words`), in the forms the questions tokenize them to:

* a cell name (``C5``, one token): that cell;
* a row letter (``ĠC``): the 8 cells of the row;
* a column number (``4`` after ``Ġ``; the digit token is the one questions use): the 8 cells of the column;
* a colour (``Ġred``): the cells holding something of that colour;
* a shape (``Ġcircle``, ``Ġcircles``): the cells holding that shape.

Loss (:func:`alignment_loss`): per image and word, cross-entropy between ``softmax_j(cos(e_w, x_j) / tau)`` over the
image's 64 visual tokens ``x_j`` (the merger's output: the placeholder embeddings ``mmtok`` scores) and the uniform
distribution over the cells the word names (words naming no cell of the image are skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import task

N_CELLS = task.GRID * task.GRID


@dataclass(frozen=True)
class AlignmentWords:
    """``token_ids [W]``; ``positions [W, 64]`` (1 where the word can name the cell at that position);
    ``contents [W, NUM_CELL_IDS]`` (1 where it can name a cell with that content); ``groups``: the word group
    (``cell``, ``row``, ``column``, ``colour``, ``shape``) of each word."""

    token_ids: np.ndarray
    positions: np.ndarray
    contents: np.ndarray
    groups: tuple[str, ...]

    def targets(self, cells) -> np.ndarray:
        """``float [B, W, 64]``: 1 where word w names cell j of grid b (``cells [B, 8, 8]`` or ``[B, 64]``)."""
        flat = np.asarray(cells).reshape(-1, N_CELLS)
        return self.positions[None] * np.take(self.contents, flat, axis=1).transpose(1, 0, 2)


def _one_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{text!r} is not one token of this tokenizer: {tokenizer.convert_ids_to_tokens(ids)}")
    return ids[0]


def alignment_words(tokenizer) -> AlignmentWords:
    """The words of :mod:`.alignment`'s docstring, as token ids of ``tokenizer`` (the GridQA tokenizer)."""
    ids, positions, contents, groups = [], [], [], []
    all_pos = np.ones(N_CELLS)
    all_content = np.ones(task.NUM_CELL_IDS)
    index = np.arange(N_CELLS)

    def add(token_id, pos, content, group):
        ids.append(token_id)
        positions.append(pos)
        contents.append(content)
        groups.append(group)

    for k, name in enumerate(task.CELL_NAMES):
        add(_one_token(tokenizer, name), (index == k).astype(float), all_content, "cell")
    for r, letter in enumerate(task.ROW_NAMES):
        add(_one_token(tokenizer, " " + letter), (index // task.GRID == r).astype(float), all_content, "row")
    for c in range(task.GRID):
        add(_one_token(tokenizer, str(c + 1)), (index % task.GRID == c).astype(float), all_content, "column")
    content = [task.cell_content(cid) for cid in range(task.NUM_CELL_IDS)]
    for colour in task.COLOUR_NAMES:
        mask = np.array([c is not None and c[0] == colour for c in content], dtype=float)
        add(_one_token(tokenizer, " " + colour), all_pos, mask, "colour")
    for shape in task.SHAPES:
        mask = np.array([c is not None and c[1] == shape for c in content], dtype=float)
        for form in (shape, task.SHAPE_PLURALS[shape]):
            add(_one_token(tokenizer, " " + form), all_pos, mask, "shape")
    return AlignmentWords(np.array(ids, dtype=np.int64), np.stack(positions), np.stack(contents), tuple(groups))


def alignment_loss(visual: torch.Tensor, embeddings: torch.Tensor, targets: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean over (image, word) pairs whose word names some cell of the image of the cross-entropy between
    ``softmax_j(cos(e_w, x_j) / tau)`` and the uniform distribution over the named cells.

    ``visual [B, 64, H]`` (merged visual tokens), ``embeddings [W, H]`` (the words' input embeddings),
    ``targets [B, W, 64]`` (:meth:`AlignmentWords.targets`)."""
    x = torch.nn.functional.normalize(visual.float(), dim=-1)
    e = torch.nn.functional.normalize(embeddings.float(), dim=-1)
    logp = torch.log_softmax(torch.einsum("wh,bjh->bwj", e, x) / tau, dim=-1)
    mass = targets.sum(-1)
    valid = mass > 0
    t = targets / mass.clamp_min(1e-9)[..., None]
    per = -(t * logp).sum(-1)
    return per[valid].mean()


@torch.no_grad()
def question_similarity(model, input_ids: torch.Tensor, visual: torch.Tensor) -> torch.Tensor:
    """``[m, 64]`` cosine of each question token's input embedding (``input_ids [m]``) with each visual token
    (``visual [64, H]``): the text-vision scores ``mmtok`` turns into its coverage matrix."""
    e = model.get_input_embeddings()(input_ids.to(visual.device)).float()
    return torch.nn.functional.normalize(e, dim=-1) @ torch.nn.functional.normalize(visual.float(), dim=-1).T


@torch.no_grad()
def visual_tokens(model, atlas, cells) -> torch.Tensor:
    """``[B, 64, H]`` merged visual tokens (the placeholder embeddings) of grids ``cells [B, 8, 8]``;
    ``atlas`` a `hf_raincheck.gridqa.batching.PixelAtlas` on the model's device."""
    pixel_values, grid = atlas(cells)
    out = model.model.visual(pixel_values.to(model.model.visual.dtype), grid_thw=grid, return_dict=True)
    return out.pooler_output.reshape(grid.shape[0], N_CELLS, -1)


@torch.no_grad()
def alignment_scores(model, words: AlignmentWords, visual: torch.Tensor, cells) -> dict:
    """Per word group, over (image, word) pairs whose word names some cell: ``top1`` the share whose most similar
    visual token is a named cell; ``precision`` the mean share of named cells among the ``k`` most similar tokens
    (``k`` = how many cells the word names). Chance: ``k / 64`` for both."""
    device = visual.device
    targets = torch.as_tensor(words.targets(cells), device=device, dtype=torch.float32)  # [B, W, 64]
    e = model.get_input_embeddings()(torch.as_tensor(words.token_ids, device=device)).float()
    sim = torch.einsum("wh,bjh->bwj", torch.nn.functional.normalize(e, dim=-1),
                       torch.nn.functional.normalize(visual.float(), dim=-1))
    order = sim.argsort(dim=-1, descending=True)
    hit = targets.gather(-1, order)  # [B, W, 64] named-ness in similarity order
    k = targets.sum(-1)
    ranks = torch.arange(N_CELLS, device=device)
    precision = (hit * (ranks[None, None] < k[..., None])).sum(-1) / k.clamp_min(1)
    chance = k / N_CELLS
    out = {}
    groups = np.array(words.groups)
    for group in dict.fromkeys(words.groups):
        sel = torch.as_tensor(groups == group, device=device)
        valid = (k > 0) & sel[None]
        if valid.any():
            out[group] = {"top1": float(hit[..., 0][valid].mean()), "precision": float(precision[valid].mean()),
                          "chance": float(chance[valid].mean()), "n": int(valid.sum())}
    return out
