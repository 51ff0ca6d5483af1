"""Attention backends for Raincheck's forwards (`naive` reference, `sdpa`) and the dispatcher."""

from .dispatch import BACKENDS, install, resolve_backend, uninstall
from .naive import naive_attention
from .sdpa import sdpa_attention

__all__ = ["BACKENDS", "install", "uninstall", "resolve_backend", "naive_attention", "sdpa_attention"]
