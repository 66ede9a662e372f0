"""Measurements of the sparse impls: realized serving sparsity per layer and phase, calibration records.

Counts are (visited, skipped) per (row, query head, key tile) (docs/skip_softmax.md). A sequence's counts go to its
phase: decode iff its first new row is at or past its prompt length (a chunk that resumes a preempted request and
recomputes prompt and generated tokens counts as prefill). Steps in which no row can drop a tile run the native
forward and are not counted.
"""

from __future__ import annotations

import torch

from ...checkpoint.calibration_records import make_record
from .impls import layer_state
from .layers import attention_layers


def _sparse_layers(model_or_layers):
    for name, layer in attention_layers(model_or_layers):
        state = layer_state(layer)
        if state is not None:
            yield name, state


def collect_calibration_records(model_or_layers, *, reset: bool = True) -> list[dict]:
    """One plain record per calibrating layer (see vllm_calibration_records), in layer order. Syncs once.

    A record's `kv_lens` are the law's lengths n per sequence-step (the prompt length for a prefill sequence, the
    key count for a decode one) and `is_decode` its phase. `reset` drops the collected steps so the next
    collection starts fresh (call it once before the calibration prompts too, to drop warm-up steps).
    """
    records = []
    for name, state in _sparse_layers(model_or_layers):
        if not state.context.calibrating:
            continue
        steps = state.records
        trials = state.context.trials
        if steps:
            counts = torch.cat([c for c, _, _ in steps]).cpu().numpy()
            law_lens = torch.cat([n for _, n, _ in steps]).cpu().numpy()
            is_decode = torch.cat([d for _, _, d in steps]).cpu().numpy()
        else:
            counts, law_lens, is_decode = torch.zeros(0, len(trials), 2, dtype=torch.int64).numpy(), [], []
        records.append(make_record(name, trials, law_lens, is_decode, counts))
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
    """Zero the serving counters of every sparse layer and of every request (in place: the tensors keep their
    addresses), and forget finished requests."""
    with torch.inference_mode():  # vLLM's forward created them under inference mode
        for _, state in _sparse_layers(model_or_layers):
            if state.phase_counts is not None:
                state.phase_counts.zero_()
        for counters in _request_counters(model_or_layers):
            counters.reset()


def _request_counters(model_or_layers) -> list:
    seen = {}
    for _, state in _sparse_layers(model_or_layers):
        counters = state.context.request_counters
        if counters is not None:
            seen[id(counters)] = counters
    return list(seen.values())


def get_request_stats(model_or_layers, request_ids=None) -> dict[str, dict]:
    """Realized sparsity per request and phase, summed over this worker's sparse layers (plugins/vllm/
    request_stats.py): {engine request id: {"user_request_id", "finished", "prefill"/"decode": {"visited",
    "skipped", "sparsity"}}}. `request_ids` keeps those whose engine id or user id is listed. Syncs once."""
    wanted = None if request_ids is None else {str(r) for r in request_ids}
    out = {}
    for counters in _request_counters(model_or_layers):
        for rid, entry in counters.snapshot().items():
            if wanted is None or rid in wanted or entry["user_request_id"] in wanted:
                out[rid] = entry
    return out


def is_sparse_layer(layer) -> bool:
    """Whether the layer runs the skip-softmax kernel (a sparse impl whose engine calibrates or serves a phase)."""
    state = layer_state(layer)
    return state is not None and state.runs_sparse
