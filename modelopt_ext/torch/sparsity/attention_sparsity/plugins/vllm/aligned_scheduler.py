"""The aligned prefill scheduler: `AlignedPrefillMixin` applies the rules of plugins/vllm/prefill_alignment.py
(prefill chunks and prefix-cache hits on multiples of 64 positions) inside vLLM's `schedule()`; this module also
composes it with the engine's scheduler class. plugins/vllm/scheduler_install.py names one of these classes in the
engine config: `AlignedScheduler` (vLLM's `Scheduler`), `AlignedAsyncScheduler` (`AsyncScheduler`), or a class over
a scheduler the user named, built by name in the engine-core process (`composed_scheduler_name`).

vLLM has no public hook inside `schedule()`, so the mixin uses private ones, detected per release by
`scheduler_hooks.scheduler_hooks` (docs/serving.md has the table): chunk ends in `_reserve_prefill_lookahead` (vLLM
0.28 on, the last word on every chunk's length) else `_mamba_block_aligned_split` (0.16 - 0.27, switched on for
every engine); prefix-cache hits in the KV-cache coordinator's `find_longest_cache_hit`, looked up again with the
cap rounded down, so every KV-cache group gets a consistent hit of the aligned length from vLLM itself.

After every step the scheduler checks what it emitted and logs any prefill chunk still off the grid (a KV
connector's external hit, a multimodal encoder budget; `_check_step`). `MODELOPT_EXT_SCHEDULER_TRACE=FILE` appends
one JSON line per engine step with its prefill chunks (tests and benchmarks/studies/aligned_prefill_cost.py).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import os

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .prefill_alignment import ALIGN, aligned_chunk_length, aligned_hit, is_aligned_chunk
from .prefix_keys import PrefixKeyMixin
from .scheduler_hooks import LOOKAHEAD_HOOK, SPLIT_HOOK, scheduler_hooks

logger = logging.getLogger(__name__)

ENV_TRACE = "MODELOPT_EXT_SCHEDULER_TRACE"
_COMPOSED_PREFIX = "AlignedOver_"
_LOGGED_VIOLATIONS = 8  # off-grid chunks logged one by one; after that only every 1000th


class AlignedPrefillMixin(PrefixKeyMixin):
    """Put in front of a vLLM `Scheduler` (sub)class: prefill chunks and prefix-cache hits on multiples of `ALIGN`
    (and, from `PrefixKeyMixin`, the prefix cache keyed by target: plugins/vllm/prefix_keys.py).

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


def class_qualname(cls) -> str:
    """The name vLLM resolves a class by in `scheduler_cls`: module path, then qualified name."""
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
    composed = _compose(import_by_qualname(user), name, user)
    globals()[name] = composed
    return composed


def import_by_qualname(qualname: str):
    """What vLLM's `resolve_obj_by_qualname` does with a `scheduler_cls` string (module path, then attribute)."""
    module, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _compose(user_cls, name: str, label: str):
    return type(name, (AlignedPrefillMixin, user_cls), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"{label} with prefill chunks and prefix-cache hits on multiples of {ALIGN} (AlignedPrefillMixin).",
    })  # fmt: skip


def composed_scheduler_class(user_cls):
    """`AlignedPrefillMixin` in front of `user_cls`, composed here and now: for a class defined in a function, which
    no process can import by name (an engine core in another process must fork to get it)."""
    return _compose(user_cls, _COMPOSED_PREFIX + user_cls.__name__, class_qualname(user_cls))


__all__ = [
    "ENV_TRACE",
    "AlignedAsyncScheduler",
    "AlignedPrefillMixin",
    "AlignedScheduler",
    "CheckedScheduler",
    "class_qualname",
    "composed_scheduler_class",
    "composed_scheduler_name",
    "import_by_qualname",
]
