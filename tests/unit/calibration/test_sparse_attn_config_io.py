"""sparse_attention_config: parsing (ModelOpt schema + ours), every mistake named, building, merging, atomic I/O."""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import subprocess
import sys
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
    PhaseCalibration,
    SparseAttentionConfigError,
    SparseAttentionSettings,
    build_sparse_attention_config,
    linked_checkpoint_copy,
    load_sparse_attention_config,
    merge_sparse_attention_config,
    parse_sparse_attention_config,
    settings_from_hf_config,
    write_json_atomic,
    write_sparse_attention_config,
)
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.constants import (
    CONTRACT_VERSION,
    MODELOPT_STATIC_THRESHOLD,
)

# The skip group of the example output in ModelOpt 0.47's conversion.export_sparse_attention_config docstring.
SKIP_GROUP = {
    "algorithm": "skip_softmax",
    "targets": ["LlamaAttention"],
    "threshold_scale_factor": {
        "formula": "a * exp(b * target_sparsity)",
        "prefill": {"a": 7.93, "b": 8.61},
        "decode": {"a": 0.12, "b": 9.85},
    },
    "target_sparsity": {"prefill": 0.5},
}
NM_GROUP = {
    "algorithm": "sparse_softmax",
    "targets": ["LlamaAttention"],
    "sparsity_n": 2,
    "sparsity_m": 4,
    "dense_sink_tokens": 0,
    "dense_recent_tokens": 64,
}
PRODUCER = {"name": "modelopt", "version": "0.37.0"}
# That docstring example in full: skip-softmax plus an N:M sparse_softmax group.
MODELOPT_EXAMPLE = {"config_groups": {"group_0": SKIP_GROUP, "group_1": NM_GROUP}, "producer": PRODUCER}
SKIP_ONLY = {"config_groups": {"group_0": SKIP_GROUP}, "producer": PRODUCER}
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


def _block(**group_changes):
    block = copy.deepcopy(SKIP_ONLY)
    block["config_groups"]["group_0"].update(group_changes)
    return block


def test_modelopt_docstring_example_parses(caplog):
    with caplog.at_level(logging.WARNING):
        s = parse_sparse_attention_config(copy.deepcopy(SKIP_ONLY))
    assert s.prefill == PhaseCalibration(7.93, 8.61, 0.5)
    # decode is calibrated but has no target: ModelOpt serves it at 0.5, so do we, and say so.
    assert s.decode == PhaseCalibration(0.12, 9.85, 0.5)
    assert "target_sparsity.decode is missing" in caplog.text
    # ModelOpt's (a, b) count 128x128 blocks: served here they realize more sparsity; the load says so
    assert "calibrated by NVIDIA ModelOpt" in caplog.text and "Recalibrate with modelopt_ext" in caplog.text
    assert s.attention_classes == ("LlamaAttention",)
    assert s.group_name == "group_0"
    assert math.isclose(s.prefill.scale_factor, 7.93 * math.exp(8.61 * 0.5))
    # the serving law: ln λ_row = ln a + b·target − 1·ln n
    assert s.prefill.length_exponent == 1.0 and s.decode.length_exponent == 1.0
    assert math.isclose(s.prefill.log_scale_factor, math.log(7.93) + 8.61 * 0.5, rel_tol=1e-15)


def test_nm_sparse_softmax_group_is_refused_at_load_naming_group_and_fix():
    """ModelOpt serves N:M on top of skip-softmax; serving without it would silently change numerics."""
    with pytest.raises(SparseAttentionConfigError) as info:
        parse_sparse_attention_config(copy.deepcopy(MODELOPT_EXAMPLE))
    msg = str(info.value)
    assert msg.startswith("sparse_attention_config.config_groups.group_1: algorithm 'sparse_softmax' (2:4 N:M")
    assert "remove group 'group_1'" in msg and "ModelOpt's own vLLM plugin" in msg
    # triton_sparse_softmax is the same to ModelOpt's loader; the top-level params override the group's
    block = copy.deepcopy(MODELOPT_EXAMPLE)
    block["config_groups"]["group_1"]["algorithm"] = "triton_sparse_softmax"
    block["sparse_softmax"] = {"sparsity_n": 4, "sparsity_m": 8}
    with pytest.raises(SparseAttentionConfigError, match=r"group_1: algorithm 'triton_sparse_softmax' \(4:8 N:M"):
        parse_sparse_attention_config(block)
    # sparsity_n = 0 is no N:M for ModelOpt either: accepted
    block["sparse_softmax"] = {"sparsity_n": 0}
    assert parse_sparse_attention_config(block).prefill == PhaseCalibration(7.93, 8.61, 0.5)
    # an N:M group alone refuses the same way
    with pytest.raises(SparseAttentionConfigError, match="group_0: algorithm 'sparse_softmax'"):
        parse_sparse_attention_config({"config_groups": {"group_0": copy.deepcopy(NM_GROUP)}})


