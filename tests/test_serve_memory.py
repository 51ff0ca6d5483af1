"""Peak memory of a batched Raincheck generate over rows with large images (the server's batches).

A batch of B rows must cost about B times one row's batch-1 call (plus the shared KV buffers), not a term in
query rows x keys x B. The shared prefill runs SDPA under a dense boolean mask with grouped-query heads; on CUDA
no fused kernel takes that call unless cuDNN does, and SDPA's math path materialises the fp32 scores
``[B, Hq, q, k]`` several times, where each row's batch-1 prefill runs unmasked (flash). The test emulates that
choice on the CPU (`_cuda_like_sdpa`: a masked grouped-query call runs the math path) and sums the bytes of the
tensors alive during the call (`LiveBytes`).
"""

from __future__ import annotations

import threading
import types
import weakref

import torch
import torch.nn.functional as F
from torch.nn.attention import bias as sdpa_bias
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

from hf_raincheck import RaincheckConfig, enable_raincheck
from hf_raincheck.attention import sdpa
from hf_raincheck.conversation import output_cache

IMAGE, VIDEO, VSTART, VEND = 1001, 1002, 1003, 1004
IMAGE_TOKENS = 1024  # merged tokens per image (64 x 64 patches)
ROWS = 8


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the tensor storages created inside (a storage counts until its last tensor dies)."""

    def __init__(self):
        super().__init__()
        self.counts, self.sizes, self.live, self.peak = {}, {}, 0, 0
        self.lock = threading.Lock()

    def _release(self, key):
        with self.lock:
            self.counts[key] -= 1
            if self.counts[key] == 0:
                del self.counts[key]
                self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            with self.lock:
                if key not in self.counts:
                    if key in inputs or storage.nbytes() == 0:
                        continue  # a view of a tensor made outside, or nothing
                    self.counts[key], self.sizes[key] = 0, storage.nbytes()
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                self.counts[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def _cuda_like_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA as CUDA picks it without cuDNN: a dense-masked call with grouped-query heads runs the math path (K and V
    repeated per query head, the scores materialised); everything else runs SDPA itself."""
    if type(attn_mask) is torch.Tensor and enable_gqa and query.shape[1] != key.shape[1]:
        group = query.shape[1] // key.shape[1]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1), attn_mask=attn_mask,
            scale=scale)[0]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


def _model():
    """Many query heads of a small dimension: the attention scores weigh as they do at the real shape."""
    config = Qwen3VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
                         head_dim=8, intermediate_size=64, vocab_size=1100, max_position_embeddings=32768,
                         rope_parameters=dict(rope_type="default", rope_theta=1e4, mrope_section=[2, 1, 1],
                                              mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=16, num_heads=1, intermediate_size=32, out_hidden_size=64,
                           deepstack_visual_indexes=[0], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           num_position_embeddings=64),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART, vision_end_token_id=VEND,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    return enable_raincheck(model)


def _row(seed: int) -> dict:
    side = int(IMAGE_TOKENS ** 0.5)
    gen = torch.Generator().manual_seed(seed)
    ids = (torch.randint(0, 1000, (10,), generator=gen).tolist() + [VSTART] + [IMAGE] * IMAGE_TOKENS + [VEND]
           + torch.randint(0, 1000, (12,), generator=gen).tolist())
    ids = torch.tensor([ids])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=(ids == IMAGE).int(),
                pixel_values=torch.randn((2 * side) ** 2, 3 * 2 * 16 * 16, generator=gen),
                image_grid_thw=torch.tensor([[1, 2 * side, 2 * side]]))


def _peak_bytes(model, inputs: dict) -> int:
    mode = LiveBytes()
    with torch.no_grad(), mode:
        model.generate(**inputs, raincheck_config=RaincheckConfig(retention=0.3, pruning="mmtok",
                                                                  completion="next_turn"),
                       max_new_tokens=2, do_sample=False)
    return mode.peak


