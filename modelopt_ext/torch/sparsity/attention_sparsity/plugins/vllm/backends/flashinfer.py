"""Sparse FlashInfer: vLLM's FlashInfer backend with the skip-softmax kernels.

    FlashInferBackend          -> ModelOptSparseFlashInferBackend
    FlashInferMetadata         -> ModelOptSparseFlashInferMetadata
    FlashInferMetadataBuilder  -> ModelOptSparseFlashInferMetadataBuilder
    FlashInferImpl             -> ModelOptSparseFlashInferImpl

A step the sparse kernel serves skips FlashInfer's plan (its host-side scheduling and copies): its metadata has the
batch's counts and slot mapping and no prefill or decode plan (`prefill=None, decode=None`), which only the dense
path reads, and it never runs on such a step. Where this vLLM's `FlashInferMetadata` needs fields this does not
know, the native build runs (logged once).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

from ..compat import native_backend
from ..impls import SparseImplMixin
from ..kv_cache import flashinfer_kv_cache_views
from .base import SparseBackendMixin, SparseBuilderMixin, sparse_metadata

if TYPE_CHECKING:
    from ..plan import SparsePlan

NATIVE = native_backend("vllm.v1.attention.backends.flashinfer", "FlashInferBackend", "FlashInferImpl",
                        "FlashInferMetadataBuilder", "FlashInferMetadata")
FlashInferBackend, FlashInferImpl = NATIVE.backend, NATIVE.impl
FlashInferMetadata, FlashInferMetadataBuilder = NATIVE.metadata, NATIVE.builder


class ModelOptSparseFlashInferImpl(SparseImplMixin, FlashInferImpl):
    """FlashInferImpl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

    _modelopt_native = FlashInferImpl

    def _modelopt_views(self, layer, kv_cache):
        return flashinfer_kv_cache_views(kv_cache, self.head_size)


@sparse_metadata
class ModelOptSparseFlashInferMetadata(FlashInferMetadata):
    """FlashInferMetadata with the step's sparse plan."""

    modelopt_sparse_plan: SparsePlan | None = None


LIGHT_FIELDS = frozenset((
    "kv_cache_layout", "num_actual_tokens", "slot_mapping", "q_data_type_prefill", "q_data_type_decode",
    "num_decodes", "num_decode_tokens", "num_prefills", "num_prefill_tokens", "causal", "prefill", "decode",
))  # fmt: skip
"""The FlashInferMetadata fields a step the sparse kernel serves fills (no FlashInfer plan)."""


@functools.cache
def _metadata_fields() -> tuple[frozenset, frozenset] | None:
    """(required init fields, all fields) of this vLLM's FlashInferMetadata, read once (None: no dataclass)."""
    if not dataclasses.is_dataclass(FlashInferMetadata):
        return None
    fields = dataclasses.fields(FlashInferMetadata)
    required = frozenset(f.name for f in fields if f.init and f.default is dataclasses.MISSING
                         and f.default_factory is dataclasses.MISSING)  # fmt: skip
    return required, frozenset(f.name for f in fields)


class ModelOptSparseFlashInferMetadataBuilder(SparseBuilderMixin, FlashInferMetadataBuilder):
    """FlashInferMetadataBuilder that plans each step for the sparse kernel (backends/base.py) and skips
    FlashInfer's plan on steps the sparse kernel serves (module docstring)."""

    sparse_metadata_cls = ModelOptSparseFlashInferMetadata

    def _modelopt_sparse_step_values(self, context, common_attn_metadata):
        fields = _metadata_fields()
        if fields is None:
            return None
        required, known = fields
        missing = sorted(required - LIGHT_FIELDS)
        if missing:
            context.log_once("flashinfer-plan", "sparse attention: FlashInfer's plan runs on sparse steps too (this "
                             "vLLM's FlashInferMetadata also needs %s)", ", ".join(missing))
            return None
        from vllm.v1.attention.backends.utils import split_decodes_and_prefills

        cam = common_attn_metadata
        num_decodes, num_prefills, num_decode_tokens, num_prefill_tokens = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold
        )
        values = {
            "kv_cache_layout": getattr(self, "kv_cache_layout", None), "num_actual_tokens": cam.num_actual_tokens,
            "slot_mapping": cam.slot_mapping, "q_data_type_prefill": getattr(self, "q_data_type_prefill", None),
            "q_data_type_decode": getattr(self, "q_data_type_decode", None), "num_decodes": num_decodes,
            "num_decode_tokens": num_decode_tokens, "num_prefills": num_prefills,
            "num_prefill_tokens": num_prefill_tokens, "causal": getattr(cam, "causal", True), "prefill": None,
            "decode": None,
        }  # fmt: skip
        return {k: v for k, v in values.items() if k in known}


class ModelOptSparseFlashInferBackend(SparseBackendMixin, FlashInferBackend):
    """FlashInferBackend whose impl and metadata builder are the sparse ones."""

    kind = "flashinfer"
    native_backend = FlashInferBackend
    native_impl = FlashInferImpl

    @staticmethod
    def get_impl_cls():
        return ModelOptSparseFlashInferImpl

    @staticmethod
    def get_builder_cls():
        return ModelOptSparseFlashInferMetadataBuilder


SPARSE_BACKEND = ModelOptSparseFlashInferBackend
