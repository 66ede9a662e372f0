"""The CPU-attention cache layout against vLLM's own C++ CPU kernels (runs only where they exist: vllm-cpu).

Run with the vllm-cpu environment, e.g. `.venv-cpu/bin/python -m pytest tests/gpu_vllm/.../test_vllm_cpu_native.py`.
Checks (1) that the sparse plugin's CPU views read exactly what `cpu_attn_reshape_and_cache` writes (vec/vec16: K
transposed, V row-major; amx: both as AMX B tiles, through 6-D views) for the ISAs the plugin accepts, and (2)
that the sparse CPU impl in calibration mode (dense output), writing through vLLM's native writer, matches vLLM's
native `cpu_attention_with_kv_cache` on the same layer.
Tolerances: float32 atol 1e-5, bfloat16 atol 2e-2 (both kernels accumulate in float32; bf16 rounds P and V).
"""

from __future__ import annotations

import logging
import math
import types

import pytest
import torch

pytestmark = pytest.mark.vllm_cpu

pytest.importorskip("vllm")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

from vllm import _custom_ops as ops  # noqa: E402  (loads vLLM's kernels where the build has them)

if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
    pytest.skip(
        "vLLM's C++ CPU attention ops are absent (official CUDA wheel); run under vllm-cpu", allow_module_level=True
    )

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.kv_cache import (  # noqa: E402
    as_cache_dtype,
    fp8_view_dtype,
)

AMX_REASON = "needs AMX tiles (Intel Sapphire Rapids or later): vLLM's native 'amx' attention is the baseline"
HAS_AMX = torch.cpu._is_amx_tile_supported()
CASES = [
    ("vec", 128, 64, torch.float32),
    ("vec", 32, 64, torch.bfloat16),
    ("vec16", 16, 80, torch.float32),
    pytest.param("amx", 32, 64, torch.bfloat16, marks=pytest.mark.skipif(not HAS_AMX, reason=AMX_REASON)),
    pytest.param("amx", 64, 128, torch.bfloat16, marks=pytest.mark.skipif(not HAS_AMX, reason=AMX_REASON)),
]


