"""Received attention from the hooked ViT blocks' own attention (`BlockAttentionHooks` with Qwen-VL's
``sdpa_input``, `FlashLSECapture`): the tower's output is bit for bit that of an un-hooked run, the scores match the
torch reference, the cases without SDPA's flash backend take the recomputing path, and HiPrune / VisionZip pick
what they pick on the torch path.

Without marks: the recomputing path on the CPU. ``gpu`` + ``triton``: the LSE path, on CUDA in bf16 (SDPA's flash
backend), or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``: SDPA's CPU flash backend, fp32)."""

from __future__ import annotations

import os
import sys

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TRITON_MARKS  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.models.qwen3_vl import qwen_vision_attn_qk, qwen_vision_attn_sdpa_input  # noqa: E402
from hf_raincheck.pruning.base import VISION_ATTENTION, VISION_HIDDEN  # noqa: E402
from hf_raincheck.pruning.hiprune import ranking  # noqa: E402
from hf_raincheck.pruning.vision import BlockAttentionHooks, received_attention_torch  # noqa: E402

LSE_MARKS = TRITON_MARKS


def lse_test(fn):
    """The marks of a test of the LSE path (`LSE_MARKS`)."""
    for mark in LSE_MARKS:
        fn = mark(fn)
    return fn


#: an image and a 2-frame video: three segments (64, 24, 24 patches)
GRID = torch.tensor([[1, 8, 8], [2, 4, 6]])
PATCH_DIM = 3 * 2 * 16 * 16
#: (rtol, atol) of received attention against the fp32 torch reference (as tests/test_attention_triton.py)
TOLERANCES = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (1e-3, 1e-5)}


def sharpen(blocks, factor: float = 4.0) -> None:
    """Scale the q and k projections of `blocks`: random init gives near-uniform attention (near ties everywhere)."""
    with torch.no_grad():
        for block in blocks:
            rows = 2 * block.attn.qkv.weight.shape[1]  # qkv's output: q, k, v of `hidden` each
            block.attn.qkv.weight[:rows] *= factor
            block.attn.qkv.bias[:rows] *= factor


def tiny_tower(attn: str = "sdpa", heads: int = 2, head_dim: int = 72, depth: int = 3, seed: int = 0):
    """A random fp32 Qwen3-VL vision tower (eval) with `heads` heads of `head_dim` (72: Qwen3-VL's)."""
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(
        depth=depth, hidden_size=heads * head_dim, intermediate_size=128, num_heads=heads, patch_size=16,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
        deepstack_visual_indexes=[0, depth - 1],
    )
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    tower = Qwen3VLVisionModel(cfg).float().eval()
    sharpen(tower.blocks)
    return tower


def tower_outputs(out) -> list[torch.Tensor]:
    return [out.last_hidden_state, out.pooler_output, *out.deepstack_features]


def run_tower(tower, layers, sdpa_input=qwen_vision_attn_sdpa_input, seed: int = 0):
    """``(plain, hooked, hooks, reference)``: the tower's outputs without and with `BlockAttentionHooks` on the
    attention modules of `layers` (as the Qwen3-VL adapter hooks them), and per layer the torch reference of the
    received attention from the inputs those modules got."""
    param = next(tower.parameters())
    pixels = torch.randn(int(GRID.prod(-1).sum()), PATCH_DIM, generator=torch.Generator().manual_seed(seed))
    pixels = pixels.to(param.device, param.dtype)
    grid = GRID.to(param.device)
    modules = [block.attn for block in tower.blocks]
    seen = {}
    spies = [modules[b].register_forward_pre_hook(lambda m, a, kw, b=b: seen.setdefault(b, (a, kw)), with_kwargs=True)
             for b in layers]
    try:
        with torch.no_grad():
            plain = tower_outputs(tower(pixels, grid_thw=grid))
            with BlockAttentionHooks(modules, layers, qwen_vision_attn_qk, sdpa_input) as hooks:
                hooked = tower_outputs(tower(pixels, grid_thw=grid))
            reference = {}
            for b in layers:
                q, k, cu, scale = qwen_vision_attn_qk(modules[b], *seen[b])
                reference[b] = received_attention_torch(q, k, cu, scale)
    finally:
        for spy in spies:
            spy.remove()
    return plain, hooked, hooks, reference


def check_tower(tower, layers, path: str, dtype, sdpa_input=qwen_vision_attn_sdpa_input):
    plain, hooked, hooks, reference = run_tower(tower, layers, sdpa_input)
    assert all(torch.equal(a, b) for a, b in zip(plain, hooked)), "the hooks changed the tower's output"
    assert hooks.paths == {b: [path] for b in layers}
    scores = hooks.scores
    for b in layers:
        rtol, atol = TOLERANCES[dtype]
        torch.testing.assert_close(scores[b], reference[b], rtol=rtol, atol=atol)
        # each segment's queries spread a total of 1 each over their segment's keys
        assert scores[b].sum().item() == pytest.approx(reference[b].shape[0], rel=1e-4)


