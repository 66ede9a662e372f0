"""The arguments of `install_sparse_attention` (mode, kernel backend, settings, calibration trials), checked before
anything else (plugins/vllm/install.py).
"""

from __future__ import annotations

import math

from ...checkpoint.config_io import SparseAttentionSettings
from .context import MODES

KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")
"""The kernel backends install takes ("auto": plugins/vllm/checks.py `resolve_kernel_backend`)."""


def checked_mode_arguments(mode, backend, settings, calibration_scale_factors, calibration_laws):
    """(trials, trial_laws) of a valid call: the mode's arguments checked before anything else."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if settings is not None and not isinstance(settings, SparseAttentionSettings):
        raise TypeError(f"settings must be a SparseAttentionSettings or None, got {type(settings).__name__}")
    if mode != "calibrate":
        if calibration_scale_factors or calibration_laws:
            raise ValueError("calibration_scale_factors / calibration_laws are only used with mode='calibrate'")
        return (), None
    if bool(calibration_scale_factors) == bool(calibration_laws):
        raise ValueError("mode='calibrate' needs exactly one of calibration_scale_factors (threshold trials as "
                         "scale factors) and calibration_laws")
    if calibration_laws:
        trial_laws = _checked_trial_laws(calibration_laws)
        return tuple(float(i) for i in range(len(trial_laws))), trial_laws
    trials = tuple(float(s) for s in calibration_scale_factors)
    if any(not (s > 0 and math.isfinite(s)) for s in trials):
        raise ValueError(f"calibration_scale_factors must be finite and positive, got {trials}")
    return trials, None


def _checked_trial_laws(laws) -> tuple[tuple[float, float, float, float], ...]:
    out = []
    for i, law in enumerate(laws):
        try:
            values = tuple(float(x) for x in law)
        except (TypeError, ValueError):
            values = ()
        if len(values) != 4 or not all(math.isfinite(x) for x in values):
            raise ValueError(f"calibration_laws[{i}] must be 4 finite numbers (c_prefill, c_decode, γ_prefill, "
                             f"γ_decode), got {law!r}")
        out.append(values)
    return tuple(out)
