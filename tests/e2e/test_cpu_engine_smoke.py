"""The real vLLM CPU engine (default multi-process engine) serves the real SmolLM2 checkpoint correctly (the base of
every e2e test)."""

from __future__ import annotations

import gc

import pytest

pytestmark = pytest.mark.e2e

KV_CACHE_BYTES = 256 * 2**20


def test_greedy_capital_of_france(smollm2_checkpoint, vllm_cpu_env, monkeypatch):
    from vllm import LLM, SamplingParams

    # The probe below is a function sent to the worker process: vLLM pickles it only when allowed to.
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    def attention_impls(worker) -> list[str]:
        """Runs inside the worker process: the attention impl class of each attention layer."""
        from vllm.model_executor.layers.attention.attention import Attention

        model = worker.model_runner.model
        return sorted(
            {f"{type(m.impl).__module__}.{type(m.impl).__qualname__}" for m in model.modules()
             if isinstance(m, Attention)}
        )

    llm = LLM(
        model=str(smollm2_checkpoint),
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    )
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
        text = out[0].outputs[0].text
        assert "Paris" in text, text
        # The impl the sparse plugin will replace on CPU (docs/vllm_releases.md §7): a vLLM upgrade that changes it
        # should fail here first, not deep inside a sparse-serving test.
        (impls,) = llm.collective_rpc(attention_impls)
        assert impls == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"], impls
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
