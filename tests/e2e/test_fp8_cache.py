"""An FP8 KV cache served sparse on vLLM's CPU engine (issue #66), as a user serves it.

The serve script (vLLM's OpenAI server, the plugin's sparse impls) with `--kv-cache-dtype fp8` (e4m3; e5m2 differs only
in the kernels' conversion, tested against vLLM's own FP8 attention in test_vllm_cpu_native.py) on a fixed-fit SmolLM2
checkpoint: every layer is served sparse (none kept dense for its cache), tiles are dropped in
both phases (from /metrics), the answer to a short probe is right, and a long prompt's perplexity at the checkpoint's
target and dense on the same FP8 cache (a per-request target) differ by less than PPL_GAP. vLLM's CPU engine takes an
FP8 cache only on x86 CPUs with AVX-512 or AMX; elsewhere this test is skipped, saying so.
"""

from __future__ import annotations

import math

import pytest
import torch
from e2e_lib import LONG_PROMPT, fixed_fit_checkpoint, http_json, serving, sparse_metrics

pytestmark = pytest.mark.e2e

NUM_LAYERS = 30  # SmolLM2-135M
HAS_AVX512 = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
PPL_GAP = 0.05  # |sparse / dense - 1| of the prompt's perplexity (sparse serving moves it < 1 % on bf16 caches)


@pytest.fixture(scope="module")
def sparse_ckpt(smollm2_checkpoint, tmp_path_factory):
    return fixed_fit_checkpoint(smollm2_checkpoint, tmp_path_factory.mktemp("fp8") / "ckpt")


def _perplexity(base: str, target=None) -> float:
    """The long prompt's perplexity (its tokens' log-probabilities, echoed) plus 8 decode steps."""
    body = {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "echo": True}  # fmt: skip
    if target is not None:
        body["vllm_xargs"] = {"sparse_attn_target": target}
    lps = http_json(base + "/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
    prompt = [lp for lp in lps[:-8] if lp is not None]
    return math.exp(-sum(prompt) / len(prompt))


@pytest.mark.skipif(not HAS_AVX512, reason="vLLM's CPU engine takes an FP8 KV cache only with AVX-512 or AMX")
def test_fp8_cache_is_served_sparse(sparse_ckpt, tmp_path, kv_cache_dtype="fp8"):
    log_path = tmp_path / "serve.log"
    skipped = {p: f'modelopt_sparse_attn_tiles_skipped_total{{phase="{p}"}}' for p in ("prefill", "decode")}
    with serving(sparse_ckpt, log_path, "--kv-cache-dtype", kv_cache_dtype) as base:
        reply = http_json(base + "/v1/completions", {"model": "smol", "prompt": "The capital of France is",
                                                     "max_tokens": 12, "temperature": 0})  # fmt: skip
        assert "Paris" in reply["choices"][0]["text"], reply
        sparse = _perplexity(base)
        metrics = sparse_metrics(base)
        assert metrics.get('modelopt_sparse_attn_layers{reason="",served="sparse"}') == NUM_LAYERS, metrics
        assert metrics[skipped["prefill"]] > 0 and metrics[skipped["decode"]] > 0, metrics
        dense = _perplexity(base, "dense")
        after = sparse_metrics(base)
        assert [after[skipped[p]] for p in skipped] == [metrics[skipped[p]] for p in skipped], (metrics, after)
    assert abs(sparse / dense - 1) < PPL_GAP, (sparse, dense)
    log = log_path.read_text()
    assert f"sparse attention serving on {NUM_LAYERS} layer(s)" in log, log[-4000:]
    assert "is not supported" not in log, log[-4000:]
