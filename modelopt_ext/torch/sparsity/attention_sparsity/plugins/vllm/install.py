"""Install / uninstall of sparse attention on a model's vLLM attention layers, with every check done up front.

    install_sparse_attention(model_or_layers, settings, *, mode="serve" | "calibrate", backend="auto",
                             calibration_scale_factors=None, track_sparsity=True, vllm_config=None,
                             model_runner=None) -> SparseAttentionInstallReport
    uninstall_sparse_attention(model_or_layers) -> list[str]

Install gives each covered layer the sparse backend of its native backend (`layer.attn_backend`, what vLLM asks
when it builds the layer's attention group, metadata builder and CUDA-graph mode; plugins/vllm/backends/) and the
sparse impl, cloned from the native impl's state. Call it after the model loads and before vLLM allocates the KV
cache (the worker glue does: plugins/vllm/worker.py); once the KV cache exists, only layers that a sparse builder
covers can be (re)configured. Every reason a layer cannot run sparse is found first (plugins/vllm/checks.py) and
reported at once, one line per reason; what is only known when vLLM builds the KV cache (the kernel block size, the
CPU ISA) is checked by the sparse builder then, at start-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...checkpoint.config_io import SparseAttentionSettings
from .backends import sparse_backend_for_impl
from .checks import (
    current_vllm_config,
    layer_problems,
    native_backend_cls,
    refusal_message,
    resolve_kernel_backend,
)
from .compat import forward_writes_kv_cache, impl_sinks
from .context import SparseAttentionContext
from .cudagraphs import check_graph_path
from .env import ENV_STRICT, strict_mode
from .impls import STATE_ATTR, LayerState, SparseImplMixin, kernel_sinks, layer_state, native_impl_cls
from .install_args import checked_mode_arguments
from .kv_cache import native_flash_cache_write_op
from .layers import (
    BUILDER_MARK,
    DENSE_REASONS_ATTR,
    IGNORED,
    UNTARGETED,
    attention_classes,
    attention_layers,
    is_ignored,
    kv_cache_bound,
    untargeted_layers,
    warn_unmatched_ignores,
)
from .prompt_lens import prompt_lens_source
from .request_stats import request_counters_source
from .request_targets import request_laws_source

logger = logging.getLogger(__name__)

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


def _same_config(context: SparseAttentionContext, other: SparseAttentionContext) -> bool:
    keys = ("mode", "settings", "kernel_backend", "trials", "trial_laws", "track_sparsity")
    return all(getattr(context, k) == getattr(other, k) for k in keys)


def _restore_native(layer) -> None:
    impl = layer.impl
    state = getattr(impl, STATE_ATTR)
    native = object.__new__(native_impl_cls(impl))
    native.__dict__.update({k: v for k, v in impl.__dict__.items() if k != STATE_ATTR})
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
    trials, trial_laws = checked_mode_arguments(mode, backend, settings, calibration_scale_factors, calibration_laws)
    layers = attention_layers(model_or_layers)
    if not layers:
        raise ValueError("no vLLM attention layers found (expected modules with an `impl`, e.g. vLLM's Attention)")
    config = current_vllm_config(vllm_config)
    kernel_backend = resolve_kernel_backend(backend, config)
    source, reason = prompt_lens_source(model_runner, config)
    laws_source, laws_reason = request_laws_source(model_runner)
    new = SparseAttentionContext(mode, settings, kernel_backend, trials, track_sparsity, source, reason,
                                 laws_source, laws_reason, request_counters_source(model_runner),
                                 trial_laws=trial_laws)
    report = SparseAttentionInstallReport(mode=mode, kernel_backend=kernel_backend)
    report.prompt_lens = source.name if source is not None else f"kernel default ({reason})"

    untargeted = untargeted_layers(settings, attention_classes(model_or_layers, layers))
    targets = _sort_layers(layers, settings, kernel_backend, config, report, untargeted)
    warn_unmatched_ignores(settings, [name for name, _ in layers])
    _keep_dense(layers, settings, report, strict_mode() if strict is None else bool(strict))
    context, unchanged = _engine_context(targets, new, source, report)
    for name, layer in layers:
        if (name in report.disabled or name in report.kept_dense) and isinstance(layer.impl, SparseImplMixin):
            _restore_native(layer)  # the ignore list (or a reason found now) wins over an earlier install
            report.restored.append(name)
    for name, layer in targets:
        _make_sparse(name, layer, context, unchanged, report)
    _log_install(context, settings, mode, targets, report)
    return report


def _sort_layers(layers, settings, kernel_backend: str, config, report, untargeted=frozenset()) -> list:
    """The layers that can run sparse; the others go to `report.disabled` (ignore list, not in `targets`) or
    `report.kept_dense`."""
    targets = []
    for name, layer in layers:
        if is_ignored(name, settings) or name in untargeted:
            report.disabled.append(name)
            report.disabled_why[name] = IGNORED if is_ignored(name, settings) else UNTARGETED
            continue
        reasons = layer_problems(layer, layer.impl, kernel_backend, config)
        # Only for a layer that could otherwise run sparse: one kept dense for its own reasons at load time keeps
        # just those when the engine is reconfigured (sparse_attn_serve / enable_calibration).
        if not reasons and not isinstance(layer.impl, SparseImplMixin) and kv_cache_bound(layer) and not getattr(
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
    native = native_impl_cls(impl)
    native_backend = native_backend_cls(layer, native)
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
    backend = sparse_backend_for_impl(native)
    sparse_impl = backend.get_impl_cls()
    sparse = object.__new__(sparse_impl)
    sparse.__dict__.update(impl.__dict__)
    state = LayerState(
        layer_name=name,
        context=context,
        writes_in_forward=forward_writes_kv_cache(native_backend),
        softcap=float(getattr(impl, "logits_soft_cap", None) or 0.0),
        sinks=kernel_sinks(impl_sinks(impl)),
        **sparse_impl.cache_facts(layer, impl, native_backend),
    )
    state.native_backend = getattr(layer, "attn_backend", None) or native_backend
    setattr(sparse, STATE_ATTR, state)
    layer.impl = sparse
    layer.attn_backend = backend
    report.installed.append(name)


def _log_install(context: SparseAttentionContext, settings, mode: str, targets, report) -> None:
    flash_writers = any(layer.impl.writes_with_flash_cache_op for _, layer in targets)
    if flash_writers and native_flash_cache_write_op() is None:
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
    for name, layer in attention_layers(model_or_layers):
        if isinstance(layer.impl, SparseImplMixin):
            _restore_native(layer)
            restored.append(name)
    return restored
