"""sparse_attention_config: parsing (ModelOpt schema), building, atomic writing, reading back."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelopt_ext.torch.sparsity.attention_sparsity.plugins.sparse_attn_config import (
    PhaseCalibration,
    SparseAttentionConfigError,
    SparseAttentionSettings,
    build_sparse_attention_config,
    load_sparse_attention_config,
    parse_sparse_attention_config,
    settings_from_hf_config,
    write_json_atomic,
    write_sparse_attention_config,
)

# The example output in ModelOpt 0.47's conversion.export_sparse_attention_config docstring.
MODELOPT_EXAMPLE = {
    "config_groups": {
        "group_0": {
            "algorithm": "skip_softmax",
            "targets": ["LlamaAttention"],
            "threshold_scale_factor": {
                "formula": "a * exp(b * target_sparsity)",
                "prefill": {"a": 7.93, "b": 8.61},
                "decode": {"a": 0.12, "b": 9.85},
            },
            "target_sparsity": {"prefill": 0.5},
        },
        "group_1": {
            "algorithm": "sparse_softmax",
            "targets": ["LlamaAttention"],
            "sparsity_n": 2,
            "sparsity_m": 4,
            "dense_sink_tokens": 0,
            "dense_recent_tokens": 64,
        },
    },
    "producer": {"name": "modelopt", "version": "0.37.0"},
}
G0 = "sparse_attention_config.config_groups.group_0"
LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "torch_dtype": "float32",
}


def test_modelopt_docstring_example_parses(caplog):
    with caplog.at_level(logging.WARNING):
        s = parse_sparse_attention_config(copy.deepcopy(MODELOPT_EXAMPLE))
    assert s.prefill == PhaseCalibration(7.93, 8.61, 0.5)
    # decode is calibrated but has no target: ModelOpt serves it at 0.5, so do we, and say so.
    assert s.decode == PhaseCalibration(0.12, 9.85, 0.5)
    assert "target_sparsity.decode is missing" in caplog.text
    assert s.attention_classes == ("LlamaAttention",)
    assert s.group_name == "group_0"
    assert math.isclose(s.prefill.scale_factor, 7.93 * math.exp(8.61 * 0.5))


def test_absent_phase_is_dense_and_scalar_target_applies_to_both():
    block = copy.deepcopy(MODELOPT_EXAMPLE)
    g = block["config_groups"]["group_0"]
    del g["threshold_scale_factor"]["decode"]
    g["target_sparsity"] = 0.7
    g["ignore"] = ["model.layers.0.self_attn"]
    s = parse_sparse_attention_config(block)
    assert s.decode is None and s.phase("decode") is None
    assert s.prefill.target_sparsity == 0.7
    assert s.disabled_layers == ("model.layers.0.self_attn",)


def _set(path, value):
    def mutate(block):
        node = block
        *parents, last = path
        for key in parents:
            node = node[key]
        if value is _DELETE:
            del node[last]
        else:
            node[last] = value

    return mutate


_DELETE = object()
TSF = ["config_groups", "group_0", "threshold_scale_factor"]
GRP = ["config_groups", "group_0"]

T = f"{G0}.threshold_scale_factor"
POS = "must be a finite positive number"
UNIT = "must be a number in [0, 1)"
MALFORMED = [
    (_set(TSF + ["prefill", "a"], float("nan")), f"{T}.prefill.a: {POS}, got nan"),
    (_set(TSF + ["prefill", "a"], float("inf")), f"{T}.prefill.a: {POS}, got inf"),
    (_set(TSF + ["prefill", "a"], -1.0), f"{T}.prefill.a: {POS}, got -1.0"),
    (_set(TSF + ["prefill", "a"], "7.9"), f"{T}.prefill.a: {POS}, got '7.9'"),
    (_set(TSF + ["prefill", "a"], True), f"{T}.prefill.a: {POS}, got True"),
    (_set(TSF + ["decode", "b"], _DELETE), f"{T}.decode.b: missing"),
    (_set(TSF + ["decode", "b"], None), f"{T}.decode.b: {POS}, got None"),
    (_set(TSF + ["decode", "b"], 0.0), f"{T}.decode.b: {POS}, got 0.0"),
    (_set(TSF + ["decode"], [0.12, 9.85]), f"{T}.decode: must be a JSON object"),
    (_set(TSF + ["formula"], "a * b"), f"{T}.formula: must be 'a * exp(b * target_sparsity)'"),
    (_set(TSF, _DELETE), f"{T}: must be a JSON object, got NoneType"),
    (_set(TSF, {"formula": "a * exp(b * target_sparsity)"}), f"{T}: calibrates no phase"),
    (_set(GRP + ["target_sparsity", "prefill"], 1.0), f"{G0}.target_sparsity.prefill: {UNIT}, got 1.0"),
    (_set(GRP + ["target_sparsity", "prefill"], -0.1), f"{G0}.target_sparsity.prefill: {UNIT}, got -0.1"),
    (_set(GRP + ["target_sparsity", "prefill"], "0.5"), f"{G0}.target_sparsity.prefill: {UNIT}, got '0.5'"),
    (_set(GRP + ["target_sparsity"], 1.5), f"{G0}.target_sparsity: {UNIT}, got 1.5"),
    (_set(GRP + ["target_sparsity"], {"prefil": 0.5}), f"{G0}.target_sparsity.prefil: unknown phase"),
    (
        _set(GRP + ["algorithm"], "skip_sofmax"),
        f"{G0}.algorithm: unknown algorithm 'skip_sofmax'; supported: ['skip_softmax', 'sparse_softmax'",
    ),
    (_set(GRP + ["ignore"], "layer0"), f"{G0}.ignore: must be a list of strings"),
    (_set(GRP + ["observed_sparsity_range"], {"prefill": [0.9, 0.1]}), f"{G0}.observed_sparsity_range.prefill: "),
    (_set(GRP + ["fit"], {"prefill": {"r2": "high"}}), f"{G0}.fit.prefill.r2: must be a finite number"),
    (_set(GRP, _DELETE), "sparse_attention_config.config_groups: has no group with algorithm 'skip_softmax'"),
    (_set(["config_groups"], {}), "sparse_attention_config.config_groups: is empty"),
    (_set(["config_groups"], _DELETE), "sparse_attention_config.config_groups: must be a JSON object, got NoneType"),
    (
        _set(["config_groups", "group_1", "algorithm"], "skip_softmax"),
        "several skip_softmax groups ['group_0', 'group_1']",
    ),
]


@pytest.mark.parametrize(
    "mutate,message", MALFORMED, ids=[f"{i}-{m[1].split(': ')[0][24:]}" for i, m in enumerate(MALFORMED)]
)
def test_malformed_block_error_names_the_field(mutate, message):
    block = copy.deepcopy(MODELOPT_EXAMPLE)
    block["config_groups"]["group_0"]["target_sparsity"]["decode"] = 0.5
    mutate(block)
    with pytest.raises(SparseAttentionConfigError) as info:
        parse_sparse_attention_config(block)
    assert message in str(info.value)


def test_block_must_be_an_object():
    with pytest.raises(SparseAttentionConfigError, match=r"^sparse_attention_config: must be a JSON object"):
        parse_sparse_attention_config([1, 2])


def test_target_outside_observed_range_warns(caplog):
    block = build_sparse_attention_config(
        {"prefill": {"a": 2.0, "b": 9.0, "sparsity_range": (0.2, 0.6)}}, target_sparsity=0.9
    )
    with caplog.at_level(logging.WARNING):
        s = parse_sparse_attention_config(block)
    assert s.prefill.observed_sparsity_range == (0.2, 0.6)
    assert "outside the sparsity range observed during calibration [0.200, 0.600]" in caplog.text
    caplog.clear()
    block["config_groups"]["group_0"]["target_sparsity"]["prefill"] = 0.5
    with caplog.at_level(logging.WARNING):
        parse_sparse_attention_config(block)
    assert "outside" not in caplog.text


def _ckpt(tmp_path, extra=None):
    cfg = dict(LLAMA_CONFIG, **(extra or {}))
    (tmp_path / "config.json").write_text(json.dumps(cfg, indent=2))
    return tmp_path


def test_build_write_load_round_trip(tmp_path):
    ckpt = _ckpt(tmp_path)
    fits = {
        "prefill": {"a": 7.93, "b": 8.61, "r2": 0.97, "n_points": 412, "sparsity_range": (0.05, 0.93)},
        "decode": PhaseCalibration(0.12, 9.85, 0.3, observed_sparsity_range=(0.1, 0.8), r2=0.9, n_points=50),
    }
    block = build_sparse_attention_config(
        fits, target_sparsity={"prefill": 0.6}, attention_classes=["LlamaAttention"], ignore=["model.layers.0"]
    )
    g = block["config_groups"]["group_0"]
    assert g["target_sparsity"] == {"prefill": 0.6, "decode": 0.3}  # decode keeps the target its fit carried
    assert g["observed_sparsity_range"] == {"prefill": [0.05, 0.93], "decode": [0.1, 0.8]}
    assert g["fit"] == {"prefill": {"r2": 0.97, "n_points": 412}, "decode": {"r2": 0.9, "n_points": 50}}
    assert block["producer"]["name"] == "modelopt_ext"
    write_sparse_attention_config(ckpt, block)
    s = load_sparse_attention_config(ckpt)
    assert s == SparseAttentionSettings(
        prefill=PhaseCalibration(7.93, 8.61, 0.6, (0.05, 0.93), 0.97, 412),
        decode=PhaseCalibration(0.12, 9.85, 0.3, (0.1, 0.8), 0.9, 50),
        disabled_layers=("model.layers.0",),
        attention_classes=("LlamaAttention",),
    )
    # settings rebuild the same block
    again = build_sparse_attention_config(s, producer=block["producer"])
    assert again == block
    # a standalone block file loads the same way
    write_json_atomic(tmp_path / "sparse_attention_config.json", block)
    assert load_sparse_attention_config(tmp_path / "sparse_attention_config.json") == s
    assert settings_from_hf_config(json.loads((ckpt / "config.json").read_text())) == s


def test_build_requires_a_target_and_rejects_bad_fits():
    with pytest.raises(ValueError, match="no target sparsity for calibrated phase 'prefill'"):
        build_sparse_attention_config({"prefill": {"a": 1.0, "b": 5.0}})
    with pytest.raises(SparseAttentionConfigError, match=r"prefill\.a: must be a finite positive number, got nan"):
        build_sparse_attention_config({"prefill": {"a": float("nan"), "b": 5.0}}, target_sparsity=0.5)
    with pytest.raises(ValueError, match="unknown phases"):
        build_sparse_attention_config({"prefil": {"a": 1.0, "b": 5.0}}, target_sparsity=0.5)


def test_load_without_block_is_none_and_errors_name_the_file(tmp_path):
    ckpt = _ckpt(tmp_path)
    assert load_sparse_attention_config(ckpt) is None
    assert load_sparse_attention_config(ckpt / "config.json") is None
    with pytest.raises(FileNotFoundError, match="containing config.json"):
        load_sparse_attention_config(tmp_path / "nope")
    bad = copy.deepcopy(MODELOPT_EXAMPLE)
    bad["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"]["a"] = -3
    _ckpt(tmp_path, {"sparse_attention_config": bad})
    with pytest.raises(SparseAttentionConfigError) as info:
        load_sparse_attention_config(ckpt)
    assert f"{G0}.threshold_scale_factor.prefill.a: must be a finite positive number, got -3" in str(info.value)
    assert str(ckpt / "config.json") in str(info.value)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(SparseAttentionConfigError, match="not valid JSON"):
        load_sparse_attention_config(ckpt)


def test_write_keeps_other_keys_and_groups_and_backs_up(tmp_path):
    existing = copy.deepcopy(MODELOPT_EXAMPLE)
    # put the old skip group second to check it is replaced in place
    existing["config_groups"] = {
        "group_0": existing["config_groups"]["group_1"],
        "group_1": existing["config_groups"]["group_0"],
    }
    existing["sparse_softmax"] = {"sparsity_n": 2}
    ckpt = _ckpt(tmp_path, {"sparse_attention_config": existing, "rope_theta": 10000.0})
    original = (ckpt / "config.json").read_bytes()
    block = build_sparse_attention_config({"prefill": {"a": 3.0, "b": 7.0}}, target_sparsity=0.4)
    write_sparse_attention_config(ckpt, block)
    cfg = json.loads((ckpt / "config.json").read_text())
    for key, value in LLAMA_CONFIG.items():
        assert cfg[key] == value
    assert cfg["rope_theta"] == 10000.0
    sac = cfg["sparse_attention_config"]
    assert list(sac["config_groups"]) == ["group_0", "group_1"]
    assert sac["config_groups"]["group_0"] == MODELOPT_EXAMPLE["config_groups"]["group_1"]
    assert sac["config_groups"]["group_1"] == block["config_groups"]["group_0"]
    assert sac["sparse_softmax"] == {"sparsity_n": 2}
    assert sac["producer"] == block["producer"]
    assert (ckpt / "config.json.bak").read_bytes() == original
    # A second write never overwrites the first backup.
    write_sparse_attention_config(ckpt, block)
    assert (ckpt / "config.json.bak").read_bytes() == original
    stamped = [p for p in os.listdir(ckpt) if p.startswith("config.json.") and p != "config.json.bak"]
    assert len(stamped) == 1 and stamped[0].endswith(".bak")
    assert not [p for p in os.listdir(ckpt) if p.endswith(".tmp")]


def test_write_adds_skip_group_beside_a_sparse_softmax_only_block(tmp_path):
    existing = {"config_groups": {"group_0": copy.deepcopy(MODELOPT_EXAMPLE["config_groups"]["group_1"])}}
    ckpt = _ckpt(tmp_path, {"sparse_attention_config": existing})
    block = build_sparse_attention_config({"decode": {"a": 0.1, "b": 9.0}}, target_sparsity=0.5)
    write_sparse_attention_config(ckpt, block, backup=False)
    groups = json.loads((ckpt / "config.json").read_text())["sparse_attention_config"]["config_groups"]
    assert groups["group_0"]["algorithm"] == "sparse_softmax"
    assert groups["group_1"]["algorithm"] == "skip_softmax"
    assert not (ckpt / "config.json.bak").exists()
    assert load_sparse_attention_config(ckpt).decode == PhaseCalibration(0.1, 9.0, 0.5)


def test_failed_write_leaves_the_original_intact(tmp_path, monkeypatch):
    ckpt = _ckpt(tmp_path)
    original = (ckpt / "config.json").read_bytes()
    block = build_sparse_attention_config({"prefill": {"a": 3.0, "b": 7.0}}, target_sparsity=0.4)
    unserialisable = copy.deepcopy(block)
    unserialisable["producer"] = {"name": object()}
    with pytest.raises(TypeError):
        write_sparse_attention_config(ckpt, unserialisable)
    nan_extra = copy.deepcopy(block)
    nan_extra["notes"] = float("nan")  # JSON has no NaN: refused rather than written as invalid JSON
    with pytest.raises(ValueError):
        write_sparse_attention_config(ckpt, nan_extra)
    with pytest.raises(TypeError):
        write_json_atomic(ckpt / "config.json", {"x": object()})

    # A crash between writing the temp file and renaming it.
    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_sparse_attention_config(ckpt, block, backup=False)
    monkeypatch.undo()
    assert (ckpt / "config.json").read_bytes() == original
    assert sorted(os.listdir(ckpt)) == ["config.json"]


def test_write_requires_existing_config(tmp_path):
    block = build_sparse_attention_config({"prefill": {"a": 3.0, "b": 7.0}}, target_sparsity=0.4)
    with pytest.raises(FileNotFoundError, match="config.json"):
        write_sparse_attention_config(tmp_path, block)
    with pytest.raises(SparseAttentionConfigError):
        write_sparse_attention_config(tmp_path, {"config_groups": {}})


@settings(max_examples=60, deadline=None)
@given(
    a=st.floats(1e-6, 1e6),
    b=st.floats(1e-3, 50.0),
    t_pre=st.floats(0.0, 0.999),
    t_dec=st.one_of(st.none(), st.floats(0.0, 0.999)),
)
def test_round_trip_property(tmp_path_factory, a, b, t_pre, t_dec):
    fits = {"prefill": {"a": a, "b": b}, "decode": None if t_dec is None else {"a": b, "b": a % 40 + 0.01}}
    targets = {"prefill": t_pre, "decode": t_dec}
    block = build_sparse_attention_config(fits, target_sparsity=targets)
    ckpt = _ckpt(tmp_path_factory.mktemp("ckpt"))
    write_sparse_attention_config(ckpt, block, backup=False)
    s = load_sparse_attention_config(ckpt)
    assert s.prefill == PhaseCalibration(a, b, t_pre)
    assert s.decode == (None if t_dec is None else PhaseCalibration(b, a % 40 + 0.01, t_dec))


def test_importable_without_vllm_torch_or_modelopt():
    """The serving side reads configs before any model loads: these modules must stay light."""
    code = (
        "import sys\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.plugins.sparse_attn_config\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.calibration.data\n"
        "heavy = {'vllm', 'torch', 'transformers', 'modelopt', 'matplotlib', 'scipy'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
