"""Vision-tower features for selectors, computed during the tower's one forward pass.

- `received_attention`: the attention each key receives in one ViT block (softmax of ``q k^T * scale`` within
  each attention segment of ``cu_seqlens``, mean over heads, summed over queries), recomputed from the block's
  q and k, so the ViT keeps its own (sdpa / flash) attention: by the Triton kernels of
  `hf_raincheck.pruning.attention_triton` where they run (`triton_enabled`: CUDA), else by
  `received_attention_torch` (fp32, a block of queries at a time; also their reference).
- `BlockAttentionHooks`: forward pre-hooks on the requested blocks only; a family-specific ``block_qk`` function
  recomputes the block's q, k (with its rotary embedding) from the block's input. Where the family says its
  attention modules run SDPA per segment (``sdpa_input``) and the Triton kernels run, the hooks instead intercept
  the module's own SDPA calls while it runs (`FlashLSECapture`): those that SDPA runs with its flash or cuDNN
  backend are run by that backend's op, the same call SDPA makes (the tower's output is bit for bit unchanged),
  which also returns each query's log-sum-exp; the kernels then only sum the probabilities (pass 2) from the
  block's own q, k and that LSE: no recomputed q, k and no LSE pass. Anything else (neither backend: CPU without the
  interpreter, fp32 on CUDA, both disabled, a mask, ...) takes the recomputing path.
- `pool_merged`: per-patch values -> per merged token (mean over the ``merge_unit`` consecutive patches of each
  merged token, which is how Qwen-VL towers lay patches out), optionally reordered to raster order (Qwen2.5-VL
  runs its blocks in window order: pass the tower's ``reverse_index``).
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from ..transformers_coupling import fused_sdp_choice
from ..triton_support import triton_enabled

#: at most this many attention probabilities in memory at once ([heads, query block, keys] fp32: 256 MiB)
MAX_ATTENTION_ELEMENTS = 1 << 26


@torch.no_grad()
def received_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | Iterable[int],
    scale: float,
    max_elements: int = MAX_ATTENTION_ELEMENTS,
) -> torch.Tensor:
    """``[P]`` fp32: for each key, the attention it receives, averaged over heads and summed over the queries of
    its segment.

    Args:
        q, k: ``[P, heads, head_dim]`` (after the rotary embedding) for all patches of the call.
        cu_seqlens: ``[segments + 1]`` cumulative segment boundaries (attention never crosses a segment).
        scale: the softmax scale of the block (``head_dim ** -0.5``).
        max_elements: the torch path's memory bound (`received_attention_torch`).
    """
    if triton_enabled(q.device):
        from .attention_triton import received_attention_triton  # lazily: CPU installs may have no Triton

        return received_attention_triton(q, k, cu_seqlens, scale)
    return received_attention_torch(q, k, cu_seqlens, scale, max_elements)


@torch.no_grad()
def received_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens: torch.Tensor | Iterable[int],
    scale: float,
    max_elements: int = MAX_ATTENTION_ELEMENTS,
) -> torch.Tensor:
    """`received_attention` in torch, fp32: the ``[heads, query block, keys]`` probabilities of at most
    `max_elements` at a time (the Triton kernels' reference)."""
    total, heads, _ = q.shape
    qh = q.float().transpose(0, 1)  # [heads, P, d]
    kh = k.float().transpose(0, 1)
    bounds = cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
    out = torch.zeros(total, dtype=torch.float32, device=q.device)
    for start, stop in zip(bounds[:-1], bounds[1:]):
        n = stop - start
        if n <= 0:
            continue
        keys_t = kh[:, start:stop].transpose(1, 2)  # [heads, d, n]
        step = max(1, max_elements // (heads * n))
        acc = torch.zeros(n, dtype=torch.float32, device=q.device)
        for q0 in range(start, stop, step):
            logits = torch.matmul(qh[:, q0 : min(q0 + step, stop)], keys_t).mul_(scale)  # [heads, c, n]
            acc += torch.softmax(logits, dim=-1).sum(dim=(0, 1))
        out[start:stop] = acc / heads
    return out


def pool_merged(x: torch.Tensor, merge_unit: int, reverse_index: torch.Tensor | None = None) -> torch.Tensor:
    """Per-patch ``x [P, ...]`` -> per merged token ``[P / merge_unit, ...]`` (fp32 mean of consecutive groups),
    then ``[reverse_index]`` when given (window order -> raster order)."""
    if x.shape[0] % merge_unit:
        raise ValueError(f"{x.shape[0]} patches do not form whole merged tokens of {merge_unit} patches")
    pooled = x.float().reshape(x.shape[0] // merge_unit, merge_unit, *x.shape[1:]).mean(dim=1)
    if reverse_index is not None:
        pooled = pooled[reverse_index.to(pooled.device)]
    return pooled


BlockQK = Callable[[torch.nn.Module, tuple, dict], tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]
#: ``(module, args, kwargs) -> hidden_states | None``: see `BlockAttentionHooks`
SDPAInput = Callable[[torch.nn.Module, tuple, dict], "torch.Tensor | None"]


class SDPACall(NamedTuple):
    """The arguments of one ``F.scaled_dot_product_attention`` call."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False


def flash_attention_with_lse(call: SDPACall) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(output, logsumexp)`` of an SDPA call that SDPA would run with its flash (or cuDNN) backend, else None.

    The output is that of ``F.scaled_dot_product_attention(*call)``, bit for bit: the backend's op is called as SDPA
    calls it (CUDA: ``aten._scaled_dot_product_flash_attention``, head_dim a multiple of 8 so that SDPA pads
    nothing; CPU: ``aten._scaled_dot_product_flash_attention_for_cpu``), with the backend SDPA's own choice
    (``torch._fused_sdp_choice``: dtype, head_dim, ``torch.backends.cuda.enable_flash_sdp``, ``sdpa_kernel``).
    logsumexp: ``[batch, heads, n]`` fp32, natural log of ``sum_j exp(scale * q.k_j)`` per query. None for calls
    with a mask, dropout, causal or GQA attention, inputs that need grad, or another backend."""
    q, k, v = call.query, call.key, call.value
    if call.attn_mask is not None or call.dropout_p != 0.0 or call.is_causal or call.enable_gqa:
        return None
    if q.dim() != 4 or q.shape != k.shape or k.shape != v.shape:
        return None
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return None
    try:
        choice = fused_sdp_choice(q, k, v, call.scale)
    except RuntimeError:  # no backend fits: SDPA itself will say why
        return None
    if choice == int(SDPBackend.CUDNN_ATTENTION) and q.device.type == "cuda":
        # cuDNN (what SDPA picks for the Qwen vision towers on Hopper GPUs): its op with the statistics output on
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, False, False, scale=call.scale)[:2]
        return out, lse.reshape(*q.shape[:3])
    if choice != int(SDPBackend.FLASH_ATTENTION):
        return None
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=call.scale)[:2]
    elif q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=None, scale=call.scale
        )
    else:
        return None
    return out, lse[..., : q.shape[2]]


