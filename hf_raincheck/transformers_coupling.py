"""Every place where hf_raincheck depends on transformers internals (and the few torch / accelerate private names
it reaches on the way): the copied pieces of transformers code and the private names, in one module.

The rest of the package imports from here; nothing else reaches a private transformers name or mirrors a
transformers forward. Follows **transformers 5.23 to 5.25** (`SUPPORTED_TRANSFORMERS`, the pin of pyproject.toml;
`check_transformers_version` enforces it at `enable_raincheck`); what differs between them is decided here once
(items 17 and 18). On a version bump, re-read each item below in the new transformers, adapt this module, then move
the pin (here and in pyproject.toml, for the package and its ``serve`` extra; a test checks they agree); CI runs the
suite on the oldest and the newest supported version.

Copied code (keep in step with the named transformers source):

1. `text_decoder_forward`: the text model's loop of ``Qwen3VLTextModel.forward`` / ``Qwen3_5TextModel.forward`` /
   ``Qwen2_5_VLTextModel.forward`` (rotary embeddings, decoder layers, final norm), without its mask creation and
   with DeepStack added densely (``Qwen3VLTextModel._deepstack_process``). Check: the layer call's keyword
   names (``attention_mask``, ``position_ids``, the cache's (item 17), ``position_embeddings``, ``use_cache``),
   that layers return a tensor, and ``rotary_emb(hidden, position_ids)``.
2. `vision_attention_qk`: the q, k of ``Qwen3VLVisionAttention.forward`` (also Qwen2.5-VL's and Qwen3.5's vision
   attention): ``qkv`` reshaped to ``[P, 3, heads, -1]``, ``apply_rotary_pos_emb_vision`` (the family module's
   own function), ``scaling``. `vision_attention_sdpa_input` relies on that forward calling
   ``F.scaled_dot_product_attention`` once per ``cu_seqlens`` segment under ``_attn_implementation == "sdpa"``.
   Check: the forward's argument names (``hidden_states``, ``cu_seqlens``, ``position_embeddings``) and its SDPA
   call pattern (tests/test_vision_attention_lse.py fails if they drift).
3. `gdn_project`, `gdn_causal_conv`, `gdn_causal_conv_tail`, `gdn_conv_update`, `gdn_factors`, `gdn_output`,
   `gdn_dims`: ``Qwen3_5GatedDeltaNet.forward`` piece by piece (projections ``in_proj_qkv``/``in_proj_z``/
   ``in_proj_b``/``in_proj_a``, the short causal conv through the modeling module's ``causal_conv1d_fn`` /
   ``causal_conv1d_update`` or, in compiled steps, as products of ``conv1d.weight`` / ``bias`` and
   ``ACT2FN[activation]`` matching them, the gates ``-A_log.exp() * softplus(a + dt_bias)`` and ``b.sigmoid()``, the gated
   RMSNorm ``norm(core, z)``, ``out_proj``). Check every attribute name and the gate formulas.

Private or internal names reached:

4. ``sys.modules[type(module).__module__]`` (`modeling_module`): the family's modeling module, for
   ``eager_attention_forward``, ``apply_rotary_pos_emb_vision``, ``causal_conv1d_fn``, ``causal_conv1d_update``
   (module-level helpers, not exported API; hub kernels may replace the conv helpers there).
5. ``PretrainedConfig._attn_implementation`` / ``_attn_implementation_internal`` (`attention_implementation`,
   `config_with_attention`): the attention dispatch of a text attention module reads
   ``self.config._attn_implementation``; Raincheck gives each module a private config copy naming its
   registered function. ``AttentionInterface.register`` and ``ALL_ATTENTION_FUNCTIONS`` (public) hold the
   functions. Check: the attention modules still look their function up through ``self.config``.
6. ``modeling_qwen3_5.torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` and their
   ``__wrapped__`` (`torch_gated_delta_rule_functions`): transformers' torch GDN kernels (decorated so that they
   may resolve to hub kernels; from 5.25 the names are ``kernels`` ``Func`` modules closing over the decorated
   function as ``func``). Check the names, the keyword arguments and the state layout ``[B, H_v, K, V]``.
7. ``CompileConfig._compile_all_devices`` and ``CompileConfig()`` defaults (`compile_config_or_default`,
   `compiles_on_all_devices`): when transformers compiles a static-cache decode step, mirrored for Raincheck's
   own compiled steps. Check ``GenerationMixin._valid_auto_compile_criteria``.
8. ``transformers.vision_utils.get_vision_window_index`` (`vision_window_index`): Qwen2.5-VL's window order.
9. ``Pipeline._sanitize_parameters`` (`guard_pipeline_kwargs`): where a pipeline call's keyword arguments are
   split into processor, generate and postprocess arguments (``ImageTextToTextPipeline`` hands unknown ones to
   the processor, which drops them with a log line).
10. Public but load-bearing: ``GenerationMixin.generate`` validates model kwargs against ``forward``'s signature
    (Raincheck's bound ``generate`` / ``forward`` show the originals' signatures), forwards ``disable_compile``,
    the cache (item 17) and ``attention_mask``; ``DynamicCache`` / ``DynamicLayer`` (subclassed by
    ``hf_raincheck.cache``: ``layers``, ``lazy_initialization``, ``is_initialized``, ``get_mask_sizes``);
    ``GenerationConfig`` keeps unknown attributes (``raincheck_config``) and serialises dataclass values through
    their ``to_dict``; ``get_rope_index``, ``get_image_features`` / ``get_video_features`` (``pooler_output``,
    ``deepstack_features``).

torch and accelerate private names (not transformers, but the same kind of coupling):

11. ``torch._fused_sdp_choice`` (`fused_sdp_choice`): the backend SDPA would pick for a call (torch 2.6+).
12. accelerate's ``module._hf_hook`` (its ``execution_device``, ``SequentialHook.hooks``) and
    ``module._old_forward`` (`accelerate_hooks`, `hooked_forward_name`): where a ``device_map``-dispatched module
    computes and where its own forward sits under the hook.
15. ``GenerationMixin._get_stopping_criteria`` (`STOPPING_CRITERIA_METHOD`): wrapped on an enabled instance so a
    batched Raincheck generate knows which rows stopped (`hf_raincheck.generation.row_stops`); ``_sample`` must
    still build the criteria once per call and AND their result into ``unfinished_sequences`` every step.
16. ``<Family>Model.rope_deltas`` (`forget_rope_deltas`): the Qwen-VL models keep the last call's M-RoPE deltas
    (``[B, 1]``) and add them to a continued call's text positions in ``_prepare_position_ids_for_generation``;
    from a call with another batch size that addition fails. Raincheck computes positions itself, so it clears
    them before each of its calls (transformers then computes text positions, which the Raincheck forward ignores).

17. The cache's name (`CACHE_NAMES_CHANGED`, `CACHE_ARGUMENT`, `GDN_CACHE_ARGUMENT`, `given_cache`,
    `pop_cache_argument`, `output_cache`): ``past_key_values`` in 5.23's ``generate`` / ``forward`` / decoder
    layers and outputs (``cache_params`` in ``Qwen3_5GatedDeltaNet.forward``); ``cache`` everywhere from 5.24,
    which still takes the old names with a deprecation warning (``past_key_values`` until 6.0). Raincheck's
    ``generate`` / ``forward`` take the cache under the names the installed transformers takes.
18. ``transformers serve``'s code under `hf_raincheck.serve` (`SERVING_ENGINE_PROCESS`, `serving_app`,
    `serving_generation_config`, `serving_load_model`): the server subclasses
    ``transformers.cli.serving.chat_completion.ChatCompletionHandler`` for its request validation
    (``_validate_request``), response and SSE builders (``_build_completion``, ``_build_chunk_sse``,
    ``chunk_to_sse``) and generation settings, and builds its FastAPI app with ``server.build_server``; it keeps the
    model in its own process, on its own scheduler thread (5.25 runs each model of ``transformers serve`` in an
    engine process, which Raincheck's pooled caches cannot live in). What differs: 5.23 / 5.24 build the settings as
    a ``GenerationConfig`` (``_build_generation_config``), 5.25 as ``generate`` keyword arguments
    (``_build_generation_kwargs``); ``build_server`` takes ``generation_state`` before 5.25; models load through
    ``ModelManager.load_model_and_processor`` before 5.25 and ``ModelLoader.load_model_and_processor`` from 5.25.
    Check: those names and signatures, and the routes ``build_server`` adds (the server replaces
    ``/v1/models``, ``/health``, ``/load_model`` and ``/reset``).

Off the inference path, kept where they are (tests/test_transformers_coupling.py lists them as the only exceptions):

13. ``hf_raincheck.testing.torchvision_free`` (tests and ``--tiny-random``): torch-only subclasses of the Qwen video
    processors and ``VideoProcessorMixin`` exposed where ``ProcessorMixin`` looks for it (transformers 5.23 cannot
    build a Qwen-VL processor without torchvision).
14. ``hf_raincheck.gridqa.batching.batched_vision_attention`` (GridQA training only): a batched copy of the Qwen
    vision attention forward (the same q, k, v as item 2) with the family's ``apply_rotary_pos_emb_vision``.
"""

