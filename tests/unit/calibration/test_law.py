"""The served law as a value (checkpoint/law.py): what a calibration serves, where a step can drop, trial laws."""

from __future__ import annotations

import math
import random

import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.law import DENSE, Law, PhaseLaw


def test_a_calibration_serves_its_log_scale_factor_and_exponent():
    rng = random.Random(7)
    for _ in range(20):
        a, b, target = rng.uniform(0.01, 5.0), rng.uniform(1.0, 12.0), rng.uniform(0.1, 0.9)
        gamma, n_ref = rng.uniform(0.5, 2.5), rng.choice([None, 1024, 4096])
        calib = PhaseCalibration(a=a, b=b, target_sparsity=target, length_exponent=gamma, reference_length=n_ref)
        law = PhaseLaw.of(calib)
        expected = math.log(a) + b * target + ((gamma - 1.0) * math.log(n_ref) if n_ref else 0.0)
        assert law.c == pytest.approx(expected, rel=1e-12) and law.gamma == gamma
        assert law.c == pytest.approx(math.log(calib.scale_factor) + (law.gamma - 1.0) * math.log(n_ref or 1))
    assert PhaseLaw.of(None) == DENSE and DENSE.is_dense
    assert PhaseLaw.of(PhaseCalibration(a=0.0, b=3.0, target_sparsity=0.5)).is_dense  # ModelOpt's a = 0: dense


def test_can_drop_is_decided_at_the_lowest_lambda_of_the_lengths():
    law = PhaseLaw(c=math.log(100.0), gamma=1.0)  # λ = 100 / n: drops only past n = 100
    assert not law.can_drop(100) and law.can_drop(101)
    flat = PhaseLaw(c=-0.1, gamma=0.0)  # a static λ < 1 drops at every length
    assert flat.can_drop(1)
    rising = PhaseLaw(c=0.2, gamma=-0.5)  # γ <= 0: smallest at n = 1
    assert not rising.can_drop(10**6)
    assert not DENSE.can_drop(10**9)
    both = Law(PhaseLaw(math.log(100.0), 1.0), PhaseLaw(math.log(10.0), 1.0))
    assert both.can_drop(11) and not Law(both.prefill, DENSE).can_drop(11)


def test_law_of_settings_and_of_trial_values():
    pre = PhaseCalibration(a=2.0, b=3.0, target_sparsity=0.5)
    settings = SparseAttentionSettings(prefill=pre, decode=None)
    law = Law.of(settings)
    assert law.prefill == PhaseLaw.of(pre) and law.decode == DENSE and not law.is_dense
    assert Law.of(None).is_dense and Law().is_dense
    trial = Law.from_values([1.5, -2.0, 1.1, 0.9])  # (c_prefill, c_decode, γ_prefill, γ_decode)
    assert trial.c == (1.5, -2.0) and trial.gamma == (1.1, 0.9)
    assert trial.replace("decode", DENSE).decode.is_dense and trial.replace("decode", DENSE).prefill == trial.prefill
    assert hash(trial) == hash(Law.from_values((1.5, -2.0, 1.1, 0.9)))  # a value: equal laws are one key
