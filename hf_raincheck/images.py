"""Images as the processors expect them: 8-bit channels, high-bit-depth images scaled rather than clipped.

Pillow converts a 16-bit (``"I;16"``), 32-bit integer (``"I"``) or float (``"F"``) image to RGB by clipping every
value to 0..255, so a typical 16-bit photo or a float image in 0..1 turns all white (or all black) and the model
describes an empty picture. `eight_bit` scales such images to 8 bits first:

- ``"I;16"`` (and ``"I;16L"``, ``"I;16B"``, ``"I;16N"``): by the 16-bit depth, ``round(v * 255 / 65535)``;
- ``"I"``: values already in 0..255 are kept; values in 0..65535 (how Pillow opens 16-bit PNGs) are scaled by the
  16-bit depth; anything else (negative values, more than 16 bits) by the image's actual range, min -> 0, max -> 255;
- ``"F"``: values in 0..1 are scaled by 255; values in 0..255 are kept (rounded); anything else by the actual range.

A constant image outside those ranges becomes mid-grey. Non-finite values (NaN, inf) are refused. Every other
mode is returned unchanged (the processor's own RGB conversion handles palettes and alpha).
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["HIGH_BIT_DEPTH_MODES", "eight_bit", "open_image"]

#: Pillow modes whose values do not fit 8 bits: `eight_bit` rescales them.
HIGH_BIT_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")


def eight_bit(image, name: str = "image"):
    """`image` (a ``PIL.Image.Image``) with 8-bit values: a high-bit-depth image becomes an ``"L"`` image scaled as
    the module docstring says; other modes come back unchanged. `name` goes into the error messages."""
    from PIL import Image

    if image.mode not in HIGH_BIT_DEPTH_MODES:
        return image
    values = np.asarray(image)
    if values.size == 0:
        return Image.new("L", image.size)
    if image.mode.startswith("I;16"):
        scaled = values.astype(np.float64) * (255.0 / 65535.0)
    else:
        values = values.astype(np.float64)
        if not np.isfinite(values).all():
            raise ValueError(f"{name}: a {image.mode!r} image with non-finite values (NaN or inf) cannot be shown "
                             "to the model; replace them first")
        low, high = float(values.min()), float(values.max())
        if image.mode == "F" and low >= 0.0 and high <= 1.0:
            scaled = values * 255.0
        elif low >= 0.0 and high <= 255.0:
            scaled = values
        elif image.mode == "I" and low >= 0.0 and high <= 65535.0:
            scaled = values * (255.0 / 65535.0)
        elif high > low:
            scaled = (values - low) * (255.0 / (high - low))
        else:
            scaled = np.full_like(values, 128.0)
    return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), mode="L")


def open_image(path, name: str = "image"):
    """The image file at `path` as transformers' ``load_image`` gives it (decoded, EXIF orientation applied, RGB),
    except that a high-bit-depth image is scaled to 8 bits first (`eight_bit`). Raises ``ValueError`` naming `name`
    for a file that is not a readable image."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    path = os.fspath(path)
    try:
        with Image.open(path) as opened:
            opened.load()
            image = ImageOps.exif_transpose(opened)
            if image is opened:
                image = opened.copy()
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, SyntaxError) as error:
        raise ValueError(f"{name}: {path!r} cannot be read as an image ({type(error).__name__}: {error})") from None
    return eight_bit(image, name).convert("RGB")
