"""Worker-side glue for vLLM: install sparse attention after the model loads, answer RPCs, log sparsity.

Two ways in, one implementation:

- `SparseAttnWorkerMixin`, mixed into vLLM's GPU or CPU worker class (see examples/vllm_serve/sparse_attn_worker.py)
  and passed as `worker_cls`; its methods are reachable through `LLM.collective_rpc("sparse_attn_...")`.
- `register()`, the vLLM general-plugin entry point (`vllm.general_plugins`): it adds the same behaviour to vLLM's
  own `Worker` class, so plain `vllm serve <ckpt>` of a checkpoint carrying `sparse_attention_config` serves sparse,
  with vLLM's default options (the sparse builders declare their CUDA-graph support; vLLM picks the mode).
  `MODELOPT_EXT_SPARSE_ATTN=0` turns that off: dense, and the log says so.

When things happen:

1. The engine's config is created (API-server process, seconds after start, no weights): the checkpoint's
   `sparse_attention_config` is validated from `model_config.hf_config`; a malformed block stops start-up there,
   its field named on the last line of the output (`check_checkpoint_config`, run by a wrapper of
   `EngineArgs.create_engine_config` that `register()` adds and `unregister()` removes).
2. Each worker, before `load_model` loads weights: the same check (engines created without EngineArgs).
3. After `load_model`, before vLLM allocates the KV cache: install (plugins/vllm_install.py) gives every covered
   layer the sparse backend and impl, so vLLM builds sparse metadata builders and resolves the graph mode from them.

vLLM has no public post-load hook for workers, so both ways in wrap `Worker.load_model` (and `execute_model` for
the periodic sparsity log line).
"""

from __future__ import annotations

import functools
import logging
import os

from .sparse_attn_config import (
    SparseAttentionConfigError,
    SparseAttentionSettings,
    parse_sparse_attention_config,
    settings_from_hf_config,
)

logger = logging.getLogger(__name__)

ENV_ENABLE = "MODELOPT_EXT_SPARSE_ATTN"
ENV_LOG_EVERY = "MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY"
ENV_BACKEND = "MODELOPT_EXT_SPARSE_ATTN_BACKEND"
DEFAULT_LOG_EVERY = 256
_PATCHED = "_modelopt_ext_patched"
_CONFIG_CHECK = "_modelopt_ext_config_check"


def route_logs_through_vllm() -> None:
    """Show this package's log lines in vLLM's processes, with vLLM's handlers, format and level.

    vLLM configures only its own `vllm` logger; without this, our INFO lines (which layers run sparse, the
    periodic realized sparsity) would be dropped in worker processes. Leaves any user-configured handler alone.
    """
    ours = logging.getLogger("modelopt_ext")
    vllm_logger = logging.getLogger("vllm")
    if ours.handlers or not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm_logger.level or logging.INFO)
    ours.propagate = False


def sparse_attention_enabled() -> bool:
    """False when the user switched the plugin off with MODELOPT_EXT_SPARSE_ATTN=0 (or false/off/no)."""
    return os.environ.get(ENV_ENABLE, "1").strip().lower() not in ("0", "false", "off", "no")


def _kernel_backend() -> str:
    return os.environ.get(ENV_BACKEND, "auto")


def _log_every() -> int:
    try:
        return max(0, int(os.environ.get(ENV_LOG_EVERY, DEFAULT_LOG_EVERY)))
    except ValueError:
        return DEFAULT_LOG_EVERY


def worker_model(worker):
    """The nn.Module a vLLM worker runs (GPU and CPU runners, model runner V1 and V2)."""
    runner = worker.model_runner
    get_model = getattr(runner, "get_model", None)
    return get_model() if callable(get_model) else runner.model


def checkpoint_settings(worker) -> SparseAttentionSettings | None:
    """The checkpoint's `sparse_attention_config` as settings (None: the checkpoint carries none)."""
    return settings_from_hf_config(worker.vllm_config.model_config.hf_config)


