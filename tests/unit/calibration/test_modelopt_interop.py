"""Our writer -> NVIDIA ModelOpt 0.47's own loader, through a real transformers config, with the numbers compared.

"The numbers ModelOpt resolves" are what its vLLM plugin would apply: `load_from_checkpoint_metadata` (per-layer
sparse_cfg) then `_build_sparse_kw` + `_resolve_skip_softmax_calibration` (the per-launch λ for a phase and a
length). Ours is `λ_row = exp(log_scale_factor − length_exponent·ln n)` (docs/skip_softmax.md); both are dense at
λ >= 1. The other direction (ModelOpt's exporter -> our reader) is tests/unit/mtsa/test_modelopt_export_interop.py.
"""

from __future__ import annotations

import copy
import json
import math

import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
    SparseAttentionConfigError,
    SparseAttentionSettings,
    build_sparse_attention_config,
    load_sparse_attention_config,
    parse_sparse_attention_config,
    write_sparse_attention_config,
)
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.constants import MODELOPT_STATIC_THRESHOLD

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
LENGTHS = (1, 7, 64, 1000, 4096, 131072)


def modelopt_vllm():
    """ModelOpt's vLLM plugin module (imports vLLM's FlashAttention backend: the official wheel here)."""
    return pytest.importorskip(
        "modelopt.torch.sparsity.attention_sparsity.plugins.vllm",
        reason="ModelOpt's vLLM plugin needs the official vllm wheel (.venv)",
    )


def modelopt_threshold(hf_config, layer: str, phase: str, n: int) -> float | None:
    """The λ ModelOpt's vLLM plugin applies to `layer` for a launch of `phase` whose longest sequence is n."""
    mo_vllm = modelopt_vllm()
    resolved = mo_cfg.load_from_checkpoint_metadata(hf_config)
    if resolved is None:
        return None
    layer_cfg = mo_cfg.match_sparse_config(layer, resolved[0])
    if layer_cfg is None or not layer_cfg.get("enable", True):
        return None
    kw = mo_vllm._build_sparse_kw(layer_cfg)
    mo_vllm._resolve_skip_softmax_calibration(kw, is_prefill=phase == "prefill", max_seq_len=n)
    return kw.get("skip_softmax_threshold")


def our_threshold(settings: SparseAttentionSettings, layer: str, phase: str, n: int) -> float | None:
    """ln λ_row = c − γ·ln n for a row of length n (prefill: n = prompt length), None = dense."""
    if any(ignored in layer for ignored in settings.disabled_layers):
        return None
    cal = settings.phase(phase)
    if cal is None:
        return None
    lam = math.exp(cal.log_scale_factor - cal.length_exponent * math.log(n))
    return lam if lam < 1.0 else None


def assert_same_numbers(hf_config, settings, layers=("model.layers.0.self_attn", "model.layers.1.self_attn")):
    for layer in layers:
        for phase in ("prefill", "decode"):
            for n in LENGTHS:
                theirs, ours = modelopt_threshold(hf_config, layer, phase, n), our_threshold(settings, layer, phase, n)
                assert (theirs is None) == (ours is None), (layer, phase, n, theirs, ours)
                if ours is not None:
                    assert ours == pytest.approx(theirs, rel=1e-12), (layer, phase, n)


def _hf_config(tmp_path, block):
    cfg = dict(LLAMA_CONFIG, sparse_attention_config=block)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return transformers.AutoConfig.from_pretrained(tmp_path)


def _write(tmp_path, existing=None, fits=None, targets=None):
    cfg = dict(LLAMA_CONFIG)
    if existing is not None:
        cfg["sparse_attention_config"] = existing
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    block = build_sparse_attention_config(
        fits
        or {
            "prefill": {"a": 7.93, "b": 8.61, "r2": 0.97, "n_points": 400, "sparsity_range": (0.05, 0.93)},
            "decode": {"a": 0.12, "b": 9.85, "r2": 0.9, "n_points": 80, "sparsity_range": (0.1, 0.9)},
        },
        target_sparsity=targets or {"prefill": 0.6, "decode": 0.4},
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


@pytest.mark.parametrize(
    "fits,targets",
    [
        (None, None),
        ({"prefill": {"a": 3.0, "b": 0.0}, "decode": {"a": 0.5, "b": -1.5}}, {"prefill": 1.0, "decode": 0.25}),
        ({"decode": {"a": 2.0, "b": 12.0}}, {"decode": 1.0}),
    ],
    ids=["typical", "b=0,negative-b,target-1", "decode-only"],
)
def test_modelopt_resolves_the_same_thresholds_from_our_block(tmp_path, fits, targets):
    hf_config = _write(tmp_path, fits=fits, targets=targets)
    assert_same_numbers(hf_config, load_sparse_attention_config(tmp_path))


def test_our_length_exponent_is_invisible_to_modelopt(tmp_path):
    """A block with our γ ≠ 1 still carries ModelOpt's (a, b): ModelOpt serves those with γ = 1."""
    block = build_sparse_attention_config({"prefill": {"a": 5.0, "b": 6.0, "length_exponent": 0.7}},
                                          target_sparsity=0.5, attention_classes=["LlamaAttention"])  # fmt: skip
    hf_config = _hf_config(tmp_path, block)
    ours = parse_sparse_attention_config(block)
    assert ours.prefill.length_exponent == 0.7
    as_modelopt = copy.deepcopy(block)
    del as_modelopt["config_groups"]["group_0"]["length_exponent"]
    assert_same_numbers(hf_config, parse_sparse_attention_config(as_modelopt))


def test_static_default_threshold_is_modelopts(tmp_path):
    mtsa_mo = pytest.importorskip("modelopt.torch.sparsity.attention_sparsity")
    preset = mtsa_mo.SKIP_SOFTMAX_TRITON_DEFAULT["sparse_cfg"]["*attn*"]
    assert preset["skip_softmax_threshold"] == MODELOPT_STATIC_THRESHOLD
    block = {"config_groups": {"group_0": {"algorithm": "skip_softmax", "targets": ["LlamaAttention"],
                                           "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)"}}}}
    hf_config = _hf_config(tmp_path, block)
    assert mo_cfg.load_from_checkpoint_metadata(hf_config)[1] == "SKIP_SOFTMAX_TRITON_DEFAULT"
    assert_same_numbers(hf_config, parse_sparse_attention_config(block))


