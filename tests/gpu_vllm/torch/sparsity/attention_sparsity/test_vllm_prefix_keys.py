"""Prefix caching keyed by target (plugins/vllm/prefix_keys.py) on this environment's real vLLM classes.

Real `Request`s hashed by vLLM's own block hasher: requests served with different laws (another target, dense, decode
feedback) get different block hashes from the first block on, requests with the same law the same ones, requests at
the checkpoint's law keep vLLM's own hashes, and a user's `cache_salt` still separates. Then vLLM's own `Scheduler`
with the plugin's mixin, a real KV-cache manager and prefix cache: a request at another target gets no hit on a
prefix cached at the checkpoint's target, one at the same target does. Then the engine-config install.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging

import pytest
import torch

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    BLOCK_KEY,
    build_sparse_attention_config,
    parse_sparse_attention_config,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import aligned_scheduler as al  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import prefix_keys as pk  # noqa: E402

PAGE = 16
FITS = {"prefill": {"a": 0.0232, "b": 12.98}, "decode": {"a": 0.0075, "b": 13.02}}  # as tests/e2e/test_invariance.py
BLOCK = build_sparse_attention_config(FITS, target_sparsity=0.5)
SETTINGS = parse_sparse_attention_config(BLOCK)
PROMPT = [(7 * i) % 997 + 1 for i in range(9 * PAGE)]  # a hit of 8 pages: 128 tokens, aligned to 64
_IDS = itertools.count()

DEFAULT = None
AT_09 = {"sparse_attn_target": 0.9}
DENSE = {"sparse_attn_target": "dense"}
PREFILL_09 = {"sparse_attn_prefill_target": 0.9}
DECODE_09 = {"sparse_attn_decode_target": "0.9"}
FEEDBACK = {"sparse_attn_decode_feedback": True}


@functools.cache
def _hasher(block: int = PAGE):
    """vLLM's request block hasher, its NONE_HASH seeded once."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(block, fn)


def _request(extra_args=None, *, salt: str | None = None, tokens=PROMPT, max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args)
    extra = {"eos_token_id": None} if "eos_token_id" in inspect.signature(Request.__init__).parameters else {}  # 0.16
    return Request(request_id=f"r{next(_IDS)}", prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, cache_salt=salt, block_hasher=_hasher(), **extra)  # fmt: skip


def _keyed(extra_args=None, *, salt: str | None = None) -> Request:
    request = _request(extra_args, salt=salt)
    pk.PrefixKeys(SETTINGS).apply(request)
    return request


# ---------------------------------------------------------------------------------------------------------------
# The key and the salt


def test_this_vllm_can_rekey_requests():
    assert pk.rekeying_problem() is None


def test_checkpoint_law_has_no_key_and_every_other_law_its_own():
    keys = pk.PrefixKeys(SETTINGS)
    assert keys.key(None) is None and keys.key({}) is None and keys.key({"temperature_hint": 1}) is None
    assert keys.key({"sparse_attn_target": 0.5}) is None  # the checkpoint's own target: the same law, shared
    assert keys.key({"sparse_attn_prefill_target": "0.5", "sparse_attn_decode_target": 0.5}) is None
    others = [AT_09, DENSE, PREFILL_09, DECODE_09, FEEDBACK, {"sparse_attn_target": 0.9000001},
              {"sparse_attn_prefill_target": "dense"}, {**AT_09, **FEEDBACK}]  # fmt: skip
    found = [keys.key(x) for x in others]
    assert None not in found and len(set(found)) == len(found), found
    assert keys.key(AT_09) == keys.key({"sparse_attn_prefill_target": 0.9, "sparse_attn_decode_target": "0.9"})
    assert keys.key({"sparse_attn_target": 0}) == keys.key(DENSE) == "prefill=dense;decode=dense"
    assert keys.key({"sparse_attn_target": "nonsense"}) is None  # served at the checkpoint's targets (worker)


def test_salts_are_one_to_one_and_not_forgeable():
    keys = [None, "prefill=dense;decode=dense", pk.PrefixKeys(SETTINGS).key(AT_09)]
    users = [None, "tenant-a", "tenant-b", pk.SALT_MARK + keys[1] + "|", pk.SALT_MARK + keys[2] + "|tenant-a",
             pk.SALT_MARK + "default|tenant-a"]  # fmt: skip
    salts = {(u, k): pk.salted(u, k) for u in users for k in keys}
    assert len(set(salts.values())) == len(salts), salts
    assert pk.salted(None, None) is None and pk.salted("tenant-a", None) == "tenant-a"  # default requests untouched
    assert all(s.startswith(pk.SALT_MARK) for (u, k), s in salts.items() if k is not None)


# ---------------------------------------------------------------------------------------------------------------
# Block hashes of real Requests