def _at_slots(view, slots, page):
    """The [n, H, D] rows of a K or V view at `slots` ([blocks, page, H, D] views, or the amx layout's 6-D ones)."""
    blocks, offsets = slots // page, slots % page
    if view.dim() == 6:
        p2 = view.shape[2]
        return view[blocks, offsets // p2, offsets % p2].flatten(-2)
    return view[blocks, offsets]


def _batch(page, dim, dtype, heads=4, kv_heads=2, nb=16, long=False):
    """Three sequences (a prompt chunk, two decode rows) on 4 pages each; `long`: past position 255 on 8 pages each
    (contract v4 drops only tiles before a row's 128 most recent keys; the chunk starts at 384, a multiple of 64),
    with a first key tile every query finds strong (k[:64, :, 0] += 10, q[..., 0] = |q[..., 0]| + 1) so whole
    prompt blocks and GQA groups drop tiles."""
    gen = torch.Generator().manual_seed(page * 1000 + dim)
    q_lens, kv_lens = ([64, 1, 1], [448, 500, 300]) if long else ([5, 1, 1], [5 + 2 * page, 2 * page + 3, 40])
    pages = max(-(-kl // page) for kl in kv_lens) if long else 4
    nb = max(nb, 3 * pages)
    bt = torch.randperm(nb, generator=gen)[: 3 * pages].view(3, pages).to(torch.int32)
    slots, ks, vs = [], [], []
    for b, kl in enumerate(kv_lens):
        pos = torch.arange(kl)
        slots.append(bt[b, pos // page].long() * page + pos % page)
        k = torch.randn(kl, kv_heads, dim, generator=gen)
        if long:
            k[:64, :, 0] += 10.0
        ks.append(k.to(dtype))
        vs.append(torch.randn(kl, kv_heads, dim, generator=gen).to(dtype))
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    if long:
        q[..., 0] = q[..., 0].abs() + 1.0
    q = q.to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return types.SimpleNamespace(
        q_lens=q_lens,
        kv_lens=kv_lens,
        block_table=bt,
        slots=torch.cat(slots),
        k=torch.cat(ks),
        v=torch.cat(vs),
        q=q,
        qsl=qsl,
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        nb=nb,
    )


@pytest.mark.parametrize("isa,page,dim,dtype", CASES)
def test_native_writer_matches_views_and_native_attention(isa, page, dim, dtype):
    b = _batch(page, dim, dtype)
    kv_cache = torch.zeros(b.nb, 2, page, 2 * dim, dtype=dtype)
    key_cache, value_cache = kv_cache.view(b.nb, 2, 2 * page, dim).chunk(2, dim=2)  # as cpu_attn.py does
    ops.cpu_attn_reshape_and_cache(b.k, b.v, key_cache, value_cache, b.slots, isa)
    k, v = plug.cpu_attn_kv_cache_views(kv_cache, dim, isa)
    assert k.data_ptr() == kv_cache.data_ptr(), "zero-copy views"
    assert torch.equal(_at_slots(k, b.slots, page), b.k)
    assert torch.equal(_at_slots(v, b.slots, page), b.v)
    if isa == "amx":
        torch.cpu._init_amx()  # tile permission for vLLM's amx kernel in this process

    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=dim,
        seq_lens=b.seq_lens,
        dtype=dtype,
        query_start_loc=b.qsl,
        causal=True,
        sliding_window_size=-1,
        isa=isa,
        enable_kv_split=False,
    )
    native = torch.full_like(b.q, math.nan)
    ops.cpu_attention_with_kv_cache(
        query=b.q,
        key_cache=key_cache,
        value_cache=value_cache,
        output=native,
        query_start_loc=b.qsl,
        seq_lens=b.seq_lens,
        scale=dim**-0.5,
        causal=True,
        alibi_slopes=None,
        sliding_window=-1,
        block_table=b.block_table,
        softcap=0.0,
        scheduler_metadata=md,
        s_aux=None,
    )
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    for backend in ("torch", "cpu"):
        ours = paged_skip_softmax_attention(
            b.q, k, v, b.block_table, b.qsl, b.seq_lens, softmax_scale=dim**-0.5, backend=backend
        )
        torch.testing.assert_close(ours.float(), native.float(), atol=atol, rtol=0)


FP8_REASON = "vLLM's CPU FP8 KV cache needs AVX-512 or AMX (its _get_attn_isa refuses it elsewhere)"
HAS_AVX512 = torch.cpu._is_avx512_supported() or HAS_AMX


@pytest.mark.skipif(not HAS_AVX512, reason=FP8_REASON)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_native_writer_matches_views_and_native_attention(kv_cache_dtype, dtype):
    """vLLM's CPU FP8 cache (uint8 storage, ISA vec, per-layer scales): the views read the bytes vLLM's writer stored
    (`k / k_scale` as e4m3 / e5m2 in the vec layout), and the kernels on them, dequantized with the scales, match
    vLLM's own FP8 CPU attention. Tolerance: fp32 2e-5, bf16 2e-2 (same bytes; float32 accumulation either way)."""
    b = _batch(32, 64, dtype)
    k_scale, v_scale = 0.37, 1.9
    kv_cache = torch.zeros(b.nb, 2, 32, 2 * 64, dtype=torch.uint8)
    key_cache, value_cache = kv_cache.view(b.nb, 2, 64, 64).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(b.k, b.v, key_cache, value_cache, b.slots, "vec", k_scale=k_scale,
                                   v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    k, v = as_cache_dtype(plug.cpu_attn_kv_cache_views(kv_cache, 64, "vec"), kv_cache_dtype)
    assert k.dtype == fp8_view_dtype(kv_cache_dtype) and k.data_ptr() == kv_cache.data_ptr()
    # vLLM's CPU writer rounds toward zero: every stored key is within one FP8 step below |k / k_scale|
    stored = _at_slots(k, b.slots, 32).float() * k_scale
    assert (stored.abs() <= b.k.float().abs() * (1 + 1e-6)).all()
    assert (stored - b.k.float()).abs().max() <= 0.3 * b.k.float().abs().max()
    md = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=3, num_heads=4, num_kv_heads=2, head_dim=64, seq_lens=b.seq_lens, dtype=dtype,
        query_start_loc=b.qsl, causal=True, sliding_window_size=-1, isa="vec", enable_kv_split=False,
    )  # fmt: skip
    native = torch.full_like(b.q, math.nan)
    ops.cpu_attention_with_kv_cache(
        query=b.q, key_cache=key_cache, value_cache=value_cache, output=native, query_start_loc=b.qsl,
        seq_lens=b.seq_lens, scale=64**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
        block_table=b.block_table, softcap=0.0, scheduler_metadata=md, s_aux=None, k_scale=k_scale,
        v_scale=v_scale, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    atol = 2e-5 if dtype == torch.float32 else 2e-2
    for backend in ("torch", "auto"):
        ours = paged_skip_softmax_attention(b.q, k, v, b.block_table, b.qsl, b.seq_lens, softmax_scale=64**-0.5,
                                            backend=backend, k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        torch.testing.assert_close(ours.float(), native.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("sinks,kernel", [(False, "auto"), (True, "auto"), (True, "torch")],
                         ids=["plain", "sinks", "sinks-reference"])  # fmt: skip
def test_sparse_cpu_impl_writes_natively_and_matches_native_forward(sinks, kernel):
    """The sparse impl (calibrate mode: dense output) on a real CPU Attention layer vs the native impl; the sparse
    run's metadata comes from the sparse CPU builder (vLLM's real CPU build, with its C++ scheduler metadata).
    With attention sinks (gpt-oss), vLLM's C++ kernel takes them as `s_aux` and ours as `sinks`: the same output."""
    from vllm_plugin_testlib import build_metadata, engine_config, make_builder, new_layer

    page, dim, dtype = 32, 64, torch.float32
    b = _batch(page, dim, dtype)
    cfg = engine_config()
    extra = {"sinks": torch.tensor([4.0, -1.0, 1.5, 0.0])} if sinks else {}
    layer = new_layer(cfg, "cpu_attn", num_heads=4, num_kv_heads=2, head_size=dim,
                      prefix=f"cpu_native.{'sinks.' if sinks else ''}{kernel}.attn", **extra)  # fmt: skip
    md = cpu_attn.CPUAttentionMetadata(
        num_actual_tokens=int(b.qsl[-1]),
        max_query_len=max(b.q_lens),
        query_start_loc=b.qsl,
        max_seq_len=max(b.kv_lens),
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        slot_mapping=b.slots,
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=3,
            num_heads=4,
            num_kv_heads=2,
            head_dim=dim,
            seq_lens=b.seq_lens,
            dtype=dtype,
            query_start_loc=b.qsl,
            causal=True,
            sliding_window_size=-1,
            isa="vec",
            enable_kv_split=False,
        ),
    )
    step = types.SimpleNamespace(  # the fields vllm_plugin_testlib.common_metadata reads
        q_lens=b.q_lens, kv_lens=b.kv_lens, query_start_loc=b.qsl, seq_lens=b.seq_lens, block_table=b.block_table,
        slot_mapping=b.slots, num_tokens=int(b.qsl[-1]),
    )
    outputs = []
    for install in (False, True):
        kv_cache = torch.zeros(b.nb, 2, page, 2 * dim, dtype=dtype)
        if install:
            plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=[4.0],
                                          backend=kernel, strict=True)  # fmt: skip
            md = build_metadata(make_builder(cfg, [layer], page=page), step)
            assert layer.impl._modelopt_sparse.isa in ("vec", "vec16")  # chosen by vLLM's CPU builder
            assert (layer.impl._modelopt_sparse.sinks is not None) == sinks
        out = torch.full_like(b.q, math.nan)
        layer.impl.do_kv_cache_update(layer, b.k, b.v, kv_cache, b.slots)  # all tokens: prefix + new
        layer.impl.forward(layer, b.q, None, None, kv_cache, md, output=out)
        outputs.append(out)
    assert type(layer.impl) is plug.ModelOptSparseCPUAttentionImpl
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)
    assert plug.collect_calibration_records([layer])[0]["kv_lens"].tolist() == b.kv_lens
    if sinks:  # the comparison sees the sinks
        plug.uninstall_sparse_attention([layer])
        layer.impl.sinks = None
        out = torch.full_like(b.q, math.nan)
        layer.impl.forward(layer, b.q, None, None, kv_cache, md, output=out)
        assert (out - outputs[0]).abs().max() > 1e-2


# ------------------------------------------------------------------------------------------------------------------
# bf16 on CPUs with AMX: vLLM picks ISA 'amx' (K/V as AMX B tiles); the sparse layers keep it and read it in place.


def _float64_attention(b, dim):
    """Causal attention of each sequence's new queries over all its keys, in float64 (GQA: head h reads h // 2)."""
    outs, start = [], 0
    for i, (ql, kl) in enumerate(zip(b.q_lens, b.kv_lens, strict=True)):
        q = b.q[int(b.qsl[i]) : int(b.qsl[i + 1])].double()
        k = b.k[start : start + kl].double().repeat_interleave(2, dim=1)
        v = b.v[start : start + kl].double().repeat_interleave(2, dim=1)
        start += kl
        s = torch.einsum("qhd,khd->hqk", q, k) * dim**-0.5
        visible = torch.arange(kl)[None, :] <= (kl - ql + torch.arange(ql))[:, None]
        outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s.masked_fill(~visible, -math.inf), -1), v))
    return torch.cat(outs)


def _amx_capable_metadata(build_metadata, builder, step):
    """vLLM's CPU metadata for the step; a skip where this vllm-cpu build cannot plan its 'amx' attention at all
    (on an AVX2-only CPU it refuses the configuration: these tests need an AVX-512 or AMX CPU)."""
    try:
        return build_metadata(builder, step)
    except RuntimeError as exc:
        if "Unsupported CPU attention configuration" not in str(exc):
            raise
        pytest.skip(f"needs an AVX-512 or AMX CPU: this vllm-cpu refuses the 'amx' attention metadata here ({exc})")


def _bf16_layer_output(monkeypatch, *, sparse: bool, prefix: str):
    """One bf16 CPU layer on an AMX-predicting engine: vLLM's builder and writer (by `layer.isa`), then forward.
    Sparse: calibrate mode (dense output from our kernel, reading the cache in place). Returns (isa, output)."""
    from vllm_plugin_testlib import build_metadata, engine_config, make_builder, new_layer

    page, dim, dtype = 32, 64, torch.bfloat16
    cfg = engine_config()
    monkeypatch.setattr(cfg.model_config, "dtype", dtype)
    layer = new_layer(cfg, "cpu_attn", num_heads=4, num_kv_heads=2, head_size=dim, prefix=prefix)
    if sparse:
        plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=[4.0])
    b = _batch(page, dim, dtype)
    step = types.SimpleNamespace(
        q_lens=b.q_lens, kv_lens=b.kv_lens, query_start_loc=b.qsl, seq_lens=b.seq_lens, block_table=b.block_table,
        slot_mapping=b.slots, num_tokens=int(b.qsl[-1]),
    )
    md = _amx_capable_metadata(build_metadata, make_builder(cfg, [layer], page=page), step)
    kv_cache = torch.randn(b.nb, 2, page, 2 * dim).to(dtype)  # slots nobody writes hold noise, not zeros
    layer.impl.do_kv_cache_update(layer, b.k, b.v, kv_cache, b.slots)  # vLLM's writer, in `layer.isa`'s layout
    out = torch.full_like(b.q, math.nan)
    layer.impl.forward(layer, b.q, None, None, kv_cache, md, output=out)
    return layer.isa, out, b


