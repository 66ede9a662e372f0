"""vLLM plugin: calibrated skip-softmax sparse attention on vLLM's attention layers.

This module is the plugin's public face; each concern lives in its own module:

    vllm_compat.py     what the installed vLLM has (native classes, version facts), asked once
    vllm_kv_cache.py   zero-copy K/V views of every cache layout vLLM has used, and the K/V write
    vllm_context.py    one engine's mode, settings and kernel, shared by its layers and builders
    vllm_prompt_lens.py  where each request's prompt length comes from (model runner V1 / V2)
    vllm_plan.py       the per-step sparse plan (persistent buffers: prompt lengths, phases, λ-law tensors)
    vllm_impls.py      the sparse impls (subclasses of vLLM's native impls) and their per-layer state
    vllm_backends.py   the sparse backends and metadata builders (subclasses of vLLM's native ones)
    vllm_install.py    install / uninstall, with every reason a layer cannot run sparse found up front
    vllm_stats.py      realized sparsity and calibration records
    vllm_worker.py     worker glue: install after load_model, RPCs, the vLLM general-plugin entry point

Public entry points (see each docstring):

    install_sparse_attention(model_or_layers, settings, *, mode="serve" | "calibrate", backend="auto",
                             calibration_scale_factors=None, track_sparsity=True, vllm_config=None,
                             model_runner=None) -> SparseAttentionInstallReport
    uninstall_sparse_attention(model_or_layers) -> list[str]
    collect_calibration_records(model_or_layers, *, reset=True) -> list[dict]
    merge_calibration_records(records) -> dict
    get_sparsity_stats(model_or_layers) -> dict[str, dict]; reset_sparsity_stats(model_or_layers)
"""

from __future__ import annotations

from .vllm_backends import (
    SPARSE_BACKENDS,
    ModelOptSparseCPUAttentionBackend,
    ModelOptSparseCPUAttentionMetadataBuilder,
    ModelOptSparseFlashAttentionBackend,
    ModelOptSparseFlashAttentionMetadataBuilder,
    ModelOptSparseFlashInferBackend,
    ModelOptSparseFlashInferMetadataBuilder,
)
from .vllm_calibration_records import merge_calibration_records, sparsity_by_phase
from .vllm_compat import forward_writes_kv_cache, vllm_facts
from .vllm_impls import (
    _BACKEND_BY_NATIVE,
    _SPARSE_BY_NATIVE,
    _SPARSE_CLASSES,
    CPUAttentionBackendImpl,
    FlashAttentionImpl,
    FlashInferImpl,
    ModelOptSparseAttentionImpl,
    ModelOptSparseCPUAttentionImpl,
    ModelOptSparseFlashInferImpl,
)
from .vllm_install import SparseAttentionInstallReport, _layers, install_sparse_attention, uninstall_sparse_attention
from .vllm_kv_cache import _cpu_attn_kv_cache_views, _flash_attn_kv_cache_views, _flashinfer_kv_cache_views
from .vllm_plan import PLAN_ATTR, SparsePlan
from .vllm_stats import collect_calibration_records, get_sparsity_stats, is_sparse_layer, reset_sparsity_stats

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
    "_BACKEND_BY_NATIVE",
    "_SPARSE_BY_NATIVE",
    "_SPARSE_CLASSES",
    "_cpu_attn_kv_cache_views",
    "_flash_attn_kv_cache_views",
    "_flashinfer_kv_cache_views",
    "_layers",
    "collect_calibration_records",
    "forward_writes_kv_cache",
    "get_sparsity_stats",
    "install_sparse_attention",
    "is_sparse_layer",
    "merge_calibration_records",
    "reset_sparsity_stats",
    "sparsity_by_phase",
    "uninstall_sparse_attention",
    "vllm_facts",
]
