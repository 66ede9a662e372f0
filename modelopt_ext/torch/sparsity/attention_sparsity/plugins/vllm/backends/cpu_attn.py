"""Sparse CPU attention: vLLM's CPU attention backend with the skip-softmax kernels.

    CPUAttentionBackend          -> ModelOptSparseCPUAttentionBackend
    CPUAttentionMetadata         -> ModelOptSparseCPUAttentionMetadata
    CPUAttentionMetadataBuilder  -> ModelOptSparseCPUAttentionMetadataBuilder
    CPUAttentionBackendImpl      -> ModelOptSparseCPUAttentionImpl

vLLM's CPU builder picks an ISA per KV-cache group and stores it on the group's layers; the ISA sets the cache
layout inside each block (docs/design.md, "CPU attention ISAs"). The sparse builder checks that the kernels read
that layout (`vec`, `vec16`, `amx`: all in place) at start-up, and the impls learn it from there; install predicts
it from the engine config before any weight loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..compat import cpu_native_write_op, native_backend, predicted_cpu_attn_isa
from ..impls import STATE_ATTR, SparseImplMixin
from ..kv_cache import as_cache_dtype, cpu_attn_kv_cache_views, cpu_isa_problem, write_kv_through_views
from .base import SparseBackendMixin, SparseBuilderMixin, sparse_metadata

if TYPE_CHECKING:
    from ..plan import SparsePlan

NATIVE = native_backend("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend", "CPUAttentionBackendImpl",
                        "CPUAttentionMetadataBuilder", "CPUAttentionMetadata")
CPUAttentionBackend, CPUAttentionBackendImpl = NATIVE.backend, NATIVE.impl
CPUAttentionMetadata, CPUAttentionMetadataBuilder = NATIVE.metadata, NATIVE.builder


class ModelOptSparseCPUAttentionImpl(SparseImplMixin, CPUAttentionBackendImpl):
    """vLLM CPU-attention impl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

    _modelopt_native = CPUAttentionBackendImpl
    writes_with_flash_cache_op = False  # vLLM's CPU writer, or the torch write through the views

    @classmethod
    def cache_facts(cls, layer, impl, native_backend) -> dict:
        """The ISA vLLM's CPU builder set on the layer (None before the KV cache exists: the builder sets it)."""
        return {"isa": getattr(layer, "isa", None)}

    def _modelopt_views(self, layer, kv_cache):
        # The ISA (hence the cache layout) was checked when the sparse CPU builder chose it for this layer.
        isa = getattr(self, STATE_ATTR).isa or getattr(layer, "isa", None)
        return cpu_attn_kv_cache_views(kv_cache, self.head_size, isa)

    def _modelopt_write(self, layer, key, value, kv_cache, slot_mapping):
        if cpu_native_write_op() is not None:
            CPUAttentionBackendImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)
            return
        k_view, v_view = as_cache_dtype(self._modelopt_views(layer, kv_cache), self._modelopt_cache_dtype())
        write_kv_through_views(key, value, k_view, v_view, slot_mapping, layer._k_scale_float, layer._v_scale_float)


@sparse_metadata
class ModelOptSparseCPUAttentionMetadata(CPUAttentionMetadata):
    """CPUAttentionMetadata with the step's sparse plan."""

    modelopt_sparse_plan: SparsePlan | None = None


class ModelOptSparseCPUAttentionMetadataBuilder(SparseBuilderMixin, CPUAttentionMetadataBuilder):
    """CPUAttentionMetadataBuilder that plans each step for the sparse kernel (backends/base.py) and checks the
    ISA vLLM chose for its group, and with it the cache layout the impl reads, at start-up."""

    sparse_metadata_cls = ModelOptSparseCPUAttentionMetadata

    def _modelopt_check_startup(self, kv_cache_spec) -> None:
        super()._modelopt_check_startup(kv_cache_spec)
        context = self._modelopt_context()
        if context is None:
            return
        isa = getattr(self, "isa", None)
        cache_dtype = getattr(self, "kv_cache_dtype", None)  # the CPU builder keeps the engine's cache dtype
        problem = cpu_isa_problem(isa, cache_dtype) if isa is not None else "vLLM's CPU builder chose no ISA"
        if problem is not None:
            raise ValueError(f"sparse attention on {len(self.layer_names)} layers ({self.layer_names[0]}, ...): "
                             f"{problem}, or set MODELOPT_EXT_SPARSE_ATTN=0")
        for layer in self._modelopt_layers:
            state = getattr(layer.impl, STATE_ATTR, None)
            if state is not None:
                state.isa = isa


class ModelOptSparseCPUAttentionBackend(SparseBackendMixin, CPUAttentionBackend):
    """CPUAttentionBackend whose impl and metadata builder are the sparse ones."""

    kind = "cpu_attn"
    native_backend = CPUAttentionBackend
    native_impl = CPUAttentionBackendImpl

    @staticmethod
    def get_impl_cls():
        return ModelOptSparseCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return ModelOptSparseCPUAttentionMetadataBuilder

    @classmethod
    def cache_problems(cls, native_backend, head_size, layer, config) -> list[str]:
        """The packed cache layout (vLLM >= 0.25.1), and an ISA whose layout the kernels read: the one vLLM's
        builder set on the layer, else the one it will choose for this engine config."""
        cache_dtype = getattr(getattr(config, "cache_config", None), "cache_dtype", None)
        isa = cpu_isa_problem(getattr(layer, "isa", None) or predicted_cpu_attn_isa(config, head_size), cache_dtype)
        return super().cache_problems(native_backend, head_size, layer, config) + ([isa] if isa else [])


SPARSE_BACKEND = ModelOptSparseCPUAttentionBackend
