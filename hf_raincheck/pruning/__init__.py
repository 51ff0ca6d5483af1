"""Visual-token selectors: which placeholder tokens the first prefill keeps.

Registered: ``mmtok`` (default), ``hiprune``, ``divprune``, ``visionzip`` (VisionZip-Select), ``uniform``,
``random``. See each module's docstring for the method, its options and their defaults.
"""

from .base import (
    OptionSpec,
    SelectionContext,
    available_selectors,
    get_selector,
    register_selector,
    resolve_options,
    select_kept,
    selector_requirements,
)
from . import divprune as _divprune  # noqa: F401  (registers "divprune")
from . import hiprune as _hiprune  # noqa: F401  (registers "hiprune")
from . import mmtok as _mmtok  # noqa: F401  (registers "mmtok")
from . import random as _random  # noqa: F401  (registers "random")
from . import uniform as _uniform  # noqa: F401  (registers "uniform")
from . import visionzip as _visionzip  # noqa: F401  (registers "visionzip")

__all__ = [
    "OptionSpec",
    "SelectionContext",
    "available_selectors",
    "get_selector",
    "register_selector",
    "resolve_options",
    "select_kept",
    "selector_requirements",
]
