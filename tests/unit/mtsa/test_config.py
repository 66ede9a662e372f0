"""Mode config validation: presets parse, ModelOpt's names, old names deprecated, every error names its field."""

from __future__ import annotations

import warnings

import pytest

import modelopt_ext.torch.sparsity.attention_sparsity as mtsa
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.errors import SparseAttentionConfigError
from modelopt_ext.torch.sparsity.attention_sparsity.config import as_config


def test_presets_parse():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # our presets use the current names
        default = as_config(mtsa.SKIP_SOFTMAX_DEFAULT)
        calib = as_config(mtsa.SKIP_SOFTMAX_CALIB)
    (pattern, layer), = default.layer_patterns()
    assert pattern == "*self_attn*" and layer.thresholds == {"prefill": 1e-3, "decode": 1e-4}
    assert default.calibration is None
    assert calib.calibration.target_sparse_ratio == {"prefill": 0.5, "decode": 0.5}
    assert calib.calibration.num_decode_tokens > 0 and calib.calibration.chunk_size > 0
    # A bare sparse_cfg dict is accepted too, and a ModelOpt-style dump round-trips.
    assert as_config({"*attn*": {}}).sparse_cfg["*attn*"]["method"] == "skip_softmax"
    assert as_config(calib.model_dump()) == calib


def test_modelopt_spellings_are_accepted():
    cfg = as_config({"*attn*": {"thresholds": {"prefill": [1e-3], "decode": [1e-5]}, "backend": "pytorch"},
                     "calibration": {"target_sparse_ratio": {"prefill": 1.0}, "num_decode_tokens": 4}})  # fmt: skip
    (_, layer), = cfg.layer_patterns()
    assert layer.thresholds == {"prefill": 1e-3, "decode": 1e-5}  # ModelOpt's list form: its first λ is applied
    assert layer.backend == "torch"
    assert cfg.calibration.target_sparse_ratio == {"prefill": 1.0, "decode": 0.0}
    assert cfg.calibration.num_decode_tokens == 4


@pytest.mark.parametrize(
    "old,new,value,attr",
    [
        ("threshold", "thresholds", {"prefill": 1e-3}, {"prefill": 1e-3, "decode": None}),
        ("decode_tokens", "num_decode_tokens", 5, 5),
    ],
)
def test_old_names_work_with_a_deprecation_warning(old, new, value, attr):
    where = "calibration" if old == "decode_tokens" else "*attn*"
    sparse_cfg = {"*attn*": {}, where: {old: value}}
    with pytest.warns(DeprecationWarning, match=rf"'{old}' is deprecated, use '{new}'"):
        cfg = as_config(sparse_cfg)
    entry = cfg.sparse_cfg[where]
    assert old not in entry and entry[new] == attr
    # the old attribute names still read (callers of the old API)
    obj = cfg.calibration if where == "calibration" else cfg.layer_patterns()[0][1]
    assert getattr(obj, old) == attr
    with pytest.raises(SparseAttentionConfigError, match=rf"{old}: is the deprecated name of '{new}'"):
        as_config({"*attn*": {}, where: {old: value, new: value}})


