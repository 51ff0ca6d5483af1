"""Gated DeltaNet state mapping (docs/design.md rule 3): prefix checkpoints, online P_tail, join.

- `state.py`: per-layer live state and the pending plan's `PrefixCheckpoint`.
- `layer.py`: one GDN layer over the rows of a Raincheck forward (one conversation, eager).
- `shared_layer.py`, `batch_rows.py`: the same over a forward shared by a batch's rows (rows of one kind together).
- `graph_layer.py`: the same inside compiled static steps (one conversation, or a static batch).
- `kernels.py`: transformers' torch kernels or fla-core's, one interface (`gated_delta`; `gated_delta_` in place).
- `ops.py`: `advance` / `advance_` / `advance_split`, the calls GDN layers make (eager, or through the custom ops
  of compiled steps).
- `graphed.py`: eager prefills' fla-core calls replayed from a CUDA graph per bucket of rows.
- `naive.py`: plain per-token reference of all of it (tests compare against it).
"""

from .kernels import BACKENDS, fla_available, gated_delta, resolve
from .ops import advance
from .graph_layer import GDNBatchGraphStep, GDNGraphStep, gdn_batch_forward_graph, gdn_rows_forward_graph
from .layer import GDNGlue, GDNStep, gdn_rows_forward
from .state import GDNLayerState, PrefixCheckpoint

__all__ = [
    "BACKENDS",
    "GDNBatchGraphStep",
    "GDNGlue",
    "GDNGraphStep",
    "GDNLayerState",
    "GDNStep",
    "PrefixCheckpoint",
    "advance",
    "fla_available",
    "gated_delta",
    "gdn_batch_forward_graph",
    "gdn_rows_forward",
    "gdn_rows_forward_graph",
    "resolve",
]
