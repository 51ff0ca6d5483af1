"""Vision-tower features for selectors, computed during the tower's one forward pass.

- `received_attention`: the attention each key receives in one ViT block (softmax of ``q k^T * scale`` within
  each attention segment of ``cu_seqlens``, mean over heads, summed over queries), recomputed from the block's
  q and k, so the ViT keeps its own (sdpa / flash) attention: by the Triton kernels of
  `hf_raincheck.pruning.attention_triton` where they run (`triton_enabled`: CUDA), else by
  `received_attention_torch` (fp32, a block of queries at a time; also their reference).
- `BlockAttentionHooks`: forward pre-hooks on the requested blocks only; a family-specific ``block_qk`` function
  recomputes the block's q, k (with its rotary embedding) from the block's input.
- `pool_merged`: per-patch values -> per merged token (mean over the ``merge_unit`` consecutive patches of each
  merged token, which is how Qwen-VL towers lay patches out), optionally reordered to raster order (Qwen2.5-VL
  runs its blocks in window order: pass the tower's ``reverse_index``).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .triton_support import triton_enabled

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


class BlockAttentionHooks:
    """Context manager: while active, each forward of ``blocks[b]`` (``b`` in `layers`) records the attention its
    keys receive (`received_attention`), from ``block_qk(block, args, kwargs) -> (q, k, cu_seqlens, scale)``.

    ``scores[b]`` is the per-patch ``[P]`` result (calls of one block concatenated in call order).
    """

    def __init__(self, blocks, layers: Iterable[int], block_qk: BlockQK):
        self.blocks = blocks
        self.layers = sorted(set(int(layer) for layer in layers))
        self.block_qk = block_qk
        self._parts: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.layers}
        self._handles = []

    def _hook(self, layer: int):
        def hook(module, args, kwargs):
            with torch.no_grad():
                q, k, cu_seqlens, scale = self.block_qk(module, args, kwargs)
                self._parts[layer].append(received_attention(q, k, cu_seqlens, scale))

        return hook

    def __enter__(self) -> "BlockAttentionHooks":
        for layer in self.layers:
            self._handles.append(self.blocks[layer].register_forward_pre_hook(self._hook(layer), with_kwargs=True))
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
