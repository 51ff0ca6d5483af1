"""The tokenizer of the tiny Qwen-VL checkpoints: a real ``Qwen2Tokenizer`` trained on the spot (no download).

Shared by every family: Qwen2.5-VL and Qwen3-VL use the same special tokens in the same order.
"""

from __future__ import annotations

import json

__all__ = ["ADDED_TOKENS", "SPECIAL_TOKENS", "build_tokenizer"]

#: Qwen's special tokens, in the order (and so with the relative ids) of the real Qwen2.5-VL / Qwen3-VL tokenizers.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
#: Added tokens that are *not* special in Qwen's tokenizer (kept by ``skip_special_tokens=True``).
ADDED_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

_WORDS = """
the a an this that these those there here it its is are was were be been being am do does did done have has had
having will would can could should may might must shall not no yes and or but if then than so because as of in on
at to from by with without for about into onto over under above below between behind before after during up down
out off near far inside outside around through across along against i you he she we they me him her us them my
your his our their what which who whom whose where when why how all any both each every few many more most other
some such only own same too very just also again once one two three four five six seven eight nine ten eleven
twelve hundred thousand first second third last next left right top bottom middle center corner side front back
image images picture pictures photo photos video videos frame frames clip scene view object objects thing things
person people man woman men women boy girl child children baby dog dogs cat cats bird birds horse cow animal
animals car cars bus truck bike train plane boat road street tree trees flower grass water sky sun cloud clouds
rain snow house building room door window table chair bed wall floor box ball book cup bottle phone computer
screen sign light shadow food apple banana pizza cake color colors colour red green blue yellow orange purple pink
brown black white gray grey dark bright big small large little long short tall high low wide round square
circle triangle line lines shape shapes block blocks pattern text word words letter number numbers count time
day night year old new good bad best better same different first each whole half part full empty open closed hot
cold warm happy sad fast slow hard soft heavy light clear hidden visible moving still describe description explain
show shows shown look looks see seen watch find found tell say says said answer question questions ask think
know want like make made take took give go went come came get got put set use used need try call called play
played run ran walk walked sit sat stand stood hold held move moved change changed start end begin happen
happened appear appears contain contains include includes compare please thanks thank hello hi okay ok sure
maybe probably likely true false correct wrong because while until since where whether either neither
assistant user system model tool response
""".split()


def _training_corpus() -> list[str]:
    words = list(dict.fromkeys(_WORDS))
    lines: list[str] = []
    for w in words:
        # Each word alone, after a space, and capitalised (sentence starts), so common words become one token.
        lines += [w, " " + w, w.capitalize(), " " + w.capitalize()]
    lines += [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    lines += [str(i) for i in range(10)] + [" " + str(i) for i in range(10)]
    lines += list(".,;:!?'\"()[]{}<>-_/\\*&%$#@+=~`^|") + ["...", "?\n", ".\n", "\n\n", "  "]
    return lines


def build_tokenizer(vocab_size: int = 4096):
    """A real ``Qwen2Tokenizer`` (byte-level BPE, Qwen's pre-tokenizer) trained on a small English word list.

    Deterministic. The BPE vocabulary (256 byte symbols + merges) comes first, then :data:`SPECIAL_TOKENS` and
    :data:`ADDED_TOKENS` in that order, as in Qwen's tokenizer. ``eos_token`` is ``<|im_end|>`` and
    ``pad_token`` ``<|endoftext|>`` (Qwen3-VL's choices); there is no unk token: every string encodes.
    """
    return train_qwen2_tokenizer(_training_corpus(), vocab_size, model_max_length=32768)


def train_qwen2_tokenizer(corpus, vocab_size: int, model_max_length: int):
    """A ``Qwen2Tokenizer`` whose byte-level BPE (Qwen's pre-tokenizer) is trained on `corpus` (strings), with
    :data:`SPECIAL_TOKENS` and :data:`ADDED_TOKENS` right after the BPE vocabulary. Deterministic."""
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        special_tokens=[],
    )
    bpe.train_from_iterator(corpus, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m) if isinstance(m, (list, tuple)) else tuple(m.split(" ")) for m in model["merges"]]
    for tok in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        vocab[tok] = len(vocab)

    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS], special_tokens=True)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    ids = tokenizer.convert_tokens_to_ids([*SPECIAL_TOKENS, *ADDED_TOKENS])
    base = len(vocab) - len(SPECIAL_TOKENS) - len(ADDED_TOKENS)
    if ids != list(range(base, len(vocab))) or len(tokenizer) != len(vocab):
        raise RuntimeError(f"special token ids not where expected: {ids} (base {base}, len {len(tokenizer)})")
    return tokenizer
