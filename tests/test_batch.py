"""Batched ``generate(raincheck_config=...)``: a left-padded batch of conversations, each row its own plan.

Every row of a mixed batch (different image counts and sizes, a text-only row, different lengths) must give what
the same conversation gives alone (batch 1): tokens, plan, accounting; ``retention=1.0`` / ``policy="full"``
must give plain batched ``generate``'s tokens; each row's deferred tokens are prefilled exactly once under every
completion mode (a row that stops early included); ``split()`` caches continue like batch-1 caches; what is not
supported raises a clear ValueError.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import TextStreamer

from hf_raincheck import transformers_coupling as hf
from hf_raincheck import DeferredPrefillCache, RaincheckConfig, enable_raincheck
from hf_raincheck.cache.batched import BatchedDeferredPrefillCache
from hf_raincheck.conversation import batch_inputs, cache_argument, next_turn_inputs, output_cache
from hf_raincheck.testing import load_tiny_qwen2_5_vl, load_tiny_qwen3_5, load_tiny_qwen3_vl, make_image

N = 10


def assert_same_cache(row, ref, length=None):
    """Row cache `row` holds what batch-1 cache `ref` holds (up to float rounding): every written layer's keys
    and values over the conversation, and every Gated DeltaNet layer's recurrent state and conv window."""
    n = ref.length if length is None else length
    for a, b in zip(row.layers, ref.layers):
        assert a.is_initialized == b.is_initialized
        if b.is_initialized:
            torch.testing.assert_close(a.keys[:, :, :n], b.keys[:, :, :n], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(a.values[:, :, :n], b.values[:, :, :n], atol=2e-5, rtol=1e-4)
    assert row.gdn_states.keys() == ref.gdn_states.keys()
    for idx, state in ref.gdn_states.items():
        torch.testing.assert_close(row.gdn_states[idx].state, state.state, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(row.gdn_states[idx].conv, state.conv, atol=2e-5, rtol=1e-4)


def _messages(images, text):
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


CONVERSATIONS = [
    _messages([make_image(0)], "What is in the picture?"),
    _messages([make_image(1, (96, 160)), make_image(2)], "Compare the two pictures, please, in some detail"),
    _messages([], "Hi"),
    _messages([make_image(3, (64, 64))], "Colours?"),
]


def _inputs(processor, conversations):
    return processor.apply_chat_template(
        conversations, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
        processor_kwargs={"padding": True, "padding_side": "left"},
    )


def _history(batch, out, i):
    """Row i's exact tokens after a batched call: its prompt (padding removed), then what the call generated."""
    width = batch["input_ids"].shape[1]
    return torch.cat([batch["input_ids"][i][batch["attention_mask"][i].bool()], out.sequences[i, width:]])[None]


def _next_turn_batch(processor, batch, out, rows, message):
    """The left-padded next-turn batch of `rows` of a batched call, each asking `message`."""
    return batch_inputs([next_turn_inputs(processor, _history(batch, out, i), message) for i in rows],
                        processor.tokenizer.pad_token_id)


def _gen(model, inputs, cfg=None, n=N, **kw):
    kw = {**dict(max_new_tokens=n, do_sample=False, return_dict_in_generate=True), **kw}
    if cfg is not None:
        kw["raincheck_config"] = cfg
    with torch.no_grad():
        return model.generate(**inputs, **kw)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen2_5_vl", "qwen3_5"])
def family(request, tiny_vl_path, tiny_qwen2_5_vl_path, tiny_qwen3_5_path):
    if request.param == "qwen3_vl":
        model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    elif request.param == "qwen3_5":
        model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    else:
        model, processor = load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)
    return enable_raincheck(model), processor


CFG = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking")


@pytest.mark.parametrize("pruning", ["uniform", "mmtok"])
def test_every_row_equals_its_batch1_run(family, pruning):
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking", pruning=pruning)
    batch = _inputs(processor, CONVERSATIONS)
    assert not bool(batch["attention_mask"][:, 0].all()) and bool(batch["attention_mask"][:, -1].all())  # left padding
    out = _gen(model, batch, cfg)
    cache = output_cache(out)
    assert isinstance(cache, BatchedDeferredPrefillCache) and cache.batch_size == len(CONVERSATIONS)
    width = batch["input_ids"].shape[1]
    assert torch.equal(out.sequences[:, :width], batch["input_ids"])
    for i, conversation in enumerate(CONVERSATIONS):
        alone = _inputs(processor, [conversation])
        ref = _gen(model, alone, cfg, output_logits=True)
        ref_new = ref.sequences[0, alone["input_ids"].shape[1]:]
        assert out.sequences[i, width:width + ref_new.numel()].tolist() == ref_new.tolist(), f"row {i}"
        row, ref_cache = cache.split()[i], output_cache(ref)
        assert isinstance(row, DeferredPrefillCache)
        assert row.token_ids == ref_cache.token_ids
        assert [p.deferred.tolist() for p in cache.row_plans[i]] == [p.deferred.tolist() for p in ref_cache.plans]
        assert [p.boundary for p in cache.row_plans[i]] == [p.boundary for p in ref_cache.plans]
        assert cache.row_turn_stats[i] == ref_cache.turn_stats
        assert_same_cache(row, ref_cache)
    assert cache.row_total_deferred[2] == 0 and not cache.row_plans[2]  # the text-only row defers nothing
    assert all(t > 0 for k, t in enumerate(cache.row_total_deferred) if k != 2)
    assert cache.row_pending == [0] * len(CONVERSATIONS)


@pytest.mark.parametrize("cfg", [RaincheckConfig(retention=1.0), RaincheckConfig(retention=0.3, policy="full")],
                         ids=["retention1", "full"])
def test_baselines_equal_plain_batched_generate(family, cfg):
    model, processor = family
    batch = _inputs(processor, CONVERSATIONS)
    plain = _gen(model, batch, output_logits=True)
    ours = _gen(model, batch, cfg)
    assert torch.equal(ours.sequences, plain.sequences)
    assert output_cache(ours).row_total_deferred == [0] * len(CONVERSATIONS)


@pytest.mark.parametrize("completion", ["blocking", "background", "next_turn"])
def test_exactly_once_per_row_with_an_early_stop(family, completion):
    model, processor = family
    batch = _inputs(processor, CONVERSATIONS[:2])
    width = batch["input_ids"].shape[1]
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion=completion)
    probe = _gen(model, batch, RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking"))
    new = probe.sequences[:, width:].tolist()
    stop = next(t for t in new[0][1:] if t not in new[1])  # row 0 stops early on this token, row 1 does not
    steps0 = new[0].index(stop) + 1
    pad = 0
    out = _gen(model, batch, cfg, eos_token_id=stop, pad_token_id=pad)
    cache = output_cache(out)
    seq = out.sequences[:, width:].tolist()
    assert seq[0][:steps0] == new[0][:steps0] and all(t == pad for t in seq[0][steps0:])
    assert seq[1] == new[1][: len(seq[1])] and len(seq[1]) == N
    stats = cache.row_turn_stats
    for i in range(2):
        record = stats[i][0]
        assert record.deferred > 0 and record.deferred == cache.rows[i].plans[0].total_deferred
        assert record.deferred == record.restored_during_decode + record.pending_at_answer_end, f"row {i}"
    assert stats[0][0].pending_at_answer_end > 0  # the early row stopped with deferred tokens left
    if completion == "background":
        assert cache.wait(timeout=120)
    if completion in ("blocking", "background"):
        assert cache.row_pending == [0, 0]
        for i in range(2):
            record = stats[i][0]
            assert cache.rows[i].turn_stats[0].restored_after_answer == record.pending_at_answer_end
            assert bool(cache.rows[i].filled_prefix(cache.rows[i].length).all())  # every slot restored
    else:  # next_turn: the next turn of each row folds exactly what was left
        pending = cache.row_pending
        assert pending[0] == stats[0][0].pending_at_answer_end
        lengths = [steps0, N]
        for i, row in enumerate(cache.split()):
            prompt = batch["input_ids"][i][batch["attention_mask"][i].bool()]
            row_seq = torch.cat([prompt, out.sequences[i, width:width + lengths[i]]])[None]
            assert row.token_ids == row_seq[0, :-1].tolist()  # (the last generated token is never fed)
            turn2 = next_turn_inputs(processor, row_seq, [{"role": "user", "content": "Why?"}])
            out2 = _gen(model, turn2, cfg, n=2, **cache_argument(row))
            assert output_cache(out2) is row
            assert row.turn_stats[1].restored_in_prefill == pending[i]
            assert row.turn_stats[0].restored_after_answer == 0
            assert row.pending == 0 and bool(row.filled_prefix(row.length).all())


def test_split_caches_continue_like_batch1(family):
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS)
    width = batch["input_ids"].shape[1]
    out = _gen(model, batch, cfg)
    for i, row in enumerate(output_cache(out).split()):
        alone = _inputs(processor, [CONVERSATIONS[i]])
        ref = _gen(model, alone, cfg)
        ref_seq = ref.sequences
        n_new = ref_seq.shape[1] - alone["input_ids"].shape[1]
        row_seq = torch.cat([alone["input_ids"], out.sequences[i:i + 1, width:width + n_new]], dim=1)
        assert torch.equal(row_seq, ref_seq)
        message = [{"role": "user", "content": [{"type": "image", "image": make_image(9)},
                                                {"type": "text", "text": "And this one?"}]}]
        turn2 = next_turn_inputs(processor, row_seq, message)
        a = _gen(model, turn2, cfg, **cache_argument(row), output_logits=True)
        b = _gen(model, turn2, cfg, **cache_argument(output_cache(ref)), output_logits=True)
        assert torch.equal(a.sequences, b.sequences), f"row {i}"
        for x, y in zip(a.logits, b.logits):
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
        assert row.turn_stats == output_cache(ref).turn_stats


