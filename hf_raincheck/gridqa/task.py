"""GridQA: a synthetic multi-turn visual QA task, generated from a seed.

An image is an 8 x 8 grid of 32 px cells (256 x 256 px). 32 px is one *merged* visual token of Qwen3-VL and
Qwen3.5 (patch 16, spatial merge 2), so every cell is exactly one ``<|image_pad|>`` token and a question about a
cell is a question about one token. A cell is empty or holds one object: a coloured shape (circle, square,
triangle, cross) or a coloured digit (0-9, drawn as seven segments, so no font is involved and the pixels are the
same everywhere). Every cell is drawn on its own (a light grey border on its top and left edge), so an image is
the mosaic of its cells' sprites: :func:`sprite_atlas` + the cell ids reproduce :func:`draw_grid` pixel for pixel
(training renders batches that way, on the GPU).

Cells are named like a chess board: rows ``A``-``H`` (top to bottom), columns ``1``-``8`` (left to right), so
``C5`` is one cell and a row letter or a column number alone names a line, with no role to infer from context.
A dialogue has 3 or 4 turns; each question targets a region (rows / columns) no earlier turn targeted, so a
first prefill that kept only the first question's region cannot answer the later ones. Question kinds:

=============  =============================================  ======================================================
kind           question                                       answer
=============  =============================================  ======================================================
``cell``       what is in C5?                                 C5 red circle  /  C5 empty
``row``        list row D.                                    D1 red circle, D2 empty, D3 blue 7, ..., D8 green cross
``column``     list column 2.                                 A2 ..., B2 ..., ..., H2 ... (top to bottom)
``count``      how many red things are in row F?              F1 red 1, F2 empty 1, F3 blue 1, ..., F8 red 2, total 2
               (things of a colour / circles, squares, ... /  (each cell's colour, or its kind: ``circle``, ``7``,
               digits; in a row or a column)                  then the running count)
``larger``     which number is larger, B3 or F1?              B3 3, F1 8, so F1
``colour``     do A2 and D4 have the same colour?             A2 red, D4 red, so yes
``search``     where in row F is the orange 3?                F1 red 3 no, F2 empty no, F3 orange 5 no, F4 orange 3
               (a row or a column, cell by cell: what it      yes, F5 ..., F8 empty no, so F4  (``so nowhere`` when
               holds, then whether that is the object)        no cell of the line holds it)
``find``       where is the green triangle?                   E8  /  nowhere  (the whole grid; not in the default
                                                              mix: the shipped models never learned it, README)
=============  =============================================  ======================================================

Every answer names a cell right before saying what is in it, and listings, counts and searches (long answers,
32-56 tokens) go cell by cell: every step is local (copy or advance a cell name, read the one cell just named,
compare the words just written with the question's, add one), which a few-million-parameter model should learn
far faster than "the k-th item of row D" or a count in one go (the first format, without cell names, left a 5.6M
Qwen3-VL blind to the image after 1900 steps x 128 dialogues; counts without the counted attribute written out,
and ``find``'s jump from an object to its cell's name, were not learned either: README, "GridQA"). They are also
where the tokens restored while an answer is being decoded can change the answer itself. Everything is
deterministic: ``make_dialogue(index, split)`` depends only on its arguments (``numpy`` ``SeedSequence`` of the
split's id and the index); ``"train"`` and ``"test"`` use disjoint seed streams.

Text is written in a canonical form (words separated by single spaces, ``,`` ``.`` ``?`` attached to the word
before), which the tokenizer of :mod:`hf_raincheck.gridqa.checkpoint` decodes back exactly;
:func:`normalize_answer` makes comparisons insensitive to spacing and case.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

GRID = 8  #: cells per side
CELL = 32  #: pixels per cell side (= patch 16 x spatial merge 2: one merged visual token)
IMAGE_SIZE = GRID * CELL  #: 256

COLOURS = {
    "red": (220, 40, 40),
    "green": (30, 160, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 195, 20),
    "purple": (150, 60, 200),
    "orange": (245, 125, 15),
}
COLOUR_NAMES = tuple(COLOURS)
SHAPES = ("circle", "square", "triangle", "cross")
SHAPE_PLURALS = {"circle": "circles", "square": "squares", "triangle": "triangles", "cross": "crosses"}
DIGITS = tuple(str(d) for d in range(10))
KINDS = SHAPES + DIGITS  #: 14 object kinds
BACKGROUND = (255, 255, 255)
BORDER = (205, 205, 205)

#: Cell content ids: 0 = empty; 1 + colour_index * len(KINDS) + kind_index otherwise (84 objects).
NUM_OBJECTS = len(COLOUR_NAMES) * len(KINDS)
NUM_CELL_IDS = 1 + NUM_OBJECTS

P_EMPTY, P_SHAPE = 0.3, 0.4  #: cell distribution: empty 30%, shape 40%, digit 30%

QUESTION_KINDS = ("cell", "row", "column", "count", "larger", "colour", "search", "find")
#: Sampling weights of the question kinds (before the region constraints). ``find`` (the whole grid, answered with
#: one cell name) has weight 0: no training recipe taught the tiny models the jump from an object to its cell's name
#: (README, "GridQA"), so the default mix asks ``search`` instead, which lists one line and then names the cell: every
#: step is a skill the models do learn (read a named cell; match the listed words against the question's).
QUESTION_WEIGHTS = {"cell": 0.18, "row": 0.16, "column": 0.12, "count": 0.16, "larger": 0.1, "colour": 0.1,
                    "search": 0.18, "find": 0.0}

#: Questions that name the cells they ask about (one or two cell names): a query-aware selector whose visual tokens
#: are aligned with the text embeddings (`hf_raincheck.gridqa.alignment`) can keep exactly those cells.
NAMED_CELL_KINDS = ("cell", "larger", "colour")
#: Questions about a whole row or column, answered cell by cell in source order (long answers, 32-56 tokens): the
#: asked line is 8 tokens, but a coverage selector keeps about one token per question word, so at turn 1 the rest
#: of the line is only there once decode-time restoration brings it.
LINE_KINDS = ("row", "column", "count", "search")

SPLITS = {"train": 0, "test": 1, "demo": 2, "val": 3}


def cell_id(colour: str, kind: str) -> int:
    return 1 + COLOUR_NAMES.index(colour) * len(KINDS) + KINDS.index(kind)


def cell_content(cid: int) -> tuple[str, str] | None:
    """``(colour, kind)`` of a cell id, ``None`` for an empty cell."""
    if cid == 0:
        return None
    colour, kind = divmod(cid - 1, len(KINDS))
    return COLOUR_NAMES[colour], KINDS[kind]


def describe(cid: int, empty: str = "empty") -> str:
    content = cell_content(cid)
    return empty if content is None else f"{content[0]} {content[1]}"


# ----------------------------------------------------------------------------------------------------------------
# drawing
# ----------------------------------------------------------------------------------------------------------------

# Seven-segment layout inside a cell: box x 10..21, y 5..26, stroke 3.
_SEG_X0, _SEG_X1, _SEG_Y0, _SEG_Y1, _SEG_W = 10, 21, 5, 26, 3
_SEG_YM = (_SEG_Y0 + _SEG_Y1) // 2
_SEGMENTS = {  # a b c d e f g (top, top-right, bottom-right, bottom, bottom-left, top-left, middle)
    "a": (_SEG_X0, _SEG_Y0, _SEG_X1, _SEG_Y0 + _SEG_W - 1),
    "b": (_SEG_X1 - _SEG_W + 1, _SEG_Y0, _SEG_X1, _SEG_YM),
    "c": (_SEG_X1 - _SEG_W + 1, _SEG_YM, _SEG_X1, _SEG_Y1),
    "d": (_SEG_X0, _SEG_Y1 - _SEG_W + 1, _SEG_X1, _SEG_Y1),
    "e": (_SEG_X0, _SEG_YM, _SEG_X0 + _SEG_W - 1, _SEG_Y1),
    "f": (_SEG_X0, _SEG_Y0, _SEG_X0 + _SEG_W - 1, _SEG_YM),
    "g": (_SEG_X0, _SEG_YM - 1, _SEG_X1, _SEG_YM + 1),
}
_DIGIT_SEGMENTS = {
    "0": "abcdef", "1": "bc", "2": "abged", "3": "abgcd", "4": "fgbc",
    "5": "afgcd", "6": "afgedc", "7": "abc", "8": "abcdefg", "9": "abcdfg",
}


def _draw_cell(draw, x: int, y: int, cid: int) -> None:
    """Draw the sprite of cell id ``cid`` with its top-left corner at (x, y). Only integer-exact primitives."""
    draw.rectangle((x, y, x + CELL - 1, y + CELL - 1), fill=BACKGROUND)
    draw.line((x, y, x + CELL - 1, y), fill=BORDER)
    draw.line((x, y, x, y + CELL - 1), fill=BORDER)
    content = cell_content(cid)
    if content is None:
        return
    colour, kind = content
    rgb = COLOURS[colour]
    if kind == "circle":
        draw.ellipse((x + 6, y + 6, x + 26, y + 26), fill=rgb)
    elif kind == "square":
        draw.rectangle((x + 8, y + 8, x + 24, y + 24), fill=rgb)
    elif kind == "triangle":
        draw.polygon([(x + 16, y + 5), (x + 27, y + 26), (x + 5, y + 26)], fill=rgb)
    elif kind == "cross":
        draw.rectangle((x + 13, y + 5, x + 19, y + 27), fill=rgb)
        draw.rectangle((x + 5, y + 13, x + 27, y + 19), fill=rgb)
    else:
        for seg in _DIGIT_SEGMENTS[kind]:
            x0, y0, x1, y1 = _SEGMENTS[seg]
            draw.rectangle((x + x0, y + y0, x + x1, y + y1), fill=rgb)


def draw_grid(cells) -> "PIL.Image.Image":  # noqa: F821
    """The RGB ``PIL.Image`` (256 x 256) of a grid of cell ids (``[8, 8]``, row-major)."""
    from PIL import Image, ImageDraw

    cells = np.asarray(cells)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for r in range(GRID):
        for c in range(GRID):
            _draw_cell(draw, c * CELL, r * CELL, int(cells[r, c]))
    return image


@lru_cache(maxsize=1)
def sprite_atlas() -> np.ndarray:
    """``uint8 [NUM_CELL_IDS, 32, 32, 3]``: the sprite of every cell id (drawn by the same code as :func:`draw_grid`)."""
    from PIL import Image, ImageDraw

    out = np.empty((NUM_CELL_IDS, CELL, CELL, 3), dtype=np.uint8)
    for cid in range(NUM_CELL_IDS):
        image = Image.new("RGB", (CELL, CELL), BACKGROUND)
        _draw_cell(ImageDraw.Draw(image), 0, 0, cid)
        out[cid] = np.asarray(image)
    out.setflags(write=False)
    return out


def render_cells(cells) -> np.ndarray:
    """``uint8 [..., 256, 256, 3]`` images of cell-id grids ``[..., 8, 8]`` from the sprite atlas (= :func:`draw_grid`)."""
    cells = np.asarray(cells)
    tiles = sprite_atlas()[cells]  # [..., 8, 8, 32, 32, 3]
    lead = cells.shape[:-2]
    tiles = np.moveaxis(tiles, -4, -3)  # [..., 8(r), 32(y), 8(c), 32(x), 3]
    return tiles.reshape(*lead, IMAGE_SIZE, IMAGE_SIZE, 3)


# ----------------------------------------------------------------------------------------------------------------
# dialogues
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Turn:
    kind: str
    question: str
    answer: str
    rows: tuple[int, ...] = ()  #: 0-based rows the question targets
    cols: tuple[int, ...] = ()  #: 0-based columns the question targets
    cells: tuple[tuple[int, int], ...] = ()  #: 0-based (row, col) cells whose content decides the answer


@dataclass
class Dialogue:
    index: int
    split: str
    cells: np.ndarray  #: int64 [8, 8] cell ids
    turns: list[Turn] = field(default_factory=list)

    def image(self):
        return draw_grid(self.cells)

    def messages(self, upto: int | None = None, with_answers: bool = True, image=None) -> list[dict]:
        """Chat messages (``apply_chat_template`` format) of turns ``[0, upto)``; the image goes with the first."""
        turns = self.turns if upto is None else self.turns[:upto]
        out: list[dict] = []
        for i, turn in enumerate(turns):
            if i == 0:
                content = [{"type": "image", "image": image if image is not None else self.image()},
                           {"type": "text", "text": turn.question}]
            else:
                content = [{"type": "text", "text": turn.question}]
            out.append({"role": "user", "content": content})
            if with_answers:
                out.append({"role": "assistant", "content": [{"type": "text", "text": turn.answer}]})
        return out


def _rng(index: int, split: str) -> np.random.Generator:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    return np.random.default_rng(np.random.SeedSequence([20261129, SPLITS[split], int(index)]))


STRUCTURES = ("random", "uniform", "rows", "columns")


def sample_cells(rng: np.random.Generator, p_empty: float = P_EMPTY, structure: str = "random") -> np.ndarray:
    """An 8 x 8 grid of cell ids: each cell empty with probability ``p_empty``, else a shape or a digit (4 : 3).

    ``structure`` (training's curriculum; the task itself is always ``"random"``): ``"uniform"`` draws one cell and
    repeats it everywhere, ``"rows"`` / ``"columns"`` one cell per row / column, so that a model can learn to read
    a cell's content before it can find the cell."""
    if structure == "uniform":
        return np.broadcast_to(sample_cells(rng, p_empty)[:1, :1], (GRID, GRID)).copy()
    if structure == "rows":
        return np.broadcast_to(sample_cells(rng, p_empty)[:, :1], (GRID, GRID)).copy()
    if structure == "columns":
        return np.broadcast_to(sample_cells(rng, p_empty)[:1, :], (GRID, GRID)).copy()
    if structure != "random":
        raise ValueError(f"structure must be one of {list(STRUCTURES)}, got {structure!r}")
    u = rng.random((GRID, GRID))
    colour = rng.integers(0, len(COLOUR_NAMES), (GRID, GRID))
    shape = rng.integers(0, len(SHAPES), (GRID, GRID))
    digit = rng.integers(0, len(DIGITS), (GRID, GRID))
    p_shape = (1.0 - p_empty) * P_SHAPE / (1.0 - P_EMPTY)
    kind = np.where(u < p_empty + p_shape, shape, len(SHAPES) + digit)
    cells = 1 + colour * len(KINDS) + kind
    return np.where(u < p_empty, 0, cells).astype(np.int64)


ROW_NAMES = tuple("ABCDEFGH")  #: rows are letters (top to bottom), columns numbers 1-8 (left to right): "C5"
#: The 64 cell names, row-major ("A1", "A2", ..., "H8"): each is one token of the GridQA tokenizer.
CELL_NAMES = tuple(f"{r}{c + 1}" for r in ROW_NAMES for c in range(GRID))


def _pos(r: int, c: int) -> str:
    return f"{ROW_NAMES[r]}{c + 1}"


def _pick(rng, options):
    return options[int(rng.integers(0, len(options)))]


def _free(used: set[int], rng) -> int:
    free = [i for i in range(GRID) if i not in used]
    return _pick(rng, free if free else list(range(GRID)))


def _q_cell(rng, cells, used_r, used_c) -> Turn:
    r, c = _free(used_r, rng), _free(used_c, rng)
    answer = f"{_pos(r, c)} {describe(int(cells[r, c]))}"
    return Turn("cell", f"what is in {_pos(r, c)}?", answer, (r,), (c,), ((r, c),))


def _listing(cells, line) -> str:
    return ", ".join(f"{_pos(r, c)} {describe(int(cells[r, c]))}" for r, c in line)


def _q_row(rng, cells, used_r, used_c) -> Turn:
    r = _free(used_r, rng)
    line = tuple((r, c) for c in range(GRID))
    return Turn("row", f"list row {ROW_NAMES[r]}.", _listing(cells, line), (r,), (), line)


def _q_column(rng, cells, used_r, used_c) -> Turn:
    c = _free(used_c, rng)
    line = tuple((r, c) for r in range(GRID))
    return Turn("column", f"list column {c + 1}.", _listing(cells, line), (), (c,), line)


def _free_line(axis: str, rng, used_r, used_c):
    """A row or column (`axis`) no earlier turn targeted (while there is one): ``(cells of the line, rows, cols,
    its name in a question)``."""
    if axis == "row":
        r = _free(used_r, rng)
        return tuple((r, c) for c in range(GRID)), (r,), (), f"row {ROW_NAMES[r]}"
    c = _free(used_c, rng)
    return tuple((r, c) for r in range(GRID)), (), (c,), f"column {c + 1}"


def _q_count(rng, cells, used_r, used_c) -> Turn:
    axis = "row" if rng.random() < 0.6 else "column"
    what = int(rng.integers(0, 3))  # 0 colour, 1 shape, 2 digits
    if what == 0:
        colour = _pick(rng, COLOUR_NAMES)
        label, match = f"{colour} things", lambda word: word == colour
    elif what == 1:
        shape = _pick(rng, SHAPES)
        label, match = SHAPE_PLURALS[shape], lambda word: word == shape
    else:
        label, match = "digits", lambda word: word in DIGITS
    line, rows, cols, where = _free_line(axis, rng, used_r, used_c)
    n = 0
    parts = []
    for r, c in line:  # cell by cell: the attribute counted (its colour, or its kind), then the running count
        content = cell_content(int(cells[r, c]))
        word = "empty" if content is None else content[0 if what == 0 else 1]
        n += bool(match(word))
        parts.append(f"{_pos(r, c)} {word} {n}")
    answer = ", ".join(parts) + f", total {n}"
    return Turn("count", f"how many {label} are in {where}?", answer, rows, cols, line)


def _cells_where(cells, pred, used_r, used_c):
    all_cells = [(r, c) for r in range(GRID) for c in range(GRID) if pred(int(cells[r, c]))]
    fresh = [(r, c) for r, c in all_cells if r not in used_r and c not in used_c]
    return fresh, all_cells


def _q_larger(rng, cells, used_r, used_c) -> Turn | None:
    is_digit = lambda cid: cid != 0 and cell_content(cid)[1] in DIGITS  # noqa: E731
    fresh, every = _cells_where(cells, is_digit, used_r, used_c)
    pool = fresh if len(fresh) >= 2 else every
    if len(pool) < 2:
        return None
    order = rng.permutation(len(pool))
    a = pool[int(order[0])]
    da = cell_content(int(cells[a]))[1]
    others = [pool[int(i)] for i in order[1:] if cell_content(int(cells[pool[int(i)]]))[1] != da and pool[int(i)][0] != a[0]]
    if not others:
        return None
    b = others[0]
    db = cell_content(int(cells[b]))[1]
    winner = a if int(da) > int(db) else b
    q = f"which number is larger, {_pos(*a)} or {_pos(*b)}?"
    answer = f"{_pos(*a)} {da}, {_pos(*b)} {db}, so {_pos(*winner)}"
    return Turn("larger", q, answer, (a[0], b[0]), (a[1], b[1]), (a, b))


def _q_colour(rng, cells, used_r, used_c) -> Turn | None:
    fresh, every = _cells_where(cells, lambda cid: cid != 0, used_r, used_c)
    pool = fresh if len(fresh) >= 2 else every
    if len(pool) < 2:
        return None
    a = pool[int(rng.integers(0, len(pool)))]
    ca = cell_content(int(cells[a]))[0]
    want_same = rng.random() < 0.5
    others = [p for p in pool if p[0] != a[0] and (cell_content(int(cells[p]))[0] == ca) == want_same]
    if not others:
        others = [p for p in pool if p[0] != a[0]]
        if not others:
            return None
    b = others[int(rng.integers(0, len(others)))]
    cb = cell_content(int(cells[b]))[0]
    q = f"do {_pos(*a)} and {_pos(*b)} have the same colour?"
    answer = f"{_pos(*a)} {ca}, {_pos(*b)} {cb}, so {'yes' if ca == cb else 'no'}"
    return Turn("colour", q, answer, (a[0], b[0]), (a[1], b[1]), (a, b))


def _q_find(rng, cells, used_r, used_c) -> Turn:
    ids, counts = np.unique(cells[cells > 0], return_counts=True)
    unique = set(int(i) for i, n in zip(ids, counts) if n == 1)
    if rng.random() < 0.15 or not unique:
        absent = [cid for cid in range(1, NUM_CELL_IDS) if cid not in set(int(i) for i in ids)]
        cid = _pick(rng, absent)
        return Turn("find", f"where is the {describe(cid)}?", "nowhere", (), (), ())
    fresh, every = _cells_where(cells, lambda x: x in unique, used_r, used_c)
    pool = fresh if fresh else every
    r, c = pool[int(rng.integers(0, len(pool)))]
    return Turn("find", f"where is the {describe(int(cells[r, c]))}?", _pos(r, c), (r,), (c,), ((r, c),))


def _q_search(rng, cells, used_r, used_c) -> Turn:
    axis = "row" if rng.random() < 0.6 else "column"
    line, rows, cols, where = _free_line(axis, rng, used_r, used_c)
    ids = [int(cells[p]) for p in line]
    present = [i for i in ids if i]
    unique = [p for p, i in zip(line, ids) if i and present.count(i) == 1]
    if rng.random() < 0.15 or not unique:
        hit = None
        target = _pick(rng, [cid for cid in range(1, NUM_CELL_IDS) if cid not in present])
    else:
        hit = unique[int(rng.integers(0, len(unique)))]
        target = int(cells[hit])
    scan = ", ".join(f"{_pos(*p)} {describe(int(cells[p]))} {'yes' if p == hit else 'no'}" for p in line)
    answer = f"{scan}, so {_pos(*hit) if hit is not None else 'nowhere'}"
    return Turn("search", f"where in {where} is the {describe(target)}?", answer, rows, cols, line)


_MAKERS = {"cell": _q_cell, "row": _q_row, "column": _q_column, "count": _q_count, "larger": _q_larger,
           "colour": _q_colour, "find": _q_find, "search": _q_search}


def make_dialogue(index: int, split: str = "test", num_turns: int | None = None, kinds=None,
                  allowed=None, p_empty: float = P_EMPTY, structure: str = "random",
                  weights: dict | None = None) -> Dialogue:
    """Dialogue ``index`` of ``split`` (deterministic). ``num_turns``: 3 or 4 at random unless given.

    ``kinds``: optional sequence of question kinds, one per turn (else drawn with :data:`QUESTION_WEIGHTS`);
    ``allowed``: optional subset of the kinds to draw from; ``p_empty``: the share of empty cells (training's
    curriculum starts with sparse grids; evaluation always uses the default); ``structure``: see :func:`sample_cells`;
    ``weights``: sampling weights of the question kinds, replacing :data:`QUESTION_WEIGHTS` (training may ask the
    hard kinds more often; evaluation always uses the default).
    """
    if not 0.0 <= p_empty < 1.0:
        raise ValueError(f"p_empty must be in [0, 1), got {p_empty!r}")
    table = QUESTION_WEIGHTS if weights is None else check_question_weights(weights)
    rng = _rng(index, split)
    cells = sample_cells(rng, p_empty, structure)
    n = int(num_turns) if num_turns is not None else int(rng.integers(3, 5))
    if kinds is not None:
        kinds = list(kinds)
        n = len(kinds)
    names = [k for k in QUESTION_WEIGHTS if (allowed is None or k in allowed) and table.get(k, 0.0) > 0]
    if not names:
        raise ValueError(f"no question kind left to ask: allowed={allowed!r}, weights={weights!r}")
    weights = np.array([table[k] for k in names], dtype=float)
    weights = weights / weights.sum()
    dialogue = Dialogue(index=int(index), split=split, cells=cells)
    used_r: set[int] = set()
    used_c: set[int] = set()
    while len(dialogue.turns) < n:
        kind = kinds[len(dialogue.turns)] if kinds is not None else names[int(rng.choice(len(names), p=weights))]
        turn = _MAKERS[kind](rng, cells, used_r, used_c)
        if turn is None:
            if kinds is not None:
                kinds[len(dialogue.turns)] = "cell"
            elif all(k in ("larger", "colour") for k in names):
                names = ["cell"]  # a grid without two suitable cells: nothing else to ask
                weights = np.ones(1)
            continue
        dialogue.turns.append(turn)
        used_r.update(turn.rows)
        used_c.update(turn.cols)
    return dialogue


def check_question_weights(weights: dict) -> dict:
    """`QUESTION_WEIGHTS` with the kinds named in `weights` replaced; a clear error for unknown kinds or weights
    that are not numbers >= 0."""
    unknown = sorted(set(weights) - set(QUESTION_WEIGHTS))
    if unknown:
        raise ValueError(f"weights: unknown question kinds {unknown}; allowed: {list(QUESTION_WEIGHTS)}")
    bad = {k: v for k, v in weights.items() if not (isinstance(v, (int, float)) and v >= 0)}
    if bad:
        raise ValueError(f"weights: every weight must be a number >= 0, got {bad}")
    return {**QUESTION_WEIGHTS, **weights}


def dialogues(split: str, start: int, count: int, **kwargs) -> list[Dialogue]:
    return [make_dialogue(i, split, **kwargs) for i in range(start, start + count)]


# ----------------------------------------------------------------------------------------------------------------
# text
# ----------------------------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")


def normalize_answer(text: str) -> str:
    """Lower case, split into words, numbers and punctuation marks, joined by single spaces: answers are compared
    on that (so ``"C1 red circle, C2 empty"`` equals ``"c1 red circle ,c2 empty"``)."""
    return " ".join(_WORD.findall(text.lower()))


def is_correct(prediction: str, answer: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(answer)


def words() -> list[str]:
    """Every word (and punctuation mark) the task's questions and answers use, sorted (the tokenizer's vocabulary)."""
    base = set(",.?:!;")
    text = " ".join(
        [
            "what is in row column empty list how many things are total which number larger or so",
            "do and have the same colour yes no where nowhere digits",
            " ".join(COLOUR_NAMES), " ".join(KINDS), " ".join(SHAPE_PLURALS.values()),
            " ".join(str(i) for i in range(GRID + 1)), " ".join(ROW_NAMES),
        ]
    )
    base.update(text.split())
    return sorted(base)