def check_checkpoint_config(model_config) -> SparseAttentionSettings | None:
    """Validate the served checkpoint's `sparse_attention_config` (from the already loaded hf_config).

    Returns the settings (None: no block, or MODELOPT_EXT_SPARSE_ATTN=0). A malformed block raises
    SparseAttentionConfigError with a one-line message that starts with the offending field.
    """
    model = getattr(model_config, "model", "?")
    if not sparse_attention_enabled():
        logger.info("%s=0: serving %s with dense attention (sparse_attention_config not applied)", ENV_ENABLE, model)
        return None
    try:
        return settings_from_hf_config(model_config.hf_config)
    except SparseAttentionConfigError as exc:
        raise SparseAttentionConfigError(
            f"{exc} [in {model}/config.json: fix the block (or re-run calibrate_sparse_attn.py "
            f"--update_checkpoint_config), or set {ENV_ENABLE}=0 to serve dense]"
        ) from None


def check_engine_config(vllm_config) -> None:
    """Refuse, before any weight loads, what the engine config already says no layer can run sparse (e.g. a CPU
    attention ISA whose cache layout the kernels do not read). One line per reason; the fix on each line."""
    from .vllm_install import predicted_startup_problems

    problems = predicted_startup_problems(vllm_config)
    if problems:
        model = getattr(getattr(vllm_config, "model_config", None), "model", "?")
        raise ValueError("\n".join([f"sparse attention cannot serve {model} on this engine:",
                                    *(f"  every attention layer: {p}; or set {ENV_ENABLE}=0 to serve dense"
                                      for p in problems)]))


def summarize_stats(stats: dict) -> dict:
    """Sum per-layer (visited, skipped) tile counts into per-phase totals and realized sparsity."""
    totals = {}
    for phase in ("prefill", "decode"):
        visited = sum(layer[phase]["visited"] for layer in stats.values())
        skipped = sum(layer[phase]["skipped"] for layer in stats.values())
        totals[phase] = {
            "visited": visited,
            "skipped": skipped,
            "sparsity": (skipped / visited) if visited else None,
        }
    return totals


def install_for_serving(worker, settings: SparseAttentionSettings | None = None, *, prepare_dense: bool = False):
    """Install serve-mode sparse attention from `settings` or the checkpoint; None when there is nothing to do.

    `prepare_dense`: also install when the checkpoint carries no config (every layer then runs its native forward
    on the sparse backend, so a later calibration or serve RPC on this engine can switch it on).
    """
    from . import vllm as vllm_plugin

    if settings is None:
        settings = checkpoint_settings(worker)
    if settings is None and not prepare_dense:
        logger.info("checkpoint has no sparse_attention_config: serving dense attention")
        return None
    report = vllm_plugin.install_sparse_attention(
        worker_model(worker),
        settings,
        mode="serve",
        backend=_kernel_backend(),
        vllm_config=worker.vllm_config,
        model_runner=getattr(worker, "model_runner", None),
    )
    if settings is None:
        logger.info("checkpoint has no sparse_attention_config: serving dense attention (%d layer(s) prepared for "
                    "calibration)", len(report.sparse))
        return report
    backends = sorted(set(report.native_impls.values()))
    logger.info(
        "sparse attention serving on %d layer(s) (native impls: %s; %d kept dense); prefill %s, decode %s; "
        "prompt lengths: %s",
        len(report.sparse),
        ", ".join(backends) or "-",
        len(report.disabled),
        _describe_phase(settings.prefill),
        _describe_phase(settings.decode),
        report.prompt_lens,
    )
    return report


def _describe_phase(calib) -> str:
    if calib is None:
        return "dense"
    return f"target {calib.target_sparsity:.2f} (scale factor {calib.scale_factor:.4g})"


