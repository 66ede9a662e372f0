"""vLLM-free reading and validation of a checkpoint's `sparse_attention_config` (NVIDIA ModelOpt's schema).

Schema (as ModelOpt exports it into config.json):

    "sparse_attention_config": {
      "config_groups": {"group_0": {
          "algorithm": "skip_softmax", "targets": ["LlamaAttention"],
          "threshold_scale_factor": {"formula": "a * exp(b * target_sparsity)",
                                     "prefill": {"a": 7.93, "b": 8.61}, "decode": {"a": 0.12, "b": 9.85}},
          "target_sparsity": {"prefill": 0.5, "decode": 0.5}}},
      "producer": {"name": "modelopt", "version": "..."}}
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PHASES = ("prefill", "decode")


class SparseAttentionConfigError(ValueError):
    """A malformed `sparse_attention_config`; the message names the offending field."""


@dataclass(frozen=True)
class PhaseCalibration:
    """Calibrated fit `scale_factor = a * exp(b * sparsity)` of one phase and the target to serve at."""

    a: float
    b: float
    target_sparsity: float

    @property
    def scale_factor(self) -> float:
        """λ * kv_len for this phase's target: the per-sequence threshold is scale_factor / kv_len."""
        return self.a * math.exp(self.b * self.target_sparsity)


@dataclass(frozen=True)
class SparseAttentionSettings:
    """What serving needs: the per-phase calibration (None = dense for that phase) and the layers it covers."""

    prefill: PhaseCalibration | None
    decode: PhaseCalibration | None
    disabled_layers: tuple[str, ...] = ()

    def phase(self, name: str) -> PhaseCalibration | None:
        return {"prefill": self.prefill, "decode": self.decode}[name]
