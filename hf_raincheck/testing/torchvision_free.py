"""Building Qwen-VL processors without torchvision (tests and ``--tiny-random`` only).

transformers 5.23 cannot build a ``Qwen3VLProcessor`` or a ``Qwen2_5_VLProcessor`` at all without torchvision: their
video processors are torchvision-only, and ``ProcessorMixin`` can't even resolve the video-processor base class, not
even for image-only use (huggingface/transformers#48558). :func:`enable_torchvision_free_processing` fills that gap
*only when torchvision is missing*: it exposes ``VideoProcessorMixin`` where ``ProcessorMixin`` looks for it and
registers, per family, a subclass of the real video processor (``Qwen3VLVideoProcessor`` for ``qwen3_vl``,
``Qwen2VLVideoProcessor`` for ``qwen2_5_vl``) whose three torchvision calls (resize to a given size, normalize,
grayscale->RGB) are done with plain torch. Everything else (frame sampling, the size rules, patchify, metadata) is
the upstream code. With torchvision installed it does nothing and the stock classes load.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types

import torch

__all__ = ["enable_torchvision_free_processing", "qwen2_vl_video_processor_class", "qwen3_vl_video_processor_class"]


def _torchvision_available() -> bool:
    from transformers.utils import is_torchvision_available

    return bool(is_torchvision_available())


def _torch_resize(x: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """``torchvision.transforms.v2.functional.resize(x, size, antialias=True)`` for (..., C, H, W) tensors."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    lead = x.shape[:-3]
    flat = x.reshape(-1, *x.shape[-3:])
    was_uint8 = flat.dtype == torch.uint8
    y = flat.float() if was_uint8 or not flat.is_floating_point() else flat
    kwargs = {} if mode.startswith("nearest") else {"align_corners": False, "antialias": True}
    y = torch.nn.functional.interpolate(y, size=size, mode=mode, **kwargs)
    if was_uint8:
        y = y.round_().clamp_(0, 255).to(torch.uint8)
    return y.reshape(*lead, *y.shape[-3:])


