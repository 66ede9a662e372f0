"""Validated configuration of skip-softmax sparse attention (the `modelopt_ext_sparse_attention` mode).

The layout follows ModelOpt's sparse-attention configs so presets read the same: `sparse_cfg` maps fnmatch
patterns over module names (e.g. ``"*self_attn*"``) to a layer config, and the reserved key ``"calibration"`` holds
the calibration settings. Every error names the offending field (``sparse_cfg['*attn*'].threshold.prefill``), so a
typo fails at `mtsa.sparsify` instead of silently meaning "dense".
"""

from __future__ import annotations

import copy
import math
from typing import Any

from modelopt.torch.opt.config import ModeloptBaseConfig, ModeloptField
from pydantic import ValidationError, field_validator

PHASES = ("prefill", "decode")
METHODS = ("skip_softmax",)
BACKENDS = ("auto", "torch", "triton")
CALIBRATION_KEY = "calibration"


def _fail(field: str, msg: str) -> ValueError:
    return ValueError(f"{field}: {msg}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


class SkipSoftmaxLayerConfig(ModeloptBaseConfig):
    """Settings of the attention modules one `sparse_cfg` pattern selects."""

    method: str = ModeloptField(default="skip_softmax", title="Sparse attention method (only 'skip_softmax').")
    enable: bool = ModeloptField(default=True, title="Run matched modules sparse (False keeps the sdpa path).")
    threshold: dict[str, float | None] = ModeloptField(
        default={"prefill": None, "decode": None},
        title="Static λ per phase (None = dense); a calibrated phase uses a*exp(b*target)/kv_len instead.",
    )
    backend: str = ModeloptField(default="auto", title="Kernel backend: 'auto' (Triton on CUDA), 'torch', 'triton'.")
    collect_stats: bool = ModeloptField(default=True, title="Count visited/skipped tiles (realized sparsity).")

    @field_validator("method")
    @classmethod
    def _check_method(cls, v):
        if v not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {v!r}")
        return v

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, v):
        if v not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)}, got {v!r}")
        return v

    @field_validator("threshold", mode="before")
    @classmethod
    def _check_threshold(cls, v):
        if v is None:
            return {p: None for p in PHASES}
        if _is_number(v):  # one λ for both phases
            v = {p: v for p in PHASES}
        if not isinstance(v, dict):
            raise ValueError(f"threshold must be a dict {{'prefill': λ, 'decode': λ}} or one number, got {v!r}")
        unknown = set(v) - set(PHASES)
        if unknown:
            raise ValueError(f"threshold has unknown phases {sorted(unknown)}; expected {list(PHASES)}")
        out = {}
        for phase in PHASES:
            lam = v.get(phase)
            if lam is not None and (not _is_number(lam) or not math.isfinite(lam) or not 0.0 < lam < 1.0):
                raise ValueError(f"threshold.{phase} must be None (dense) or a number in (0, 1), got {lam!r}")
            out[phase] = None if lam is None else float(lam)
        return out


class SkipSoftmaxCalibrationConfig(ModeloptBaseConfig):
    """How `mtsa.calibrate` measures tile counts (prefill and decode) and which sparsity to serve at."""

    target_sparse_ratio: dict[str, float] = ModeloptField(
        default={"prefill": 0.5, "decode": 0.5},
        title="Target sparsity per phase in [0, 1); 0 leaves the phase uncalibrated (dense).",
    )
    threshold_trials: list[float] | None = ModeloptField(
        default=None, title="Scale factors (λ·kv_len) to measure; None = calibration.fit.default_threshold_trials()."
    )
    samples: int = ModeloptField(default=24, title="Number of calibration prompts from the shared data builder.")
    max_seqlen: int = ModeloptField(default=4096, title="Longest calibration prompt in tokens.")
    min_seqlen: int = ModeloptField(default=256, title="Shortest calibration prompt in tokens.")
    decode_tokens: int = ModeloptField(default=8, title="Greedy decode steps measured after each prompt.")
    chunk_size: int = ModeloptField(default=2048, title="Chunked prefill: tokens per forward for long prompts.")
    seed: int = ModeloptField(default=0, title="Seed of the calibration data builder.")
    data_dir: str | None = ModeloptField(default=None, title="Optional local text corpus for the data builder.")
    cache_dir: str | None = ModeloptField(default=None, title="Optional cache directory for built prompts.")

    @field_validator("target_sparse_ratio", mode="before")
    @classmethod
    def _check_target(cls, v):
        if _is_number(v):
            v = {p: v for p in PHASES}
        if not isinstance(v, dict):
            raise ValueError(f"target_sparse_ratio must be a dict {{'prefill': r, 'decode': r}}, got {v!r}")
        unknown = set(v) - set(PHASES)
        if unknown:
            raise ValueError(f"target_sparse_ratio has unknown phases {sorted(unknown)}; expected {list(PHASES)}")
        out = {}
        for phase in PHASES:
            r = v.get(phase, 0.0)
            if not _is_number(r) or not math.isfinite(r) or not 0.0 <= r < 1.0:
                raise ValueError(f"target_sparse_ratio.{phase} must be a number in [0, 1), got {r!r}")
            out[phase] = float(r)
        if all(r == 0.0 for r in out.values()):
            raise ValueError("target_sparse_ratio is 0 for both phases: nothing to calibrate")
        return out

    @field_validator("threshold_trials")
    @classmethod
    def _check_trials(cls, v):
        if v is None:
            return v
        if len(v) < 3:
            raise ValueError(f"threshold_trials needs at least 3 scale factors, got {len(v)}")
        if any(not math.isfinite(t) or t <= 0 for t in v):
            raise ValueError(f"threshold_trials must be finite positive scale factors (λ·kv_len), got {v}")
        return sorted(float(t) for t in v)

    @field_validator("samples", "max_seqlen", "min_seqlen", "chunk_size")
    @classmethod
    def _check_positive(cls, v, info):
        if v < 1:
            raise ValueError(f"{info.field_name} must be >= 1, got {v}")
        return v

    @field_validator("decode_tokens")
    @classmethod
    def _check_decode_tokens(cls, v):
        if v < 0:
            raise ValueError(f"decode_tokens must be >= 0, got {v}")
        return v


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    msg = err.get("msg", str(exc)).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc and not msg.startswith(loc) else msg


