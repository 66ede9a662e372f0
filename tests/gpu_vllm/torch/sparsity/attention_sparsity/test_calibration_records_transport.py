"""Calibration records through vLLM's real RPC serialization (the official wheel's classes, no engine).

`LLM.collective_rpc` replies travel worker -> executor (pickle: the multiprocess executor's shared-memory queue,
Ray) and EngineCore -> client (vLLM's MsgpackEncoder inside `EngineCoreOutputs.utility_output`). numpy arrays come
out of the second one as `[dtype, shape, buffer]` lists, which is why the worker RPC returns `encode_record` output;
the end-to-end proof with real processes (default multiprocessing and tensor_parallel_size=2 on the CPU engine) is
in tests/e2e.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
    encode_record,
    make_record,
    merge_calibration_records,
)

serial_utils = pytest.importorskip("vllm.v1.serial_utils")
engine = pytest.importorskip("vllm.v1.engine")

TRIALS = [0.5, 5.0, 50.0, 500.0]


def _through_engine_core(result):
    """What the client gets back for a utility call whose result is `result` (vLLM's own encode and decode)."""
    outputs = engine.EngineCoreOutputs(
        utility_output=engine.UtilityOutput(call_id=7, result=serial_utils.UtilityResult(result))
    )
    frames = serial_utils.MsgpackEncoder().encode(outputs)
    decoded = serial_utils.MsgpackDecoder(engine.EngineCoreOutputs).decode(frames)
    return decoded.utility_output.result.result


def _rank(rng, kv_lens, is_decode, layers=3):
    records = []
    for i in range(layers):
        visited = rng.integers(1, 50_000, size=(len(kv_lens), len(TRIALS)))
        skipped = np.minimum(np.sort(rng.integers(0, visited + 1), axis=1), visited)
        records.append(make_record(f"model.layers.{i}.self_attn.attn", TRIALS, kv_lens, is_decode,
                                   np.stack([visited, skipped], axis=-1)))
    return records


def test_encoded_records_of_two_ranks_merge_exactly_after_vllms_transports():
    rng = np.random.default_rng()
    kv_lens, is_decode = [333, 334, 335, 1500], [False, True, True, False]
    ranks = [_rank(rng, kv_lens, is_decode) for _ in range(2)]
    # worker -> executor (pickle), then executor -> EngineCore -> client (msgpack): the list of per-rank lists
    reply = [pickle.loads(pickle.dumps([encode_record(r) for r in rank], protocol=pickle.HIGHEST_PROTOCOL))
             for rank in ranks]
    received = _through_engine_core(reply)
    merged = merge_calibration_records(received)
    np.testing.assert_array_equal(merged["counts"], sum(r["counts"] for rank in ranks for r in rank))
    np.testing.assert_array_equal(merged["kv_lens"], kv_lens)
    np.testing.assert_array_equal(merged["is_decode"], is_decode)
    assert merged["scale_factors"] == TRIALS and len(merged["layers"]) == 6


def test_numpy_records_do_not_survive_the_engine_core_reply():
    """The bug behind this design: the same records, not encoded, arrive as lists that cannot be merged."""
    rng = np.random.default_rng()
    ranks = [_rank(rng, [200, 201], [False, True], layers=1) for _ in range(2)]
    received = _through_engine_core(ranks)
    assert not isinstance(received[0][0]["counts"], np.ndarray)
    with pytest.raises(ValueError, match="encoded"):
        merge_calibration_records(received)
