"""Pruning selectors (mmtok, hiprune, divprune, visionzip): fast vs plain-loop references, properties, options,
the question of the current turn, vision-tower extras, and end to end on a tiny Qwen3-VL. CPU, small sizes."""

from __future__ import annotations

import inspect
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.pruning import (  # noqa: E402
    SelectionContext,
    available_selectors,
    get_selector,
    resolve_options,
    select_kept,
    selector_requirements,
)
from hf_raincheck.pruning import mmtok  # noqa: E402
from hf_raincheck.pruning.base import VISION_ATTENTION, VISION_DEPTH, VISION_HIDDEN  # noqa: E402
from hf_raincheck.pruning.naive import NAIVE  # noqa: E402
from hf_raincheck.pruning.query import question_positions  # noqa: E402
from hf_raincheck.pruning.vision import BlockAttentionHooks, pool_merged, received_attention  # noqa: E402

SELECTORS = ["mmtok", "hiprune", "divprune", "visionzip"]
IMG = 250


# ------------------------------------------------------------------------------------------ random contexts
def make_ctx(
    seed: int,
    grids=((1, 4, 6), (1, 5, 5), (1, 3, 4)),
    texts=(3, 2, 4, 3),
    retention: float = 0.3,
    hidden: int = 16,
    vit: int = 8,
    depth: int = 4,
    query_len: int = 5,
    duplicates: bool = False,
    score_levels: int | None = None,
    options: dict | None = None,
) -> SelectionContext:
    """Spans (images / frames) with text between them, random embeddings / ViT features / attention scores.

    ``duplicates`` copies some tokens onto others inside each span (exact ties for divprune / mmtok);
    ``score_levels`` makes attention scores integers in ``[0, levels)`` (ties for hiprune / visionzip)."""
    g = torch.Generator().manual_seed(seed)
    ids, spans = list(range(10, 10 + texts[0])), []
    for k, (t, h, w) in enumerate(grids):
        start = len(ids)
        ids += [IMG] * (t * h * w)
        spans.append((start, len(ids)))
        ids += list(range(20, 20 + texts[k + 1]))
    sizes = [b - a for a, b in spans]
    total = sum(sizes)
    emb = torch.randn(total, hidden, generator=g)
    vh = torch.randn(total, vit, generator=g)
    if score_levels:
        att = {b: torch.randint(0, score_levels, (total,), generator=g).float() for b in range(depth)}
    else:
        att = {b: torch.rand(total, generator=g) for b in range(depth)}
    if duplicates:
        offset = 0
        for n in sizes:
            for _ in range(max(1, n // 3)):
                i, j = torch.randint(0, n, (2,), generator=g).tolist()
                emb[offset + j] = emb[offset + i]
                vh[offset + j] = vh[offset + i]
            offset += n
    budgets = [RaincheckConfig(retention=retention).kept_budget(n) for n in sizes]
    return SelectionContext(
        input_ids=torch.tensor(ids),
        spans=spans,
        budgets=budgets,
        modalities=["image"] * len(spans),
        grids=[tuple(gr) for gr in grids],
        embeddings=emb,
        query_ids=torch.arange(query_len),
        query_embeds=torch.randn(query_len, hidden, generator=g),
        options=dict(options or {}),
        extras={VISION_ATTENTION: att, VISION_HIDDEN: vh, VISION_DEPTH: depth},
    )


VIDEO = ((1, 4, 4),) * 4  # four frames of equal size and budget: the batched path

OPTION_CASES = {
    "mmtok": [{}, {"alpha": 0.0}, {"alpha": 2.0, "tau_tv": 0.1, "tau_vv": 0.05},
              {"late_stage": "off", "cuda_graphs": False}, {"late_stage": [3, 1]}],
    "hiprune": [{}, {"alpha": 1.0}, {"alpha": 2.5, "object_layer": 1, "register_layer": 2}],
    "divprune": [{}],
    "visionzip": [{}, {"layer": 1}],
}


def run_naive(name: str, ctx: SelectionContext) -> torch.Tensor:
    """The reference of `name` with the context's options, less those that only choose how the fast path runs
    (`mmtok.EXECUTION_OPTIONS`: they never change the picks)."""
    options = resolve_options(name, ctx.options)
    if name == "mmtok":
        options = {k: v for k, v in options.items() if k not in mmtok.EXECUTION_OPTIONS}
    return NAIVE[name](ctx, **options)


# ------------------------------------------------------------------------------------------ fast == naive
@pytest.mark.parametrize("name", SELECTORS)
@pytest.mark.parametrize("grids", [((1, 4, 6), (1, 5, 5), (1, 3, 4)), VIDEO], ids=["images", "frames"])
def test_fast_matches_naive_on_random_inputs(name, grids):
    for seed in range(4):
        for options in OPTION_CASES[name]:
            ctx = make_ctx(seed, grids=grids, texts=(2,) * (len(grids) + 1), retention=0.4, options=options)
            assert select_kept(name, ctx).tolist() == run_naive(name, ctx).tolist(), (seed, options)


@pytest.mark.parametrize("lazy_from", [1, 10**9], ids=["lazy", "dense"])
def test_both_mmtok_greedy_paths_match_naive(monkeypatch, lazy_from):
    """Spans of >= ``LAZY_MIN_TOKENS`` tokens take the lazy greedy, smaller ones the dense step: both give the
    reference's picks (random inputs, exact ties, batched frames)."""
    from hf_raincheck.pruning import mmtok

    monkeypatch.setattr(mmtok, "LAZY_MIN_TOKENS", lazy_from)
    for seed in range(3):
        for grids in (((1, 4, 6), (1, 5, 5), (1, 3, 4)), VIDEO):
            for duplicates in (False, True):
                ctx = make_ctx(seed, grids=grids, texts=(2,) * (len(grids) + 1), retention=0.4,
                               duplicates=duplicates)
                assert select_kept("mmtok", ctx).tolist() == run_naive("mmtok", ctx).tolist(), (seed, duplicates)


@pytest.mark.parametrize("name", SELECTORS)
def test_fast_matches_naive_with_ties(name):
    for seed in range(4):
        for options in OPTION_CASES[name]:
            ctx = make_ctx(seed, duplicates=True, score_levels=3, retention=0.5, options=options)
            assert select_kept(name, ctx).tolist() == run_naive(name, ctx).tolist(), (seed, options)


def test_ties_go_to_the_lowest_index():
    # every token identical: all gains / distances / scores tie, so each span keeps its first b tokens
    ctx = make_ctx(0, retention=0.3)
    ctx.embeddings = torch.ones_like(ctx.embeddings)
    ctx.extras[VISION_HIDDEN] = torch.ones_like(ctx.extras[VISION_HIDDEN])
    ctx.extras[VISION_ATTENTION] = {b: torch.zeros_like(s) for b, s in ctx.extras[VISION_ATTENTION].items()}
    first = torch.cat([torch.arange(a, a + b) for (a, _), b in zip(ctx.spans, ctx.budgets)])
    for name in ["mmtok", "divprune", "visionzip"]:
        assert select_kept(name, ctx).tolist() == first.tolist(), name
        assert run_naive(name, ctx).tolist() == first.tolist(), name
    # hiprune: anchors are the first tokens, then their neighbours, then the first remaining ones
    ctx.options = {"alpha": 2.5}
    assert select_kept("hiprune", ctx).tolist() == run_naive("hiprune", ctx).tolist()


def test_hiprune_buffers_respect_row_boundaries():
    # a 3 x 4 grid whose best object-layer token ends a row: its right "neighbour" must not be the next row's start
    ctx = make_ctx(0, grids=((1, 3, 4),), texts=(1, 1), retention=0.5, options={"alpha": 1.7})  # b=6, 2 anchors
    obj = torch.zeros(12)
    obj[3], obj[4] = 2.0, 1.0  # anchors 3 (row 0, last column) and 4 (row 1, first column)
    reg = torch.arange(12, 0, -1).float()  # registers prefer low indices
    ctx.extras[VISION_ATTENTION] = {1: obj, 3: reg}
    start = ctx.spans[0][0]
    kept = (select_kept("hiprune", ctx) - start).tolist()
    # candidates: anchors 3, 4; left 2 (of 3); right 5 (of 4); up -(3 has none), 0 (of 4); down 7, 8 -> first 6
    assert kept == sorted([3, 4, 2, 5, 0, 7])
    assert kept == (run_naive("hiprune", ctx) - start).tolist()


# ------------------------------------------------------------------------------------------ properties
@pytest.mark.parametrize("name", SELECTORS + ["uniform", "random"])
@pytest.mark.parametrize("retention", [0.05, 0.3, 0.71, 1.0])
def test_exact_counts_sorted_in_range_deterministic(name, retention):
    ctx = make_ctx(3, grids=((1, 4, 6), (1, 2, 2), (1, 5, 3), (1, 1, 1)), texts=(2, 3, 1, 2, 2), retention=retention)
    fn = get_selector(name)
    raw = fn(ctx)
    assert raw.dtype == torch.long and raw.ndim == 1
    kept = select_kept(name, ctx)  # validates exact per-span counts, uniqueness and range
    assert kept.tolist() == sorted(raw.tolist())
    assert torch.equal(kept, select_kept(name, ctx))
    for (start, stop), budget in zip(ctx.spans, ctx.budgets):
        assert int(((kept >= start) & (kept < stop)).sum()) == budget
    assert set(kept.tolist()) <= {i for a, b in ctx.spans for i in range(a, b)}


@pytest.mark.parametrize("name", SELECTORS)
def test_batched_frames_equal_one_span_at_a_time(name):
    ctx = make_ctx(5, grids=VIDEO + ((1, 4, 6),), texts=(1,) * 6, retention=0.3)
    together = select_kept(name, ctx)
    alone = []
    for m in range(len(ctx.spans)):
        rows = ctx.span_rows(m)
        single = SelectionContext(
            input_ids=ctx.input_ids,
            spans=[ctx.spans[m]],
            budgets=[ctx.budgets[m]],
            modalities=[ctx.modalities[m]],
            grids=[ctx.grids[m]],
            embeddings=ctx.embeddings[rows],
            query_ids=ctx.query_ids,
            query_embeds=ctx.query_embeds,
            extras={
                VISION_ATTENTION: {b: s[rows] for b, s in ctx.extras[VISION_ATTENTION].items()},
                VISION_HIDDEN: ctx.extras[VISION_HIDDEN][rows],
                VISION_DEPTH: ctx.extras[VISION_DEPTH],
            },
        )
        alone.append(select_kept(name, single))
    assert together.tolist() == torch.cat(alone).tolist()


def test_only_mmtok_depends_on_the_question():
    ctx = make_ctx(1, retention=0.3)
    other = make_ctx(1, retention=0.3)
    other.query_embeds = torch.randn(7, ctx.query_embeds.shape[1], generator=torch.Generator().manual_seed(99))
    other.query_ids = torch.arange(7)
    for name in SELECTORS + ["uniform", "random"]:
        same = torch.equal(select_kept(name, ctx), select_kept(name, other))
        assert same == (name != "mmtok"), name
    empty = make_ctx(1, retention=0.3, query_len=0)  # no question: vision-vision coverage only
    assert select_kept("mmtok", empty).tolist() == run_naive("mmtok", empty).tolist()


# ------------------------------------------------------------------------------------------ options
@pytest.mark.parametrize("name", SELECTORS + ["uniform", "random"])
def test_unknown_option_names_the_option_and_the_allowed_ones(name):
    allowed = sorted(resolve_options(name, {}))
    with pytest.raises(ValueError, match="no option 'bogus'") as err:
        RaincheckConfig(pruning=name, pruning_options={"bogus": 1})
    assert str(allowed if allowed else "none") in str(err.value)
    ctx = make_ctx(0, options={"bogus": 1})
    with pytest.raises(ValueError, match="no option 'bogus'"):
        get_selector(name)(ctx)


@pytest.mark.parametrize(
    "name, options, match",
    [
        ("mmtok", {"alpha": -1}, "'alpha'"),
        ("mmtok", {"tau_tv": 0}, "'tau_tv'"),
        ("mmtok", {"tau_vv": "hot"}, "'tau_vv'"),
        ("mmtok", {"late_stage": "never"}, "'late_stage'"),
        ("mmtok", {"late_stage": [64]}, "'late_stage'"),
        ("mmtok", {"late_stage": [64, 0]}, "'late_stage'"),
        ("mmtok", {"late_stage": [-1, 8]}, "'late_stage'"),
        ("mmtok", {"late_stage": [64, 8, 3, 4]}, "'late_stage'"),
        ("mmtok", {"late_stage": [64, 8, 4, 3]}, "'late_stage'"),
        ("mmtok", {"late_stage": [64, 8.0]}, "'late_stage'"),
        ("mmtok", {"late_stage": (64, True)}, "'late_stage'"),
        ("mmtok", {"cuda_graphs": 0}, "'cuda_graphs'"),
        ("mmtok", {"cuda_graphs": "no"}, "'cuda_graphs'"),
        ("hiprune", {"alpha": 6}, "'alpha'"),
        ("hiprune", {"object_layer": 1.5}, "'object_layer'"),
        ("visionzip", {"layer": "last"}, "'layer'"),
    ],
)
def test_bad_option_values_raise(name, options, match):
    with pytest.raises(ValueError, match=match):
        RaincheckConfig(pruning=name, pruning_options=options)


def test_mmtok_execution_options_reach_the_greedy_and_keep_the_picks(monkeypatch):
    """``cuda_graphs`` and ``late_stage`` reach the greedy loops (torch path here: Triton off) and leave the picks
    the reference's; a bad value given straight to the selector is refused naming the option."""
    monkeypatch.setenv("HF_RAINCHECK_TRITON", "0")
    monkeypatch.setattr(mmtok, "LAZY_MIN_TOKENS", 1)  # every span takes the lazy greedy
    loops, orders = [], []
    run_greedy, order = mmtok.run_greedy, mmtok.greedy_coverage_order
    monkeypatch.setattr(mmtok, "run_greedy", lambda *a, **k: loops.append(k["graphs"]) or run_greedy(*a, **k))
    monkeypatch.setattr(mmtok, "greedy_coverage_order", lambda *a, **k: orders.append(k) or order(*a, **k))
    cases = (({}, True, None), ({"cuda_graphs": False, "late_stage": "off"}, False, mmtok.ONE_LAUNCH),
             ({"late_stage": [5, 2, 4, 8]}, True, (5, 2, 4, 8)))
    for options, graphs, late in cases:
        loops.clear(), orders.clear()
        ctx = make_ctx(0, retention=0.4, options=options)
        assert select_kept("mmtok", ctx).tolist() == run_naive("mmtok", ctx).tolist(), options
        assert loops and set(loops) == {graphs}, options
        assert orders and all(k["late"] == late and k["graphs"] == graphs for k in orders), options
    for bad, name in (({"late_stage": [5]}, "late_stage"), ({"cuda_graphs": 1}, "cuda_graphs")):
        with pytest.raises(ValueError, match=f"pruning option '{name}' of 'mmtok'"):
            select_kept("mmtok", make_ctx(0, options=bad))


def test_defaults_and_requirements():
    assert RaincheckConfig().pruning == "mmtok"
    assert resolve_options("mmtok", {}) == {"alpha": 0.5, "tau_tv": 0.01, "tau_vv": 0.2, "late_stage": "auto",
                                            "cuda_graphs": True}
    assert resolve_options("mmtok", {"late_stage": [64, 8, 4, 16]})["late_stage"] == (64, 8, 4, 16)
    assert resolve_options("mmtok", {"late_stage": "off", "cuda_graphs": False})["cuda_graphs"] is False
    assert resolve_options("hiprune", {})["alpha"] == 0.1
    # hiprune's object layer: the middle block (Qwen2.5-VL, 32 blocks: 15 as the official code; Qwen3-VL, 27: 13)
    assert selector_requirements("hiprune", {}, 32)[VISION_ATTENTION] == (15, 31)
    assert selector_requirements("hiprune", {}, 27)[VISION_ATTENTION] == (13, 26)
    assert selector_requirements("hiprune", {"object_layer": -5}, 27)[VISION_ATTENTION] == (22, 26)
    assert selector_requirements("visionzip", {}, 27) == {VISION_ATTENTION: (26,), VISION_HIDDEN: False}
    assert selector_requirements("mmtok", {}, 27) == {VISION_ATTENTION: (), VISION_HIDDEN: True}
    for name in ["divprune", "uniform", "random"]:
        assert selector_requirements(name, {}, 27) == {}
    with pytest.raises(ValueError, match="out of range"):
        selector_requirements("hiprune", {"object_layer": 27}, 27)
    ctx = make_ctx(0)
    ctx.extras = {}
    for name in ["mmtok", "hiprune", "visionzip"]:
        with pytest.raises(ValueError, match="needs ctx.extras"):
            get_selector(name)(ctx)


# ------------------------------------------------------------------------------------------ the question
def _positions_text(processor, ids, positions):
    return processor.tokenizer.decode([ids[i] for i in positions])


def _question(adapter, ids, old=0):
    special = {adapter.image_token_id, adapter.video_token_id, *adapter.special_token_ids()}
    spans, i = [], old
    while i < len(ids):
        if ids[i] in (adapter.image_token_id, adapter.video_token_id):
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return question_positions(ids, old, spans, special, adapter.end_of_turn_token_ids())


@pytest.fixture(scope="module")
def raincheck_vl(tiny_vl_path):
    from hf_raincheck.testing import load_tiny_qwen3_vl

    model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    return enable_raincheck(model), processor


def test_question_is_the_current_user_turn_text(raincheck_vl):
    from hf_raincheck.models import get_adapter
    from hf_raincheck.testing import chat_inputs, make_image

    model, processor = raincheck_vl
    adapter = get_adapter(model)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look at this picture."},
                {"type": "image", "image": make_image(0)},
                {"type": "text", "text": "What color is the big box?"},
            ],
        },
    ]
    ids = chat_inputs(processor, messages)["input_ids"][0].tolist()
    assert _positions_text(processor, ids, _question(adapter, ids)) == "Look at this picture.What color is the big box?"
    # no system prompt, question before the image only
    messages2 = [{"role": "user", "content": [{"type": "text", "text": "Count the dogs"}, {"type": "image", "image": make_image(1)}]}]
    ids2 = chat_inputs(processor, messages2)["input_ids"][0].tolist()
    assert _positions_text(processor, ids2, _question(adapter, ids2)) == "Count the dogs"
    # a later turn: only its own text, not the earlier turns'
    messages3 = messages + [
        {"role": "assistant", "content": "It is red."},
        {"role": "user", "content": [{"type": "image", "image": make_image(2)}, {"type": "text", "text": "And here?"}]},
    ]
    ids3 = chat_inputs(processor, messages3)["input_ids"][0].tolist()
    old = len(ids) + 4  # somewhere in the assistant answer: cached
    assert _positions_text(processor, ids3, _question(adapter, ids3, old)) == "And here?"
    # a raw prompt without template: every new non-special token
    raw = [5, 6] + [adapter.image_token_id] * 4 + [7, 8]
    assert _question(adapter, raw) == [0, 1, 6, 7]