def normalize_sparse_cfg(sparse_cfg: Any) -> dict[str, dict]:
    """Validate `sparse_cfg` and fill defaults; errors name `sparse_cfg[<key>].<field>`."""
    if not isinstance(sparse_cfg, dict):
        raise _fail("sparse_cfg", f"must be a dict of pattern -> layer config, got {type(sparse_cfg).__name__}")
    out: dict[str, dict] = {}
    for key, value in sparse_cfg.items():
        where = f"sparse_cfg[{key!r}]"
        if not isinstance(key, str):
            raise _fail(where, "keys must be fnmatch patterns over module names (strings)")
        if not isinstance(value, dict):
            raise _fail(where, f"must be a dict, got {type(value).__name__}")
        cls = SkipSoftmaxCalibrationConfig if key == CALIBRATION_KEY else SkipSoftmaxLayerConfig
        try:
            out[key] = cls(**value).model_dump()
        except ValidationError as exc:
            raise _fail(where, _first_error(exc)) from None
    if not any(k != CALIBRATION_KEY for k in out):
        raise _fail("sparse_cfg", "selects no modules; add a pattern such as '*self_attn*'")
    return out


class SparseAttentionConfig(ModeloptBaseConfig):
    """Config of the `modelopt_ext_sparse_attention` mode.

    `sparse_cfg` keys are fnmatch patterns over module names, applied in order (a later match overrides an
    earlier one, as in ModelOpt); the key "calibration" holds `SkipSoftmaxCalibrationConfig` fields.
    """

    sparse_cfg: dict[str, dict] = ModeloptField(
        default={"*self_attn*": {"method": "skip_softmax", "enable": True}},
        title="Pattern -> layer config, plus an optional 'calibration' entry.",
        validate_default=True,
    )

    @field_validator("sparse_cfg", mode="before")
    @classmethod
    def _check_sparse_cfg(cls, v):
        return normalize_sparse_cfg(v)

    @property
    def calibration(self) -> SkipSoftmaxCalibrationConfig | None:
        raw = self.sparse_cfg.get(CALIBRATION_KEY)
        return None if raw is None else SkipSoftmaxCalibrationConfig(**raw)

    def layer_patterns(self) -> list[tuple[str, SkipSoftmaxLayerConfig]]:
        return [(k, SkipSoftmaxLayerConfig(**v)) for k, v in self.sparse_cfg.items() if k != CALIBRATION_KEY]


def as_config(config: Any) -> SparseAttentionConfig:
    """Accept a `SparseAttentionConfig`, a preset dict ``{"sparse_cfg": ...}`` or a bare `sparse_cfg` dict."""
    if isinstance(config, SparseAttentionConfig):
        return config
    if isinstance(config, dict):
        config = copy.deepcopy(config)
        if "sparse_cfg" not in config:
            config = {"sparse_cfg": config}
        try:
            return SparseAttentionConfig(**config)
        except ValidationError as exc:
            raise ValueError(_first_error(exc)) from None
    raise TypeError(f"config must be a dict or SparseAttentionConfig, got {type(config).__name__}")


# Static threshold for every self-attention module: the λ values ModelOpt's flash_skip_softmax preset uses.
SKIP_SOFTMAX_DEFAULT: dict[str, Any] = {
    "sparse_cfg": {
        "*self_attn*": {
            "method": "skip_softmax",
            "threshold": {"prefill": 1e-3, "decode": 1e-4},
            "backend": "auto",
            "enable": True,
        },
    },
}

# Calibrate both phases to 50% sparsity on the shared calibration prompts; λ = a*exp(b*target)/kv_len at runtime.
SKIP_SOFTMAX_CALIB: dict[str, Any] = {
    "sparse_cfg": {
        CALIBRATION_KEY: {
            "target_sparse_ratio": {"prefill": 0.5, "decode": 0.5},
            "samples": 24,
            "max_seqlen": 4096,
            "decode_tokens": 8,
            "chunk_size": 2048,
        },
        "*self_attn*": {"method": "skip_softmax", "backend": "auto", "enable": True},
    },
}
