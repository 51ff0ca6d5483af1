"""What Raincheck keeps per Gated DeltaNet layer: the live state, and the prefix checkpoint of a pending plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefixCheckpoint:
    """A GDN layer's state at a plan's boundary, continued by the plan's deferred rows, and the tail's map.

    Attributes:
        plan_id: ``id`` of the `DeferralPlan` it belongs to.
        recurrent: ``[1, H_v, K, V]`` fp32, S_prefix (advanced by every restored chunk).
        conv: ``[1, C, kernel]`` the short-conv window at the boundary (advanced likewise).
        transition: ``[1, H_v, K, K]`` fp32, P_tail: the product of the tail's transitions, latest on the left.
    """

    plan_id: int
    recurrent: torch.Tensor
    conv: torch.Tensor
    transition: torch.Tensor


class GDNLayerState:
    """Live recurrent state ``[1, H_v, K, V]`` (fp32) and conv window ``[1, C, kernel]`` of one GDN layer, plus
    the `PrefixCheckpoint` of the plan whose deferred rows are still pending (None otherwise)."""

    def __init__(self):
        self.recurrent: torch.Tensor | None = None
        self.conv: torch.Tensor | None = None
        self.prefix: PrefixCheckpoint | None = None

    @property
    def is_initialized(self) -> bool:
        return self.recurrent is not None

    def checkpoint(self, plan_id: int, num_v_heads: int, key_dim: int, value_dim: int, conv_shape, device, dtype):
        """Copies the live state as the boundary checkpoint of plan `plan_id`, with P_tail = I."""
        if self.recurrent is None:  # nothing before the boundary yet (cannot happen for a real prompt)
            self.recurrent = torch.zeros(1, num_v_heads, key_dim, value_dim, dtype=torch.float32, device=device)
            self.conv = torch.zeros(conv_shape, dtype=dtype, device=device)
        eye = torch.eye(key_dim, dtype=torch.float32, device=self.recurrent.device)
        self.prefix = PrefixCheckpoint(
            plan_id=plan_id,
            recurrent=self.recurrent.clone(),
            conv=self.conv.clone(),
            transition=eye.expand(1, num_v_heads, key_dim, key_dim).contiguous(),
        )

    def join(self, new_prefix: torch.Tensor) -> None:
        """S_live += P_tail (S_prefix_new - S_prefix_old); then S_prefix = S_prefix_new."""
        prefix = self.prefix
        self.recurrent = self.recurrent + torch.matmul(prefix.transition, new_prefix - prefix.recurrent)
        prefix.recurrent = new_prefix

    def snapshot(self) -> tuple:
        """References to everything a forward may replace (updates build new tensors, never write in place)."""
        prefix = self.prefix
        fields = None if prefix is None else (prefix.recurrent, prefix.conv, prefix.transition)
        return self.recurrent, self.conv, prefix, fields

    def restore(self, snapshot: tuple) -> None:
        """Undoes the updates of a forward that failed half-way (see `snapshot`)."""
        self.recurrent, self.conv, self.prefix, fields = snapshot
        if self.prefix is not None:
            self.prefix.recurrent, self.prefix.conv, self.prefix.transition = fields

    def nbytes(self) -> int:
        tensors = [self.recurrent, self.conv]
        if self.prefix is not None:
            tensors += [self.prefix.recurrent, self.prefix.conv, self.prefix.transition]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
