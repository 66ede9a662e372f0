"""One declarative schema for everything a user writes or a checkpoint carries, and what it resolves to.

Two documents are validated here, with pydantic models (pydantic ships with vLLM and ModelOpt; importing this module
imports neither, nor torch):

1. The mode config of `mtsa.sparsify` (`sparse_cfg`): `SkipSoftmaxLayerConfig` per fnmatch pattern and
   `SkipSoftmaxCalibrationConfig` under the key ``"calibration"``. Field names follow NVIDIA ModelOpt's
   (`thresholds`, `num_decode_tokens`, `target_sparse_ratio`); our old names (`threshold`, `decode_tokens`) are still
   accepted with a `DeprecationWarning`, for one release.
2. The checkpoint block `config.json["sparse_attention_config"]` (NVIDIA ModelOpt's schema, as its HF exporter writes
   it, plus our optional extras inside the skip_softmax group):

       "sparse_attention_config": {
         "config_groups": {"group_0": {
             "algorithm": "skip_softmax", "targets": ["LlamaAttention"],
             "ignore": ["model.layers.0.self_attn"],                 # layers kept dense
             "initial_disabled_steps": 2,                            # ModelOpt policy, kept, not interpreted
             "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                        "prefill": {"a": 7.93, "b": 8.61}, "decode": {"a": 0.12, "b": 9.85}},
             "target_sparsity": {"prefill": 0.5, "decode": 0.5},    # or one number for both
             # ours (ModelOpt's loader does not read them):
             "observed_sparsity_range": {"prefill": [0.06, 0.93]},
             "fit": {"prefill": {"r2": 0.98, "n_points": 412}},
             "length_exponent": {"prefill": 0.8, "decode": 1.3},    # γ, see "How a block resolves"
             "reference_length": {"prefill": 2048, "decode": 2048}}},  # n_ref where (a, b) is ModelOpt's law
         "producer": {"name": "modelopt", "version": "0.47.0"}}

Every error names the exact field (``sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefil``,
``sparse_cfg['*attn*'].thresholds.prefill``) and what to do. Keys are closed wherever the schema is ours or ModelOpt
fixes it (the phase maps, `a`/`b`, our own fields, the mode config): an unknown key is an error, with "did you mean"
for a near miss. At group level and at the top of the block a key a newer ModelOpt may add is kept on rewrite and
reported once; only a near miss of a known key (a typo such as ``ignored``) is an error there.

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
import difflib
import logging
import math
import numbers
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Tag, ValidationError, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import PydanticCustomError

logger = logging.getLogger(__name__)

PHASES = ("prefill", "decode")

# ------------------------------------------------------------------------------------------------------ constants

BLOCK_KEY = "sparse_attention_config"
SKIP_SOFTMAX = "skip_softmax"
# ModelOpt's N:M sparse-softmax algorithms (its loader treats both names alike).
SPARSE_SOFTMAX_ALGORITHMS = ("sparse_softmax", "triton_sparse_softmax")
KNOWN_ALGORITHMS = (SKIP_SOFTMAX, *SPARSE_SOFTMAX_ALGORITHMS)
FORMULA = "a * exp(b * target_sparsity)"
# What ModelOpt serves a calibrated phase at when the checkpoint names no target for it.
DEFAULT_TARGET_SPARSITY = 0.5
# ModelOpt 0.47's static λ for a skip_softmax group without calibration (SKIP_SOFTMAX_TRITON_DEFAULT's
# `skip_softmax_threshold`); a test checks it against the installed ModelOpt.
MODELOPT_STATIC_THRESHOLD = 0.1
# N:M defaults of ModelOpt's loader (SPARSE_SOFTMAX_DEFAULTS): a group without sparsity_n is 2:4.
MODELOPT_DEFAULT_SPARSITY_N = 2
# Our optional per-phase length exponent γ; ModelOpt's law is γ = 1.
LENGTH_EXPONENT_RANGE = (0.0, 4.0)
# γ may vary with the target: γ(target) = length_exponent + length_exponent_slope·(target − pivot). The checkpoint
# stores γ at this fixed pivot, so a target edited by hand in config.json is served with the right γ.
LENGTH_EXPONENT_PIVOT = 0.5
# Calibration results inside the skip_softmax group: replaced as a whole on recalibration. Every other group key
# (ignore, initial_disabled_steps, targets, keys of a newer ModelOpt) is policy and survives a recalibration.
CALIBRATION_KEYS = (
    "threshold_scale_factor",
    "target_sparsity",
    "observed_sparsity_range",
    "fit",
    "length_exponent",
    "length_exponent_slope",
    "reference_length",
)

# Mode config (sparse_cfg).
METHODS = ("skip_softmax",)
BACKENDS = ("auto", "torch", "triton")
BACKEND_ALIASES = {"pytorch": "torch"}  # ModelOpt's spelling of the non-Triton path
CALIBRATION_KEY = "calibration"

_LOG_FLOAT_MAX = math.log(1.7976931348623157e308)
# A key at an open level that is this close to a known key is a typo, not a newer ModelOpt's key.
_TYPO_CUTOFF = 0.85
# Known confusions at group level (a mode-config name written into the checkpoint).
_GROUP_MISNAMES = {"target_sparse_ratio": "target_sparsity", "thresholds": "threshold_scale_factor"}


class SparseAttentionConfigError(ValueError):
    """A malformed config or checkpoint block; the message names the offending field and the fix."""


# --------------------------------------------------------------------------------------------- error plumbing


def _fail(msg: str, sub: str = "") -> PydanticCustomError:
    """A validation error with our message; `sub` is appended to the field path (a key below the validated node)."""
    return PydanticCustomError("modelopt_ext", "{msg}", {"msg": msg, "sub": sub})


def did_you_mean(key: Any, choices: Iterable[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(str(key), list(choices), n=1, cutoff=cutoff)
    return f"did you mean {close[0]!r}? " if close else ""


def _type_name(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


_MISSING_HINTS = {
    "a": "the fit scale_factor = a * exp(b * target_sparsity) needs a and b",
    "b": "the fit scale_factor = a * exp(b * target_sparsity) needs a and b",
    "config_groups": "add a group with algorithm 'skip_softmax': calibrate the checkpoint",
}
_GROUP_TAGS = {SKIP_SOFTMAX, "sparse_softmax"}


def _render_loc(loc: tuple) -> list[str]:
    parts = [str(p) for p in loc]
    # Discriminated unions put the union member's tag after the group name: drop it.
    if len(parts) > 2 and parts[0] == "config_groups" and parts[2] in _GROUP_TAGS:
        del parts[2]
    return parts


def _message(err: dict) -> tuple[str, list[str]]:
    """Our message for one pydantic error, and extra path parts."""
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "modelopt_ext":
        return err["msg"], [ctx["sub"]] if ctx.get("sub") else []
    if kind == "missing":
        hint = _MISSING_HINTS.get(str(err["loc"][-1]) if err["loc"] else "", "add it")
        return f"missing ({hint})", []
    if kind in ("model_type", "model_attributes_type", "dict_type", "dataclass_type"):
        return f"must be a JSON object, got {_type_name(value)} {value!r}", []
    if kind == "union_tag_invalid":
        algo = value.get("algorithm") if isinstance(value, Mapping) else None
        return (
            f"unknown algorithm {algo!r}; {did_you_mean(algo, KNOWN_ALGORITHMS)}"
            f"supported: {list(KNOWN_ALGORITHMS)}",
            ["algorithm"],
        )
    if kind == "union_tag_not_found":
        if not isinstance(value, Mapping):
            return f"must be a JSON object, got {_type_name(value)} {value!r}", []
        return f"missing (every group names its algorithm, one of {list(KNOWN_ALGORITHMS)})", ["algorithm"]
    if kind == "literal_error":
        return f"must be {ctx.get('expected')}, got {value!r}", []
    if kind in ("bool_type", "bool_parsing"):
        return f"must be true or false, got {value!r}", []
    if kind in ("string_type", "string_sub_type"):
        return f"must be a string, got {_type_name(value)} {value!r}", []
    return f"{err['msg']}, got {value!r}", []


def format_validation_error(exc: ValidationError, root: str) -> str:
    """One line per error: ``<root>.<field path>: <what is wrong and what to do>``."""
    lines = []
    for err in exc.errors(include_url=False):
        msg, extra = _message(err)
        path = ".".join([root, *_render_loc(err["loc"]), *extra])
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ value types


def _number(*, lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False,
            what: str | None = None) -> BeforeValidator:  # fmt: skip
    """A finite real number (never a bool or a string) within the bounds, as float."""
    if what is None:
        if lo is not None and hi is not None:
            what = f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo is not None:
            what = f"a finite number {'>' if lo_open else '>='} {lo:g}"
        else:
            what = "a finite number"

    def check(value: Any) -> float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        if ok and lo is not None:
            ok = value > lo if lo_open else value >= lo
        if ok and hi is not None:
            ok = value < hi if hi_open else value <= hi
        if not ok:
            raise _fail(f"must be {what}, got {value!r}")
        return float(value)

    return BeforeValidator(check)


def _integer(lo: int) -> BeforeValidator:
    def check(value: Any) -> int:
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < lo:
            raise _fail(f"must be an integer >= {lo}, got {value!r}")
        return int(value)

    return BeforeValidator(check)


def _strings(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _fail(f"must be a list of strings, got {value!r}")
    return tuple(value)


def _strict_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(f"must be true or false, got {value!r}")
    return value


def _optional_string(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _fail(f"must be a string or null, got {value!r}")
    return value


Finite = Annotated[float, _number()]
NonNegative = Annotated[float, _number(lo=0.0)]
Sparsity = Annotated[float, _number(lo=0.0, hi=1.0, what="a sparsity in [0, 1]")]
LengthExponent = Annotated[float, _number(lo=LENGTH_EXPONENT_RANGE[0], hi=LENGTH_EXPONENT_RANGE[1])]
ReferenceLength = Annotated[float, _number(lo=1.0)]
Count = Annotated[int, _integer(0)]
PositiveInt = Annotated[int, _integer(1)]
Strings = Annotated[tuple[str, ...], BeforeValidator(_strings)]
StrictBool = Annotated[bool, BeforeValidator(_strict_bool)]
OptionalString = Annotated[str | None, BeforeValidator(_optional_string)]


# ------------------------------------------------------------------------------------------------ model bases


class _Schema(BaseModel):
    """Closed by default: an unknown key is an error with "did you mean"; renamed keys warn and are mapped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # old name -> new name, accepted with a DeprecationWarning.
    renamed: ClassVar[dict[str, str]] = {}
    # Open models keep unknown keys (in `model_extra`) unless they are near misses of a known key.
    open_keys: ClassVar[bool] = False
    # Extra typo hints (wrong name -> right name) that hold whatever the similarity.
    misnames: ClassVar[dict[str, str]] = {}
    label: ClassVar[str] = "config"

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data  # pydantic reports "must be a JSON object"
        data = dict(data)
        for old, new in cls.renamed.items():
            if old not in data:
                continue
            if new in data:
                raise _fail(f"is the deprecated name of {new!r}, which is set too; keep only {new!r}", old)
            warnings.warn(
                f"{cls.label}: {old!r} is deprecated, use {new!r} (the name NVIDIA ModelOpt uses); "
                "the old name is accepted until the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            data[new] = data.pop(old)
        known = list(cls.model_fields)
        for key in data:
            if key in cls.model_fields:
                continue
            if not isinstance(key, str):
                raise _fail(f"keys must be strings, got {key!r}", str(key))
            if key in cls.misnames:
                raise _fail(f"unknown key; did you mean {cls.misnames[key]!r}?", key)
            if cls.open_keys:
                typo = difflib.get_close_matches(key, known, n=1, cutoff=_TYPO_CUTOFF)
                if typo:
                    raise _fail(f"unknown key; did you mean {typo[0]!r}? (a typo here would silently change "
                                "what is served, so it is refused)", key)  # fmt: skip
                continue
            raise _fail(f"unknown key; {did_you_mean(key, known)}expected one of {known}", key)
        return data


class _Open(_Schema):
    model_config = ConfigDict(extra="allow", frozen=True)
    open_keys: ClassVar[bool] = True


class _PhaseMap(_Schema):
    """A closed map phase -> value: `prefill` and/or `decode`, nothing else."""

    def get(self, phase: str) -> Any:
        return getattr(self, phase)


# ----------------------------------------------------------------------------------------- the checkpoint block


class ABParams(_Schema):
    label: ClassVar[str] = "threshold_scale_factor.<phase>"
    a: NonNegative
    b: Finite


class ThresholdScaleFactor(_PhaseMap):
    label: ClassVar[str] = "threshold_scale_factor"
    formula: Literal["a * exp(b * target_sparsity)"] = FORMULA
    prefill: ABParams | None = None
    decode: ABParams | None = None


class PhaseTargets(_PhaseMap):
    prefill: Sparsity | None = None
    decode: Sparsity | None = None


def _targets(value: Any) -> Any:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            raise _fail(f"must be a sparsity in [0, 1] (or a map phase -> sparsity), got {value!r}")
        return {"prefill": float(value), "decode": float(value)}
    if value is not None and not isinstance(value, Mapping):
        raise _fail(f"must be a sparsity in [0, 1] or a map phase -> sparsity, got {value!r}")
    return value


def _sparsity_range(value: Any) -> tuple[float, float]:
    ok = isinstance(value, list | tuple) and len(value) == 2
    ok = ok and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not ok or not 0.0 <= value[0] <= value[1] <= 1.0:
        raise _fail(f"must be [lo, hi] with 0 <= lo <= hi <= 1, got {value!r}")
    return float(value[0]), float(value[1])


SparsityRange = Annotated[tuple[float, float], BeforeValidator(_sparsity_range)]


class PhaseRanges(_PhaseMap):
    prefill: SparsityRange | None = None
    decode: SparsityRange | None = None


class FitQuality(_Schema):
    r2: Finite | None = None
    n_points: Count | None = None


class PhaseFits(_PhaseMap):
    prefill: FitQuality | None = None
    decode: FitQuality | None = None


class PhaseExponents(_PhaseMap):
    prefill: LengthExponent | None = None
    decode: LengthExponent | None = None


class PhaseSlopes(_PhaseMap):
    prefill: Finite | None = None
    decode: Finite | None = None


class PhaseLengths(_PhaseMap):
    prefill: ReferenceLength | None = None
    decode: ReferenceLength | None = None


class SkipSoftmaxGroup(_Open):
    """ModelOpt's skip_softmax group (open: a newer ModelOpt's keys are kept) with our optional extras."""

    label: ClassVar[str] = "skip_softmax group"
    misnames: ClassVar[dict[str, str]] = _GROUP_MISNAMES
    algorithm: Literal["skip_softmax"]
    targets: Strings = ()
    ignore: Strings = ()
    initial_disabled_steps: Count = 0
    threshold_scale_factor: ThresholdScaleFactor | None = None
    target_sparsity: Annotated[PhaseTargets | None, BeforeValidator(_targets)] = None
    observed_sparsity_range: PhaseRanges | None = None
    fit: PhaseFits | None = None
    length_exponent: PhaseExponents | None = None
    length_exponent_slope: PhaseSlopes | None = None
    reference_length: PhaseLengths | None = None

    def calibrated(self, phase: str) -> ABParams | None:
        return None if self.threshold_scale_factor is None else self.threshold_scale_factor.get(phase)

    def target(self, phase: str) -> float | None:
        return None if self.target_sparsity is None else self.target_sparsity.get(phase)

    def per_phase(self, key: str, phase: str) -> Any:
        value = getattr(self, key)
        return None if value is None else value.get(phase)

    @model_validator(mode="after")
    def _check_law(self) -> SkipSoftmaxGroup:
        for phase in PHASES:
            params = self.calibrated(phase)
            for key in ("length_exponent", "length_exponent_slope", "reference_length"):
                if self.per_phase(key, phase) is not None and (params is None or params.a == 0.0):
                    raise _fail(
                        f"is set but threshold_scale_factor.{phase} does not calibrate {phase} (a > 0): remove it, "
                        f"or calibrate {phase}",
                        f"{key}.{phase}",
                    )
            if params is None or params.a == 0.0:
                continue
            target = self.target(phase)
            target = DEFAULT_TARGET_SPARSITY if target is None else target
            log_sf = math.log(params.a) + params.b * target
            if log_sf > _LOG_FLOAT_MAX:
                raise _fail(
                    f"a * exp(b * target_sparsity) = exp({log_sf:.6g}) overflows a float64 (at target {target:g}); "
                    f"no calibration produces this (ModelOpt's fit keeps b in [0, 20]): recalibrate, or correct b",
                    f"threshold_scale_factor.{phase}.b",
                )
        return self


class SparseSoftmaxGroup(_Open):
    """ModelOpt's N:M sparse-softmax group: validated enough to decide whether it is active; kept as written."""

    label: ClassVar[str] = "sparse_softmax group"
    algorithm: Literal["sparse_softmax", "triton_sparse_softmax"]
    targets: Strings = ()
    sparsity_n: Count = MODELOPT_DEFAULT_SPARSITY_N
    sparsity_m: Literal[4, 8] = 4
    dense_sink_tokens: Count = 0
    dense_recent_tokens: Count = 64


class SparseSoftmaxParams(_Open):
    """ModelOpt's optional top-level `sparse_softmax` params (they override the group's)."""

    sparsity_n: Count | None = None
    sparsity_m: Literal[4, 8] | None = None
    dense_sink_tokens: Count | None = None
    dense_recent_tokens: Count | None = None


def _group_tag(value: Any) -> str | None:
    algo = value.get("algorithm") if isinstance(value, Mapping) else getattr(value, "algorithm", None)
    if algo is not None and not isinstance(algo, str):
        return repr(algo)  # reported as an unknown algorithm
    return "sparse_softmax" if algo in SPARSE_SOFTMAX_ALGORITHMS else algo


Group = Annotated[
    Annotated[SkipSoftmaxGroup, Tag(SKIP_SOFTMAX)] | Annotated[SparseSoftmaxGroup, Tag("sparse_softmax")],
    Discriminator(_group_tag),
]


def _non_empty_groups(value: Any) -> Any:
    if isinstance(value, Mapping) and not value:
        raise _fail("is empty; expected a group with algorithm 'skip_softmax' (calibrate the checkpoint, or remove "
                    "the sparse_attention_config block)")  # fmt: skip
    return value


class SparseAttentionBlock(_Open):
    """The whole `sparse_attention_config` block (open at top level: unknown keys are kept)."""

    label: ClassVar[str] = BLOCK_KEY
    config_groups: Annotated[dict[str, Group], BeforeValidator(_non_empty_groups)]
    producer: dict[str, Any] | None = None
    sparse_softmax: SparseSoftmaxParams | None = None


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


def resolve_settings(model: SparseAttentionBlock, *, path: str = BLOCK_KEY) -> SparseAttentionSettings:
    """What a validated block serves (see the module docstring); warnings for what a user should know."""
    _refuse_sparse_softmax(model, path)
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
    gpath = f"{path}.config_groups.{name}"
    group: SkipSoftmaxGroup = model.config_groups[name]

    unknown = [f"{path}.{k}" for k in (model.model_extra or {})]
    unknown += [f"{gpath}.{k}" for k in (group.model_extra or {})]
    _report_unknown_once(unknown)

    phases: dict[str, PhaseCalibration | None] = {}
    if not any(group.calibrated(p) is not None for p in PHASES):
        lam = MODELOPT_STATIC_THRESHOLD
        logger.warning(
            "%s calibrates no phase (no threshold_scale_factor.prefill/decode): serving NVIDIA ModelOpt's static "
            "default threshold λ = %g for every row of both phases, as ModelOpt 0.47 does%s; calibrate the "
            "checkpoint for a target sparsity", gpath, lam,
            f" (its `ignore` list {list(group.ignore)} is honoured here; ModelOpt 0.47's static preset ignores it)"
            if group.ignore else "",
        )  # fmt: skip
        static = PhaseCalibration(lam, 0.0, 0.0, length_exponent=0.0)
        phases = {"prefill": static, "decode": static}
    for phase in PHASES if not phases else ():
        params = group.calibrated(phase)
        target = group.target(phase)
        if params is None:
            if target is not None:
                # ModelOpt exports targets for both phases even when it calibrated one: normal, not a warning.
                logger.info("%s.target_sparsity.%s is set but %s is not calibrated: %s stays dense",
                            gpath, phase, phase, phase)  # fmt: skip
            phases[phase] = None
            continue
        if params.a == 0.0:
            logger.warning("%s.threshold_scale_factor.%s.a is 0: NVIDIA ModelOpt serves %s dense, and so do we",
                           gpath, phase, phase)  # fmt: skip
            phases[phase] = None
            continue
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
        phases[phase] = PhaseCalibration(
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
    if all(cal is None for cal in phases.values()):
        logger.warning("%s: no phase is calibrated with a > 0; the checkpoint is served dense", gpath)
    producer = (model.producer or {}).get("name")
    calibrated = [p for p in PHASES if phases[p] is not None and not phases[p].is_static]
    if producer == "modelopt" and calibrated:
        logger.warning(
            "%s: calibrated by NVIDIA ModelOpt, whose (a, b) count sparsity in blocks of 128 query rows x 128 keys; "
            "modelopt_ext drops per row and 64-key tile, so the same (a, b) realizes a higher sparsity here than "
            "the target (README, 'Compatibility with NVIDIA ModelOpt'). Recalibrate with modelopt_ext to serve the "
            "target; recalibration keeps the group's ignore list and other policy", gpath,
        )  # fmt: skip
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


# ------------------------------------------------------------------------------------- the mode config (sparse_cfg)


_REPORTED_LISTS: set[tuple] = set()


def _lambda_value(value: Any) -> float | None:
    """A static λ in (0, 1): a number, or ModelOpt's list form (its first entry is the one applied)."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        if not value:
            raise _fail("must be a number in (0, 1) or a non-empty list of them (the first is applied), got []")
        if len(value) > 1 and tuple(value) not in _REPORTED_LISTS:
            _REPORTED_LISTS.add(tuple(value))
            logger.warning("thresholds list %s: the first value is applied (as in NVIDIA ModelOpt); the others are "
                           "neither applied nor measured here", list(value))  # fmt: skip
        value = value[0]
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0.0 < value < 1.0:
        raise _fail(f"must be None (dense) or a number in (0, 1), got {value!r}")
    return float(value)


class StaticThresholds(_PhaseMap):
    prefill: Annotated[float | None, BeforeValidator(_lambda_value)] = None
    decode: Annotated[float | None, BeforeValidator(_lambda_value)] = None


def _phase_dict(model_cls: type[_PhaseMap], scalar_ok: bool) -> BeforeValidator:
    """A field holding `{phase: value}` (or one value for both phases), validated by a closed phase map."""

    def check(value: Any) -> dict[str, Any]:
        broadcast = scalar_ok and value is not None and not isinstance(value, Mapping)
        if value is None:
            value = {}
        elif broadcast:
            value = {p: value for p in PHASES}
        if not isinstance(value, Mapping):
            raise _fail(f"must be a map {{'prefill': .., 'decode': ..}}, got {value!r}")
        try:
            return model_cls.model_validate(value).model_dump()
        except ValidationError as exc:  # re-raised with the inner path folded into our message
            err = exc.errors(include_url=False)[0]
            msg, extra = _message(err)
            if broadcast:  # the user wrote one value for both phases: name the field itself
                return_msg = msg.replace(", got", " (or a map phase -> value), got", 1)
                raise _fail(return_msg) from None
            raise _fail(msg, ".".join([*_render_loc(err["loc"]), *extra])) from None

    return BeforeValidator(check)


def _method(value: Any) -> str:
    if value not in METHODS:
        raise _fail(f"must be one of {list(METHODS)}; {did_you_mean(value, METHODS)}got {value!r}")
    return value


def _backend(value: Any) -> str:
    value = BACKEND_ALIASES.get(value, value) if isinstance(value, str) else value
    if value not in BACKENDS:
        raise _fail(f"must be one of {list(BACKENDS)}; {did_you_mean(value, BACKENDS)}got {value!r}")
    return value


class SkipSoftmaxLayerConfig(_Schema):
    """Settings of the attention modules one `sparse_cfg` pattern selects."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)
    label: ClassVar[str] = "sparse_cfg layer config"
    renamed: ClassVar[dict[str, str]] = {"threshold": "thresholds"}

    method: Annotated[str, BeforeValidator(_method)] = "skip_softmax"
    enable: StrictBool = True
    # Static λ per phase (None = dense); a calibrated phase uses its fitted law instead.
    thresholds: Annotated[dict[str, float | None], _phase_dict(StaticThresholds, scalar_ok=True)] = {
        "prefill": None,
        "decode": None,
    }
    backend: Annotated[str, BeforeValidator(_backend)] = "auto"
    collect_stats: StrictBool = True

    @property
    def threshold(self) -> dict[str, float | None]:
        """Deprecated alias of `thresholds` (kept for callers of the old name)."""
        return self.thresholds


class CalibrationTargets(_PhaseMap):
    prefill: Sparsity = 0.0
    decode: Sparsity = 0.0


def _trials(value: Any) -> list[float] | None:
    if value is None:
        return None
    ok = isinstance(value, list | tuple) and all(
        isinstance(t, numbers.Real) and not isinstance(t, bool) and math.isfinite(t) and t > 0 for t in value
    )
    if not ok:
        raise _fail(f"must be a list of finite positive scale factors (λ·n), got {value!r}")
    if len(value) < 3:
        raise _fail(f"needs at least 3 scale factors, got {len(value)}")
    if max(value) < 1.0:
        logger.warning(
            "threshold_trials %s are all below 1: modelopt_ext's trials are scale factors λ·n (NVIDIA ModelOpt's are "
            "λ); if these are λ values, multiply them by a typical prompt length", list(value),
        )  # fmt: skip
    return sorted(float(t) for t in value)


class SkipSoftmaxCalibrationConfig(_Schema):
    """How `mtsa.calibrate` measures tile counts (prefill and decode) and which sparsity to serve at."""

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)
    label: ClassVar[str] = "sparse_cfg['calibration']"
    renamed: ClassVar[dict[str, str]] = {"decode_tokens": "num_decode_tokens"}

    # Target sparsity per phase in [0, 1]; 0 (or absent) leaves the phase uncalibrated (dense).
    target_sparse_ratio: Annotated[dict[str, float], _phase_dict(CalibrationTargets, scalar_ok=True)] = {
        "prefill": 0.5,
        "decode": 0.5,
    }
    # Scale factors (λ·n) to measure; None = calibration.fit.default_threshold_trials(). Unlike ModelOpt's
    # `threshold_trials` (λ values), these are multiplied out per sequence length.
    threshold_trials: Annotated[list[float] | None, BeforeValidator(_trials)] = None
    samples: PositiveInt = 24
    max_seqlen: PositiveInt = 4096
    min_seqlen: PositiveInt = 256
    num_decode_tokens: Count = 8
    chunk_size: PositiveInt = 2048
    seed: Annotated[int, _integer(0)] = 0
    data_dir: OptionalString = None
    cache_dir: OptionalString = None

    @model_validator(mode="after")
    def _something_to_calibrate(self) -> SkipSoftmaxCalibrationConfig:
        if all(r == 0.0 for r in self.target_sparse_ratio.values()):
            raise _fail("is 0 for both phases: nothing to calibrate; set a target in (0, 1] for prefill and/or "
                        "decode", "target_sparse_ratio")  # fmt: skip
        return self

    @property
    def decode_tokens(self) -> int:
        """Deprecated alias of `num_decode_tokens` (kept for callers of the old name)."""
        return self.num_decode_tokens


def normalize_sparse_cfg(sparse_cfg: Any) -> dict[str, dict]:
    """Validate `sparse_cfg` and fill defaults; errors name `sparse_cfg[<key>].<field>` and the fix."""
    if not isinstance(sparse_cfg, Mapping):
        raise SparseAttentionConfigError(
            f"sparse_cfg: must be a dict of pattern -> layer config, got {type(sparse_cfg).__name__}"
        )
    out: dict[str, dict] = {}
    for key, value in sparse_cfg.items():
        where = f"sparse_cfg[{key!r}]"
        if not isinstance(key, str):
            raise SparseAttentionConfigError(f"{where}: keys must be fnmatch patterns over module names (strings)")
        if not isinstance(value, Mapping):
            raise SparseAttentionConfigError(f"{where}: must be a dict, got {type(value).__name__}")
        cls = SkipSoftmaxCalibrationConfig if key == CALIBRATION_KEY else SkipSoftmaxLayerConfig
        try:
            out[key] = cls.model_validate(value).model_dump()
        except ValidationError as exc:
            raise SparseAttentionConfigError(format_validation_error(exc, where)) from None
    if not any(k != CALIBRATION_KEY for k in out):
        raise SparseAttentionConfigError("sparse_cfg: selects no modules; add a pattern such as '*self_attn*'")
    return out