from __future__ import annotations

import copy
import inspect
import sys
import warnings

import torch
import torch.nn.functional as F

#: the transformers versions hf_raincheck follows (the pin of pyproject.toml's dependencies: a test checks they agree)
SUPPORTED_TRANSFORMERS = ">=5.23,<5.26"


# --------------------------------------------------------------------------------------------------- version check
def installed_transformers_version() -> str:
    import transformers

    return transformers.__version__


def transformers_version_supported(version: str | None = None) -> bool:
    """Whether `version` (default: the installed transformers) is within `SUPPORTED_TRANSFORMERS`."""
    return _within(SUPPORTED_TRANSFORMERS, version)


def _within(specifier: str, version: str | None) -> bool:
    """Whether `version` (default: the installed transformers) is within `specifier`, as pip reads it."""
    from packaging.specifiers import SpecifierSet

    version = installed_transformers_version() if version is None else version
    return SpecifierSet(specifier).contains(version, prereleases=True)


def _cache_names_changed() -> bool:
    from packaging.version import Version

    return Version(installed_transformers_version()).release >= (5, 24)


#: coupling point 17: whether the installed transformers takes the cache as ``cache`` (5.24 on: ``generate``,
#: model ``forward``, decoder layers, ``Qwen3_5GatedDeltaNet.forward``, and the outputs' field) where 5.23 says
#: ``past_key_values`` (``cache_params`` in the GDN module). From 5.24 the old names are still taken, with
#: transformers' deprecation warning (``past_key_values`` until 6.0).
CACHE_NAMES_CHANGED = _cache_names_changed()
#: the keyword of the cache in the installed transformers' ``generate`` / ``forward`` / decoder layers, and the
#: field of their outputs that holds it
CACHE_ARGUMENT = "cache" if CACHE_NAMES_CHANGED else "past_key_values"
#: the keyword of the cache in ``Qwen3_5GatedDeltaNet.forward``
GDN_CACHE_ARGUMENT = "cache" if CACHE_NAMES_CHANGED else "cache_params"


