"""Calibration on a tiny Llama (custom forward loop), export to ModelOpt's schema, mto save/restore round-trip."""

from __future__ import annotations

import copy
import json

import modelopt.torch.opt as mto
import pytest
import torch
from mtsa_models import make_byte_tokenizer, make_tiny_llama, random_ids

import modelopt_ext.torch.sparsity.attention_sparsity as mtsa
from modelopt_ext.torch.sparsity.attention_sparsity.calibration.calibrate import run_sample
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
    load_sparse_attention_config,
    parse_sparse_attention_config,
)
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.constants import LENGTH_EXPONENT_RANGE

TARGETS = {"prefill": 0.3, "decode": 0.4}
CALIB_CFG = {
    "sparse_cfg": {
        "calibration": {"target_sparse_ratio": TARGETS},
        "*self_attn*": {"method": "skip_softmax", "backend": "torch"},
    }
}


def forward_loop(model):
    """Three unpadded prompts, chunked prefill (chunks of 256) then 6 decode steps each."""
    for i, n in enumerate((512, 1024, 1536)):  # long enough for tiles before the recent window
        run_sample(model, random_ids(n, seed=100 + i), chunk_size=256, decode_tokens=6)


@pytest.fixture(scope="module")
def calibrated():
    dense = make_tiny_llama(11)
    model = mtsa.sparsify(copy.deepcopy(dense), CALIB_CFG, forward_loop)
    return dense, model


def test_calibration_fits_both_phases(calibrated):
    _, model = calibrated
    states = mtsa.sparse_attention_states(model)
    assert len(states) == 2
    first = next(iter(states.values())).calibration
    for phase, target in TARGETS.items():
        cal = first[phase]
        assert cal is not None and cal.a > 0 and cal.b > 0
        assert cal.target_sparsity == target
        assert cal.n_points >= 6 and cal.r2 > 0.5
    for state in states.values():
        assert state.calibration == first  # one fit, merged over layers, on every module


def test_calibrated_model_hits_target_roughly(calibrated):
    dense, model = calibrated
    mtsa.reset_sparse_attention_stats(model)
    ids = random_ids(1280, seed=555)  # held out: not a calibration prompt
    with torch.no_grad():
        out = model(ids).logits
        ref = dense(ids).logits
    realized = mtsa.realized_sparsity(model)["prefill"]
    assert abs(realized - TARGETS["prefill"]) < 0.2, realized
    assert (out.argmax(-1) == ref.argmax(-1)).double().mean() > 0.9
    text = mtsa.print_sparse_attention_summary(model, print_fn=None)
    assert "model.layers.1.self_attn" in text and f"@{TARGETS['prefill']:.2f}" in text


def test_export_block_parses_and_writes(calibrated, tmp_path):
    _, model = calibrated
    block = mtsa.export_sparse_attention_config(model)
    settings = parse_sparse_attention_config(block)
    cal = next(iter(mtsa.sparse_attention_states(model).values())).calibration
    assert settings.prefill.a == pytest.approx(cal["prefill"].a) and settings.decode.b == pytest.approx(cal["decode"].b)
    assert settings.prefill.target_sparsity == TARGETS["prefill"]
    assert settings.attention_classes == ("LlamaAttention",)
    # Into a saved HF checkpoint's config.json (other keys kept, backup made).
    make_tiny_llama(11).save_pretrained(tmp_path)
    mtsa.export_sparse_attention_config(model, tmp_path)
    loaded = load_sparse_attention_config(tmp_path)
    assert loaded.decode.a == pytest.approx(cal["decode"].a)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    assert (tmp_path / "config.json.bak").exists()


