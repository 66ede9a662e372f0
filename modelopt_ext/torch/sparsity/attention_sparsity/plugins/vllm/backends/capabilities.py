"""What the sparse path supports, as vLLM's backends say it: the `supports_*` class methods of every sparse backend.

vLLM's selector validates a backend for a layer by asking the backend class (`supports_head_size`,
`supports_kv_cache_dtype`, `supports_attn_type`, `supports_sink`, `supports_sliding_window`, `supports_dcp`, ...).
Each sparse backend inherits these answers, and the install checks (plugins/vllm/checks.py) ask the layer's sparse
backend the same questions instead of re-deriving them. The answers are the sparse path's own limits: the native
backend's were met when vLLM chose it for the layer, so they are not asked again (several of them probe the GPU).
This module imports no vLLM backend, so the engine-config checks can ask it before any backend is loaded.
"""

from __future__ import annotations

from typing import ClassVar

from .. import compat
from ..kv_cache import FP8_VIEW_DTYPES

UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")
"""vLLM cache dtypes that hold the model's own values."""
FP8_KV_DTYPES = tuple(FP8_VIEW_DTYPES)
"""vLLM's FP8 cache dtypes the kernels read (the views' table: e4m3 / e5m2 bytes times the layer's scales,
docs/skip_softmax.md); other quantized caches (NVFP4, FP8 with per-token or MLA layouts) are not read."""


class SparseCapabilities:
    """The capability class methods of a sparse backend (the base of `SparseBackendMixin`)."""

    kind: ClassVar[str]  # the native backend's kind in plugins/vllm/compat.py
    native_backend: ClassVar[type]
    native_impl: ClassVar[type]

    @classmethod
    def supports_head_size(cls, head_size) -> bool:
        """Any positive head size (the Triton kernel's own range is checked with the engine's kernel choice)."""
        return isinstance(head_size, int) and head_size > 0

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        """Unquantized caches and vLLM's per-tensor FP8 caches (e4m3, e5m2); no NVFP4 or other quantized cache."""
        return not isinstance(kv_cache_dtype, str) or kv_cache_dtype in UNQUANTIZED_KV_DTYPES + FP8_KV_DTYPES

    @classmethod
    def supports_attn_type(cls, attn_type) -> bool:
        """Decoder self-attention only (no encoder or cross attention)."""
        return str(getattr(attn_type, "value", attn_type)).lower().rsplit(".", 1)[-1] == "decoder"

    @classmethod
    def supports_sink(cls) -> bool:
        """Attention sinks where the native impl takes them (the kernels read the impl's `sinks`)."""
        return compat.impl_takes_sinks(cls.native_impl)

    @classmethod
    def is_mla(cls) -> bool:
        """No multi-head latent attention (MLA layers keep vLLM's own backend)."""
        return False

    @classmethod
    def supports_sliding_window(cls) -> bool:
        """No sliding window: the kernels attend to every earlier key."""
        return False

    @classmethod
    def supports_dcp(cls) -> bool:
        """No decode context parallelism: the kernels read each sequence's whole cache on one rank."""
        return False

    @classmethod
    def cache_problems(cls, native_backend, head_size, layer, config) -> list[str]:
        """Why the cache this layer's native backend gives the impl is not one the sparse views read (empty: it
        is). Not a vLLM question: the plugin's own, asked by the install checks."""
        problem = compat.cache_layout_problem(cls.kind, native_backend, head_size)
        return [problem] if problem is not None else []