def given_cache(kwargs: dict):
    """The cache among a ``generate`` / ``forward`` call's keyword arguments under either name (None when not
    given), leaving them as they are."""
    cache = kwargs.get(CACHE_ARGUMENT)
    return kwargs.get("past_key_values") if cache is None and CACHE_NAMES_CHANGED else cache


def pop_cache_argument(kwargs: dict, caller: str):
    """Removes the cache from a ``generate`` / ``forward`` call's keyword arguments and returns it (None when not
    given). From transformers 5.24 both names are taken, as transformers takes them: ``cache``, and
    ``past_key_values`` with transformers' `FutureWarning`; both at once is an error (transformers' rule)."""
    if not CACHE_NAMES_CHANGED:
        return kwargs.pop("past_key_values", None)
    old, new = kwargs.pop("past_key_values", None), kwargs.pop("cache", None)
    if old is None:
        return new
    if new is not None:
        raise ValueError(f"{caller}: cache and past_key_values are both set; pass the cache as cache only")
    warnings.warn(f"{caller}: `past_key_values` is deprecated in transformers {installed_transformers_version()}; "
                  "pass the cache as `cache`", FutureWarning, stacklevel=4)  # (the caller of generate / forward)
    return old


def output_cache(output):
    """The cache a transformers generate / forward output holds (``cache`` from 5.24, ``past_key_values`` before),
    read without transformers' deprecation message."""
    return getattr(output, CACHE_ARGUMENT)


