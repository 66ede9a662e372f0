"""Calibration records of the vLLM plugin: plain, picklable per-layer tile counts, and their exact merge.

A record is a plain dict (so worker RPCs can return it without importing this package):

    {"layers": ["model.layers.0.self_attn.attn"],   # layers whose counts were summed into this record
     "scale_factors": [sf_1, ..., sf_T],            # threshold trials as scale factors: λ_t = sf_t / kv_len
     "kv_lens": np.int64 [N],                       # one entry per sequence-step, in forward order
     "is_decode": np.bool_ [N],                     # phase of that sequence-step (decode iff q_len == 1)
     "counts": np.int64 [N, T, 2]}                  # (visited, skipped) tiles at each trial

Layers (and tensor-parallel ranks) see the same sequences in the same order, so their records are merged by
summing raw counts entry by entry. Records that do not line up (other sequences, phases, lengths or trials) are
an error: averaging sparsities of mismatched records would silently bias the fit.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

RECORD_KEYS = ("layers", "scale_factors", "kv_lens", "is_decode", "counts")


def make_record(layer: str, scale_factors, kv_lens, is_decode, counts) -> dict:
    """Build a record from array-likes (host data), checking the shapes agree."""
    kv_lens = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    is_decode = np.asarray(is_decode, dtype=np.bool_).reshape(-1)
    scale_factors = [float(s) for s in scale_factors]
    counts = np.asarray(counts, dtype=np.int64).reshape(len(kv_lens), len(scale_factors), 2)
    if is_decode.shape != kv_lens.shape:
        raise ValueError(f"is_decode {is_decode.shape} and kv_lens {kv_lens.shape} must match")
    return {
        "layers": [layer],
        "scale_factors": scale_factors,
        "kv_lens": kv_lens,
        "is_decode": is_decode,
        "counts": counts,
    }


def _check(record: dict, index: int) -> None:
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"calibration record {index} lacks {missing}; expected keys {RECORD_KEYS}")


def merge_calibration_records(records: Iterable[dict] | Iterable[Iterable[dict]]) -> dict:
    """Sum the raw counts of aligned records (layers of one rank, and/or the lists of several TP ranks).

    Accepts a flat iterable of records or an iterable of per-rank lists. Raises ValueError naming the first
    misaligned record (different trials, sequence count, kv_lens or phases).
    """
    flat: list[dict] = []
    for item in records:
        if isinstance(item, dict):
            flat.append(item)
        else:
            flat.extend(item)
    if not flat:
        raise ValueError("no calibration records to merge: did the calibration forward run with mode='calibrate'?")
    for i, r in enumerate(flat):
        _check(r, i)
    first = flat[0]
    counts = np.array(first["counts"], dtype=np.int64, copy=True)
    layers = list(first["layers"])
    for i, r in enumerate(flat[1:], start=1):
        where = f"record {i} ({', '.join(r['layers'])}) vs record 0 ({', '.join(first['layers'])})"
        if list(r["scale_factors"]) != list(first["scale_factors"]):
            raise ValueError(f"misaligned calibration records: different scale-factor trials in {where}")
        if np.shape(r["kv_lens"]) != np.shape(first["kv_lens"]):
            raise ValueError(
                f"misaligned calibration records: {len(r['kv_lens'])} vs {len(first['kv_lens'])} sequence-steps "
                f"in {where}"
            )
        if not np.array_equal(r["kv_lens"], first["kv_lens"]):
            raise ValueError(f"misaligned calibration records: different kv_lens in {where}")
        if not np.array_equal(r["is_decode"], first["is_decode"]):
            raise ValueError(f"misaligned calibration records: different phases in {where}")
        counts += np.asarray(r["counts"], dtype=np.int64)
        layers.extend(r["layers"])
    return {
        "layers": layers,
        "scale_factors": list(first["scale_factors"]),
        "kv_lens": np.array(first["kv_lens"], dtype=np.int64),
        "is_decode": np.array(first["is_decode"]),
        "counts": counts,
    }


def sparsity_by_phase(record: dict) -> dict[str, dict[str, np.ndarray]]:
    """Per phase: kv_lens [n] and per-sequence sparsity [n, T] (skipped / visited; NaN where nothing visited)."""
    out = {}
    counts = np.asarray(record["counts"], dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        sparsity = counts[..., 1] / counts[..., 0]
    for phase, mask in (("prefill", ~record["is_decode"]), ("decode", record["is_decode"])):
        out[phase] = {"kv_lens": record["kv_lens"][mask], "sparsity": sparsity[mask]}
    return out