# ------------------------------------------------------------------------------------------ vision extras
def test_block_attention_from_q_k_matches_the_block(raincheck_vl):
    """Qwen3-VL: the hook's q/k (rotary included) reproduce the block's own attention output, per segment."""
    model, _ = raincheck_vl
    grid = torch.tensor([[1, 8, 8], [2, 4, 6]])  # an image and a 2-frame video: three segments
    cu = _check_block_attention(model, grid, 3 * 2 * 16 * 16, block_id=len(model.model.visual.blocks) - 1)
    assert cu == [0, 64, 88, 112]


def test_block_attention_from_q_k_matches_the_block_qwen2_5_vl(qwen25):
    """Qwen2.5-VL: the same in a windowed block (segments = windows, in the tower's window order)."""
    grid = torch.tensor([[1, 8, 12], [1, 10, 8]])
    cu = _check_block_attention(qwen25, grid, Q25_PATCH, block_id=0)
    assert len(cu) > 3  # windows, not images


def _check_block_attention(model, grid, patch_dim, block_id):
    from hf_raincheck.models.qwen3_vl import qwen_vision_block_qk

    visual = model.model.visual
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=torch.Generator().manual_seed(0))
    block = visual.blocks[block_id]
    seen = {}
    pre = block.register_forward_pre_hook(lambda mod, a, kw: seen.update(args=a, kwargs=kw), with_kwargs=True)
    post = block.attn.register_forward_hook(lambda mod, a, kw, out: seen.update(out=out), with_kwargs=True)
    try:
        with BlockAttentionHooks(visual.blocks, [block_id], qwen_vision_block_qk) as hooks:
            with torch.no_grad():
                model.model.get_image_features(pixels, grid, return_dict=True)
    finally:
        pre.remove()
        post.remove()
    with torch.no_grad():
        q, k, cu, scale = qwen_vision_block_qk(block, seen["args"], seen["kwargs"])
        x = block.norm1(seen["args"][0])
        v = block.attn.qkv(x).reshape(x.shape[0], 3, block.attn.num_heads, -1)[:, 2]
        outs, received = [], []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            probs = torch.softmax(torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale, dim=-1)
            outs.append(torch.einsum("hqk,khd->qhd", probs, v[a:b]).reshape(b - a, -1))
            received.append(probs.sum(dim=1).mean(dim=0))
        torch.testing.assert_close(block.attn.proj(torch.cat(outs)), seen["out"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(hooks.scores[block_id], torch.cat(received), atol=1e-5, rtol=1e-4)
    # query blocks of any size give the same sums
    torch.testing.assert_close(
        received_attention(q, k, cu, scale, max_elements=7), torch.cat(received), atol=1e-5, rtol=1e-4
    )
    return cu.tolist()


def test_pool_merged_undoes_a_window_order():
    raster = torch.arange(6.0)  # six merged tokens, 4 patches each
    window_index = torch.tensor([0, 1, 3, 4, 2, 5])  # window position -> raster index
    patches = raster[window_index].repeat_interleave(4)  # the tower's patch order
    pooled = pool_merged(patches, 4, reverse_index=torch.argsort(window_index))
    assert pooled.tolist() == raster.tolist()


def _two_images_and_text(processor, question="What color is the big box?"):
    from hf_raincheck.testing import chat_inputs, make_image

    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": make_image(0, size=(128, 192))},
                {"type": "text", "text": "and"},
                {"type": "image", "image": make_image(1)},
                {"type": "text", "text": question},
            ],
        },
    ]
    return chat_inputs(processor, messages)


