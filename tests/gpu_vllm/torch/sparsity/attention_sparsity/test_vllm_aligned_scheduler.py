"""The aligned prefill scheduler (plugins/vllm/aligned_scheduler.py, its rules in prefill_alignment.py, installed by
scheduler_install.py) on the real vLLM Scheduler of this environment.

Each test builds vLLM's own Scheduler (or AsyncScheduler) with the plugin's mixin in front, a real KV-cache manager
and prefix cache, real Requests with real block hashes, and drives it the way vLLM's engine core does: `schedule()`,
then `update_from_output()` with one sampled token for every request whose chunk reached its end. What the scheduler
emits (SchedulerOutput) is read directly: every chunk that holds prompt positions must start at a multiple of 64 and
end at one or at/after the prompt's end, and a prefix-cache hit must be a multiple of 64 tokens. vLLM's stock
scheduler on the same workload is the control (it cuts elsewhere, so the checks can fail). Nothing here depends on
the kernels' decisions.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import aligned_scheduler as al  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import prefill_alignment as rules  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import scheduler_install as inst  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.prefix_keys import PrefixKeyMixin  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.scheduler_hooks import (  # noqa: E402
    LOOKAHEAD_HOOK,
    SPLIT_HOOK,
    scheduler_hooks,
    split_call_guarded,
)

ALIGN = rules.ALIGN
_IDS = itertools.count()


class SplitHookScheduler(al.AlignedPrefillMixin, Scheduler):
    """The aligned scheduler through the Mamba split (how vLLM 0.16 - 0.27 are served), on this vLLM."""

    _modelopt_hook = SPLIT_HOOK


def _engine_config(*, budget: int, block: int, prefix_caching: bool, long_prefill: int = 0, max_seqs: int = 8):
    from vllm_plugin_testlib import new_engine_config

    config = new_engine_config()
    scheduler = config.scheduler_config
    scheduler.max_num_batched_tokens = budget
    scheduler.max_num_seqs = max_seqs
    scheduler.enable_chunked_prefill = True
    scheduler.long_prefill_token_threshold = long_prefill
    config.cache_config.enable_prefix_caching = prefix_caching
    config.cache_config.block_size = block
    return config


def _make_scheduler(cls, *, budget: int = 200, block: int = 16, prefix_caching: bool = True, num_blocks: int = 400,
                    long_prefill: int = 0, sliding_window: int | None = None):  # fmt: skip
    """One KV-cache group of full attention; with `sliding_window`, a second group of sliding-window layers (vLLM's
    hybrid coordinator, as for Gemma 2/3 and gpt-oss)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config = _engine_config(budget=budget, block=block, prefix_caching=prefix_caching, long_prefill=long_prefill)
    config.cache_config.num_gpu_blocks = num_blocks
    geometry = {"block_size": block, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], FullAttentionSpec(**geometry))]
    if sliding_window:
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"],
                                       SlidingWindowSpec(**geometry, sliding_window=sliding_window)))
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    kwargs = {"vllm_config": config, "kv_cache_config": kv_config,
              "structured_output_manager": StructuredOutputManager(config), "block_size": block}  # fmt: skip
    if "hash_block_size" in inspect.signature(Scheduler.__init__).parameters:
        kwargs["hash_block_size"] = block
    return cls(**kwargs)