def test_set_target_sparsity_moves_the_length_exponent_with_the_target(calibrated):
    """A new target without recalibrating is served with that target's γ (pivot + slope·(target − 0.5)), not the old
    target's, and exports the same law: the checkpoint's pivot γ and slope are unchanged."""
    dense, model = calibrated
    model = copy.deepcopy(model)
    before = {p: c for p, c in next(iter(mtsa.sparse_attention_states(model).values())).calibration.items()}
    assert before["prefill"].length_exponent_slope != 0.0  # lengths 512-1536+: the fit has a slope to move along
    block = mtsa.export_sparse_attention_config(model)["config_groups"]["group_0"]
    new_target = 0.45
    mtsa.set_target_sparsity(model, {"prefill": new_target})
    after = next(iter(mtsa.sparse_attention_states(model).values())).calibration
    old, new = before["prefill"], after["prefill"]
    assert new.target_sparsity == new_target and after["decode"] == before["decode"]
    lo, hi = LENGTH_EXPONENT_RANGE  # served γ is clipped
    expected = min(max(old.pivot_length_exponent + old.length_exponent_slope * (new_target - 0.5), lo), hi)
    assert lo < expected < hi
    assert new.length_exponent == pytest.approx(expected, abs=1e-12)
    assert new.pivot_length_exponent == pytest.approx(old.pivot_length_exponent, abs=1e-12)
    again = mtsa.export_sparse_attention_config(model)["config_groups"]["group_0"]
    for key in ("length_exponent", "length_exponent_slope", "reference_length"):
        assert again[key]["prefill"] == pytest.approx(block[key]["prefill"], abs=1e-12), key
    assert again["target_sparsity"]["prefill"] == new_target
    # served: the higher target skips more on a held-out prompt
    ids = random_ids(1280, seed=556)
    realized = {}
    for target in (0.2, new_target):
        mtsa.set_target_sparsity(model, {"prefill": target})
        mtsa.reset_sparse_attention_stats(model)
        with torch.no_grad():
            model(ids)
        realized[target] = mtsa.realized_sparsity(model)["prefill"]
    assert realized[0.2] < realized[new_target], realized


def test_export_lists_disabled_layers(calibrated):
    _, model = calibrated
    model = copy.deepcopy(model)
    mtsa.disable_sparse_attention(model, "*layers.1.*")
    block = mtsa.export_sparse_attention_config(model)
    assert parse_sparse_attention_config(block).disabled_layers == ("model.layers.1.self_attn",)


