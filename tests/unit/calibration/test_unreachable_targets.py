"""A target the law cannot reach at short lengths (λ >= 1: those rows run dense) is named, never silent."""

from __future__ import annotations

import math

import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import PhaseFit
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import PhaseCalibration


@pytest.mark.parametrize("target", [0.3, 0.5, 0.7])
def test_checkpoint_calibration_and_fit_agree_on_the_dense_cut(target):
    fit = PhaseFit(a=0.0214, b=13.18, r2=0.94, n_points=395, sparsity_range=(0.02, 0.9), phase="prefill",
                   length_exponent=1.58, reference_length=2080.0)  # fmt: skip
    cal = fit.to_phase_calibration(target)
    assert cal.dense_below == pytest.approx(fit.dense_below(target), rel=1e-9)
    cut = cal.dense_below
    n = int(cut)
    # the row law of docs/skip_softmax.md: λ = exp(c − γ·ln n)
    assert math.exp(cal.log_scale_factor - cal.length_exponent * math.log(n)) >= 1.0
    assert math.exp(cal.log_scale_factor - cal.length_exponent * math.log(n + 1)) < 1.0
    note = cal.describe_unreachable("prefill")
    assert note is not None and f"up to {n} tokens" in note and f"target {target:g}" in note


def test_reachable_everywhere_and_static_thresholds_say_nothing():
    assert PhaseCalibration(0.01, 1.0, 0.3).describe_unreachable("decode") is None  # λ = 0.027/n < 1 for all n
    static = PhaseCalibration(0.1, 0.0, 0.5, length_exponent=0.0)  # ModelOpt's static λ = 0.1
    assert static.dense_below == 0.0 and static.describe_unreachable("prefill") is None
    never = PhaseCalibration(2.0, 0.0, 0.5, length_exponent=0.0)  # a static λ >= 1: nothing is ever skipped
    assert math.isinf(never.dense_below) and "every length" in never.describe_unreachable("prefill")