VALID_MODELOPT_BLOCKS = [
    # (what ModelOpt's exporter or fit can write, expected prefill, expected decode)
    ("b = 0 (ModelOpt's fit bounds b to [0, 20])",
     {"threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 3.0, "b": 0.0}},
      "target_sparsity": {"prefill": 0.5, "decode": 0.5}},
     PhaseCalibration(3.0, 0.0, 0.5), None),
    ("negative b (ModelOpt's log-space fit is unbounded)",
     {"threshold_scale_factor": {"prefill": {"a": 3.0, "b": -2.5}}, "target_sparsity": 0.4},
     PhaseCalibration(3.0, -2.5, 0.4), None),
    ("target 1.0", {"target_sparsity": {"prefill": 1.0, "decode": 1.0}},
     PhaseCalibration(7.93, 8.61, 1.0), PhaseCalibration(0.12, 9.85, 1.0)),
    ("a = 0 (bounded fit): ModelOpt serves the phase dense",
     {"threshold_scale_factor": {"prefill": {"a": 0.0, "b": 3.0}, "decode": {"a": 0.12, "b": 9.85}},
      "target_sparsity": 0.5},
     None, PhaseCalibration(0.12, 9.85, 0.5)),
    ("null phase", {"threshold_scale_factor": {"prefill": None, "decode": {"a": 0.12, "b": 9.85}}},
     None, PhaseCalibration(0.12, 9.85, 0.5)),
    ("targets as ints", {"target_sparsity": {"prefill": 0, "decode": 1}},
     PhaseCalibration(7.93, 8.61, 0.0), PhaseCalibration(0.12, 9.85, 1.0)),
]  # fmt: skip


@pytest.mark.parametrize(
    "what,changes,prefill,decode", VALID_MODELOPT_BLOCKS, ids=[v[0] for v in VALID_MODELOPT_BLOCKS]
)
def test_every_valid_modelopt_block_is_accepted(what, changes, prefill, decode):
    s = parse_sparse_attention_config(_block(**changes))
    assert (s.prefill, s.decode) == (prefill, decode)


def test_skip_group_without_calibration_serves_modelopts_static_threshold(caplog):
    """ModelOpt 0.47 serves such a group with SKIP_SOFTMAX_TRITON_DEFAULT: λ = 0.1 for every row, both phases."""
    for group in (
        {"algorithm": "skip_softmax", "targets": ["LlamaAttention"]},
        {"algorithm": "skip_softmax", "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)"},
         "ignore": ["model.layers.0.self_attn"]},
    ):  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            s = parse_sparse_attention_config({"config_groups": {"group_0": group}})
        assert s.prefill == s.decode
        cal = s.prefill
        assert cal.length_exponent == 0.0 and cal.is_static
        assert cal.log_scale_factor == math.log(MODELOPT_STATIC_THRESHOLD) and cal.scale_factor == 0.1
        assert "static default threshold λ = 0.1" in caplog.text
        assert s.disabled_layers == tuple(group.get("ignore", ()))
        if group.get("ignore"):
            assert "is honoured here" in caplog.text


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


def _rename(path, new):
    def mutate(block):
        node = block
        for key in path[:-1]:
            node = node[key]
        node[new] = node.pop(path[-1])

    return mutate


_DELETE = object()
TSF = ["config_groups", "group_0", "threshold_scale_factor"]
GRP = ["config_groups", "group_0"]

