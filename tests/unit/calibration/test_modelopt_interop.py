"""What we write is read by NVIDIA ModelOpt 0.47's own loader, through a real transformers config."""

from __future__ import annotations

import json

import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.plugins.sparse_attn_config import (
    build_sparse_attention_config,
    load_sparse_attention_config,
    write_sparse_attention_config,
)

mo_cfg = pytest.importorskip("modelopt.torch.sparsity.attention_sparsity.plugins.sparse_attn_config")
transformers = pytest.importorskip("transformers")

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
}


def _write(tmp_path, existing=None):
    cfg = dict(LLAMA_CONFIG)
    if existing is not None:
        cfg["sparse_attention_config"] = existing
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    block = build_sparse_attention_config(
        {
            "prefill": {"a": 7.93, "b": 8.61, "r2": 0.97, "n_points": 400, "sparsity_range": (0.05, 0.93)},
            "decode": {"a": 0.12, "b": 9.85, "r2": 0.9, "n_points": 80, "sparsity_range": (0.1, 0.9)},
        },
        target_sparsity={"prefill": 0.6, "decode": 0.4},
        attention_classes=["LlamaAttention"],
        ignore=["model.layers.0.self_attn"],
    )
    write_sparse_attention_config(tmp_path, block)
    return transformers.AutoConfig.from_pretrained(tmp_path)


def test_modelopt_loader_accepts_our_block(tmp_path):
    hf_config = _write(tmp_path)
    result = mo_cfg.load_from_checkpoint_metadata(hf_config)
    assert result is not None
    sparse_cfg, preset = result
    assert preset == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP"
    layer = mo_cfg.match_sparse_config("model.layers.1.self_attn.attn", sparse_cfg)
    assert layer["method"] == "triton_skip_softmax" and layer["enable"] is True
    assert layer["threshold_scale_factor"]["prefill"] == {"a": 7.93, "b": 8.61}
    assert layer["threshold_scale_factor"]["decode"] == {"a": 0.12, "b": 9.85}
    assert layer["target_sparse_ratio"] == {"prefill": 0.6, "decode": 0.4}
    # our `ignore` keeps layer 0 dense on ModelOpt's side too
    assert mo_cfg.match_sparse_config("model.layers.0.self_attn.attn", sparse_cfg) == {"enable": False}
    # and we read back what transformers re-serialises
    hf_config.save_pretrained(tmp_path / "resaved")
    assert load_sparse_attention_config(tmp_path / "resaved") == load_sparse_attention_config(tmp_path)


def test_modelopt_loader_sees_preserved_sparse_softmax_group(tmp_path):
    existing = {
        "config_groups": {
            "group_0": {"algorithm": "sparse_softmax", "targets": ["LlamaAttention"], "sparsity_n": 2, "sparsity_m": 4}
        }
    }
    hf_config = _write(tmp_path, existing)
    sparse_cfg, preset = mo_cfg.load_from_checkpoint_metadata(hf_config)
    assert preset == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP_SPARSE_SOFTMAX"
    layer = sparse_cfg["sparse_cfg"]["*attn*"]
    assert layer["sparsity_n"] == 2 and layer["sparsity_m"] == 4
    assert layer["threshold_scale_factor"]["prefill"] == {"a": 7.93, "b": 8.61}
