"""From calibration tile counts to the per-phase fit `scale_factor = a * exp(b * sparsity)`.

Calibration runs each sequence once, dense, and counts for every threshold trial how many tiles serving would visit
and skip (docs/skip_softmax.md, "Counts"). Trials are *scale factors* `sf_t`; a sequence with `kv_len` keys is
tested at `λ = sf_t / kv_len`, so one trial list serves every length. Each (sequence, trial) gives one point
`(sparsity = skipped / visited, scale_factor = sf_t)`.

Fit (least squares on `log(scale_factor) = log(a) + b * sparsity`, i.e. relative error, as ModelOpt's
`fit_logspace`): scale factors span orders of magnitude, and λ acts multiplicatively (the skip test compares
against `ln λ`), so a relative error is the meaningful one and the largest trials must not dominate.

Length law (ours, beside ModelOpt's): the 1/kv_len law assumes the threshold for a given sparsity scales as 1/n.
Measured, it does not (decode sparsity at a fixed scale factor falls with length), so when the points span several
lengths the fit is `log(scale_factor) = log(a) + b * sparsity + (1 - γ(sparsity)) * log(n / n_ref)`, i.e.
`λ = a * exp(b * sparsity) / n_ref * (n_ref / n)^γ`, with the reference length `n_ref` the geometric mean of the
points' lengths. The exponent may vary with the sparsity, `γ(s) = γ + γ'·(s − 0.5)` (schema's
`LENGTH_EXPONENT_PIVOT`), fitted on level crossings only: measured on SmolLM2's held-out prose the threshold for
sparsity 0.3 falls as n^-2.5 while the one for 0.7 falls as n^-1.1, so one γ overshoots one end of the target range
at short lengths and the other at long ones. γ' is written as `length_exponent_slope`. At `n = n_ref` it is
ModelOpt's law with the same `(a, b)`, so a ModelOpt reader of the checkpoint (which knows only `a`, `b`) serves the
calibration exactly at the typical calibration length and approximately elsewhere, while our serving uses γ. A
single length (or `length_law=False`) gives ModelOpt's fit (γ = 1).

Estimator (ours, `length_law=True` and points that know their sample, as `aggregate_counts` makes them): ModelOpt's
regression of log(scale_factor) on the *measured* sparsity puts the scatter of the measurements (text to text,
sample to sample) in the regressor, which flattens the fitted slope: the law then lands short of its target at
both ends (measured on SmolLM2's calibration samples themselves: target 0.3 realized 0.26-0.27, target 0.7 up to
0.76). We instead invert each sample's own monotone curve at fixed sparsity levels (`LEVELS`): every sample that
spans a level gives the log scale factor where it crosses that level, and the regression is on those crossings,
with the exact level as regressor and all the scatter in log(scale_factor), which is what least squares models.
Points without a sample (plain `(sparsity, scale_factor)` pairs) use the point regression.

Informative-point rule: a point with sparsity <= `MIN_INFORMATIVE_SPARSITY` (0.01) or >= `MAX_INFORMATIVE_SPARSITY`
(0.99) is dropped. At those ends sparsity saturates (nothing or nearly everything skipped, or λ >= 1 which is dense
by definition), so any trial beyond the saturation point lands there and would bend the fit without telling it
anything about where the curve is.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.config_io import PHASES, PhaseCalibration
from ..checkpoint.constants import LENGTH_EXPONENT_PIVOT, LENGTH_EXPONENT_RANGE
from ..checkpoint.resolve import served_length_exponent

logger = logging.getLogger(__name__)

MIN_INFORMATIVE_SPARSITY = 0.01
MAX_INFORMATIVE_SPARSITY = 0.99
# Fewest informative points, and fewest distinct trials among them, for a fit we are willing to write.
MIN_POINTS = 6
MIN_DISTINCT_TRIALS = 3
# The length law needs lengths at least this far apart; γ is kept in a range where the law stays monotone and sane.
MIN_LENGTH_SPAN = 1.5
MIN_LENGTH_EXPONENT, MAX_LENGTH_EXPONENT = LENGTH_EXPONENT_RANGE  # what the checkpoint schema accepts
# Sparsity levels where each sample's curve is inverted (the level-crossing estimator, see the module docstring).
LEVELS = tuple(round(0.05 * i, 2) for i in range(1, 20))


class CalibrationFitError(ValueError):
    """The calibration data cannot support a fit; the message says what to change."""


@dataclass(frozen=True)
class CalibrationRecord:
    """Counts of one sequence (or one layer / TP-rank share of it) for all trials.

    `counts[t] = (visited, skipped)` at trial `t`. Records with the same `(phase, seq_id, kv_len)` are summed by
    `aggregate_counts` (raw counts over layers and ranks, never averaged ratios); `seq_id=None` makes a record
    its own sample.
    """

    phase: str
    kv_len: int
    counts: Any  # array-like [T, 2] of int (numpy, torch tensor or nested lists)
    seq_id: Any = None


@dataclass(frozen=True)
class FitPoint:
    """One (sequence, trial) measurement."""

    sparsity: float
    scale_factor: float
    kv_len: int = 0
    sample: int = -1  # which sample (sequence-step) it was measured on; -1 unknown (then no level crossings)


@dataclass(frozen=True)
class PhaseFit:
    """Result of `fit_phase`: the law, its log-space R², and the data it rests on."""

    a: float
    b: float
    r2: float
    n_points: int
    sparsity_range: tuple[float, float]
    n_total: int = 0
    phase: str = ""
    notes: tuple[str, ...] = field(default=())
    length_exponent: float = 1.0  # γ at LENGTH_EXPONENT_PIVOT: λ ∝ n^-γ at a fixed sparsity (1 = ModelOpt's law)
    reference_length: float | None = None  # n_ref where (a, b) is exactly ModelOpt's law; None for γ = 1
    length_range: tuple[int, int] | None = None  # shortest and longest sample the fit saw
    length_exponent_slope: float = 0.0  # dγ/d(sparsity): γ(s) = length_exponent + slope·(s − pivot)

    def exponent(self, target_sparsity: float) -> float:
        """γ served at `target_sparsity` (clipped to the schema's range)."""
        if self.length_exponent_slope == 0.0:
            return self.length_exponent
        return served_length_exponent(self.length_exponent, self.length_exponent_slope, target_sparsity, None)

    def scale_factor(self, target_sparsity: float) -> float:
        """ModelOpt's scale factor a·exp(b·target) (= λ·n at n = n_ref)."""
        return self.a * math.exp(self.b * target_sparsity)

    def log_scale_factor(self, target_sparsity: float) -> float:
        """c of docs/skip_softmax.md: ln λ_row = c − γ·ln(n)."""
        c = math.log(self.a) + self.b * target_sparsity
        if self.reference_length is not None:
            c += (self.exponent(target_sparsity) - 1.0) * math.log(self.reference_length)
        return c

    def threshold(self, target_sparsity: float, length: int) -> float:
        """λ of a row whose law length is `length` (>= 1 means dense)."""
        gamma = self.exponent(target_sparsity)
        return math.exp(self.log_scale_factor(target_sparsity) - gamma * math.log(max(length, 1)))

    def dense_below(self, target_sparsity: float) -> float:
        """Rows with law length <= this run dense at `target_sparsity` (λ >= 1): the law cannot reach the target
        there. 0 when every length is reachable, inf when none is."""
        c, gamma = self.log_scale_factor(target_sparsity), self.exponent(target_sparsity)
        if gamma <= 0:
            return math.inf if c >= 0 else 0.0
        return max(0.0, math.exp(c / gamma)) if c > 0 else 0.0

    def to_phase_calibration(self, target_sparsity: float) -> PhaseCalibration:
        extras = {}
        if self.reference_length is not None:
            pivot = self.length_exponent if self.length_exponent_slope else None
            extras = dict(length_exponent=self.exponent(target_sparsity), reference_length=self.reference_length,
                          length_exponent_slope=self.length_exponent_slope, stored_pivot_exponent=pivot)  # fmt: skip
        return PhaseCalibration(
            self.a,
            self.b,
            float(target_sparsity),
            observed_sparsity_range=self.sparsity_range,
            r2=self.r2,
            n_points=self.n_points,
            **extras,
        )


def default_threshold_trials(
    min_scale_factor: float = 1e-2, max_scale_factor: float = 1e5, per_decade: int = 4
) -> list[float]:
    """Log-spaced scale factors (λ·kv_len), 1e-2 .. 1e5 with 4 per decade (29 trials) by default.

    Why this range: ModelOpt 0.47 sweeps λ over 1e-6 .. 0.99 (20 trials) at lengths 1k..32k, i.e. scale factors
    ~1e-3 .. 3e4, and its example fits (prefill a≈7.9, b≈8.6; decode a≈0.12, b≈9.9) put sparsity 0.05..0.95 at
    scale factors ~0.2 .. 3e4. Trials at or above a sequence's kv_len mean λ >= 1 (dense) and are simply dropped.
    """
    if not 0 < min_scale_factor < max_scale_factor or per_decade < 1:
        raise ValueError("need 0 < min_scale_factor < max_scale_factor and per_decade >= 1")
    lo, hi = math.log10(min_scale_factor), math.log10(max_scale_factor)
    n = max(2, round((hi - lo) * per_decade) + 1)
    return [float(f"{v:.6g}") for v in np.logspace(lo, hi, n)]


def _as_counts(counts: Any, n_trials: int, where: str) -> np.ndarray:
    if hasattr(counts, "detach"):  # torch tensor, without importing torch here
        counts = counts.detach().cpu().numpy()
    arr = np.asarray(counts)
    if arr.shape != (n_trials, 2):
        raise ValueError(
            f"{where}: counts must have shape [T, 2] = [{n_trials}, 2] (visited, skipped), got {arr.shape}"
        )
    if np.any(arr < 0) or np.any(arr[:, 1] > arr[:, 0]):
        raise ValueError(f"{where}: counts must satisfy 0 <= skipped <= visited, got {arr.tolist()}")
    return arr.astype(np.int64)


def _as_record(rec: Any) -> CalibrationRecord:
    if isinstance(rec, CalibrationRecord):
        return rec
    if isinstance(rec, Mapping):
        return CalibrationRecord(rec["phase"], int(rec["kv_len"]), rec["counts"], rec.get("seq_id"))
    return CalibrationRecord(*rec)


def aggregate_counts(records: Iterable[Any], scale_factors: Sequence[float]) -> dict[str, list[FitPoint]]:
    """Per phase, one `FitPoint` per (sample, trial) from raw count records.

    `records` are `CalibrationRecord`s, `(phase, kv_len, counts[, seq_id])` tuples or dicts with those keys.
    Counts of records sharing `(phase, seq_id, kv_len)` are summed first, so per-layer and per-rank records can
    be passed as they come. Samples with no visited tile, and trials with λ = sf / kv_len >= 1 (dense by
    definition), give no point.
    """
    n_trials = len(scale_factors)
    sums: dict[tuple, np.ndarray] = {}
    singles: list[tuple[str, int, np.ndarray]] = []
    for i, raw in enumerate(records):
        rec = _as_record(raw)
        if rec.phase not in PHASES:
            raise ValueError(f"record {i}: phase must be one of {list(PHASES)}, got {rec.phase!r}")
        counts = _as_counts(rec.counts, n_trials, f"record {i}")
        if rec.seq_id is None:
            singles.append((rec.phase, int(rec.kv_len), counts))
        else:
            key = (rec.phase, rec.seq_id, int(rec.kv_len))
            sums[key] = counts if key not in sums else sums[key] + counts
    samples = singles + [(phase, kv_len, c) for (phase, _, kv_len), c in sums.items()]
    points: dict[str, list[FitPoint]] = {phase: [] for phase in PHASES}
    for sample, (phase, kv_len, counts) in enumerate(samples):
        for sf, (visited, skipped) in zip(scale_factors, counts.tolist(), strict=True):
            if visited <= 0 or kv_len <= 0 or sf >= kv_len:
                continue
            points[phase].append(FitPoint(skipped / visited, float(sf), kv_len, sample))
    return points


def level_crossings(
    sparsity: np.ndarray, log_sf: np.ndarray, lengths: np.ndarray, samples: np.ndarray, levels: Sequence[float] = LEVELS
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(level, log scale factor, length) where each sample's curve crosses each level, for the levels that every
    sample of its length octave crosses.

    A sample's points, in trial order, trace sparsity against log scale factor; the curve is made monotone (running
    maximum: a larger threshold never skips less, so a dip is count noise) and inverted by linear interpolation
    between the last point at or below the level and the first above it; never extrapolated. A level that only
    some samples of an octave (round(log2 kv_len)) reach is dropped for all of them: short samples lose their
    largest trials to the dense cut-off (λ >= 1), so the ones that still reach a high level are those whose text
    is sparse, and keeping only them would bias the length exponent.
    """
    per_sample: dict[int, dict[float, float]] = {}
    length_of: dict[int, float] = {}
    for sample in np.unique(samples):
        idx = np.flatnonzero(samples == sample)
        idx = idx[np.argsort(log_sf[idx], kind="stable")]
        curve = np.maximum.accumulate(sparsity[idx])
        xs = log_sf[idx]
        crossed = {}
        for level in levels:
            if curve[0] < level < curve[-1]:
                j = int(np.searchsorted(curve, level, side="right"))  # the curve is <= level before j, above at j
                frac = (level - curve[j - 1]) / (curve[j] - curve[j - 1])
                crossed[level] = float(xs[j - 1] + frac * (xs[j] - xs[j - 1]))
        per_sample[int(sample)] = crossed
        length_of[int(sample)] = float(lengths[idx[0]])
    octaves: dict[int, list[int]] = {}
    for sample, n in length_of.items():
        octaves.setdefault(int(np.round(np.log2(max(n, 1.0)))), []).append(sample)
    out_s, out_y, out_n = [], [], []
    for members in octaves.values():
        shared = set(levels).intersection(*(per_sample[m].keys() for m in members))
        for sample in members:
            for level in sorted(shared):
                out_s.append(level)
                out_y.append(per_sample[sample][level])
                out_n.append(length_of[sample])
    return np.array(out_s, dtype=np.float64), np.array(out_y, dtype=np.float64), np.array(out_n, dtype=np.float64)


def _point_arrays(points: Iterable[FitPoint | tuple[float, float]]) -> tuple[np.ndarray, ...]:
    """(sparsity, scale factor, kv_len, sample) arrays of the points; a plain pair has length 0 and sample -1."""
    pts = [
        (p.sparsity, p.scale_factor, p.kv_len, p.sample) if isinstance(p, FitPoint)
        else (float(p[0]), float(p[1]), 0, -1)
        for p in points
    ]  # fmt: skip
    return (
        np.array([p[0] for p in pts], dtype=np.float64),
        np.array([p[1] for p in pts], dtype=np.float64),
        np.array([p[2] for p in pts], dtype=np.float64),
        np.array([p[3] for p in pts], dtype=np.int64),
    )


@dataclass
class _Informative:
    """The informative points of a phase (the module docstring's rule), the whole curves for the level crossings,
    and what to tell the user when they do not suffice (`hint`, `fixes`)."""

    s: np.ndarray
    sf: np.ndarray
    lengths: np.ndarray
    curves: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    hint: str
    fixes: list[str]


def _informative_points(arrays, n_total: int, min_sparsity: float, max_sparsity: float) -> _Informative:
    """Drop the saturated and invalid points; say how many fell at each end and which trial change would help."""
    s, sf, lengths, samples = arrays
    valid = np.isfinite(s) & np.isfinite(sf) & (sf > 0)
    low = int(np.sum(valid & (s <= min_sparsity)))
    high = int(np.sum(valid & (s >= max_sparsity)))
    keep = valid & (s > min_sparsity) & (s < max_sparsity)
    curves = s[valid], np.log(sf[valid]), lengths[valid], samples[valid]  # whole curves, saturated ends included
    hint = (
        f"{int(np.sum(keep))} of {n_total} points are informative (sparsity in ({min_sparsity}, {max_sparsity})); "
        f"{low} at or below {min_sparsity}, {high} at or above {max_sparsity}"
    )
    fixes = []
    if low >= high:
        fixes.append("raise the largest threshold trial (scale factor) or use longer prompts (more tiles per row)")
    if high > low:
        fixes.append("lower the smallest threshold trial (scale factor)")
    fixes.append("use more / longer calibration prompts or more trials inside the range")
    return _Informative(s[keep], sf[keep], lengths[keep], curves, hint, fixes)


def _require_enough_points(info: _Informative, n_total: int, min_points: int, label: str) -> None:
    """Refuse a phase without measurements, or with too few informative points or distinct trials to fit."""
    n = int(info.s.size)
    if n == 0 and n_total == 0:
        raise CalibrationFitError(
            f"{label}: no measurements at all; run calibration prompts for this phase "
            "(decode needs generated tokens, prefill needs prompts longer than one tile of 64 tokens)"
        )
    if n < min_points or np.unique(info.sf).size < MIN_DISTINCT_TRIALS or np.ptp(info.s) <= 0:
        raise CalibrationFitError(
            f"{label}: too few informative points to fit (need >= {min_points} points over >= "
            f"{MIN_DISTINCT_TRIALS} distinct trials): {info.hint}. Fix: {'; '.join(info.fixes)}"
        )


def _regression_data(info: _Informative, length_law: bool, min_points: int):
    """(sparsity, log scale factor, length, on_levels): the level crossings when every point knows its sample and
    enough of them cross, else the informative points themselves.

    Our estimator regresses level crossings (exact sparsity, scattered log sf); ModelOpt's regresses the points.
    """
    if length_law and bool(np.all(info.curves[3] >= 0)):
        crossings = level_crossings(*info.curves)
        if crossings[0].size >= min_points and np.unique(crossings[0]).size >= MIN_DISTINCT_TRIALS:
            return (*crossings, True)
    return info.s, np.log(info.sf), info.lengths, False


@dataclass
class _LogLaw:
    """The regression's coefficients and its prediction of each log scale factor (for R²)."""

    intercept: float
    slope: float
    gamma: float
    gamma_slope: float
    reference_length: float | None
    pred: np.ndarray


def _regress_log_law(x_s, y, x_len, *, with_lengths: bool, varying: bool) -> _LogLaw:
    """Least squares of `y = log(sf)` on sparsity, plus the length term (and, with `varying`, its sparsity
    interaction) when the points span lengths. An exponent outside the schema's range is fixed at the bound it
    crossed and the rest refitted; an exponent that varies with sparsity is clipped where it leaves the range."""
    if not with_lengths:
        from scipy import stats

        res = stats.linregress(x_s, y)
        intercept, slope = float(res.intercept), float(res.slope)
        return _LogLaw(intercept, slope, 1.0, 0.0, None, intercept + slope * x_s)
    n_ref = float(np.exp(np.mean(np.log(x_len))))
    log_len = np.log(x_len / n_ref)
    columns = [np.ones_like(x_s), x_s, log_len]
    if varying:
        columns.append((x_s - LENGTH_EXPONENT_PIVOT) * log_len)
    coef, *_ = np.linalg.lstsq(np.stack(columns, axis=1), y, rcond=None)
    intercept, slope, delta = (float(v) for v in coef[:3])
    gamma = float(np.clip(1.0 - delta, MIN_LENGTH_EXPONENT, MAX_LENGTH_EXPONENT))
    gamma_slope = -float(coef[3]) if varying else 0.0
    if gamma != 1.0 - delta:  # (a, b) of the clipped exponent, not of the unclipped one
        coef, *_ = np.linalg.lstsq(np.stack(columns[:2], axis=1), y - (1.0 - gamma) * log_len, rcond=None)
        intercept, slope, gamma_slope = float(coef[0]), float(coef[1]), 0.0
    gamma_at = np.clip(gamma + gamma_slope * (x_s - LENGTH_EXPONENT_PIVOT), MIN_LENGTH_EXPONENT,
                       MAX_LENGTH_EXPONENT)  # fmt: skip
    return _LogLaw(intercept, slope, gamma, gamma_slope, n_ref, intercept + slope * x_s + (1.0 - gamma_at) * log_len)


def _r2(law: _LogLaw, y: np.ndarray) -> float:
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    return 1.0 - float(np.sum((y - law.pred) ** 2)) / ss_tot if ss_tot > 0 else 0.0


def _best_law(x_s, y, x_len, *, with_lengths: bool, on_levels: bool, label: str) -> tuple[_LogLaw, list[str]]:
    """The law to serve, with notes: of the length law with an exponent varying with sparsity (level crossings
    only, whose sparsity is exact: with the measured sparsity as regressor its scatter would leak into the
    interaction term), the one with a constant exponent, and ModelOpt's 1/n law (γ = 1), the one with the best R².

    Each law has the freedom of the next, so a simpler one only wins where the exponent hit the schema's range:
    measured on a tiny Llama's decode, the clipped varying law had R² −1.7 and kept every prompt below 10k tokens
    dense.
    """
    candidates = [_regress_log_law(x_s, y, x_len, with_lengths=with_lengths, varying=with_lengths and on_levels)]
    if with_lengths:
        if on_levels:
            candidates.append(_regress_log_law(x_s, y, x_len, with_lengths=True, varying=False))
        candidates.append(_regress_log_law(x_s, y, x_len, with_lengths=False, varying=False))
    r2s = [_r2(law, y) for law in candidates]
    best = int(np.argmax(r2s))  # the first of equals: the freest law
    if best == 0:
        return candidates[0], []
    chosen = candidates[best]
    chosen_is = "ModelOpt's 1/n law (γ = 1)" if chosen.reference_length is None else f"γ = {chosen.gamma:.2f}"
    note = (f"the length law's exponent reached its range {MIN_LENGTH_EXPONENT:g}..{MAX_LENGTH_EXPONENT:g} "
            f"(R² {r2s[0]:.3f}); serving {chosen_is}, R² {r2s[best]:.3f}")  # fmt: skip
    logger.warning("%s: %s. Calibrating on a wider spread of lengths (--calib_min_seqlen, --calib_max_seqlen) "
                   "measures the length exponent better", label, note)  # fmt: skip
    return chosen, [note]


def _checked_law(law: _LogLaw, y: np.ndarray, info: _Informative, label: str) -> tuple[float, float, float]:
    """(a, b, R² in log space), refusing a law that is not finite or whose sparsity does not grow with λ."""
    a, b = float(math.exp(law.intercept)) if math.isfinite(law.intercept) else math.nan, law.slope
    r2 = _r2(law, y)
    if not (math.isfinite(a) and math.isfinite(b) and a > 0):
        raise CalibrationFitError(
            f"{label}: the fit is not finite (a={a}, b={b}); {info.hint}. Fix: {'; '.join(info.fixes)}"
        )
    if b <= 0:
        raise CalibrationFitError(
            f"{label}: fitted b={b:.4g} <= 0, i.e. sparsity does not grow with the threshold: the measurements "
            f"are noise ({info.hint}). Fix: use a wider trials range and more / longer prompts"
        )
    return a, b, r2


def fit_phase(
    points: Iterable[FitPoint | tuple[float, float]],
    *,
    phase: str = "",
    min_sparsity: float = MIN_INFORMATIVE_SPARSITY,
    max_sparsity: float = MAX_INFORMATIVE_SPARSITY,
    min_points: int = MIN_POINTS,
    length_law: bool = True,
) -> PhaseFit:
    """Fit `scale_factor = a * exp(b * sparsity)` to the informative points (see the module docstring), with a
    length exponent γ when `length_law` and the points span lengths at least `MIN_LENGTH_SPAN` apart.

    Points are `FitPoint`s or `(sparsity, scale_factor)` pairs. Raises `CalibrationFitError` saying what to
    change when there are too few informative points, too few distinct trials among them, or the fit has b <= 0
    or is not finite.
    """
    label = f"{phase} calibration" if phase else "calibration"
    arrays = _point_arrays(points)
    n_total = int(arrays[0].size)
    info = _informative_points(arrays, n_total, min_sparsity, max_sparsity)
    _require_enough_points(info, n_total, min_points, label)
    n, lengths = int(info.s.size), info.lengths
    with_lengths = length_law and bool(np.all(lengths > 0)) and lengths.max() >= MIN_LENGTH_SPAN * lengths.min()
    x_s, y, x_len, on_levels = _regression_data(info, length_law, min_points)
    law, notes = _best_law(x_s, y, x_len, with_lengths=with_lengths, on_levels=on_levels, label=label)
    a, b, r2 = _checked_law(law, y, info, label)
    if r2 < 0.8:
        notes.append(f"low fit quality R²={r2:.3f} (log space)")
        logger.warning("%s: low fit quality R²=%.3f in log space over %d points", label, r2, n)
    fit = PhaseFit(
        a=a,
        b=b,
        r2=float(r2),
        n_points=n,
        sparsity_range=(float(info.s.min()), float(info.s.max())),
        n_total=n_total,
        phase=phase,
        notes=tuple(notes),
        length_exponent=law.gamma,
        reference_length=law.reference_length,
        length_range=(int(lengths.min()), int(lengths.max())) if lengths.size and lengths.min() > 0 else None,
        length_exponent_slope=law.gamma_slope,
    )
    logger.info(
        "%s: a=%.6g b=%.4f γ=%.3f%+.3f·(s−%g) (n_ref %s) R²=%.4f over %d/%d points (%s), observed sparsity "
        "[%.3f, %.3f]", label, fit.a, fit.b, law.gamma, law.gamma_slope, LENGTH_EXPONENT_PIVOT,
        "-" if law.reference_length is None else f"{law.reference_length:.0f}", fit.r2, n, n_total,
        "regression on the points" if not on_levels else f"{x_s.size} level crossings", *fit.sparsity_range,
    )  # fmt: skip
    return fit


def fit_phases(points_by_phase: Mapping[str, Iterable[FitPoint]], **kwargs: Any) -> dict[str, PhaseFit]:
    """`fit_phase` for every phase that has points (a phase with none stays uncalibrated, i.e. dense)."""
    out = {}
    for phase in PHASES:
        pts = list(points_by_phase.get(phase, ()))
        if pts:
            out[phase] = fit_phase(pts, phase=phase, **kwargs)
    return out


def plot_fit(
    points_by_phase: Mapping[str, Iterable[FitPoint | tuple[float, float]]],
    fits: Mapping[str, PhaseFit | None],
    path: str | os.PathLike,
) -> Path:
    """PNG of the measured points and fitted curves, one panel per phase (matplotlib's Agg canvas, no pyplot)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plot_fit needs matplotlib: pip install matplotlib") from exc

    phases = [p for p in PHASES if list(points_by_phase.get(p, ())) or fits.get(p) is not None]
    if not phases:
        raise ValueError("plot_fit: nothing to plot (no points and no fits)")
    fig = Figure(figsize=(6 * len(phases), 4.5), dpi=100)
    FigureCanvasAgg(fig)
    for i, phase in enumerate(phases):
        ax = fig.add_subplot(1, len(phases), i + 1)
        pts = [(p.sparsity, p.scale_factor) if isinstance(p, FitPoint) else p for p in points_by_phase.get(phase, ())]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.scatter(xs, ys, s=6, alpha=0.35, label=f"measured ({len(pts)})")
        fit = fits.get(phase)
        if fit is not None:
            grid = np.linspace(0.0, 1.0, 200)
            label = f"a={fit.a:.3g}, b={fit.b:.3g}, R²={fit.r2:.3f}"
            if fit.reference_length is None:
                ax.plot(grid, fit.a * np.exp(fit.b * grid), color="C3", label=label)
            else:  # the length law: one curve per length it saw (scale factor = λ·n at that length)
                lo, hi = fit.length_range or (fit.reference_length, fit.reference_length)
                for j, n in enumerate(sorted({lo, int(round(fit.reference_length)), hi})):
                    sf = np.array([fit.threshold(x, n) * n for x in grid])
                    gamma = f"γ={fit.length_exponent:.2f}" + (f"{fit.length_exponent_slope:+.2f}·(s−0.5)"
                                                              if fit.length_exponent_slope else "")  # fmt: skip
                    ax.plot(grid, sf, color=f"C{3 + j}", label=f"n={n}" + (f": {label}, {gamma}" if j == 0 else ""))
            ax.axvspan(*fit.sparsity_range, color="C2", alpha=0.08, label="observed range")
            for note in unreachable_notes(fit, (0.3, 0.5, 0.7)):
                ax.text(0.02, 0.02 + 0.05 * note[0], note[1], transform=ax.transAxes, fontsize=7)
        for lim in (MIN_INFORMATIVE_SPARSITY, MAX_INFORMATIVE_SPARSITY):
            ax.axvline(lim, color="grey", lw=0.6, ls=":")
        ax.set_yscale("log")
        ax.set_xlim(0.0, 1.0)
        ax.set_xlabel("sparsity (dropped / visited row-tiles)")
        ax.set_ylabel("scale factor (λ · kv_len)")
        ax.set_title(f"{phase}: scale_factor = a·exp(b·sparsity)")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def unreachable_notes(fit: PhaseFit, targets) -> list[tuple[int, str]]:
    """(index, text) for each target some lengths cannot reach: rows whose law length is below the returned
    bound get λ >= 1 and run dense (docs/skip_softmax.md)."""
    notes = []
    for i, t in enumerate(targets):
        cut = fit.dense_below(t)
        if cut >= 2:
            where = "every length" if math.isinf(cut) else f"lengths <= {int(cut)} tokens"
            notes.append((i, f"target {t:g}: {where} run dense (λ >= 1)"))
    return notes


def log_unreachable(fit: PhaseFit, target: float, label: str = "") -> None:
    """Say once, at calibration or load time, which lengths a target leaves dense (instead of silently)."""
    for _, text in unreachable_notes(fit, (target,)):
        logger.warning("%s%s %s", label, fit.phase, text)


def points_from_merged_record(record: Mapping[str, Any]) -> dict[str, list[FitPoint]]:
    """Fit points per phase from a merged vLLM calibration record (checkpoint/calibration_records.py).

    The record already sums the raw counts of every layer and rank per sequence-step, so each entry is one
    sample: a prefill chunk or a decode step, with its own kv_len.
    """
    kv_lens = np.asarray(record["kv_lens"], dtype=np.int64)
    is_decode = np.asarray(record["is_decode"], dtype=bool)
    counts = np.asarray(record["counts"], dtype=np.int64)
    samples = [
        CalibrationRecord("decode" if d else "prefill", int(k), c)
        for k, d, c in zip(kv_lens.tolist(), is_decode.tolist(), counts, strict=True)
    ]
    return aggregate_counts(samples, record["scale_factors"])
