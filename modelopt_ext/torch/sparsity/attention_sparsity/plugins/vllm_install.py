"""Install / uninstall of sparse attention on a model's vLLM attention layers, with every check done up front.

    install_sparse_attention(model_or_layers, settings, *, mode="serve" | "calibrate", backend="auto",
                             calibration_scale_factors=None, track_sparsity=True, vllm_config=None,
                             model_runner=None) -> SparseAttentionInstallReport
    uninstall_sparse_attention(model_or_layers) -> list[str]

Install gives each covered layer the sparse backend of its native backend (`layer.attn_backend`, what vLLM asks
when it builds the layer's attention group, metadata builder and CUDA-graph mode; plugins/vllm_backends.py) and the
sparse impl, cloned from the native impl's state. Call it after the model loads and before vLLM allocates the KV
cache (the worker glue does: plugins/vllm_worker.py); once the KV cache exists, only layers that a sparse builder
covers can be (re)configured.

Every reason a layer cannot run sparse is found here, before anything changes, and reported in one ValueError:
unsupported attention features (sinks, sliding window, ALiBi, soft-cap, encoder/cross attention, MLA, DCP,
quantized KV cache, V head size != K head size), head sizes / dtypes / page sizes the chosen kernel does not cover,
an unmeasured CPU ISA, a cache layout the views do not know, and a layer whose metadata builder is vLLM's native one.
What is only known when vLLM builds the KV cache (the kernel block size, the CPU ISA) is checked by the sparse
builder then, at start-up. The sparse impls never fuse output quantization (`fused_output_quant_supported` is
False), so no forward ever meets an output scale.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from dataclasses import dataclass, field

import torch

from .sparse_attn_config import SparseAttentionSettings
from .vllm_backends import BUILDER_MARK, SPARSE_BACKENDS, kernel_page_problem, native_backend_of
from .vllm_compat import (
    cache_layout_problem,
    cpu_attn_isa,
    flash_attn_kv_first,
    forward_writes_kv_cache,
    vllm_facts,
)
from .vllm_context import MODES, SparseAttentionContext
from .vllm_impls import _BACKEND_BY_NATIVE, _SPARSE_BY_NATIVE, _SPARSE_CLASSES, _STATE_ATTR, _LayerState, layer_state
from .vllm_kv_cache import cpu_isa_problem, native_flash_cache_write_op
from .vllm_prompt_lens import prompt_lens_source

logger = logging.getLogger(__name__)

KERNEL_BACKENDS = ("auto", "torch", "triton", "cpu")
_UNQUANTIZED_KV_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")


@dataclass
class SparseAttentionInstallReport:
    """What `install_sparse_attention` did: layer names by outcome, and the engine-wide choices."""

    mode: str
    installed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)  # already sparse with the same configuration
    reconfigured: list[str] = field(default_factory=list)  # already sparse, settings/mode replaced
    disabled: list[str] = field(default_factory=list)  # settings.disabled_layers: native impl and backend
    restored: list[str] = field(default_factory=list)  # of `disabled`: were sparse, got their native impl back
    native_impls: dict[str, str] = field(default_factory=dict)  # covered layers -> native impl class name
    kernel_backend: str = ""
    prompt_lens: str = ""  # where the per-request prompt lengths come from (or why the kernel default applies)

    @property
    def sparse(self) -> list[str]:
        return self.installed + self.unchanged + self.reconfigured


# ---------------------------------------------------------------------------------------------------------------
# Layers


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


def _native_impl_cls(impl) -> type:
    return type(impl)._modelopt_native if isinstance(impl, _SPARSE_CLASSES) else type(impl)


def _native_backend_cls(layer, native_impl):
    backend = getattr(layer, "attn_backend", None)
    return native_backend_of(backend) if backend is not None else _BACKEND_BY_NATIVE.get(native_impl)


def _kv_cache_bound(layer) -> bool:
    """Whether vLLM already bound a KV cache to the layer (then its attention group and builder exist)."""
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    return isinstance(kv, torch.Tensor) and kv.numel() > 0


def _disabled(name: str, settings: SparseAttentionSettings | None) -> bool:
    """Whether `ignore` keeps this layer dense. HF exports name the attention module (`model.layers.1.self_attn`)
    while vLLM names its layer inside it (`model.layers.1.self_attn.attn`), so a name also matches by prefix."""
    patterns = settings.disabled_layers if settings is not None else ()
    return any(
        name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*")
        for p in patterns
    )


# ---------------------------------------------------------------------------------------------------------------
# Validation


def _current_vllm_config(vllm_config):
    if vllm_config is not None:
        return vllm_config
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover
        return None
    return get_current_vllm_config_or_none()


def _resolve_kernel_backend(backend: str, config) -> str:
    """"auto" -> "triton" where CUDA serves, the compiled CPU kernel on the CPU (the reference where it cannot
    load or cover the dtype, with the reason logged); decided once, so no call falls back silently."""
    if backend != "auto":
        if backend == "triton":
            from modelopt_ext.torch.kernels.sparsity.attention import triton_available

            if not triton_available():
                raise ValueError("backend='triton' needs the triton package; install it or use backend='torch'")
        return backend
    device_type = str(getattr(getattr(config, "device_config", None), "device_type", "") or "")
    if device_type == "cpu" or not torch.cuda.is_available():
        from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel

        dtype = getattr(getattr(config, "model_config", None), "dtype", None)
        reason = cpu_kernel.unavailable_reason()
        if reason is None and isinstance(dtype, torch.dtype) and dtype not in cpu_kernel.CPU_KERNEL_DTYPES:
            reason = f"the compiled CPU kernel does not cover {dtype}"
        if reason is not None:
            logger.warning("sparse attention: using the PyTorch reference on the CPU (%s)", reason)
            return "torch"
        return "cpu"
    from modelopt_ext.torch.kernels.sparsity.attention import triton_available

    if not triton_available():
        raise ValueError(
            "sparse attention on CUDA needs triton (the PyTorch reference would serve every step with host syncs); "
            "install triton, or set MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch to accept the slow reference"
        )
    return "triton"


def _unsupported(layer, impl, kernel_backend: str, config) -> list[str]:
    """Every reason this layer cannot run sparse attention (empty when it can)."""
    reasons = []
    native = _native_impl_cls(impl)
    if native not in _SPARSE_BY_NATIVE:
        if "MLA" in type(layer).__name__ or "MLA" in native.__name__:
            reasons.append(f"MLA attention ({native.__name__}) is not supported")
        else:
            supported = ", ".join(c.__name__ for c in _SPARSE_BY_NATIVE)
            reasons.append(f"impl {native.__module__}.{native.__name__} is not supported (supported: {supported})")
        return reasons
    kind = vllm_facts().kind_of_impl(native)
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
    head_size_v = getattr(layer, "head_size_v", head_size)
    if head_size_v != head_size:
        reasons.append(f"V head size {head_size_v} != K head size {head_size} is not supported")
    if getattr(impl, "dcp_world_size", 1) > 1:
        reasons.append("decode context parallelism (DCP) is not supported")
    reasons += _kernel_problems(head_size, kernel_backend, config)
    backend_cls = _native_backend_cls(layer, native)
    layout = cache_layout_problem(kind, backend_cls, head_size)
    if layout is not None:
        reasons.append(layout)
    if kind == "cpu_attn":
        problem = cpu_isa_problem(getattr(layer, "isa", None) or _predicted_cpu_isa(config, head_size))
        if problem is not None:
            reasons.append(problem)
    return reasons


def _kernel_problems(head_size, kernel_backend: str, config) -> list[str]:
    """Head size, dtype and (when the user fixed it) page size the chosen kernel backend does not cover."""
    if not isinstance(head_size, int) or head_size <= 0:
        return [f"head size {head_size} is not supported"]
    if kernel_backend != "triton":
        return []
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    dtype = dtype if isinstance(dtype, torch.dtype) else torch.float16
    block = getattr(getattr(config, "cache_config", None), "block_size", None)
    problem = kernel_page_problem("triton", block if isinstance(block, int) else 16, head_size, dtype)
    if problem is None:
        return []
    return [f"{problem} (or serve with MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch; --block-size 16 covers the page)"]


def _name_list(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ..., {names[-1]}"


def refusal_message(head: str, problems) -> str:
    """`head` and one line per reason ("30 layers (a, b, ..., z): reason"), from (layer name, reasons) pairs."""
    by_reason: dict[str, list[str]] = {}
    for name, reasons in problems:
        for reason in reasons:
            by_reason.setdefault(reason, []).append(name)
    lines = [f"  {len(names)} layer{'s' if len(names) > 1 else ''} ({_name_list(names)}): {reason}"
             for reason, names in by_reason.items()]
    return "\n".join([head, *lines])


def predicted_startup_problems(vllm_config) -> list[str]:
    """What stops every attention layer of this engine from running sparse, predicted from the engine config
    alone (no model, no weights): the CPU attention ISA from dtype, page size and head size."""
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "") or "")
    model_config = getattr(vllm_config, "model_config", None)
    if device != "cpu" or model_config is None:
        return []
    try:
        head_size = int(model_config.get_head_size())
    except Exception:  # noqa: BLE001 - models without a uniform head size: install checks each layer
        return []
    problem = cpu_isa_problem(_predicted_cpu_isa(vllm_config, head_size))
    return [problem] if problem is not None else []


def _predicted_cpu_isa(config, head_size) -> str | None:
    model, cache = getattr(config, "model_config", None), getattr(config, "cache_config", None)
    dtype, block = getattr(model, "dtype", None), getattr(cache, "block_size", None)
    if not isinstance(dtype, torch.dtype) or not isinstance(block, int):
        return None
    return cpu_attn_isa(dtype, block, head_size, getattr(cache, "cache_dtype", None))


# ---------------------------------------------------------------------------------------------------------------
# Install / uninstall


def _check_trial_laws(laws) -> tuple[tuple[float, float, float, float], ...]:
    out = []
    for i, law in enumerate(laws):
        try:
            values = tuple(float(x) for x in law)
        except (TypeError, ValueError):
            values = ()
        if len(values) != 4 or not all(math.isfinite(x) for x in values):
            raise ValueError(f"calibration_laws[{i}] must be 4 finite numbers (c_prefill, c_decode, γ_prefill, "
                             f"γ_decode), got {law!r}")
        out.append(values)
    return tuple(out)


def _same_config(context: SparseAttentionContext, other: SparseAttentionContext) -> bool:
    keys = ("mode", "settings", "kernel_backend", "trials", "trial_laws", "track_sparsity")
    return all(getattr(context, k) == getattr(other, k) for k in keys)


def _restore_native(layer) -> None:
    impl = layer.impl
    state = getattr(impl, _STATE_ATTR)
    native = object.__new__(type(impl)._modelopt_native)
    native.__dict__.update({k: v for k, v in impl.__dict__.items() if k != _STATE_ATTR})
    layer.impl = native
    if state.native_backend is not None:
        layer.attn_backend = state.native_backend


def install_sparse_attention(
    model_or_layers,
    settings: SparseAttentionSettings | None,
    *,
    mode: str = "serve",
    backend: str = "auto",
    calibration_scale_factors=None,
    calibration_laws=None,
    track_sparsity: bool = True,
    vllm_config=None,
    model_runner=None,
) -> SparseAttentionInstallReport:
    """Give each vLLM attention layer the sparse backend and impl of its native ones.

    Args:
        model_or_layers: the vLLM model (nn.Module), a {name: layer} dict such as
            `vllm_config.compilation_config.static_forward_context`, or an iterable of `Attention` layers.
        settings: per-phase calibration and disabled layers (names or fnmatch patterns, given back their native
            impl and backend). A phase without calibration is served dense; None serves everything dense (the
            layers still get the sparse backend, so a later install on the same engine can calibrate or serve).
        mode: "serve" (drop tiles per row at ln λ = c - γ·ln n, docs/skip_softmax.md) or "calibrate" (dense output,
            and per sequence the visited/skipped tile counts of every trial in `calibration_scale_factors`).
        backend: kernel backend, "auto" (Triton where CUDA serves, else the PyTorch reference), "torch" or "triton".
        calibration_scale_factors: calibrate mode only: threshold trials as scale factors sf_t (λ = sf_t / n).
        calibration_laws: calibrate mode only, instead of scale factors: one served law per trial,
            `(c_prefill, c_decode, γ_prefill, γ_decode)`, so one dense pass counts exactly what serving each law
            would drop (benchmarks/fidelity.py). Records then label their trials 0..T-1 (`scale_factors`), which
            are no scale factors: such records measure, they are not for fitting.
        track_sparsity: serve mode: count dropped row-tiles per layer and phase (in-place device sums, see
            `get_sparsity_stats`).
        vllm_config: the engine's VllmConfig (default: the current one, if set), for the kernel checks.
        model_runner: the worker's model runner: where each request's prompt length comes from
            (plugins/vllm_prompt_lens.py). Without it the kernel's default rule applies.

    Every layer is validated before any is changed; one ValueError lists every offending layer. Installing
    again with the same arguments changes nothing; with other settings or mode it reconfigures the engine's
    sparse layers in place (records and counters are kept only when nothing changed).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if settings is not None and not isinstance(settings, SparseAttentionSettings):
        raise TypeError(f"settings must be a SparseAttentionSettings or None, got {type(settings).__name__}")
    trials: tuple[float, ...] = ()
    trial_laws = None
    if mode == "calibrate":
        if bool(calibration_scale_factors) == bool(calibration_laws):
            raise ValueError("mode='calibrate' needs exactly one of calibration_scale_factors (threshold trials as "
                             "scale factors) and calibration_laws")
        if calibration_laws:
            trial_laws = _check_trial_laws(calibration_laws)
            trials = tuple(float(i) for i in range(len(trial_laws)))
        else:
            trials = tuple(float(s) for s in calibration_scale_factors)
            if any(not (s > 0 and math.isfinite(s)) for s in trials):
                raise ValueError(f"calibration_scale_factors must be finite and positive, got {trials}")
    elif calibration_scale_factors or calibration_laws:
        raise ValueError("calibration_scale_factors / calibration_laws are only used with mode='calibrate'")

    layers = _layers(model_or_layers)
    if not layers:
        raise ValueError("no vLLM attention layers found (expected modules with an `impl`, e.g. vLLM's Attention)")
    config = _current_vllm_config(vllm_config)
    kernel_backend = _resolve_kernel_backend(backend, config)
    source, reason = prompt_lens_source(model_runner, config)
    new = SparseAttentionContext(mode, settings, kernel_backend, trials, track_sparsity, source, reason,
                                 trial_laws=trial_laws)

    problems, targets, report = [], [], SparseAttentionInstallReport(mode=mode, kernel_backend=kernel_backend)
    report.prompt_lens = source.name if source is not None else f"kernel default ({reason})"
    for name, layer in layers:
        if _disabled(name, settings):
            report.disabled.append(name)
            continue
        reasons = _unsupported(layer, layer.impl, kernel_backend, config)
        if not isinstance(layer.impl, _SPARSE_CLASSES) and _kv_cache_bound(layer) and not getattr(
            layer, BUILDER_MARK, False
        ):
            reasons.append(
                "vLLM already built this layer's KV cache and attention group with its native backend, so no step "
                "would carry a sparse plan; install right after the model loads (the worker mixin and the general "
                "plugin do) or restart the engine with this configuration"
            )
        if reasons:
            problems.append((name, reasons))
        else:
            targets.append((name, layer))
    if problems:
        raise ValueError(refusal_message(f"sparse attention cannot be installed on {len(problems)} layer(s); "
                                         "nothing was changed:", problems))

    # One context per engine: reuse (and reconfigure in place) the one the covered layers already share.
    existing = {id(s.context): s.context for _, layer in targets if (s := layer_state(layer)) is not None}
    context, unchanged_context = new, False
    if len(existing) == 1:
        context = next(iter(existing.values()))
        unchanged_context = _same_config(context, new)
        if not unchanged_context:
            for key in ("mode", "settings", "kernel_backend", "trials", "trial_laws", "track_sparsity"):
                setattr(context, key, getattr(new, key))
            context.version += 1
        if source is not None:  # a re-install without a runner keeps the prompt-length source it had
            context.prompt_lens, context.prompt_lens_reason = source, None
        report.prompt_lens = (context.prompt_lens.name if context.prompt_lens is not None
                              else f"kernel default ({context.prompt_lens_reason})")

    for name, layer in layers:
        if name in report.disabled and isinstance(layer.impl, _SPARSE_CLASSES):
            _restore_native(layer)  # the ignore list wins over an earlier install
            report.restored.append(name)
    for name, layer in targets:
        impl = layer.impl
        native = _native_impl_cls(impl)
        native_backend = _native_backend_cls(layer, native)
        report.native_impls[name] = native.__name__
        state = layer_state(layer)
        if state is not None:
            if unchanged_context and state.context is context:
                report.unchanged.append(name)
            else:
                state.context, state.records, state.phase_counts = context, [], None
                report.reconfigured.append(name)
            continue
        sparse = object.__new__(_SPARSE_BY_NATIVE[native])
        sparse.__dict__.update(impl.__dict__)
        kind = vllm_facts().kind_of_impl(native)
        state = _LayerState(
            layer_name=name,
            context=context,
            writes_in_forward=forward_writes_kv_cache(native_backend),
            kv_first=flash_attn_kv_first(native_backend, impl.head_size) if kind == "flash_attn" else None,
            isa=getattr(layer, "isa", None) if kind == "cpu_attn" else None,
        )
        state.native_backend = getattr(layer, "attn_backend", None) or native_backend
        setattr(sparse, _STATE_ATTR, state)
        layer.impl = sparse
        layer.attn_backend = SPARSE_BACKENDS[kind]
        report.installed.append(name)

    kinds = {vllm_facts().kind_of_impl(_native_impl_cls(layer.impl)) for _, layer in targets}
    if kinds - {"cpu_attn"} and native_flash_cache_write_op() is None:
        context.log_once("torch-write", "vLLM's reshape_and_cache_flash op is absent in this process; the sparse "
                         "impls write K/V into the paged cache with the torch equivalent")
    if mode == "serve" and settings is not None and context.serves_dense:
        logger.warning(
            "sparse attention: no calibrated phase in the settings; %d layer(s) carry the sparse backend but run "
            "their native dense attention (calibrate the checkpoint first)", len(targets)
        )
    if mode == "serve" and settings is not None:
        for phase in ("prefill", "decode"):
            calib = settings.phase(phase)
            note = None if calib is None else calib.describe_unreachable(phase)
            if note:
                logger.warning("sparse attention: %s", note)
    logger.info(
        "sparse attention (%s): %d layer(s) installed, %d unchanged, %d reconfigured, %d disabled (%d restored); "
        "prompt lengths: %s",
        context.describe(),
        len(report.installed),
        len(report.unchanged),
        len(report.reconfigured),
        len(report.disabled),
        len(report.restored),
        report.prompt_lens,
    )
    return report


def uninstall_sparse_attention(model_or_layers) -> list[str]:
    """Give every sparse layer back its native impl (same state) and native backend class. Returns their names.

    Metadata builders vLLM already created from the sparse backend stay (vLLM builds them once, with the KV
    cache); with no sparse layer left they build native metadata only.
    """
    restored = []
    for name, layer in _layers(model_or_layers):
        if isinstance(layer.impl, _SPARSE_CLASSES):
            _restore_native(layer)
            restored.append(name)
    return restored