class SparseAttnWorkerMixin:
    """Sparse attention for a vLLM worker: installed after `load_model`; RPC methods for calibration and status."""

    _sparse_attn_steps = 0

    def load_model(self, *args, **kwargs):
        route_logs_through_vllm()
        settings = check_checkpoint_config(self.vllm_config.model_config)  # before any weight loads
        if sparse_attention_enabled():
            check_engine_config(self.vllm_config)
        result = super().load_model(*args, **kwargs)
        if sparse_attention_enabled():
            install_for_serving(self, settings, prepare_dense=True)
        return result

    def execute_model(self, *args, **kwargs):
        result = super().execute_model(*args, **kwargs)
        _maybe_log_sparsity(self)
        return result

    # ---- RPCs (LLM.collective_rpc("<name>", args=...)); arguments and results are plain data ----

    def sparse_attn_enable_calibration(self, scale_factors, backend: str | None = None, laws=None) -> dict:
        """Switch every attention layer to calibration mode (dense output, counts per scale-factor trial, or with
        `laws` = [(c_prefill, c_decode, γ_prefill, γ_decode), ...] and `scale_factors` None, per served law).

        Takes and returns plain data (it crosses vLLM's RPC transports): the layer count and the native impls.
        """
        from . import vllm as vllm_plugin

        trials = None if scale_factors is None else [float(s) for s in scale_factors]
        settings = checkpoint_settings(self)
        report = vllm_plugin.install_sparse_attention(
            worker_model(self),
            settings,
            mode="calibrate",
            backend=backend or _kernel_backend(),
            calibration_scale_factors=trials,
            calibration_laws=None if laws is None else [list(law) for law in laws],
            vllm_config=self.vllm_config,
        )
        vllm_plugin.collect_calibration_records(worker_model(self), reset=True)
        return {"layers": len(report.native_impls), "native_impls": sorted(set(report.native_impls.values()))}

    def sparse_attn_collect_counts(self, reset: bool = True) -> list[dict]:
        """This rank's calibration records, one per layer, in their wire form: plain Python lists and numbers
        (`encode_record`), so they cross every vLLM process boundary (msgpack, pickle, Ray, JSON) unchanged;
        `merge_calibration_records` decodes them (plugins/vllm_calibration_records.py)."""
        from . import vllm as vllm_plugin
        from .vllm_calibration_records import encode_record

        return [encode_record(r) for r in vllm_plugin.collect_calibration_records(worker_model(self), reset=reset)]

    def sparse_attn_serve(self, config_block: dict | None = None) -> dict:
        """(Re)install serve mode from a `sparse_attention_config` block, or from the checkpoint when None."""
        settings = parse_sparse_attention_config(config_block) if config_block is not None else None
        report = install_for_serving(self, settings)
        return {"layers": 0 if report is None else len(report.native_impls)}

    def sparse_attn_status(self) -> dict:
        """Which layers run sparse, on which native backend, in which mode, and the realized sparsity per phase."""
        from . import vllm as vllm_plugin

        model = worker_model(self)
        layers = {}
        for name, layer in vllm_plugin._layers(model):
            layers[name] = {"impl": type(layer.impl).__name__, "sparse": vllm_plugin.is_sparse_layer(layer)}
        stats = vllm_plugin.get_sparsity_stats(model)
        return {
            "enabled": sparse_attention_enabled(),
            "layers": layers,
            "sparse_layers": sum(1 for v in layers.values() if v["sparse"]),
            "realized": summarize_stats(stats),
        }

    def sparse_attn_reset_stats(self) -> None:
        from . import vllm as vllm_plugin

        vllm_plugin.reset_sparsity_stats(worker_model(self))


