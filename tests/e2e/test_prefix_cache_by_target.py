"""Prefix caching keyed by target (plugins/vllm/prefix_keys.py), end to end on vLLM's CPU engine.

Plain vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`, the plugin's entry point only) serves a
sparse checkpoint with prefix caching on. One prompt with a long shared prefix (about 750 tokens) is sent at the
checkpoint's target (0.5), at 0.7 and dense (three laws that give different log-probabilities here):

1. each first on a cold cache, kept apart by a `cache_salt` of its own: what it gives served alone;
2. then without a salt, the checkpoint's target first (it caches the prefix), then 0.7 and dense: each must give
   the tokens and log-probabilities it gave alone, and get no prefix-cache hit;
3. then each again: a request at the same target hits the cache (vLLM's `vllm:prefix_cache_hits` on /metrics) and
   still gives what it gave alone.

Before the fix, step 2's requests reused the prefix cached at the checkpoint's target (docs/serving.md).
"""

from __future__ import annotations

import sys
import time
import urllib.request

import pytest
from e2e_lib import fixed_fit_checkpoint, free_port, http_json, server_process

pytestmark = pytest.mark.e2e

SHARED = " ".join(f"Record {i}: the crate for dock {i % 17} ships in week {i % 23}." for i in range(40))
PROMPT = SHARED + " Question: which dock does the crate of record 12 go to, and in which week?"
TOKENS = 16
TARGETS = {"checkpoint": None, "0.7": {"sparse_attn_target": 0.7}, "dense": {"sparse_attn_target": "dense"}}
LOGPROB_TOL = 1e-3  # the same computation up to float32 rounding; another law's prefix moved them by 0.01 or more


@pytest.fixture(scope="module")
def sparse_ckpt(smollm2_checkpoint, tmp_path_factory):
    return fixed_fit_checkpoint(smollm2_checkpoint, tmp_path_factory.mktemp("prefix_keys") / "ckpt")


def _cache_counters(base: str) -> tuple[float, float]:
    """(queried tokens, hit tokens) of vLLM's prefix cache, from /metrics (summed over engines)."""
    with urllib.request.urlopen(base + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    out = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rpartition(" ")[2])
    return out["vllm:prefix_cache_queries_total"], out["vllm:prefix_cache_hits_total"]


def _complete(base: str, target: str, salt: str | None = None) -> dict:
    """One greedy completion of PROMPT at `target`; returns its tokens, log-probabilities and prefix-cache hit."""
    before = _cache_counters(base)
    body = {"model": "smol", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 1}  # fmt: skip
    if TARGETS[target] is not None:
        body["vllm_xargs"] = TARGETS[target]
    if salt is not None:
        body["cache_salt"] = salt
    reply = http_json(base + "/v1/completions", body)
    prompt_tokens = reply["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 30
    while (after := _cache_counters(base))[0] - before[0] < prompt_tokens:  # the step's stats reach /metrics
        assert time.monotonic() < deadline, f"/metrics never counted the request's lookup: {before} -> {after}"
        time.sleep(0.2)
    logprobs = reply["choices"][0]["logprobs"]
    return {"tokens": logprobs["tokens"], "logprobs": logprobs["token_logprobs"], "hit": after[1] - before[1],
            "prompt_tokens": prompt_tokens}  # fmt: skip


def _differs(got: dict, alone: dict) -> float:
    """The largest log-probability difference (inf when the tokens differ)."""
    if got["tokens"] != alone["tokens"]:
        return float("inf")
    return max(abs(a - b) for a, b in zip(got["logprobs"], alone["logprobs"], strict=True))


def test_requests_at_other_targets_do_not_reuse_the_checkpoints_prefix(sparse_ckpt, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(sparse_ckpt), "--host",
           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
           "--served-model-name", "smol", "--enable-prefix-caching",
           "--kv-cache-memory-bytes", str(256 * 2**20)]  # fmt: skip
    with server_process(cmd, port, tmp_path / "server.log") as server:
        base = server.base
        alone = {t: _complete(base, t, salt=f"alone-{t}") for t in TARGETS}  # cold cache, each kept apart
        assert min(a["prompt_tokens"] for a in alone.values()) > 700
        assert all(a["hit"] == 0 for a in alone.values()), {t: a["hit"] for t, a in alone.items()}
        laws = list(TARGETS)
        for i, a in enumerate(laws):  # three laws that the checks below can tell apart
            assert all(_differs(alone[a], alone[b]) > 10 * LOGPROB_TOL for b in laws[i + 1 :]), (a, alone)

        first = {t: _complete(base, t) for t in TARGETS}  # the checkpoint's target caches the prefix first
        again = {t: _complete(base, t) for t in TARGETS}
    report = {t: {"first": (first[t]["hit"], _differs(first[t], alone[t])),
                  "again": (again[t]["hit"], _differs(again[t], alone[t]))} for t in TARGETS}  # fmt: skip
    for t in TARGETS:  # (hit tokens, largest log-probability difference from alone)
        assert first[t]["hit"] == 0, report
        assert again[t]["hit"] >= 640, report  # the shared prefix, cut back to a multiple of 64
        assert _differs(first[t], alone[t]) <= LOGPROB_TOL, report
        assert _differs(again[t], alone[t]) <= LOGPROB_TOL, report
