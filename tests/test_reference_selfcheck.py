"""Self-checks of the independent Qwen3-VL reference (tests/reference_qwen3_vl.py). CPU, fast."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from reference_qwen3_vl import (  # noqa: E402
    build_mask,
    build_schedule,
    encode_conversation,
    find_spans,
    plan_boundary,
    reference_logits,
    run_reference,
)

from handmade import ATOL, IMG, VID, VS, VE, VOCAB, _conv, _extend, _text, _tiny_model, _video_conv  # noqa: E402,F401

@pytest.fixture(scope="module")
def model():
    return _tiny_model("eager")


@pytest.fixture(scope="module")
def model_sdpa():
    return _tiny_model("sdpa")


def test_image_and_video_single_forward_equals_model(model):
    inputs = _video_conv()
    L = inputs["input_ids"].shape[1]
    spans = find_spans(inputs["input_ids"], IMG, VID)
    assert len(spans) == 3
    with torch.no_grad():
        want = model(**inputs).logits[0].float()
    ref = reference_logits(model, inputs, [list(range(L))])
    torch.testing.assert_close(ref.logits, want, atol=ATOL, rtol=1e-5)
    # with deferral in the video frames, the permuted layout still agrees
    D = [i for s, e in spans[1:] for i in range(s + 1, e)]
    sched = build_schedule(L, D, 1, completion="blocking", completion_chunk_size=2)
    a = reference_logits(model, inputs, sched.forwards, [(D, plan_boundary(spans))])
    rev = [list(reversed(f)) for f in sched.forwards]
    b = reference_logits(model, inputs, rev, [(D, plan_boundary(spans))])
    torch.testing.assert_close(a.at_many(range(L)), b.at_many(range(L)), atol=ATOL, rtol=1e-5)


def test_schedule_rules():
    # prompt 10 tokens, D = {3,4,5,6,7}, chunk 2, guard 1, 5 tokens generated
    s = build_schedule(10, [3, 4, 5, 6, 7], 5, chunk_size=2, guard_tokens=1, completion="blocking",
                       completion_chunk_size=3)
    assert s.forwards == [[0, 1, 2, 8, 9], [10], [3, 4, 11], [5, 6, 12], [7, 13]]
    assert s.logit_rows == [9, 10, 11, 12, 13] and s.pending == []
    s = build_schedule(10, [3, 4, 5, 6, 7], 3, chunk_size=2, guard_tokens=1, completion="blocking",
                       completion_chunk_size=2)
    assert s.forwards == [[0, 1, 2, 8, 9], [10], [3, 4, 11], [5, 6], [7]]
    s = build_schedule(10, [3, 4, 5, 6, 7], 3, chunk_size=2, guard_tokens=1, completion="next_turn")
    assert s.forwards == [[0, 1, 2, 8, 9], [10], [3, 4, 11]] and s.pending == [5, 6, 7]
    t2 = build_schedule(16, [], 2, new_start=12, pending_before=s.pending)
    assert t2.forwards == [[5, 6, 7, 12, 13, 14, 15], [16]] and t2.logit_rows == [15, 16]
    h = build_schedule(10, [3, 4], 2, policy="hard")
    assert h.forwards == [[0, 1, 2, 5, 6, 7, 8, 9], [10]] and h.pending == []
    f = build_schedule(10, [3, 4], 2, policy="full")
    assert f.forwards == [list(range(10)), [10]]


def test_mask_rules():
    # logical 0..5, plan D={2,3} boundary 4; 4,5 tail. forwards: [0,1,4,5], [2,3,6]
    fw = [[0, 1, 4, 5], [3, 2, 6]]
    m = build_mask(fw, [({2, 3}, 4)], return_bool=True)
    rows = [0, 1, 4, 5, 3, 2, 6]
    vis = {(rows[r], rows[s]) for r in range(7) for s in range(7) if m[r, s]}
    assert (4, 2) not in vis and (5, 3) not in vis  # tail never sees later-restored D
    assert (3, 1) in vis and (3, 2) in vis and (3, 3) in vis and (3, 4) not in vis  # D sees prefix + earlier D
    assert (2, 3) not in vis and (2, 1) in vis  # causal among D
    assert (6, 2) in vis and (6, 3) in vis and (6, 5) in vis  # decode row sees same-step chunk
    m2 = build_mask([[0, 1, 2, 3, 4]], [({2}, 3)], return_bool=True)
    assert not m2[2, 3] and not m2[2, 4] and m2[2, 2]  # D row never sees the tail (>= boundary)
    assert m2[3, 2] and m2[4, 2]  # tail sees a D row restored in the same forward
    m3 = build_mask([[0, 1, 2, 3, 4]], [({1}, 4)], return_bool=True)
    assert m3[1, 3] and not m3[1, 4]  # boundary mode: D row sees later kept prefix rows
    m4 = build_mask([[0, 1, 2, 3, 4]], [({1}, 4)], visibility="causal", return_bool=True)
    assert not m4[1, 3] and m4[1, 1]


# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["eager", "sdpa"])
def test_single_forward_equals_model(which, model, model_sdpa):
    m = model if which == "eager" else model_sdpa
    inputs = _conv([[1, 8, 8]], [5, 7])
    L = inputs["input_ids"].shape[1]
    with torch.no_grad():
        want = m(**inputs).logits[0].float()
    ref = reference_logits(m, inputs, [list(range(L))])
    assert ref.logits.shape == want.shape
    torch.testing.assert_close(ref.logits, want, atol=ATOL, rtol=1e-5)
    # permuted single forward: same per logical index
    perm = torch.randperm(L, generator=torch.Generator().manual_seed(1)).tolist()
    ref2 = reference_logits(m, inputs, [perm])
    torch.testing.assert_close(ref2.at_many(range(L)), want, atol=ATOL, rtol=1e-5)


def test_incremental_generate_equals_schedule(model):
    inputs = _conv([[1, 8, 8], [1, 4, 8]], [4, 6, 5])
    P = inputs["input_ids"].shape[1]
    n = 6
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, suppress_tokens=[IMG, VID, VS, VE])
    gen_logits = torch.stack([lg[0] for lg in out.logits]).float()
    new = out.sequences[0, P:]
    assert new.shape[0] == n
    conv = _extend(inputs, new)
    sched = build_schedule(P, [], n)
    assert sched.forwards == [list(range(P))] + [[P + j - 1] for j in range(1, n)]
    ref = reference_logits(model, conv, sched.forwards)
    torch.testing.assert_close(ref.at_many(sched.logit_rows), gen_logits, atol=ATOL, rtol=1e-5)
    # the last generated token y_n was never fed
    assert P + n - 1 not in ref.row_of


def test_hard_equals_plain_forward_over_I0(model):
    inputs = _conv([[1, 8, 8]], [5, 7])
    P = inputs["input_ids"].shape[1]
    spans = find_spans(inputs["input_ids"], IMG, VID)
    assert len(spans) == 1
    s0, e0 = spans[0]
    D = list(range(s0 + 1, e0, 2))  # every other placeholder but the first deferred
    gen_tokens = [7, 11, 13, 17]
    conv = _extend(inputs, gen_tokens)
    n = len(gen_tokens) + 1
    sched = build_schedule(P, D, n, chunk_size=3, guard_tokens=0, policy="hard")
    ref = reference_logits(model, conv, sched.forwards, [(D, plan_boundary(spans))])
    # plain causal forward over kept rows with their logical positions
    c = encode_conversation(model, conv)
    kept = [i for i in range(conv["input_ids"].shape[1]) if i not in set(D)]
    idx = torch.tensor(kept)
    vis = c.visual[idx]
    with torch.no_grad():
        h = model.model.language_model(
            inputs_embeds=c.embeds[idx][None],
            position_ids=c.positions[:, idx][:, None],
            visual_pos_masks=vis[None],
            deepstack_visual_embeds=[c.deepstack[k, idx[vis]] for k in range(c.deepstack.shape[0])],
            use_cache=False,
        ).last_hidden_state[0]
        want = model.lm_head(h).float()
    rows_in_kept = [kept.index(i) for i in ref.rows]
    torch.testing.assert_close(ref.logits, want[rows_in_kept], atol=ATOL, rtol=1e-5)
    assert not any(d in ref.row_of for d in D)
    # and hard differs from full at the step logits
    full = reference_logits(model, conv, build_schedule(P, [], n).forwards)
    assert not torch.allclose(full.at(P - 1), ref.at(P - 1), atol=1e-4)


# ------------------------------------------------------------------------------------------
def _two_image_setup(seed=0):
    inputs = _conv([[1, 8, 8], [1, 4, 8]], [4, 6, 5], seed=seed)
    P = inputs["input_ids"].shape[1]
    spans = find_spans(inputs["input_ids"], IMG, VID)
    assert len(spans) == 2
    D = [i for s, e in spans for i in range(s, e) if (i - s) % 3 != 0]  # 2/3 of each span deferred
    b = plan_boundary(spans)
    return inputs, P, D, b


def test_row_permutation_and_deepstack_of_deferred_rows(model):
    inputs, P, D, b = _two_image_setup()
    gen_tokens = [3, 5, 7, 9, 11, 13]
    conv = _extend(inputs, gen_tokens)
    n = len(gen_tokens) + 1
    sched = build_schedule(P, D, n, chunk_size=4, guard_tokens=2, completion="blocking", completion_chunk_size=5)
    assert sched.forwards[3][:4] == D[:4]  # step 3 is the first fused step
    plans = [(D, b)]
    c = encode_conversation(model, conv)
    base = run_reference(model, c, sched.forwards, plans)
    g = torch.Generator().manual_seed(3)
    permuted = [[fwd[k] for k in torch.randperm(len(fwd), generator=g).tolist()] for fwd in sched.forwards]
    assert permuted != sched.forwards
    perm = run_reference(model, c, permuted, plans)
    order = sorted(base.rows)
    torch.testing.assert_close(perm.at_many(order), base.at_many(order), atol=ATOL, rtol=1e-5)
    for variant in ("boundary", "causal"):
        a = run_reference(model, c, sched.forwards, plans, visibility=variant)
        p2 = run_reference(model, c, permuted, plans, visibility=variant)
        torch.testing.assert_close(p2.at_many(order), a.at_many(order), atol=ATOL, rtol=1e-5)

    # deepstack is injected for deferred rows: perturb the deepstack features of one deferred row
    d = D[0]
    c2 = c.clone()
    c2.deepstack[:, d] += 1.0
    alt = run_reference(model, c2, sched.forwards, plans)
    f_d = next(f for f, fwd in enumerate(sched.forwards) if d in fwd)
    before = [i for f, fwd in enumerate(sched.forwards) if f < f_d for i in fwd]
    after = [i for f, fwd in enumerate(sched.forwards) if f >= f_d for i in fwd if i > P - 1]
    assert before and after
    torch.testing.assert_close(alt.at_many(before), base.at_many(before), atol=0, rtol=0)
    assert (alt.at_many(after) - base.at_many(after)).abs().max() > 1e-3
    assert (alt.at(d) - base.at(d)).abs().max() > 1e-3
    # a deferred row in the first image is also restored with its deepstack in the second image's rows
    d2 = D[-1]
    c3 = c.clone()
    c3.deepstack[:, d2] += 1.0
    alt3 = run_reference(model, c3, sched.forwards, plans)
    assert (alt3.at(d2) - base.at(d2)).abs().max() > 1e-3


def test_chunk_size_and_completion_invariance_of_next_turn(model):
    inputs, P, D, b = _two_image_setup(seed=1)
    gen_tokens = [3, 5, 7, 9]
    turn2 = [21, 22, 23, 24, 25]
    conv = _extend(inputs, gen_tokens + turn2)
    n1 = len(gen_tokens)
    # turn 2 fed tokens: y_n1 (never fed in turn 1) + turn-2 prompt
    new_start = P + n1 - 1
    P2 = conv["input_ids"].shape[1]
    c = encode_conversation(model, conv)
    plans = [(D, b)]
    for visibility in ("boundary", "causal"):
        # (a) the D entries of the cache do not depend on chunk sizes / completion (rule 5)
        d_rows = []
        for cs, guard, completion, ccs in [(2, 0, "blocking", 4), (5, 1, "blocking", 1), (3, 0, "next_turn", 4),
                                           (1000, 100, "next_turn", 4), (7, 0, "background", 2)]:
            t1 = build_schedule(P, D, n1, chunk_size=cs, guard_tokens=guard, completion=completion,
                                completion_chunk_size=ccs)
            t2 = build_schedule(P2, [], 1, new_start=new_start, pending_before=t1.pending)
            ref = run_reference(model, c, t1.forwards + t2.forwards, plans, visibility=visibility)
            assert sorted(ref.rows) == list(range(P2))  # full restoration
            d_rows.append(torch.stack([ref.hidden[ref.row_of[d]] for d in D]))
        for r in d_rows[1:]:
            torch.testing.assert_close(r, d_rows[0], atol=ATOL, rtol=1e-5)
        # (b) for a fixed in-generation schedule, where the remainder goes does not change turn 2
        for cs, guard in [(2, 0), (3, 1), (4, 100)]:
            outs = []
            for completion, ccs in [("blocking", 1), ("blocking", 5), ("background", 3), ("next_turn", None)]:
                t1 = build_schedule(P, D, n1, chunk_size=cs, guard_tokens=guard, completion=completion,
                                    completion_chunk_size=ccs)
                assert (completion == "next_turn") == bool(t1.pending)
                t2 = build_schedule(P2, [], 1, new_start=new_start, pending_before=t1.pending)
                ref = run_reference(model, c, t1.forwards + t2.forwards, plans, visibility=visibility)
                outs.append(ref.at_many(range(new_start, P2)))
            for r in outs[1:]:
                torch.testing.assert_close(r, outs[0], atol=ATOL, rtol=1e-5)
    # visibility and restoration both matter for turn 2
    t1 = build_schedule(P, D, n1, chunk_size=3, guard_tokens=0)
    t2 = build_schedule(P2, [], 1, new_start=new_start)
    cau = run_reference(model, c, t1.forwards + t2.forwards, plans, visibility="causal")
    bnd = run_reference(model, c, t1.forwards + t2.forwards, plans, visibility="boundary")
    assert not torch.allclose(bnd.at(P2 - 1), cau.at(P2 - 1), atol=1e-4)
    h1 = build_schedule(P, D, n1, policy="hard")
    hard = run_reference(model, c, h1.forwards + t2.forwards, plans)
    assert not torch.allclose(bnd.at(P2 - 1), hard.at(P2 - 1), atol=1e-4)
    # the kept prefix rows (before the first D row) are identical under every schedule
    first = [i for i in range(min(D))]
    torch.testing.assert_close(bnd.at_many(first), hard.at_many(first), atol=ATOL, rtol=1e-5)


def test_retention_one_equals_plain_generate_schedule(model):
    """No deferred rows: raincheck schedule == full schedule, whatever chunk/guard/completion."""
    inputs = _conv([[1, 8, 8]], [5, 7])
    P = inputs["input_ids"].shape[1]
    conv = _extend(inputs, [1, 2, 3])
    a = build_schedule(P, [], 4, chunk_size=2, guard_tokens=0, completion="next_turn")
    bsched = build_schedule(P, [], 4, policy="full")
    assert a.forwards == bsched.forwards and a.pending == []
    spans = find_spans(inputs["input_ids"], IMG, VID)
    ra = reference_logits(model, conv, a.forwards, [([], plan_boundary(spans))])
    rb = reference_logits(model, conv, bsched.forwards)
    torch.testing.assert_close(ra.logits, rb.logits, atol=0, rtol=0)