def _maybe_log_sparsity(worker) -> None:
    every = _log_every()
    if not every:
        return
    worker._sparse_attn_steps = getattr(worker, "_sparse_attn_steps", 0) + 1
    if worker._sparse_attn_steps % every:
        return
    from . import vllm as vllm_plugin

    totals = summarize_stats(vllm_plugin.get_sparsity_stats(worker_model(worker)))
    if any(t["visited"] for t in totals.values()):
        logger.info(
            "sparse attention after %d steps: realized sparsity prefill %s, decode %s",
            worker._sparse_attn_steps,
            _fmt(totals["prefill"]["sparsity"]),
            _fmt(totals["decode"]["sparsity"]),
        )


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _patch_worker_class(cls) -> None:
    """Give vLLM's own worker class the mixin's behaviour (general-plugin path), once."""
    if _PATCHED in cls.__dict__:
        return
    original_load = cls.load_model
    original_execute = cls.execute_model

    @functools.wraps(original_load)
    def load_model(self, *args, **kwargs):
        # The mixin does this itself; a patched subclass calling a patched base must do it once.
        if isinstance(self, SparseAttnWorkerMixin) or getattr(self, "_modelopt_ext_loading", False):
            return original_load(self, *args, **kwargs)
        route_logs_through_vllm()
        settings = check_checkpoint_config(self.vllm_config.model_config)  # before any weight loads
        if settings is not None:
            check_engine_config(self.vllm_config)
        self._modelopt_ext_loading = True
        try:
            result = original_load(self, *args, **kwargs)
        finally:
            self._modelopt_ext_loading = False
        if settings is not None:
            install_for_serving(self, settings)
        elif sparse_attention_enabled():
            logger.info("checkpoint has no sparse_attention_config: serving dense attention")
        return result

    @functools.wraps(original_execute)
    def execute_model(self, *args, **kwargs):
        result = original_execute(self, *args, **kwargs)
        if not isinstance(self, SparseAttnWorkerMixin):
            _maybe_log_sparsity(self)
        return result

    load_model.__modelopt_original__ = original_load
    execute_model.__modelopt_original__ = original_execute
    cls.load_model = load_model
    cls.execute_model = execute_model
    added = []
    for name in (
        "sparse_attn_status",
        "sparse_attn_reset_stats",
        "sparse_attn_serve",
        "sparse_attn_collect_counts",
        "sparse_attn_enable_calibration",
    ):
        if not hasattr(cls, name):
            setattr(cls, name, getattr(SparseAttnWorkerMixin, name))
            added.append(name)
    setattr(cls, _PATCHED, tuple(added))


def _unpatch_worker_class(cls) -> None:
    added = cls.__dict__.get(_PATCHED)
    if added is None:
        return
    cls.load_model = cls.load_model.__modelopt_original__
    cls.execute_model = cls.execute_model.__modelopt_original__
    for name in added:
        delattr(cls, name)
    delattr(cls, _PATCHED)


def _wrap_engine_config_check() -> None:
    """Validate the checkpoint's block as soon as vLLM has created the engine config (process 0, no weights)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__dict__["create_engine_config"]
    if getattr(original, _CONFIG_CHECK, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if getattr(config, "model_config", None) is not None:
            route_logs_through_vllm()
            if check_checkpoint_config(config.model_config) is not None:
                check_engine_config(config)
        return config

    setattr(create_engine_config, _CONFIG_CHECK, True)
    EngineArgs.create_engine_config = create_engine_config


def _worker_classes() -> list:
    classes = []
    try:
        from vllm.v1.worker.gpu_worker import Worker

        classes.append(Worker)
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        logger.warning("modelopt-ext: cannot patch vLLM's Worker (%s); sparse attention needs --worker-cls", exc)
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker
    except Exception:  # CPU worker absent or not importable on this build
        CPUWorker = None
    if CPUWorker is not None and ("execute_model" in CPUWorker.__dict__ or "load_model" in CPUWorker.__dict__):
        classes.append(CPUWorker)
    return classes


def register() -> None:
    """vLLM general-plugin entry point (every vLLM process): check configs early, install after load_model.

    The patches are always applied; MODELOPT_EXT_SPARSE_ATTN is read when each engine starts.
    """
    try:
        _wrap_engine_config_check()
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        logger.warning("modelopt-ext: no early sparse_attention_config check (%s); workers still check it", exc)
    for cls in _worker_classes():
        _patch_worker_class(cls)


def unregister() -> None:
    """Undo `register()` (tests; a process that wants vLLM untouched again)."""
    from vllm.engine.arg_utils import EngineArgs

    current = EngineArgs.__dict__.get("create_engine_config")
    if getattr(current, _CONFIG_CHECK, False):
        EngineArgs.create_engine_config = current.__wrapped__
    for cls in _worker_classes():
        _unpatch_worker_class(cls)
