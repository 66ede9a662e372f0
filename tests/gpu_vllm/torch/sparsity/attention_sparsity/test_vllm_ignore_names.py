"""`ignore` entries written by the HF export name the attention module; vLLM's layer sits one level below it."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.attention.backends.flash_attn")

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402


def _settings(disabled):
    return SparseAttentionSettings(prefill=PhaseCalibration(4.0, 8.0, 0.5), decode=None, disabled_layers=disabled)


def test_hf_module_name_disables_the_vllm_layer_inside_it(make_layer):
    a = make_layer("flash_attn", head_size=64, prefix="model.layers.1.self_attn.attn")
    b = make_layer("flash_attn", head_size=64, prefix="model.layers.11.self_attn.attn")
    c = make_layer("flash_attn", head_size=64, prefix="model.layers.2.self_attn.attn")
    report = plug.install_sparse_attention([a, b, c], _settings(("model.layers.1.self_attn", "model.layers.2.*")))
    assert report.disabled == ["model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn"]
    assert type(a.impl).__name__ == "FlashAttentionImpl" and type(c.impl).__name__ == "FlashAttentionImpl"
    assert type(b.impl) is plug.ModelOptSparseAttentionImpl  # layers.11 is not layers.1