@pytest.mark.parametrize("completion", ["next_turn", "blocking"])
def test_batched_next_turn_equals_each_row_alone(family, completion):
    """Turn 2 of a batch continues every row from its row cache in one call (a new conversation joins in a row
    whose cache is None), with what each row left pending folded in: every row equals its batch-1 next turn."""
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion=completion)
    first = CONVERSATIONS[:3]
    batch = _inputs(processor, first)
    width = batch["input_ids"].shape[1]
    out = _gen(model, batch, cfg, n=4)
    follow = [{"role": "user", "content": [{"type": "image", "image": make_image(9)},
                                           {"type": "text", "text": "And this one?"}]}]
    rows = output_cache(out).split()
    refs, row_inputs = [], []
    for i, conversation in enumerate(first):
        alone = _inputs(processor, [conversation])
        ref = _gen(model, alone, cfg, n=4)
        seq = ref.sequences
        assert seq[0, alone["input_ids"].shape[1]:].tolist() == out.sequences[i, width:width + 4].tolist()
        row_inputs.append(next_turn_inputs(processor, seq, follow))
        refs.append(output_cache(ref))
    row_inputs.append(_inputs(processor, [CONVERSATIONS[3]]))  # a new conversation joins the batch
    batch2 = batch_inputs(row_inputs, processor.tokenizer.pad_token_id)
    out2 = _gen(model, batch2, cfg, n=4, **cache_argument(BatchedDeferredPrefillCache(rows + [None])))
    width2 = batch2["input_ids"].shape[1]
    assert output_cache(out2).rows[:3] == rows  # the same row caches, continued
    for i, inputs in enumerate(row_inputs):
        ref = _gen(model, inputs, cfg, n=4, **cache_argument(refs[i] if i < 3 else None))
        ref_new = ref.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        assert out2.sequences[i, width2:width2 + len(ref_new)].tolist() == ref_new, f"row {i}"
        assert output_cache(out2).row_turn_stats[i] == output_cache(ref).turn_stats, f"row {i}"
        assert output_cache(out2).rows[i].token_ids == output_cache(ref).token_ids
        if completion == "blocking":
            assert_same_cache(output_cache(out2).rows[i], output_cache(ref))


