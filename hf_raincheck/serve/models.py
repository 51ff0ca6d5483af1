"""`RaincheckModelManager`: the one model of the server, in this process, with Raincheck enabled: the shipped GridQA
checkpoint by its alias, a model object already in memory, or any other name loaded as ``transformers serve``
loads it (`transformers_coupling.serving_load_model`)."""

from __future__ import annotations

from ..generation import enable_raincheck
from ..transformers_coupling import serving_load_model

#: the model name that serves the package's tiny GridQA Qwen3-VL (`hf_raincheck.gridqa.load_default`) on the CPU
DEFAULT_MODEL = "hf-raincheck/gridqa-qwen3-vl"


def _torch_dtype(dtype):
    """The torch dtype a ``dtype`` option names (None: ``"auto"`` or None, the checkpoint's own)."""
    import torch

    if dtype in ("auto", None):
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype must be 'auto' or a torch dtype name (bfloat16, float16, float32, ...), got "
                         f"{dtype!r}")
    return value


class RaincheckModelManager:
    """Holds ``force_model``, the server's one model, and its processor; loads it when the server starts.

    ``DEFAULT_MODEL`` is loaded with `hf_raincheck.gridqa.load_default` (fp32 on the CPU unless ``device`` /
    ``dtype`` say otherwise); ``preloaded=(model, processor)`` serves that model object under the name
    ``force_model`` (nothing is loaded; ``device`` / ``dtype`` do not apply); any other name goes through
    transformers' own loading (Hub id, ``id@revision`` or local path, with ``device`` / ``dtype`` /
    ``attn_implementation`` / ``trust_remote_code``). Every model gets `enable_raincheck`; a model without a
    Raincheck adapter is refused when the server starts.

    The model stays in this process for the server's lifetime: the conversation caches between requests live with
    it (``transformers serve``'s own manager, from transformers 5.25, runs models in engine processes and unloads
    idle ones). It answers what ``transformers serve``'s app asks of a model manager (``shutdown``, ``is_dead``,
    ``list_models``).
    """

    def __init__(self, force_model: str, preloaded: tuple | None = None, device: str = "auto",
                 dtype: str | None = "auto", attn_implementation: str | None = None, trust_remote_code: bool = False):
        if preloaded is not None and (not isinstance(preloaded, tuple) or len(preloaded) != 2
                                      or any(x is None for x in preloaded)):
            raise ValueError("RaincheckModelManager: preloaded must be a (model, processor) pair")
        if not isinstance(device, str) or not device:
            raise ValueError(f"RaincheckModelManager: device must be a device_map string (auto, cpu, cuda, 0, ...), "
                             f"got {device!r}")
        self.force_model = force_model
        self.device, self.dtype = device, dtype
        self.attn_implementation, self.trust_remote_code = attn_implementation, trust_remote_code
        if preloaded is None:
            _torch_dtype(dtype)  # a bad dtype is refused before anything loads
        model, processor = preloaded if preloaded is not None else self._load()
        self._pair = (enable_raincheck(model), processor)

    def load_model_and_processor(self) -> tuple:
        """``(model, processor)`` of the served model (loaded when the manager was made)."""
        return self._pair

    def _load(self) -> tuple:
        if self.force_model.split("@", 1)[0] == DEFAULT_MODEL:
            from ..gridqa import load_default

            device = "cpu" if self.device == "auto" else self.device
            return load_default(device=device, dtype=_torch_dtype(self.dtype))
        return serving_load_model(self.force_model, device=self.device, dtype=self.dtype,
                                  attn_implementation=self.attn_implementation,
                                  trust_remote_code=self.trust_remote_code)

    # what transformers' serving app calls on its model manager
    def shutdown(self) -> None:
        """Nothing to stop: the model lives in this process (the server's scheduler and pool are closed by
        `RaincheckServer.close`)."""

    @property
    def is_dead(self) -> bool:
        return False

    def list_models(self) -> list[dict]:
        return [{"id": self.force_model, "object": "model", "created": 0, "owned_by": "hf_raincheck"}]
