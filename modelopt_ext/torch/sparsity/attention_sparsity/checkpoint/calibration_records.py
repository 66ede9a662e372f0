"""Calibration records of the vLLM plugin: per-layer tile counts, their wire form, their exact merge, their file.

In memory (what `collect_calibration_records` builds inside a worker) a record is a dict of numpy arrays:

    {"layers": ["model.layers.0.self_attn.attn"],   # layers whose counts were summed into this record
     "scale_factors": [sf_1, ..., sf_T],            # threshold trials as scale factors: λ_t = sf_t / n
     "kv_lens": np.int64 [N],                       # the law's length n per sequence-step, in forward order
     "is_decode": np.bool_ [N],                     # phase of that sequence-step
     "counts": np.int64 [N, T, 2]}                  # (visited, skipped) at each trial

On the wire (what the worker RPC `sparse_attn_collect_counts` returns) the same record is `encode_record(record)`:
plain Python lists, ints, floats, bools and strings only, tagged with `WIRE_FORMAT`. That crosses every process
boundary vLLM puts between a worker and `LLM.collective_rpc` unchanged: the in-process executor, the multiprocess
executor's pickled message queue, the EngineCore process's msgpack utility replies (which turn numpy arrays into
`[dtype, shape, buffer]` lists that nothing decodes), Ray, and the JSON of the HTTP `/collective_rpc` endpoint.
`merge_calibration_records` takes either form and decodes explicitly, checking every shape.

Layers (and tensor-parallel ranks) see the same sequences in the same order, so their records are merged by
summing raw counts entry by entry (int64, exact). Records that do not line up (other sequences, phases, lengths or
trials) are an error: averaging sparsities of mismatched records would silently bias the fit.

The merged record is kept on disk beside the written config (`save_calibration_records`, a small compressed .npz,
format `FILE_FORMAT`): per sequence-step its law length n, its phase and the counts of every trial, plus the trial
scale factors, so a later fit (another law, another phase policy) needs no engine (`load_calibration_records`).
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .atomic_io import write_bytes_atomic

RECORD_KEYS = ("layers", "scale_factors", "kv_lens", "is_decode", "counts")
WIRE_FORMAT = "modelopt_ext.vllm_calibration_record/1"
FILE_FORMAT = "modelopt_ext.calibration_records/1"
PHASE_NAMES = ("prefill", "decode")  # index = is_decode


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


# ------------------------------------------------------------------------------------------------------ the wire


def encode_record(record: Mapping) -> dict:
    """The record as plain Python types (lists of int / bool / float / str), safe for any RPC transport."""
    _check(record, 0)
    kv_lens = np.asarray(record["kv_lens"], dtype=np.int64).reshape(-1)
    trials = [float(s) for s in record["scale_factors"]]
    counts = np.asarray(record["counts"], dtype=np.int64).reshape(len(kv_lens), len(trials), 2)
    return {
        "format": WIRE_FORMAT,
        "layers": [str(name) for name in record["layers"]],
        "scale_factors": trials,
        "kv_lens": kv_lens.tolist(),
        "is_decode": np.asarray(record["is_decode"], dtype=np.bool_).reshape(-1).tolist(),
        "counts": counts.tolist(),
    }


def decode_record(obj: Mapping, index: int = 0) -> dict:
    """A record from its wire form (or an in-memory record, checked and copied); ValueError names the problem."""
    if not isinstance(obj, Mapping):
        raise ValueError(
            f"calibration record {index} is a {type(obj).__name__}, not a mapping: the worker RPC "
            "sparse_attn_collect_counts returns a list of records per rank"
        )
    fmt = obj.get("format")
    if fmt is not None and fmt != WIRE_FORMAT:
        raise ValueError(f"calibration record {index} has format {fmt!r}; this version reads {WIRE_FORMAT!r}")
    _check(obj, index)
    try:
        trials = [float(s) for s in obj["scale_factors"]]
        kv_lens = np.asarray(obj["kv_lens"], dtype=np.int64).reshape(-1)
        is_decode = np.asarray(obj["is_decode"], dtype=np.bool_).reshape(-1)
        counts = np.asarray(obj["counts"], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"calibration record {index}: not plain numbers ({exc}); records must cross process boundaries "
            "encoded (encode_record), not as numpy arrays"
        ) from None
    if counts.size == 0:
        counts = counts.reshape(0, len(trials), 2)
    if counts.shape != (len(kv_lens), len(trials), 2) or is_decode.shape != kv_lens.shape:
        raise ValueError(
            f"calibration record {index}: counts {counts.shape}, kv_lens {kv_lens.shape}, is_decode "
            f"{is_decode.shape} do not match [N, T={len(trials)}, 2], [N], [N]"
        )
    return {
        "layers": [str(name) for name in obj["layers"]],
        "scale_factors": trials,
        "kv_lens": kv_lens,
        "is_decode": is_decode,
        "counts": counts,
    }


def _check(record: Mapping, index: int) -> None:
    missing = [k for k in RECORD_KEYS if k not in record]
    if missing:
        raise ValueError(f"calibration record {index} lacks {missing}; expected keys {RECORD_KEYS}")


# ----------------------------------------------------------------------------------------------------- the merge


def merge_calibration_records(records: Iterable[Mapping] | Iterable[Iterable[Mapping]]) -> dict:
    """Sum the raw counts of aligned records (layers of one rank, and/or the lists of several TP ranks).

    Accepts a flat iterable of records or an iterable of per-rank lists, each record in memory or in its wire form
    (`encode_record`). Raises ValueError naming the first misaligned record (different trials, sequence count,
    kv_lens or phases).
    """
    flat: list[dict] = []
    for item in records:
        if isinstance(item, Mapping):
            flat.append(decode_record(item, len(flat)))
        else:
            flat.extend(decode_record(r, len(flat) + i) for i, r in enumerate(item))
    if not flat:
        raise ValueError("no calibration records to merge: did the calibration forward run with mode='calibrate'?")
    first = flat[0]
    counts = first["counts"].copy()
    layers = list(first["layers"])
    for i, r in enumerate(flat[1:], start=1):
        where = f"record {i} ({', '.join(r['layers'])}) vs record 0 ({', '.join(first['layers'])})"
        if r["scale_factors"] != first["scale_factors"]:
            raise ValueError(f"misaligned calibration records: different scale-factor trials in {where}")
        if r["kv_lens"].shape != first["kv_lens"].shape:
            raise ValueError(
                f"misaligned calibration records: {len(r['kv_lens'])} vs {len(first['kv_lens'])} sequence-steps "
                f"in {where}"
            )
        if not np.array_equal(r["kv_lens"], first["kv_lens"]):
            raise ValueError(f"misaligned calibration records: different kv_lens in {where}")
        if not np.array_equal(r["is_decode"], first["is_decode"]):
            raise ValueError(f"misaligned calibration records: different phases in {where}")
        counts += r["counts"]
        layers.extend(r["layers"])
    return {
        "layers": layers,
        "scale_factors": list(first["scale_factors"]),
        "kv_lens": first["kv_lens"].copy(),
        "is_decode": first["is_decode"].copy(),
        "counts": counts,
    }


def sparsity_by_phase(record: Mapping) -> dict[str, dict[str, np.ndarray]]:
    """Per phase: kv_lens [n] and per-sequence sparsity [n, T] (skipped / visited; NaN where nothing visited)."""
    out = {}
    counts = np.asarray(record["counts"], dtype=np.float64)
    is_decode = np.asarray(record["is_decode"], dtype=np.bool_)
    kv_lens = np.asarray(record["kv_lens"], dtype=np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        sparsity = counts[..., 1] / counts[..., 0]
    for phase, mask in (("prefill", ~is_decode), ("decode", is_decode)):
        out[phase] = {"kv_lens": kv_lens[mask], "sparsity": sparsity[mask]}
    return out


# ------------------------------------------------------------------------------------------------------ the file


def records_path_for(config_path: str | os.PathLike) -> Path:
    """Where the raw records of a written config go: `<name>.records.npz` beside it."""
    path = Path(config_path)
    return path.with_name(path.stem + ".records.npz")


def save_calibration_records(path: str | os.PathLike, record: Mapping, meta: Mapping[str, Any] | None = None) -> Path:
    """Write a merged record atomically as a compressed .npz (no pickles): `kv_lens` int64 [N] (the law's length
    n), `phase` str [N] ("prefill" / "decode"), `counts` int64 [N, T, 2] (visited, skipped), `scale_factors`
    float64 [T], `layers` str [L] (what was summed), `format`, and `meta` (a JSON string: whatever the caller
    wants to keep, e.g. the command line)."""
    rec = decode_record(record)
    path = Path(path)
    arrays = {
        "format": np.array(FILE_FORMAT),
        "scale_factors": np.asarray(rec["scale_factors"], dtype=np.float64),
        "kv_lens": rec["kv_lens"],
        "phase": np.array([PHASE_NAMES[int(d)] for d in rec["is_decode"]], dtype="<U7"),
        "counts": rec["counts"],
        "layers": np.array(rec["layers"], dtype=str),
        "meta": np.array(json.dumps(dict(meta or {}), sort_keys=True, default=str)),
    }
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    return write_bytes_atomic(path, buffer.getvalue())


def load_calibration_records(path: str | os.PathLike) -> tuple[dict, dict]:
    """(merged record, meta) from a file written by `save_calibration_records`; ValueError / OSError name what is
    wrong with the file."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:
        if isinstance(exc, FileNotFoundError | IsADirectoryError | PermissionError):
            raise
        raise ValueError(f"{path}: not a calibration records file (.npz): {exc}") from None
    needed = ("format", "scale_factors", "kv_lens", "phase", "counts")
    missing = [k for k in needed if k not in arrays]
    if missing:
        raise ValueError(f"{path}: not a calibration records file (lacks {', '.join(missing)})")
    fmt = str(arrays["format"])
    if fmt != FILE_FORMAT:
        raise ValueError(f"{path}: records format {fmt!r}; this version reads {FILE_FORMAT!r}")
    phases = [str(p) for p in arrays["phase"].reshape(-1)]
    unknown = sorted(set(phases) - set(PHASE_NAMES))
    if unknown:
        raise ValueError(f"{path}: unknown phase(s) {unknown}; expected {list(PHASE_NAMES)}")
    record = decode_record(
        {
            "layers": [str(x) for x in arrays.get("layers", np.array([], dtype=str)).reshape(-1)],
            "scale_factors": arrays["scale_factors"].reshape(-1).tolist(),
            "kv_lens": arrays["kv_lens"],
            "is_decode": [p == "decode" for p in phases],
            "counts": arrays["counts"],
        }
    )
    counts = record["counts"]
    if np.any(counts < 0) or np.any(counts[..., 1] > counts[..., 0]):
        raise ValueError(f"{path}: counts must satisfy 0 <= skipped <= visited")
    try:
        meta = json.loads(str(arrays["meta"])) if "meta" in arrays else {}
    except json.JSONDecodeError:
        meta = {}
    return record, meta