def _video_and_text(processor, question="What is moving?"):
    from hf_raincheck.testing import chat_inputs, make_video

    messages = [{"role": "user", "content": [{"type": "video", "video": make_video(0, num_frames=4)}, {"type": "text", "text": question}]}]
    return chat_inputs(processor, messages)


def _generate(model, inputs, config, n=5):
    with torch.no_grad():
        return model.generate(
            **inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True,
            raincheck_config=config,
        )


def test_extras_only_when_required_and_vision_runs_once(raincheck_vl, monkeypatch):
    from hf_raincheck.models.qwen3_vl import Qwen3VLAdapter

    model, processor = raincheck_vl
    inputs = _two_images_and_text(processor)
    asked = []
    original = Qwen3VLAdapter.vision_features

    def spy(self, modality, pixel_values, grid_thw, want=None):
        asked.append(want)
        feats = original(self, modality, pixel_values, grid_thw, want=want)
        if want:
            assert feats.extras[VISION_HIDDEN if want[VISION_HIDDEN] else VISION_ATTENTION] is not None
        return feats

    monkeypatch.setattr(Qwen3VLAdapter, "vision_features", spy)
    tower_calls = []
    handle = model.model.visual.register_forward_hook(lambda *a: tower_calls.append(1))
    try:
        expected = {
            "divprune": None,
            "uniform": None,
            "mmtok": {VISION_ATTENTION: (), VISION_HIDDEN: True},
            "visionzip": {VISION_ATTENTION: (1,), VISION_HIDDEN: False},
            "hiprune": {VISION_ATTENTION: (0, 1), VISION_HIDDEN: False},  # 2 blocks: object layer (2-1)//2 = 0
        }
        for name, want in expected.items():
            asked.clear()
            tower_calls.clear()
            _generate(model, inputs, RaincheckConfig(policy="hard", pruning=name), n=2)
            assert asked == [want], name
            assert len(tower_calls) == 1, name
        asked.clear()
        _generate(model, inputs, RaincheckConfig(retention=1.0, pruning="hiprune"), n=2)  # nothing to select
        assert asked == [None]
    finally:
        handle.remove()


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("policy", ["hard", "raincheck"])
@pytest.mark.parametrize("make_inputs", [_two_images_and_text, _video_and_text], ids=["two_images", "video"])
def test_every_selector_end_to_end(raincheck_vl, policy, make_inputs):
    model, processor = raincheck_vl
    inputs = make_inputs(processor)
    for name in available_selectors():
        config = RaincheckConfig(policy=policy, retention=0.3, pruning=name, chunk_size=4, guard_tokens=1,
                                 completion="blocking")
        out = _generate(model, inputs, config)
        plan = output_cache(out).plan
        assert len(plan.spans) >= 2
        for (start, stop), budget in zip(plan.spans, plan.budgets):
            assert budget == config.kept_budget(stop - start)
            assert int(((plan.kept >= start) & (plan.kept < stop)).sum()) == budget
        if policy == "raincheck":
            assert output_cache(out).pending == 0  # completion "blocking": everything restored