# ------------------------------------------------------------------------------------------ the recomputing path
@pytest.mark.parametrize("with_glue", [True, False], ids=["sdpa_input", "block_qk_only"])
def test_recomputing_path_leaves_the_tower_unchanged(monkeypatch, with_glue):
    """No Triton (CPU): q, k recomputed before the block, as without ``sdpa_input``."""
    monkeypatch.setenv("HF_RAINCHECK_TRITON", "0")
    tower = tiny_tower()
    check_tower(tower, [0, 2], "recomputed", torch.float32, qwen_vision_attn_sdpa_input if with_glue else None)


def test_glue_says_sdpa_only_for_the_sdpa_implementation():
    x = torch.zeros(4, 144)
    assert qwen_vision_attn_sdpa_input(tiny_tower("sdpa").blocks[0].attn, (x,), {}) is x
    assert qwen_vision_attn_sdpa_input(tiny_tower("sdpa").blocks[0].attn, (), {"hidden_states": x}) is x
    assert qwen_vision_attn_sdpa_input(tiny_tower("eager").blocks[0].attn, (x,), {}) is None


# ------------------------------------------------------------------------------------------ the LSE path
@pytest.fixture(scope="module")
def device(triton_device) -> torch.device:
    return triton_device


def lse_dtype(device) -> torch.dtype:
    """The dtype SDPA runs with its flash backend on `device` (CUDA: 16-bit only)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@lse_test
@pytest.mark.parametrize("heads,head_dim", [(2, 72), (4, 16), (2, 80)], ids=["qwen3vl_72", "tiny_16", "qwen25vl_80"])
@pytest.mark.parametrize("layers", [[0, 2], [1]])
def test_lse_path_leaves_the_tower_unchanged(device, heads, head_dim, layers):
    tower = tiny_tower(heads=heads, head_dim=head_dim).to(device, lse_dtype(device))
    check_tower(tower, layers, "lse", lse_dtype(device))


@lse_test
def test_cudnn_backend_takes_the_lse_path(device):
    """SDPA's cuDNN backend (what it picks for the Qwen vision towers on the H200) also gives the LSE: its op with the
    statistics output, the tower's output unchanged bit for bit."""
    if device.type != "cuda" or not torch.backends.cuda.is_flash_attention_available():
        pytest.skip("cuDNN attention is a CUDA backend")
    tower = tiny_tower().to(device, torch.bfloat16)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        check_tower(tower, [0, 2], "lse", torch.bfloat16)


@contextlib.contextmanager
def flash_disabled():
    """``torch.backends.cuda.enable_flash_sdp(False)`` (also the CPU's flash backend) and cuDNN's off, restored
    after."""
    was, was_cudnn = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_flash_sdp(was)
        torch.backends.cuda.enable_cudnn_sdp(was_cudnn)


@lse_test
@pytest.mark.parametrize("case", ["eager", "math_only", "flash_disabled", "fp32_cuda"])
def test_flashless_cases_recompute(device, case):
    """Where SDPA would not run the flash backend (or the tower does not call SDPA), the hooks recompute q, k (after
    the block's forward, or before it for a non-SDPA implementation) and the tower's output stays unchanged."""
    if case == "fp32_cuda" and device.type != "cuda":
        pytest.skip("fp32 takes the CPU's flash backend")
    dtype = torch.float32 if case == "fp32_cuda" else lse_dtype(device)
    tower = tiny_tower(attn="eager" if case == "eager" else "sdpa").to(device, dtype)
    context = {"math_only": lambda: sdpa_kernel([SDPBackend.MATH]), "flash_disabled": flash_disabled}.get(
        case, contextlib.nullcontext
    )
    with context():
        check_tower(tower, [0, 2], "recomputed", dtype)


@lse_test
def test_a_failing_forward_leaves_no_capture_behind(device):
    """The capture (a torch function mode) ends with the block's forward even when the forward raises."""
    from torch.overrides import _get_current_function_mode_stack

    tower = tiny_tower().to(device, lse_dtype(device))
    modules = [block.attn for block in tower.blocks]
    before = len(_get_current_function_mode_stack())
    with BlockAttentionHooks(modules, [0], qwen_vision_attn_qk, qwen_vision_attn_sdpa_input) as hooks:
        with pytest.raises(Exception):
            with torch.no_grad():
                modules[0](torch.zeros(8, 144, device=device, dtype=lse_dtype(device)), cu_seqlens=None)
        assert len(_get_current_function_mode_stack()) == before
    assert hooks.paths == {0: []}


