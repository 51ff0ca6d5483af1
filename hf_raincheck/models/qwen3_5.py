"""Qwen3.5 adapter: Qwen3-VL's placeholders, M-RoPE and vision (no DeepStack), plus Gated DeltaNet layers.

The GDN glue below mirrors transformers 5.23's ``Qwen3_5GatedDeltaNet.forward`` piece by piece (projections,
short causal conv, gates, gated RMSNorm); keep it in step with that file when the pin moves. The conv helpers
and the gated RMSNorm are transformers' own functions/modules, so a model patched with hub kernels keeps them.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ..gdn_state import GDNGlue
from ..gdn_state.layer import conv_window
from .qwen3_vl import Qwen3VLAdapter


class Qwen3_5GDNGlue(GDNGlue):
    """transformers' ``Qwen3_5GatedDeltaNet`` pieces (also fits Qwen3-Next's layer, which has the same names)."""

    @staticmethod
    def _functions(module):
        return sys.modules[type(module).__module__]

    def project(self, module, hidden):
        batch, seq_len, _ = hidden.shape
        mixed_qkv = module.in_proj_qkv(hidden).transpose(1, 2)
        z = module.in_proj_z(hidden).reshape(batch, seq_len, -1, module.head_v_dim)
        return mixed_qkv, z, module.in_proj_b(hidden), module.in_proj_a(hidden)

    def conv(self, module, mixed_qkv, window):
        fns = self._functions(module)
        kernel = module.conv_kernel_size
        seq_len = mixed_qkv.shape[-1]
        weight = module.conv1d.weight.squeeze(1)
        if window is not None and seq_len == 1:
            window = window.clone()
            out = fns.causal_conv1d_update(mixed_qkv, window, weight, module.conv1d.bias, module.activation)
        else:
            full = mixed_qkv if window is None else torch.cat([window, mixed_qkv], dim=-1)
            out = fns.causal_conv1d_fn(full, weight, module.conv1d.bias, activation=module.activation)
            out = out[:, :, -seq_len:]
            window = conv_window(full, kernel)
        return out.transpose(1, 2), window

    def conv_full(self, module, full):
        fns = self._functions(module)
        out = fns.causal_conv1d_fn(full, module.conv1d.weight.squeeze(1), module.conv1d.bias, activation=module.activation)
        return out.transpose(1, 2)

    def conv_step_(self, module, mixed_qkv, window):
        fns = self._functions(module)
        out = fns.causal_conv1d_update(mixed_qkv, window, module.conv1d.weight.squeeze(1), module.conv1d.bias,
                                       module.activation)
        return out.transpose(1, 2)

    def factors(self, module, conv_out, a, b):
        batch, seq_len, _ = conv_out.shape
        query, key, value = torch.split(conv_out, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
        query = query.reshape(batch, seq_len, -1, module.head_k_dim)
        key = key.reshape(batch, seq_len, -1, module.head_k_dim)
        value = value.reshape(batch, seq_len, -1, module.head_v_dim)
        beta = b.sigmoid()
        g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
        return query, key, value, g, beta

    def output(self, module, core_out, z):
        batch, seq_len = core_out.shape[:2]
        core = module.norm(core_out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
        return module.out_proj(core.reshape(batch, seq_len, -1))

    def dims(self, module):
        return module.num_v_heads, module.head_k_dim, module.head_v_dim, module.conv_dim, module.conv_kernel_size


class Qwen3_5Adapter(Qwen3VLAdapter):
    family = "qwen3_5"
    gdn_glue = Qwen3_5GDNGlue()

    def _layers_of(self, kind: str):
        types = self.text.config.layer_types
        return [(i, layer) for i, layer in enumerate(self.text.layers) if types[i] == kind]

    def text_attention_modules(self):
        return [layer.self_attn for _, layer in self._layers_of("full_attention")]

    def gdn_modules(self) -> dict:
        return {i: layer.linear_attn for i, layer in self._layers_of("linear_attention")}

    def layer_mask(self, layer_idx: int, mask):
        """Gated DeltaNet layers take no mask (their rows are handled by `hf_raincheck.gdn_state`)."""
        return mask if self.text.config.layer_types[layer_idx] == "full_attention" else None
