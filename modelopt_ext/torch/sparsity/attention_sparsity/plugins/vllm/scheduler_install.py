"""Installing the aligned prefill scheduler into an engine config, before vLLM starts the engine core: which
scheduler class the engine gets, or whole prompts where this vLLM has no hook (docs/serving.md, "Aligned prefill
chunks for block decisions").

vLLM's public extension point is `SchedulerConfig.scheduler_cls`. `install_aligned_scheduler(vllm_config)` sets it
(the plugin does when vLLM creates the engine config of an engine that may run sparse: `engine_may_run_sparse`;
plugins/vllm/entry.py) to the engine's own scheduler class with `AlignedPrefillMixin` in front
(plugins/vllm/aligned_scheduler.py), composed with a scheduler class the user named. This is config work (no
scheduler runs here), so it lives apart from the classes it names.

Where a release offers neither hook, `install_aligned_scheduler` serves prompts whole instead (chunked prefill and
prefix caching off, as vLLM's CPU platform does for MLA), with a warning naming the reason.
`MODELOPT_EXT_SPARSE_ATTN_ALIGN_PREFILL=0` leaves vLLM's scheduler alone (block decisions may then depend on the
chunking; logged); the prefix-cache keys then come with `prefix_keys.KeyedScheduler` (plugins/vllm/prefix_keys.py).
"""

from __future__ import annotations

import logging

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .aligned_scheduler import (
    AlignedAsyncScheduler,
    AlignedPrefillMixin,
    AlignedScheduler,
    class_qualname,
    composed_scheduler_class,
    composed_scheduler_name,
    import_by_qualname,
)
from .env import env_flag
from .prefill_alignment import ALIGN
from .scheduler_hooks import SPLIT_HOOK, scheduler_hooks

logger = logging.getLogger(__name__)

ENV_ALIGN = "MODELOPT_EXT_SPARSE_ATTN_ALIGN_PREFILL"


def _resolve(scheduler_cls):
    if not isinstance(scheduler_cls, str):
        return scheduler_cls
    try:
        return import_by_qualname(scheduler_cls)
    except Exception as exc:  # noqa: BLE001 - any failure to import the user's class is the same mistake
        raise ValueError(f"scheduler_cls {scheduler_cls!r} cannot be imported ({type(exc).__name__}: {exc}); the "
                         "sparse-attention plugin composes its aligned scheduler with it") from exc  # fmt: skip


def _whole_prompts(vllm_config, why: str) -> str:
    """The fallback where no scheduler hook exists: every prompt in one call (no chunked prefill, no prefix cache),
    the way vLLM's CPU platform serves MLA."""
    scheduler, cache, model = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
    scheduler.enable_chunked_prefill = False
    scheduler.long_prefill_token_threshold = 0
    cache.enable_prefix_caching = False
    if model is not None:
        scheduler.max_num_batched_tokens = max(int(scheduler.max_num_batched_tokens), int(model.max_model_len))
    logger.warning(
        "aligned prefill chunks: %s; serving every prompt in one call instead (chunked prefill and prefix caching "
        "off, max_num_batched_tokens=%d) so that no block of %d prompt positions is split across calls",
        why, scheduler.max_num_batched_tokens, ALIGN,
    )  # fmt: skip
    return "whole prompts"


def _check_budget(scheduler_config) -> None:
    budget = int(scheduler_config.max_num_batched_tokens)
    threshold = int(getattr(scheduler_config, "long_prefill_token_threshold", 0) or 0)
    chunked = bool(getattr(scheduler_config, "enable_chunked_prefill", True))
    if chunked and (budget < ALIGN or 0 < threshold < ALIGN):
        raise ValueError(
            f"max_num_batched_tokens={budget}, long_prefill_token_threshold={threshold}: sparse attention cuts "
            f"prompts into chunks of multiples of {ALIGN} positions; set --max-num-batched-tokens and "
            f"--long-prefill-token-threshold (or 0) to at least {ALIGN}, or serve dense (MODELOPT_EXT_SPARSE_ATTN=0)")