def test_block_hashes_differ_from_the_first_block_between_laws():
    plain = _request()
    default, explicit = _keyed(DEFAULT), _keyed({"sparse_attn_target": 0.5})
    assert len(plain.block_hashes) == len(PROMPT) // PAGE
    assert default.block_hashes == plain.block_hashes == explicit.block_hashes  # vLLM's own hashes, shared
    assert default.cache_salt is None
    laws = [_keyed(x) for x in (AT_09, DENSE, PREFILL_09, DECODE_09, FEEDBACK)]
    for i, a in enumerate([default, *laws]):
        assert len(a.block_hashes) == len(PROMPT) // PAGE
        for b in [default, *laws][i + 1 :]:
            assert all(x != y for x, y in zip(a.block_hashes, b.block_hashes, strict=True)), b.cache_salt
    assert _keyed(AT_09).block_hashes == laws[0].block_hashes  # the same law: the same blocks
    assert _keyed(DENSE).block_hashes == laws[1].block_hashes


def test_a_users_salt_still_separates():
    a, b = _keyed(AT_09, salt="tenant-a"), _keyed(AT_09, salt="tenant-b")
    assert a.block_hashes[0] != b.block_hashes[0] and a.block_hashes[0] != _keyed(AT_09).block_hashes[0]
    assert _keyed(AT_09, salt="tenant-a").block_hashes == a.block_hashes
    default_a = _keyed(DEFAULT, salt="tenant-a")
    assert default_a.block_hashes == _request(salt="tenant-a").block_hashes  # untouched: vLLM's own salted hashes
    assert default_a.block_hashes[0] not in (a.block_hashes[0], _request().block_hashes[0])


def test_a_forged_salt_does_not_reach_another_laws_blocks():
    victim = _keyed(AT_09)
    forger = _keyed(DEFAULT, salt=victim.cache_salt)
    assert forger.cache_salt != victim.cache_salt and forger.block_hashes[0] != victim.block_hashes[0]


def test_rehashing_matches_a_request_created_with_the_salt():
    keyed = _keyed(AT_09, salt="tenant-a")
    fresh = _request(AT_09, salt=keyed.cache_salt)
    assert keyed.block_hashes == fresh.block_hashes and len(fresh.block_hashes) == len(PROMPT) // PAGE


# ---------------------------------------------------------------------------------------------------------------
# vLLM's Scheduler with the mixin


def _engine_config(*, prefix_caching: bool = True, block=BLOCK):
    from vllm_plugin_testlib import new_engine_config

    config = new_engine_config()
    config.scheduler_config.max_num_batched_tokens = 1024
    config.scheduler_config.max_num_seqs = 8
    config.cache_config.enable_prefix_caching = prefix_caching
    config.cache_config.block_size = PAGE
    if block is not None:
        setattr(config.model_config.hf_config, BLOCK_KEY, block)
    return config


def _scheduler(cls, config, num_blocks: int = 200):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)])  # fmt: skip
    kwargs = {"vllm_config": config, "kv_cache_config": kv_config,
              "structured_output_manager": StructuredOutputManager(config), "block_size": PAGE}  # fmt: skip
    if "hash_block_size" in inspect.signature(Scheduler.__init__).parameters:
        kwargs["hash_block_size"] = PAGE
    return cls(**kwargs)


def _serve(scheduler, request: Request, max_steps: int = 50) -> int:
    """Run one request to its end the way the engine core does; returns its prefix-cache hit (tokens)."""
    from vllm.v1.outputs import ModelRunnerOutput

    scheduler.add_request(request)
    hit = None
    for _ in range(max_steps):
        output = scheduler.schedule()
        for new in output.scheduled_new_reqs:
            hit = new.num_computed_tokens
        ids = list(output.num_scheduled_tokens)
        sampled = [[11] if scheduler.requests[r].num_computed_tokens + output.num_scheduled_tokens[r]
                   >= scheduler.requests[r].num_tokens else [] for r in ids]  # fmt: skip
        runner = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=sampled)  # fmt: skip
        finished = {o.request_id for outs in scheduler.update_from_output(output, runner).values()
                    for o in outs.outputs if o.finish_reason is not None}  # fmt: skip
        if request.request_id in finished:
            return hit
    raise AssertionError(f"request {request.request_id} did not finish in {max_steps} steps")


@pytest.mark.parametrize("cls", [pk.KeyedScheduler, al.AlignedScheduler], ids=["keyed", "aligned"])
def test_scheduler_hits_only_blocks_of_the_same_law(cls):
    scheduler = _scheduler(cls, _engine_config())
    assert _serve(scheduler, _request(DEFAULT)) == 0  # fills the cache with the checkpoint's law
    assert _serve(scheduler, _request(AT_09)) == 0
    assert _serve(scheduler, _request(DENSE)) == 0
    assert _serve(scheduler, _request(AT_09, salt="tenant-a")) == 0
    shared = len(PROMPT) - PAGE  # vLLM computes the last token again (a hit never covers the whole prompt)
    for extra, salt in ((AT_09, None), (DENSE, None), (DEFAULT, None), ({"sparse_attn_target": 0.5}, None),
                        (AT_09, "tenant-a")):  # fmt: skip
        assert _serve(scheduler, _request(extra, salt=salt)) == shared, (extra, salt)


