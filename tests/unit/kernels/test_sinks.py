"""Attention sinks (gpt-oss) in every backend, against the float64 oracle (docs/skip_softmax.md, version 3).

A head's sink is a logit every row of the head sees with no value: it joins the softmax denominator (once, whatever
the key splits) and the skip test's reference max, like the anchor tile. Each backend (PyTorch reference, compiled
CPU kernel, Triton under the interpreter) is compared with the oracle written from the document
(skip_attention_helpers.oracle, float64): outputs at the dtype's tolerance, counts exactly, thresholds nudged off the
decision boundaries of the statistics *with* the sinks. The sinks are large enough to change both the output and
the decisions, so a backend that ignores them fails; cache slots past kv_len hold NaN/inf.
"""

from __future__ import annotations

import math

import pytest
import torch
from skip_attention_helpers import dense_attention_f64, kernel_backends, make_case, oracle, safe_log_lambda
from test_skip_softmax_semantics import TOL, assert_close64, run

CAP = 2.5


def _poison_past_kv_len(case, page: int) -> None:
    """NaN / inf in every cache slot past each sequence's kv_len that no sequence reads."""
    owned = {p for b, kv in enumerate(case.kv_lens) for p in case.block_table[b, : math.ceil(kv / page)].tolist()}
    for b, kv in enumerate(case.kv_lens):
        n_pages = math.ceil(kv / page)
        last = int(case.block_table[b, n_pages - 1])
        case.k_cache[last, kv % page or page :] = math.inf
        case.v_cache[last, kv % page or page :] = math.nan
        for junk in case.block_table[b, n_pages:].tolist():
            if junk not in owned:
                case.v_cache[junk] = math.nan


def _case(dtype=torch.float32, seed: int = 11):
    # prefill rows over several tiles (a chunk after a prefix), decode rows (one past a split: two splits), a short
    # sequence, a one-row prompt and a prefill chunk whose rows cross the split at 2048 (every split's reference max
    # starts from the sink); GQA 6 query heads over 2 KV heads
    case = make_case([70, 1, 1, 3, 1, 40], [200, 2300, 90, 3, 1, 2080], hq=6, hkv=2, d=32, page=16, dtype=dtype,
                     seed=seed, spread=2.0)  # fmt: skip
    _poison_past_kv_len(case, 16)
    return case


def _sinks(case, seed: int = 5) -> torch.Tensor:
    """One sink per query head across the rows' score maxima (6 to 15 on these cases: some heads' sinks above them,
    some below), so they change outputs and decisions."""
    g = torch.Generator().manual_seed(seed)
    hq = case.q.shape[1]
    return (torch.linspace(4.0, 16.0, hq) + 0.3 * torch.randn(hq, generator=g)).to(torch.float32)


def _safe_log_lams(case, sinks, log_lam: float, softcap: float = 0.0) -> torch.Tensor:
    stats = oracle(case, None, sinks=sinks, softcap=softcap).tile_stats
    return torch.tensor([[safe_log_lambda(log_lam, stats[b])] for b in range(case.batch)], dtype=torch.float64)


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_with_sinks_matches_float64(backend, dtype):
    case = _case(dtype)
    sinks = _sinks(case)
    out, counts = run(case, backend, sinks=sinks)
    assert counts is None
    expected = dense_attention_f64(case, sinks)
    assert_close64(out, expected, dtype)
    assert_close64(oracle(case, None, sinks=sinks).out, expected, torch.float64)
    assert (expected - dense_attention_f64(case)).abs().max() > 10 * TOL[dtype][0], "the sinks must change the output"


@pytest.mark.parametrize("backend", kernel_backends())
def test_sinks_join_the_skip_test(backend):
    case = _case()
    sinks = _sinks(case)
    log_lams = _safe_log_lams(case, sinks, -1.2)
    expected = oracle(case, log_lams, sinks=sinks)
    out, counts = run(case, backend, skip_threshold=log_lams[:, 0].exp().float(), counts=True, sinks=sinks)
    assert torch.equal(counts, expected.counts) and counts[1, 0, 1] > 0, "the decode row past a split drops tiles"
    assert_close64(out, expected.out, torch.float32)
    without = oracle(case, log_lams).counts
    assert (expected.counts[..., 1] > without[..., 1]).any(), "a sink above the tiles must drop more of them"


@pytest.mark.parametrize("backend", kernel_backends())
def test_calibration_counts_with_sinks(backend):
    """Calibration: the output stays dense (with the sinks) and every trial counts what serving would drop."""
    case = _case(seed=12)
    sinks = _sinks(case, seed=6)
    stats = oracle(case, None, sinks=sinks).tile_stats
    trials = [math.exp(safe_log_lambda(x, torch.cat(stats))) for x in (-3.0, -1.5, -0.5)]
    expected = oracle(case, torch.log(torch.tensor(trials, dtype=torch.float64)).expand(case.batch, -1),
                      calibrate=True, sinks=sinks)  # fmt: skip
    out, counts = run(case, backend, trials=trials, sinks=sinks)
    assert torch.equal(counts, expected.counts)
    assert counts[..., 1].sum(0).tolist() == sorted(counts[..., 1].sum(0).tolist()) and counts[..., 1].sum() > 0
    assert_close64(out, dense_attention_f64(case, sinks), torch.float32)


@pytest.mark.parametrize("backend", kernel_backends())
def test_sinks_are_not_soft_capped(backend):
    case = _case(seed=13)
    sinks = _sinks(case, seed=7) + 1.0  # some sinks above the cap: capping them would change every row
    log_lams = _safe_log_lams(case, sinks, -0.9, softcap=CAP)
    expected = oracle(case, log_lams, sinks=sinks, softcap=CAP)
    out, counts = run(case, backend, skip_threshold=log_lams[:, 0].exp().float(), counts=True, sinks=sinks,
                      logits_soft_cap=CAP)  # fmt: skip
    assert torch.equal(counts, expected.counts) and counts[..., 1].sum() > 0
    assert_close64(out, expected.out, torch.float32)


def test_reference_float64_with_sinks():
    case = _case(torch.float64, seed=14)
    sinks = _sinks(case, seed=8)
    log_lams = _safe_log_lams(case, sinks, -1.0)
    expected = oracle(case, log_lams, sinks=sinks)
    out, counts = run(case, "torch", skip_threshold=log_lams[:, 0].exp().float(), counts=True, sinks=sinks)
    assert torch.equal(counts, expected.counts)
    assert_close64(out, expected.out, torch.float64)


def test_bad_sinks_are_refused():
    case = _case()
    hq = case.q.shape[1]
    with pytest.raises(ValueError, match=r"sinks must have shape \[Hq\]"):
        run(case, "torch", sinks=torch.zeros(hq + 1))
    with pytest.raises(ValueError, match="sinks must be finite"):
        run(case, "torch", sinks=torch.full((hq,), math.nan))
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        run(case, "torch", sinks=torch.zeros(hq, dtype=torch.int32))
    with pytest.raises(TypeError, match="sinks must be None or a"):
        run(case, "torch", sinks=[0.0] * hq)
