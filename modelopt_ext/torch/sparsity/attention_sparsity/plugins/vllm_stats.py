"""Measurements of the sparse impls: realized serving sparsity per layer and phase, calibration records."""

from __future__ import annotations

import torch

from .vllm_calibration_records import make_record
from .vllm_impls import _SPARSE_CLASSES, _STATE_ATTR
from .vllm_install import _layers


def _sparse_layers(model_or_layers):
    for name, layer in _layers(model_or_layers):
        if isinstance(layer.impl, _SPARSE_CLASSES):
            yield name, getattr(layer.impl, _STATE_ATTR)


def collect_calibration_records(model_or_layers, *, reset: bool = True) -> list[dict]:
    """One plain record per calibrating layer (see vllm_calibration_records), in layer order. Syncs once.

    `reset` drops the collected steps so the next collection starts fresh (call it once before the
    calibration prompts too, to drop warm-up steps).
    """
    records = []
    for name, state in _sparse_layers(model_or_layers):
        if state.mode != "calibrate":
            continue
        steps = state.records
        trials = len(state.scale_factor_trials)
        if steps:
            counts = torch.cat([c for c, _, _ in steps]).cpu().numpy()
            kv_lens = torch.cat([k for _, k, _ in steps]).cpu().numpy()
            is_decode = torch.cat([d for _, _, d in steps]).cpu().numpy()
        else:
            counts, kv_lens, is_decode = torch.zeros(0, trials, 2, dtype=torch.int64).numpy(), [], []
        records.append(make_record(name, state.scale_factor_trials, kv_lens, is_decode, counts))
        if reset:
            state.records = []
    return records


def get_sparsity_stats(model_or_layers) -> dict[str, dict[str, dict[str, int]]]:
    """Realized serving sparsity per layer and phase: {layer: {phase: {"visited", "skipped"}}}. Syncs once."""
    stats = {}
    for name, state in _sparse_layers(model_or_layers):
        counts = state.phase_counts.tolist() if state.phase_counts is not None else [[0, 0], [0, 0]]
        phases = zip(("prefill", "decode"), counts, strict=True)
        stats[name] = {phase: {"visited": int(c[0]), "skipped": int(c[1])} for phase, c in phases}
    return stats


def reset_sparsity_stats(model_or_layers) -> None:
    """Zero the serving counters of every sparse layer."""
    for _, state in _sparse_layers(model_or_layers):
        state.phase_counts = None