T = f"{G0}.threshold_scale_factor"
A_OK = "must be a finite number >= 0"
SP = "must be a sparsity in [0, 1]"
MISTAKES = [
    (_set(TSF + ["prefill", "a"], float("nan")), f"{T}.prefill.a: {A_OK}, got nan"),
    (_set(TSF + ["prefill", "a"], float("inf")), f"{T}.prefill.a: {A_OK}, got inf"),
    (_set(TSF + ["prefill", "a"], -1.0), f"{T}.prefill.a: {A_OK}, got -1.0"),
    (_set(TSF + ["prefill", "a"], "7.9"), f"{T}.prefill.a: {A_OK}, got '7.9'"),
    (_set(TSF + ["prefill", "a"], True), f"{T}.prefill.a: {A_OK}, got True"),
    (_set(TSF + ["decode", "b"], _DELETE), f"{T}.decode.b: missing (the fit scale_factor = a * exp(b"),
    (_set(TSF + ["decode", "b"], None), f"{T}.decode.b: must be a finite number, got None"),
    (_set(TSF + ["decode", "b"], float("-inf")), f"{T}.decode.b: must be a finite number, got -inf"),
    (_set(TSF + ["decode", "b"], 2000), f"{T}.decode.b: a * exp(b * target_sparsity) = exp(997.88) overflows"),
    (_set(TSF + ["decode", "c"], 1.0), f"{T}.decode.c: unknown key; expected one of ['a', 'b']"),
    (_set(TSF + ["decode"], [0.12, 9.85]), f"{T}.decode: must be a JSON object, got list [0.12, 9.85]"),
    (_set(TSF + ["formula"], "a * b"), f"{T}.formula: must be 'a * exp(b * target_sparsity)', got 'a * b'"),
    (_rename(TSF + ["prefill"], "prefil"), f"{T}.prefil: unknown key; did you mean 'prefill'?"),
    (_rename(TSF + ["decode"], "Decode"), f"{T}.Decode: unknown key; did you mean 'decode'?"),
    (_set(TSF, [1]), f"{T}: must be a JSON object, got list [1]"),
    (_set(GRP + ["target_sparsity", "prefill"], 1.01), f"{G0}.target_sparsity.prefill: {SP}, got 1.01"),
    (_set(GRP + ["target_sparsity", "prefill"], -0.1), f"{G0}.target_sparsity.prefill: {SP}, got -0.1"),
    (_set(GRP + ["target_sparsity", "prefill"], "0.5"), f"{G0}.target_sparsity.prefill: {SP}, got '0.5'"),
    (_set(GRP + ["target_sparsity"], 1.5), f"{G0}.target_sparsity: {SP} (or a map phase -> sparsity), got 1.5"),
    (_set(GRP + ["target_sparsity"], "high"), f"{G0}.target_sparsity: {SP} or a map phase -> sparsity, got 'high'"),
    (_set(GRP + ["target_sparsity"], {"prefil": 0.5}), f"{G0}.target_sparsity.prefil: unknown key; did you mean"),
    (
        _set(GRP + ["algorithm"], "skip_sofmax"),
        f"{G0}.algorithm: unknown algorithm 'skip_sofmax'; did you mean 'skip_softmax'? supported: ['skip_softmax'",
    ),
    (_set(GRP + ["algorithm"], _DELETE), f"{G0}.algorithm: missing (every group names its algorithm"),
    (_set(GRP + ["ignore"], "layer0"), f"{G0}.ignore: must be a list of strings, got 'layer0'"),
    (_set(GRP + ["ignored"], ["layer0"]), f"{G0}.ignored: unknown key; did you mean 'ignore'?"),
    (_rename(GRP + ["target_sparsity"], "target_sparse_ratio"), f"{G0}.target_sparse_ratio: unknown key; did you mean 'target_sparsity'?"),  # noqa: E501
    (_set(GRP + ["initial_disabled_steps"], -1), f"{G0}.initial_disabled_steps: must be an integer >= 0, got -1"),
    (_set(GRP + ["initial_disabled_steps"], 1.5), f"{G0}.initial_disabled_steps: must be an integer >= 0, got 1.5"),
    (_set(GRP + ["observed_sparsity_range"], {"prefill": [0.9, 0.1]}), f"{G0}.observed_sparsity_range.prefill: must be [lo, hi]"),  # noqa: E501
    (_set(GRP + ["observed_sparsity_range"], {"prefll": [0.1, 0.9]}), f"{G0}.observed_sparsity_range.prefll: unknown key; did you mean 'prefill'?"),  # noqa: E501
    (_set(GRP + ["fit"], {"prefill": {"r2": "high"}}), f"{G0}.fit.prefill.r2: must be a finite number, got 'high'"),
    (_set(GRP + ["fit"], {"prefill": {"r_2": 0.9}}), f"{G0}.fit.prefill.r_2: unknown key; did you mean 'r2'?"),
    (_set(GRP + ["length_exponent"], {"prefill": 4.5}), f"{G0}.length_exponent.prefill: must be a number in [0, 4], got 4.5"),  # noqa: E501
    (_set(GRP + ["length_exponent"], {"prefill": float("nan")}), f"{G0}.length_exponent.prefill: must be a number in [0, 4], got nan"),  # noqa: E501
    (_set(GRP + ["length_exponent"], {"decod": 1.0}), f"{G0}.length_exponent.decod: unknown key; did you mean 'decode'?"),  # noqa: E501
    (_set(["config_groups", "group_0"], {"algorithm": "sparse_softmax", "sparsity_n": 0}), "sparse_attention_config.config_groups: has no group with algorithm 'skip_softmax'"),  # noqa: E501
    (_set(["config_groups"], {}), "sparse_attention_config.config_groups: is empty"),
    (_set(["config_groups"], _DELETE), "sparse_attention_config.config_groups: missing (add a group"),
    (_rename(["config_groups"], "config_group"), "sparse_attention_config.config_group: unknown key; did you mean 'config_groups'?"),  # noqa: E501
    (_set(["config_groups", "group_1"], copy.deepcopy(SKIP_GROUP)), "several skip_softmax groups ['group_0', 'group_1']"),  # noqa: E501
    (_set(["config_groups", "group_1"], "x"), "sparse_attention_config.config_groups.group_1: must be a JSON object, got string 'x'"),  # noqa: E501
    (_set(["producer"], [1]), "sparse_attention_config.producer: must be a JSON object, got list [1]"),
]  # fmt: skip


