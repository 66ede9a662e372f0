"""What a valid `sparse_attention_config` block serves: the per-phase law and the layers kept dense.

How a block resolves (`parse_sparse_attention_config`), matching what NVIDIA ModelOpt 0.47's own vLLM loader
(`load_from_checkpoint_metadata` + `_resolve_skip_softmax_calibration`) serves:

- a phase with `a > 0`: calibrated, λ_row = a·exp(b·target) / n (ModelOpt's law, γ = 1). Our checkpoints may add
  a length exponent γ and a reference length n_ref per phase: ln λ_row = ln a + b·target + (γ − 1)·ln n_ref − γ·ln n,
  which is ModelOpt's law at n = n_ref (n_ref = 1 when absent); ModelOpt's loader reads only (a, b);
- a phase with `a == 0` (ModelOpt's bounded fit can return it), or absent: dense;
- a calibrated phase without a target: ModelOpt's default 0.5 (with a warning); targets lie in [0, 1];
- `b` is any finite number (ModelOpt's linear fit bounds it to [0, 20], its log-space fit leaves it free), but
  `a·exp(b·target)` must fit a float64 (ModelOpt 0.47 crashes with `OverflowError` on it);
- a skip_softmax group that calibrates no phase: ModelOpt serves its static preset λ = 0.1 for every row of both
  phases (`SKIP_SOFTMAX_TRITON_DEFAULT`); so do we (γ = 0). We honour the group's `ignore` list there, which ModelOpt
  0.47's preset path drops (said in a warning);
- an N:M `sparse_softmax` / `triton_sparse_softmax` group with `sparsity_n > 0`: ModelOpt serves N:M sparse softmax
  on top of skip-softmax; we do not implement it, so loading refuses with an error that names the group and the
  choices. Writing keeps such groups untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from .constants import (
    BLOCK_KEY,
    CONTRACT_VERSION,
    DEFAULT_TARGET_SPARSITY,
    LENGTH_EXPONENT_PIVOT,
    LENGTH_EXPONENT_RANGE,
    MODELOPT_STATIC_THRESHOLD,
    PHASES,
)
from .errors import (
    SparseAttentionConfigError,
    _type_name,
    format_validation_error,
)
from .schema import (
    _LOG_FLOAT_MAX,
    Count,
    Finite,
    LengthExponent,
    NonNegative,
    ReferenceLength,
    SkipSoftmaxGroup,
    SparseAttentionBlock,
    SparseSoftmaxGroup,
    Sparsity,
    SparsityRange,
)

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------ resolution


def served_length_exponent(pivot: float, slope: float, target: float, where: str | None = "") -> float:
    """γ(target) = pivot + slope·(target − LENGTH_EXPONENT_PIVOT), kept inside LENGTH_EXPONENT_RANGE (a target
    far from the calibrated ones could push a steep slope outside; that is logged, not fatal, unless `where` is
    None: a fit evaluated over a grid of targets)."""
    gamma = pivot + slope * (target - LENGTH_EXPONENT_PIVOT)
    lo, hi = LENGTH_EXPONENT_RANGE
    clipped = min(max(gamma, lo), hi)
    if clipped != gamma and where is not None:
        logger.warning("%s: length exponent %.3g at target %g lies outside [%g, %g]; serving %g (recalibrate for "
                       "this target)", where or "length law", gamma, target, lo, hi, clipped)  # fmt: skip
    return clipped


@pydantic_dataclass(frozen=True)
class PhaseCalibration:
    """How one phase is served: ln λ_row = log_scale_factor − length_exponent·ln(n) (docs/skip_softmax.md).

    NVIDIA ModelOpt's law `λ = a·exp(b·target) / n`: `log_scale_factor = ln a + b·target`, `length_exponent = 1`.
    Our length law (γ, n_ref): `log_scale_factor = ln a + b·target + (γ − 1)·ln n_ref`, i.e. ModelOpt's λ at
    n = n_ref. ModelOpt's static λ (a group without calibration): `a = λ`, `b = 0`, `length_exponent = 0`.
    `length_exponent` is the γ served at `target_sparsity`; `length_exponent_slope` is dγ/d(target), kept so the
    checkpoint can store γ at `LENGTH_EXPONENT_PIVOT` (`pivot_length_exponent`) and any target gets its own γ.
    `stored_pivot_exponent` is that pivot γ as read or fitted: the served γ may be clipped to
    `LENGTH_EXPONENT_RANGE`, and a pivot derived back from a clipped γ would rewrite the checkpoint's law.
    """

    a: NonNegative
    b: Finite
    target_sparsity: Sparsity
    # Optional calibration extras (None when the checkpoint does not carry them, e.g. one exported by ModelOpt).
    observed_sparsity_range: SparsityRange | None = None
    r2: Finite | None = None
    n_points: Count | None = None
    length_exponent: LengthExponent = 1.0
    reference_length: ReferenceLength | None = None
    length_exponent_slope: Finite = 0.0
    stored_pivot_exponent: LengthExponent | None = None

    @property
    def pivot_length_exponent(self) -> float:
        """γ at `LENGTH_EXPONENT_PIVOT`: what the checkpoint stores as `length_exponent`."""
        if self.stored_pivot_exponent is not None:
            return self.stored_pivot_exponent
        return self.length_exponent - self.length_exponent_slope * (self.target_sparsity - LENGTH_EXPONENT_PIVOT)

    def at_target(self, target_sparsity: float) -> PhaseCalibration:
        """The same law served at another target: γ moves with the target along its slope (a plain
        `dataclasses.replace` of the target would keep the old target's γ)."""
        extras = {}
        if self.length_exponent_slope:
            pivot = self.pivot_length_exponent
            extras = dict(length_exponent=served_length_exponent(pivot, self.length_exponent_slope, target_sparsity),
                          stored_pivot_exponent=pivot)  # fmt: skip
        return dataclasses.replace(self, target_sparsity=float(target_sparsity), **extras)

    @property
    def log_scale_factor(self) -> float:
        """c of the serving law, computed in log space (never overflows; -inf when a == 0, i.e. dense)."""
        c = self._log_modelopt_scale_factor
        if self.reference_length is not None and math.isfinite(c):
            c += (self.length_exponent - 1.0) * math.log(self.reference_length)
        return c

    @property
    def _log_modelopt_scale_factor(self) -> float:
        return (math.log(self.a) if self.a > 0.0 else -math.inf) + self.b * self.target_sparsity

    @property
    def scale_factor(self) -> float:
        """ModelOpt's a·exp(b·target) (λ·n at n = n_ref; λ itself for a static threshold); inf, not OverflowError."""
        log_sf = self._log_modelopt_scale_factor
        if log_sf > _LOG_FLOAT_MAX:
            return math.inf
        try:
            return self.a * math.exp(self.b * self.target_sparsity)
        except OverflowError:  # exp(b·target) alone overflows although the product fits (tiny a)
            return math.exp(log_sf)

    @property
    def is_static(self) -> bool:
        """One λ for every row, whatever the target and length (b = 0, γ = 0), e.g. ModelOpt's static default
        threshold; a calibrated law (b > 0) whose γ happens to be 0 at its target is not static."""
        return self.b == 0.0 and self.length_exponent == 0.0 and self.length_exponent_slope == 0.0

    @property
    def dense_below(self) -> float:
        """Rows whose law length n is at most this get λ >= 1 and run dense: the target is unreachable there
        (0: every length is served sparse; inf: no length is)."""
        c, gamma = self.log_scale_factor, self.length_exponent
        if not c > 0:
            return 0.0
        return math.inf if gamma <= 0 else math.exp(min(c / gamma, 700.0))

    def describe_unreachable(self, phase: str) -> str | None:
        """One line for logs when some lengths run dense at this target, else None."""
        cut = self.dense_below
        if cut < 2:
            return None
        where = "every length" if math.isinf(cut) else f"sequences of up to {int(cut)} tokens"
        return f"{phase} target {self.target_sparsity:g}: {where} run dense (λ >= 1, the law cannot reach the target)"


@dataclass(frozen=True)
class SparseAttentionSettings:
    """What serving needs: the per-phase calibration (None = dense for that phase) and the layers it covers."""

    prefill: PhaseCalibration | None
    decode: PhaseCalibration | None
    disabled_layers: tuple[str, ...] = ()
    # The skip_softmax group's `targets` (attention class names) and its key inside config_groups.
    attention_classes: tuple[str, ...] = ()
    group_name: str = "group_0"
    # ModelOpt's `initial_disabled_steps` (recorded policy; neither ModelOpt's loader nor we interpret it).
    initial_disabled_steps: int = 0
    # Paths of keys this version does not know (a newer ModelOpt's); kept when we rewrite the block.
    unknown_keys: tuple[str, ...] = ()

    def phase(self, name: str) -> PhaseCalibration | None:
        return {"prefill": self.prefill, "decode": self.decode}[name]


_REPORTED_UNKNOWN: set[str] = set()


def _report_unknown_once(paths: list[str]) -> None:
    fresh = [p for p in paths if p not in _REPORTED_UNKNOWN]
    if fresh:
        _REPORTED_UNKNOWN.update(fresh)
        logger.warning(
            "%s: not known to modelopt_ext (a newer NVIDIA ModelOpt's?); not used for serving, kept when the block "
            "is rewritten", ", ".join(fresh),
        )  # fmt: skip


def validate_block(block: Any, *, path: str = BLOCK_KEY) -> SparseAttentionBlock:
    """Structural validation of a `sparse_attention_config` block (what writing requires)."""
    if not isinstance(block, Mapping):
        raise SparseAttentionConfigError(f"{path}: must be a JSON object, got {_type_name(block)} {block!r}")
    try:
        return SparseAttentionBlock.model_validate(block)
    except ValidationError as exc:
        raise SparseAttentionConfigError(format_validation_error(exc, path)) from None


def active_sparse_softmax_groups(model: SparseAttentionBlock) -> list[str]:
    """Names of the N:M groups that ModelOpt's loader would serve (effective sparsity_n > 0)."""
    top = model.sparse_softmax
    names = []
    for name, group in model.config_groups.items():
        if not isinstance(group, SparseSoftmaxGroup):
            continue
        n = top.sparsity_n if top is not None and top.sparsity_n is not None else group.sparsity_n
        if n > 0:
            names.append(name)
    return names


def _refuse_sparse_softmax(model: SparseAttentionBlock, path: str) -> None:
    active = active_sparse_softmax_groups(model)
    if not active:
        return
    name = active[0]
    group = model.config_groups[name]
    top = model.sparse_softmax
    n = top.sparsity_n if top is not None and top.sparsity_n is not None else group.sparsity_n
    m = top.sparsity_m if top is not None and top.sparsity_m is not None else group.sparsity_m
    raise SparseAttentionConfigError(
        f"{path}.config_groups.{name}: algorithm {group.algorithm!r} ({n}:{m} N:M sparse softmax) is not implemented "
        "by modelopt_ext, and serving the checkpoint without it would not give the numerics NVIDIA ModelOpt serves. "
        f"Either remove group {name!r} (or set its sparsity_n to 0) in config.json to serve skip-softmax alone, "
        "or serve this checkpoint with ModelOpt's own vLLM plugin"
    )


def _skip_softmax_group(model: SparseAttentionBlock, path: str) -> tuple[str, str, SkipSoftmaxGroup]:
    """(name, path, group) of the block's one skip_softmax group; refuses a block with none or several."""
    skip_names = [n for n, g in model.config_groups.items() if isinstance(g, SkipSoftmaxGroup)]
    if not skip_names:
        raise SparseAttentionConfigError(
            f"{path}.config_groups: has no group with algorithm 'skip_softmax'; calibrate the checkpoint "
            "(calibrate_sparse_attn.py) or remove the sparse_attention_config block"
        )
    if len(skip_names) > 1:
        raise SparseAttentionConfigError(
            f"{path}.config_groups: has several skip_softmax groups {skip_names}; keep exactly one"
        )
    name = skip_names[0]
    return name, f"{path}.config_groups.{name}", model.config_groups[name]


def _static_phases(group: SkipSoftmaxGroup, gpath: str) -> dict[str, PhaseCalibration | None]:
    """ModelOpt's static default λ for both phases, for a group that calibrates neither (as ModelOpt serves it)."""
    lam = MODELOPT_STATIC_THRESHOLD
    logger.warning(
        "%s calibrates no phase (no threshold_scale_factor.prefill/decode): serving NVIDIA ModelOpt's static "
        "default threshold λ = %g for every row of both phases, as ModelOpt 0.47 does%s; calibrate the "
        "checkpoint for a target sparsity", gpath, lam,
        f" (its `ignore` list {list(group.ignore)} is honoured here; ModelOpt 0.47's static preset ignores it)"
        if group.ignore else "",
    )  # fmt: skip
    static = PhaseCalibration(lam, 0.0, 0.0, length_exponent=0.0)
    return {"prefill": static, "decode": static}


def _calibrated_phase(group: SkipSoftmaxGroup, phase: str, gpath: str) -> PhaseCalibration | None:
    """One phase's served law from its calibration, target and length exponent; None (dense) when the phase is not
    calibrated or its `a` is 0. Warns about a missing target and a target outside the observed range."""
    params = group.calibrated(phase)
    target = group.target(phase)
    if params is None:
        if target is not None:
            # ModelOpt exports targets for both phases even when it calibrated one: normal, not a warning.
            logger.info("%s.target_sparsity.%s is set but %s is not calibrated: %s stays dense",
                        gpath, phase, phase, phase)  # fmt: skip
        return None
    if params.a == 0.0:
        logger.warning("%s.threshold_scale_factor.%s.a is 0: NVIDIA ModelOpt serves %s dense, and so do we",
                       gpath, phase, phase)  # fmt: skip
        return None
    if target is None:
        logger.warning(
            "%s.target_sparsity.%s is missing; serving %s at ModelOpt's default target %.2f",
            gpath, phase, phase, DEFAULT_TARGET_SPARSITY,
        )  # fmt: skip
        target = DEFAULT_TARGET_SPARSITY
    observed = None if group.observed_sparsity_range is None else group.observed_sparsity_range.get(phase)
    fit = None if group.fit is None else group.fit.get(phase)
    pivot, slope = group.per_phase("length_exponent", phase), group.per_phase("length_exponent_slope", phase)
    pivot = 1.0 if pivot is None else pivot
    gamma = served_length_exponent(pivot, slope or 0.0, target, f"{gpath} {phase}")
    if observed is not None and not observed[0] <= target <= observed[1]:
        logger.warning(
            "%s target sparsity %.3f lies outside the sparsity range observed during calibration [%.3f, %.3f]: "
            "the threshold is extrapolated and the realised sparsity may differ; recalibrate with wider trials "
            "or pick a target inside the range",
            phase, target, observed[0], observed[1],
        )  # fmt: skip
    return PhaseCalibration(
        params.a,
        params.b,
        target,
        observed_sparsity_range=observed,
        r2=None if fit is None else fit.r2,
        n_points=None if fit is None else fit.n_points,
        length_exponent=gamma,
        reference_length=group.per_phase("reference_length", phase),
        length_exponent_slope=slope or 0.0,
        stored_pivot_exponent=pivot if slope else None,
    )


def _warn_about_served_phases(model: SparseAttentionBlock, group: SkipSoftmaxGroup, phases: dict,
                              gpath: str) -> None:  # fmt: skip
    """Say when nothing is served sparse, and when the calibration was made under other semantics than the ones
    served (NVIDIA ModelOpt's, or an earlier or later version of docs/skip_softmax.md), so the target will not hold."""
    if all(cal is None for cal in phases.values()):
        logger.warning("%s: no phase is calibrated with a > 0; the checkpoint is served dense", gpath)
    producer = (model.producer or {}).get("name")
    calibrated = [p for p in PHASES if phases[p] is not None and not phases[p].is_static]
    if not calibrated:
        return
    if producer == "modelopt":
        logger.warning(
            "%s: calibrated by NVIDIA ModelOpt, whose (a, b) count sparsity in blocks of 128 query rows x 128 keys; "
            "modelopt_ext decides per aligned block of 64 prompt rows (and per GQA group of decode rows) on 64-key "
            "tiles and never drops a row's 128 most recent keys, so the same (a, b) does not realize the target "
            "here (README, 'Compatibility with NVIDIA ModelOpt'). Recalibrate with modelopt_ext to serve the "
            "target; recalibration keeps the group's ignore list and other policy", gpath,
        )  # fmt: skip
    elif (group.contract_version or 0) != CONTRACT_VERSION:
        made = "before contract versions were recorded (version 3 or earlier: per-row decisions, no recent window)"
        if group.contract_version is not None:
            made = f"under contract version {group.contract_version}"
        if group.contract_version == 4:  # v5 adds the window's max to every reference: more dropped at one λ
            effect = "drop more at the same (a, b) (the recent window's max joins the reference), so realized " \
                     "sparsity will be above the target and quality below what it was calibrated for"
        elif group.contract_version is None or group.contract_version < 4:
            effect = "decide per prompt block and GQA group with a recent window, so realized sparsity will not " \
                     "be the target (below it in the measurements of version 4)"
        else:
            effect = "mean something else at the same (a, b)"
        logger.warning(
            "%s: calibrated %s; this modelopt_ext serves version %d (docs/skip_softmax.md), whose decisions %s. "
            "Recalibrate (examples/vllm_serve/calibrate_sparse_attn.py, or mtsa.sparsify with a calibration): it "
            "keeps the group's ignore list and other policy", gpath, made, CONTRACT_VERSION, effect,
        )  # fmt: skip


def resolve_settings(model: SparseAttentionBlock, *, path: str = BLOCK_KEY) -> SparseAttentionSettings:
    """What a validated block serves (see the module docstring); warnings for what a user should know."""
    _refuse_sparse_softmax(model, path)
    name, gpath, group = _skip_softmax_group(model, path)

    unknown = [f"{path}.{k}" for k in (model.model_extra or {})]
    unknown += [f"{gpath}.{k}" for k in (group.model_extra or {})]
    _report_unknown_once(unknown)

    if not any(group.calibrated(p) is not None for p in PHASES):
        phases = _static_phases(group, gpath)
    else:
        phases = {phase: _calibrated_phase(group, phase, gpath) for phase in PHASES}
    _warn_about_served_phases(model, group, phases, gpath)
    return SparseAttentionSettings(
        prefill=phases["prefill"],
        decode=phases["decode"],
        disabled_layers=group.ignore,
        attention_classes=group.targets,
        group_name=str(name),
        initial_disabled_steps=group.initial_disabled_steps,
        unknown_keys=tuple(unknown),
    )


def parse_sparse_attention_config(block: Any, *, path: str = BLOCK_KEY) -> SparseAttentionSettings:
    """Validate a `sparse_attention_config` block and return what it serves.

    Raises `SparseAttentionConfigError` naming the exact field (e.g.
    `sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefill.a`) so a bad checkpoint fails
    before any model weights load.
    """
    return resolve_settings(validate_block(block, path=path), path=path)