@lse_test
def test_capture_outputs_and_no_host_sync(device):
    """Calls made as the ViT makes them (one per segment, views of one tensor): the captured outputs are SDPA's, the
    scores match the reference, and on CUDA computing them waits for nothing on the device (no host sync)."""
    import torch.nn.functional as F

    from hf_raincheck.pruning.vision import FlashLSECapture

    dtype = lse_dtype(device)
    lengths = [64, 1, 100, 31]
    gen = torch.Generator().manual_seed(3)
    qkv = (torch.randn(3, 1, 4, sum(lengths), 72, generator=gen) * 2).to(device, dtype)
    parts = [x.split(lengths, dim=2) for x in qkv]
    with torch.no_grad():
        want = [F.scaled_dot_product_attention(q, k, v, scale=0.1) for q, k, v in zip(*parts)]
        with FlashLSECapture() as capture:
            got = [F.scaled_dot_product_attention(q, k, v, scale=0.1) for q, k, v in zip(*parts)]
    assert capture.complete and len(capture.parts) == len(lengths)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        scores = capture.received_attention(sum(lengths))
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert capture.received_attention(sum(lengths) + 1) is None  # the calls do not cover those rows
    q, k = qkv[0, 0].transpose(0, 1), qkv[1, 0].transpose(0, 1)
    cu = [0, 64, 65, 165, 196]
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(scores, received_attention_torch(q, k, cu, 0.1), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------------------ end to end: the picks
def _media_inputs(processor):
    from hf_raincheck.testing import chat_inputs, make_image, make_video

    messages = [{"role": "user", "content": [
        {"type": "image", "image": make_image(0, size=(128, 192))},
        {"type": "video", "video": make_video(1, num_frames=4)},
        {"type": "text", "text": "What is in there?"},
    ]}]
    return chat_inputs(processor, messages)


@lse_test
@pytest.mark.parametrize("selector", ["hiprune", "visionzip"])
def test_selection_matches_the_torch_path(fresh_tiny_vl, device, monkeypatch, selector):
    """HiPrune / VisionZip on a tiny Qwen3-VL: the vision extras from the LSE path match those of the torch path
    (``HF_RAINCHECK_TRITON=0``: q, k recomputed, fp32 loops), their order differs at most between near ties (within
    the tolerance), and where it does not differ the kept tokens are the same."""
    import hf_raincheck.models.qwen3_vl as qwen3_vl
    from hf_raincheck import RaincheckConfig, enable_raincheck

    model, processor = fresh_tiny_vl
    dtype = lse_dtype(device)
    sharpen(model.model.visual.blocks)
    model = enable_raincheck(model.to(device, dtype))
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in _media_inputs(processor).items()}
    inputs = {k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in inputs.items()}

    hooks_made, extras = [], []

    class RecordingHooks(BlockAttentionHooks):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            hooks_made.append(self)

    original = qwen3_vl.Qwen3VLAdapter.vision_features

    def spy(self, modality, pixel_values, grid_thw, want=None):
        feats = original(self, modality, pixel_values, grid_thw, want=want)
        extras.append(feats.extras)
        return feats

    monkeypatch.setattr(qwen3_vl, "BlockAttentionHooks", RecordingHooks)
    monkeypatch.setattr(qwen3_vl.Qwen3VLAdapter, "vision_features", spy)
    kept, scores = {}, {}
    for path, env in (("lse", "1"), ("recomputed", "0")):
        monkeypatch.setenv("HF_RAINCHECK_TRITON", env)
        hooks_made.clear()
        extras.clear()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=1, do_sample=False, return_dict_in_generate=True,
                                 raincheck_config=RaincheckConfig(policy="hard", pruning=selector))
        kept[path] = output_cache(out).plan.kept.cpu()
        used = [h for h in hooks_made if h.layers]
        assert used and all(p == path for h in used for calls in h.paths.values() for p in calls)
        tables = [e[VISION_ATTENTION] for e in extras if e and VISION_ATTENTION in e]
        scores[path] = {b: torch.cat([t[b] for t in tables]).float().cpu() for b in tables[0]}
        assert all(not e.get(VISION_HIDDEN) for e in extras if e)

    rtol, atol = TOLERANCES[dtype]
    same_order = True
    for b, want in scores["recomputed"].items():
        got = scores["lse"][b]
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
        order = ranking(got)
        if not torch.equal(order, ranking(want)):
            same_order = False
            # in the LSE path's order, the reference scores may only rise between near ties
            rises = want[order][1:] - want[order][:-1]
            assert float(rises.max()) <= atol + rtol * float(want.abs().max()), f"block {b}: not a near tie"
    if same_order:
        assert torch.equal(kept["lse"], kept["recomputed"])
    else:  # near ties may pick differently, but as many
        assert kept["lse"].numel() == kept["recomputed"].numel()
