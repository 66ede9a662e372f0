"""Config validation: presets parse, every error names its field."""

from __future__ import annotations

import pytest

import modelopt_ext.torch.sparsity.attention_sparsity as mtsa
from modelopt_ext.torch.sparsity.attention_sparsity.config import as_config


def test_presets_parse():
    default = as_config(mtsa.SKIP_SOFTMAX_DEFAULT)
    (pattern, layer), = default.layer_patterns()
    assert pattern == "*self_attn*" and layer.threshold == {"prefill": 1e-3, "decode": 1e-4}
    assert default.calibration is None
    calib = as_config(mtsa.SKIP_SOFTMAX_CALIB)
    assert calib.calibration.target_sparse_ratio == {"prefill": 0.5, "decode": 0.5}
    assert calib.calibration.decode_tokens > 0 and calib.calibration.chunk_size > 0
    # A bare sparse_cfg dict is accepted too, and a ModelOpt-style dump round-trips.
    assert as_config({"*attn*": {}}).sparse_cfg["*attn*"]["method"] == "skip_softmax"
    assert as_config(calib.model_dump()) == calib


@pytest.mark.parametrize(
    "sparse_cfg,field",
    [
        ({"*attn*": {"method": "flash"}}, r"sparse_cfg\['\*attn\*'\].*method"),
        ({"*attn*": {"threshold": {"prefill": 1.5}}}, r"sparse_cfg\['\*attn\*'\].*threshold\.prefill"),
        ({"*attn*": {"threshold": {"prefil": 0.1}}}, r"sparse_cfg\['\*attn\*'\].*threshold.*prefil"),
        ({"*attn*": {"backend": "cuda"}}, r"sparse_cfg\['\*attn\*'\].*backend"),
        ({"*attn*": {"enabled": True}}, r"sparse_cfg\['\*attn\*'\].*enabled"),
        ({"*attn*": {}, "calibration": {"target_sparse_ratio": {"decode": 1.0}}}, r"target_sparse_ratio\.decode"),
        ({"*attn*": {}, "calibration": {"target_sparse_ratio": {"prefill": 0, "decode": 0}}}, "target_sparse_ratio"),
        ({"*attn*": {}, "calibration": {"threshold_trials": [1.0, -1.0, 2.0]}}, "threshold_trials"),
        ({"*attn*": {}, "calibration": {"samples": 0}}, r"calibration'\].*samples"),
        ({"*attn*": {}, "calibration": {"decode_tokens": -1}}, "decode_tokens"),
        ({"*attn*": {}, "calibration": {"chunk_size": 0}}, "chunk_size"),
        ({"*attn*": []}, r"sparse_cfg\['\*attn\*'\]: must be a dict"),
        ({"calibration": {}}, "sparse_cfg: selects no modules"),
    ],
)
def test_errors_name_the_field(sparse_cfg, field):
    with pytest.raises(ValueError, match=field):
        as_config({"sparse_cfg": sparse_cfg})


def test_sparsify_rejects_bad_config_before_touching_the_model(tiny_llama):
    model = tiny_llama(0)
    with pytest.raises(ValueError, match="threshold.decode"):
        mtsa.sparsify(model, {"*self_attn*": {"threshold": {"decode": 2.0}}})
    assert model.config._attn_implementation == "sdpa"
    assert not mtsa.is_sparse_attention_model(model)
