"""benchmarks/studies/decode_levers.py: its model of served decode rows against the PyTorch reference, its helpers."""

from __future__ import annotations

import math

import pytest
import torch
from benchmark_modules import load_benchmark

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
from modelopt_ext.torch.kernels.sparsity.attention.semantics import RECENT_WINDOW, TILE_K


@pytest.fixture(scope="module")
def dl():
    return load_benchmark("studies/decode_levers", "decode_levers_under_test")


def _continuation(seed: int, keys: int = 2300, rows: int = 40, hq: int = 6, hkv: int = 2, d: int = 16):
    """A sequence of `keys` tokens whose last `rows` are a continuation (decode rows), with sink-like first keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, rows, d, generator=gen, dtype=torch.float64)
    k = torch.randn(hkv, keys, d, generator=gen, dtype=torch.float64) * 1.5
    k[:, :4] += 3.0 * q.mean(dim=(0, 1))
    v = torch.randn(hkv, keys, d, generator=gen, dtype=torch.float64)
    return q, k, v


def _scores(q, k, positions):
    """Scaled, causally masked scores [Hq, R, K padded to whole tiles] of the rows at `positions`."""
    keys = k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(q.shape[0] // k.shape[0], 0).transpose(1, 2)) * q.shape[-1] ** -0.5
    s.masked_fill_(torch.arange(keys)[None, :] > positions[:, None], -math.inf)
    return torch.nn.functional.pad(s, (0, -keys % TILE_K), value=-math.inf)


def _reference(q, k, v, c: float, gamma: float):
    """The package reference on the same rows as decode rows of one request (prompt = the keys before them)."""
    hq, rows, d = q.shape
    keys = k.shape[1]
    pages = math.ceil(keys / TILE_K)
    cache = [torch.full((pages * TILE_K, k.shape[0], d), float("nan"), dtype=torch.float64) for _ in range(2)]
    cache[0][:keys], cache[1][:keys] = k.transpose(0, 1), v.transpose(0, 1)  # NaN past kv_len: never read
    out, counts = paged_skip_softmax_attention(
        q.transpose(0, 1).contiguous(), cache[0].view(pages, TILE_K, -1, d), cache[1].view(pages, TILE_K, -1, d),
        torch.arange(pages, dtype=torch.int32)[None], torch.tensor([0, rows], dtype=torch.int32),
        torch.tensor([keys], dtype=torch.int32), softmax_scale=d**-0.5, return_skip_counts=True, backend="torch",
        log_scale_factors=torch.tensor([[c, c]], dtype=torch.float32),
        length_exponents=torch.tensor([gamma, gamma], dtype=torch.float32),
        prompt_lens=torch.tensor([keys - rows], dtype=torch.int32),
    )  # fmt: skip
    return out.transpose(0, 1), counts


@pytest.mark.parametrize(("lam_at_2k", "gamma"), [(0.3, 1.0), (0.6, 1.7)])
def test_decode_rows_decide_as_served(dl, lam_at_2k, gamma):
    """With the contract's window, the benchmark's decode rows drop what the reference drops for decode rows under
    the same law (counts: the reference counts per query head, the benchmark per GQA group) and give its output
    (float64 inputs; 1e-10: the same keys enter both softmaxes)."""
    q, k, v = _continuation(1)
    c = math.log(lam_at_2k) + gamma * math.log(2048)
    variant = dl.Variant(c, gamma)
    variant.dense = False
    out = dl.attention(variant, 0, q, k, v, q.shape[-1] ** -0.5)
    ref_out, counts = _reference(q, k, v, c, gamma)
    group = q.shape[0] // k.shape[0]
    skipped, visited = variant.counts()
    assert skipped > 0 and [group * skipped, group * visited] == [int(counts[0, 0, 1]), int(counts[0, 0, 0])]
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)


def test_levers_change_only_what_they_say(dl):
    """A larger window keeps each row's recent tiles and drops a subset of what the contract's window drops; a
    layer offset moves only that layer's λ; a dense layer decides nothing; dense is exact causal attention."""
    q, k, v = _continuation(2)
    scale = q.shape[-1] ** -0.5
    base = dl.Variant(math.log(0.6) + math.log(2048), 1.0)
    base.dense = False
    positions = torch.arange(2260, 2300)
    gaps = dl.score_gaps(_scores(q, k, positions), positions)
    contract = dl.protect_window(gaps, positions, RECENT_WINDOW)
    wide = dl.protect_window(gaps, positions, 512)
    assert torch.equal(contract == math.inf, (gaps == math.inf) | (contract == math.inf))
    assert ((wide == math.inf) >= (contract == math.inf)).all()
    assert (wide[:, :, (2299 - 511) // TILE_K:] == math.inf).all()  # the last row's 512 keys all kept
    dl.attention(base, 0, q, k, v, scale)
    wider = dl.Variant(base.c, base.gamma)
    wider.dense, wider.window = False, 512
    dl.attention(wider, 0, q, k, v, scale)
    assert 0 < wider.counts()[0] < base.counts()[0]
    shifted = dl.Variant(base.c, base.gamma)
    shifted.dense, shifted.layer_offsets = False, {3: -2.0, 4: dl.DENSE_LAYER}
    dl.attention(shifted, 0, q, k, v, scale)
    dl.attention(shifted, 3, q, k, v, scale)
    dl.attention(shifted, 4, q, k, v, scale)
    assert shifted.per_layer[0] == base.per_layer[0] and shifted.per_layer[3][0] < base.per_layer[0][0]
    assert 4 not in shifted.per_layer
    dense = dl.Variant(base.c, base.gamma)
    full = torch.matmul(q, k.repeat_interleave(3, 0).transpose(1, 2)) * scale
    full.masked_fill_(torch.arange(2300)[None, :] > positions[:, None], -math.inf)
    expected = torch.matmul(torch.softmax(full, -1), v.repeat_interleave(3, 0))
    torch.testing.assert_close(dl.attention(dense, 0, q, k, v, scale), expected, rtol=1e-12, atol=1e-12)


def test_equal_work_comparison_and_allocation(dl):
    """Perplexity changes are pooled over documents and interpolated at a skipped share; the allocation moves
    sparsity from the layer that pays for it to the one that does not, at no less skipped work than the law."""
    dense = {"docs": [{"nll": 10.0, "tokens": 10}, {"nll": 20.0, "tokens": 10}]}
    rows = [{"sparsity": 0.6, "docs": [{"nll": 10.0}, {"nll": 20.0}]},
            {"sparsity": 0.8, "docs": [{"nll": 11.0}, {"nll": 21.0}]}]  # fmt: skip
    assert dl.ppl_change(rows[1], dense) == pytest.approx(math.exp(2 / 20) - 1)
    assert dl.at_share(rows, dense, 0.7) == pytest.approx((math.exp(0.1) - 1) / 2)
    assert dl.at_share(rows, dense, 0.9) is None
    lo, hi = dl.bootstrap(rows, dense, 0.7, draws=200)
    assert lo <= dl.at_share(rows, dense, 0.7) <= hi
    sens = {"rows": [
        {"layer": 0, "offset": -1.0, "per_layer": {"0": 0.2}, "nll_delta": 0.5},
        {"layer": 0, "offset": 0.0, "per_layer": {"0": 0.5}, "nll_delta": 5.0},
        {"layer": 1, "offset": 0.0, "per_layer": {"1": 0.5}, "nll_delta": 0.1},
        {"layer": 1, "offset": 1.0, "per_layer": {"1": 0.9}, "nll_delta": 0.2},
    ]}  # fmt: skip
    assert dl.allocate(sens, 2) == {0: -1.0, 1: 1.0}  # mean share 0.55 >= the law's 0.5, NLL 0.7 instead of 5.1


def test_stronger_references_drop_a_superset(dl):
    """A larger reference max (the window's, or the row's true max) only lowers gaps: at the same λ it drops every
    tile version 4's running reference drops and more; anchor, window and unvisited tiles keep their marks."""
    q, k, v = _continuation(3)
    scale = q.shape[-1] ** -0.5
    dropped = {}
    for reference in ("running", "window", "row"):
        variant = dl.Variant(math.log(0.3) + math.log(2048), 1.0)
        variant.dense, variant.reference = False, reference
        dl.attention(variant, 0, q, k, v, scale)
        dropped[reference] = variant.counts()[0]
    assert 0 < dropped["running"] < dropped["window"] <= dropped["row"]
    positions = torch.arange(2260, 2300)
    full = _scores(q, k, positions)
    gaps = dl.score_gaps(full, positions)
    row = dl.stronger_reference(gaps, full, positions, "row", RECENT_WINDOW)
    assert (row <= gaps).all() and torch.equal(row == math.inf, gaps == math.inf)
    assert torch.equal(row == -math.inf, gaps == -math.inf)
    with pytest.raises(ValueError, match="unknown reference"):
        dl.stronger_reference(gaps, full, positions, "best", RECENT_WINDOW)