def test_mmtok_end_to_end_follows_the_question(raincheck_vl):
    model, processor = raincheck_vl
    kept = {}
    for name in ["mmtok", "hiprune"]:
        for question in ["What color is the big box?", "How many dogs are on the left side?"]:
            out = _generate(model, _two_images_and_text(processor, question), RaincheckConfig(policy="hard", pruning=name), n=1)
            plan = output_cache(out).plan
            kept[name, question] = (plan.kept - plan.spans[0][0]).tolist()
    questions = ["What color is the big box?", "How many dogs are on the left side?"]
    assert kept["mmtok", questions[0]] != kept["mmtok", questions[1]]
    assert kept["hiprune", questions[0]] == kept["hiprune", questions[1]]


def test_selectors_keep_their_signature():
    # the generation code passes `want` only to adapters that accept it
    from hf_raincheck.models.qwen3_vl import Qwen3VLAdapter

    assert "want" in inspect.signature(Qwen3VLAdapter.vision_features).parameters


# ------------------------------------------------------------------------------------------ Qwen2.5-VL (window order)
Q25_IMG, Q25_VID, Q25_VS, Q25_VE = 250, 251, 248, 249
Q25_PATCH = 3 * 2 * 14 * 14


@pytest.fixture(scope="module")
def qwen25():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3]),
        ),
        vision_config=dict(
            depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
            temporal_patch_size=2, out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
        image_token_id=Q25_IMG, video_token_id=Q25_VID, vision_start_token_id=Q25_VS, vision_end_token_id=Q25_VE,
    )
    model = Qwen2_5_VLForConditionalGeneration(cfg).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return enable_raincheck(model)