@pytest.mark.parametrize(
    "mutate,message", MISTAKES, ids=[f"{i}-{m[1].split(': ')[0][24:]}" for i, m in enumerate(MISTAKES)]
)
def test_every_mistake_is_an_error_naming_the_field(mutate, message):
    block = copy.deepcopy(SKIP_ONLY)
    block["config_groups"]["group_0"]["target_sparsity"]["decode"] = 0.5
    mutate(block)
    with pytest.raises(SparseAttentionConfigError) as info:
        parse_sparse_attention_config(block)
    assert message in str(info.value)


def test_length_law_is_read_and_must_belong_to_a_calibrated_phase():
    s = parse_sparse_attention_config(
        _block(length_exponent={"prefill": 0.6, "decode": 0}, reference_length={"prefill": 2048}, target_sparsity=0.5)
    )
    assert s.prefill.length_exponent == 0.6 and s.decode.length_exponent == 0.0
    assert s.prefill.reference_length == 2048 and s.decode.reference_length is None
    # c = ln a + b·target + (γ − 1)·ln n_ref: ModelOpt's λ = a·exp(b·target)/n exactly at n = n_ref
    c = s.prefill.log_scale_factor
    assert c == pytest.approx(math.log(7.93) + 8.61 * 0.5 - 0.4 * math.log(2048), rel=1e-15)
    assert math.exp(c - 0.6 * math.log(2048)) == pytest.approx(7.93 * math.exp(8.61 * 0.5) / 2048, rel=1e-13)
    assert s.prefill.scale_factor == pytest.approx(7.93 * math.exp(8.61 * 0.5), rel=1e-15)  # ModelOpt's (a, b)
    assert s.decode.log_scale_factor == pytest.approx(math.log(0.12) + 9.85 * 0.5, rel=1e-15)
    for key, value in (("length_exponent", 1.2), ("reference_length", 512)):
        block = _block(**{key: {"decode": value}})
        del block["config_groups"]["group_0"]["threshold_scale_factor"]["decode"]
        with pytest.raises(SparseAttentionConfigError, match=rf"{G0}\.{key}\.decode: is set but "
                           r"threshold_scale_factor\.decode does not calibrate decode"):  # fmt: skip
            parse_sparse_attention_config(block)
    with pytest.raises(SparseAttentionConfigError, match=rf"{G0}\.reference_length\.prefill: must be a finite "
                       r"number >= 1, got 0"):  # fmt: skip
        parse_sparse_attention_config(_block(reference_length={"prefill": 0}))


def test_overflow_is_an_error_not_a_crash_and_the_settings_guard_it():
    # exp(8.61 + 800·1) overflows a float64: ModelOpt 0.47 raises OverflowError (math range error) on it.
    with pytest.raises(SparseAttentionConfigError, match=rf"{G0}\.threshold_scale_factor\.prefill\.b: .* overflows"):
        parse_sparse_attention_config(_block(threshold_scale_factor={"prefill": {"a": 7.93, "b": 800.0}},
                                             target_sparsity=1.0))  # fmt: skip
    # the same b at target 0 is fine (exp(ln a) = a)
    s = parse_sparse_attention_config(_block(threshold_scale_factor={"prefill": {"a": 7.93, "b": 800.0}},
                                             target_sparsity=0.0))  # fmt: skip
    assert s.prefill.scale_factor == pytest.approx(7.93)
    # a PhaseCalibration made in code never raises OverflowError either
    cal = PhaseCalibration(1.0, 2000.0, 0.5)
    assert cal.log_scale_factor == 1000.0 and cal.scale_factor == math.inf


