"""Configuration of skip-softmax sparse attention (the `modelopt_ext_sparse_attention` mode).

The layout follows ModelOpt's sparse-attention configs so presets read the same: `sparse_cfg` maps fnmatch
patterns over module names (e.g. ``"*self_attn*"``) to a layer config, and the reserved key ``"calibration"`` holds
the calibration settings. The fields and their validation live in `checkpoint/` (one schema for the mode config and
the checkpoint block); this module only binds them to ModelOpt's mode framework (`ModeloptBaseConfig`) and holds the
presets. Every error names the offending field (``sparse_cfg['*attn*'].thresholds.prefill``) and the fix, so a typo
fails at `mtsa.sparsify` instead of silently meaning "dense".
"""

from __future__ import annotations

import copy
from typing import Any

from modelopt.torch.opt.config import ModeloptBaseConfig, ModeloptField
from pydantic import ValidationError, field_validator
from pydantic_core import PydanticCustomError

from .checkpoint.constants import BACKENDS, CALIBRATION_KEY, METHODS, PHASES
from .checkpoint.errors import SparseAttentionConfigError
from .checkpoint.schema import SkipSoftmaxCalibrationConfig, SkipSoftmaxLayerConfig, normalize_sparse_cfg

__all__ = [
    "BACKENDS",
    "CALIBRATION_KEY",
    "METHODS",
    "PHASES",
    "SKIP_SOFTMAX_CALIB",
    "SKIP_SOFTMAX_DEFAULT",
    "SkipSoftmaxCalibrationConfig",
    "SkipSoftmaxLayerConfig",
    "SparseAttentionConfig",
    "as_config",
    "normalize_sparse_cfg",
]


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
        try:
            return normalize_sparse_cfg(v)
        except SparseAttentionConfigError as exc:  # the message already names the field: no "Value error, "
            raise PydanticCustomError("modelopt_ext", "{msg}", {"msg": str(exc)}) from None

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
            raise SparseAttentionConfigError("\n".join(e["msg"] for e in exc.errors(include_url=False))) from None
    raise TypeError(f"config must be a dict or SparseAttentionConfig, got {type(config).__name__}")


# Static threshold for every self-attention module: the λ values ModelOpt's flash_skip_softmax preset uses.
SKIP_SOFTMAX_DEFAULT: dict[str, Any] = {
    "sparse_cfg": {
        "*self_attn*": {
            "method": "skip_softmax",
            "thresholds": {"prefill": 1e-3, "decode": 1e-4},
            "backend": "auto",
            "enable": True,
        },
    },
}

# Calibrate both phases to 50% sparsity on the shared calibration prompts; λ = a*exp(b*target)/n at runtime.
SKIP_SOFTMAX_CALIB: dict[str, Any] = {
    "sparse_cfg": {
        CALIBRATION_KEY: {
            "target_sparse_ratio": {"prefill": 0.5, "decode": 0.5},
            "samples": 24,
            "max_seqlen": 4096,
            "num_decode_tokens": 8,
            "chunk_size": 2048,
        },
        "*self_attn*": {"method": "skip_softmax", "backend": "auto", "enable": True},
    },
}
