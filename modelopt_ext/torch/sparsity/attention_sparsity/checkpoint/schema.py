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

Constants live in `constants.py`, error rendering in `errors.py`, and what a valid block resolves to (the
served law) in `resolve.py`.
"""

from __future__ import annotations

import difflib
import logging
import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Tag, ValidationError, model_validator

from .constants import (
    BACKEND_ALIASES,
    BACKENDS,
    BLOCK_KEY,
    CALIBRATION_KEY,
    DEFAULT_TARGET_SPARSITY,
    FORMULA,
    LENGTH_EXPONENT_RANGE,
    METHODS,
    MODELOPT_DEFAULT_SPARSITY_N,
    PHASES,
    SKIP_SOFTMAX,
    SPARSE_SOFTMAX_ALGORITHMS,
)
from .errors import (
    SparseAttentionConfigError,
    _fail,
    _message,
    _render_loc,
    did_you_mean,
    format_validation_error,
)

logger = logging.getLogger(__name__)

_LOG_FLOAT_MAX = math.log(1.7976931348623157e308)
# A key at an open level that is this close to a known key is a typo, not a newer ModelOpt's key.
_TYPO_CUTOFF = 0.85
# Known confusions at group level (a mode-config name written into the checkpoint).
_GROUP_MISNAMES = {"target_sparse_ratio": "target_sparsity", "thresholds": "threshold_scale_factor"}


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
    contract_version: PositiveInt | None = None

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
