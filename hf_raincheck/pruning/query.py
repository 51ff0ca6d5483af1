"""The question of the current user turn, found in the token ids (no tokenizer at hand inside `generate`).

`question_positions` returns the positions in ``input_ids`` of the text a query-aware selector (``mmtok``) uses:

1. the current user turn is the turn that holds the plan's new spans: it starts right after the last
   end-of-turn token (``eos`` ids, e.g. Qwen's ``<|im_end|>``) before the first new span (never before the first
   token that is new in this call), and ends before the first end-of-turn token after the last new span (the end
   of the prompt when there is none, e.g. a raw prompt without chat template);
2. a ChatML role header at the start of that turn (``\\n<|im_start|>user\\n``) is dropped. Its tokens are learnt
   from the generation prompt that follows the turn (``\\n<|im_start|>assistant\\n``): ``separator, opener, role,
   terminator``. Leading separators are skipped, then an opener, then everything up to and including the first
   terminator (at most a few tokens: the role name). Without a generation prompt nothing is dropped;
3. special tokens (placeholders, ``<|vision_start|>``/``<|vision_end|>``, eos / pad / bos) are dropped.

So the system prompt, earlier turns, the template and the media are excluded, and every text token of the user's
current message is kept: text before, between and after its images (e.g. "Picture 1:" labels included).
"""

from __future__ import annotations

from typing import Iterable, Sequence

#: longest role name (in tokens) skipped in a ChatML header
MAX_ROLE_TOKENS = 4


def question_positions(
    ids: Sequence[int],
    first_new: int,
    spans: Sequence[tuple[int, int]],
    special_ids: Iterable[int],
    end_of_turn_ids: Iterable[int],
) -> list[int]:
    """Positions in `ids` of the current user turn's text (see the module docstring).

    Args:
        ids: the whole conversation's token ids.
        first_new: index of the first token that is new in this call (tokens before it are cached).
        spans: ``(start, stop)`` of the new placeholder spans (the plan's), in order.
        special_ids: ids never part of a question (placeholders, vision start/end, eos, pad, bos, ...).
        end_of_turn_ids: ids that end a chat turn (the model's eos ids, e.g. ``<|im_end|>``).
    """
    special = set(special_ids)
    ends = set(end_of_turn_ids)
    length = len(ids)
    if spans:
        first_span, last_span = spans[0][0], spans[-1][1]
    else:
        first_span = last_span = first_new
    stop = next((i for i in range(last_span, length) if ids[i] in ends), length)
    start = first_new
    for i in range(first_span - 1, first_new - 1, -1):
        if ids[i] in ends:
            start = i + 1
            break

    # ChatML role header, learnt from the generation prompt after the turn: [sep, opener, role, terminator]
    prompt = list(ids[stop + 1 :]) if stop < length else []
    if len(prompt) >= 4:
        separator, opener, terminator = prompt[0], prompt[1], prompt[3]
        i = start
        while i < first_span and ids[i] == separator:
            i += 1
        if i < first_span and ids[i] == opener:
            i += 1
            for j in range(i, min(i + MAX_ROLE_TOKENS + 1, first_span)):
                if ids[j] == terminator:
                    i = j + 1
                    break
            start = i
    inside = [False] * length
    for a, b in spans:
        for i in range(a, b):
            inside[i] = True
    return [i for i in range(start, stop) if not inside[i] and ids[i] not in special]
