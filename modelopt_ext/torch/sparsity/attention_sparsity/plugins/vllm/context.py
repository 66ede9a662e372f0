"""One engine's sparse-attention configuration, shared by its layers' impls and read by its metadata builders.

An install creates one `SparseAttentionContext` for the layers it covers (one model, i.e. one engine or one worker
rank) and every sparse impl of those layers points to it; re-installing reconfigures it in place. The builders of
that engine find it through their layers each step, so there is no process-wide registry: two engines in one
process have two contexts.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from ...checkpoint.config_io import PhaseCalibration, SparseAttentionSettings

logger = logging.getLogger(__name__)

MODES = ("serve", "calibrate")
PHASES = ("prefill", "decode")


def phase_law(calib: PhaseCalibration | None) -> tuple[float, float]:
    """`(c, γ)` of one phase: ln λ_row = c - γ·ln(n) (docs/skip_softmax.md); `(-inf, 1)` for a dense phase.

    ModelOpt's law λ = a·exp(b·target) / n is c = ln a + b·target, γ = 1. A calibration that carries its own
    `log_scale_factor` / `length_exponent` (config schema, issue #15) is served with those.
    """
    if calib is None:
        return -math.inf, 1.0
    c = getattr(calib, "log_scale_factor", None)
    if c is None:  # a settings object without the schema's property
        c = (math.log(calib.a) if calib.a > 0 else -math.inf) + calib.b * calib.target_sparsity
    gamma = getattr(calib, "length_exponent", None)
    return float(c), 1.0 if gamma is None else float(gamma)


@dataclass(eq=False)
class SparseAttentionContext:
    """Mode, settings and kernel of one engine's sparse layers, and where its prompt lengths come from."""

    mode: str
    settings: SparseAttentionSettings | None
    kernel_backend: str  # resolved at install: "torch" or "triton" (never "auto": no per-call fallback)
    trials: tuple[float, ...] = ()  # calibrate: threshold trials as scale factors sf_t (λ_t = sf_t / n)
    track_sparsity: bool = True
    prompt_lens: Callable | None = None  # source(common_attn_metadata) -> int32 [num_reqs] | None
    prompt_lens_reason: str | None = None  # why there is no source (the kernel's default applies)
    # source(num_reqs, context) -> float32 [num_reqs, 4] per-row law | None (plugins/vllm/request_targets.py)
    request_laws: Callable | None = None
    request_laws_reason: str | None = None  # why there is no source (every request gets the checkpoint's law)
    request_counters: object | None = None  # RequestCounters (plugins/vllm/request_stats.py): realized per request
    version: int = 0  # bumped by every reconfiguration; builders refresh their law buffers when it changes
    # calibrate with served laws instead of scale factors: (c_prefill, c_decode, γ_prefill, γ_decode) per trial
    trial_laws: tuple[tuple[float, float, float, float], ...] | None = None
    graph_path: str | None = None  # the forward full decode graphs captured ("sparse"/"dense"), when they run
    _logged: set = field(default_factory=set, repr=False)
    _serves_dense: tuple | None = field(default=None, repr=False)

    @property
    def calibrating(self) -> bool:
        return self.mode == "calibrate"

    def law(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """`((c_prefill, c_decode), (γ_prefill, γ_decode))` for serving; c = -inf for a dense phase."""
        s = self.settings
        pre = phase_law(s.prefill if s is not None else None)
        dec = phase_law(s.decode if s is not None else None)
        return (pre[0], dec[0]), (pre[1], dec[1])

    @property
    def serves_dense(self) -> bool:
        """Serving with no calibrated phase: every layer runs its native forward (cached per `version`: every
        layer's forward asks, every step)."""
        cached = self._serves_dense
        if cached is not None and cached[0] == (self.version, self.mode, id(self.settings)):
            return cached[1]
        dense = False
        if not self.calibrating:
            (c_pre, c_dec), _ = self.law()
            dense = not (math.isfinite(c_pre) or math.isfinite(c_dec))
        self._serves_dense = ((self.version, self.mode, id(self.settings)), dense)
        return dense

    def trial_log_scale_factors(self) -> tuple[float, ...]:
        """ln sf_t of each calibration trial (γ = 1 for both phases: λ_t = sf_t / n)."""
        return tuple(math.log(s) for s in self.trials)

    def log_once(self, key: str, msg: str, *args, level: int = logging.INFO) -> None:
        """Log a message once per engine (not once per process: each engine says it)."""
        if key not in self._logged:
            self._logged.add(key)
            logger.log(level, msg, *args)

    def describe(self) -> str:
        if self.calibrating:
            kind = "law" if self.trial_laws else "scale-factor"
            return f"calibration, {len(self.trials)} {kind} trials, {self.kernel_backend} kernel"
        (c_pre, c_dec), (g_pre, g_dec) = self.law()
        phase = lambda c, g: "dense" if not math.isfinite(c) else f"c={c:.4g}, γ={g:.3g}"  # noqa: E731
        return f"serve, prefill {phase(c_pre, g_pre)}, decode {phase(c_dec, g_dec)}, {self.kernel_backend} kernel"
