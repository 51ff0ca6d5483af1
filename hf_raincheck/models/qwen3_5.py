"""Qwen3.5 adapter: Qwen3-VL's placeholders, M-RoPE and vision (no DeepStack), plus Gated DeltaNet layers.

The GDN glue's pieces are transformers' ``Qwen3_5GatedDeltaNet.forward`` split up, in
`hf_raincheck.transformers_coupling` (``gdn_*``, with what to check when the transformers pin moves). The conv helpers
and the gated RMSNorm are transformers' own functions/modules, so a model patched with hub kernels keeps them.
"""

from __future__ import annotations

import torch

from .. import transformers_coupling as hf
from ..gdn_state import GDNGlue
from ..gdn_state.layer import conv_window
from .qwen3_vl import Qwen3VLAdapter


class Qwen3_5GDNGlue(GDNGlue):
    """transformers' ``Qwen3_5GatedDeltaNet`` pieces (also fits Qwen3-Next's layer, which has the same names)."""

    def project(self, module, hidden):
        return hf.gdn_project(module, hidden)

    def conv(self, module, mixed_qkv, window):
        seq_len = mixed_qkv.shape[-1]
        if window is not None and seq_len == 1:
            window = window.clone()
            out = hf.gdn_conv_update(module, mixed_qkv, window)
        else:
            full = mixed_qkv if window is None else torch.cat([window, mixed_qkv], dim=-1)
            out = hf.gdn_causal_conv(module, full)[:, :, -seq_len:]
            window = conv_window(full, module.conv_kernel_size)
        return out.transpose(1, 2), window

    def conv_full(self, module, full):
        return hf.gdn_causal_conv(module, full).transpose(1, 2)

    def conv_tail(self, module, rows, n):
        return hf.gdn_causal_conv_tail(module, rows, n)

    def factors(self, module, conv_out, a, b):
        return hf.gdn_factors(module, conv_out, a, b)

    def output(self, module, core_out, z):
        return hf.gdn_output(module, core_out, z)

    def dims(self, module):
        return hf.gdn_dims(module)


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
