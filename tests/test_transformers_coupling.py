"""`hf_raincheck.transformers_coupling` holds every private transformers name and every copied piece of transformers
code: the pin agrees with pyproject.toml, no other module reaches those names, and the copied pieces still
reassemble transformers' own forwards."""

from __future__ import annotations

import ast
import os
import re

import pytest
import torch

import hf_raincheck
from hf_raincheck import transformers_coupling as hf
from hf_raincheck.testing import load_tiny_qwen3_5

PACKAGE = os.path.dirname(hf_raincheck.__file__)
ROOT = os.path.dirname(PACKAGE)

# names that only transformers_coupling.py may reach (attributes, getattr/hasattr strings, imported names)
COUPLED_NAMES = {
    "_attn_implementation", "_attn_implementation_internal", "_fused_sdp_choice", "_compile_all_devices",
    "_hf_hook", "_old_forward", "_sanitize_parameters", "_preprocess_params", "eager_attention_forward",
    "apply_rotary_pos_emb_vision", "causal_conv1d_fn", "causal_conv1d_update", "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule", "get_vision_window_index", "AttentionInterface", "ALL_ATTENTION_FUNCTIONS",
    "CompileConfig", "_build_generation_config", "_build_generation_kwargs", "build_server", "ModelManager",
    "ModelLoader", "DirectStreamer", "_GenerationCancelled", "_StreamError",
}
# test scaffolding and training code, not on the inference path (listed in transformers_coupling's docstring)
EXEMPT = {
    os.path.join("testing", "torchvision_free.py"),
    os.path.join("gridqa", "batching.py"),
}


def _names_used(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.alias):
            used.add(node.name.rsplit(".", 1)[-1])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                used.add(node.args[1].value)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
            used.add("sys.modules[...]")
    return used


def test_only_the_coupling_module_reaches_transformers_internals():
    offenders = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, PACKAGE)
            if rel == "transformers_coupling.py" or rel in EXEMPT:
                continue
            with open(path) as f:
                used = _names_used(ast.parse(f.read()))
            hits = used & (COUPLED_NAMES | {"sys.modules[...]"})
            if hits:
                offenders[rel] = sorted(hits)
    assert offenders == {}


def test_the_scan_sees_what_it_looks_for():
    tree = ast.parse("import sys\nx = sys.modules[type(m).__module__].eager_attention_forward\n"
                     "getattr(c, '_attn_implementation')\nfrom transformers import AttentionInterface\n")
    assert {"sys.modules[...]", "eager_attention_forward", "_attn_implementation", "AttentionInterface"} <= _names_used(tree)


def test_pin_agrees_with_pyproject():
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    pins = re.findall(r'"transformers([<>=!~][^"]*)"', text)
    assert pins == [hf.SUPPORTED_TRANSFORMERS]


def test_space_requirements_pin_the_supported_versions():
    """examples/space/requirements.txt (a Space running the demo) pins transformers as the package does."""
    with open(os.path.join(ROOT, "examples", "space", "requirements.txt")) as f:
        pins = [line.strip()[len("transformers"):] for line in f if line.startswith("transformers")]
    assert pins == [hf.SUPPORTED_TRANSFORMERS]


def test_serving_pin_agrees_with_pyproject():
    """The serve extra's transformers[serving] takes the versions the package takes (the server follows each)."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        text = f.read()
    assert re.findall(r'"transformers\[serving\]([<>=!~][^"]*)"', text) == [hf.SUPPORTED_TRANSFORMERS]


def test_serving_generation_config_follows_the_installed_serving_code():
    """A chat request's settings become one GenerationConfig on every supported version (5.23 / 5.24 build it,
    5.25 builds generate's keyword arguments), on top of the model's generation config."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    from packaging.version import Version
    from transformers import GenerationConfig
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.utils import GenerationState

    assert hf.SERVING_ENGINE_PROCESS is (Version(hf.installed_transformers_version()).release >= (5, 25))
    handler = ChatCompletionHandler(model_manager=None, generation_state=GenerationState())
    model_config = GenerationConfig(eos_token_id=[7, 9], pad_token_id=0, top_k=5, max_new_tokens=16)
    body = {"messages": [], "temperature": 0, "max_tokens": 3, "stop": ["x"], "frequency_penalty": 0.5,
            "logit_bias": {"4": -1.0}}
    config = hf.serving_generation_config(handler, body, model_config)
    assert isinstance(config, GenerationConfig) and config is not model_config
    assert (config.max_new_tokens, config.do_sample, config.stop_strings) == (3, False, ["x"])
    assert config.repetition_penalty == 1.5 and config.sequence_bias == {(4,): -1.0}
    assert config.eos_token_id == [7, 9] and config.top_k == 5 and model_config.max_new_tokens == 16
    sampled = hf.serving_generation_config(handler, {"messages": [], "temperature": 0.7, "top_p": 0.9}, model_config)
    assert (sampled.temperature, sampled.top_p, sampled.max_new_tokens) == (0.7, 0.9, 1024)