class FlashLSECapture(TorchFunctionMode):
    """While active (a torch function mode: this thread only, nothing patched), each
    ``F.scaled_dot_product_attention`` call that SDPA runs with its flash (or cuDNN) backend is run by
    `flash_attention_with_lse` (the same output) and its q, k and log-sum-exp are kept; any other call runs
    unchanged and makes the capture incomplete (`received_attention` then gives None).

    parts: per call, ``(q, k, lse, scale)``: q, k ``[1, heads, n, head_dim]`` as the call got them, lse
    ``[1, heads, n]`` fp32 (natural log), the call's softmax scale (None: SDPA's default).
    """

    def __init__(self):
        super().__init__()
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None]] = []
        self.complete = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or not self.complete:
            return func(*args, **kwargs)
        try:
            call = SDPACall(*args, **kwargs)
        except TypeError:  # arguments this SDPA version has and this code does not know
            call = None
        if call is not None and call.query.dim() == 4 and call.query.shape[2] == 0:  # an empty segment: no LSE
            out = func(*args, **kwargs)
            self.parts.append((call.query, call.key, call.query.new_empty(call.query.shape[:3], dtype=torch.float32),
                               call.scale))
            return out
        got = None if call is None else flash_attention_with_lse(call)
        if got is None:
            self.complete = False
            self.parts.clear()
            return func(*args, **kwargs)
        out, lse = got
        self.parts.append((call.query, call.key, lse, call.scale))
        return out

    def received_attention(self, patches: int) -> torch.Tensor | None:
        """`received_attention` ``[patches]`` of the captured calls, taken as consecutive segments of the
        `patches` rows, from their LSE (`received_attention_from_lse`: the Triton pass 2 only); None when the capture
        is incomplete or the calls do not cover exactly those rows with one batch, heads, head_dim and scale."""
        if not self.complete or not self.parts:
            return None
        qs, ks, lses, scales = zip(*self.parts)
        if (
            len({(q.shape[0], q.shape[1], q.shape[3]) for q in qs}) != 1
            or qs[0].shape[0] != 1
            or len(set(scales)) != 1
            or sum(q.shape[2] for q in qs) != patches
        ):
            return None
        from .attention_triton import received_attention_from_lse  # lazily: CPU installs may have no Triton

        def joined(parts):
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

        q, k, lse = joined(qs), joined(ks), joined(lses)
        bounds = [0]
        for part in qs:
            bounds.append(bounds[-1] + part.shape[2])
        cu_seqlens = torch.tensor(bounds, dtype=torch.int64)
        if q.is_cuda:  # pinned: the copy does not wait for the queued kernels
            cu_seqlens = cu_seqlens.pin_memory().to(q.device, non_blocking=True)
        scale = scales[0] if scales[0] is not None else 1.0 / math.sqrt(q.shape[-1])  # SDPA's default
        return received_attention_from_lse(q[0].transpose(0, 1), k[0].transpose(0, 1), lse[0], cu_seqlens, scale)