# ------------------------------------------------------------------------------------- transformers serve (item 18)
def _serving_engine_process() -> bool:
    from packaging.version import Version

    return Version(installed_transformers_version()).release >= (5, 25)


#: coupling point 18: whether the installed ``transformers serve`` runs each model in an engine process (5.25 on),
#: which changed its handler's generation settings, its app factory and its model loading
SERVING_ENGINE_PROCESS = _serving_engine_process()


def serving_app(model_manager, chat_handler, refused_handler, generation_state):
    """``transformers serve``'s FastAPI app (``build_server``) with `chat_handler` on ``/v1/chat/completions`` and
    `refused_handler` on its other generation endpoints."""
    from transformers.cli.serving.server import build_server

    handlers = dict(completion_handler=refused_handler("/v1/completions"),
                    response_handler=refused_handler("/v1/responses"),
                    transcription_handler=refused_handler("/v1/audio/transcriptions"),
                    systemone_handler=refused_handler("/v1/systemone"))
    if not SERVING_ENGINE_PROCESS:
        handlers["generation_state"] = generation_state
    return build_server(model_manager, chat_handler, **handlers)


def serving_generation_config(handler, body: dict, model_generation_config):
    """The `GenerationConfig` of a chat request, as ``transformers serve``'s chat handler builds it (``temperature``,
    ``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``frequency_penalty``, ``logit_bias``,
    ``generation_config``; the model's generation config beneath). Raises what transformers raises on a bad value."""
    if not SERVING_ENGINE_PROCESS:
        return handler._build_generation_config(body, model_generation_config)
    generation_kwargs = handler._build_generation_kwargs(body, model_generation_config)
    config = copy.deepcopy(model_generation_config)
    unused = config.update(**generation_kwargs)
    if unused:
        raise ValueError(f"not generation settings: {sorted(unused)}")
    return config


def serving_load_model(name: str, device: str, dtype: str | None, attn_implementation: str | None,
                       trust_remote_code: bool):
    """Loads `name` (a Hub id, ``id@revision`` or a local path) and its processor in this process as ``transformers
    serve`` loads a model (its device, dtype, attention and ``trust_remote_code`` options); returns
    ``(model, processor)``."""
    options = dict(device=device, dtype=dtype, attn_implementation=attn_implementation,
                   trust_remote_code=trust_remote_code)
    if SERVING_ENGINE_PROCESS:
        from transformers.cli.serving.model_manager import ModelLoader
        from transformers.cli.serving.utils import canonical_model_id

        return ModelLoader(**options).load_model_and_processor(canonical_model_id(name))
    from transformers.cli.serving.model_manager import ModelManager

    manager = ModelManager(model_timeout=-1, **options)
    return manager.load_model_and_processor(manager.process_model_name(name))


def check_transformers_version(force: bool = False, caller: str = "enable_raincheck") -> None:
    """Raises `RuntimeError` when the installed transformers is outside `SUPPORTED_TRANSFORMERS`; with `force`, warns
    (`UserWarning`) instead."""
    version = installed_transformers_version()
    if transformers_version_supported(version):
        return
    message = (
        f"{caller}: hf_raincheck supports transformers {SUPPORTED_TRANSFORMERS}, found {version}. Raincheck follows "
        "that version's internals (listed in hf_raincheck/transformers_coupling.py); install a supported version "
        "(pip install 'transformers" + SUPPORTED_TRANSFORMERS + "')"
    )
    if force:
        warnings.warn(message + "; force=True: going on anyway, results are unchecked", UserWarning, stacklevel=3)
        return
    raise RuntimeError(message + ", or pass force=True to try anyway (a warning then)")


# ------------------------------------------------------------------------------------------ family modeling modules
def modeling_module(module: torch.nn.Module):
    """The transformers modeling module that defines `module`'s class (e.g. ``modeling_qwen3_vl``)."""
    return sys.modules[type(module).__module__]


