"""benchmarks/studies/decision_unit_quality.py: its rules against the PyTorch reference, and their definitions."""

from __future__ import annotations

import math

import pytest
import torch
from benchmark_modules import load_benchmark

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
from modelopt_ext.torch.kernels.sparsity.attention.semantics import TILE_K


@pytest.fixture(scope="module")
def dq():
    return load_benchmark("studies/decision_unit_quality", "decision_unit_quality_under_test")


def _case(seed: int, n: int = 2300, hq: int = 4, hkv: int = 2, d: int = 16):
    """A prompt of n tokens (over one 2048-key split boundary) with a peaked first tile, like real attention."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, n, d, generator=gen, dtype=torch.float64)
    k = torch.randn(hkv, n, d, generator=gen, dtype=torch.float64) * 1.5
    k[:, :4] += 3.0 * q.mean(dim=(0, 1))  # a few sink-like keys
    v = torch.randn(hkv, n, d, generator=gen, dtype=torch.float64)
    return q, k, v


def _reference(q, k, v, lam: float, prompt_len: int | None = None):
    """The package reference on the same prompt in a paged cache (page = TILE_K), λ on every row, with counts;
    `prompt_len` < n makes the rows from it on decode rows (decided per GQA group)."""
    hq, n, d = q.shape
    pages = math.ceil(n / TILE_K)
    cache = [torch.full((pages * TILE_K, k.shape[0], d), float("nan"), dtype=torch.float64) for _ in range(2)]
    cache[0][:n], cache[1][:n] = k.transpose(0, 1), v.transpose(0, 1)  # NaN past kv_len: must never be read
    out, counts = paged_skip_softmax_attention(
        q.transpose(0, 1).contiguous(), cache[0].view(pages, TILE_K, -1, d), cache[1].view(pages, TILE_K, -1, d),
        torch.arange(pages, dtype=torch.int32)[None], torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32), softmax_scale=d**-0.5, skip_threshold=lam, return_skip_counts=True,
        backend="torch", prompt_lens=None if prompt_len is None else torch.tensor([prompt_len], dtype=torch.int32),
    )  # fmt: skip
    return out.transpose(0, 1), counts


@pytest.mark.parametrize("lam", [3e-3, 5e-2])
@pytest.mark.parametrize("rule", ["block64+win128+ref", "gqa+win128+ref"])
def test_version_5_rules_are_the_contract(dq, lam, rule):
    """Contract version 5 is `block64+win128+ref` for prompt rows and `gqa+win128+ref` for decode rows: each drops what
    the reference drops (same count) and its masked softmax gives the reference's output (float64 inputs; 1e-10:
    the same keys enter both softmaxes, in another order). The reference takes every row after the first as a
    decode row for the group rule (a teacher-forced continuation)."""
    q, k, v = _case(1)
    rec = dq.Recorder(group=2)
    rec.rule, rec.ln_lambda = rule, math.log(lam)
    out = dq.decided_attention(rec, q, k, v, q.shape[-1] ** -0.5)
    ref_out, counts = _reference(q, k, v, lam, prompt_len=None if rule.startswith("block") else 1)
    assert counts.sum().item() > 0 and rec.counts["row"] == [int(counts[0, 0, 1]), int(counts[0, 0, 0])]
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)


def test_block_and_group_rules_agree_within_their_unit(dq):
    """Block rule: every visiting row of an aligned block decides alike, and drops a subset of the row rule's
    drops; 1-row blocks are the row rule. Group rule: the query heads of a KV head decide alike."""
    q, k, v = _case(2)
    s = torch.matmul(q, k.repeat_interleave(2, dim=0).transpose(1, 2)) * q.shape[-1] ** -0.5
    n = q.shape[1]
    s.masked_fill_(torch.arange(n)[None, :] > torch.arange(n)[:, None], -math.inf)
    gaps = dq.score_gaps(torch.nn.functional.pad(s, (0, -n % TILE_K), value=-math.inf), torch.arange(n))
    ln_lambda = math.log(0.6)  # random keys agree little: a large λ so that blocks and groups drop tiles
    row = dq.drops(gaps, ln_lambda)
    block = dq.drops(dq.effective_gaps("block64", gaps, 2), ln_lambda)
    visited = dq.visited_mask(n, gaps.shape[-1])
    assert block.sum() > 0 and not (block & ~row).any()
    for b0 in range(0, n, 64):
        rows = slice(b0, min(n, b0 + 64))
        decided = torch.where(visited[rows], block[:, rows].int(), -1)  # -1: the row does not visit the tile
        for t in range(gaps.shape[-1]):
            values = decided[:, :, t]
            for h in range(values.shape[0]):
                assert len(set(values[h][values[h] >= 0].tolist())) <= 1
    assert torch.equal(dq.drops(dq.effective_gaps("block1", gaps, 2), ln_lambda), row)
    group = dq.drops(dq.effective_gaps("gqa", gaps, 2), ln_lambda).view(2, 2, n, -1)
    assert group.sum() > 0 and torch.equal(group[:, 0], group[:, 1])
    shares = dq.skipped_shares(gaps, ln_lambda, 2)
    assert shares["row"][0] == int(row.sum()) and shares["prog64"][0] <= shares["row"][0]


def test_window_lever_keeps_each_rows_recent_tiles(dq):
    """`+winW`: a row never drops a tile holding one of its last W keys (its diagonal tile for any W), and otherwise
    decides as its rule does; the window applies before the rule's AND, so a block or group keeps what any of its
    rows protects. Unknown rules and windows are refused."""
    q, k, v = _case(3)
    s = torch.matmul(q, k.repeat_interleave(2, dim=0).transpose(1, 2)) * q.shape[-1] ** -0.5
    n = q.shape[1]
    s.masked_fill_(torch.arange(n)[None, :] > torch.arange(n)[:, None], -math.inf)
    gaps = dq.score_gaps(torch.nn.functional.pad(s, (0, -n % TILE_K), value=-math.inf), torch.arange(n))
    ln_lambda = math.log(0.6)
    row = dq.drops(gaps, ln_lambda)
    for window in (1, 200):
        windowed = dq.drops(dq.effective_gaps(f"row+win{window}", gaps, 2), ln_lambda)
        for p in (70, 700, n - 1):
            recent = range(max(0, p - window + 1) // TILE_K, p // TILE_K + 1)
            assert not windowed[:, p, list(recent)].any()
            older = [t for t in range(1, p // TILE_K + 1) if t not in recent]
            assert torch.equal(windowed[:, p, older], row[:, p, older])
        assert windowed.sum() > 0 and not (windowed & ~row).any()
    group = dq.drops(dq.effective_gaps("gqa+win200", gaps, 2), ln_lambda)
    assert not (group & ~dq.drops(dq.effective_gaps("gqa", gaps, 2), ln_lambda)).any()
    for bad in ("rows", "gqa+win0", "gqa+winx", "block+win64"):
        with pytest.raises(ValueError, match="unknown rule"):
            dq.split_rule(bad)
    assert dq.split_rule("block64+win256") == ("block64", 256)


def test_window_reference_lever_drops_more_at_the_same_lambda(dq):
    """`+ref`: the row's reference max also takes its window tiles' max, which only lowers gaps, so at one λ a rule
    with it drops a superset of the rule without it; it needs a window."""
    q, k, v = _case(4)
    dropped = {}
    for rule in ("block64+win128", "block64+win128+ref", "gqa+win128", "gqa+win128+ref"):
        rec = dq.Recorder(group=2)
        rec.rule, rec.ln_lambda = rule, math.log(0.9)  # random keys agree little: blocks need a large λ
        dq.decided_attention(rec, q, k, v, q.shape[-1] ** -0.5)
        dropped[rule] = rec.counts["row"][0]
    assert 0 < dropped["block64+win128"] < dropped["block64+win128+ref"]
    assert 0 < dropped["gqa+win128"] < dropped["gqa+win128+ref"]
    assert dq.split_rule("gqa+win128+ref") == ("gqa", 128) and dq.uses_window_reference("gqa+win128+ref")
    with pytest.raises(ValueError, match="needs a window"):
        dq.split_rule("gqa+ref")