def test_sparse_bf16_layers_on_an_amx_cpu_keep_vllms_amx_layout(monkeypatch, caplog):
    """vLLM's own ISA rule with its AMX probe answered yes (this CPU may lack AMX: vLLM's writer needs no tiles, and
    our kernel reads the layout on its vector path too): the group is 'amx', the sparse builder keeps it (no ISA
    line at start-up), vLLM's writer writes that layout and our kernel reads it in place.
    Against float64 attention: bf16 atol 2e-2 (bf16 queries, keys and values; fp32 accumulation)."""
    if not torch.cpu._is_amx_tile_supported():
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    if cpu_attn._get_attn_isa(torch.bfloat16, 32, 64) != "amx":
        pytest.skip("this vLLM does not pick 'amx' for bf16 on AMX CPUs")
    with caplog.at_level(logging.INFO, logger="modelopt_ext"):
        isa, out, b = _bf16_layer_output(monkeypatch, sparse=True, prefix="cpu_amx_rule.attn")
    assert isa == "amx"
    assert not [r for r in caplog.records if "CPU attention ISA" in r.getMessage()]
    torch.testing.assert_close(out.double(), _float64_attention(b, 64), atol=2e-2, rtol=0)


@pytest.mark.skipif(not HAS_AMX, reason=AMX_REASON)
def test_sparse_bf16_on_amx_layout_matches_vllms_native_amx_attention(monkeypatch):
    """On a real AMX CPU: the native and the sparse layer both get vLLM's 'amx' writer; native runs vLLM's amx
    attention, sparse our kernel on the same cache layout. Same K/V, same queries: outputs agree to bf16 precision
    (atol 2e-2), and both to float64."""
    torch.cpu._init_amx()  # tile permission for vLLM's amx kernel in this process
    native_isa, native, b = _bf16_layer_output(monkeypatch, sparse=False, prefix="cpu_amx_native.attn")
    sparse_isa, ours, _ = _bf16_layer_output(monkeypatch, sparse=True, prefix="cpu_amx_sparse.attn")
    assert (native_isa, sparse_isa) == ("amx", "amx")
    torch.testing.assert_close(ours.float(), native.float(), atol=2e-2, rtol=0)
    torch.testing.assert_close(native.double(), _float64_attention(b, 64), atol=2e-2, rtol=0)


def _bf16_sparse_layer(monkeypatch, *, amx_probe: bool, prefix: str, settings=None, page=64, dim=64):
    """A bf16 sparse CPU layer with vLLM's AMX probe answered `amx_probe` (vLLM's ISA rule then picks 'amx' or 'vec'),
    its cache written by vLLM's writer in that layout, run on one mixed step. Returns (isa, output, counts): the
    calibration counts per sequence and trial, or the served layer's realized (visited, skipped) per phase."""
    from vllm_plugin_testlib import build_metadata, engine_config, make_builder, new_layer

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx_probe)
    cfg = engine_config()
    monkeypatch.setattr(cfg.model_config, "dtype", torch.bfloat16)
    layer = new_layer(cfg, "cpu_attn", num_heads=4, num_kv_heads=2, head_size=dim, prefix=prefix)
    if settings is None:
        plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=[4.0, 64.0, 250.0])
    else:
        plug.install_sparse_attention([layer], settings)
    b = _batch(page, dim, torch.bfloat16, long=True)
    step = types.SimpleNamespace(
        q_lens=b.q_lens, kv_lens=b.kv_lens, query_start_loc=b.qsl, seq_lens=b.seq_lens, block_table=b.block_table,
        slot_mapping=b.slots, num_tokens=int(b.qsl[-1]),
    )
    md = _amx_capable_metadata(build_metadata, make_builder(cfg, [layer], page=page), step)
    kv_cache = torch.full((b.nb, 2, page, 2 * dim), math.nan, dtype=torch.bfloat16)  # unwritten slots: NaN
    layer.impl.do_kv_cache_update(layer, b.k, b.v, kv_cache, b.slots)
    out = torch.full_like(b.q, math.nan)
    layer.impl.forward(layer, b.q, None, None, kv_cache, md, output=out)
    if settings is None:
        return layer.isa, out, plug.collect_calibration_records([layer])[0]["counts"].tolist()
    return layer.isa, out, list(plug.get_sparsity_stats([layer]).values())