def test_cache_argument_names():
    """The cache's keyword follows the installed transformers (5.24 renamed it)."""
    from packaging.version import Version

    renamed = Version(hf.installed_transformers_version()).release >= (5, 24)
    assert hf.CACHE_NAMES_CHANGED is renamed
    assert (hf.CACHE_ARGUMENT, hf.GDN_CACHE_ARGUMENT) == (("cache", "cache") if renamed
                                                          else ("past_key_values", "cache_params"))
    import inspect

    from transformers.generation.utils import GenerateDecoderOnlyOutput
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_vl.modeling_qwen3_vl import (Qwen3VLForConditionalGeneration,
                                                                Qwen3VLTextDecoderLayer)

    assert hf.CACHE_ARGUMENT in inspect.signature(Qwen3VLTextDecoderLayer.forward).parameters
    assert hf.CACHE_ARGUMENT in inspect.signature(Qwen3VLForConditionalGeneration.forward).parameters
    assert hf.GDN_CACHE_ARGUMENT in inspect.signature(Qwen3_5GatedDeltaNet.forward).parameters
    assert hf.CACHE_ARGUMENT in GenerateDecoderOnlyOutput.__dataclass_fields__


def test_pop_cache_argument():
    cache = object()
    kwargs = {hf.CACHE_ARGUMENT: cache, "x": 1}
    assert hf.given_cache(kwargs) is cache and hf.pop_cache_argument(kwargs, "generate") is cache
    assert kwargs == {"x": 1}
    assert hf.pop_cache_argument({}, "generate") is None
    if not hf.CACHE_NAMES_CHANGED:
        return
    with pytest.warns(FutureWarning, match="generate: `past_key_values` is deprecated"):
        assert hf.pop_cache_argument({"past_key_values": cache}, "generate") is cache
    assert hf.given_cache({"past_key_values": cache}) is cache
    assert hf.pop_cache_argument({"past_key_values": None, "cache": cache}, "generate") is cache
    with pytest.raises(ValueError, match="generate: cache and past_key_values are both set"):
        hf.pop_cache_argument({"past_key_values": cache, "cache": object()}, "generate")


def test_documented_coupling_points_exist():
    """Each function the module docstring lists is defined (the list is the upgrade checklist)."""
    for name in re.findall(r"(?<!`)`([a-z_]+)`(?!`)", hf.__doc__):
        if name in ("raincheck_config",) or hasattr(hf_raincheck, name):
            continue
        assert callable(getattr(hf, name, None)) or name.isupper(), name


def test_attention_lookup():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.qwen3_vl import modeling_qwen3_vl
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig

    module = modeling_qwen3_vl.Qwen3VLTextAttention(Qwen3VLTextConfig(hidden_size=32, num_attention_heads=2,
                                                                      num_key_value_heads=1, head_dim=16), 0)
    assert hf.attention_function(module, "eager") is modeling_qwen3_vl.eager_attention_forward
    assert hf.attention_function(module, None) is modeling_qwen3_vl.eager_attention_forward
    assert hf.attention_function(module, "sdpa") is ALL_ATTENTION_FUNCTIONS["sdpa"]
    config = module.config
    before = hf.attention_implementation(config)
    private = hf.config_with_attention(config, "raincheck")
    assert hf.attention_implementation(private) == "raincheck"
    assert hf.attention_implementation(config) == before and private is not config


def test_compile_config_reading():
    from transformers.generation.configuration_utils import CompileConfig

    default = hf.compile_config_or_default(None)
    assert isinstance(default, CompileConfig) and not hf.compiles_on_all_devices(default)
    mine = CompileConfig(mode="default")
    assert hf.compile_config_or_default(mine) is mine
    mine._compile_all_devices = True
    assert hf.compiles_on_all_devices(mine)
    assert "_compile_all_devices" not in mine.to_dict()  # StaticStep passes to_dict() to torch.compile


def test_fused_sdp_choice_names_an_sdpa_backend():
    from torch.nn.attention import SDPBackend

    q = torch.randn(1, 2, 8, 16)
    backends = {SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION}
    assert hf.fused_sdp_choice(q, q, q, None) in {int(b) for b in backends}


def test_gdn_pieces_reassemble_the_layer_forward(tiny_qwen3_5_path):
    """project -> causal conv -> factors -> transformers' chunked kernel -> output == the layer's own forward."""
    model, _ = load_tiny_qwen3_5(tiny_qwen3_5_path)
    layer = next(layer.linear_attn for layer in model.model.language_model.layers if hasattr(layer, "linear_attn"))
    torch.manual_seed(0)
    hidden = torch.randn(1, 7, model.config.text_config.hidden_size)
    with torch.no_grad():
        expected = layer(hidden)
        mixed_qkv, z, b, a = hf.gdn_project(layer, hidden)
        conv_out = hf.gdn_causal_conv(layer, mixed_qkv).transpose(1, 2)
        q, k, v, g, beta = hf.gdn_factors(layer, conv_out, a, b)
        core, _ = hf.modeling_module(layer).torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        got = hf.gdn_output(layer, core, z)
        # one row at a time through the conv update gives the same conv output as the full conv
        window = torch.zeros(1, hf.gdn_dims(layer)[3], hf.gdn_dims(layer)[4])
        stepped = torch.cat([hf.gdn_conv_update(layer, mixed_qkv[..., t:t + 1], window)
                             for t in range(mixed_qkv.shape[-1])], dim=-1)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(stepped.transpose(1, 2), conv_out)


def test_torch_gated_delta_rule_functions_are_transformers_torch_code():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    chunk, recurrent = hf.torch_gated_delta_rule_functions()
    assert chunk.__module__ == m.__name__ and recurrent.__module__ == m.__name__
    assert chunk.__name__ == "torch_chunk_gated_delta_rule"