def test_unknown_group_and_top_level_keys_are_kept_and_reported_once(caplog, tmp_path):
    key = f"future_key_{uuid.uuid4().hex[:8]}"  # a key no earlier test reported
    block = _block(**{key: {"x": 1}})
    block["serving_hints"] = {"y": 2}
    with caplog.at_level(logging.WARNING):
        s1 = parse_sparse_attention_config(block)
        s2 = parse_sparse_attention_config(block)
    assert s1 == s2
    assert f"{G0}.{key}" in s1.unknown_keys
    assert caplog.text.count(f"{G0}.{key}") == 1, caplog.text
    assert "kept when the block is rewritten" in caplog.text
    # kept on rewrite (recalibration)
    ckpt = _ckpt(tmp_path, {"sparse_attention_config": block})
    write_sparse_attention_config(ckpt, build_sparse_attention_config({"prefill": {"a": 2.0, "b": 5.0}},
                                                                      target_sparsity=0.3), backup=False)  # fmt: skip
    written = json.loads((ckpt / "config.json").read_text())["sparse_attention_config"]
    assert written["config_groups"]["group_0"][key] == {"x": 1}
    assert written["serving_hints"] == {"y": 2}


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


def test_contract_version_is_the_kernels_and_an_older_calibration_warns_naming_the_fix(caplog):
    """Our calibrations record the contract they were made under (a λ means something else in another version):
    a block of ours without it (made before version 4) or with another version still loads, with a warning that
    names the recalibration (and, for version 4, that it now overshoots); the checkpoint constant is the
    kernels' own."""
    from modelopt_ext.torch.kernels.sparsity.attention.semantics import CONTRACT_VERSION as KERNELS_VERSION

    assert CONTRACT_VERSION == KERNELS_VERSION == 5
    ours = {"name": "modelopt_ext", "version": "0.9.0"}
    for version, expected in [(None, "before contract versions were recorded"), (3, "under contract version 3"),
                              (4, "above the target"), (CONTRACT_VERSION, None)]:  # fmt: skip
        block = _block(**({} if version is None else {"contract_version": version}))
        block["producer"] = ours
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            settings = parse_sparse_attention_config(block)
        assert settings.prefill is not None
        if expected is None:
            assert "Recalibrate" not in caplog.text
        else:
            assert expected in caplog.text and "calibrate_sparse_attn.py" in caplog.text
    with pytest.raises(SparseAttentionConfigError, match="contract_version"):
        parse_sparse_attention_config(_block(contract_version=0))