def test_step_logits_and_expanded_rows_equal_batch1(family):
    """``output_logits`` of a shared-step batch: each row's step logits equal its batch-1 run's (while it runs);
    ``num_return_sequences=2`` (sampling with top_k=1, so the copies can be checked) gives each prompt's copies
    the prompt's plan and its batch-1 answer."""
    model, processor = family
    conversations = [CONVERSATIONS[0], CONVERSATIONS[3]]
    batch = _inputs(processor, conversations)
    width = batch["input_ids"].shape[1]
    out = _gen(model, batch, CFG, output_logits=True)
    expanded = _gen(model, batch, CFG, num_return_sequences=2, do_sample=True, top_k=1)
    assert expanded.sequences.shape[0] == 4
    for i, conversation in enumerate(conversations):
        alone = _inputs(processor, [conversation])
        ref = _gen(model, alone, CFG, output_logits=True)
        ref_new = ref.sequences[0, alone["input_ids"].shape[1]:].tolist()
        for step, (a, b) in enumerate(zip(out.logits[: len(ref_new)], ref.logits)):
            torch.testing.assert_close(a[i], b[0], atol=2e-5, rtol=1e-4, msg=f"row {i} step {step}")
        for copy in (2 * i, 2 * i + 1):
            assert expanded.sequences[copy, width:width + len(ref_new)].tolist() == ref_new, f"copy {copy}"
            plans = output_cache(expanded).row_plans[copy]
            assert [p.deferred.tolist() for p in plans] == [p.deferred.tolist() for p in output_cache(ref).plans]


def test_carry_counts_share_the_budget():
    from hf_raincheck.generation.shared_batch import carry_counts, fused_window, row_carry_cap

    assert carry_counts([31, 31, 0, 5], None) == [31, 31, 0, 5]
    assert carry_counts([31, 31, 0, 5], 124) == [31, 31, 0, 5]  # a budget that does not bind changes nothing
    assert carry_counts([31, 31, 0, 5], 45) == [12, 12, 0, 5]  # at most ceil(45 / 4) = 12 a row
    assert carry_counts([5, 31, 31, 31], 17) == [5, 4, 4, 4]  # capped at 5, then small asks first, split evenly
    assert carry_counts([31, 31, 31], 64) == [22, 21, 21]  # the remainder to the earlier rows
    assert carry_counts([3, 3, 3], 2) == [1, 1, 0]
    assert carry_counts([31] * 16, 128) == [8] * 16  # the default budget at B = 16
    for wanted, budget in [([31] * 16, 128), ([7, 31, 2, 31, 31], 50), ([1] * 5, 3), ([31, 0, 0, 0], 20)]:
        counts = carry_counts(wanted, budget)
        cap = row_carry_cap(budget, len(wanted))
        assert sum(counts) == min(budget, sum(min(w, cap) for w in wanted))
        assert all(0 <= c <= min(w, cap) for c, w in zip(counts, wanted))
    # a compiled batch's fused window: chunk_size unless the budget's row cap is smaller
    assert [fused_window(31, 128, b) for b in (1, 4, 5, 8, 16)] == [31, 31, 26, 16, 8]
    assert fused_window(31, None, 16) == 31 and row_carry_cap(None, 16) is None
    # the defaults of models with Gated DeltaNet layers (chunk 63, budget 1024): every row carries its whole chunk
    # up to B = 16, so a fused step is [B, 64], a multiple of 64 rows (GEMMs without a ragged tile)
    chunk, budget = RaincheckConfig.CHUNK_GDN, RaincheckConfig.STEP_BUDGET_GDN
    assert all(fused_window(chunk, budget, b) == 63 for b in range(2, 17))
    assert fused_window(chunk, budget, 32) == 32  # past 16 rows the budget caps the window


def test_a_binding_step_budget_equals_batch1_fed_the_same_counts(family, monkeypatch):
    """docs/design.md, Batches: a row whose carry is cut by ``step_deferred_budget`` equals a batch-1 run of the
    same row fed the same counts step by step (a schedule replaying them)."""
    import hf_raincheck.generation.shared_batch as shared_batch

    model, processor = family
    conversations = [CONVERSATIONS[0], CONVERSATIONS[1], CONVERSATIONS[3]]
    cfg = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=1, completion="blocking", step_deferred_budget=5)
    seen = []
    real = shared_batch.carry_counts
    monkeypatch.setattr(shared_batch, "carry_counts", lambda wanted, budget: seen.append(real(wanted, budget)) or seen[-1])
    batch = _inputs(processor, conversations)
    width = batch["input_ids"].shape[1]
    out = _gen(model, batch, cfg)
    assert all(sum(c) <= 5 for c in seen)
    assert any(0 < c < 4 for counts in seen for c in counts)  # the budget did bind
    for i, conversation in enumerate(conversations):
        counts = [c[i] for c in seen]
        replay = RaincheckConfig(retention=0.3, completion="blocking",
                                 schedule=lambda step, pending, counts=counts: counts[step - 1] if step <= len(counts) else 0)
        alone = _inputs(processor, [conversation])
        ref = _gen(model, alone, replay)
        ref_new = ref.sequences[0, alone["input_ids"].shape[1]:].tolist()
        assert out.sequences[i, width:width + len(ref_new)].tolist() == ref_new, f"row {i}"
        assert output_cache(out).row_turn_stats[i] == output_cache(ref).turn_stats, f"row {i}"
        assert_same_cache(output_cache(out).rows[i], output_cache(ref))


def test_the_default_step_budget_is_the_models(family, monkeypatch):
    """``step_deferred_budget="auto"`` (the default) is resolved per call from the model: 128 for models whose
    layers are all attention layers, 1024 for models with Gated DeltaNet layers (the benchmarks page, "Batches");
    the config keeps saying ``"auto"``; an int the user sets is used as given."""
    import hf_raincheck.generation.shared_batch as shared_batch

    model, processor = family
    budgets = []
    real = shared_batch.carry_counts
    monkeypatch.setattr(shared_batch, "carry_counts", lambda wanted, budget: budgets.append(budget) or real(wanted, budget))
    batch = _inputs(processor, CONVERSATIONS[:2])
    cfg = RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=1, completion="blocking")
    assert cfg.step_deferred_budget == "auto"
    out = _gen(model, batch, cfg)
    gdn = model._raincheck_state.adapter.gdn_glue is not None
    assert gdn == (model.config.model_type == "qwen3_5")
    assert budgets and set(budgets) == {1024 if gdn else 128}
    assert output_cache(out).rows[0].config.step_deferred_budget == "auto"
    budgets.clear()
    _gen(model, batch, RaincheckConfig(retention=0.3, chunk_size=4, guard_tokens=1, completion="blocking",
                                       step_deferred_budget=3))
    assert budgets and set(budgets) == {3}


