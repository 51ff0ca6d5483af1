"""Shared by the demo tests: importing `examples/app.py` as a module, and writing uploads / videos."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
APP_PATH = ROOT / "examples" / "app.py"


def import_app():
    """`examples/app.py` as the module ``raincheck_demo_app`` (imported once)."""
    name = "raincheck_demo_app"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, APP_PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def write_video(path, frames: np.ndarray, fps: int = 8) -> str:
    """An H.264 / MPEG-4 file of ``frames`` (T, H, W, 3) uint8 with PyAV."""
    import av

    path = os.fspath(path)
    with av.open(path, mode="w") as container:
        codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for array in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(array), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
