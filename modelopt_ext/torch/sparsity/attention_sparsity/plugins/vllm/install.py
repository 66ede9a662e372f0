"""Install / uninstall of sparse attention on a model's vLLM attention layers, with every check done up front.

    install_sparse_attention(model_or_layers, settings, *, mode="serve" | "calibrate", backend="auto",
                             calibration_scale_factors=None, track_sparsity=True, vllm_config=None,
                             model_runner=None) -> SparseAttentionInstallReport
    uninstall_sparse_attention(model_or_layers) -> list[str]

Install gives each covered layer the sparse backend of its native backend (`layer.attn_backend`, what vLLM asks
when it builds the layer's attention group, metadata builder and CUDA-graph mode; plugins/vllm/backends.py) and the
sparse impl, cloned from the native impl's state. Call it after the model loads and before vLLM allocates the KV
cache (the worker glue does: plugins/vllm/worker.py); once the KV cache exists, only layers that a sparse builder
covers can be (re)configured.

Every reason a layer cannot run sparse is found (plugins/vllm/checks.py) before anything changes, and reported in one
ValueError, one line per reason:
unsupported attention features (sliding window, ALiBi, encoder/cross attention, MLA, DCP,
quantized KV cache, V head size != K head size), head sizes / dtypes / page sizes the chosen kernel does not cover,
an unmeasured CPU ISA, a cache layout the views do not know, and a layer whose metadata builder is vLLM's native one.
What is only known when vLLM builds the KV cache (the kernel block size, the CPU ISA) is checked by the sparse
builder then, at start-up. The sparse impls never fuse output quantization (`fused_output_quant_supported` is
False), so no forward ever meets an output scale.
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
import math
from dataclasses import dataclass, field

import torch

from ...checkpoint.config_io import SparseAttentionSettings
from .backends import BUILDER_MARK, SPARSE_BACKENDS
from .checks import (
    KERNEL_BACKENDS,
    _current_vllm_config,
    _native_backend_cls,
    _native_impl_cls,
    _unsupported,
    refusal_message,
    resolve_kernel_backend,
)
from .compat import (
    flash_attn_kv_first,
    forward_writes_kv_cache,
    impl_sinks,
    vllm_facts,
)
from .context import MODES, SparseAttentionContext
from .cudagraphs import check_graph_path
from .env import ENV_STRICT, strict_mode
from .impls import _SPARSE_BY_NATIVE, _SPARSE_CLASSES, _STATE_ATTR, _LayerState, kernel_sinks, layer_state
from .kv_cache import native_flash_cache_write_op
from .prompt_lens import prompt_lens_source
from .request_stats import request_counters_source
from .request_targets import request_laws_source

logger = logging.getLogger(__name__)

DENSE_REASONS_ATTR = "_modelopt_dense_reasons"
IGNORED = "kept dense by the checkpoint's ignore list"
UNTARGETED = "kept dense: its attention class is not in the checkpoint's targets"
"""Set on a vLLM attention layer that runs dense on its own backend: why (what `sparse_attn_status` reports)."""


@dataclass
class SparseAttentionInstallReport:
    """What `install_sparse_attention` did: layer names by outcome, and the engine-wide choices."""

    mode: str
    installed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)  # already sparse with the same configuration
    reconfigured: list[str] = field(default_factory=list)  # already sparse, settings/mode replaced
    disabled: list[str] = field(default_factory=list)  # ignore list or not in targets: native impl and backend
    disabled_why: dict[str, str] = field(default_factory=dict)  # of `disabled`: which of the two
    restored: list[str] = field(default_factory=list)  # of `disabled`: were sparse, got their native impl back
    native_impls: dict[str, str] = field(default_factory=dict)  # covered layers -> native impl class name
    kept_dense: dict[str, list[str]] = field(default_factory=dict)  # layers that cannot run sparse -> the reasons
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


def _attention_classes(model_or_layers, layers) -> dict[str, set[str]]:
    """Per layer name, the class names `targets` may list: the layer's own (vLLM's `Attention`) and, when a model is
    given, its parent module's (vLLM's model attention class, e.g. `LlamaAttention`, usually named as in
    transformers)."""
    # A layer's class and its bases up to vLLM's `Attention`: the default target `Attention` covers the subclasses
    # vLLM gives some layers (`ChunkedLocalAttention`, ...); whether those can run sparse is decided on their own.
    classes = {name: {c.__name__ for c in type(layer).__mro__ if c.__module__.startswith("vllm")} or
               {type(layer).__name__} for name, layer in layers}  # fmt: skip
    if isinstance(model_or_layers, torch.nn.Module) and not _is_attention_layer(model_or_layers):
        for path, module in model_or_layers.named_modules():
            if _is_attention_layer(module) and "." in path:
                parent = model_or_layers.get_submodule(path.rsplit(".", 1)[0])
                classes.setdefault(getattr(module, "layer_name", None) or path, set()).add(type(parent).__name__)
    return classes


def _untargeted(settings: SparseAttentionSettings | None, classes: dict[str, set[str]]) -> set[str]:
    """Layers whose classes the checkpoint's `targets` do not list: served dense, like the ignore list.

    Targets that name no class of this vLLM model (transformers and vLLM name some attention classes differently,
    e.g. vLLM serves Mistral with its Llama classes) are not applied, with a warning: a checkpoint never goes dense
    silently because of a class name.
    """
    wanted = set(settings.attention_classes or ()) if settings is not None else set()
    if not wanted:
        return set()
    present = set().union(*classes.values()) if classes else set()
    if not wanted & present:
        logger.warning(
            "sparse attention: targets %s name no attention class of this vLLM model (its classes: %s), so targets "
            "is not applied: every attention layer goes sparse unless ignored. Write this model's class names into "
            "targets to restrict which layers go sparse", sorted(wanted), ", ".join(sorted(present)) or "-",
        )  # fmt: skip
        return set()
    return {name for name, names in classes.items() if not wanted & names}


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
    return any(_ignore_matches(name, p) for p in patterns)


def _ignore_matches(name: str, pattern: str) -> bool:
    return (name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern)
            or fnmatch.fnmatchcase(name, pattern + ".*"))  # fmt: skip


def _warn_unmatched_ignores(settings: SparseAttentionSettings | None, names: list[str]) -> None:
    """An `ignore` pattern that matches no vLLM layer would leave the layer it meant sparse: say so, with the
    nearest vLLM layer names (HF-style names match vLLM's by prefix; other spellings do not)."""
    for pattern in settings.disabled_layers if settings is not None else ():
        if not any(_ignore_matches(name, pattern) for name in names):
            near = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
            logger.warning("sparse attention: ignore pattern %r matches no attention layer of this engine, so "
                           "nothing is kept dense for it; nearest vLLM layer names: %s", pattern,
                           ", ".join(near) or "-")  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Validation


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
    strict: bool | None = None,
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
            (plugins/vllm/prompt_lens.py). Without it the kernel's default rule applies.

        strict: True: a layer that cannot run sparse is an error (one ValueError lists every offending layer,
            one line per reason, and nothing changes); False: such layers are kept dense on vLLM's own backend and
            impl, unchanged, with one log line per reason (`report.kept_dense`). Default:
            MODELOPT_EXT_SPARSE_ATTN_STRICT.

    Every layer is validated before any is changed. Installing
    again with the same arguments changes nothing; with other settings or mode it reconfigures the engine's
    sparse layers in place (records and counters are kept only when nothing changed).
    """
    trials, trial_laws = _checked_mode(mode, backend, settings, calibration_scale_factors, calibration_laws)
    layers = _layers(model_or_layers)
    if not layers:
        raise ValueError("no vLLM attention layers found (expected modules with an `impl`, e.g. vLLM's Attention)")
    config = _current_vllm_config(vllm_config)
    kernel_backend = resolve_kernel_backend(backend, config)
    source, reason = prompt_lens_source(model_runner, config)
    laws_source, laws_reason = request_laws_source(model_runner)
    new = SparseAttentionContext(mode, settings, kernel_backend, trials, track_sparsity, source, reason,
                                 laws_source, laws_reason, request_counters_source(model_runner),
                                 trial_laws=trial_laws)
    report = SparseAttentionInstallReport(mode=mode, kernel_backend=kernel_backend)
    report.prompt_lens = source.name if source is not None else f"kernel default ({reason})"

    untargeted = _untargeted(settings, _attention_classes(model_or_layers, layers))
    targets = _sort_layers(layers, settings, kernel_backend, config, report, untargeted)
    _warn_unmatched_ignores(settings, [name for name, _ in layers])
    _keep_dense(layers, settings, report, strict_mode() if strict is None else bool(strict))
    context, unchanged = _engine_context(targets, new, source, report)
    for name, layer in layers:
        if (name in report.disabled or name in report.kept_dense) and isinstance(layer.impl, _SPARSE_CLASSES):
            _restore_native(layer)  # the ignore list (or a reason found now) wins over an earlier install
            report.restored.append(name)
    for name, layer in targets:
        _make_sparse(name, layer, context, unchanged, report)
    _log_install(context, settings, mode, targets, report)
    return report


def _checked_mode(mode, backend, settings, calibration_scale_factors, calibration_laws):
    """(trials, trial_laws) of a valid call: the mode's arguments checked before anything else."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if settings is not None and not isinstance(settings, SparseAttentionSettings):
        raise TypeError(f"settings must be a SparseAttentionSettings or None, got {type(settings).__name__}")
    if mode != "calibrate":
        if calibration_scale_factors or calibration_laws:
            raise ValueError("calibration_scale_factors / calibration_laws are only used with mode='calibrate'")
        return (), None
    if bool(calibration_scale_factors) == bool(calibration_laws):
        raise ValueError("mode='calibrate' needs exactly one of calibration_scale_factors (threshold trials as "
                         "scale factors) and calibration_laws")
    if calibration_laws:
        trial_laws = _check_trial_laws(calibration_laws)
        return tuple(float(i) for i in range(len(trial_laws))), trial_laws
    trials = tuple(float(s) for s in calibration_scale_factors)
    if any(not (s > 0 and math.isfinite(s)) for s in trials):
        raise ValueError(f"calibration_scale_factors must be finite and positive, got {trials}")
    return trials, None


def _sort_layers(layers, settings, kernel_backend: str, config, report, untargeted=frozenset()) -> list:
    """The layers that can run sparse; the others go to `report.disabled` (ignore list, not in `targets`) or
    `report.kept_dense`."""
    targets = []
    for name, layer in layers:
        if _disabled(name, settings) or name in untargeted:
            report.disabled.append(name)
            report.disabled_why[name] = IGNORED if _disabled(name, settings) else UNTARGETED
            continue
        reasons = _unsupported(layer, layer.impl, kernel_backend, config)
        # Only for a layer that could otherwise run sparse: one kept dense for its own reasons at load time keeps
        # just those when the engine is reconfigured (sparse_attn_serve / enable_calibration).
        if not reasons and not isinstance(layer.impl, _SPARSE_CLASSES) and _kv_cache_bound(layer) and not getattr(
            layer, BUILDER_MARK, False
        ):
            reasons.append(
                "vLLM already built this layer's KV cache and attention group with its native backend, so no step "
                "would carry a sparse plan; install right after the model loads (the worker mixin and the general "
                "plugin do) or restart the engine with this configuration"
            )
        if reasons:
            report.kept_dense[name] = reasons
        else:
            targets.append((name, layer))
    return targets


def _keep_dense(layers, settings, report, strict: bool) -> None:
    """Strict: refuse every layer that cannot run sparse (nothing changed). Else say why, one line per reason, and
    mark each dense layer with its reasons (what `sparse_attn_status` reports)."""
    problems = list(report.kept_dense.items())
    if problems and strict:
        raise ValueError(refusal_message(f"sparse attention cannot be installed on {len(problems)} layer(s); "
                                         "nothing was changed:", problems))
    if problems:
        logger.warning(refusal_message(
            f"sparse attention: {len(problems)} of {len(layers)} attention layer(s) kept dense on vLLM's own backend "
            f"({ENV_STRICT}=1 makes this an error):", problems))
        if len(problems) + len(report.disabled) == len(layers):
            logger.warning("sparse attention: no attention layer of this model can run sparse; serving dense")
    for name, layer in layers:
        if name in report.disabled:
            setattr(layer, DENSE_REASONS_ATTR, (report.disabled_why.get(name, IGNORED),))
        elif name in report.kept_dense:
            setattr(layer, DENSE_REASONS_ATTR, tuple(report.kept_dense[name]))
        elif hasattr(layer, DENSE_REASONS_ATTR):
            delattr(layer, DENSE_REASONS_ATTR)


def _engine_context(targets, new: SparseAttentionContext, source, report):
    """(context, unchanged): one context per engine; the one the covered layers already share is reused, and
    reconfigured in place when the new call differs (its version bumps, so the builders re-plan the law)."""
    existing = {id(s.context): s.context for _, layer in targets if (s := layer_state(layer)) is not None}
    if len(existing) != 1:
        return new, False
    context = next(iter(existing.values()))
    unchanged = _same_config(context, new)
    if not unchanged:
        check_graph_path(context, new)
        for key in ("mode", "settings", "kernel_backend", "trials", "trial_laws", "track_sparsity"):
            setattr(context, key, getattr(new, key))
        context.version += 1
    if source is not None:  # a re-install without a runner keeps the prompt-length source it had
        context.prompt_lens, context.prompt_lens_reason = source, None
    if new.request_laws is not None:  # and the per-request law source and counters
        context.request_laws, context.request_laws_reason = new.request_laws, None
    if context.request_counters is None:
        context.request_counters = new.request_counters
    report.prompt_lens = (context.prompt_lens.name if context.prompt_lens is not None
                          else f"kernel default ({context.prompt_lens_reason})")
    return context, unchanged


def _make_sparse(name: str, layer, context: SparseAttentionContext, unchanged: bool, report) -> None:
    """Give one layer the sparse impl (cloned from the native one's state) and backend, or reconfigure it."""
    impl = layer.impl
    native = _native_impl_cls(impl)
    native_backend = _native_backend_cls(layer, native)
    report.native_impls[name] = native.__name__
    state = layer_state(layer)
    if state is not None:
        if unchanged and state.context is context:
            report.unchanged.append(name)
        else:
            state.context, state.records = context, []
            if state.phase_counts is not None:  # zeroed in place: a captured decode graph adds into this tensor
                with torch.inference_mode():  # vLLM's forward created it under inference mode
                    state.phase_counts.zero_()
            report.reconfigured.append(name)
        return
    sparse = object.__new__(_SPARSE_BY_NATIVE[native])
    sparse.__dict__.update(impl.__dict__)
    kind = vllm_facts().kind_of_impl(native)
    state = _LayerState(
        layer_name=name,
        context=context,
        writes_in_forward=forward_writes_kv_cache(native_backend),
        kv_first=flash_attn_kv_first(native_backend, impl.head_size) if kind == "flash_attn" else None,
        isa=getattr(layer, "isa", None) if kind == "cpu_attn" else None,
        softcap=float(getattr(impl, "logits_soft_cap", None) or 0.0),
        sinks=kernel_sinks(impl_sinks(impl)),
    )
    state.native_backend = getattr(layer, "attn_backend", None) or native_backend
    setattr(sparse, _STATE_ATTR, state)
    layer.impl = sparse
    layer.attn_backend = SPARSE_BACKENDS[kind]
    report.installed.append(name)


def _log_install(context: SparseAttentionContext, settings, mode: str, targets, report) -> None:
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
        "sparse attention (%s): %d layer(s) installed, %d unchanged, %d reconfigured, %d disabled, %d kept dense "
        "(%d restored); prompt lengths: %s",
        context.describe(), len(report.installed), len(report.unchanged), len(report.reconfigured),
        len(report.disabled), len(report.kept_dense), len(report.restored), report.prompt_lens,
    )  # fmt: skip


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
