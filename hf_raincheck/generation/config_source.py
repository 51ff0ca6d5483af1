"""Which `RaincheckConfig` a `generate` call runs with: the ``raincheck_config=`` argument, else the defaults
transformers users set on generation configs.

Order (first found wins):

1. ``generate(..., raincheck_config=cfg)``; an explicit ``raincheck_config=None`` asks for plain generation
   (unless the cache given is a `DeferredPrefillCache` or a `BatchedDeferredPrefillCache`, which only
   Raincheck fills: then its last config);
2. ``generate(..., generation_config=GenerationConfig(raincheck_config=cfg))``;
3. the config of a `DeferredPrefillCache` passed as the cache (the conversation's last call; for a
   `BatchedDeferredPrefillCache`, its first row that has one);
4. ``model.generation_config.raincheck_config`` (saved in generation_config.json by ``save_pretrained``, in
   `RaincheckConfig.to_dict` form, and back with ``from_pretrained``).

Generation-config values may be a `RaincheckConfig` or its dict; None there means "not set".
"""

from __future__ import annotations

from .. import transformers_coupling as hf
from ..cache import DeferredPrefillCache
from ..cache.batched import BatchedDeferredPrefillCache
from ..config import RaincheckConfig

ATTR = "raincheck_config"


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET = _Unset()


def from_generation_config(generation_config, where: str) -> RaincheckConfig | None:
    """The `RaincheckConfig` a generation config holds (None: none), validated; `where` names it in errors."""
    value = getattr(generation_config, ATTR, None)
    if value is None or isinstance(value, RaincheckConfig):
        return value
    if isinstance(value, dict):
        try:
            return RaincheckConfig.from_dict(value)
        except ValueError as error:
            raise ValueError(f"{where}.raincheck_config: {error}") from error
    raise ValueError(
        f"{where}.raincheck_config must be a RaincheckConfig or its dict (RaincheckConfig.to_dict()), "
        f"got {type(value).__name__}"
    )


def resolve(model, explicit, generation_config, past) -> RaincheckConfig | None:
    """The config of a `generate` call (see the module docstring); None: plain transformers generation."""
    if explicit is not UNSET and explicit is not None:
        if not isinstance(explicit, RaincheckConfig):
            raise ValueError(f"generate: raincheck_config must be a RaincheckConfig, got {type(explicit).__name__}")
        return explicit
    deferred_past = past if isinstance(past, (DeferredPrefillCache, BatchedDeferredPrefillCache)) else None
    config = None
    if explicit is UNSET and generation_config is not None:
        config = from_generation_config(generation_config, "generate: generation_config")
    if config is None and isinstance(deferred_past, DeferredPrefillCache):
        config = deferred_past.config
    if config is None and isinstance(deferred_past, BatchedDeferredPrefillCache):
        config = next((r.config for r in deferred_past.rows if r is not None and r.config is not None), None)
    if config is None and explicit is UNSET:
        config = from_generation_config(getattr(model, "generation_config", None), "model.generation_config")
    if config is None and deferred_past is not None:
        raise ValueError(
            f"generate: {hf.CACHE_ARGUMENT} is a {type(deferred_past).__name__} that no Raincheck call has used yet; "
            "pass raincheck_config=RaincheckConfig(...)"
        )
    return config
