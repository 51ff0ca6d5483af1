"""Independent eager reference of Raincheck's semantics for Qwen3-VL (full-attention layers only).

This module deliberately does NOT import ``hf_raincheck``: it re-derives the contract of
``docs/design.md`` ("Terms" / "Semantics") from scratch so tests can check the package against it.

Idea
----
With full-attention layers only, any schedule of forward passes over a KV cache is equivalent to
ONE forward of the language model over all processed rows with an explicit 4D mask: the K/V of a
row depend only on the rows it can see, and those are fixed by the mask. Row ``r`` (logical index
``i``) may attend to row ``s`` (logical index ``j``) iff

* ``s`` was processed in the same forward as ``r`` or an earlier one, and
* the visibility rule allows it:

  - ``i`` is a deferred row of plan ``P`` (deferred set ``D_P``, boundary ``b_P``):
      ``"boundary"`` (default): ``j < b_P and not (j in D_P and j > i)``
      ``"causal"``:             ``j <= i``
  - any other row: ``j <= i``.

Rows that are never processed (hard pruning) are simply absent. Rows may be laid out in any order
(RoPE uses the explicit logical M-RoPE positions, DeepStack is injected by row through
``visual_pos_masks``), so ``forwards`` are concatenated in processing order.

"Logical index" = index in the FULL conversation's ``input_ids`` (prompt + generated tokens +
later turns). Logical positions are ``model.model.get_rope_index`` on that full conversation.
Vision runs once on all pixels; placeholder rows get the vision tower's ``pooler_output``
(images fill image placeholders in order, videos fill video placeholders in order) and their
DeepStack features.

API
---
``find_spans(input_ids, image_token_id, video_token_id) -> list[(start, end)]``
    maximal runs of placeholder tokens (``end`` exclusive).
``plan_boundary(spans) -> int``
    logical index right after the last placeholder of the plan's last span.
``build_schedule(prompt_len, deferred, n_generated, chunk_size=31, guard_tokens=16,
                 completion="blocking", completion_chunk_size=None, pending_before=(),
                 new_start=0, policy="raincheck") -> TurnSchedule``
    the forwards of ONE ``generate`` call (rules 4/5). ``new_start..prompt_len`` are the turn's
    new (uncached) tokens, ``deferred`` the plan's D (subset of them), ``pending_before`` the D
    rows of an earlier plan folded into this prefill (``completion="next_turn"``).
    ``TurnSchedule.forwards`` (list of lists of logical indices), ``.pending`` (D rows left for
    the next turn), ``.logit_rows`` (row ``k`` gives the logits of ``y_{k+1}``).
``encode_conversation(model, conv_inputs) -> Conversation``
    per-logical-index embeddings, DeepStack features, visual flags and M-RoPE positions
    (tensors can be edited by a test before running).
``build_mask(forwards, plans, visibility="boundary", dtype=torch.float32) -> [1, 1, N, N]``
    the additive mask (0 / finfo.min) over the concatenated rows.
``run_reference(model, conv, forwards, plans, visibility="boundary") -> ReferenceLogits``
``reference_logits(model, conv_inputs, forwards, plans, visibility="boundary") -> ReferenceLogits``
    (``encode_conversation`` + ``run_reference``).
    ``ReferenceLogits.logits`` is ``[N_rows, vocab]`` (fp32) in row order, ``.rows`` the logical
    index of each row, ``.row_of`` the inverse map, ``.at(i)`` the next-token logits after logical
    index ``i`` (``[vocab]``), ``.at_many(idxs)`` stacked ``[len, vocab]``.

``plans`` is a list of ``(deferred, boundary)`` pairs (``deferred``: iterable / tensor of logical
indices). ``conv_inputs`` are processor outputs for the full conversation (batch 1):
``input_ids`` (including generated tokens), optional ``attention_mask`` (all ones),
``mm_token_type_ids`` (derived from ``input_ids`` if absent), ``pixel_values`` /
``image_grid_thw``, optional ``pixel_values_videos`` / ``video_grid_thw``.
The model must use ``eager`` or ``sdpa`` attention; run it in fp32 for tight comparisons.

Example
-------
>>> spans = find_spans(ids1, cfg.image_token_id, cfg.video_token_id)      # turn 1 prompt
>>> D = deferred_rows_of_turn1; b = plan_boundary(spans)
>>> t1 = build_schedule(len(ids1), D, n_generated=n1, chunk_size=31, guard_tokens=16,
...                     completion="next_turn")
>>> # turn 2: conversation = turn-1 prompt + y_1..y_n1 + new turn text; cache holds len(ids1)+n1-1
>>> t2 = build_schedule(len(ids2), [], n_generated=1, new_start=len(ids1) + n1 - 1,
...                     pending_before=t1.pending)
>>> ref = reference_logits(model, conv2_inputs, t1.forwards + t2.forwards, [(D, b)])
>>> step_logits_turn1 = ref.at_many(t1.logit_rows)        # [n1, vocab]: logits of y_1..y_n1
>>> next_turn_first = ref.at(len(ids2) - 1)               # logits of turn 2's first token
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

__all__ = [
    "Conversation",
    "ReferenceLogits",
    "TurnSchedule",
    "build_mask",
    "build_schedule",
    "encode_conversation",
    "find_spans",
    "plan_boundary",
    "reference_logits",
    "run_reference",
]


# --------------------------------------------------------------------------------------------
# spans / plans
# --------------------------------------------------------------------------------------------
def _ids_list(input_ids) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim == 2:
            assert input_ids.shape[0] == 1, "batch size 1 only"
            input_ids = input_ids[0]
        return [int(t) for t in input_ids.tolist()]
    return [int(t) for t in input_ids]


def find_spans(input_ids, image_token_id: int, video_token_id: int) -> list[tuple[int, int]]:
    """Maximal runs of image/video placeholder tokens, as ``(start, end)`` with ``end`` exclusive.

    A run of image placeholders directly followed by video placeholders is two spans."""
    ids = _ids_list(input_ids)
    spans: list[tuple[int, int]] = []
    i = 0
    while i < len(ids):
        if ids[i] in (image_token_id, video_token_id):
            tok = ids[i]
            j = i
            while j < len(ids) and ids[j] == tok:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def plan_boundary(spans: Sequence[tuple[int, int]]) -> int:
    """Boundary of a plan: the logical index right after the last placeholder of its last span."""
    if not spans:
        raise ValueError("a plan needs at least one span")
    return max(end for _, end in spans)


def _as_index_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.flatten().tolist()]
    return [int(v) for v in x]


# --------------------------------------------------------------------------------------------
# schedule (rules 4 / 5)
# --------------------------------------------------------------------------------------------
@dataclass
class TurnSchedule:
    """Forwards of one ``generate`` call.

    forwards:   processed logical indices per forward, in processing order.
    pending:    deferred rows still unprocessed when the call returns (``completion="next_turn"``);
                pass them as ``pending_before`` to the next turn's ``build_schedule``.
    logit_rows: ``logit_rows[k]`` is the logical index whose next-token logits produce
                ``y_{k+1}`` (last prompt token, then the decode rows of ``y_1..y_{n-1}``).
    """

    forwards: list[list[int]]
    pending: list[int] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)


def build_schedule(
    prompt_len: int,
    deferred: Iterable[int] | torch.Tensor | None,
    n_generated: int,
    chunk_size: int = 31,
    guard_tokens: int = 16,
    completion: str = "blocking",
    completion_chunk_size: int | None = None,
    pending_before: Iterable[int] | torch.Tensor = (),
    new_start: int = 0,
    policy: str = "raincheck",
) -> TurnSchedule:
    """Schedule of one ``generate`` call (DESIGN rules 4 and 5).

    prompt_len:      logical length of the conversation fed to this call (its last prompt token
                     is ``prompt_len - 1``).
    deferred:        this call's plan D (logical indices in ``[new_start, prompt_len)``).
    n_generated:     number of generated tokens ``y_1..y_n`` (``n - 1`` decode steps: ``y_n`` is
                     never fed). ``y_j`` has logical index ``prompt_len + j - 1``.
    chunk_size, guard_tokens: decode step ``j`` carries ``min(chunk_size, remaining)`` D rows
                     (ascending, before the decode row) iff ``j > guard_tokens`` and D remains.
    completion:      ``"blocking"`` / ``"background"`` (same final cache: the rest in forwards of
                     ``completion_chunk_size`` rows, default ``chunk_size``) or ``"next_turn"``
                     (rest returned in ``pending``).
    pending_before:  D rows of an earlier plan still pending; they open this call's prefill.
    new_start:       first logical index not yet in the cache (turn 1: 0).
    policy:          ``"raincheck"``; ``"hard"`` (D never processed); ``"full"`` (D ignored:
                     everything in the prefill, ``pending_before`` too).
    """
    if n_generated < 1:
        raise ValueError("n_generated must be >= 1")
    if completion not in ("blocking", "background", "next_turn"):
        raise ValueError(f"unknown completion {completion!r}")
    if policy not in ("raincheck", "hard", "full"):
        raise ValueError(f"unknown policy {policy!r}")
    D = sorted(set(_as_index_list(deferred)))
    if any(not (new_start <= d < prompt_len) for d in D):
        raise ValueError("deferred indices must lie in [new_start, prompt_len)")
    pending = sorted(set(_as_index_list(pending_before)))
    if policy == "full":
        D = []
    Dset = set(D)
    new_tokens = [i for i in range(new_start, prompt_len) if i not in Dset]
    if policy == "full":
        prefill = sorted(set(pending) | set(new_tokens))
    else:
        prefill = pending + new_tokens
    forwards: list[list[int]] = [prefill]
    remaining = D if policy == "raincheck" else []
    if policy == "raincheck" and chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    for j in range(1, n_generated):
        fwd: list[int] = []
        if j > guard_tokens and remaining:
            fwd.extend(remaining[:chunk_size])
            remaining = remaining[chunk_size:]
        fwd.append(prompt_len + j - 1)
        forwards.append(fwd)
    left: list[int] = []
    if remaining:
        if completion == "next_turn":
            left = remaining
        else:
            cs = completion_chunk_size or chunk_size
            for k in range(0, len(remaining), cs):
                forwards.append(remaining[k : k + cs])
    logit_rows = [prompt_len - 1 + k for k in range(n_generated)]
    return TurnSchedule(forwards=forwards, pending=left, logit_rows=logit_rows)


# --------------------------------------------------------------------------------------------
# logical inputs
# --------------------------------------------------------------------------------------------
@dataclass
class Conversation:
    """Per-logical-index inputs of the full conversation (length L).

    embeds:    [L, hidden]   text embeddings, placeholder rows replaced by vision embeddings.
    deepstack: [n_ds, L, hidden] DeepStack features (zeros on non-visual rows); n_ds may be 0.
    visual:    [L] bool, placeholder (image or video) rows.
    positions: [3, L] long, logical M-RoPE positions.
    input_ids: [L] long.
    """

    embeds: torch.Tensor
    deepstack: torch.Tensor
    visual: torch.Tensor
    positions: torch.Tensor
    input_ids: torch.Tensor

    def clone(self) -> "Conversation":
        return Conversation(*(t.clone() for t in (self.embeds, self.deepstack, self.visual,
                                                  self.positions, self.input_ids)))


def _get(d, key):
    # dict, transformers BatchFeature / BatchEncoding, or any object with attributes
    if hasattr(d, "get"):
        return d.get(key)
    return getattr(d, key, None)


@torch.no_grad()
def encode_conversation(model, conv_inputs) -> Conversation:
    """Embeddings, DeepStack features and logical positions of the full conversation."""
    cfg = model.config
    input_ids = _get(conv_inputs, "input_ids")
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    assert input_ids.shape[0] == 1, "batch size 1 only"
    device = model.lm_head.weight.device
    input_ids = input_ids.to(device)
    attention_mask = _get(conv_inputs, "attention_mask")
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        if attention_mask.ndim == 1:
            attention_mask = attention_mask[None]
        if not bool(attention_mask.all()):
            raise ValueError("padding is not supported by the reference")
    ids = input_ids[0]
    L = ids.shape[0]
    image_rows = ids == cfg.image_token_id
    video_rows = ids == cfg.video_token_id
    mm_type = _get(conv_inputs, "mm_token_type_ids")
    if mm_type is None:
        mm_type = (image_rows.long() + 2 * video_rows.long())[None]
    mm_type = mm_type.to(device)
    if mm_type.ndim == 1:
        mm_type = mm_type[None]
    image_grid_thw = _get(conv_inputs, "image_grid_thw")
    video_grid_thw = _get(conv_inputs, "video_grid_thw")
    pixel_values = _get(conv_inputs, "pixel_values")
    pixel_values_videos = _get(conv_inputs, "pixel_values_videos")

    embed = model.get_input_embeddings()
    embeds = embed(ids).clone()
    dtype = embeds.dtype
    hidden = embeds.shape[-1]
    n_ds = len(getattr(cfg.vision_config, "deepstack_visual_indexes", []) or [])
    deepstack = torch.zeros(n_ds, L, hidden, dtype=dtype, device=device)

    def fill(rows_mask, pixels, grid, getter, what):
        n_rows = int(rows_mask.sum())
        if pixels is None:
            if n_rows:
                raise ValueError(f"{n_rows} {what} placeholders but no pixels")
            return
        out = getter(pixels.to(device), grid.to(device), return_dict=True)
        feats = torch.cat(list(out.pooler_output), dim=0).to(dtype)
        if feats.shape[0] != n_rows:
            raise ValueError(f"{what}: {feats.shape[0]} features for {n_rows} placeholders")
        idx = rows_mask.nonzero().flatten()
        embeds[idx] = feats
        ds = getattr(out, "deepstack_features", None) or []  # Qwen3.5: no DeepStack
        if len(ds) != n_ds:
            raise ValueError(f"{what}: {len(ds)} deepstack layers, config says {n_ds}")
        for k, per_item in enumerate(ds):
            deepstack[k, idx] = torch.cat(list(per_item), dim=0).to(dtype)

    fill(image_rows, pixel_values, image_grid_thw, model.model.get_image_features, "image")
    fill(video_rows, pixel_values_videos, video_grid_thw, model.model.get_video_features, "video")

    has_mm = bool(mm_type.any())
    if has_mm:
        positions, _ = model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_type,
            image_grid_thw=None if image_grid_thw is None else image_grid_thw.to(device),
            video_grid_thw=None if video_grid_thw is None else video_grid_thw.to(device),
            attention_mask=attention_mask,
        )
        positions = positions[:, 0]
    else:
        positions = torch.arange(L, device=device)[None].expand(3, L).clone()
    return Conversation(
        embeds=embeds,
        deepstack=deepstack,
        visual=image_rows | video_rows,
        positions=positions.long(),
        input_ids=ids.clone(),
    )


# --------------------------------------------------------------------------------------------
# mask + forward
# --------------------------------------------------------------------------------------------
def _normalize_plans(plans) -> list[tuple[set[int], int]]:
    out = []
    for p in plans or []:
        d, b = p
        out.append((set(_as_index_list(d)), int(b)))
    return out


def _check_forwards(forwards: Sequence[Sequence[int]]) -> list[int]:
    rows = [int(i) for fwd in forwards for i in fwd]
    if len(set(rows)) != len(rows):
        raise ValueError("a logical index is processed more than once")
    return rows


def build_mask(
    forwards: Sequence[Sequence[int]],
    plans=(),
    visibility: str = "boundary",
    dtype: torch.dtype = torch.float32,
    device=None,
    return_bool: bool = False,
) -> torch.Tensor:
    """Additive 4D mask ``[1, 1, N, N]`` (0 where allowed, ``finfo(dtype).min`` elsewhere) over
    the rows of ``forwards`` concatenated; ``return_bool`` gives the boolean ``[N, N]`` instead."""
    if visibility not in ("boundary", "causal"):
        raise ValueError(f"unknown visibility {visibility!r}")
    rows = _check_forwards(forwards)
    fwd_of = [f for f, fwd in enumerate(forwards) for _ in fwd]
    plans_n = _normalize_plans(plans)
    seen: set[int] = set()
    for D, b in plans_n:
        for d in D:
            if d in seen:
                raise ValueError(f"index {d} deferred by two plans")
            if d >= b:
                raise ValueError(f"deferred index {d} not before its boundary {b}")
            seen.add(d)
    N = len(rows)
    log = torch.tensor(rows, dtype=torch.long)
    fw = torch.tensor(fwd_of, dtype=torch.long)
    i = log[:, None]
    j = log[None, :]
    allowed = fw[None, :] <= fw[:, None]
    causal = j <= i
    vis = causal.clone()
    if visibility == "boundary":
        for D, b in plans_n:
            in_D = torch.tensor([lj in D for lj in rows], dtype=torch.bool)  # [N] columns in D_P
            if not bool(in_D.any()):
                continue
            q = in_D.nonzero().flatten()  # rows that are deferred rows of this plan
            vis[q] = (log < b)[None, :] & ~(in_D[None, :] & (log[None, :] > log[q][:, None]))
    allowed &= vis
    if return_bool:
        return allowed
    mask = torch.zeros(N, N, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    mask = mask[None, None]
    return mask if device is None else mask.to(device)


@dataclass
class ReferenceLogits:
    logits: torch.Tensor  # [N_rows, vocab] fp32, row order
    rows: list[int]  # logical index of each row
    row_of: dict[int, int]  # logical index -> row
    hidden: torch.Tensor | None = None  # [N_rows, hidden], final normed hidden states

    def at(self, logical_index: int) -> torch.Tensor:
        """Next-token logits produced at the row of ``logical_index`` ([vocab])."""
        if logical_index not in self.row_of:
            raise KeyError(f"logical index {logical_index} was never processed")
        return self.logits[self.row_of[logical_index]]

    def at_many(self, logical_indices: Iterable[int]) -> torch.Tensor:
        return torch.stack([self.at(int(i)) for i in logical_indices])


@torch.no_grad()
def run_reference(
    model, conv: Conversation, forwards: Sequence[Sequence[int]], plans=(), visibility: str = "boundary"
) -> ReferenceLogits:
    """One language-model forward over all processed rows with the explicit Raincheck mask."""
    impl = getattr(model.config.text_config, "_attn_implementation", None) or getattr(
        model.config, "_attn_implementation", None
    )
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"reference needs eager or sdpa attention, model has {impl!r}")
    rows = _check_forwards(forwards)
    L = conv.input_ids.shape[0]
    if any(not (0 <= r < L) for r in rows):
        raise ValueError("a processed index is outside the conversation")
    device = conv.embeds.device
    idx = torch.tensor(rows, dtype=torch.long, device=device)
    embeds = conv.embeds[idx][None]
    position_ids = conv.positions[:, idx][:, None, :]  # [3, 1, N]
    mask = build_mask(forwards, plans, visibility, dtype=embeds.dtype, device=device)
    visual = conv.visual[idx]
    kwargs = {}
    if conv.deepstack.shape[0] > 0 and bool(visual.any()):
        kwargs["visual_pos_masks"] = visual[None]
        kwargs["deepstack_visual_embeds"] = [conv.deepstack[k, idx[visual]] for k in range(conv.deepstack.shape[0])]
    out = model.model.language_model(
        inputs_embeds=embeds,
        position_ids=position_ids,
        attention_mask=mask,
        use_cache=False,
        **kwargs,
    )
    hidden = out.last_hidden_state[0]
    logits = model.lm_head(hidden).float()
    return ReferenceLogits(
        logits=logits, rows=rows, row_of={r: k for k, r in enumerate(rows)}, hidden=hidden
    )


def reference_logits(
    model, conv_inputs, forwards: Sequence[Sequence[int]], plans=(), visibility: str = "boundary"
) -> ReferenceLogits:
    """``encode_conversation`` + ``run_reference``."""
    return run_reference(model, encode_conversation(model, conv_inputs), forwards, plans, visibility)
