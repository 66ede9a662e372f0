"""The vLLM general-plugin entry point (`vllm.general_plugins` in pyproject.toml): `register()` runs in every vLLM
process, so plain `vllm serve <ckpt>` of a checkpoint carrying `sparse_attention_config` serves sparse with vLLM's
default options. `MODELOPT_EXT_SPARSE_ATTN=0` turns that off: dense, and the log says so.

When things happen:

1. The engine's config is created (API-server process, seconds after start, no weights): the checkpoint's
   `sparse_attention_config` is validated from `model_config.hf_config` and what the engine config already says no
   layer can run sparse is refused (plugins/vllm/checks.py); a mistake stops start-up there, one line per reason.
   A checkpoint with a block gets the plugin's worker RPCs through vLLM's `worker_extension_cls`, and the check of
   per-request targets at admission through vLLM's `logits_processors` (plugins/vllm/admission.py). An engine that
   may run sparse gets the aligned prefill scheduler through vLLM's `scheduler_cls` (plugins/vllm/aligned_scheduler.py),
   which also keys the prefix cache by each request's law (plugins/vllm/prefix_keys.py).
2. Each worker, before `load_model` loads weights: the same checks (engines created without EngineArgs).
3. After `load_model`, before vLLM allocates the KV cache: install (plugins/vllm/install.py) gives every covered
   layer the sparse backend and impl, so vLLM builds sparse metadata builders and resolves the graph mode from them.

vLLM has no extension point for 1 (after its config exists) nor for 3 (after the weights load): `register()` wraps
`EngineArgs.create_engine_config` and `Worker.load_model` (and `execute_model`, for the periodic sparsity log line);
docs/design.md lists these patches and the vLLM releases they are checked on. `unregister()` undoes them.
"""

from __future__ import annotations

import functools
import logging

from ...checkpoint.config_io import hf_config_block
from .admission import disable_admission_checks, enable_admission_checks
from .checks import check_checkpoint_config, check_engine_config
from .env import sparse_attention_enabled
from .metrics import export_to_prometheus, stop_exporting
from .worker import SparseAttnWorkerExtension, install_for_serving, maybe_log_sparsity, worker_extension_cls

logger = logging.getLogger(__name__)

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


def _patch_worker_class(cls) -> None:
    """Install after vLLM's own worker loads the model, and log realized sparsity after its steps (once per class)."""
    if _PATCHED in cls.__dict__:
        return
    original_load = cls.load_model
    original_execute = cls.execute_model

    @functools.wraps(original_load)
    def load_model(self, *args, **kwargs):
        if getattr(self, "_modelopt_ext_loading", False):  # a patched subclass calling its patched base
            return original_load(self, *args, **kwargs)
        route_logs_through_vllm()
        settings = check_checkpoint_config(self.vllm_config.model_config)  # before any weight loads
        # A worker with the plugin's RPCs (calibration tools) prepares every layer, block or not.
        prepare = isinstance(self, SparseAttnWorkerExtension) and sparse_attention_enabled()
        if settings is not None or prepare:
            check_engine_config(self.vllm_config)
        self._modelopt_ext_loading = True
        try:
            result = original_load(self, *args, **kwargs)
        finally:
            self._modelopt_ext_loading = False
        if settings is not None or prepare:
            install_for_serving(self, settings, prepare_dense=prepare)
        elif sparse_attention_enabled():
            logger.info("checkpoint has no sparse_attention_config: serving dense attention")
        return result

    @functools.wraps(original_execute)
    def execute_model(self, *args, **kwargs):
        if getattr(self, "_modelopt_ext_executing", False):  # a patched subclass calling its patched base
            return original_execute(self, *args, **kwargs)
        self._modelopt_ext_executing = True
        try:
            result = original_execute(self, *args, **kwargs)
        finally:
            self._modelopt_ext_executing = False
        maybe_log_sparsity(self)
        return result

    load_model.__modelopt_original__ = original_load
    execute_model.__modelopt_original__ = original_execute
    cls.load_model = load_model
    cls.execute_model = execute_model
    setattr(cls, _PATCHED, True)


def _unpatch_worker_class(cls) -> None:
    if _PATCHED not in cls.__dict__:
        return
    cls.load_model = cls.load_model.__modelopt_original__
    cls.execute_model = cls.execute_model.__modelopt_original__
    delattr(cls, _PATCHED)


def _carries_block(model_config) -> bool:
    """Whether the served checkpoint's config.json has a `sparse_attention_config` block (valid or not)."""
    return hf_config_block(getattr(model_config, "hf_config", None)) is not None


def _wrap_engine_config_check() -> None:
    """Check the checkpoint's block and the engine as soon as vLLM has created the engine config (process 0, no
    weights), and give an engine that will serve sparse the plugin's worker RPCs (vLLM's `worker_extension_cls`)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__dict__["create_engine_config"]
    if getattr(original, _CONFIG_CHECK, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        if getattr(config, "model_config", None) is not None:
            route_logs_through_vllm()
            settings = check_checkpoint_config(config.model_config)
            if settings is not None:
                check_engine_config(config)
            if _carries_block(config.model_config):  # the status RPC answers even with MODELOPT_EXT_SPARSE_ATTN=0
                parallel = config.parallel_config
                parallel.worker_extension_cls = worker_extension_cls(parallel.worker_extension_cls or None)
                enable_admission_checks(config, settings)  # per-request targets: refused at admission if invalid
                export_to_prometheus()  # realized sparsity on this server's /metrics (workers inherit the dir)
            _align_prefill_chunks(config, settings)
            _key_prefix_cache(config, settings)
        return config

    setattr(create_engine_config, _CONFIG_CHECK, True)
    EngineArgs.create_engine_config = create_engine_config


def _align_prefill_chunks(config, settings) -> None:
    """An engine that may run sparse or calibrate cuts prompts into calls only at multiples of 64 positions (block
    decisions, plugins/vllm/aligned_scheduler.py): its `scheduler_cls`, set here, reaches the engine-core process
    with the config, before that process builds its scheduler."""
    # Imported here, not at module level (no cycle): vLLM's plugin loader imports this module in every process,
    # workers included, and the scheduler modules import vLLM's scheduler, which only the process that creates an
    # engine config needs.
    from .scheduler_install import engine_may_run_sparse, install_aligned_scheduler

    if engine_may_run_sparse(config, settings):
        install_aligned_scheduler(config)


def _key_prefix_cache(config, settings) -> None:
    """A request served with another law than the checkpoint's reuses only cached blocks of that law
    (plugins/vllm/prefix_keys.py): the aligned scheduler keys them; an engine without it gets `KeyedScheduler`."""
    from .prefix_keys import install_prefix_keys  # imported here for the reason `_align_prefill_chunks` gives

    install_prefix_keys(config, settings)


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
    disable_admission_checks()
    stop_exporting()