def _q25_inputs(seed=0):
    """text, image [1,8,12] (24 tokens, 2x2-token windows), text, image [1,10,8] (20 tokens, padded windows),
    text, a 2-step video [4,4,8] (2 spans of 8 tokens), text."""
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, 240, (3,), generator=gen)]
    for n, text, token in ((24, 2, Q25_IMG), (20, 3, Q25_IMG), (16, 4, Q25_VID)):
        parts += [torch.tensor([Q25_VS]), torch.full((n,), token), torch.tensor([Q25_VE])]
        parts.append(torch.randint(0, 240, (text,), generator=gen))
    ids = torch.cat(parts)[None].long()
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        mm_token_type_ids=((ids == Q25_IMG).long() + 2 * (ids == Q25_VID).long()),
        pixel_values=torch.randn(96 + 80, Q25_PATCH, generator=gen),
        image_grid_thw=torch.tensor([[1, 8, 12], [1, 10, 8]]),
        pixel_values_videos=torch.randn(64, Q25_PATCH, generator=gen),
        video_grid_thw=torch.tensor([[2, 4, 8]]),
        second_per_grid_ts=torch.tensor([1.0]),
    )


def test_qwen2_5_vl_extras_are_put_back_in_raster_order(qwen25):
    from hf_raincheck.models import get_adapter

    adapter = get_adapter(qwen25)
    inputs = _q25_inputs()
    grid = inputs["image_grid_thw"]
    want = {VISION_ATTENTION: (0, 1, 2), VISION_HIDDEN: True}
    with torch.no_grad():
        feats = adapter.vision_features("image", inputs["pixel_values"], grid, want=want)
        out = qwen25.model.visual(inputs["pixel_values"], grid_thw=grid, return_dict=True)
        order = adapter.window_order(grid).reverse_index
        # the merger groups the same consecutive patches: merger(window-ordered patches)[order] == placeholder order
        torch.testing.assert_close(qwen25.model.visual.merger(out.last_hidden_state)[order], feats.embeds)
    assert not torch.equal(order, torch.arange(order.numel()))  # the window order is not the identity here
    hidden = out.last_hidden_state.reshape(-1, 4, out.last_hidden_state.shape[-1]).mean(1)[order]
    torch.testing.assert_close(feats.extras[VISION_HIDDEN], hidden)
    assert set(feats.extras[VISION_ATTENTION]) == {0, 1, 2}
    for scores in feats.extras[VISION_ATTENTION].values():
        assert scores.shape == (feats.embeds.shape[0],)
    # block 1 (full attention): received attention sums to the number of queries of each image (4 patches/token)
    full = feats.extras[VISION_ATTENTION][1]
    torch.testing.assert_close(full[:24].sum() * 4, torch.tensor(96.0))
    torch.testing.assert_close(full[24:].sum() * 4, torch.tensor(80.0))