def test_mto_save_restore_round_trip(calibrated, tmp_path):
    _, model = calibrated
    state = mto.modelopt_state(model)
    (mode_name, mode_state), = state["modelopt_state_dict"]
    assert mode_name == mtsa.MODE_NAME
    saved_cal = mode_state["metadata"]["modules"]["model.layers.0.self_attn"]["calibration"]
    assert saved_cal["prefill"]["target_sparsity"] == TARGETS["prefill"]

    path = tmp_path / "model.pth"
    mto.save(model, path)
    restored = mto.restore(make_tiny_llama(99), path)  # other random weights: all must come from the file
    assert restored.config._attn_implementation == mtsa.ATTN_IMPLEMENTATION
    for name, st in mtsa.sparse_attention_states(restored).items():
        assert st.calibration == mtsa.sparse_attention_states(model)[name].calibration
        assert st.enabled
    ids = random_ids(300, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(restored(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_restore_keeps_disabled_modules(calibrated, tmp_path):
    _, model = calibrated
    model = copy.deepcopy(model)
    mtsa.disable_sparse_attention(model, "*layers.0.*")
    mto.save(model, tmp_path / "m.pth")
    restored = mto.restore(make_tiny_llama(11), tmp_path / "m.pth")
    assert {n: s.enabled for n, s in mtsa.sparse_attention_states(restored).items()} == {
        "model.layers.0.self_attn": False,
        "model.layers.1.self_attn": True,
    }


def test_unfittable_phase_is_a_clear_error():
    model = mtsa.sparsify(make_tiny_llama(12), {"*self_attn*": {}})
    cfg = {"sparse_cfg": {"calibration": {"threshold_trials": [1e-9, 2e-9, 4e-9]}, "*self_attn*": {}}}
    with pytest.raises(mtsa.CalibrationFitError, match=r"prefill calibration.*threshold_trials"):
        mtsa.calibrate(model, cfg, forward_loop)


def test_phase_with_zero_target_stays_dense():
    model = make_tiny_llama(13)
    cfg = {"sparse_cfg": {"calibration": {"target_sparse_ratio": {"prefill": 0.3, "decode": 0.0}}, "*self_attn*": {}}}

    def prefill_only(m):
        for i, n in enumerate((512, 1024, 1536)):  # long enough for tiles before the recent window
            run_sample(m, random_ids(n, seed=200 + i), chunk_size=512, decode_tokens=0)

    mtsa.sparsify(model, cfg, prefill_only)
    cal = next(iter(mtsa.sparse_attention_states(model).values())).calibration
    assert cal["prefill"] is not None and cal["decode"] is None
    group = mtsa.export_sparse_attention_config(model)["config_groups"]["group_0"]
    assert "decode" not in group["threshold_scale_factor"]


def test_decode_without_decode_steps_names_the_fix():
    model = make_tiny_llama(14)

    def prefill_only(m):
        run_sample(m, random_ids(512, seed=300), chunk_size=512, decode_tokens=0)

    with pytest.raises(mtsa.CalibrationFitError, match="decode"):
        mtsa.sparsify(model, CALIB_CFG, prefill_only)


def test_calibrate_needs_a_sparsified_model_and_data():
    with pytest.raises(ValueError, match="mtsa.sparsify"):
        mtsa.calibrate(make_tiny_llama(15), CALIB_CFG, forward_loop)
    model = mtsa.sparsify(make_tiny_llama(15), {"*self_attn*": {}})
    with pytest.raises(ValueError, match=r"sparse_cfg\['calibration'\] is missing"):
        mtsa.calibrate(model)
    with pytest.raises(ValueError, match="not calibrated"):
        mtsa.export_sparse_attention_config(model)


def test_default_forward_loop_uses_the_shared_prompts(tmp_path):
    """No forward_loop: RULER-style prompts from calibration.data, chunked prefill (3 chunks at 1k) + decode."""
    model = make_tiny_llama(16)
    calib = {"target_sparse_ratio": {"prefill": 0.3, "decode": 0.3}, "samples": 4, "max_seqlen": 1024,
             "min_seqlen": 512, "num_decode_tokens": 4, "chunk_size": 384, "cache_dir": str(tmp_path)}  # fmt: skip
    mtsa.sparsify(model, {"sparse_cfg": {"calibration": calib, "*self_attn*": {}}}, tokenizer=make_byte_tokenizer())
    cal = next(iter(mtsa.sparse_attention_states(model).values())).calibration
    assert cal["prefill"].n_points >= 6 and cal["decode"].n_points >= 6
    assert list(tmp_path.glob("calib_prompts_*.json")), "the data builder's cache was used"
    with pytest.raises(ValueError, match="pass forward_loop"):
        mtsa.calibrate(model)  # a model built in code has no tokenizer to load


def test_restore_in_a_fresh_process_after_importing_mtsa(calibrated, tmp_path):
    """`import mto; import mtsa; mto.restore(...)` works in a new interpreter, with no mtsa name used first."""
    import subprocess
    import sys
    from pathlib import Path

    _, model = calibrated
    path = tmp_path / "model.pth"
    mto.save(model, path)
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import modelopt.torch.opt as mto
import modelopt_ext.torch.sparsity.attention_sparsity  # noqa: F401  (no mtsa attribute used before restore)
from mtsa_models import make_tiny_llama
restored = mto.restore(make_tiny_llama(5), {str(path)!r})
print("ATTN", restored.config._attn_implementation)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ATTN modelopt_ext_skip_softmax" in proc.stdout