class BlockAttentionHooks:
    """Context manager: while active, each forward of ``blocks[b]`` (``b`` in `layers`) records the attention its
    keys receive (`received_attention`), from ``block_qk(block, args, kwargs) -> (q, k, cu_seqlens, scale)``.

    ``sdpa_input(block, args, kwargs)`` (optional, family glue): the block's input hidden states ``[P, hidden]``
    when the block's forward runs its attention as one ``F.scaled_dot_product_attention`` call per segment of its
    ``P`` rows, in order, with q, k ``[1, heads, n, head_dim]`` as `received_attention` takes them, else None. Given
    that and where the Triton kernels run, the block's SDPA calls are intercepted for the duration of its forward
    (`FlashLSECapture`) and, if SDPA ran them all with its flash or cuDNN backend, the attention comes from their q, k
    and LSE, after the forward (a forward hook); otherwise from ``block_qk``, before the forward (no flash backend at
    all: its pre-hook, as without ``sdpa_input``) or after it.

    ``scores[b]`` is the per-patch ``[P]`` result (calls of one block concatenated in call order); ``paths[b]`` says
    how each call's was computed: ``"lse"`` (from the block's own attention) or ``"recomputed"`` (``block_qk``).

    The hooks belong to the thread that entered the context: forwards of the same blocks in other threads (another
    `generate` on the same model, e.g. a second chat session) run their own hooks' recording and are skipped by
    these, so concurrent vision passes on one model each record exactly their own calls.
    """

    def __init__(self, blocks, layers: Iterable[int], block_qk: BlockQK, sdpa_input: SDPAInput | None = None):
        self.blocks = blocks
        self.layers = sorted(set(int(layer) for layer in layers))
        self.block_qk = block_qk
        self.sdpa_input = sdpa_input
        self._parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self.paths: dict[int, list[str]] = {layer: [] for layer in self.layers}
        self._captures: dict[int, tuple[FlashLSECapture, int]] = {}
        self._handles = []
        self._thread: int | None = None  # the thread whose block forwards these hooks record

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _recompute(self, layer: int, module, args, kwargs) -> None:
        with torch.no_grad():
            q, k, cu_seqlens, scale = self.block_qk(module, args, kwargs)
            self._parts[layer].append(received_attention(q, k, cu_seqlens, scale))
        self.paths[layer].append("recomputed")

    def _pre_hook(self, layer: int):
        # ``kwargs=None``: torch registers a kwargs hook in two dict writes (the hook, then its with-kwargs flag)
        # and removes it in two, so a forward of the same block in another thread, between the two, calls it
        # without kwargs; that thread's call is not ours and returns at once
        def hook(module, args, kwargs=None):
            if not self._mine():
                return
            hidden = None if self.sdpa_input is None else self.sdpa_input(module, args, kwargs)
            if hidden is not None and triton_enabled(hidden.device):
                capture = FlashLSECapture()
                capture.__enter__()
                self._captures[layer] = (capture, hidden.shape[0])
                return
            self._recompute(layer, module, args, kwargs)

        return hook

    def _post_hook(self, layer: int):
        def hook(module, args, *kwargs_output):  # (kwargs, output), or (output,) from another thread (`_pre_hook`)
            if not self._mine() or layer not in self._captures:
                return
            kwargs, output = kwargs_output
            capture, patches = self._captures.pop(layer)
            capture.__exit__(None, None, None)
            if output is None:  # the forward raised (an always-called hook)
                return
            with torch.no_grad():
                scores = capture.received_attention(patches)
            if scores is None:
                self._recompute(layer, module, args, kwargs)
                return
            self._parts[layer].append(scores)
            self.paths[layer].append("lse")

        return hook

    def __enter__(self) -> "BlockAttentionHooks":
        if self._handles:
            raise RuntimeError("BlockAttentionHooks is not re-entrant: use one instance per vision-tower call")
        self._thread = threading.get_ident()
        for layer in self.layers:
            block = self.blocks[layer]
            self._handles.append(block.register_forward_pre_hook(self._pre_hook(layer), with_kwargs=True))
            if self.sdpa_input is not None:
                self._handles.append(
                    block.register_forward_hook(self._post_hook(layer), with_kwargs=True, always_call=True)
                )
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def scores(self) -> dict[int, torch.Tensor]:
        missing = [layer for layer in self.layers if not self._parts[layer]]
        if missing:
            raise RuntimeError(f"vision blocks {missing} did not run while their attention was being recorded")
        return {layer: torch.cat(parts) for layer, parts in self._parts.items()}