def test_build_write_load_round_trip(tmp_path):
    ckpt = _ckpt(tmp_path)
    fits = {
        "prefill": {"a": 7.93, "b": 8.61, "r2": 0.97, "n_points": 412, "sparsity_range": (0.05, 0.93),
                    "length_exponent": 0.8},
        "decode": PhaseCalibration(0.12, 9.85, 0.3, observed_sparsity_range=(0.1, 0.8), r2=0.9, n_points=50),
    }  # fmt: skip
    block = build_sparse_attention_config(
        fits, target_sparsity={"prefill": 0.6}, attention_classes=["LlamaAttention"], ignore=["model.layers.0"]
    )
    g = block["config_groups"]["group_0"]
    assert g["target_sparsity"] == {"prefill": 0.6, "decode": 0.3}  # decode keeps the target its fit carried
    assert g["observed_sparsity_range"] == {"prefill": [0.05, 0.93], "decode": [0.1, 0.8]}
    assert g["fit"] == {"prefill": {"r2": 0.97, "n_points": 412}, "decode": {"r2": 0.9, "n_points": 50}}
    assert g["length_exponent"] == {"prefill": 0.8}  # ModelOpt's γ = 1 is not written
    assert block["producer"]["name"] == "modelopt_ext" and g["contract_version"] == CONTRACT_VERSION
    write_sparse_attention_config(ckpt, block)
    s = load_sparse_attention_config(ckpt)
    assert s == SparseAttentionSettings(
        prefill=PhaseCalibration(7.93, 8.61, 0.6, (0.05, 0.93), 0.97, 412, length_exponent=0.8),
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
    with pytest.raises(SparseAttentionConfigError, match=r"prefill\.a: must be a finite number >= 0, got nan"):
        build_sparse_attention_config({"prefill": {"a": float("nan"), "b": 5.0}}, target_sparsity=0.5)
    with pytest.raises(SparseAttentionConfigError, match=r"prefill\.b: .* overflows"):
        build_sparse_attention_config({"prefill": {"a": 1.0, "b": 2000.0}}, target_sparsity=0.5)
    with pytest.raises(ValueError, match="unknown phases"):
        build_sparse_attention_config({"prefil": {"a": 1.0, "b": 5.0}}, target_sparsity=0.5)
    static = PhaseCalibration(0.1, 0.0, 0.0, length_exponent=0.0)
    with pytest.raises(ValueError, match="static threshold"):
        build_sparse_attention_config({"prefill": static})


def test_load_without_block_is_none_and_errors_name_the_file(tmp_path):
    ckpt = _ckpt(tmp_path)
    assert load_sparse_attention_config(ckpt) is None
    assert load_sparse_attention_config(ckpt / "config.json") is None
    with pytest.raises(FileNotFoundError, match="containing config.json"):
        load_sparse_attention_config(tmp_path / "nope")
    bad = copy.deepcopy(SKIP_ONLY)
    bad["config_groups"]["group_0"]["threshold_scale_factor"]["prefill"]["a"] = -3
    _ckpt(tmp_path, {"sparse_attention_config": bad})
    with pytest.raises(SparseAttentionConfigError) as info:
        load_sparse_attention_config(ckpt)
    assert f"{G0}.threshold_scale_factor.prefill.a: must be a finite number >= 0, got -3" in str(info.value)
    assert str(ckpt / "config.json") in str(info.value)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(SparseAttentionConfigError, match="not valid JSON"):
        load_sparse_attention_config(ckpt)


def test_recalibration_keeps_policy_and_other_groups(tmp_path, caplog):
    """ignore, initial_disabled_steps, other per-group keys and other groups survive a recalibration."""
    existing = copy.deepcopy(MODELOPT_EXAMPLE)
    old_skip = existing["config_groups"]["group_0"]
    old_skip.update(
        ignore=["model.layers.0.self_attn"],
        initial_disabled_steps=3,
        observed_sparsity_range={"prefill": [0.1, 0.9], "decode": [0.2, 0.8]},
        length_exponent={"decode": 0.5},
        fit={"decode": {"r2": 0.5}},
        reference_length={"decode": 900},
    )
    # put the old skip group second to check it is replaced in place
    existing["config_groups"] = {"group_0": existing["config_groups"]["group_1"], "group_1": old_skip}
    existing["sparse_softmax"] = {"sparsity_n": 2}
    ckpt = _ckpt(tmp_path, {"sparse_attention_config": existing, "rope_theta": 10000.0})
    original = (ckpt / "config.json").read_bytes()
    block = build_sparse_attention_config({"prefill": {"a": 3.0, "b": 7.0}}, target_sparsity=0.4,
                                          attention_classes=["LlamaAttention"])  # fmt: skip
    with caplog.at_level(logging.WARNING):
        write_sparse_attention_config(ckpt, block)
    assert "keeps N:M group 'group_0'" in caplog.text  # said at write time, refused at load time
    cfg = json.loads((ckpt / "config.json").read_text())
    for key, value in LLAMA_CONFIG.items():
        assert cfg[key] == value
    assert cfg["rope_theta"] == 10000.0
    sac = cfg["sparse_attention_config"]
    assert list(sac["config_groups"]) == ["group_0", "group_1"]
    assert sac["config_groups"]["group_0"] == NM_GROUP
    skip = sac["config_groups"]["group_1"]
    assert skip == {
        "algorithm": "skip_softmax",
        "targets": ["LlamaAttention"],
        "ignore": ["model.layers.0.self_attn"],  # policy kept
        "initial_disabled_steps": 3,  # policy kept
        "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)", "prefill": {"a": 3.0, "b": 7.0}},
        "target_sparsity": {"prefill": 0.4},  # calibration replaced as a whole: no stale decode, range, fit, γ
        "contract_version": CONTRACT_VERSION,
    }
    assert sac["sparse_softmax"] == {"sparsity_n": 2}
    assert sac["producer"] == block["producer"]
    assert (ckpt / "config.json.bak").read_bytes() == original
    # A second write never overwrites the first backup.
    write_sparse_attention_config(ckpt, block)
    assert (ckpt / "config.json.bak").read_bytes() == original
    stamped = [p for p in os.listdir(ckpt) if p.startswith("config.json.") and p != "config.json.bak"]
    assert len(stamped) == 1 and stamped[0].endswith(".bak")
    assert not [p for p in os.listdir(ckpt) if p.endswith(".tmp")]
    # Without the N:M group the recalibrated checkpoint serves with the kept policy.
    del sac["config_groups"]["group_0"], sac["sparse_softmax"]
    s = parse_sparse_attention_config(sac)
    assert s.disabled_layers == ("model.layers.0.self_attn",) and s.initial_disabled_steps == 3
    assert s.prefill == PhaseCalibration(3.0, 7.0, 0.4) and s.decode is None


def test_merge_new_policy_wins_when_set():
    old = _block(ignore=["a"], initial_disabled_steps=2, targets=["Old"])
    new = build_sparse_attention_config({"prefill": {"a": 1.0, "b": 2.0}}, target_sparsity=0.5, ignore=["b"],
                                        attention_classes=["LlamaAttention"])  # fmt: skip
    merged = merge_sparse_attention_config(old, new)["config_groups"]["group_0"]
    assert merged["ignore"] == ["b"] and merged["targets"] == ["LlamaAttention"]
    assert merged["initial_disabled_steps"] == 2