@pytest.mark.parametrize(
    "sparse_cfg,message",
    [
        ({"*attn*": {"method": "flash"}}, r"^sparse_cfg\['\*attn\*'\]\.method: must be one of \['skip_softmax'\]"),
        ({"*attn*": {"thresholds": {"prefill": 1.5}}},
         r"^sparse_cfg\['\*attn\*'\]\.thresholds\.prefill: must be None \(dense\) or a number in \(0, 1\), got 1.5"),
        ({"*attn*": {"thresholds": {"prefil": 0.1}}},
         r"^sparse_cfg\['\*attn\*'\]\.thresholds\.prefil: unknown key; did you mean 'prefill'\?"),
        ({"*attn*": {"thresholds": {"decode": []}}},
         r"thresholds\.decode: must be a number in \(0, 1\) or a non-empty"),
        ({"*attn*": {"thresholds": "low"}},
         r"\*'\]\.thresholds: must be None \(dense\) or a number in \(0, 1\) \(or a map phase -> value\), got 'low'"),
        ({"*attn*": {"backend": "cuda"}}, r"^sparse_cfg\['\*attn\*'\]\.backend: must be one of \['auto', 'torch'"),
        ({"*attn*": {"enabled": True}}, r"^sparse_cfg\['\*attn\*'\]\.enabled: unknown key; did you mean 'enable'\?"),
        ({"*attn*": {"enable": "yes"}}, r"\.enable: must be true or false, got 'yes'"),
        ({"*attn*": {}, "calibration": {"target_sparse_ratio": {"decode": 1.2}}},
         r"^sparse_cfg\['calibration'\]\.target_sparse_ratio\.decode: must be a sparsity in \[0, 1\], got 1.2"),
        ({"*attn*": {}, "calibration": {"target_sparse_ratio": {"decod": 0.5}}},
         r"target_sparse_ratio\.decod: unknown key; did you mean 'decode'\?"),
        ({"*attn*": {}, "calibration": {"target_sparse_ratio": {"prefill": 0, "decode": 0}}},
         r"target_sparse_ratio: is 0 for both phases: nothing to calibrate"),
        ({"*attn*": {}, "calibration": {"threshold_trials": [1.0, -1.0, 2.0]}},
         r"threshold_trials: must be a list of finite positive scale factors"),
        ({"*attn*": {}, "calibration": {"threshold_trials": [1.0, 2.0]}}, r"threshold_trials: needs at least 3"),
        ({"*attn*": {}, "calibration": {"samples": 0}},
         r"^sparse_cfg\['calibration'\]\.samples: must be an integer >= 1"),
        ({"*attn*": {}, "calibration": {"num_decode_tokens": -1}},
         r"num_decode_tokens: must be an integer >= 0, got -1"),
        ({"*attn*": {}, "calibration": {"chunk_size": 0}}, r"chunk_size: must be an integer >= 1, got 0"),
        ({"*attn*": {}, "calibration": {"chunk_size": 1.5}}, r"chunk_size: must be an integer >= 1, got 1.5"),
        ({"*attn*": {}, "calibration": {"num_length_bins": 4}},
         r"calibration'\]\.num_length_bins: unknown key; expected one of \['target_sparse_ratio'"),
        ({"*attn*": []}, r"^sparse_cfg\['\*attn\*'\]: must be a dict"),
        ({"calibration": {}}, r"^sparse_cfg: selects no modules"),
    ],
)  # fmt: skip
def test_errors_name_the_field_and_the_fix(sparse_cfg, message):
    with pytest.raises(SparseAttentionConfigError, match=message):
        as_config({"sparse_cfg": sparse_cfg})


def test_several_errors_are_all_reported():
    with pytest.raises(SparseAttentionConfigError) as info:
        as_config({"*attn*": {}, "calibration": {"samples": 0, "chunk_size": True}})
    lines = str(info.value).splitlines()
    assert lines == [
        "sparse_cfg['calibration'].samples: must be an integer >= 1, got 0",
        "sparse_cfg['calibration'].chunk_size: must be an integer >= 1, got True",
    ]


def test_modelopt_style_lambda_trials_warn(caplog):
    as_config({"*attn*": {}, "calibration": {"threshold_trials": [1e-3, 1e-2, 1e-1]}})
    assert "trials are scale factors λ·n (NVIDIA ModelOpt's are λ)" in caplog.text


def test_sparsify_rejects_bad_config_before_touching_the_model(tiny_llama):
    model = tiny_llama(0)
    with pytest.raises(ValueError, match=r"thresholds\.decode"):
        mtsa.sparsify(model, {"*self_attn*": {"thresholds": {"decode": 2.0}}})
    assert model.config._attn_implementation == "sdpa"
    assert not mtsa.is_sparse_attention_model(model)