def test_modelopt_loader_sees_preserved_groups_and_policy_after_our_recalibration(tmp_path):
    existing = {
        "config_groups": {
            "group_0": {"algorithm": "skip_softmax", "targets": ["LlamaAttention"], "ignore": ["model.layers.1"],
                        "initial_disabled_steps": 2,
                        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                                   "prefill": {"a": 1.0, "b": 1.0}}},
            "group_1": {"algorithm": "sparse_softmax", "targets": ["LlamaAttention"], "sparsity_n": 2,
                        "sparsity_m": 4},
        }
    }  # fmt: skip
    cfg = dict(LLAMA_CONFIG, sparse_attention_config=existing)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    block = build_sparse_attention_config({"prefill": {"a": 7.93, "b": 8.61}}, target_sparsity=0.6,
                                          attention_classes=["LlamaAttention"])  # fmt: skip
    write_sparse_attention_config(tmp_path, block, backup=False)
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    sparse_cfg, preset = mo_cfg.load_from_checkpoint_metadata(hf_config)
    assert preset == "CHECKPOINT_CALIBRATED_SOFTMAX_SKIP_SPARSE_SOFTMAX"
    layer = sparse_cfg["sparse_cfg"]["*attn*"]
    assert layer["sparsity_n"] == 2 and layer["sparsity_m"] == 4
    assert layer["threshold_scale_factor"]["prefill"] == {"a": 7.93, "b": 8.61}
    # the old group's policy survived the recalibration: layer 1 stays dense for ModelOpt
    assert mo_cfg.match_sparse_config("model.layers.1.self_attn", sparse_cfg) == {"enable": False}
    assert hf_config.sparse_attention_config["config_groups"]["group_0"]["initial_disabled_steps"] == 2


# ------------------------------------------------------------------------ ModelOpt's exporter -> our reader


