"""Exponential fit from calibration counts: recovery of a known law, the informative-point rule, clear errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import (
    CalibrationFitError,
    CalibrationRecord,
    FitPoint,
    PhaseFit,
    aggregate_counts,
    default_threshold_trials,
    fit_phase,
    fit_phases,
    plot_fit,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.sparse_attn_config import (
    build_sparse_attention_config,
    parse_sparse_attention_config,
)

A0, B0 = 7.93, 8.61  # ModelOpt's example prefill fit


def _law_points(n, a, b, sigma, seed=0):
    rng = np.random.default_rng(seed)
    s = rng.uniform(0.05, 0.95, n)
    sf = a * np.exp(b * s) * np.exp(rng.normal(0.0, sigma, n))
    return [FitPoint(float(x), float(y)) for x, y in zip(s, sf, strict=True)]


@pytest.mark.parametrize("a,b", [(A0, B0), (0.12, 9.85), (50.0, 4.0)])
def test_fit_recovers_known_law_with_noise(a, b):
    # Multiplicative noise of 10 % (sigma 0.1 in log space) on 500 points: the slope's standard error is about
    # 0.1 / (0.26 * sqrt(500)) = 0.017, so the tolerances below (|Δb| < 0.1, |Δ log a| < 0.06) are > 5 sigma.
    fit = fit_phase(_law_points(500, a, b, 0.1), phase="prefill")
    assert abs(fit.b - b) < 0.1
    assert abs(math.log(fit.a) - math.log(a)) < 0.06
    assert fit.r2 > 0.95
    assert fit.n_points == 500 and fit.n_total == 500
    assert 0.05 <= fit.sparsity_range[0] < 0.1 and 0.9 < fit.sparsity_range[1] <= 0.95


def test_saturated_points_are_dropped():
    pts = _law_points(200, A0, B0, 0.05)
    clean = fit_phase(pts)
    # trials far beyond saturation: nothing skipped at tiny sf, (almost) everything at huge sf
    junk = [FitPoint(0.0, 1e-3), FitPoint(0.005, 0.5), FitPoint(0.995, 1e6), FitPoint(1.0, 1e7)] * 50
    noisy = fit_phase(pts + junk)
    assert (noisy.a, noisy.b, noisy.n_points) == (clean.a, clean.b, 200)
    assert noisy.n_total == 400


def test_counts_to_fit_end_to_end():
    """Records shaped like the kernel's calibration counts recover the law that generated them."""
    trials = default_threshold_trials()
    records = []
    for seq, kv_len in enumerate([1024, 2048, 4096, 8192, 16384] * 4):
        for layer in range(3):  # per-layer shares of one sequence, summed by seq_id
            counts = []
            for sf in trials:
                lam = sf / kv_len
                s = 0.0 if lam >= 1 else min(max(math.log(sf / A0) / B0, 0.0), 1.0)
                visited = 300 + 10 * layer
                counts.append((visited, round(s * visited)))
            records.append(CalibrationRecord("prefill", kv_len, np.array(counts), seq_id=seq))
    points = aggregate_counts(records, trials)
    assert points["decode"] == []
    assert len(points["prefill"]) == sum(sf < k for k in [1024, 2048, 4096, 8192, 16384] * 4 for sf in trials)
    fits = fit_phases(points)
    assert set(fits) == {"prefill"}
    fit = fits["prefill"]
    assert abs(fit.b - B0) < 0.05 and abs(math.log(fit.a / A0)) < 0.05
    settings = parse_sparse_attention_config(
        build_sparse_attention_config(fits, target_sparsity=0.5, attention_classes=["LlamaAttention"])
    )
    assert settings.decode is None
    assert settings.prefill.n_points == fit.n_points
    assert settings.prefill.observed_sparsity_range == fit.sparsity_range
    assert fit.to_phase_calibration(0.5).scale_factor == pytest.approx(fit.scale_factor(0.5))


