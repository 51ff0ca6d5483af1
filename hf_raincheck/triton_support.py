"""When the package may run its Triton kernels.

The kernels (`hf_raincheck.attention.softmax_triton`, `hf_raincheck.attention.split_keys_triton`,
`hf_raincheck.gdn_state.join_triton`, `hf_raincheck.gdn_state.chunk_triton`,
`hf_raincheck.pruning.greedy_triton`, `hf_raincheck.pruning.attention_triton`) run on CUDA tensors when Triton
imports (it ships with CUDA builds of torch). ``HF_RAINCHECK_TRITON=0``, the package's one environment switch, turns
them off (the torch paths run instead: the same results; the attention's kernels and the GDN join read it at import,
the pruning kernels at each call). For tests
on a machine without a GPU, Triton's interpreter (``TRITON_INTERPRET=1``) runs them on CPU tensors too.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # ImportError, or CUDA/driver errors at import
        return False
    return True


def interpreted() -> bool:
    """Triton's interpreter is on (kernels run on CPU tensors, slowly: tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_enabled(device: torch.device | str) -> bool:
    """Whether the Triton kernels run for tensors on `device`."""
    if os.environ.get("HF_RAINCHECK_TRITON", "1") == "0" or not triton_importable():
        return False
    device = torch.device(device)
    return device.type == "cuda" or (device.type == "cpu" and interpreted())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA `device` (1 elsewhere: Triton's interpreter runs programs in turn)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
