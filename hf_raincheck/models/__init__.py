"""Per-family adapters. `get_adapter(model)` picks one or raises a clear error."""

from __future__ import annotations

from .base import ModelAdapter, VisionFeatures
from .qwen2_5_vl import Qwen2_5_VLAdapter
from .qwen3_5 import Qwen3_5Adapter
from .qwen3_vl import Qwen3VLAdapter

_ADAPTERS = {"qwen3_vl": Qwen3VLAdapter, "qwen2_5_vl": Qwen2_5_VLAdapter, "qwen3_5": Qwen3_5Adapter}


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(model) -> ModelAdapter:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    adapter = _ADAPTERS.get(model_type)
    if adapter is None:
        raise ValueError(
            f"enable_raincheck: model type {model_type!r} ({type(model).__name__}) has no Raincheck adapter; "
            f"supported: {supported_model_types()}"
        )
    if not hasattr(model, "lm_head") or not hasattr(model, "model"):
        raise ValueError(
            f"enable_raincheck: pass the {model_type!r} model with its LM head (the ...ForConditionalGeneration "
            "model, e.g. from AutoModelForImageTextToText.from_pretrained), not its inner model (model.model): "
            f"got {type(model).__name__}"
        )
    return adapter(model)


__all__ = ["ModelAdapter", "VisionFeatures", "get_adapter", "supported_model_types"]
