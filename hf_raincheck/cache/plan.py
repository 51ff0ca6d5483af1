"""`DeferralPlan`: which placeholder tokens of one `generate` call were kept, and the store of the deferred ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DeferralPlan:
    """The deferral of the spans that are new in one `generate` call.

    Index tensors are logical indices into the conversation's ``input_ids`` (CPU LongTensors).

    Attributes:
        spans: ``(start, stop)`` per placeholder span (an image, or a video frame), in source order.
        modalities: ``"image"``/``"video"`` per span.
        budgets: kept tokens per span.
        boundary: the logical index right after the last placeholder of the last span.
        kept: the placeholder indices prefilled first (K).
        deferred: the placeholder indices deferred (D = X \\ K), ascending.
        policy: the config's policy; under ``"hard"`` the deferred tokens are dropped, never restored.
        restored: how many of ``deferred`` (a prefix, in source order) are already in the cache.
    """

    spans: list[tuple[int, int]]
    modalities: list[str]
    budgets: list[int]
    boundary: int
    kept: torch.Tensor
    deferred: torch.Tensor
    policy: str
    restored: int = 0
    # the deferred store (on the model's device): input embeddings, DeepStack features, logical positions
    store_embeds: torch.Tensor | None = field(default=None, repr=False)
    store_deepstack: list[torch.Tensor] | None = field(default=None, repr=False)
    store_positions: torch.Tensor | None = field(default=None, repr=False)
    # device-side helpers: deferred slots as a mask over logical indices [0, boundary), and `deferred` itself
    deferred_slot_mask: torch.Tensor | None = field(default=None, repr=False)
    deferred_on_device: torch.Tensor | None = field(default=None, repr=False)
    # compiled static steps: the store widened to the cache's capacity (hf_raincheck.generation.decode.StaticStep)
    padded_store: dict | None = field(default=None, repr=False)
    # `deferred` as a host list, built on first use (`deferred_at`)
    _deferred_list: list[int] | None = field(default=None, repr=False, compare=False)

    @property
    def total_deferred(self) -> int:
        return int(self.deferred.numel())

    def deferred_at(self, i: int) -> int:
        """``int(deferred[i])`` from a host copy made once per plan (no ``_local_scalar_dense`` per decode step)."""
        if self._deferred_list is None:
            self._deferred_list = self.deferred.tolist()
        return self._deferred_list[i]

    @property
    def pending(self) -> int:
        """Deferred tokens that are still to be prefilled (0 under ``hard``: they are dropped)."""
        if self.policy == "hard":
            return 0
        return self.total_deferred - self.restored

    def release_store(self) -> None:
        """Frees the deferred store once every deferred token is in the cache (or dropped)."""
        self.store_embeds = self.store_deepstack = self.store_positions = self.deferred_on_device = None
        self.padded_store = None
