"""Sparse FlashAttention: vLLM's FlashAttention backend with the skip-softmax kernels.

    FlashAttentionBackend          -> ModelOptSparseFlashAttentionBackend
    FlashAttentionMetadata         -> ModelOptSparseFlashAttentionMetadata
    FlashAttentionMetadataBuilder  -> ModelOptSparseFlashAttentionMetadataBuilder
    FlashAttentionImpl             -> ModelOptSparseAttentionImpl
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..compat import flash_attn_kv_first, native_backend
from ..impls import STATE_ATTR, SparseImplMixin
from ..kv_cache import flash_attn_kv_cache_views
from .base import SparseBackendMixin, SparseBuilderMixin, sparse_metadata

if TYPE_CHECKING:
    from ..plan import SparsePlan

NATIVE = native_backend("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend", "FlashAttentionImpl",
                        "FlashAttentionMetadataBuilder", "FlashAttentionMetadata")
FlashAttentionBackend, FlashAttentionImpl = NATIVE.backend, NATIVE.impl
FlashAttentionMetadata, FlashAttentionMetadataBuilder = NATIVE.metadata, NATIVE.builder


class ModelOptSparseAttentionImpl(SparseImplMixin, FlashAttentionImpl):
    """FlashAttentionImpl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

    _modelopt_native = FlashAttentionImpl

    @classmethod
    def cache_facts(cls, layer, impl, native_backend) -> dict:
        """The axis order of a 5D cache (K/V axis first or blocks first), as the native backend declares it."""
        return {"kv_first": flash_attn_kv_first(native_backend, impl.head_size)}

    def _modelopt_views(self, layer, kv_cache):
        return flash_attn_kv_cache_views(kv_cache, self.head_size, getattr(self, STATE_ATTR).kv_first)


@sparse_metadata
class ModelOptSparseFlashAttentionMetadata(FlashAttentionMetadata):
    """FlashAttentionMetadata with the step's sparse plan."""

    modelopt_sparse_plan: SparsePlan | None = None


class ModelOptSparseFlashAttentionMetadataBuilder(SparseBuilderMixin, FlashAttentionMetadataBuilder):
    """FlashAttentionMetadataBuilder that plans each step for the sparse kernel (backends/base.py)."""

    sparse_metadata_cls = ModelOptSparseFlashAttentionMetadata


class ModelOptSparseFlashAttentionBackend(SparseBackendMixin, FlashAttentionBackend):
    """FlashAttentionBackend whose impl and metadata builder are the sparse ones."""

    kind = "flash_attn"
    native_backend = FlashAttentionBackend
    native_impl = FlashAttentionImpl

    @staticmethod
    def get_impl_cls():
        return ModelOptSparseAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ModelOptSparseFlashAttentionMetadataBuilder


SPARSE_BACKEND = ModelOptSparseFlashAttentionBackend