def test_write_refuses_to_merge_into_an_invalid_block(tmp_path):
    broken = _block(ignored=["x"])  # a typo in the existing policy: never silently carried on
    ckpt = _ckpt(tmp_path, {"sparse_attention_config": broken})
    block = build_sparse_attention_config({"prefill": {"a": 3.0, "b": 7.0}}, target_sparsity=0.4)
    with pytest.raises(SparseAttentionConfigError, match=r"group_0\.ignored: unknown key.*\n.*fix or remove"):
        write_sparse_attention_config(ckpt, block, backup=False)


def test_write_adds_skip_group_beside_a_sparse_softmax_only_block(tmp_path):
    existing = {"config_groups": {"group_0": copy.deepcopy(NM_GROUP)}}
    ckpt = _ckpt(tmp_path, {"sparse_attention_config": existing})
    block = build_sparse_attention_config({"decode": {"a": 0.1, "b": 9.0}}, target_sparsity=0.5)
    write_sparse_attention_config(ckpt, block, backup=False)
    sac = json.loads((ckpt / "config.json").read_text())["sparse_attention_config"]
    groups = sac["config_groups"]
    assert groups["group_0"] == NM_GROUP
    assert groups["group_1"]["algorithm"] == "skip_softmax"
    assert not (ckpt / "config.json.bak").exists()
    with pytest.raises(SparseAttentionConfigError, match="group_0: algorithm 'sparse_softmax'"):
        load_sparse_attention_config(ckpt)
    groups["group_0"]["sparsity_n"] = 0
    assert parse_sparse_attention_config(sac).decode == PhaseCalibration(0.1, 9.0, 0.5)


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
    b=st.floats(-50.0, 50.0),
    t_pre=st.floats(0.0, 1.0),
    t_dec=st.one_of(st.none(), st.floats(0.0, 1.0)),
    gamma=st.one_of(st.none(), st.floats(0.0, 4.0)),
    n_ref=st.one_of(st.none(), st.floats(1.0, 1e6)),
)
def test_round_trip_property(tmp_path_factory, a, b, t_pre, t_dec, gamma, n_ref):
    fits = {
        "prefill": {"a": a, "b": b, "length_exponent": gamma, "reference_length": n_ref},
        "decode": None if t_dec is None else {"a": abs(b) + 1e-3, "b": a % 40},
    }
    targets = {"prefill": t_pre, "decode": t_dec}
    block = build_sparse_attention_config(fits, target_sparsity=targets)
    ckpt = _ckpt(tmp_path_factory.mktemp("ckpt"))
    write_sparse_attention_config(ckpt, block, backup=False)
    s = load_sparse_attention_config(ckpt)
    law = {} if gamma is None or gamma == 1.0 else {"length_exponent": gamma, "reference_length": n_ref}
    assert s.prefill == PhaseCalibration(a, b, t_pre, **law)
    assert s.decode == (None if t_dec is None else PhaseCalibration(abs(b) + 1e-3, a % 40, t_dec))
    # the law in log space equals the product form wherever the product is representable
    shift = 0.0 if not law or n_ref is None else (gamma - 1.0) * math.log(n_ref)
    assert s.prefill.log_scale_factor == pytest.approx(math.log(a) + b * t_pre + shift, rel=1e-12, abs=1e-12)
    assert math.log(s.prefill.scale_factor) == pytest.approx(math.log(a) + b * t_pre, rel=1e-12, abs=1e-12)