def test_aggregate_sums_raw_counts_not_ratios():
    trials = [10.0, 100.0]
    recs = [
        ("decode", 500, [[10, 1], [10, 9]], "s0"),
        ("decode", 500, [[30, 3], [30, 3]], "s0"),  # another TP rank's share of the same sequence
        {"phase": "decode", "kv_len": 501, "counts": [[8, 4], [8, 8]], "seq_id": "s0"},  # next decode step
        ("prefill", 50, [[4, 0], [0, 0]]),  # sf=100 >= kv_len: λ >= 1, dense by definition -> no point
    ]
    pts = aggregate_counts(recs, trials)
    assert sorted((p.kv_len, p.scale_factor, p.sparsity) for p in pts["decode"]) == [
        (500, 10.0, 4 / 40),
        (500, 100.0, 12 / 40),
        (501, 10.0, 0.5),
        (501, 100.0, 1.0),
    ]
    assert pts["prefill"] == [FitPoint(0.0, 10.0, 50)]


def test_aggregate_rejects_bad_counts():
    with pytest.raises(ValueError, match=r"record 0: counts must have shape \[T, 2\] = \[2, 2\]"):
        aggregate_counts([("prefill", 100, [[1, 0]])], [1.0, 2.0])
    with pytest.raises(ValueError, match="0 <= skipped <= visited"):
        aggregate_counts([("prefill", 100, [[1, 2], [1, 0]])], [1.0, 2.0])
    with pytest.raises(ValueError, match="phase must be one of"):
        aggregate_counts([("prefil", 100, [[1, 0], [1, 0]])], [1.0, 2.0])


def test_errors_say_what_to_change():
    with pytest.raises(CalibrationFitError, match="no measurements at all"):
        fit_phase([], phase="decode")
    # every trial too small: nothing skipped anywhere
    with pytest.raises(CalibrationFitError, match="raise the largest threshold trial") as info:
        fit_phase([FitPoint(0.0, sf) for sf in default_threshold_trials()], phase="prefill")
    assert "0 of 29 points are informative" in str(info.value)
    # every trial too large: everything skipped
    with pytest.raises(CalibrationFitError, match="lower the smallest threshold trial"):
        fit_phase([FitPoint(1.0, sf) for sf in default_threshold_trials()])
    # informative points at only two trials
    with pytest.raises(CalibrationFitError, match="distinct trials"):
        fit_phase([FitPoint(0.2 + 0.01 * i, 10.0 if i % 2 else 100.0) for i in range(20)])
    # sparsity falling as the threshold grows: the data are noise
    with pytest.raises(CalibrationFitError, match=r"b=-\S+ <= 0.*wider trials range"):
        fit_phase([FitPoint(0.9 - 0.04 * i, 2.0**i) for i in range(20)])


def test_default_trials_cover_typical_sparsities():
    trials = default_threshold_trials()
    assert len(trials) == 29 and trials[0] == pytest.approx(1e-2) and trials[-1] == pytest.approx(1e5)
    ratios = np.diff(np.log10(trials))
    assert np.allclose(ratios, 0.25, atol=1e-4)
    # ModelOpt's example fits (prefill and decode): sparsity 0.05 .. 0.95 lies inside the trials
    for a, b in [(A0, B0), (0.12, 9.85)]:
        assert trials[0] < a * math.exp(b * 0.05) and a * math.exp(b * 0.95) < trials[-1]
    with pytest.raises(ValueError):
        default_threshold_trials(10.0, 1.0)


def test_plot_fit_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    pts = {"prefill": _law_points(100, A0, B0, 0.1), "decode": _law_points(50, 0.12, 9.85, 0.1, seed=1)}
    fits = {phase: fit_phase(p, phase=phase) for phase, p in pts.items()}
    out = plot_fit(pts, fits, tmp_path / "sub" / "fit.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    img = imread(out)
    assert img.shape[0] == 450 and img.shape[1] == 1200  # two 6x4.5 in panels at 100 dpi
    assert isinstance(fits["prefill"], PhaseFit)
