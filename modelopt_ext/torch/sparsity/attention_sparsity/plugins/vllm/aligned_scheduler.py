"""Aligned prefill chunks for block decisions: a vLLM scheduler that cuts prompts only at multiples of 64 positions.

Contract versions 4 and 5 (docs/skip_softmax.md) decide prompt rows per aligned block of `DECISION_BLOCK_ROWS` (64)
absolute positions: a block drops a tile only when every one of its prompt rows *in the same kernel call* drops it.
A row's output stays independent of how vLLM chunks a prompt only if every block of prompt positions is computed in
one attention call, so in every engine step the first new position of a request's prefill chunk must be a multiple
of 64 or at least the prompt length:

(a) a prefill chunk that ends before the prompt's end ends at a multiple of 64 (rounded down);
(b) a prefix-cache hit is cut back to a multiple of 64 tokens.

Decode steps, chunks that reach the prompt's end, and positions past the prompt (decode rows, also when a
preempted request recomputes them) are free. A preempted request recomputes from 0 or from an aligned hit.

vLLM's public extension point is `SchedulerConfig.scheduler_cls`. `install_aligned_scheduler(vllm_config)` sets it
(the plugin does when vLLM creates the engine config of an engine that may run sparse; plugins/vllm/entry.py) to
the engine's own scheduler class with `AlignedPrefillMixin` in front: `AlignedScheduler` (vLLM's `Scheduler`),
`AlignedAsyncScheduler` (`AsyncScheduler`), or a composed class over a scheduler the user named (built by name in
the engine-core process, like the worker extension). vLLM has no public hook inside `schedule()`, so the mixin uses
private ones, detected per release by `scheduler_hooks.scheduler_hooks` (docs/serving.md has the table):

- chunk ends: `_reserve_prefill_lookahead` (vLLM 0.28 on: the last word on every chunk's length, after the Mamba
  split and the multimodal encoder caps), else `_mamba_block_aligned_split` (0.16 - 0.27, switched on for every
  engine; there it is the last word);
- prefix-cache hits: the KV-cache coordinator's `find_longest_cache_hit(block_hashes, max_cache_hit_length)` (0.16
  on): a hit that is not a multiple of 64 is looked up again with the cap rounded down, so every KV-cache group
  (full attention, sliding window, Mamba) gets a consistent hit of the aligned length from vLLM itself.

Where a release offers neither hook, `install_aligned_scheduler` serves prompts whole instead (chunked prefill and
prefix caching off, as vLLM's CPU platform does for MLA), with a warning naming the reason. After every step the
scheduler checks what it emitted and logs any prefill chunk that still starts or ends off the grid (a KV
connector's external hit, a multimodal encoder budget; see `_check_step`).

Switches: `MODELOPT_EXT_SPARSE_ATTN_ALIGN_PREFILL=0` leaves vLLM's scheduler alone (block decisions may then depend
on the chunking; logged). `MODELOPT_EXT_SCHEDULER_TRACE=FILE` appends one JSON line per engine step with its
prefill chunks (tests and benchmarks/studies/aligned_prefill_cost.py read it).
"""

from __future__ import annotations

import functools
import json
import logging
import os

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from modelopt_ext.torch.kernels.sparsity.attention.semantics import DECISION_BLOCK_ROWS

from .env import env_flag
from .scheduler_hooks import LOOKAHEAD_HOOK, SPLIT_HOOK, scheduler_hooks

logger = logging.getLogger(__name__)

ALIGN = DECISION_BLOCK_ROWS
"""Prefill chunks start at multiples of this many absolute positions (or at/after the prompt's end)."""

ENV_ALIGN = "MODELOPT_EXT_SPARSE_ATTN_ALIGN_PREFILL"
ENV_TRACE = "MODELOPT_EXT_SCHEDULER_TRACE"
_COMPOSED_PREFIX = "AlignedOver_"
_MAX_HIT_TRIES = 4  # aligned targets tried per lookup before a hit is given up (each: at most two lookups)
_LOGGED_VIOLATIONS = 8  # off-grid chunks logged one by one; after that only every 1000th


# ---------------------------------------------------------------------------------------------------------------
# The rules (pure functions)


