"""Where vLLM's scheduler lets the aligned prefill scheduler act, detected per scheduler class (never from a
version string): the hooks plugins/vllm/aligned_scheduler.py wraps (docs/serving.md, "Aligned prefill chunks for
block decisions").
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap

# Scheduler hooks of the aligned prefill scheduler (plugins/vllm/aligned_scheduler.py; docs/serving.md, "Aligned
# prefill chunks for block decisions"). Read in the wheels of vLLM 0.16.0 - 0.34.0:
#
# - `Scheduler._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)` (0.28 on): called from
#   `schedule()` on every chunk length, for running and waiting requests, after the Mamba split and the multimodal
#   encoder caps: the last word on a chunk's length. A no-op unless multi-module MTP drafts.
# - `Scheduler._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens=0,
#   num_external_computed_tokens=0[, num_uncached_common_prefix_tokens=0 (0.24, 0.25)])` (0.16 on): called on every
#   chunk length when `self.need_mamba_block_aligned_split` is set; up to 0.27 it is the last word (the encoder caps
#   come before it). Its waiting-request call is skipped for asynchronous KV-connector loads from 0.23 on (0.16 - 0.22
#   would call it with 0 tokens and stop admitting: an async load would never start).
# - `KVCacheManager.coordinator.find_longest_cache_hit(block_hashes, max_cache_hit_length)` (0.16 on): every local
#   prefix-cache hit's length, for every KV-cache group (full attention, sliding window, Mamba), returned second.

SPLIT_HOOK = "_mamba_block_aligned_split"
LOOKAHEAD_HOOK = "_reserve_prefill_lookahead"
_SPLIT_EXTRA = ("num_new_local_computed_tokens", "num_external_computed_tokens", "num_uncached_common_prefix_tokens")


@dataclasses.dataclass(frozen=True)
class SchedulerHooks:
    """Where a vLLM scheduler class lets the aligned scheduler act (or why it cannot)."""

    chunk_hook: str | None  # LOOKAHEAD_HOOK or SPLIT_HOOK: the method whose result is a chunk's final length
    split_skips_async_loads: bool  # SPLIT_HOOK: whether the waiting-request split is skipped for async KV loads
    problem: str | None  # why no aligned scheduler can be built on this class (None: it can)


def _vllm_method(cls, name: str):
    """The implementation vLLM's own classes give `name` in `cls`'s MRO (a user's subclass may wrap it)."""
    for klass in getattr(cls, "__mro__", ()):
        if name in klass.__dict__ and klass.__module__.startswith("vllm."):
            return klass.__dict__[name]
    return None


def _params(fn) -> tuple[str, ...] | None:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def _split_skips_async_loads(schedule_fn) -> bool:
    """Whether the waiting-request call of the Mamba split (the one passing the hit's local and external tokens) is
    skipped when the KV connector loads asynchronously: its `if` tests `not load_kv_async` (0.23 - 0.27) or it sits
    in the `else` of `if load_kv_async:` (0.28 on). False where the source cannot be read (conservative)."""
    try:
        source = textwrap.dedent(inspect.getsource(schedule_fn))
    except (OSError, TypeError):
        return False
    return split_call_guarded(source)


def split_call_guarded(source: str) -> bool:
    """`_split_skips_async_loads` on the source text of a `schedule()` method."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def names(node) -> set[str]:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}

    def negates_async(test) -> bool:
        return any(isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) and "load_kv_async" in names(n.operand)
                   for n in ast.walk(test))  # fmt: skip

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == SPLIT_HOOK
             and len(n.args) > 2]  # fmt: skip
    if not calls:
        return False
    for call in calls:
        node, guarded = call, False
        while node in parents and not guarded:
            parent = parents[node]
            if isinstance(parent, ast.If):
                in_else = any(node is n for n in parent.orelse)
                guarded = negates_async(parent.test) or (in_else and "load_kv_async" in names(parent.test))
            node = parent
        if not guarded:
            return False
    return True


@functools.cache
def scheduler_hooks(scheduler_cls) -> SchedulerHooks:
    """The hooks `scheduler_cls` (vLLM's Scheduler or a subclass) offers the aligned scheduler, detected from the
    class: the methods, their parameters, and the names `schedule()` uses (never a version string)."""
    schedule = _vllm_method(scheduler_cls, "schedule")
    used = set(getattr(getattr(schedule, "__code__", None), "co_names", ()))
    problems = []
    hit = _prefix_hit_problem()
    if hit:
        problems.append(hit)
    lookahead = _vllm_method(scheduler_cls, LOOKAHEAD_HOOK)
    split = _vllm_method(scheduler_cls, SPLIT_HOOK)
    if lookahead is not None and LOOKAHEAD_HOOK in used and _params(lookahead) == (
        "self", "request", "num_computed_tokens", "num_new_tokens"
    ):  # fmt: skip
        return SchedulerHooks(LOOKAHEAD_HOOK, False, "; ".join(problems) or None)
    params = _params(split) if split is not None else None
    if (params is not None and params[:3] == ("self", "request", "num_new_tokens") and set(params[3:]) <= set(
            _SPLIT_EXTRA) and {SPLIT_HOOK, "need_mamba_block_aligned_split"} <= used):  # fmt: skip
        return SchedulerHooks(SPLIT_HOOK, _split_skips_async_loads(schedule), "; ".join(problems) or None)
    name = getattr(scheduler_cls, "__name__", str(scheduler_cls))
    problems.insert(0, f"{name}.schedule() passes chunk lengths through neither {LOOKAHEAD_HOOK}(request, "
                       f"num_computed_tokens, num_new_tokens) nor {SPLIT_HOOK}(request, num_new_tokens, ...)")
    return SchedulerHooks(None, False, "; ".join(problems))


@functools.cache
def _prefix_hit_problem() -> str | None:
    """Why local prefix-cache hits cannot be cut back on this vLLM (None: they can)."""
    try:
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
        from vllm.v1.core.kv_cache_manager import KVCacheManager
    except ImportError as exc:  # pragma: no cover - layout of another vLLM
        return f"no KV-cache coordinator to cut prefix-cache hits back ({exc})"
    finder = getattr(KVCacheCoordinator, "find_longest_cache_hit", None)
    lookup = getattr(KVCacheManager, "get_computed_blocks", None)
    if (finder is None or _params(finder) != ("self", "block_hashes", "max_cache_hit_length") or lookup is None
            or "find_longest_cache_hit" not in lookup.__code__.co_names
            or "coordinator" not in KVCacheManager.__init__.__code__.co_names):  # fmt: skip
        return ("KVCacheManager.get_computed_blocks does not take its hits from coordinator.find_longest_cache_hit("
                "block_hashes, max_cache_hit_length)")
    return None