def test_importable_without_vllm_torch_or_modelopt():
    """The serving side reads configs before any model loads: these modules must stay light."""
    code = (
        "import sys\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.schema\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.atomic_io\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit\n"
        "import modelopt_ext.torch.sparsity.attention_sparsity.calibration.data\n"
        "heavy = {'vllm', 'torch', 'transformers', 'modelopt', 'matplotlib', 'scipy'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_length_exponent_slope_gives_each_target_its_own_exponent(tmp_path, caplog):
    """γ(target) = length_exponent + length_exponent_slope·(target − 0.5): the checkpoint stores γ at the pivot,
    so a target edited by hand in config.json is served with its own γ, and a build → load round trip keeps it."""
    block = _block(length_exponent={"prefill": 1.8}, length_exponent_slope={"prefill": -1.5},
                   reference_length={"prefill": 2048}, target_sparsity=0.3)  # fmt: skip
    s = parse_sparse_attention_config(block)
    gamma = 1.8 - 1.5 * (0.3 - 0.5)
    assert s.prefill.length_exponent == pytest.approx(gamma, rel=1e-15)
    assert s.prefill.length_exponent_slope == -1.5 and s.prefill.pivot_length_exponent == pytest.approx(1.8)
    assert s.prefill.log_scale_factor == pytest.approx(
        math.log(7.93) + 8.61 * 0.3 + (gamma - 1.0) * math.log(2048), rel=1e-15
    )
    assert s.decode.length_exponent == 1.0 and s.decode.length_exponent_slope == 0.0  # no extras: ModelOpt's law
    # written back as γ at the pivot (not at this target), so the block is the same
    again = build_sparse_attention_config(s, producer=block["producer"])
    g = again["config_groups"]["group_0"]
    assert g["length_exponent"]["prefill"] == pytest.approx(1.8) and g["length_exponent_slope"] == {"prefill": -1.5}
    # the same block at another target (as a user edits it): that target's γ
    block["config_groups"]["group_0"]["target_sparsity"] = {"prefill": 0.7, "decode": 0.7}
    assert parse_sparse_attention_config(block).prefill.length_exponent == pytest.approx(1.8 - 1.5 * 0.2)
    # a target that would push γ out of [0, 4]: served at the bound, and the log says so at load
    steep = _block(length_exponent={"prefill": 1.0}, length_exponent_slope={"prefill": -10.0},
                   reference_length={"prefill": 2048}, target_sparsity=0.1)  # fmt: skip
    with caplog.at_level(logging.WARNING):
        assert parse_sparse_attention_config(steep).prefill.length_exponent == 4.0
    assert "length exponent 5 at target 0.1 lies outside [0, 4]; serving 4" in caplog.text
    # ... and written back with the checkpoint's own pivot γ, not one derived from the clipped value
    clipped = parse_sparse_attention_config(steep)
    assert clipped.prefill.pivot_length_exponent == 1.0
    rewritten = build_sparse_attention_config(clipped, producer=steep["producer"])["config_groups"]["group_0"]
    assert rewritten["length_exponent"]["prefill"] == 1.0 and rewritten["length_exponent_slope"]["prefill"] == -10.0
    # a new target on the loaded law (mtsa.set_target_sparsity) moves γ along the slope from that pivot
    assert clipped.prefill.at_target(0.45).length_exponent == pytest.approx(1.5)
    assert clipped.prefill.at_target(0.45).pivot_length_exponent == 1.0
    # a recalibration replaces the slope with the rest of the calibration (policy keys stay)
    plain = build_sparse_attention_config({"prefill": {"a": 2.0, "b": 9.0}}, target_sparsity=0.5)
    merged = merge_sparse_attention_config(block, plain)["config_groups"]["group_0"]
    assert "length_exponent_slope" not in merged and "length_exponent" not in merged
    # the slope belongs to a calibrated phase, and is a number
    bad = _block(length_exponent_slope={"decode": -1.0})
    del bad["config_groups"]["group_0"]["threshold_scale_factor"]["decode"]
    with pytest.raises(SparseAttentionConfigError, match=rf"{G0}\.length_exponent_slope\.decode: is set but "
                       r"threshold_scale_factor\.decode does not calibrate decode"):  # fmt: skip
        parse_sparse_attention_config(bad)
    with pytest.raises(SparseAttentionConfigError, match=rf"{G0}\.length_exponent_slope\.prefill: must be a finite"):
        parse_sparse_attention_config(_block(length_exponent_slope={"prefill": float("inf")}))


def test_linked_checkpoint_copy_links_weights_copies_config_and_never_touches_the_original(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors").write_bytes(os.urandom(256))
    (src / ".cache").mkdir()
    dst = linked_checkpoint_copy(src, tmp_path / "mine")
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    assert (dst / "model.safetensors").is_symlink() and not (dst / "config.json").is_symlink()
    block = build_sparse_attention_config({"prefill": {"a": 2.0, "b": 9.0}}, target_sparsity=0.5)
    write_sparse_attention_config(dst, block, backup=False)
    assert json.loads((src / "config.json").read_text()) == config  # the original is untouched
    assert load_sparse_attention_config(dst).prefill.a == 2.0
    with pytest.raises(FileExistsError, match="overwrite=True"):
        linked_checkpoint_copy(src, dst)
    assert load_sparse_attention_config(linked_checkpoint_copy(src, dst, overwrite=True)) is None  # a fresh copy
    with pytest.raises(ValueError, match="the checkpoint itself"):
        linked_checkpoint_copy(src, src, overwrite=True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        linked_checkpoint_copy(tmp_path / "mine" / "model.safetensors", tmp_path / "x")
    assert (src / "model.safetensors").exists()