def install_aligned_scheduler(vllm_config) -> str:
    """Make the engine of `vllm_config` cut prefill chunks and prefix-cache hits at multiples of `ALIGN`: set
    `scheduler_config.scheduler_cls` (composed with the class it would use), or fall back to whole prompts where
    this vLLM has no hook. Returns what it did, in words (also logged). Call it before vLLM starts the engine core
    (it reads `scheduler_cls` there): the config, with the class's name, is what the engine-core process gets.

    A `scheduler_cls` the user set is composed with, never replaced; one that is not a subclass of vLLM's
    `Scheduler` is refused (ValueError naming the fix)."""
    if not env_flag(ENV_ALIGN):
        logger.warning("aligned prefill chunks: off (%s=0): vLLM cuts prompts where its budget ends, so the block "
                       "decisions of prompt rows can depend on the chunking", ENV_ALIGN)  # fmt: skip
        return "off"
    scheduler = vllm_config.scheduler_config
    _check_budget(scheduler)
    current = scheduler.scheduler_cls
    if current is None:
        base = AsyncScheduler if getattr(scheduler, "async_scheduling", False) else Scheduler
    else:
        base = _resolve(current)
        if isinstance(base, type) and issubclass(base, AlignedPrefillMixin):
            return "already installed"
        if not (isinstance(base, type) and issubclass(base, Scheduler)):
            raise ValueError(
                f"scheduler_cls {current!r} is not a subclass of vLLM's Scheduler, so the sparse-attention plugin "
                f"cannot cut its prefill chunks at multiples of {ALIGN} positions (block decisions, "
                "docs/serving.md): derive it from vllm.v1.core.sched.scheduler.Scheduler (the plugin then composes "
                f"with it), put {class_qualname(AlignedPrefillMixin)} in front of it yourself, or serve dense "
                "(MODELOPT_EXT_SPARSE_ATTN=0)")  # fmt: skip
    hooks = scheduler_hooks(base)
    connector = getattr(vllm_config, "kv_transfer_config", None) is not None
    problem = hooks.problem
    if problem is None and connector and hooks.chunk_hook == SPLIT_HOOK and not hooks.split_skips_async_loads:
        problem = (f"with a KV connector this vLLM would call {SPLIT_HOOK} for asynchronous KV loads too and never "
                   "admit them")  # fmt: skip
    if problem is not None:
        return _whole_prompts(vllm_config, f"{problem} (vLLM {getattr(__import__('vllm'), '__version__', '?')})")
    if current is None:
        scheduler.scheduler_cls = class_qualname(AlignedAsyncScheduler if base is AsyncScheduler else AlignedScheduler)
    elif isinstance(current, str):
        scheduler.scheduler_cls = composed_scheduler_name(current)
    elif "<locals>" not in current.__qualname__:
        scheduler.scheduler_cls = composed_scheduler_name(class_qualname(current))
    else:  # a class defined in a function: composed here (an engine core in another process must fork)
        scheduler.scheduler_cls = composed_scheduler_class(current)
    if connector:
        logger.warning("aligned prefill chunks: a KV connector's external hits are not cut back (connectors load "
                       "what they matched); a request resumed from one may compute a block of prompt positions in "
                       "two calls, which the scheduler logs")  # fmt: skip
    logger.info("aligned prefill chunks: scheduler_cls=%s (prefill chunks and prefix-cache hits on multiples of %d "
                "positions, through %s)", scheduler.scheduler_cls if isinstance(scheduler.scheduler_cls, str) else
                scheduler.scheduler_cls.__name__, ALIGN, hooks.chunk_hook)  # fmt: skip
    return "scheduler"


def engine_may_run_sparse(vllm_config, settings) -> bool:
    """Whether the engine of `vllm_config` may run sparse or calibrate (then its prompts need aligned chunks): the
    checkpoint's settings are served, or its workers carry the plugin's RPCs (calibration tools), plugin on."""
    if settings is not None:
        return True
    from .env import sparse_attention_enabled
    from .worker import worker_extension_cls

    extension = getattr(vllm_config.parallel_config, "worker_extension_cls", None) or ""
    ours = worker_extension_cls()
    prefix = ours.rsplit(".", 1)[0] + "."
    return sparse_attention_enabled() and isinstance(extension, str) and extension.startswith(prefix)


__all__ = ["ENV_ALIGN", "engine_may_run_sparse", "install_aligned_scheduler"]