def aligned_chunk_length(start: int, num_new_tokens: int, prompt_len: int, max_prefill_tokens: int, *,
                         may_wait: bool = True) -> int:  # fmt: skip
    """The length of a chunk of `num_new_tokens` positions from `start` once its end is cut back to a multiple of
    `ALIGN`: unchanged when it reaches the prompt's end (or starts past it). A chunk that cannot reach the next
    multiple becomes 0 (the request waits a step for budget) when a chunk of `max_prefill_tokens` could reach it;
    otherwise, or when `may_wait` is False (a multimodal request whose encoder budget cut the chunk, which waiting
    would not change), it keeps its length: progress before alignment."""
    end = start + num_new_tokens
    if num_new_tokens <= 0 or start >= prompt_len or end >= prompt_len:
        return num_new_tokens
    aligned_end = end // ALIGN * ALIGN
    if aligned_end > start:
        return aligned_end - start
    next_boundary = (start // ALIGN + 1) * ALIGN
    if may_wait and next_boundary - start <= max_prefill_tokens:
        return 0
    return num_new_tokens


def is_aligned_chunk(start: int, num_new_tokens: int, prompt_len: int) -> bool:
    """Whether a chunk of `num_new_tokens` positions from `start` keeps every block of prompt positions in one call:
    it starts at a multiple of `ALIGN` and ends at one or at/after the prompt's end, or holds no prompt position."""
    if start >= prompt_len or num_new_tokens <= 0:
        return True
    end = start + num_new_tokens
    return start % ALIGN == 0 and (end >= prompt_len or end % ALIGN == 0)


def aligned_hit(find, block_hashes, max_cache_hit_length: int, *, slack: int):
    """A prefix-cache lookup (`find(block_hashes, max_cache_hit_length)`, vLLM's coordinator method, whose result's
    second item is the hit length) whose hit is a multiple of `ALIGN`. An unaligned hit H is looked up again with
    the cap rounded down (A = H // ALIGN * ALIGN), and with A + `slack` (one block: a lookup may drop its last
    block, as EAGLE's does); a result of exactly A is taken. Up to `_MAX_HIT_TRIES` multiples down, then no hit."""
    result = find(block_hashes, max_cache_hit_length)
    hit = result[1]
    if hit % ALIGN == 0:
        return result
    target = hit // ALIGN * ALIGN
    for _ in range(_MAX_HIT_TRIES):
        if target <= 0:
            break
        for cap in (target, target + slack):
            if cap > max_cache_hit_length:
                break
            candidate = find(block_hashes, cap)
            if candidate[1] == target:
                return candidate
        target -= ALIGN
    return find(block_hashes, 0)


# ---------------------------------------------------------------------------------------------------------------
# The scheduler


class AlignedPrefillMixin:
    """Put in front of a vLLM `Scheduler` (sub)class: prefill chunks and prefix-cache hits on multiples of `ALIGN`.

    `_modelopt_align = False` keeps vLLM's scheduling and only checks and traces it (the benchmark's baseline);
    `_modelopt_hook` forces one of the compat hooks (tests), default: what `scheduler_hooks.scheduler_hooks` detects.
    """

    _modelopt_align = True
    _modelopt_hook: str | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        hooks = scheduler_hooks(type(self))
        self._modelopt_chunk_hook = (self._modelopt_hook or hooks.chunk_hook) if self._modelopt_align else None
        # vLLM's own Mamba split (hybrid models in mamba_cache_mode "align") places chunk ends where Mamba states
        # are cached; moving them would corrupt those states, so such an engine keeps vLLM's chunk ends.
        self._modelopt_engine_split = bool(getattr(self, "need_mamba_block_aligned_split", False))
        if self._modelopt_align and hooks.problem:
            logger.warning("aligned prefill chunks: %s; prefill chunks are checked, not aligned", hooks.problem)
            self._modelopt_chunk_hook = None
        if self._modelopt_chunk_hook is not None and self._modelopt_engine_split:
            logger.warning(
                "aligned prefill chunks: this hybrid Mamba engine places its chunk ends where its Mamba states are "
                "cached (mamba_cache_mode 'align'); those are kept, so chunk ends are not cut back to multiples of "
                "%d (checked after every step)", ALIGN)  # fmt: skip
            self._modelopt_chunk_hook = None
        if self._modelopt_chunk_hook == SPLIT_HOOK:
            self.need_mamba_block_aligned_split = True  # every chunk's length now passes through the split
        if self._modelopt_align and not hooks.problem:
            self._modelopt_align_hits()
        self._modelopt_stats = {"steps": 0, "trimmed_tokens": 0, "off_grid_chunks": 0}
        self._modelopt_trimmed = 0
        self._modelopt_trace = None
        path = os.environ.get(ENV_TRACE)
        if path:
            self._modelopt_trace = open(path, "a", buffering=1)  # noqa: SIM115 - one line per step, kept open
        logger.info("aligned prefill chunks (%d positions): %s; prefix-cache hits %s", ALIGN,
                    f"chunk ends cut back in {self._modelopt_chunk_hook}" if self._modelopt_chunk_hook else
                    "chunk ends left to vLLM (checked after every step)",
                    "cut back to multiples of it" if self._modelopt_align and not hooks.problem else "left as found")

    # -- budget --------------------------------------------------------------------------------------------------

    def _modelopt_max_prefill(self) -> int:
        config = self.scheduler_config
        limit = int(config.max_num_batched_tokens)
        threshold = int(getattr(config, "long_prefill_token_threshold", 0) or 0)
        return min(limit, threshold) if threshold > 0 else limit

    def _modelopt_cut(self, request, start: int, num_new_tokens: int) -> int:
        mm = bool(getattr(request, "has_encoder_inputs", False))
        out = aligned_chunk_length(start, num_new_tokens, request.num_prompt_tokens, self._modelopt_max_prefill(),
                                   may_wait=not mm)  # fmt: skip
        self._modelopt_trimmed += num_new_tokens - out
        return out

    # -- the chunk hooks -----------------------------------------------------------------------------------------

    def _mamba_block_aligned_split(self, request, num_new_tokens, *args, **kwargs):
        if self._modelopt_engine_split or self._modelopt_chunk_hook != SPLIT_HOOK:
            num_new_tokens = super()._mamba_block_aligned_split(request, num_new_tokens, *args, **kwargs)
        if self._modelopt_chunk_hook != SPLIT_HOOK:
            return num_new_tokens
        local = args[0] if args else kwargs.get("num_new_local_computed_tokens", 0)
        external = args[1] if len(args) > 1 else kwargs.get("num_external_computed_tokens", 0)
        return self._modelopt_cut(request, request.num_computed_tokens + local + external, num_new_tokens)

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        out = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self._modelopt_chunk_hook != LOOKAHEAD_HOOK:
            return out
        for _ in range(8):  # cut back, and keep vLLM's MTP reservation (both only shorten): a fixed point
            cut = self._modelopt_cut(request, num_computed_tokens, out)
            again = super()._reserve_prefill_lookahead(request, num_computed_tokens, cut)
            if again == cut == out:
                break
            out = again
        return out

    # -- prefix-cache hits ---------------------------------------------------------------------------------------

    def _modelopt_align_hits(self) -> None:
        """Wrap this scheduler's coordinator lookup (an instance attribute: the class and other engines untouched)."""
        manager = getattr(self, "kv_cache_manager", None)
        coordinator = getattr(manager, "coordinator", None)
        find = getattr(coordinator, "find_longest_cache_hit", None)
        if find is None:
            return
        sizes = [getattr(m, "block_size", 0) for m in getattr(coordinator, "single_type_managers", ())]
        slack = max([int(s) for s in sizes if s] or [int(getattr(self, "block_size", ALIGN) or ALIGN)])

        @functools.wraps(find)
        def find_aligned(block_hashes, max_cache_hit_length):
            return aligned_hit(find, block_hashes, max_cache_hit_length, slack=slack)

        coordinator.find_longest_cache_hit = find_aligned

    # -- every step: check, count, trace -------------------------------------------------------------------------

    def schedule(self, *args, **kwargs):
        self._modelopt_trimmed = 0
        output = super().schedule(*args, **kwargs)
        self._check_step(output)
        return output

    def _step_chunks(self, output) -> list[tuple[str, int, int, int]]:
        """(request id, first position, length, prompt length) of every chunk of this step holding prompt rows."""
        starts = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        cached = output.scheduled_cached_reqs
        starts += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        chunks = []
        for req_id, start in starts:
            request = self.requests.get(req_id)
            n = output.num_scheduled_tokens.get(req_id, 0)
            if request is not None and start < request.num_prompt_tokens and n > 0:
                chunks.append((req_id, int(start), int(n), int(request.num_prompt_tokens)))
        return chunks

    def _check_step(self, output) -> None:
        """Log any prefill chunk of this step that is off the grid, and trace the step when asked."""
        stats = self._modelopt_stats
        stats["trimmed_tokens"] += self._modelopt_trimmed
        if not output.total_num_scheduled_tokens:
            return
        stats["steps"] += 1
        chunks = self._step_chunks(output)
        for req_id, start, n, prompt_len in chunks:
            if is_aligned_chunk(start, n, prompt_len):
                continue
            stats["off_grid_chunks"] += 1
            count = stats["off_grid_chunks"]
            if self._modelopt_align and (count <= _LOGGED_VIOLATIONS or count % 1000 == 0):
                logger.warning(
                    "aligned prefill chunks: request %s computes prompt positions %d..%d of %d in one call, not cut "
                    "at multiples of %d (a KV connector's hit, a multimodal encoder budget or a vLLM feature the "
                    "aligned scheduler does not cover); block decisions of its prompt rows at the cut can depend on "
                    "the chunking (%d such chunk(s) so far)", req_id, start, start + n - 1, prompt_len, ALIGN, count,
                )  # fmt: skip
        if self._modelopt_trace is not None:
            record = {"pid": os.getpid(), "step": stats["steps"], "aligned": self._modelopt_align,
                      "scheduled": int(output.total_num_scheduled_tokens),
                      "budget": int(self.scheduler_config.max_num_batched_tokens),
                      "trimmed": self._modelopt_trimmed, "prefill_chunks": chunks}  # fmt: skip
            self._modelopt_trace.write(json.dumps(record) + "\n")

    def modelopt_alignment_stats(self) -> dict:
        """Steps scheduled, tokens the alignment cut from chunks, and prefill chunks found off the grid."""
        return dict(self._modelopt_stats)


class AlignedScheduler(AlignedPrefillMixin, Scheduler):
    """vLLM's `Scheduler` with prefill chunks and prefix-cache hits on multiples of `ALIGN`."""


class AlignedAsyncScheduler(AlignedPrefillMixin, AsyncScheduler):
    """vLLM's `AsyncScheduler` with prefill chunks and prefix-cache hits on multiples of `ALIGN`."""


class CheckedScheduler(AlignedPrefillMixin, Scheduler):
    """vLLM's `Scheduler` as it is, with the per-step check and trace only (the baseline of
    benchmarks/studies/aligned_prefill_cost.py)."""

    _modelopt_align = False


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def composed_scheduler_name(user: str) -> str:
    """The `scheduler_cls` name of `AlignedPrefillMixin` in front of the scheduler class named `user`."""
    return f"{__name__}.{_COMPOSED_PREFIX}{user.encode().hex()}"


def __getattr__(name: str):
    """Composed scheduler classes, by the names `composed_scheduler_name` gives them (built once per process: vLLM
    resolves `scheduler_cls` by name in the engine-core process)."""
    if not name.startswith(_COMPOSED_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        user = bytes.fromhex(name[len(_COMPOSED_PREFIX) :]).decode()
    except (ValueError, UnicodeDecodeError):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    composed = _compose(_import_by_name(user), name, user)
    globals()[name] = composed
    return composed


def _import_by_name(qualname: str):
    """What vLLM's `resolve_obj_by_qualname` does with a `scheduler_cls` string (module path, then attribute)."""
    import importlib

    module, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _compose(user_cls, name: str, label: str):
    return type(name, (AlignedPrefillMixin, user_cls), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"{label} with prefill chunks and prefix-cache hits on multiples of {ALIGN} (AlignedPrefillMixin).",
    })  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Installation (the engine config, before vLLM starts the engine core)


def _resolve(scheduler_cls):
    if not isinstance(scheduler_cls, str):
        return scheduler_cls
    try:
        return _import_by_name(scheduler_cls)
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
                f"with it), put {_qualname(AlignedPrefillMixin)} in front of it yourself, or serve dense "
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
        scheduler.scheduler_cls = _qualname(AlignedAsyncScheduler if base is AsyncScheduler else AlignedScheduler)
    elif isinstance(current, str):
        scheduler.scheduler_cls = composed_scheduler_name(current)
    elif "<locals>" not in current.__qualname__:
        scheduler.scheduler_cls = composed_scheduler_name(_qualname(current))
    else:  # a class defined in a function: composed here (an engine core in another process must fork)
        scheduler.scheduler_cls = _compose(current, _COMPOSED_PREFIX + current.__name__, _qualname(current))
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


__all__ = [
    "ALIGN",
    "AlignedAsyncScheduler",
    "AlignedPrefillMixin",
    "AlignedScheduler",
    "CheckedScheduler",
    "aligned_chunk_length",
    "aligned_hit",
    "composed_scheduler_name",
    "engine_may_run_sparse",
    "install_aligned_scheduler",
    "is_aligned_chunk",
]