def _tiny_llama_module():
    """tests/unit/mtsa/mtsa_models.py (the tiny peaky Llama with an attention sink), loaded by path."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "mtsa" / "mtsa_models.py"
    spec = importlib.util.spec_from_file_location("mtsa_models_for_interop", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def modelopt_calibrated():
    """A tiny Llama sparsified and calibrated (prefill) by ModelOpt 0.47 itself, layer 0 disabled, on fresh ids."""
    import contextlib
    import io
    import random

    torch = pytest.importorskip("torch")
    mo_mtsa = pytest.importorskip("modelopt.torch.sparsity.attention_sparsity")
    models = _tiny_llama_module()
    seed = random.randrange(1 << 30)
    model = models.make_tiny_llama(seed % 1000, dtype=torch.float32)
    model.config._attn_implementation = "eager"  # ModelOpt's pytorch backend patches the eager softmax
    cfg = {
        "sparse_cfg": {
            "calibration": {"target_sparse_ratio": {"prefill": 0.3, "decode": 0.0}, "max_seqlen": 1024},
            "*self_attn*": {"method": "flash_skip_softmax", "br": 128, "bc": 128, "backend": "pytorch",
                            "initial_disabled_steps": 2, "enable": True},
            "default": {"enable": False},
        }
    }  # fmt: skip

    def forward_loop(m):
        for i, n in enumerate((512, 1024, 768, 1024)):
            m(models.random_ids(n, seed=seed + i))

    with contextlib.redirect_stdout(io.StringIO()):  # ModelOpt's calibration prints its tables
        model = mo_mtsa.sparsify(model, cfg, forward_loop=forward_loop)
    mo_mtsa.disable_sparse_attention(model, "*layers.0.*")
    return model, seed


def _export(model):
    from modelopt.torch.sparsity.attention_sparsity.conversion import export_sparse_attention_config

    return export_sparse_attention_config(model)


def _modules(model):
    from modelopt.torch.sparsity.attention_sparsity.utils import get_named_sparse_attention_modules

    return [m for _, m in get_named_sparse_attention_modules(model)]


def _methods(model):
    return [m._sparse_method_instance for m in _modules(model)]


def test_modelopt_export_reads_with_modelopts_numbers_and_policy(tmp_path, modelopt_calibrated):
    model, seed = modelopt_calibrated
    block = _export(model)
    group = block["config_groups"]["group_0"]
    assert group["ignore"] == ["model.layers.0.self_attn"] and group["initial_disabled_steps"] == 2, seed
    settings = parse_sparse_attention_config(block)
    params = group["threshold_scale_factor"]["prefill"]
    assert (settings.prefill.a, settings.prefill.b, settings.prefill.target_sparsity) == (
        params["a"], params["b"], 0.3,
    )  # fmt: skip
    assert settings.decode is None  # decode target 0: ModelOpt did not calibrate it
    assert settings.disabled_layers == ("model.layers.0.self_attn",) and settings.initial_disabled_steps == 2
    hf_config = _hf_config(tmp_path, block)
    assert_same_numbers(hf_config, settings)
    # and back: our writer rebuilds a block from what we read, ModelOpt's loader resolves the same numbers
    ckpt = tmp_path / "ours"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(dict(LLAMA_CONFIG, sparse_attention_config=block)))
    write_sparse_attention_config(ckpt, build_sparse_attention_config(settings), backup=False)
    again = transformers.AutoConfig.from_pretrained(ckpt)
    assert again.sparse_attention_config["config_groups"]["group_0"]["initial_disabled_steps"] == 2
    assert_same_numbers(again, settings)
    assert load_sparse_attention_config(ckpt) == settings


@pytest.mark.parametrize(
    "params,targets",
    [
        ({"prefill": {"a": 3.0, "b": 0.0}, "decode": {"a": 0.0, "b": 4.0}}, {"prefill": 1.0, "decode": 0.5}),
        ({"prefill": {"a": 0.02, "b": 17.5}, "decode": {"a": 0.4, "b": -3.0}}, {"prefill": 0.9, "decode": 0.1}),
        ({"decode": {"a": 0.12, "b": 20.0}}, {"prefill": 0.5, "decode": 1.0}),
    ],
    ids=["b=0,a=0,target-1", "log-space-negative-b", "decode-only"],
)
def test_every_calibration_modelopts_exporter_can_write_reads_with_its_numbers(
    tmp_path, modelopt_calibrated, params, targets
):
    """Calibration results put on the real modules (what its fit can return), exported by its real exporter."""
    model, _ = modelopt_calibrated
    saved = [(m.calibration_params, m.target_sparse_ratio) for m in _methods(model)]
    try:
        for m in _methods(model):
            m.calibration_params, m.target_sparse_ratio = copy.deepcopy(params), dict(targets)
        block = _export(model)
    finally:
        for m, (p, t) in zip(_methods(model), saved, strict=True):
            m.calibration_params, m.target_sparse_ratio = p, t
    assert_same_numbers(_hf_config(tmp_path, block), parse_sparse_attention_config(block))


def test_modelopt_export_without_calibration_serves_its_static_threshold(tmp_path, modelopt_calibrated):
    model, _ = modelopt_calibrated
    saved = [m.calibration_params for m in _methods(model)]
    try:
        for m in _methods(model):
            m.calibration_params = {}  # a calibration that fitted no phase
        block = _export(model)
    finally:
        for m, p in zip(_methods(model), saved, strict=True):
            m.calibration_params = p
    assert block["config_groups"]["group_0"]["threshold_scale_factor"] == {"formula": "a * exp(b * target_sparsity)"}
    settings = parse_sparse_attention_config(block)
    assert settings.prefill.is_static and math.exp(settings.prefill.log_scale_factor) == pytest.approx(0.1)
    # ModelOpt's static preset ignores `ignore`; we honour it (documented), so compare on the enabled layer
    assert_same_numbers(_hf_config(tmp_path, block), settings, layers=("model.layers.1.self_attn",))


def test_modelopt_export_with_nm_sparse_softmax_is_refused_naming_the_group(modelopt_calibrated):
    model, _ = modelopt_calibrated
    saved = [dict(m._method_config) for m in _modules(model)]
    try:
        for m in _modules(model):
            m._method_config.update(export_sparse_softmax=True, sparsity_n=2, sparsity_m=4)
        block = _export(model)
    finally:
        for m, c in zip(_modules(model), saved, strict=True):
            m._method_config.clear()
            m._method_config.update(c)
    assert block["config_groups"]["group_1"]["algorithm"] == "sparse_softmax"
    with pytest.raises(SparseAttentionConfigError) as info:
        parse_sparse_attention_config(block)
    assert "group_1: algorithm 'sparse_softmax' (2:4 N:M sparse softmax) is not implemented" in str(info.value)