def test_stock_scheduler_shares_blocks_across_laws():
    """The control: vLLM's own scheduler reuses the checkpoint-law prefix for a request at another target."""
    scheduler = _scheduler(Scheduler, _engine_config())
    assert _serve(scheduler, _request(DEFAULT)) == 0
    assert _serve(scheduler, _request(AT_09)) > 0


@pytest.mark.parametrize(("prefix_caching", "block", "switch"), [(False, BLOCK, "1"), (True, None, "1"),
                                                                 (True, BLOCK, "0")])  # fmt: skip
def test_scheduler_keys_nothing_without_a_cache_a_block_or_the_plugin(prefix_caching, block, switch, monkeypatch):
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN", switch)
    scheduler = _scheduler(pk.KeyedScheduler, _engine_config(prefix_caching=prefix_caching, block=block))
    assert scheduler._modelopt_prefix_keys is None
    request = _request(AT_09)
    scheduler.add_request(request)
    assert request.cache_salt is None


# ---------------------------------------------------------------------------------------------------------------
# Install (the engine config)


def test_install_keys_vllms_scheduler_and_keeps_the_aligned_one():
    config = _engine_config()
    assert pk.install_prefix_keys(config, SETTINGS) == "scheduler"
    keyed = "KeyedAsyncScheduler" if config.scheduler_config.async_scheduling else "KeyedScheduler"
    assert config.scheduler_config.scheduler_cls == f"{pk.__name__}.{keyed}"
    config = _engine_config()
    config.scheduler_config.scheduler_cls = f"{al.__name__}.AlignedScheduler"
    assert pk.install_prefix_keys(config, SETTINGS) == "scheduler"
    assert config.scheduler_config.scheduler_cls == f"{al.__name__}.AlignedScheduler"
    config.scheduler_config.scheduler_cls = al.composed_scheduler_name(f"{Scheduler.__module__}.Scheduler")
    assert pk.install_prefix_keys(config, SETTINGS) == "scheduler"
    assert issubclass(al.AlignedPrefillMixin, pk.PrefixKeyMixin)


def test_install_leaves_what_needs_no_key_and_warns_about_a_foreign_scheduler(caplog):
    off = _engine_config(prefix_caching=False)
    assert pk.install_prefix_keys(off, SETTINGS) == "off" and off.scheduler_config.scheduler_cls is None
    dense = _engine_config()
    assert pk.install_prefix_keys(dense, None) == "off" and dense.scheduler_config.scheduler_cls is None
    foreign = _engine_config()
    foreign.scheduler_config.scheduler_cls = f"{Scheduler.__module__}.Scheduler"
    with caplog.at_level(logging.WARNING):
        assert pk.install_prefix_keys(foreign, SETTINGS) == "off"
    assert "prefix cache not keyed by target" in caplog.text
    assert foreign.scheduler_config.scheduler_cls == f"{Scheduler.__module__}.Scheduler"


@pytest.mark.vllm_cpu
@pytest.mark.parametrize(("align", "caching", "expected"), [("1", True, "aligned"), ("0", True, "keyed"),
                                                            ("0", False, None)])  # fmt: skip
def test_vllms_engine_config_path_keys_the_prefix_cache(align, caching, expected, smollm2_checkpoint, tmp_path,
                                                        monkeypatch):  # fmt: skip
    """vLLM's own EngineArgs path: the engine of a sparse checkpoint gets a scheduler that keys its prefix cache,
    aligned or not (MODELOPT_EXT_SPARSE_ATTN_ALIGN_PREFILL)."""
    from vllm.engine.arg_utils import EngineArgs

    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        linked_checkpoint_copy,
        write_sparse_attention_config,
    )

    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN_ALIGN_PREFILL", align)
    ckpt = linked_checkpoint_copy(smollm2_checkpoint, tmp_path / "ckpt")
    write_sparse_attention_config(ckpt, BLOCK)
    config = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=1024, max_num_batched_tokens=256,
                        enable_prefix_caching=caching).create_engine_config()  # fmt: skip
    name = config.scheduler_config.scheduler_cls
    asynchronous = "Async" if config.scheduler_config.async_scheduling else ""
    assert {"aligned": f"{al.__name__}.Aligned{asynchronous}Scheduler",
            "keyed": f"{pk.__name__}.Keyed{asynchronous}Scheduler", None: None}[expected] == name  # fmt: skip
