"""Two GPUs (run on the H200 x2): a model split by a device_map, and one placed whole on the second GPU, give the
one-GPU results, with the greedy selectors' CUDA graphs captured on the right device.

    python -m pytest -q -s tests/test_multi_gpu.py
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))

from helpers import generate, new_tokens  # noqa: E402
from latency import QUICK_WORKLOADS  # noqa: E402
from shapes import build_model, dispatch  # noqa: E402

from hf_raincheck import RaincheckConfig, enable_raincheck  # noqa: E402
from hf_raincheck.conversation import output_cache  # noqa: E402
from hf_raincheck.pruning import greedy  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def _on(inputs, device):
    return {k: v.to(device) for k, v in inputs.items()}


@pytest.mark.parametrize("shape", ["tiny", "tiny-qwen3.5"])
@pytest.mark.parametrize("pruning", ["mmtok", "divprune"])
def test_split_and_second_gpu_equal_one_gpu(shape, pruning):
    inputs = QUICK_WORKLOADS["image4096"].inputs("cuda:0", torch.float32)  # 144 tokens: a graphed greedy loop
    cfg = RaincheckConfig(retention=0.3, chunk_size=7, guard_tokens=4, pruning=pruning, completion="blocking")
    greedy._CACHE.clear()
    one = enable_raincheck(build_model(shape, "cuda:0", torch.float32))
    second = enable_raincheck(build_model(shape, "cuda:0", torch.float32).to("cuda:1"))
    split = enable_raincheck(dispatch(build_model(shape, "cuda:0", torch.float32), ["cuda:0", "cuda:1"]))
    assert torch.cuda.current_device() == 0
    ref = generate(one, inputs, 12, cfg)  # captures the loop's graph on cuda:0 first
    for model, device in ((second, "cuda:1"), (split, "cuda:0")):
        out = generate(model, _on(inputs, device), 12, cfg)
        assert new_tokens(out, inputs) == new_tokens(ref, inputs)
        torch.testing.assert_close(torch.stack(out.logits).cpu(), torch.stack(ref.logits).cpu(), atol=1e-4, rtol=1e-4)
        assert output_cache(out).stats == output_cache(ref).stats
    assert {key[1] for key in greedy._CACHE} == {torch.device("cuda", 0), torch.device("cuda", 1)}