@functools.cache
def _torch_video_ops():
    """Mixin over ``BaseVideoProcessor`` with its torchvision calls done in plain torch.

    The family classes' own ``resize`` computes the target size (their ``smart_resize`` rules) and then calls
    ``super().resize(image=..., size=SizeDict(height=, width=), resample=)``: that call lands here.
    """
    from transformers.image_utils import ChannelDimension, PILImageResampling
    from transformers.video_processing_utils import BaseVideoProcessor
    from transformers.video_utils import convert_to_rgb

    modes = {
        PILImageResampling.NEAREST: "nearest-exact",
        PILImageResampling.BILINEAR: "bilinear",
        PILImageResampling.BICUBIC: "bicubic",
    }

    class TorchVideoOps(BaseVideoProcessor):
        def convert_to_rgb(self, video, input_data_format=None):
            if video.shape[-3] == 1:
                video = video.expand(*video.shape[:-3], 3, *video.shape[-2:])
            return convert_to_rgb(video, input_data_format=ChannelDimension.FIRST)

        def normalize(self, image, mean, std, inplace=False, **kwargs):
            mean = torch.as_tensor(mean, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            std = torch.as_tensor(std, dtype=image.dtype, device=image.device).view(-1, 1, 1)
            if inplace:
                return image.sub_(mean).div_(std)
            return (image - mean) / std

        def resize(self, image, size, resample=None, antialias=True, **kwargs):
            if not (size.height and size.width):
                raise ValueError(f"the torch-only video resize takes an explicit height and width, got {size}")
            mode = modes.get(resample, "bilinear") if resample is not None else "bilinear"
            return _torch_resize(image, (int(size.height), int(size.width)), mode)

    return TorchVideoOps


def _import_annotation_only_torchvision(module_name: str):
    """Imports a transformers module whose only use of torchvision is ``import torchvision.transforms.v2.functional
    as tvF`` for string annotations (``video_processing_qwen2_vl``), with a stub torchvision that exists only
    during the import. The module is not left in ``sys.modules`` (stock imports keep failing as before)."""
    import transformers  # noqa: F401  (transformers' own torchvision probe must run before the stub exists)
    import transformers.video_processing_utils  # noqa: F401

    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2", "torchvision.transforms.v2.functional"]
    added = [name for name in names if name not in sys.modules]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    for parent, child in zip(names, names[1:]):
        if parent in added or child in added:
            setattr(sys.modules[parent], child.rsplit(".", 1)[1], sys.modules[child])
    had_module = module_name in sys.modules
    try:
        module = importlib.import_module(module_name)
    finally:
        for name in added:
            sys.modules.pop(name, None)
        if not had_module:
            sys.modules.pop(module_name, None)
    return module


@functools.cache
def _torch_only_qwen3_vl_video_processor():
    # Import the submodule itself: attribute access on the lazy ``qwen3_vl`` package yields a torchvision dummy.
    upstream = importlib.import_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")

    class Qwen3VLVideoProcessor(upstream.Qwen3VLVideoProcessor, _torch_video_ops()):
        """``transformers``' Qwen3VLVideoProcessor with resize/normalize/grayscale done without torchvision."""

    # Keep the upstream identity for repr/save: the JSON must say "Qwen3VLVideoProcessor".
    Qwen3VLVideoProcessor.__qualname__ = "Qwen3VLVideoProcessor"
    return Qwen3VLVideoProcessor


@functools.cache
def _torch_only_qwen2_vl_video_processor():
    upstream = _import_annotation_only_torchvision("transformers.models.qwen2_vl.video_processing_qwen2_vl")

    class Qwen2VLVideoProcessor(upstream.Qwen2VLVideoProcessor, _torch_video_ops()):
        """``transformers``' Qwen2VLVideoProcessor (Qwen2-VL, Qwen2.5-VL) with resize/normalize/grayscale done
        without torchvision."""

    Qwen2VLVideoProcessor.__qualname__ = "Qwen2VLVideoProcessor"
    return Qwen2VLVideoProcessor


_torchvision_free_enabled = False


def enable_torchvision_free_processing() -> bool:
    """Let ``AutoProcessor.from_pretrained`` build Qwen3-VL and Qwen2.5-VL processors when torchvision is missing.

    Idempotent; a no-op (returns False) when torchvision is available. Returns True when the shim is active.
    Process-global changes, all only reachable where the stock code would raise:

    * ``transformers.VideoProcessorMixin`` is set (only exported with torchvision), so ``ProcessorMixin`` can check
      the class of the video processor;
    * ``AutoVideoProcessor`` gets the torch-only ``Qwen3VLVideoProcessor`` for ``Qwen3VLConfig`` and the torch-only
      ``Qwen2VLVideoProcessor`` for ``Qwen2_5_VLConfig``.
    """
    global _torchvision_free_enabled
    if _torchvision_free_enabled:
        return True
    if _torchvision_available():
        return False

    import transformers
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig, processing_utils
    from transformers.models.auto.video_processing_auto import AutoVideoProcessor
    from transformers.video_processing_utils import VideoProcessorMixin

    # ``processing_utils`` resolves class names on its own handle of the ``transformers`` module (a re-executed
    # lazy module, not always ``sys.modules["transformers"]``): expose the mixin on every handle.
    for module in {id(m): m for m in (processing_utils.transformers_module, transformers, sys.modules["transformers"])}.values():
        if "VideoProcessorMixin" not in module.__dict__:
            setattr(module, "VideoProcessorMixin", VideoProcessorMixin)
    AutoVideoProcessor.register(
        Qwen3VLConfig, video_processor_classes={"torchvision": _torch_only_qwen3_vl_video_processor()}, exist_ok=True
    )
    AutoVideoProcessor.register(
        Qwen2_5_VLConfig, video_processor_classes={"torchvision": _torch_only_qwen2_vl_video_processor()}, exist_ok=True
    )
    _torchvision_free_enabled = True
    return True


def qwen3_vl_video_processor_class():
    """``Qwen3VLVideoProcessor``: the torch-only subclass when torchvision is missing, else the stock class."""
    if enable_torchvision_free_processing():
        return _torch_only_qwen3_vl_video_processor()
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor


def qwen2_vl_video_processor_class():
    """``Qwen2VLVideoProcessor`` (Qwen2.5-VL's): the torch-only subclass when torchvision is missing, else stock."""
    if enable_torchvision_free_processing():
        return _torch_only_qwen2_vl_video_processor()
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor
