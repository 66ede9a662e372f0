"""vLLM plugin: calibrated skip-softmax sparse attention on vLLM's attention layers.

This package's `__init__` is the plugin's public face; each concern lives in its own module:

    env.py          the environment switches (MODELOPT_EXT_SPARSE_ATTN*), read in one place
    compat.py       what the installed vLLM has (native classes, version facts), asked once
    kv_cache.py     zero-copy K/V views of every cache layout vLLM has used, and the K/V write
    context.py      one engine's mode, settings and kernel, shared by its layers and builders
    prompt_lens.py  where each request's prompt length comes from (model runner V1 / V2)
    request_targets.py  a request's own targets (SamplingParams.extra_args) and each row's law from them
    admission.py    per-request targets refused at admission (vLLM's logits-processor validation hook)
    request_stats.py    realized sparsity per request (device counters, one slot per request)
    metrics.py      realized sparsity on vLLM's Prometheus /metrics (worker files, a collector in the server)
    plan.py         the per-step sparse plan (persistent buffers: prompt lengths, phases, λ-law tensors)
    impls.py        the sparse impls (subclasses of vLLM's native impls) and their per-layer state
    kernel_pages.py which page sizes the skip-softmax kernels cover (asked by the builders, checks and graph self-test)
    backends.py     the sparse backends and metadata builders (subclasses of vLLM's native ones)
    cudagraphs.py   what the builders declare for CUDA graphs (full decode graphs after a start-up self-test)
    checks.py       every reason a layer cannot run sparse: predicted from the engine config, or per layer
    install.py      install / uninstall: every layer checked before any changes
    stats.py        realized sparsity and calibration records
    worker.py       the worker side: install after load_model, the RPCs (vLLM's `worker_extension_cls`), the log
    entry.py        the vLLM general-plugin entry point `register()` (config checks, the load_model hook)

The checkpoint side (the `sparse_attention_config` block, config.json I/O, calibration records) is vLLM-free and
lives in `attention_sparsity/checkpoint/`.

Public entry points (see each docstring):

    install_sparse_attention(model_or_layers, settings, *, mode="serve" | "calibrate", backend="auto",
                             calibration_scale_factors=None, track_sparsity=True, vllm_config=None,
                             model_runner=None) -> SparseAttentionInstallReport
    uninstall_sparse_attention(model_or_layers) -> list[str]
    collect_calibration_records(model_or_layers, *, reset=True) -> list[dict]
    merge_calibration_records(records) -> dict
    get_sparsity_stats(model_or_layers) -> dict[str, dict]; reset_sparsity_stats(model_or_layers)
    get_request_stats(model_or_layers, request_ids=None) -> dict[str, dict]
"""

from __future__ import annotations

from ...checkpoint.calibration_records import merge_calibration_records, sparsity_by_phase
from .backends import (
    SPARSE_BACKENDS,
    ModelOptSparseCPUAttentionBackend,
    ModelOptSparseCPUAttentionMetadataBuilder,
    ModelOptSparseFlashAttentionBackend,
    ModelOptSparseFlashAttentionMetadataBuilder,
    ModelOptSparseFlashInferBackend,
    ModelOptSparseFlashInferMetadataBuilder,
)
from .compat import forward_writes_kv_cache, vllm_facts
from .impls import _BACKEND_BY_NATIVE as _BACKEND_BY_NATIVE
from .impls import _SPARSE_BY_NATIVE as _SPARSE_BY_NATIVE
from .impls import _SPARSE_CLASSES as _SPARSE_CLASSES
from .impls import (
    CPUAttentionBackendImpl,
    FlashAttentionImpl,
    FlashInferImpl,
    ModelOptSparseAttentionImpl,
    ModelOptSparseCPUAttentionImpl,
    ModelOptSparseFlashInferImpl,
)
from .install import SparseAttentionInstallReport, install_sparse_attention, uninstall_sparse_attention
from .install import _layers as _layers
from .kv_cache import _cpu_attn_kv_cache_views as _cpu_attn_kv_cache_views
from .kv_cache import _flash_attn_kv_cache_views as _flash_attn_kv_cache_views
from .kv_cache import _flashinfer_kv_cache_views as _flashinfer_kv_cache_views
from .plan import PLAN_ATTR, SparsePlan
from .stats import (
    collect_calibration_records,
    get_request_stats,
    get_sparsity_stats,
    is_sparse_layer,
    reset_sparsity_stats,
)

# Private names kept importable from this package (not part of `__all__`): the K/V cache views are a contract that
# outside checks import by these names from here (`_flashinfer_kv_cache_views` above all), and the tests read the
# impl/backend maps and the layer walk from here. The `from .m import _x as _x` form above marks each one as a
# deliberate re-export.
__all__ = [
    "CPUAttentionBackendImpl",
    "FlashAttentionImpl",
    "FlashInferImpl",
    "ModelOptSparseAttentionImpl",
    "ModelOptSparseCPUAttentionBackend",
    "ModelOptSparseCPUAttentionMetadataBuilder",
    "ModelOptSparseCPUAttentionImpl",
    "ModelOptSparseFlashAttentionBackend",
    "ModelOptSparseFlashAttentionMetadataBuilder",
    "ModelOptSparseFlashInferBackend",
    "ModelOptSparseFlashInferImpl",
    "ModelOptSparseFlashInferMetadataBuilder",
    "PLAN_ATTR",
    "SPARSE_BACKENDS",
    "SparseAttentionInstallReport",
    "SparsePlan",
    "collect_calibration_records",
    "forward_writes_kv_cache",
    "get_request_stats",
    "get_sparsity_stats",
    "install_sparse_attention",
    "is_sparse_layer",
    "merge_calibration_records",
    "reset_sparsity_stats",
    "sparsity_by_phase",
    "uninstall_sparse_attention",
    "vllm_facts",
]
