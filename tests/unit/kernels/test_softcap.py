"""Logit soft-capping (Gemma 2's `attn_logit_softcapping`) in every backend, against the float64 oracle.

docs/skip_softmax.md: with a cap, every score becomes cap·tanh(score / cap) before the skip test and the softmax,
as vLLM's own backends apply it. Each backend (PyTorch reference, compiled CPU kernel, Triton under the interpreter)
is compared with the oracle written from the document (skip_attention_helpers.oracle, float64): outputs at the
dtype's tolerance, counts exactly, thresholds nudged off the capped scores' decision boundaries. A cap small
enough to change the scores is used, so an ignored cap fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from skip_attention_helpers import kernel_backends, make_case, oracle, safe_log_lambda
from test_skip_softmax_semantics import TOL, assert_close64, run

CAP = 2.5  # the cases' scores reach several units: the cap changes them, and the decisions


def _case(dtype=torch.float32):
    # prefill rows over several tiles (a chunk from position 260, not a multiple of 64: its first block is partial),
    # decode rows (one past a split), a short sequence; long enough (pos >= 255) for tiles before the recent window
    return make_case([70, 1, 1, 3], [330, 2300, 300, 3], hq=4, hkv=2, d=32, page=16, dtype=dtype, seed=7, spread=2.0)


@pytest.mark.parametrize("backend", kernel_backends())
def test_dense_softcap_matches_float64(backend):
    case = _case()
    out, _ = run(case, backend, logits_soft_cap=CAP)
    assert_close64(out, oracle(case, None, softcap=CAP).out, torch.float32)
    uncapped = oracle(case, None).out
    assert (out.double() - uncapped).abs().max() > 10 * TOL[torch.float32][0], "the cap must change the output"


@pytest.mark.parametrize("backend", kernel_backends())
def test_softcap_is_applied_before_the_skip_test(backend):
    case = _case()
    stats = oracle(case, None, softcap=CAP).tile_stats
    # capped scores lie within ±CAP, so their gaps are small: a λ close to 1 (decode groups and prompt blocks AND
    # their rows' tests, version 4)
    log_lams = torch.tensor([[safe_log_lambda(-0.05, stats[b])] for b in range(case.batch)], dtype=torch.float64)
    expected = oracle(case, log_lams, softcap=CAP)
    out, counts = run(case, backend, skip_threshold=log_lams[:, 0].exp().float(), counts=True, logits_soft_cap=CAP)
    assert torch.equal(counts, expected.counts) and (counts[:2, 0, 1] > 0).all(), "prefill and decode drop tiles"
    assert_close64(out, expected.out, torch.float32)
    uncapped = oracle(case, log_lams).counts
    assert not torch.equal(uncapped, expected.counts), "capped scores must drop different tiles"


def test_bad_cap_is_refused():
    case = _case()
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            run(case, "torch", logits_soft_cap=bad)
