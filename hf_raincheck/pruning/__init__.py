"""Visual-token selectors: which placeholder tokens the first prefill keeps."""

from .base import SelectionContext, available_selectors, get_selector, register_selector, select_kept
from . import random as _random  # noqa: F401  (registers "random")
from . import uniform as _uniform  # noqa: F401  (registers "uniform")

__all__ = ["SelectionContext", "available_selectors", "get_selector", "register_selector", "select_kept"]
