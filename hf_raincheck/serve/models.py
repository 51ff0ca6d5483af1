"""`RaincheckModelManager`: transformers' serving `ModelManager`, loading the shipped GridQA checkpoint by its alias
(or serving a model already in memory) and enabling Raincheck on every model it loads."""

from __future__ import annotations

from transformers.cli.serving.model_manager import ModelManager

from ..generation import enable_raincheck

#: the model name that serves the package's tiny GridQA Qwen3-VL (`hf_raincheck.gridqa.load_default`) on the CPU
DEFAULT_MODEL = "hf-raincheck/gridqa-qwen3-vl"


class RaincheckModelManager(ModelManager):
    """Loads ``force_model`` (the one model of the server) like `transformers serve`, then `enable_raincheck`.

    ``DEFAULT_MODEL`` is loaded with `hf_raincheck.gridqa.load_default` (fp32 on the CPU unless ``device`` /
    ``dtype`` say otherwise); ``preloaded=(model, processor)`` serves that model object under the name
    ``force_model`` (nothing is loaded; ``device`` / ``dtype`` do not apply); any other name goes through
    transformers' own loading (Hub id or local path, ``--device`` / ``--dtype``). A model without a Raincheck
    adapter is refused when the server starts.
    """

    def __init__(self, force_model: str, preloaded: tuple | None = None, **kwargs):
        self._default_pair = None
        if preloaded is not None and (not isinstance(preloaded, tuple) or len(preloaded) != 2
                                      or any(x is None for x in preloaded)):
            raise ValueError("RaincheckModelManager: preloaded must be a (model, processor) pair")
        self._preloaded = preloaded
        super().__init__(force_model=force_model, **kwargs)

    def _is_preloaded(self, model_id_and_revision: str) -> bool:
        return self._preloaded is not None and model_id_and_revision.split("@", 1)[0] == self.force_model

    def _gridqa(self):
        if self._default_pair is None:
            import torch

            from ..gridqa import load_default

            device = "cpu" if self.device in ("auto", None) else self.device
            dtype = self.dtype if isinstance(self.dtype, torch.dtype) else None
            self._default_pair = load_default(device=device, dtype=dtype)
        return self._default_pair

    @staticmethod
    def _is_default(model_id_and_revision: str) -> bool:
        return model_id_and_revision.split("@", 1)[0] == DEFAULT_MODEL

    def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None):
        if self._is_preloaded(model_id_and_revision):
            return self._preloaded[1]
        if self._is_default(model_id_and_revision):
            return self._gridqa()[1]
        return super()._load_processor(model_id_and_revision, gguf_file=gguf_file)

    def _load_model(self, model_id_and_revision: str, tqdm_class=None, progress_callback=None,
                    gguf_file: str | None = None):
        if self._is_preloaded(model_id_and_revision):
            model = self._preloaded[0]
        elif self._is_default(model_id_and_revision):
            model = self._gridqa()[0]
        else:
            model = super()._load_model(model_id_and_revision, tqdm_class=tqdm_class,
                                        progress_callback=progress_callback, gguf_file=gguf_file)
        return enable_raincheck(model)
