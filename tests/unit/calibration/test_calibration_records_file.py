"""Calibration records: their wire form (plain Python types), the exact merge of decoded records, and the .npz file
kept beside a written config (round trip, refusal of damaged files). No vLLM needed; vLLM's own transports are in
tests/gpu_vllm/.../test_calibration_records_transport.py."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import fit_phases, points_from_merged_record
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
    FILE_FORMAT,
    WIRE_FORMAT,
    decode_record,
    encode_record,
    load_calibration_records,
    make_record,
    merge_calibration_records,
    records_path_for,
    save_calibration_records,
)

TRIALS = [0.1, 1.0, 10.0, 100.0, 1000.0]


def _random_record(rng, layer, kv_lens, is_decode, trials=TRIALS):
    visited = rng.integers(1, 10_000, size=(len(kv_lens), len(trials)))
    skipped = np.sort(rng.integers(0, visited + 1), axis=1)  # grows with the trial, <= visited per trial
    skipped = np.minimum(skipped, visited)
    return make_record(layer, trials, kv_lens, is_decode, np.stack([visited, skipped], axis=-1))


def _plain(obj) -> bool:
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in obj.items())
    if isinstance(obj, list):
        return all(_plain(v) for v in obj)
    return type(obj) in (int, float, bool, str)


def test_wire_form_is_plain_python_and_round_trips_exactly():
    rng = np.random.default_rng()
    record = _random_record(rng, "layers.0", [700, 701, 702], [False, True, True])
    wire = encode_record(record)
    assert wire["format"] == WIRE_FORMAT and _plain(wire)
    assert json.loads(json.dumps(wire)) == wire  # survives JSON (the HTTP /collective_rpc endpoint) unchanged
    back = decode_record(pickle.loads(pickle.dumps(wire)))
    for key in ("kv_lens", "is_decode", "counts"):
        np.testing.assert_array_equal(back[key], record[key])
        assert back[key].dtype == record[key].dtype
    assert back["scale_factors"] == TRIALS and back["layers"] == ["layers.0"]


def test_empty_record_round_trips_with_its_trial_axis():
    empty = make_record("l", TRIALS, [], [], np.zeros((0, len(TRIALS), 2), dtype=np.int64))
    assert decode_record(json.loads(json.dumps(encode_record(empty))))["counts"].shape == (0, len(TRIALS), 2)


def test_merge_of_wire_records_is_the_exact_int64_sum():
    """Two ranks x three layers, as collective_rpc returns them (a list per rank), some counts above 2**31."""
    rng = np.random.default_rng()
    kv_lens, is_decode = [129, 130, 131, 900], [False, True, True, False]
    ranks = [[_random_record(rng, f"layers.{i}", kv_lens, is_decode) for i in range(3)] for _ in range(2)]
    ranks[0][0]["counts"][0, 0] = (2**40, 2**39)
    merged = merge_calibration_records([[encode_record(r) for r in rank] for rank in ranks])
    expected = sum(r["counts"] for rank in ranks for r in rank)
    np.testing.assert_array_equal(merged["counts"], expected)
    assert merged["counts"].dtype == np.int64 and merged["counts"][0, 0, 0] >= 2**40
    assert merged["layers"] == [f"layers.{i}" for i in range(3)] * 2
    # in-memory and wire records mix (a driver that merges its own records with its workers')
    mixed = merge_calibration_records([ranks[0], [encode_record(r) for r in ranks[1]]])
    np.testing.assert_array_equal(mixed["counts"], expected)


def test_numpy_arrays_mangled_by_a_transport_are_a_clear_error():
    """What vLLM's msgpack made of numpy arrays before records were encoded: [dtype, shape, buffer] lists."""
    record = _random_record(np.random.default_rng(), "l", [100, 101], [False, True])
    mangled = dict(record, counts=["int64", [2, len(TRIALS), 2], record["counts"].tobytes()])
    with pytest.raises(ValueError, match="record 1.*encoded"):
        merge_calibration_records([record, mangled])
    with pytest.raises(ValueError, match="format"):
        decode_record(dict(encode_record(record), format="something/9"))


def test_records_file_round_trip_and_refit_gives_the_same_fit(tmp_path):
    rng = np.random.default_rng()
    kv_lens = [256, 512, 1024, 2048] * 4
    is_decode = [False] * 8 + [True] * 8
    # counts that follow a law: sparsity grows with log(trial), so the fit succeeds
    counts = []
    for n in kv_lens:
        visited = np.full(len(TRIALS), 4 * n)
        frac = np.clip(0.08 * np.log(np.array(TRIALS) * n / 10) + rng.normal(0, 0.01, len(TRIALS)), 0.02, 0.95)
        counts.append(np.stack([visited, (frac * visited).astype(np.int64)], axis=-1))
    record = make_record("all", TRIALS, kv_lens, is_decode, np.array(counts))
    path = save_calibration_records(records_path_for(tmp_path / "cfg.json"), record, {"argv": ["x"]})
    assert path.name == "cfg.records.npz" and path.stat().st_size < 20_000
    assert [p.name for p in tmp_path.iterdir()] == ["cfg.records.npz"]  # no temp file left
    with np.load(path, allow_pickle=False) as raw:
        assert str(raw["format"]) == FILE_FORMAT
        assert raw["phase"].tolist() == ["prefill"] * 8 + ["decode"] * 8
        np.testing.assert_array_equal(raw["kv_lens"], kv_lens)
        np.testing.assert_array_equal(raw["scale_factors"], TRIALS)
    loaded, meta = load_calibration_records(path)
    assert meta == {"argv": ["x"]}
    np.testing.assert_array_equal(loaded["counts"], record["counts"])
    before = fit_phases(points_from_merged_record(record))
    after = fit_phases(points_from_merged_record(loaded))
    assert set(before) == {"prefill", "decode"} and before == after


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: p.write_bytes(b"not an npz"), "not a calibration records file"),
        (lambda p: np.savez(p, format=np.array(FILE_FORMAT)), "lacks"),
        (lambda p: np.savez(p, format=np.array("other/1"), scale_factors=[1.0], kv_lens=[1], phase=["prefill"],
                            counts=np.ones((1, 1, 2), dtype=np.int64)), "records format"),
        (lambda p: np.savez(p, format=np.array(FILE_FORMAT), scale_factors=[1.0], kv_lens=[1], phase=["verify"],
                            counts=np.ones((1, 1, 2), dtype=np.int64)), "unknown phase"),
        (lambda p: np.savez(p, format=np.array(FILE_FORMAT), scale_factors=[1.0], kv_lens=[1], phase=["decode"],
                            counts=np.array([[[1, 2]]])), "skipped <= visited"),
    ],
)
def test_damaged_records_files_are_refused_by_name(tmp_path, damage, words):
    path = tmp_path / "r.npz"
    damage(path)
    with pytest.raises(ValueError, match=words):
        load_calibration_records(path)


def test_an_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    record = _random_record(np.random.default_rng(), "l", [100], [True])

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        save_calibration_records(tmp_path / "r.npz", record)
    assert list(tmp_path.iterdir()) == []