@functools.cache
def _hasher(block: int):
    """vLLM's request block hasher, its NONE_HASH seeded once (random per seeding where PYTHONHASHSEED is unset:
    seeded per request, no two requests would share a block hash)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(block, fn)


def _request(tokens: list[int], block: int, max_tokens: int = 3) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    extra = {"eos_token_id": None} if "eos_token_id" in inspect.signature(Request.__init__).parameters else {}  # 0.16
    return Request(request_id=f"r{next(_IDS)}", prompt_token_ids=tokens, sampling_params=params,
                   pooling_params=None, block_hasher=_hasher(block), **extra)  # fmt: skip


def _prompts(shared: int, lengths: list[int]) -> list[list[int]]:
    prefix = [(7 * i) % 997 + 1 for i in range(shared)]
    return [prefix + [(13 * i + 5 * k) % 991 + 1 for i in range(n - shared)] for k, n in enumerate(lengths)]


def _run(scheduler, prompts: list[list[int]], block: int, *, stagger: int = 0, max_steps: int = 400) -> dict:
    """Drive `scheduler` over the prompts (added `stagger` steps apart) until every request finishes. Returns the
    chunks it emitted, as (request id, start, length, prompt length), and the hits of the new requests."""
    from vllm.v1.outputs import ModelRunnerOutput

    with_index = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    pending = [_request(p, block) for p in prompts]
    chunks, hits, finished = [], [], set()
    ids = {r.request_id for r in pending}
    for step in range(max_steps):
        if pending and (stagger == 0 or step % stagger == 0):
            for r in pending[: 1 if stagger else None]:
                scheduler.add_request(r)
            pending = pending[1:] if stagger else []
        output = scheduler.schedule()
        starts = [(n.req_id, n.num_computed_tokens) for n in output.scheduled_new_reqs]
        hits += [(n.req_id, n.num_computed_tokens) for n in output.scheduled_new_reqs if n.num_computed_tokens]
        cached = output.scheduled_cached_reqs
        starts += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled = []
        for req_id, start in starts:
            request = scheduler.requests[req_id]
            n = output.num_scheduled_tokens[req_id]
            chunks.append((req_id, start, n, request.num_prompt_tokens))
            sampled.append([11] if start + n >= request.num_tokens else [])
        req_ids = [rid for rid, _ in starts]
        index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if with_index else {}  # gone in 0.34
        runner = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **index)
        for outputs in scheduler.update_from_output(output, runner).values():
            finished |= {o.request_id for o in outputs.outputs if o.finish_reason is not None}
        if not pending and finished >= ids:
            return {"chunks": chunks, "hits": hits, "steps": step + 1}
    raise AssertionError(f"requests did not finish in {max_steps} steps: {sorted(ids - finished)}")


def _off_grid(chunks) -> list:
    return [c for c in chunks if not rules.is_aligned_chunk(c[1], c[2], c[3])]


# ---------------------------------------------------------------------------------------------------------------
# The rules


def test_chunk_rule():
    f = rules.aligned_chunk_length
    assert f(0, 200, 1000, 200) == 192  # cut back to a multiple of 64
    assert f(192, 200, 1000, 200) == 192  # ends at 384
    assert f(0, 200, 150, 200) == 200  # reaches the prompt's end: free
    assert f(960, 200, 1000, 200) == 200
    assert f(1000, 5, 1000, 200) == 5  # decode rows: free
    assert f(128, 40, 1000, 200) == 0  # less than a block left this step: wait for budget
    assert f(128, 40, 1000, 40) == 40  # a block can never fit: progress
    assert f(128, 40, 1000, 200, may_wait=False) == 40  # multimodal request cut by its encoder budget
    assert f(100, 100, 1000, 200) == 92  # an off-grid start re-aligns at the last multiple it reaches (192)
    assert f(100, 20, 1000, 200) == 0
    assert rules.is_aligned_chunk(0, 192, 1000) and rules.is_aligned_chunk(960, 40, 1000)
    assert rules.is_aligned_chunk(1000, 1, 1000) and rules.is_aligned_chunk(5, 3, 5)
    assert not rules.is_aligned_chunk(0, 200, 1000) and not rules.is_aligned_chunk(100, 28, 1000)


def test_hooks_detected_on_this_vllm():
    """0.28 on: the lookahead reservation is the last word on every chunk; every release: the Mamba split."""
    hooks = scheduler_hooks(Scheduler)
    assert hooks.problem is None, hooks.problem
    expected = LOOKAHEAD_HOOK if hasattr(Scheduler, LOOKAHEAD_HOOK) else SPLIT_HOOK
    assert hooks.chunk_hook == expected
    assert scheduler_hooks(AsyncScheduler).chunk_hook == expected
    if expected == LOOKAHEAD_HOOK:  # read in 0.28 - 0.34: the waiting-request split sits in `else` of load_kv_async
        assert split_call_guarded(textwrap.dedent(inspect.getsource(Scheduler.schedule)))
    unguarded = "if self.need_mamba_block_aligned_split:\n    n = self._mamba_block_aligned_split(r, n, a, b)\n"
    guarded = unguarded.replace("split:", "split and not load_kv_async:")
    assert not split_call_guarded(unguarded) and split_call_guarded(guarded)  # 0.16 - 0.22 / 0.23 - 0.27


# ---------------------------------------------------------------------------------------------------------------
# Chunks and hits on the real scheduler


WORKLOAD = {"shared": 300, "lengths": [700, 450, 333, 1000, 301, 640]}  # shared prefix: 288 cacheable at page 16


@pytest.mark.parametrize("cls", [al.AlignedScheduler, SplitHookScheduler, al.AlignedAsyncScheduler],
                         ids=["lookahead-or-split", "split", "async"])  # fmt: skip
@pytest.mark.parametrize("block", [16, 32])
def test_every_prefill_chunk_and_hit_is_aligned(cls, block):
    scheduler = _make_scheduler(cls, budget=200, block=block)
    # staggered: the first request's prefix blocks are cached before the others look them up
    run = _run(scheduler, _prompts(**WORKLOAD), block, stagger=4)
    assert not _off_grid(run["chunks"]), _off_grid(run["chunks"])[:5]
    assert run["hits"] and all(start % ALIGN == 0 for _, start in run["hits"]), run["hits"]
    assert scheduler.modelopt_alignment_stats()["off_grid_chunks"] == 0
    assert scheduler.modelopt_alignment_stats()["trimmed_tokens"] > 0
    # the chunk ends did bind: at least one prompt was cut short of the 200-token budget
    assert any(n < 200 and start + n < prompt for _, start, n, prompt in run["chunks"])


@pytest.mark.parametrize("block", [16, 32])
def test_stock_scheduler_cuts_off_grid_on_the_same_workload(block):
    """The control: vLLM's scheduler cuts at its budget (200) and hits at its page, off the 64 grid."""
    run = _run(_make_scheduler(al.CheckedScheduler, budget=200, block=block), _prompts(**WORKLOAD), block, stagger=4)
    assert _off_grid(run["chunks"])
    assert any(start % ALIGN for _, start in run["hits"]), run["hits"]


