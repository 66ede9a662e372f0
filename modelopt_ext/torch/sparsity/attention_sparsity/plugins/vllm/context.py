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

from ...checkpoint.config_io import SparseAttentionSettings
from ...checkpoint.law import PHASES, Law

__all__ = ["MODES", "PHASES", "SparseAttentionContext"]

logger = logging.getLogger(__name__)

MODES = ("serve", "calibrate")


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
    # source(num_reqs, context, cam) -> one RequestLaw per row | None (plugins/vllm/request_targets.py)
    request_laws: Callable | None = None
    request_laws_reason: str | None = None  # why there is no source (every request gets the checkpoint's law)
    request_counters: object | None = None  # RequestCounters (plugins/vllm/request_stats.py): realized per request
    version: int = 0  # bumped by every reconfiguration; builders refresh their law buffers when it changes
    # calibrate with served laws instead of scale factors: one Law per trial ((c_prefill, c_decode, γ_prefill,
    # γ_decode) tuples are taken as such)
    trial_laws: tuple[Law, ...] | None = None
    graph_path: str | None = None  # the forward full decode graphs captured ("sparse"/"dense"), when they run
    _logged: set = field(default_factory=set, repr=False)
    _serves_dense: tuple | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.trial_laws is not None:
            self.trial_laws = tuple(t if isinstance(t, Law) else Law.from_values(t) for t in self.trial_laws)

    @property
    def calibrating(self) -> bool:
        return self.mode == "calibrate"

    def law(self) -> Law:
        """The checkpoint's law, served to every request that sets no target of its own."""
        return Law.of(self.settings)

    @property
    def serves_dense(self) -> bool:
        """Serving with no calibrated phase: every layer runs its native forward (cached per `version`: every
        layer's forward asks, every step)."""
        cached = self._serves_dense
        if cached is not None and cached[0] == (self.version, self.mode, id(self.settings)):
            return cached[1]
        dense = not self.calibrating and self.law().is_dense
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
        return f"serve, {self.law().describe()}, {self.kernel_backend} kernel"
