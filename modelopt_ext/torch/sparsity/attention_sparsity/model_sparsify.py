"""User API: sparsify, calibrate, enable/disable by pattern, export the checkpoint block, print a summary."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import modelopt.torch.opt as mto
from modelopt.torch.opt.conversion import ModeloptStateManager
from torch import nn

from .checkpoint.config_io import build_sparse_attention_config, write_sparse_attention_config
from .config import PHASES, SparseAttentionConfig, as_config
from .conversion import set_sparse_attention_by_pattern, sparse_attention_states
from .mode import MODE_NAME, SparseAttentionModeRegistry
from .plugins.huggingface import find_attention_modules

logger = logging.getLogger(__name__)

ForwardLoop = Callable[[nn.Module], Any]


def sparsify(
    model: nn.Module, config: dict | SparseAttentionConfig, forward_loop: ForwardLoop | None = None, *, tokenizer=None
) -> nn.Module:
    """Convert `model` to skip-softmax sparse attention; calibrate too when the config has a 'calibration' entry.

    `forward_loop(model)` runs the calibration data; without it the shared RULER-style prompts are built with
    `tokenizer` (or the model's own, loaded from `model.name_or_path`).
    """
    cfg = as_config(config)
    model = mto.apply_mode(model, mode=[(MODE_NAME, cfg)], registry=SparseAttentionModeRegistry)
    if cfg.calibration is not None:
        calibrate(model, cfg, forward_loop, tokenizer=tokenizer)
    return model


def _mode_config(model: nn.Module) -> SparseAttentionConfig | None:
    if not ModeloptStateManager.is_converted(model):
        return None
    for mode, config, _ in ModeloptStateManager(model).modes_with_states():
        if mode.name == MODE_NAME:
            return as_config(config.model_dump() if hasattr(config, "model_dump") else config)
    return None


def _load_tokenizer(model: nn.Module):
    path = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path:
        raise ValueError(
            "calibration needs data: pass forward_loop=... or tokenizer=... (the model has no name_or_path to "
            "load a tokenizer from)"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ValueError(f"could not load a tokenizer from {path!r} ({exc}); pass tokenizer= or forward_loop=") from exc


def calibrate(
    model: nn.Module,
    config: dict | SparseAttentionConfig | None = None,
    forward_loop: ForwardLoop | None = None,
    *,
    tokenizer=None,
) -> nn.Module:
    """Fit `scale_factor = a * exp(b * sparsity)` per phase on a sparsified model and store it on its modules.

    `config` defaults to the one the model was sparsified with; its `sparse_cfg['calibration']` entry sets the
    targets and data. Raises `CalibrationFitError` (saying what to change) when a phase cannot be fitted.
    """
    from .calibration.calibrate import calibrate_sparse_attention, make_forward_loop

    states = sparse_attention_states(model, enabled_only=True)
    if not sparse_attention_states(model):
        raise ValueError(f"{type(model).__name__} is not sparsified; call mtsa.sparsify(model, config) first")
    cfg = as_config(config) if config is not None else _mode_config(model)
    calib = cfg.calibration if cfg is not None else None
    if calib is None:
        raise ValueError(
            "sparse_cfg['calibration'] is missing: add e.g. {'target_sparse_ratio': {'prefill': 0.5, 'decode': 0.5}} "
            "(see mtsa.SKIP_SOFTMAX_CALIB)"
        )
    if forward_loop is None:
        forward_loop = make_forward_loop(tokenizer or _load_tokenizer(model), calib)
    calibrate_sparse_attention(model, states, calib, forward_loop)
    return model


def enable_sparse_attention(model: nn.Module, pattern: str = "*") -> list[str]:
    """Enable sparse attention on converted modules whose name matches the fnmatch `pattern`; returns their names."""
    return set_sparse_attention_by_pattern(model, pattern, True)


def disable_sparse_attention(model: nn.Module, pattern: str = "*") -> list[str]:
    """Disable (back to transformers' sdpa path) modules whose name matches `pattern`; returns their names."""
    return set_sparse_attention_by_pattern(model, pattern, False)


def set_target_sparsity(model: nn.Module, target: float | dict[str, float]) -> None:
    """Serve calibrated phases at a new target sparsity (one number or per phase), without recalibrating.

    The fit `scale_factor = a * exp(b * sparsity)` does not depend on the target, so only λ changes.
    """
    targets = {p: target for p in PHASES} if isinstance(target, int | float) else dict(target)
    unknown = set(targets) - set(PHASES)
    if unknown:
        raise ValueError(f"target has unknown phases {sorted(unknown)}; expected {list(PHASES)}")
    for phase, value in targets.items():
        if not 0.0 <= float(value) < 1.0:
            raise ValueError(f"target.{phase} must be in [0, 1), got {value!r}")
    states = sparse_attention_states(model, enabled_only=True)
    if not any(s.calibration.get(p) is not None for s in states.values() for p in targets):
        raise ValueError("no enabled module is calibrated for these phases; run mtsa.calibrate(model, config) first")
    for state in states.values():
        for phase, value in targets.items():
            cal = state.calibration.get(phase)
            if cal is not None:
                state.calibration[phase] = cal.at_target(float(value))


def reset_sparse_attention_stats(model: nn.Module) -> None:
    for state in sparse_attention_states(model).values():
        state.reset_stats()


def realized_sparsity(model: nn.Module) -> dict[str, float | None]:
    """Skipped / visited tiles per phase, summed over enabled modules since the last reset."""
    out = {}
    for phase in PHASES:
        visited = skipped = 0
        for state in sparse_attention_states(model, enabled_only=True).values():
            stats = state.stats.get(phase)
            if stats is not None:
                v, s = (int(x) for x in stats.tolist())
                visited, skipped = visited + v, skipped + s
        out[phase] = skipped / visited if visited else None
    return out


def export_sparse_attention_config(
    model: nn.Module, ckpt_dir: str | os.PathLike | None = None, *, backup: bool = True
) -> dict:
    """The `sparse_attention_config` block (ModelOpt's schema) of a calibrated model; also written when `ckpt_dir`.

    Disabled attention modules are listed under `ignore`; all enabled modules must share one calibration.
    """
    enabled = sparse_attention_states(model, enabled_only=True)
    if not enabled:
        raise ValueError(f"{type(model).__name__} has no enabled sparse attention; call mtsa.sparsify/calibrate first")
    calibrations = {name: tuple(state.calibration.get(p) for p in PHASES) for name, state in enabled.items()}
    distinct = set(calibrations.values())
    if len(distinct) > 1:
        raise ValueError(
            "enabled modules carry different calibrations; the checkpoint schema holds one per phase: recalibrate "
            "with mtsa.calibrate(model) after enabling/disabling modules"
        )
    fits = dict(zip(PHASES, distinct.pop(), strict=True))
    if all(fit is None for fit in fits.values()):
        raise ValueError(
            "the model is not calibrated (static thresholds have no place in the checkpoint schema); run "
            "mtsa.calibrate(model, config) first"
        )
    modules = find_attention_modules(model)
    classes = sorted({type(modules[name]).__name__ for name in enabled if name in modules})
    ignore = sorted(name for name in sparse_attention_states(model) if name not in enabled)
    block = build_sparse_attention_config(fits, attention_classes=classes, ignore=ignore)
    if ckpt_dir is not None:
        save_sparse_attention_config(block, ckpt_dir, backup=backup)
    return block


def save_sparse_attention_config(
    model_or_block: nn.Module | dict, ckpt_dir: str | os.PathLike, *, backup: bool = True
) -> Path:
    """Write the block (or the block exported from a model) into `<ckpt_dir>/config.json`; returns its path."""
    block = model_or_block if isinstance(model_or_block, dict) else export_sparse_attention_config(model_or_block)
    return write_sparse_attention_config(ckpt_dir, block, backup=backup)


def _fmt_phase(state, phase: str) -> str:
    cal = state.calibration.get(phase)
    if cal is not None:
        return f"a={cal.a:.4g} b={cal.b:.4g} @{cal.target_sparsity:.2f}"
    lam = state.threshold.get(phase)
    return "dense" if lam is None else f"λ={lam:.3g}"


def print_sparse_attention_summary(model: nn.Module, *, print_fn: Callable[[str], Any] | None = print) -> str:
    """Table of layer, enabled, per-phase calibration (or static λ) and realized sparsity; printed and returned."""
    states = sparse_attention_states(model)
    if not states:
        raise ValueError(f"{type(model).__name__} is not sparsified; call mtsa.sparsify(model, config) first")
    header = ("layer", "enabled", "prefill", "decode", "sparsity prefill", "sparsity decode")
    rows = []
    for name, state in states.items():
        real = [state.realized_sparsity(p) for p in PHASES]
        rows.append(
            (
                name,
                "yes" if state.enabled else "no",
                _fmt_phase(state, "prefill") if state.enabled else "-",
                _fmt_phase(state, "decode") if state.enabled else "-",
                *("-" if r is None else f"{r:.3f}" for r in real),
            )
        )
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    overall = realized_sparsity(model)
    n_on = sum(1 for s in states.values() if s.enabled)
    lines.append(
        f"{n_on}/{len(states)} attention modules sparse; realized sparsity "
        + ", ".join(f"{p} {'-' if v is None else f'{v:.3f}'}" for p, v in overall.items())
    )
    text = "\n".join(lines)
    logger.debug("sparse attention summary:\n%s", text)
    if print_fn is not None:
        print_fn(text)
    return text
