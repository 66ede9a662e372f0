"""The served law as one value: `PhaseLaw` (one phase) and `Law` (both phases), from the checkpoint to the kernels.

docs/skip_softmax.md: a row of law length n drops a tile when its score gap exceeds -ln λ, with
ln λ = c − γ·ln(n); c = -inf serves the phase dense. A calibration (`PhaseCalibration`), a request's own targets
(plugins/vllm/request_targets.py) and a calibration trial all end as a `Law`; the planner writes its fields, by
name, into the buffers the kernels read. Framework-free (no torch, no vLLM), like the rest of checkpoint/.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .constants import PHASES  # phase order wherever a law is laid out per phase (kernels: 0 prefill, 1 decode)

__all__ = ["DENSE", "PHASES", "Law", "PhaseLaw"]


@dataclass(frozen=True)
class PhaseLaw:
    """ln λ_row = c − γ·ln(n) for one phase; c = -inf: the phase is served dense."""

    c: float = -math.inf
    gamma: float = 1.0

    @classmethod
    def of(cls, calib) -> PhaseLaw:
        """The law a `PhaseCalibration` serves (None: dense). ModelOpt's λ = a·exp(b·target)/n is c = ln a +
        b·target, γ = 1; a calibration with its own `log_scale_factor` / `length_exponent` is served with those."""
        if calib is None:
            return DENSE
        c = getattr(calib, "log_scale_factor", None)
        if c is None:  # a settings object without the schema's property
            c = (math.log(calib.a) if calib.a > 0 else -math.inf) + calib.b * calib.target_sparsity
        gamma = getattr(calib, "length_exponent", None)
        return cls(float(c), 1.0 if gamma is None else float(gamma))

    @property
    def is_dense(self) -> bool:
        return not math.isfinite(self.c)

    def lowest_log_lambda(self, longest: int) -> float:
        """The smallest ln λ over law lengths 1..`longest` (at `longest` for γ > 0, at 1 otherwise)."""
        return self.c - self.gamma * math.log(max(int(longest), 1)) if self.gamma > 0 else self.c

    def can_drop(self, longest: int) -> bool:
        """Whether some row of law length <= `longest` has λ < 1, i.e. may drop a tile."""
        return not self.is_dense and self.lowest_log_lambda(longest) < 0

    def shifted(self, dc: float) -> PhaseLaw:
        return PhaseLaw(self.c + dc, self.gamma)

    def describe(self) -> str:
        return "dense" if self.is_dense else f"c={self.c:.4g}, γ={self.gamma:.3g}"


DENSE = PhaseLaw()


@dataclass(frozen=True)
class Law:
    """The law of both phases, as served to one request (or to every request: the checkpoint's)."""

    prefill: PhaseLaw = DENSE
    decode: PhaseLaw = DENSE

    @classmethod
    def of(cls, settings) -> Law:
        """The checkpoint's law (`SparseAttentionSettings`; None: dense)."""
        if settings is None:
            return cls()
        return cls(PhaseLaw.of(settings.prefill), PhaseLaw.of(settings.decode))

    @classmethod
    def from_values(cls, values: Iterable[float]) -> Law:
        """From (c_prefill, c_decode, γ_prefill, γ_decode), the order of the calibration driver's trial laws."""
        c_pre, c_dec, g_pre, g_dec = (float(v) for v in values)
        return cls(PhaseLaw(c_pre, g_pre), PhaseLaw(c_dec, g_dec))

    def phase(self, name: str) -> PhaseLaw:
        return self.prefill if name == "prefill" else self.decode

    def replace(self, phase: str, law: PhaseLaw) -> Law:
        return Law(law, self.decode) if phase == "prefill" else Law(self.prefill, law)

    @property
    def is_dense(self) -> bool:
        """Both phases dense."""
        return self.prefill.is_dense and self.decode.is_dense

    def can_drop(self, longest: int) -> bool:
        """Whether a row of either phase with law length <= `longest` may drop a tile (the host's dense decision)."""
        return self.prefill.can_drop(longest) or self.decode.can_drop(longest)

    @property
    def c(self) -> tuple[float, float]:
        """(c_prefill, c_decode): one row of the kernels' `log_scale_factors`."""
        return self.prefill.c, self.decode.c

    @property
    def gamma(self) -> tuple[float, float]:
        """(γ_prefill, γ_decode): one row of the kernels' `length_exponents`."""
        return self.prefill.gamma, self.decode.gamma

    def describe(self) -> str:
        return f"prefill {self.prefill.describe()}, decode {self.decode.describe()}"