def test_concurrent_prompts_under_a_small_budget_all_finish():
    """Six prompts at once (no stagger) under a 100-token budget: requests wait for a whole block, none starves."""
    scheduler = _make_scheduler(al.AlignedScheduler, budget=100, block=16)
    run = _run(scheduler, _prompts(**WORKLOAD), 16)
    assert not _off_grid(run["chunks"])


def test_long_prefill_threshold_is_a_budget_too():
    scheduler = _make_scheduler(al.AlignedScheduler, budget=512, block=16, long_prefill=150)
    run = _run(scheduler, _prompts(shared=0, lengths=[500, 700]), 16)
    assert not _off_grid(run["chunks"])
    assert max(n for _, start, n, prompt in run["chunks"] if start + n < prompt) == 128


def test_preempted_requests_recompute_from_an_aligned_point():
    """A KV cache too small for every prompt at once: vLLM preempts and the requests recompute, from 0 or from an
    aligned hit, still on the grid."""
    scheduler = _make_scheduler(al.AlignedScheduler, budget=200, block=16, num_blocks=90)
    run = _run(scheduler, _prompts(shared=100, lengths=[600, 620, 640]), 16)
    assert not _off_grid(run["chunks"])


def test_hits_without_prefix_caching_and_without_alignment():
    run = _run(_make_scheduler(al.AlignedScheduler, prefix_caching=False), _prompts(**WORKLOAD), 16, stagger=4)
    assert not run["hits"] and not _off_grid(run["chunks"])


