"""Apply skip-softmax sparse attention to a model, and move its per-module state in and out of mode metadata.

Conversion attaches a `SparseAttentionState` to every attention module (enabled where a `sparse_cfg` pattern says
so) and routes the model's attention through the registered transformers attention function. Nothing is added to
the state dict, so HF checkpoints load and save unchanged; the states (calibration included) travel in the
ModelOpt mode metadata, which is what `mto.save` / `mto.restore` / `mto.modelopt_state` round-trip.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

from torch import nn

from .checkpoint.config_io import PhaseCalibration
from .config import PHASES, SkipSoftmaxLayerConfig, SparseAttentionConfig, as_config
from .plugins.huggingface import (
    STATE_ATTR,
    SparseAttentionState,
    UnsupportedModelError,
    check_model_supported,
    check_module_supported,
    find_attention_modules,
    set_model_attention,
)

logger = logging.getLogger(__name__)

MetadataDict = dict[str, Any]


def match_layer_config(name: str, config: SparseAttentionConfig) -> SkipSoftmaxLayerConfig | None:
    """The config of the last `sparse_cfg` pattern matching `name` (ModelOpt's rule), or None."""
    chosen = None
    for pattern, layer_cfg in config.layer_patterns():
        if fnmatch.fnmatch(name, pattern):
            chosen = layer_cfg
    return chosen


def sparse_attention_states(model: nn.Module, *, enabled_only: bool = False) -> dict[str, SparseAttentionState]:
    """Module name -> state of every converted attention module."""
    out = {}
    for name, module in model.named_modules():
        state = getattr(module, STATE_ATTR, None)
        if isinstance(state, SparseAttentionState) and (state.enabled or not enabled_only):
            out[name] = state
    return out


def is_sparse_attention_model(model: nn.Module) -> bool:
    return bool(sparse_attention_states(model))


def convert_to_sparse_attention_model(model: nn.Module, config: Any) -> tuple[nn.Module, MetadataDict]:
    """Mode convert entrypoint: attach states per `sparse_cfg` and select the skip-softmax attention function."""
    config = as_config(config)
    check_model_supported(model)
    modules = find_attention_modules(model)
    if not modules:
        raise UnsupportedModelError(
            f"{type(model).__name__}: no attention modules found (expected transformers *Attention modules with "
            "a layer_idx, e.g. LlamaAttention)"
        )
    chosen = {}
    for name, module in modules.items():  # check everything before changing anything
        layer_cfg = match_layer_config(name, config)
        enabled = layer_cfg is not None and layer_cfg.enable
        if enabled:
            check_module_supported(module)
        chosen[name] = (enabled, layer_cfg or SkipSoftmaxLayerConfig(enable=False))
    matched = sum(enabled for enabled, _ in chosen.values())
    for name, module in modules.items():
        enabled, layer_cfg = chosen[name]
        setattr(
            module,
            STATE_ATTR,
            SparseAttentionState(
                name=name,
                enabled=enabled,
                threshold=dict(layer_cfg.threshold),
                backend=layer_cfg.backend,
                collect_stats=layer_cfg.collect_stats,
            ),
        )
    if matched == 0:
        patterns = [p for p, _ in config.layer_patterns()]
        logger.warning(
            "sparse_cfg patterns %s enable no attention module of %s (modules look like %r): the model stays dense",
            patterns, type(model).__name__, next(iter(modules)),
        )  # fmt: skip
    previous = set_model_attention(model)
    logger.info("sparse attention: %d of %d attention modules enabled", matched, len(modules))
    return model, {"original_attn_implementation": previous, "modules": export_module_states(model)}


def restore_sparse_attention_model(model: nn.Module, config: Any, metadata: MetadataDict) -> nn.Module:
    """Mode restore entrypoint: convert again, then load the saved per-module states (calibration included)."""
    model, _ = convert_to_sparse_attention_model(model, config)
    load_module_states(model, metadata.get("modules", {}))
    return model


def update_sparse_attention_metadata(model: nn.Module, config: Any, metadata: MetadataDict) -> None:
    """Mode update entrypoint (before save / next mode): record the current states in the metadata."""
    metadata["modules"] = export_module_states(model)


def _calibration_to_dict(cal: PhaseCalibration | None) -> dict | None:
    if cal is None:
        return None
    return {
        "a": float(cal.a),
        "b": float(cal.b),
        "target_sparsity": float(cal.target_sparsity),
        "observed_sparsity_range": None if cal.observed_sparsity_range is None else list(cal.observed_sparsity_range),
        "r2": None if cal.r2 is None else float(cal.r2),
        "n_points": None if cal.n_points is None else int(cal.n_points),
        "length_exponent": float(cal.length_exponent),
        "length_exponent_slope": float(cal.length_exponent_slope),
        "stored_pivot_exponent": None if cal.stored_pivot_exponent is None else float(cal.stored_pivot_exponent),
        "reference_length": None if cal.reference_length is None else float(cal.reference_length),
    }


def _calibration_from_dict(raw: dict | None) -> PhaseCalibration | None:
    if raw is None:
        return None
    rng = raw.get("observed_sparsity_range")
    return PhaseCalibration(
        float(raw["a"]),
        float(raw["b"]),
        float(raw["target_sparsity"]),
        observed_sparsity_range=None if rng is None else (float(rng[0]), float(rng[1])),
        r2=raw.get("r2"),
        n_points=raw.get("n_points"),
        length_exponent=raw.get("length_exponent", 1.0),
        reference_length=raw.get("reference_length"),
        length_exponent_slope=raw.get("length_exponent_slope", 0.0),
        stored_pivot_exponent=raw.get("stored_pivot_exponent"),
    )


def export_module_states(model: nn.Module) -> dict[str, dict]:
    """Plain (torch weights_only-loadable) dict of every module's settings and calibration."""
    return {
        name: {
            "enabled": bool(state.enabled),
            "threshold": dict(state.threshold),
            "backend": state.backend,
            "collect_stats": bool(state.collect_stats),
            "calibration": {p: _calibration_to_dict(state.calibration.get(p)) for p in PHASES},
        }
        for name, state in sparse_attention_states(model).items()
    }


def load_module_states(model: nn.Module, saved: dict[str, dict]) -> None:
    states = sparse_attention_states(model)
    missing = sorted(set(saved) - set(states))
    if missing:
        raise ValueError(
            f"saved sparse attention state names modules {missing[:3]}... that {type(model).__name__} does not have; "
            "restore into the same model architecture"
        )
    modules = dict(model.named_modules())
    for name, raw in saved.items():
        state = states[name]
        state.enabled = bool(raw["enabled"])
        state.threshold = dict(raw["threshold"])
        state.backend = raw.get("backend", state.backend)
        state.collect_stats = bool(raw.get("collect_stats", state.collect_stats))
        state.calibration = {p: _calibration_from_dict(raw.get("calibration", {}).get(p)) for p in PHASES}
        if state.enabled:
            check_module_supported(modules[name])


def set_sparse_attention_by_pattern(model: nn.Module, pattern: str, enabled: bool) -> list[str]:
    """Enable or disable converted attention modules whose name matches the fnmatch `pattern`."""
    states = sparse_attention_states(model)
    if not states:
        raise ValueError(f"{type(model).__name__} has no sparse attention; call mtsa.sparsify(model, config) first")
    names = [name for name in states if fnmatch.fnmatch(name, pattern)]
    if not names:
        raise ValueError(
            f"pattern {pattern!r} matches no sparse attention module (they look like {next(iter(states))!r})"
        )
    modules = dict(model.named_modules())
    for name in names:
        if enabled:
            check_module_supported(modules[name])
        states[name].enabled = enabled
    return names
