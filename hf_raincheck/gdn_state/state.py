"""What Raincheck keeps per Gated DeltaNet layer: the live state, and the prefix checkpoint of a pending plan."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

_CHANGES = itertools.count(1)
_last_change = 0
_TRACKED = frozenset({"state", "conv", "prefix", "value_dim", "recurrent"})


def _note_change() -> None:
    global _last_change
    _last_change = next(_CHANGES)  # (a fresh number each time, so a late write never repeats one seen earlier)


def last_change() -> int:
    """A number that changes whenever any `GDNLayerState` or `PrefixCheckpoint` rebinds one of its tensors (in any
    cache; in-place updates do not count). A compiled static batch step skips re-checking every row's states when
    nothing was rebound since its last check (`BatchedDeferredPrefillCache.sync_gdn_states`)."""
    return _last_change


class _Tracked:
    """Notes every rebinding of a tracked field (`last_change`)."""

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name in _TRACKED:
            _note_change()


@dataclass
class PrefixCheckpoint(_Tracked):
    """A GDN layer's state at a plan's boundary, continued by the plan's restored deferred rows.

    Attributes:
        plan_id: ``id`` of the `DeferralPlan` it belongs to.
        recurrent: ``[1, H_v, K, V]`` fp32, S_prefix (advanced by every restored chunk).
        conv: ``[1, C, kernel]`` the short-conv window at the boundary (advanced likewise).
    """

    plan_id: int
    recurrent: torch.Tensor
    conv: torch.Tensor


class GDNLayerState(_Tracked):
    """Live state of one GDN layer, and the `PrefixCheckpoint` of the plan whose deferred rows are pending.

    ``state`` is ``[1, H_v, K, V]`` fp32, or ``[1, H_v, K, V + K]`` while a plan is pending: the extra columns
    hold P_tail, the product of the transitions of every row after the plan's boundary (latest on the left),
    advanced by the same kernel call as the state (`kernels.advance`). ``conv`` is the short-conv window
    ``[1, C, kernel]`` (the model's dtype).

    ``fixed=True`` (compiled static steps): P_tail's columns stay in ``state`` even when no plan is pending, so the
    shapes never change (from the end of the conversation's first forward on: `add_transition_columns`), and every
    tensor is marked as a static address (compiled steps update them in place).

    ``pending`` (compiled fused steps, `ops.lazy_window_`): ``[1, H_v, K, V]`` fp32, the checkpoint's change that
    the live state has not joined yet; the live state is ``S + P_tail pending`` while it is not zero. The cache
    folds it in before any other forward (`DeferredPrefillCache.join_pending_gdn`); None until a fused step needs it.
    """

    def __init__(self, fixed: bool = False):
        self.state: torch.Tensor | None = None
        self.conv: torch.Tensor | None = None
        self.prefix: PrefixCheckpoint | None = None
        self.pending: torch.Tensor | None = None
        self.value_dim = 0
        self.fixed = fixed

    def _static(self) -> None:
        if self.fixed:  # CUDA graphs of compiled steps keep these addresses (re-recorded when a turn replaces one)
            for t in (self.state, self.conv) + ((self.prefix.recurrent, self.prefix.conv) if self.prefix else ()):
                if t is not None:
                    torch._dynamo.mark_static_address(t, guard=False)

    def make_fixed(self, key_dim: int) -> None:
        """Switches to the fixed layout (adds P_tail's columns if missing)."""
        if not self.fixed:
            self.fixed = True
            self.add_transition_columns(key_dim)

    def add_transition_columns(self, key_dim: int) -> None:
        """Fixed layout: gives a state without P_tail's columns (nothing pending) the columns of P_tail = I.

        A fixed layer's first forward runs its rows without them (`gdn_rows_forward`): nothing is pending before
        a conversation's first prefill, so a map carried through its rows would never be read (no plan: Full,
        Hard, a prompt without images) or would be restarted at a new plan's boundary (Raincheck), and carrying
        it doubles the columns the kernel computes over the whole prompt. The columns are added after it."""
        if self.state is not None and self.carry == 0:
            s = self.state
            eye = torch.eye(key_dim, dtype=s.dtype, device=s.device).expand(*s.shape[:2], key_dim, key_dim)
            self.state = torch.cat([s, eye], dim=-1)
        self._static()

    @property
    def carry(self) -> int:
        """Columns of ``state`` that hold P_tail (0 when no plan is pending)."""
        return 0 if self.state is None else self.state.shape[-1] - self.value_dim

    @property
    def recurrent(self) -> torch.Tensor | None:
        """The recurrent state ``[1, H_v, K, V]`` (a view while P_tail rides along)."""
        return None if self.state is None else self.state[..., : self.value_dim]

    @property
    def transition(self) -> torch.Tensor | None:
        """P_tail ``[1, H_v, K, K]`` (a view), or None when no plan is pending."""
        return self.state[..., self.value_dim :] if self.carry else None

    def set_state(self, state: torch.Tensor, value_dim: int) -> None:
        self.state, self.value_dim = state, value_dim
        self._static()

    def checkpoint(self, plan_id: int, num_v_heads: int, key_dim: int, value_dim: int, conv_shape, device, dtype):
        """Copies the live state as the boundary checkpoint of plan `plan_id` and starts P_tail = I."""
        if self.state is None:  # nothing before the boundary yet (cannot happen for a real prompt)
            self.set_state(torch.zeros(1, num_v_heads, key_dim, value_dim, dtype=torch.float32, device=device), value_dim)
            self.conv = torch.zeros(conv_shape, dtype=dtype, device=device)
        recurrent = self.recurrent.contiguous()
        self.prefix = PrefixCheckpoint(plan_id=plan_id, recurrent=recurrent.clone(), conv=self.conv.clone())
        eye = torch.eye(key_dim, dtype=torch.float32, device=recurrent.device).expand(1, num_v_heads, key_dim, key_dim)
        self.state = torch.cat([recurrent, eye], dim=-1)
        self._static()

    def start_tail(self, plan_id: int, recurrent: torch.Tensor, conv: torch.Tensor, state: torch.Tensor,
                   value_dim: int) -> None:
        """`checkpoint` with its tensors built by the caller (a batch's rows build theirs together): `recurrent`
        ``[1, H_v, K, V]`` and `conv` ``[1, C, kernel]`` become plan `plan_id`'s boundary checkpoint, `state`
        ``[1, H_v, K, V + K]`` (``[recurrent | I]``) the live state; three distinct tensors, none written in place
        afterwards (updates build new ones)."""
        if state.shape[-1] != value_dim + state.shape[-2] or recurrent.shape[-1] != value_dim:
            raise ValueError("start_tail: state must be [recurrent | I] ([1, H_v, K, V + K]) and recurrent "
                             f"[1, H_v, K, V] with V = value_dim = {value_dim}")
        self.prefix = PrefixCheckpoint(plan_id=plan_id, recurrent=recurrent, conv=conv)
        self.set_state(state, value_dim)

    def join(self, new_prefix: torch.Tensor) -> None:
        """S_live += P_tail (S_prefix_new - S_prefix_old); then S_prefix = S_prefix_new."""
        prefix = self.prefix
        # a new tensor, never in place: `snapshot` keeps the old one for a rollback. One product-and-add over the
        # heads and one concatenation with P_tail (eager steps are host-bound on a GPU: fewer operators per layer)
        transition = self.transition
        key_dim = transition.shape[-1]
        recurrent = torch.baddbmm(
            self.recurrent.reshape(-1, key_dim, self.value_dim),
            transition.reshape(-1, key_dim, key_dim),
            (new_prefix - prefix.recurrent).reshape(-1, key_dim, self.value_dim),
        )
        self.state = torch.cat([recurrent.view(*self.state.shape[:-1], self.value_dim), transition], dim=-1)
        prefix.recurrent = new_prefix
        self._static()

    def release(self) -> None:
        """Drops the checkpoint and P_tail (the plan has nothing pending)."""
        self.prefix = None
        if self.carry and not self.fixed:
            self.state = self.state[..., : self.value_dim].contiguous()

    def persist(self, into) -> None:
        """Rebinds the state, the conv window and the prefix checkpoint to ``into(field, tensor)``: the same values
        in persistent buffers (compiled static steps; see `DeferredPrefillCache.persist_gdn_states`)."""
        if self.state is not None:
            self.state = into("state", self.state)
        if self.conv is not None:
            self.conv = into("conv", self.conv)
        if self.prefix is not None:
            self.prefix.recurrent = into("prefix.recurrent", self.prefix.recurrent)
            self.prefix.conv = into("prefix.conv", self.prefix.conv)

    def snapshot(self) -> tuple:
        """References to everything a forward may replace (updates build new tensors, never write in place)."""
        prefix = self.prefix
        fields = None if prefix is None else (prefix.recurrent, prefix.conv)
        return self.state, self.value_dim, self.conv, prefix, fields

    def restore(self, snapshot: tuple) -> None:
        """Undoes the updates of a forward that failed half-way (see `snapshot`)."""
        self.state, self.value_dim, self.conv, self.prefix, fields = snapshot
        if self.prefix is not None:
            self.prefix.recurrent, self.prefix.conv = fields

    def nbytes(self) -> int:
        tensors = [self.state, self.conv, self.pending]
        if self.prefix is not None:
            tensors += [self.prefix.recurrent, self.prefix.conv]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
