"""Shared pytest fixtures: tiny random Qwen3-VL and Qwen2.5-VL checkpoints built once per session (CPU, no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

# Importing the testing package lets AutoProcessor build Qwen3-VL / Qwen2.5-VL processors without torchvision.
from hf_raincheck.testing import (
    build_tiny_qwen2_5_vl,
    build_tiny_qwen3_5,
    build_tiny_qwen3_vl,
    load_tiny_qwen2_5_vl,
    load_tiny_qwen3_vl,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(int(os.environ.get("HF_RAINCHECK_TEST_THREADS", "2")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not (os.getenv("TRITON_INTERPRET") == "1" and item.get_closest_marker("triton")):
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the Triton kernel tests run: CUDA, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    from hf_raincheck.triton_support import interpreted, triton_importable

    if not triton_importable():
        pytest.skip("needs Triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if interpreted():
        return torch.device("cpu")
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")


@pytest.fixture(scope="session")
def tiny_vl_path(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen3-VL checkpoint (seed 0), built once per test session."""
    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny_qwen3_vl") / "seed0", seed=0)


@pytest.fixture(scope="session")
def tiny_vl(tiny_vl_path):
    """``(model, processor)`` loaded from :func:`tiny_vl_path` through the Auto classes; shared by the session.

    Don't patch or modify this model in a test; use ``fresh_tiny_vl`` for that.
    """
    return load_tiny_qwen3_vl(tiny_vl_path)


@pytest.fixture
def fresh_dynamo():
    """Dynamo reset (and its counters cleared) before and after the test: each compiled test compiles afresh (the
    tests' different capacities would otherwise add up past dynamo's recompile limit) and counts its own graphs.
    Modules of compiled tests use it for every test: ``pytestmark = pytest.mark.usefixtures("fresh_dynamo")``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fresh_tiny_vl(tiny_vl_path):
    """A freshly loaded ``(model, processor)`` for tests that patch or modify the model."""
    return load_tiny_qwen3_vl(tiny_vl_path)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_path(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen2.5-VL checkpoint (seed 0), built once per test session."""
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_qwen2_5_vl") / "seed0", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl(tiny_qwen2_5_vl_path):
    """``(model, processor)`` of :func:`tiny_qwen2_5_vl_path` through the Auto classes; shared by the session.

    Don't patch or modify this model in a test; load your own with ``load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)``.
    """
    return load_tiny_qwen2_5_vl(tiny_qwen2_5_vl_path)


@pytest.fixture(scope="session")
def tiny_qwen3_5_path(tmp_path_factory) -> str:
    """Directory of a tiny random Qwen3.5 checkpoint (seed 0, GDN + full attention), built once per test session."""
    return build_tiny_qwen3_5(tmp_path_factory.mktemp("tiny_qwen3_5") / "seed0", seed=0)
