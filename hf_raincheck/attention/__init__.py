"""Attention backends for Raincheck's forwards (`naive` reference, `sdpa`, `flash`) and the dispatcher."""

from .dispatch import BACKENDS, install, resolve_backend, uninstall
from .flash import flash_attention
from .naive import naive_attention, naive_flash_kernel, naive_masked_softmax
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "install", "uninstall", "resolve_backend", "naive_attention", "naive_flash_kernel", "naive_masked_softmax",
           "sdpa_attention", "flash_attention"]