def test_unsupported_batches_raise(family):
    model, processor = family
    batch = _inputs(processor, CONVERSATIONS[:2])
    static_rows = BatchedDeferredPrefillCache([DeferredPrefillCache(2, static=True, max_cache_len=64)
                                               for _ in range(2)])
    for kw, message in [
        (dict(**cache_argument(static_rows), output_logits=True),  # (rows of batch-1 static caches: one after the other)
         "output_logits .* not supported when the rows run"),
        (dict(streamer=TextStreamer(processor.tokenizer)), "only supports batch size 1"),  # (transformers' own)
        (dict(output_attentions=True), "output_attentions"),
        (dict(num_beams=2), "beam search is not supported"),
        (dict(num_return_sequences=2, do_sample=True, **cache_argument(BatchedDeferredPrefillCache([None, None]))),
         "num_return_sequences > 1 starts new conversations"),
        (cache_argument(DeferredPrefillCache(2)), f"{hf.CACHE_ARGUMENT} must be a BatchedDeferredPrefillCache"),
        (cache_argument(BatchedDeferredPrefillCache([None])), "holds 1 rows but input_ids has 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            _gen(model, batch, CFG, n=2, **kw)
    right = dict(batch)
    right["attention_mask"] = batch["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="not left-padded"):
        _gen(model, right, CFG, n=2)


def test_static_batches_equal_batch1(family):
    """Static caches run the shared engine on a static batch cache (its steps eager on the CPU without a compile
    config, compiled otherwise: tests/test_batch_compiled.py), Qwen3.5's Gated DeltaNet layers included."""
    from hf_raincheck.generation.batch import shared_steps_supported
    from hf_raincheck.generation.state import raincheck_state

    model, processor = family
    kw = dict(cache_implementation="static")
    conversations = CONVERSATIONS[:3]
    batch = _inputs(processor, conversations)
    out = _gen(model, batch, CFG, n=6, **kw)
    why = shared_steps_supported(raincheck_state(model, "test"), "static", "sdpa", None)
    assert why is None and output_cache(out).static and not any(r.static for r in output_cache(out).rows)
    width = batch["input_ids"].shape[1]
    for i, conversation in enumerate(conversations):
        alone = _inputs(processor, [conversation])
        ref = _gen(model, alone, CFG, n=6, **kw)
        ref_new = ref.sequences[0, alone["input_ids"].shape[1]:].tolist()
        assert out.sequences[i, width:width + len(ref_new)].tolist() == ref_new, f"row {i}"
        assert output_cache(out).row_turn_stats[i] == output_cache(ref).turn_stats


def test_batch1_cache_has_the_row_views(family):
    model, processor = family
    out = _gen(model, _inputs(processor, CONVERSATIONS[:1]), RaincheckConfig(retention=0.3, completion="next_turn"))
    cache = output_cache(out)
    assert isinstance(cache, DeferredPrefillCache) and cache.split() == [cache]
    assert cache.row_pending == [cache.pending] and cache.pending > 0
    assert cache.row_total_deferred == [cache.total_deferred]
    assert cache.row_plans == [cache.plans] and cache.row_turn_stats == [cache.turn_stats]


def test_pipeline_batch_size_two(tiny_vl_path):
    from transformers import pipeline

    model, processor = load_tiny_qwen3_vl(tiny_vl_path)
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking")
    kw = dict(generate_kwargs={"raincheck_config": cfg, "do_sample": False, "max_new_tokens": 6})
    texts = [CONVERSATIONS[0], CONVERSATIONS[3]]
    pipe = enable_raincheck(pipeline("image-text-to-text", model=model, processor=processor))
    processor.tokenizer.padding_side = "right"  # (after the pipeline is built: from 5.25 it sets left itself)
    with pytest.raises(ValueError, match="not left-padded"):
        pipe(text=texts, batch_size=2, **kw)
    processor.tokenizer.padding_side = "left"
    batched = pipe(text=texts, batch_size=2, **kw)
    alone = pipe(text=texts, batch_size=1, **kw)
    answers = [[x[0]["generated_text"][-1]["content"] for x in out] for out in (batched, alone)]
    assert answers[0] == answers[1] and all(answers[0])


def test_qwen2_5_vl_batch_with_videos_equals_batch1(tiny_qwen2_5_vl_path):
    """Videos cut per row (their pixels, grids and ``second_per_grid_ts``: 0.25 fps and 1 fps, so a wrong cut
    moves the temporal positions), next to an image row."""
    from transformers.video_utils import VideoMetadata

    from hf_raincheck.testing import make_video

    model, processor = load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)
    enable_raincheck(model)
    video = [{"role": "user", "content": [{"type": "video", "video": make_video(5)}, {"type": "text", "text": "What?"}]}]
    video2 = [{"role": "user", "content": [{"type": "video", "video": make_video(6)},
                                           {"type": "text", "text": "What happens here, then?"}]}]
    conversations = [video, CONVERSATIONS[0], video2]
    metas = [VideoMetadata(total_num_frames=4, fps=0.25), VideoMetadata(total_num_frames=4, fps=1.0)]

    def inputs(convs, meta):
        return processor.apply_chat_template(
            convs, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt",
            processor_kwargs={"padding": True, "padding_side": "left", "video_metadata": meta})

    batch = inputs(conversations, metas)
    assert batch["second_per_grid_ts"].tolist() == [8.0, 2.0]
    out = _gen(model, batch, CFG)
    width = batch["input_ids"].shape[1]
    for i, (conversation, meta) in enumerate(zip(conversations, [metas[:1], None, metas[1:]])):
        alone = inputs([conversation], meta) if meta else _inputs(processor, [conversation])
        ref = _gen(model, alone, CFG)
        ref_new = ref.sequences[0, alone["input_ids"].shape[1]:].tolist()
        assert out.sequences[i, width:width + len(ref_new)].tolist() == ref_new, f"row {i}"
        assert output_cache(out).row_turn_stats[i] == output_cache(ref).turn_stats
        row, ref_cache = output_cache(out).rows[i], output_cache(ref)
        assert row.rope_delta == ref_cache.rope_delta  # (the temporal positions move it)
        assert [p.deferred.tolist() for p in row.plans] == [p.deferred.tolist() for p in ref_cache.plans]
        for a, b in zip(row.layers, ref_cache.layers):
            torch.testing.assert_close(a.keys, b.keys, atol=2e-5, rtol=1e-4)


def test_complete_deferred_of_a_batch(family):
    """``complete_deferred`` on a `BatchedDeferredPrefillCache`: every row's pending tokens, in shared forwards,
    ``max_tokens`` per row; the rows then hold what a batch-1 blocking run holds."""
    from hf_raincheck import complete_deferred

    model, processor = family
    conversations = [CONVERSATIONS[0], CONVERSATIONS[2], CONVERSATIONS[1]]
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    out = _gen(model, _inputs(processor, conversations), cfg, n=3)
    group = output_cache(out)
    pending = group.row_pending
    assert pending[0] > 2 and pending[1] == 0 and pending[2] > 2
    assert complete_deferred(model, group, max_tokens=2) == 4
    assert group.row_pending == [pending[0] - 2, 0, pending[2] - 2]
    assert complete_deferred(model, group) == sum(pending) - 4 and group.pending == 0
    for i, conversation in enumerate(conversations):
        ref = _gen(model, _inputs(processor, [conversation]), RaincheckConfig(
            retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking"), n=3)
        assert group.rows[i].turn_stats[0].restored_after_answer == pending[i]
        assert_same_cache(group.rows[i], output_cache(ref))


def test_batched_calls_build_no_autograd_graph(family):
    """Called with gradients on (as a server thread or a script without ``torch.no_grad`` calls it), a batched
    generate and a batch's ``complete_deferred`` run every forward without autograd, as transformers' generate does:
    a graph kept by the cache held every vision block's and every prefill layer's activations (an 8-row server batch
    of 4096-token images ran out of an H200's 140 GB)."""
    from hf_raincheck import complete_deferred

    model, processor = family
    assert any(p.requires_grad for p in model.parameters())
    seen = []
    record = lambda *_: seen.append(torch.is_grad_enabled())  # noqa: E731
    modules = [m for name, m in model.named_modules() if name.endswith(("visual", "layers.0"))]
    assert len(modules) == 2
    handles = [m.register_forward_pre_hook(record) for m in modules]
    try:
        cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
        kw = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, raincheck_config=cfg)
        out = model.generate(**_inputs(processor, CONVERSATIONS[:2]), **kw)
        assert complete_deferred(model, output_cache(out)) > 0
    finally:
        for h in handles:
            h.remove()
    assert seen and not any(seen)
    for row in output_cache(out).rows:
        assert not any(t.requires_grad for layer in row.layers if layer.is_initialized for t in (layer.keys, layer.values))


def _cache_distance(row, ref) -> float:
    """The largest absolute difference between row cache `row` and batch-1 cache `ref` over what
    `assert_same_cache` compares."""
    n = ref.length
    diffs = [float((a.keys[:, :, :n] - b.keys[:, :, :n]).abs().max()) for a, b in zip(row.layers, ref.layers)
             if b.is_initialized]
    diffs += [float((a.values[:, :, :n] - b.values[:, :, :n]).abs().max()) for a, b in zip(row.layers, ref.layers)
              if b.is_initialized]
    for idx, state in ref.gdn_states.items():
        diffs += [float((row.gdn_states[idx].state - state.state).abs().max()),
                  float((row.gdn_states[idx].conv - state.conv).abs().max())]
    return max(diffs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_steps_on_cuda_equal_batch1(family):
    """The shared engine on CUDA (SDPA's CUDA kernels, the grouped path for masked steps) with fp32 kernels in every
    layer (Qwen3.5: transformers' torch GDN functions; fla-core's run TF32 products, next test): every row's tokens
    and cache equal its batch-1 run's on CUDA."""
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking", gdn_backend="torch")
    model.cuda()
    try:
        batch = {k: v.cuda() for k, v in _inputs(processor, CONVERSATIONS).items()}
        out = _gen(model, batch, cfg)
        width = batch["input_ids"].shape[1]
        for i, conversation in enumerate(CONVERSATIONS):
            alone = {k: v.cuda() for k, v in _inputs(processor, [conversation]).items()}
            ref = _gen(model, alone, cfg)
            ref_new = ref.sequences[0, alone["input_ids"].shape[1]:].tolist()
            assert out.sequences[i, width:width + len(ref_new)].tolist() == ref_new, f"row {i}"
            assert_same_cache(output_cache(out).rows[i], output_cache(ref))
    finally:
        model.cpu()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_batch_rows_stay_as_close_as_batch1(tiny_qwen3_5_path):
    """Qwen3.5 with fla-core's GDN kernels on CUDA: their products are TF32, and a batch row's rows reach them at
    other chunk offsets than alone (left padding and other rows' tails are inert rows), so a row's cache is its
    batch-1 run's only to TF32 rounding. Every row: its batch-1 run's tokens, and a cache no farther from the fp32
    batch-1 run (``gdn_backend="torch"``) than twice the batch-1 fla run is (plus fp32 rounding)."""
    from hf_raincheck.gdn_state import kernels

    if not kernels.fla_available():
        pytest.skip("needs fla-core")
    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    model = enable_raincheck(model).cuda()
    fla = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking", gdn_backend="fla")
    fp32 = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking", gdn_backend="torch")
    batch = {k: v.cuda() for k, v in _inputs(processor, CONVERSATIONS).items()}
    out = _gen(model, batch, fla)
    width = batch["input_ids"].shape[1]
    for i, conversation in enumerate(CONVERSATIONS):
        alone = {k: v.cuda() for k, v in _inputs(processor, [conversation]).items()}
        ref, exact = _gen(model, alone, fla), _gen(model, alone, fp32)
        ref_new = ref.sequences[0, alone["input_ids"].shape[1]:].tolist()
        assert out.sequences[i, width:width + len(ref_new)].tolist() == ref_new, f"row {i}"
        alone_error = _cache_distance(output_cache(ref), output_cache(exact))
        batch_error = _cache_distance(output_cache(out).rows[i], output_cache(exact))
        assert batch_error <= 2 * alone_error + 2e-5, (i, batch_error, alone_error)


def test_consecutive_calls_of_other_batch_sizes_continue(family):
    """transformers keeps the last call's M-RoPE deltas on the model and adds them to a continued call's positions;
    a continued call of another batch size (3 rows, then 2 of them, then 1 alone) must not trip on them."""
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS[:3])
    out = _gen(model, batch, cfg, n=3)
    rows = output_cache(out).split()
    follow = [{"role": "user", "content": "Why?"}]
    turn2 = _next_turn_batch(processor, batch, out, [0, 1], follow)
    out2 = _gen(model, turn2, cfg, n=3, **cache_argument(BatchedDeferredPrefillCache(rows[:2])))
    assert out2.sequences.shape[0] == 2 and rows[0].pending == 0 and rows[1].pending == 0
    alone = _history(turn2, out2, 0)
    out3 = _gen(model, next_turn_inputs(processor, alone, follow), cfg, n=2, **cache_argument(rows[0]))
    assert output_cache(out3) is rows[0] and len(rows[0].turn_stats) == 3


def test_a_row_continued_alone_gets_its_own_buffers(family):
    """Row caches of a batch are views of shared buffers; a row continued alone moves to buffers of its own (so it
    does not keep the whole batch's alive), with the same entries, while the other rows keep sharing."""
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="blocking")
    batch = _inputs(processor, CONVERSATIONS[:2])
    out = _gen(model, batch, cfg, n=3)
    rows = output_cache(out).split()
    layer = next(i for i, a in enumerate(rows[0].layers) if a.is_initialized)
    shared = lambda t: t.untyped_storage().nbytes() > t.nbytes  # noqa: E731
    assert shared(rows[0].layers[layer].keys) and shared(rows[1].layers[layer].keys)
    before = rows[0].layers[layer].keys[:, :, : rows[0].length].clone()
    _gen(model, next_turn_inputs(processor, _history(batch, out, 0), [{"role": "user", "content": "Why?"}]), cfg, n=2,
         **cache_argument(rows[0]))
    assert not shared(rows[0].layers[layer].keys) and shared(rows[1].layers[layer].keys)
    torch.testing.assert_close(rows[0].layers[layer].keys[:, :, : before.shape[2]], before)


LONG = _messages([make_image(4, (128, 128))], "Describe it, " + "every detail of it, " * 80)


def _own(tensor, slots: int) -> bool:
    """Whether `tensor` (a KV buffer, or a filled-slot mask) holds `slots` slots in a storage of its own."""
    return tensor.shape[2 if tensor.dim() == 4 else 0] == slots and tensor.untyped_storage().nbytes() == tensor.nbytes


def _gdn_fields(layer):
    """A `GDNLayerState`'s tensors by field name (state, conv window, checkpoint)."""
    fields = [("state", layer.state), ("conv", layer.conv)]
    if layer.prefix is not None:
        fields += [("prefix.recurrent", layer.prefix.recurrent), ("prefix.conv", layer.prefix.conv)]
    return [(name, t) for name, t in fields if t is not None]


def test_trimmed_rows_hold_their_own_right_sized_buffers_and_continue_like_batch1(family, monkeypatch):
    """The rows of a batch of different lengths, trimmed (`DeferredPrefillCache.trim`, what the server does before
    it pools a row): each holds KV buffers and a filled-slot mask of its own, of its slots rounded up to 256, with
    the same entries, and GDN states of its own (Qwen3.5), and the batch's shared buffers and step outputs are freed; continued together (rows folding different pending
    counts into one shared prefill) and then alone, the trimmed rows equal their batch-1 conversations. The shared
    forwards allocate the width the call needs: a short row's padding next to a row folding its pending tokens
    writes one scratch slot, not one per padding position."""
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    first = [LONG, CONVERSATIONS[2], CONVERSATIONS[0]]
    batch = _inputs(processor, first)
    width = batch["input_ids"].shape[1]
    out = _gen(model, batch, cfg, n=4)
    sequences = out.sequences
    group = output_cache(out)
    rows = group.split()
    shared = [weakref.ref(t) for t in group.keys + group.values + [group.filled] if t is not None]
    assert len(shared) > 1
    before = [[(a.keys[:, :, :r.length].clone(), a.values[:, :, :r.length].clone()) for a in r.layers
               if a.is_initialized] for r in rows]
    filled = [r.filled.clone() for r in rows]
    gdn = [{(idx, field): t for idx, layer in r.gdn_states.items() for field, t in _gdn_fields(layer)} for r in rows]
    # Qwen3.5: the rows' GDN states are rows of the batch's last forward's outputs (a trim gives them their own)
    gdn_bases = [weakref.ref(t._base) for states in gdn for t in states.values() if t._base is not None]
    assert (len(gdn_bases) > 0) == bool(rows[0].gdn_states)
    gdn = [{key: t.clone() for key, t in states.items()} for states in gdn]
    needed = [-(-r.length // 256) * 256 for r in rows]
    assert needed[0] > needed[1]  # (rows of different sizes)
    for row in rows:
        row.trim()
    for i, row in enumerate(rows):
        assert row.capacity_needed == needed[i]
        layers = [a for a in row.layers if a.is_initialized]
        assert len(layers) == len(before[i]) > 0
        for layer, (keys, values) in zip(layers, before[i]):
            assert _own(layer.keys, needed[i]) and _own(layer.values, needed[i]), f"row {i}"
            assert torch.equal(layer.keys[:, :, :row.length], keys) and torch.equal(layer.values[:, :, :row.length],
                                                                                      values)
        assert row.filled.untyped_storage().nbytes() == row.slot_index.numel() == needed[i]  # (bool: a byte a slot)
        assert torch.equal(row.filled, filled[i])
        states = {(idx, field): t for idx, layer in row.gdn_states.items() for field, t in _gdn_fields(layer)}
        assert states.keys() == gdn[i].keys()
        for key, t in states.items():
            assert t.untyped_storage().nbytes() == t.nbytes and torch.equal(t, gdn[i][key]), f"row {i} {key}"
        assert row.trim() == needed[i]  # (trimmed already: nothing moves)
    del out, group
    gc.collect()
    assert all(ref() is None for ref in shared + gdn_bases)  # no row uses the batch's tensors: they are freed

    widths = []
    share_buffers = BatchedDeferredPrefillCache.share_buffers

    def recorded(self, needed):
        widths.append(needed)
        return share_buffers(self, needed)

    monkeypatch.setattr(BatchedDeferredPrefillCache, "share_buffers", recorded)
    image_follow = [{"role": "user", "content": [{"type": "image", "image": make_image(9)},
                                                 {"type": "text", "text": "And this one?"}]}]
    text_follow = [{"role": "user", "content": "Why?"}]
    refs, row_inputs = [], []
    for i, conversation in enumerate(first):
        alone = _inputs(processor, [conversation])
        ref = _gen(model, alone, cfg, n=4)
        assert ref.sequences[0, alone["input_ids"].shape[1]:].tolist() == sequences[i, width:width + 4].tolist()
        row_inputs.append(next_turn_inputs(processor, ref.sequences, text_follow if i == 1 else image_follow))
        refs.append(ref)
    pending = [row.pending for row in rows]
    assert pending[0] > cfg.chunk_size + 1 and pending[1] == 0  # (folded into turn 2's prefill next to a short row)
    batch2 = batch_inputs(row_inputs, processor.tokenizer.pad_token_id)
    width2 = batch2["input_ids"].shape[1]
    out2 = _gen(model, batch2, cfg, n=4, **cache_argument(BatchedDeferredPrefillCache(rows)))
    assert max(widths) <= max(row.length for row in rows) + cfg.chunk_size + 1, widths
    for i, inputs in enumerate(row_inputs):
        ref = _gen(model, inputs, cfg, n=4, **cache_argument(output_cache(refs[i])))
        refs[i] = ref
        ref_new = ref.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        assert out2.sequences[i, width2:width2 + len(ref_new)].tolist() == ref_new, f"row {i}"
        assert rows[i].turn_stats == output_cache(ref).turn_stats and rows[i].token_ids == \
            output_cache(ref).token_ids
    rows[0].trim()
    turn3 = next_turn_inputs(processor, refs[0].sequences, text_follow)
    a = _gen(model, turn3, cfg, n=4, **cache_argument(rows[0]), output_logits=True)
    b = _gen(model, turn3, cfg, n=4, **cache_argument(output_cache(refs[0])), output_logits=True)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.logits, b.logits):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-4)
    assert_same_cache(rows[0], output_cache(b))


def test_a_batch_continued_without_raincheck_config_takes_its_rows_config(family):
    """Like a batch-1 cache, a `BatchedDeferredPrefillCache` passed back brings its rows' config; one whose rows
    never ran Raincheck asks for raincheck_config."""
    model, processor = family
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=2, completion="next_turn")
    batch = _inputs(processor, CONVERSATIONS[:2])
    out = _gen(model, batch, cfg, n=3)
    rows = output_cache(out).split()
    turn2 = _next_turn_batch(processor, batch, out, [0, 1], [{"role": "user", "content": "Why?"}])
    out2 = _gen(model, turn2, None, n=2, **cache_argument(BatchedDeferredPrefillCache(rows)))
    assert all(len(r.turn_stats) == 2 and r.pending == 0 for r in rows)
    assert output_cache(out2).rows == rows
    with pytest.raises(ValueError, match="BatchedDeferredPrefillCache that no Raincheck call has used yet"):
        _gen(model, batch, None, n=2, **cache_argument(BatchedDeferredPrefillCache([None, None])))


def test_qwen3_5_decode_rows_share_one_gdn_call_per_layer(tiny_qwen3_5_path, monkeypatch):
    """Eager shared steps of Qwen3.5: the rows that only decode (every row of a decode-only step, the rows that carry
    nothing in a fused step) run each GDN layer in one kernel call for all of them; a row that carries deferred
    tokens runs its own. Each row still equals its batch-1 run (step logits too)."""
    from hf_raincheck.gdn_state import kernels

    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    model = enable_raincheck(model)
    calls = []
    original = kernels.gated_delta
    monkeypatch.setattr(kernels, "gated_delta", lambda *a, **kw: calls.append(a[1].shape[0]) or original(*a, **kw))
    gdn_layers = model.config.text_config.layer_types.count("linear_attention")
    batch = _inputs(processor, CONVERSATIONS)
    width = batch["input_ids"].shape[1]
    full = RaincheckConfig(retention=1.0)  # nothing deferred: every step after the prefill is decode-only
    out = _gen(model, batch, full, n=6, output_logits=True)
    prefill, decode = calls[:gdn_layers], calls[gdn_layers:]  # (the prefill: no plan, every row in one call too)
    assert prefill == [len(CONVERSATIONS)] * gdn_layers
    assert decode == [len(CONVERSATIONS)] * (5 * gdn_layers)
    calls.clear()
    conversations = [CONVERSATIONS[0], CONVERSATIONS[2], _messages([], "Hello there, how are you?")]
    batch = _inputs(processor, conversations)
    width = batch["input_ids"].shape[1]
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn")
    out = _gen(model, batch, cfg, n=6, output_logits=True)
    assert 2 in calls and 1 in calls  # fused steps: the two text rows together, the carrying row alone
    for i, conversation in enumerate(conversations):
        alone = _inputs(processor, [conversation])
        ref = _gen(model, alone, cfg, n=6, output_logits=True)
        ref_new = ref.sequences[0, alone["input_ids"].shape[1]:].tolist()
        assert out.sequences[i, width:width + len(ref_new)].tolist() == ref_new, f"row {i}"
        for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
            torch.testing.assert_close(a[i], b[0], atol=2e-5, rtol=1e-4, msg=f"row {i} step {step}")
        assert_same_cache(output_cache(out).rows[i], output_cache(ref))


def test_qwen3_5_prefill_rows_share_gdn_calls_per_layer(tiny_qwen3_5_path, monkeypatch):
    """Eager shared prefills of Qwen3.5: the rows that continue a live state (no plan: Full, a text-only prompt) run
    each GDN layer in one call of each piece for all of them, and so do Raincheck's rows with a new plan's boundary
    inside (one kernel call for the rows before the boundaries, one for the tails); one layer's GDN forward per
    row (`gdn_rows_forward`) is left only for a lone row of its kind. Each row still equals its batch-1 run."""
    from hf_raincheck.gdn_state import kernels, shared_layer as gdn_layer

    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    model = enable_raincheck(model)
    calls, alone = [], []
    original, original_rows = kernels.gated_delta, gdn_layer.gdn_rows_forward
    monkeypatch.setattr(kernels, "gated_delta", lambda *a, **kw: calls.append(a[1].shape[0]) or original(*a, **kw))
    monkeypatch.setattr(gdn_layer, "gdn_rows_forward", lambda *a, **kw: alone.append(1) or original_rows(*a, **kw))
    gdn_layers = model.config.text_config.layer_types.count("linear_attention")
    conversations = CONVERSATIONS + [_messages([], "Hello there, how are you?")]  # 3 rows with images, 2 without
    batch = _inputs(processor, conversations)
    width = batch["input_ids"].shape[1]
    for cfg, expected in [(RaincheckConfig(policy="full"), [5] * gdn_layers),
                          (RaincheckConfig(policy="hard", retention=0.3), [5] * gdn_layers),
                          (RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn"),
                           [3, 3, 2] * gdn_layers)]:
        calls.clear(), alone.clear()
        out = _gen(model, batch, cfg, n=1, output_logits=True)
        assert sorted(calls) == sorted(expected), cfg.policy
        assert not alone, cfg.policy
        for i, conversation in enumerate(conversations):
            single = _inputs(processor, [conversation])
            ref = _gen(model, single, cfg, n=1, output_logits=True)
            assert out.sequences[i, width:].tolist() == ref.sequences[0, single["input_ids"].shape[1]:].tolist()
            torch.testing.assert_close(out.logits[0][i], ref.logits[0][0], atol=2e-5, rtol=1e-4, msg=f"row {i}")
            assert_same_cache(output_cache(out).rows[i], output_cache(ref))


def test_qwen3_5_first_token_call_host_work_does_not_grow_per_row_and_gdn_layer(tiny_qwen3_5_path, monkeypatch):
    """Raincheck's first-token call of a Qwen3.5 batch (every row with an image, so every row's prefill has a new
    plan's boundary inside: `gdn_checkpoint_rows_forward`) issues the same operators per GDN layer for 4 rows as
    for 2: each row's checkpoint (boundary state, conv window) and ``[S | P_tail = I]`` are rows of tensors built
    once per layer for all rows, and the identity is built once per forward, not once per row and layer. Eager
    forwards on a GPU are host-bound, so every operator per row and GDN layer costs launches that Hard (no
    checkpoint, no P_tail) does not pay. View operators (slices, expands) launch nothing and are not counted.

    Likewise each Raincheck row's turn preparation moves its deferred data (slots, their rows in the call, the slot
    mask) to the model's device in one transfer: Raincheck's `prepare_turn` moves at most one tensor more to the
    device than Hard's (a transfer each, host round trips on a GPU).

    Rows 3 and 4 repeat rows 1 and 2, so every layer's rows have the same lengths and cuts in both batches (the
    torch kernel's operators depend on the length); each row still equals its batch-1 run."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_raincheck.gdn_state import shared_layer as gdn_layer
    from hf_raincheck.generation import shared_batch

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.counts[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    model, processor = load_tiny_qwen3_5(tiny_qwen3_5_path)
    model = enable_raincheck(model)
    gdn_layers = model.config.text_config.layer_types.count("linear_attention")
    per_layer = []
    original = gdn_layer.gdn_checkpoint_rows_forward

    def counted(*args, **kwargs):
        with Ops() as ops:
            out = original(*args, **kwargs)
        per_layer.append(ops.counts)
        return out

    moves, preparing = [], []  # per prepared row: its `Tensor.to(device)` calls
    original_to, original_prepare = torch.Tensor.to, shared_batch.prepare_turn

    def to(self, *args, **kwargs):
        if preparing and (isinstance(kwargs.get("device"), torch.device)
                          or any(isinstance(a, torch.device) for a in args)):
            moves[-1] += 1
        return original_to(self, *args, **kwargs)

    def prepare(*args, **kwargs):
        moves.append(0)
        preparing.append(True)
        try:
            return original_prepare(*args, **kwargs)
        finally:
            preparing.pop()

    monkeypatch.setattr(gdn_layer, "gdn_checkpoint_rows_forward", counted)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(shared_batch, "prepare_turn", prepare)
    cfg = RaincheckConfig(retention=0.3, chunk_size=3, guard_tokens=1, completion="next_turn")
    pair = [CONVERSATIONS[0], CONVERSATIONS[3]]
    _gen(model, _inputs(processor, pair), cfg, n=1)  # (once first: what a process builds once, e.g. a cached zero)
    counts = {}
    for rows in (pair, pair + pair):
        per_layer.clear()
        batch = _inputs(processor, rows)
        out = _gen(model, batch, cfg, n=1, output_logits=True)
        assert len(per_layer) == gdn_layers, len(per_layer)  # every row in one call per GDN layer
        counts[len(rows)] = list(per_layer)
        for i, conversation in enumerate(rows[:2]):
            single = _inputs(processor, [conversation])
            ref = _gen(model, single, cfg, n=1, output_logits=True)
            torch.testing.assert_close(out.logits[0][i], ref.logits[0][0], atol=2e-5, rtol=1e-4, msg=f"row {i}")
            assert_same_cache(output_cache(out).rows[i], output_cache(ref))
    for layer, (two, four) in enumerate(zip(counts[2], counts[4])):
        grown = {op: four[op] - two[op] for op in set(two) | set(four) if four[op] != two[op]}
        assert not grown, f"GDN layer {layer}: operators that grow with the rows: {grown}"
    eyes = [c["eye"] for c in counts[4]]
    assert sum(eyes) <= 1, eyes  # one identity per forward (built in its first GDN layer)
    monkeypatch.setattr(gdn_layer, "gdn_checkpoint_rows_forward", original)
    batch = _inputs(processor, pair + pair)
    moved = {}
    for policy, config in (("raincheck", cfg), ("hard", RaincheckConfig(policy="hard", retention=0.3))):
        moves.clear()
        _gen(model, batch, config, n=1)
        assert len(moves) == 4, moves
        moved[policy] = list(moves)
    assert all(r <= h + 1 for r, h in zip(moved["raincheck"], moved["hard"])), moved