@pytest.mark.parametrize("policy", ["hard", "raincheck"])
def test_every_selector_end_to_end_qwen2_5_vl(qwen25, policy):
    inputs = _q25_inputs()
    for name in available_selectors():
        config = RaincheckConfig(policy=policy, retention=0.3, pruning=name, chunk_size=4, guard_tokens=1)
        out = _generate(qwen25, inputs, config)
        plan = output_cache(out).plan
        assert len(plan.spans) == 4
        for (start, stop), budget in zip(plan.spans, plan.budgets):
            assert int(((plan.kept >= start) & (plan.kept < stop)).sum()) == budget


def test_block_attention_hooks_called_without_kwargs_by_another_thread():
    """torch registers a kwargs hook in two dict writes (the hook, then its with-kwargs flag) and removes it in two;
    a forward of the same block in another thread between the two calls the hook without kwargs (``hook(module,
    args)``, ``hook(module, args, output)``): seen as a TypeError when two chat sessions ran visionzip at once.
    `BlockAttentionHooks`' hooks take both signatures and skip other threads' calls."""
    import threading

    blocks = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
    hooks = BlockAttentionHooks(blocks, [1], lambda *a: None, sdpa_input=lambda *a: None)
    results = []
    with hooks:
        pre = list(blocks[1]._forward_pre_hooks.values())
        post = list(blocks[1]._forward_hooks.values())
        assert len(pre) == len(post) == 1

        def other_thread():
            x = (torch.zeros(1, 4),)
            results.append((pre[0](blocks[1], x), post[0](blocks[1], x, torch.zeros(1, 4)),
                            pre[0](blocks[1], x, {}), post[0](blocks[1], x, {}, torch.zeros(1, 4))))

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
    assert results == [(None, None, None, None)]
    assert hooks.paths == {1: []}