# ------------------------------------------------------------------------------------------------ attention dispatch
def register_attention_function(name: str, function) -> None:
    """Registers `function` under `name` in transformers' `AttentionInterface` (additive, process-wide)."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, function)


def attention_implementation(config) -> str | None:
    """The attention implementation a module with this config dispatches to."""
    return getattr(config, "_attn_implementation", None)


def attention_function(module: torch.nn.Module, implementation: str | None):
    """The attention function `module` calls under `implementation` (eager: its modeling module's own)."""
    if implementation in (None, "eager"):
        return modeling_module(module).eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[implementation]


def config_with_attention(config, implementation: str):
    """A shallow copy of `config` whose attention implementation is `implementation` (the original untouched)."""
    private = copy.copy(config)
    private._attn_implementation_internal = implementation
    return private


# ----------------------------------------------------------------------------------------------- text decoder loop
def forget_rope_deltas(model) -> None:
    """Coupling point 16: clears the M-RoPE deltas a Qwen-VL model keeps from its last call (``model.model``)."""
    inner = getattr(model, "model", None)
    if getattr(inner, "rope_deltas", None) is not None:
        inner.rope_deltas = None


#: coupling point 15: transformers' private method that builds a generate call's stopping criteria (an enabled
#: instance wraps it; finished rows are fed padding by transformers, which must not reach their caches)
STOPPING_CRITERIA_METHOD = "_get_stopping_criteria"


def text_decoder_forward(text, embeds, positions, layer_mask, cache, deepstack, backend):
    """The text model's decoder loop over rows ``embeds [B, q, H]`` -> final hidden states ``[B, q, H]``.

    ``text``: the family's text model (``rotary_emb``, ``layers``, ``norm``, ``config.num_hidden_layers``);
    ``layer_mask(i)``: the attention mask of decoder layer i; ``deepstack[k]`` ``[q, H]`` or ``[B, q, H]`` (zeros on non-visual
    rows) is added to the output of layer k, which equals transformers' boolean-indexed add without its
    data-dependent shapes (no host sync, one graph for torch.compile). ``raincheck_backend`` reaches the
    attention function (`hf_raincheck.attention.dispatch`) through the layers' ``**kwargs``.
    """
    hidden = embeds
    position_embeddings = text.rotary_emb(hidden, positions)
    given = {CACHE_ARGUMENT: cache}  # (item 17)
    for i, layer in enumerate(text.layers[: text.config.num_hidden_layers]):
        hidden = layer(
            hidden,
            attention_mask=layer_mask(i),
            position_ids=None,
            position_embeddings=position_embeddings,
            use_cache=True,
            raincheck_backend=backend,
            **given,
        )
        if deepstack is not None and i < len(deepstack):
            feature = deepstack[i].to(hidden.device, hidden.dtype)
            hidden = hidden + (feature if feature.dim() == 3 else feature[None])  # [B, q, H] or one row's [q, H]
    return text.norm(hidden)


# ------------------------------------------------------------------------------------------- Qwen-VL vision blocks
def vision_attention_qk(attn, args, kwargs):
    """q, k ``[P, heads, head_dim]`` (rotary applied, as the vision attention computes them), ``cu_seqlens`` and the
    softmax scale, from the forward inputs of a Qwen-VL vision attention module (``block.attn``)."""
    apply_rotary_pos_emb_vision = modeling_module(attn).apply_rotary_pos_emb_vision  # the family's own
    x = args[0] if args else kwargs["hidden_states"]
    cu_seqlens = args[1] if len(args) > 1 else kwargs["cu_seqlens"]
    n = x.shape[0]
    q, k, _ = attn.qkv(x).reshape(n, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = kwargs["position_embeddings"]
    q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
    return q, k, cu_seqlens, attn.scaling


def vision_attention_sdpa_input(attn, args, kwargs):
    """The input hidden states ``[P, hidden]`` of a Qwen-VL vision attention module whose forward runs one
    ``F.scaled_dot_product_attention(q, k, v, attn_mask=None, scale=attn.scaling)`` per ``cu_seqlens`` segment,
    in order (``attn_implementation="sdpa"``), else None (the other implementations never call SDPA)."""
    if attention_implementation(attn.config) != "sdpa":
        return None
    return args[0] if args else kwargs["hidden_states"]


def vision_window_index(vision_config, grid_thw: torch.Tensor):
    """Qwen2.5-VL's ``(window_index, cu_window_seqlens)`` for `grid_thw`, computed as its vision tower does."""
    from transformers.vision_utils import get_vision_window_index

    return get_vision_window_index(
        grid_thw,
        spatial_merge_size=vision_config.spatial_merge_size,
        window_size=vision_config.window_size,
        patch_size=vision_config.patch_size,
    )


# ------------------------------------------------------------------------------------ Qwen3.5 Gated DeltaNet pieces
def gdn_project(module, hidden):
    """-> ``mixed_qkv [B, C, T]`` (pre-conv), ``z [B, T, H_v, V]``, ``b``, ``a``."""
    batch, seq_len, _ = hidden.shape
    mixed_qkv = module.in_proj_qkv(hidden).transpose(1, 2)
    z = module.in_proj_z(hidden).reshape(batch, seq_len, -1, module.head_v_dim)
    return mixed_qkv, z, module.in_proj_b(hidden), module.in_proj_a(hidden)


def gdn_conv_update(module, mixed_qkv, window):
    """transformers' ``causal_conv1d_update`` on one row ``[B, C, 1]`` (`window` ``[B, C, kernel]`` updated in
    place) -> ``[B, C, 1]``."""
    return modeling_module(module).causal_conv1d_update(
        mixed_qkv, window, module.conv1d.weight.squeeze(1), module.conv1d.bias, module.activation
    )


def gdn_causal_conv(module, full):
    """transformers' ``causal_conv1d_fn`` over ``full [B, C, L]`` (zero left padding) -> ``[B, C, L]``."""
    return modeling_module(module).causal_conv1d_fn(
        full, module.conv1d.weight.squeeze(1), module.conv1d.bias, activation=module.activation
    )


def gdn_causal_conv_tail(module, rows, n: int):
    """The last `n` outputs of `gdn_causal_conv` over ``rows [B, L, C]`` (positions on dim 1: the layout of
    ``in_proj_qkv``'s output; ``L >= n + kernel - 1``, so no position reads the zero padding) as ``kernel`` shifted
    products and one activation -> ``[B, n, C]``: elementwise work that a compiled graph fuses into one kernel
    (transformers' fallback is a depthwise ``conv1d`` call, a cuDNN kernel per layer that costs more than the
    products at a compiled step's few rows). Channels last, so that every read and write of that kernel runs along
    the channels (in ``[B, C, L]`` the kernel's loop ran along the positions and its ``[B, n, C]`` writes were
    strided). The conv's dtype rules: inputs in the weight's dtype, products summed in float32, output rounded to
    the weight's dtype before the activation."""
    weight = module.conv1d.weight.squeeze(1)  # [C, kernel]
    kernel, length = weight.shape[-1], rows.shape[1]
    x = rows.to(weight.dtype).float()
    w = weight.float().t()  # [kernel, C]
    acc = x[:, length - n - kernel + 1 : length - kernel + 1] * w[0]
    for j in range(1, kernel):
        acc = acc + x[:, length - n - kernel + 1 + j : length - kernel + 1 + j] * w[j]
    if module.conv1d.bias is not None:
        acc = acc + module.conv1d.bias.float()
    out = acc.to(weight.dtype)
    if module.activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[module.activation](out)
    return out.to(rows.dtype)


def gdn_factors(module, conv_out, a, b):
    """-> q, k ``[B, T, H_k, K]``, v ``[B, T, H_v, V]``, g (fp32), beta."""
    batch, seq_len, _ = conv_out.shape
    query, key, value = torch.split(conv_out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, module.head_k_dim)
    key = key.reshape(batch, seq_len, -1, module.head_k_dim)
    value = value.reshape(batch, seq_len, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    return query, key, value, g, beta


def gdn_output(module, core_out, z):
    """The gated RMSNorm and output projection -> ``[B, T, hidden]``."""
    batch, seq_len = core_out.shape[:2]
    core = module.norm(core_out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(batch, seq_len, -1))


def gdn_dims(module):
    """-> ``(num_v_heads, head_k_dim, head_v_dim, conv_dim, conv_kernel_size)``."""
    return module.num_v_heads, module.head_k_dim, module.head_v_dim, module.conv_dim, module.conv_kernel_size


def torch_gated_delta_rule_functions():
    """``(chunk, recurrent)``: transformers' torch gated delta rule kernels (``__wrapped__`` when decorated: the
    decorated names may resolve to hub kernels, e.g. fla, when installed)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    return _torch_function(m.torch_chunk_gated_delta_rule), _torch_function(m.torch_recurrent_gated_delta_rule)


def _torch_function(decorated):
    """The torch function under transformers' hub-kernel decorators: from 5.25, with the ``kernels`` package (a
    dependency of transformers then), ``use_kernel_forward_from_hub`` makes the name a ``Func`` module of
    ``kernels`` whose ``forward`` calls the function it closes over (``func``); under it, and in 5.23, the function
    transformers wrapped with ``functools.wraps`` (``__wrapped__``)."""
    if isinstance(decorated, torch.nn.Module):
        decorated = inspect.getclosurevars(type(decorated).forward).nonlocals.get("func", decorated)
    return getattr(decorated, "__wrapped__", decorated)


# --------------------------------------------------------------------------------------------------- compiled steps
def compile_config_or_default(compile_config):
    """`compile_config`, or transformers' default `CompileConfig()` when None."""
    if compile_config is not None:
        return compile_config
    from transformers.generation.configuration_utils import CompileConfig

    return CompileConfig()


def compiles_on_all_devices(compile_config) -> bool:
    """Whether transformers would compile a static-cache step on any device (not only CUDA / XPU)."""
    return bool(getattr(compile_config, "_compile_all_devices", None))


# -------------------------------------------------------------------------------------------------------- pipelines
def guard_pipeline_kwargs(pipe, check) -> None:
    """Runs ``check(kwargs)`` on the keyword arguments of each call of this pipeline instance (and on those it was
    built with) before transformers splits them into processor, generate and postprocess arguments."""
    if getattr(vars(pipe).get("_sanitize_parameters"), "raincheck_guard", False):
        return  # guarded already
    original = pipe._sanitize_parameters  # the class's method, or an instance-level one (kept behind the check)

    def sanitize(**kwargs):
        check(kwargs)
        return original(**kwargs)

    sanitize.raincheck_guard = True
    sanitize.original = original
    pipe._sanitize_parameters = sanitize


def unguard_pipeline_kwargs(pipe) -> None:
    """Removes `guard_pipeline_kwargs`'s check from this pipeline instance (what was there before comes back)."""
    guard = vars(pipe).get("_sanitize_parameters")
    if not getattr(guard, "raincheck_guard", False):
        return
    if getattr(guard.original, "__self__", None) is pipe and guard.original.__func__ is getattr(
        type(pipe), "_sanitize_parameters", None
    ):
        del pipe._sanitize_parameters  # the class's method again
    else:
        pipe._sanitize_parameters = guard.original


def pipeline_preprocess_params(pipe) -> dict:
    """The processor arguments a pipeline was built with (``pipeline(..., **kwargs)``)."""
    return dict(getattr(pipe, "_preprocess_params", None) or {})


# --------------------------------------------------------------------------------------------------------- torch SDPA
def fused_sdp_choice(q, k, v, scale) -> int:
    """The `SDPBackend` (as an int) that ``F.scaled_dot_product_attention(q, k, v, scale=scale)`` would run
    (``torch._fused_sdp_choice``; RuntimeError when no backend fits)."""
    return torch._fused_sdp_choice(q, k, v, None, 0.0, False, scale=scale, enable_gqa=False)


# -------------------------------------------------------------------------------------------------- accelerate hooks
def accelerate_hooks(module: torch.nn.Module) -> list:
    """The accelerate hooks on `module` (``_hf_hook``: one hook, or the hooks of a ``SequentialHook``)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    return list(getattr(hook, "hooks", None) or [hook])


def hooked_forward_name(module: torch.nn.Module) -> str:
    """The attribute holding `module`'s own forward: ``_old_forward`` under an accelerate hook, else ``forward``."""
    return "_old_forward" if hasattr(module, "_old_forward") else "forward"