@pytest.mark.parametrize("mode", ["calibrate", "serve"])
def test_sparse_layer_on_vllms_amx_layout_equals_vec_layout(monkeypatch, mode):
    """The same bf16 layer and step on vLLM's 'amx' cache layout (AMX B tiles, read in place through 6-D views) and
    on 'vec' (the probe answered no): bitwise the same output, and in calibration the same counts for every trial;
    unwritten slots hold NaN in both caches. Runs on any x86 CPU (vLLM's writer needs no tiles; without AMX our
    kernel takes its vector path on both layouts)."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        PhaseCalibration,
        SparseAttentionSettings,
    )

    if not hasattr(cpu_attn, "_get_attn_isa"):
        pytest.skip("this vLLM's CPU attention chooses no ISA")
    settings = None
    if mode == "serve":
        law = PhaseCalibration(a=250.0, b=0.0, target_sparsity=0.5)  # λ = 250 / n
        settings = SparseAttentionSettings(prefill=law, decode=law, disabled_layers=())
    results = {}
    for probe in (True, False):
        results[probe] = _bf16_sparse_layer(monkeypatch, amx_probe=probe, prefix=f"cpu_amx_eq_{mode}_{probe}.attn",
                                            settings=settings)  # fmt: skip
    (isa_amx, out_amx, rec_amx), (isa_vec, out_vec, rec_vec) = results[True], results[False]
    if isa_amx != "amx":
        pytest.skip(f"this vLLM picks {isa_amx!r} for bf16 on AMX CPUs")
    assert isa_vec == "vec" and not torch.isnan(out_amx).any()
    assert torch.equal(out_amx, out_vec)
    assert rec_amx == rec_vec
    if mode == "calibrate":  # sequence 0 is the prompt chunk, 1 and 2 decode rows
        skipped = {"prefill": sum(t[1] for t in rec_amx[0]), "decode": sum(t[1] for seq in rec_amx[1:] for t in seq)}
    else:
        skipped = {phase: sum(layer[phase]["skipped"] for layer in rec_amx) for phase in ("prefill", "decode")}
    assert skipped["prefill"] > 0 and skipped["decode"] > 0, f"the step must skip tiles in both phases: {rec_amx}"