def test_prefix_hit_lookups_go_through_vllm_with_an_aligned_cap():
    """The coordinator's own lookup gives the aligned hit (same blocks as a lookup capped there by hand)."""
    scheduler = _make_scheduler(al.AlignedScheduler, budget=512, block=16)
    _run(scheduler, [_prompts(shared=300, lengths=[330])[0]], 16)
    probe = _request(_prompts(shared=300, lengths=[330, 400])[1], 16)
    coordinator = scheduler.kv_cache_manager.coordinator
    aligned = coordinator.find_longest_cache_hit(probe.block_hashes, probe.num_tokens - 1)
    raw = type(coordinator).find_longest_cache_hit(coordinator, probe.block_hashes, probe.num_tokens - 1)
    assert raw[1] == 288 and aligned[1] == 256
    by_hand = type(coordinator).find_longest_cache_hit(coordinator, probe.block_hashes, 256)
    assert [[b.block_id for b in g] for g in aligned[0]] == [[b.block_id for b in g] for g in by_hand[0]]


def test_hits_with_a_sliding_window_group_are_consistent():
    """vLLM's hybrid coordinator (full attention + a 128-token sliding window): the aligned hit is the one vLLM's own
    lookup gives for that length in every group, and every request runs to the end on it."""
    scheduler = _make_scheduler(al.AlignedScheduler, budget=200, block=16, sliding_window=128)
    assert type(scheduler.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    run = _run(scheduler, _prompts(**WORKLOAD), 16, stagger=4)
    assert not _off_grid(run["chunks"]) and run["hits"] and all(start % ALIGN == 0 for _, start in run["hits"])
    probe = _request(_prompts(**WORKLOAD)[1], 16)
    coordinator = scheduler.kv_cache_manager.coordinator
    aligned = coordinator.find_longest_cache_hit(probe.block_hashes, probe.num_tokens - 1)
    by_hand = type(coordinator).find_longest_cache_hit(coordinator, probe.block_hashes, aligned[1])
    assert aligned[1] % ALIGN == 0 and aligned[1] > 0
    assert [[b.block_id for b in g] for g in aligned[0]] == [[b.block_id for b in g] for g in by_hand[0]]


# ---------------------------------------------------------------------------------------------------------------
# Installation into an engine config


def _config(**kw):
    return _engine_config(budget=kw.pop("budget", 2048), block=16, prefix_caching=True, **kw)


def test_install_picks_the_engines_scheduler_class():
    config = _config()
    config.scheduler_config.scheduler_cls = None
    config.scheduler_config.async_scheduling = False
    assert inst.install_aligned_scheduler(config) == "scheduler"
    assert config.scheduler_config.scheduler_cls == f"{al.__name__}.AlignedScheduler"
    assert config.scheduler_config.get_scheduler_cls() is al.AlignedScheduler
    config = _config()
    config.scheduler_config.scheduler_cls = None
    config.scheduler_config.async_scheduling = True
    inst.install_aligned_scheduler(config)
    assert config.scheduler_config.get_scheduler_cls() is al.AlignedAsyncScheduler
    assert inst.install_aligned_scheduler(config) == "already installed"


class UserScheduler(Scheduler):
    """A user's scheduler (a subclass of vLLM's), named in scheduler_cls."""

    def schedule(self, *args, **kwargs):
        self.user_steps = getattr(self, "user_steps", 0) + 1
        return super().schedule(*args, **kwargs)


def test_install_composes_with_a_users_scheduler():
    for given in (f"{__name__}.UserScheduler", UserScheduler):
        config = _config()
        config.scheduler_config.scheduler_cls = given
        inst.install_aligned_scheduler(config)
        name = config.scheduler_config.scheduler_cls
        assert isinstance(name, str) and name.startswith(f"{al.__name__}.AlignedOver_")
        cls = config.scheduler_config.get_scheduler_cls()  # vLLM resolves it by name, as its engine core does
        assert cls.__mro__[1:4] == (al.AlignedPrefillMixin, PrefixKeyMixin, UserScheduler)  # keyed prefix cache too
    scheduler = _make_scheduler(cls, budget=200)
    run = _run(scheduler, _prompts(**WORKLOAD), 16, stagger=4)
    assert not _off_grid(run["chunks"]) and scheduler.user_steps == run["steps"]


class NotAScheduler:
    """Implements vLLM's scheduler interface without deriving from its Scheduler."""


def test_install_refuses_a_scheduler_it_cannot_compose_with():
    config = _config()
    config.scheduler_config.scheduler_cls = f"{__name__}.NotAScheduler"
    with pytest.raises(ValueError, match="not a subclass of vLLM's Scheduler.*AlignedPrefillMixin"):
        inst.install_aligned_scheduler(config)
    config.scheduler_config.scheduler_cls = "no.such.module.Scheduler"
    with pytest.raises(ValueError, match="cannot be imported"):
        inst.install_aligned_scheduler(config)


@pytest.mark.parametrize(("budget", "threshold"), [(48, 0), (2048, 40)])
def test_install_refuses_budgets_below_one_block(budget, threshold):
    config = _config(budget=budget, long_prefill=threshold)
    with pytest.raises(ValueError, match="at least 64"):
        inst.install_aligned_scheduler(config)


def _old_release_scheduler():
    """A scheduler class standing in for a vLLM release whose schedule() calls neither hook."""

    def schedule(self, *args, **kwargs):
        return Scheduler.schedule(self, *args, **kwargs)

    return type("OldScheduler", (Scheduler,), {"__module__": "vllm.v1.core.sched.old_release", "schedule": schedule})


def test_without_hooks_prompts_are_served_whole():
    old = _old_release_scheduler()
    assert scheduler_hooks(old).problem
    config = _config()
    config.scheduler_config.scheduler_cls = old
    assert inst.install_aligned_scheduler(config) == "whole prompts"
    scheduler, cache = config.scheduler_config, config.cache_config
    assert scheduler.scheduler_cls is old  # left as it was
    assert not scheduler.enable_chunked_prefill and not cache.enable_prefix_caching
    assert scheduler.long_prefill_token_threshold == 0
    assert scheduler.max_num_batched_tokens >= config.model_config.max_model_len


def test_switched_off(monkeypatch):
    monkeypatch.setenv(inst.ENV_ALIGN, "0")
    config = _config()
    before = config.scheduler_config.scheduler_cls
    assert inst.install_aligned_scheduler(config) == "off"
    assert config.scheduler_config.scheduler_cls == before


def test_trace_lines(tmp_path, monkeypatch):
    import json

    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(al.ENV_TRACE, str(path))
    scheduler = _make_scheduler(al.AlignedScheduler, budget=200)
    run = _run(scheduler, _prompts(shared=0, lengths=[500]), 16)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == run["steps"] and all(rec["budget"] == 200 for rec in lines)
    traced = [tuple(c) for rec in lines for c in rec["prefill_chunks"]]
    assert traced == [c for c in run["chunks"] if c[1] < c[3]]
    assert sum(rec["trimmed"] for rec in lines) == scheduler.modelopt_alignment_stats()["trimmed_tokens"]


@pytest.mark.vllm_cpu
@pytest.mark.parametrize(("switch", "user"), [("1", None), ("1", "UserScheduler"), ("0", None)])
def test_vllms_engine_config_path_installs_it(switch, user, smollm2_checkpoint, tmp_path, monkeypatch):
    """vLLM's own EngineArgs path with the general plugin loaded by vLLM: a sparse checkpoint's engine config names
    the aligned scheduler (composed with a user's); switched off, vLLM's default stays."""
    from vllm.engine.arg_utils import EngineArgs

    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        build_sparse_attention_config,
        linked_checkpoint_copy,
        write_sparse_attention_config,
    )

    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN", switch)
    ckpt = linked_checkpoint_copy(smollm2_checkpoint, tmp_path / "ckpt")
    fits = {"prefill": {"a": 0.0232, "b": 12.98}, "decode": {"a": 0.0075, "b": 13.02}}
    write_sparse_attention_config(ckpt, build_sparse_attention_config(fits, target_sparsity=0.5))
    given = f"{__name__}.{user}" if user else None
    config = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=1024, scheduler_cls=given,
                        max_num_batched_tokens=200).create_engine_config()  # fmt: skip
    name = config.scheduler_config.scheduler_cls
    if switch == "0":
        assert name == given
    elif user:
        assert name == al.composed_scheduler_name(given)
    else:
        assert name == f"{al.__name__}.AlignedScheduler"