def test_batch_of_large_image_rows_costs_about_rows_times_one_row(monkeypatch):
    monkeypatch.setattr(sdpa, "F", types.SimpleNamespace(scaled_dot_product_attention=_cuda_like_sdpa))
    # (causal_lower_right builds a tensor subclass, which a dispatch mode's plain tensor cannot become)
    make_bias = sdpa_bias.causal_lower_right

    def causal_lower_right(*args):
        with _disable_current_modes():
            return make_bias(*args)

    monkeypatch.setattr(sdpa_bias, "causal_lower_right", causal_lower_right)
    # the model is ~256x smaller than Qwen3-VL-8B in heads x rows x keys per row: the cap scaled alike
    monkeypatch.setattr(sdpa, "MAX_SCORE_ELEMENTS", sdpa.MAX_SCORE_ELEMENTS >> 8)
    model = _model()
    one = _peak_bytes(model, _row(0))
    rows = [_row(seed) for seed in range(ROWS)]
    batch = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
    pixels = batch["pixel_values"].numel() * batch["pixel_values"].element_size()  # (the tower's input, one copy)
    many = _peak_bytes(model, batch)
    assert many - pixels <= 1.5 * ROWS * one, (
        f"a batch of {ROWS} rows peaked at {(many - pixels) / 2**20:.1f} MiB beyond its pixels, one row alone at "
        f"{one / 2**20:.1f} MiB")


def test_dense_masked_sdpa_blocks_give_the_unsplit_result(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(3, 8, 70, 16, generator=gen)
    key = torch.randn(3, 2, 50, 16, generator=gen)
    value = torch.randn(3, 2, 50, 16, generator=gen)
    visible = torch.rand(3, 1, 70, 50, generator=gen) > 0.3
    visible[..., 0] = True
    whole = sdpa.sdpa_attention(query, key, value, visible, 0.25)
    for limit in (8 * 70 * 50 * 2, 8 * 70 * 50, 8 * 50 * 5, 1):
        monkeypatch.setattr(sdpa, "MAX_SCORE_ELEMENTS", limit)
        torch.testing.assert_close(sdpa.sdpa_attention(query, key, value, visible, 0.25), whole)
    assert sdpa.score_blocks(3, 8, 70, 50, 8 * 70 * 50 * 2) == (2, 70)
    assert sdpa.score_blocks(3, 8, 70, 50, 8 * 50 * 5) == (1, 5)
    assert sdpa.score_blocks(3, 8, 70, 50, 1) == (1, 1)


def test_split_prefill_gives_the_unsplit_answers_and_caches(monkeypatch):
    """A batched generate whose masked forwards are split into many SDPA calls (a tiny cap) answers and caches
    what it does unsplit."""
    model = _model()
    rows = [_row(seed) for seed in range(3)]
    batch = {key: torch.cat([r[key] for r in rows]) for key in rows[0]}
    config = RaincheckConfig(retention=0.3, pruning="mmtok", completion="blocking", chunk_size=7)

    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("attn_mask") is not None)
        return F.scaled_dot_product_attention(*args, **kwargs)

    monkeypatch.setattr(sdpa, "F", types.SimpleNamespace(scaled_dot_product_attention=counted))

    def run():
        calls.clear()
        with torch.no_grad():
            out = model.generate(**batch, raincheck_config=config, max_new_tokens=6, do_sample=False,
                                 return_dict_in_generate=True)
        return out, sum(calls)

    whole, whole_calls = run()
    monkeypatch.setattr(sdpa, "MAX_SCORE_ELEMENTS", 16 * 64 * 1100)  # (16 heads) 64 query rows per call, ~1,100 keys
    split, split_calls = run()
    assert split_calls > whole_calls > 0  # the masked forwards did run in blocks
    assert torch.equal(split.sequences, whole.sequences)
    for a, b in zip(output_cache(split).split(), output_cache(whole).split()):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.layers, b.layers):
            torch.testing.assert_close(la.keys[:, :, :b.length], lb.keys[:, :, :b.length], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(la.values[:, :, :b.length], lb.values[:, :, :b.length], atol=2e-5, rtol=1e-4)