def gather_extras(parts, length: int, rows: torch.Tensor, depth: int | None) -> dict:
    """``ctx.extras`` for the selection: per-placeholder features of several vision-tower calls, each given as
    ``(where, extras)`` (``where``: positions among `length` new tokens), scattered into the new tokens and then
    taken at `rows` (the spans' rows, in span order, like ``ctx.embeddings``)."""
    from .base import VISION_ATTENTION, VISION_DEPTH, VISION_HIDDEN

    full: dict = {}
    for where, extras in parts:
        for layer, scores in (extras or {}).get(VISION_ATTENTION, {}).items():
            table = full.setdefault(VISION_ATTENTION, {})
            if layer not in table:
                table[layer] = torch.zeros(length, dtype=torch.float32, device=scores.device)
            table[layer][where.to(scores.device)] = scores.float()
        hidden = (extras or {}).get(VISION_HIDDEN)
        if hidden is not None:
            if VISION_HIDDEN not in full:
                full[VISION_HIDDEN] = torch.zeros(length, hidden.shape[-1], dtype=torch.float32, device=hidden.device)
            full[VISION_HIDDEN][where.to(hidden.device)] = hidden.float()
    out: dict = {}
    if VISION_ATTENTION in full:
        out[VISION_ATTENTION] = {layer: t[rows.to(t.device)] for layer, t in full[VISION_ATTENTION].items()}
    if VISION_HIDDEN in full:
        out[VISION_HIDDEN] = full[VISION_HIDDEN][rows.to(full[VISION_HIDDEN].device)]
    if out and depth is not None:
        out[VISION_DEPTH] = int(depth)
    return out
