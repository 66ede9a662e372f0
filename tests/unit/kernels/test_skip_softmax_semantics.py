"""Both backends (PyTorch reference and Triton under the interpreter) against docs/skip_softmax.md.

The float64 oracle in skip_attention_helpers.py implements the document tile by tile; every test compares a
backend's output with it (stated tolerances) and its counts for equality. Thresholds are nudged away from tile
decision boundaries (`safe_lambdas`) so float32 rounding cannot flip a decision.
"""

from __future__ import annotations

import math

import pytest
import torch
from skip_attention_helpers import (
    LAYOUTS,
    dense_attention_f64,
    gather_dense,
    log_lams_tensor,
    make_case,
    oracle,
    quantile_lambda,
    safe_lambdas,
)

from modelopt_ext.torch.kernels.sparsity.attention import SPLIT_TOKENS, paged_skip_softmax_attention, semantics

BACKENDS = ["torch", "triton"]
# (atol, rtol) of a backend's output vs float64; fp16 outputs are rounded to fp16 (and Triton's P·V uses fp16 P).
TOL = {torch.float32: (3e-5, 1e-4), torch.float16: (4e-3, 4e-3), torch.float64: (1e-10, 1e-10)}
EXTRA_ROWS = 3


def run(case, backend, *, skip_threshold=None, trials=None, counts=False, **law):
    """Call the API with `out` poisoned with NaN (and extra rows that must stay untouched)."""
    total_q, hq, d = case.q.shape
    out = torch.full((total_q + EXTRA_ROWS, hq, d), math.nan, dtype=case.q.dtype)
    res = paged_skip_softmax_attention(
        *case.args(),
        softmax_scale=case.scale,
        skip_threshold=skip_threshold,
        threshold_trials=trials,
        return_skip_counts=counts,
        out=out,
        backend=backend,
        **law,
    )
    o, c = res if isinstance(res, tuple) else (res, None)
    assert o is out
    assert torch.isnan(out[total_q:]).all(), "rows past total_q must be left untouched"
    assert not torch.isnan(out[:total_q]).any(), "every row < total_q must be written"
    return out[:total_q], c


def assert_close64(out, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.to(torch.float64), expected, atol=atol, rtol=rtol)


def mixed_case(**kw):
    # prefill (2 query blocks, a chunk from an aligned start), decode, empty, one-token-prefill-sized chunk of 2,
    # decode at kv_len 1; long enough (pos >= 255) for tiles before the recent window
    return make_case([80, 1, 0, 2, 1, 33], [400, 700, 7, 70, 1, 33], **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dense_matches_float64(backend, dtype):
    case = mixed_case(dtype=dtype, hq=6, hkv=2, seed=1)
    out, counts = run(case, backend)
    assert counts is None
    assert_close64(out, dense_attention_f64(case), dtype)


def test_reference_float64_inputs_match_float64_oracle():
    case = mixed_case(dtype=torch.float64, seed=2)
    out, _ = run(case, "torch")
    assert_close64(out, dense_attention_f64(case), torch.float64)
    lam = torch.tensor([quantile_lambda(case, b, 0.6) for b in range(case.batch)])
    out, counts = run(case, "torch", skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    assert torch.equal(counts, ref.counts)
    assert counts[..., 1].sum() > 0
    assert_close64(out, ref.out, torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_serving_per_sequence_lambda_matches_oracle(backend, dtype):
    case = mixed_case(dtype=dtype, seed=3, hq=4, hkv=1)
    lam = torch.tensor([quantile_lambda(case, b, 0.5) for b in range(case.batch)])
    out, counts = run(case, backend, skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    assert counts.dtype == torch.int64 and counts.shape == (case.batch, 1, 2)
    assert torch.equal(counts, ref.counts)
    assert (counts[[0, 1], 0, 1] > 0).all(), "the test must actually skip tiles in prefill and decode"
    assert (counts[..., 1] < counts[..., 0]).all() or (counts[2] == 0).all()
    assert_close64(out, ref.out, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_calibration_counts_equal_serving_counts(backend):
    case = mixed_case(seed=4, hq=2, hkv=1)
    lams = safe_lambdas(case, torch.tensor([1e-2, 0.1, 0.7]).expand(case.batch, -1).contiguous())
    out_cal, cal = run(case, backend, trials=lams)
    expected = oracle(case, log_lams_tensor(lams, case.batch), calibrate=True)
    assert cal.shape == (case.batch, 3, 2)
    assert torch.equal(cal, expected.counts)
    assert (cal[[0, 1], 2, 1] > 0).all()
    # calibration output is dense
    out_dense, _ = run(case, backend)
    torch.testing.assert_close(out_cal, out_dense, atol=0, rtol=0)
    for t in range(lams.shape[1]):
        _, served = run(case, backend, skip_threshold=lams[:, t].contiguous(), counts=True)
        assert torch.equal(served[:, 0], cal[:, t]), f"trial {t}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_dense_thresholds_skip_nothing(backend):
    case = mixed_case(seed=5, hq=2, hkv=1)
    dense, _ = run(case, backend)
    visited = oracle(case, log_lams_tensor(0.0, case.batch)).counts[..., 0]
    dense_lams = [1.0, 1.5, 0.0, -0.3, math.nan, math.inf]  # one per sequence
    out, counts = run(case, backend, skip_threshold=torch.tensor(dense_lams), counts=True)
    torch.testing.assert_close(out, dense, atol=0, rtol=0)
    assert (counts[..., 1] == 0).all() and torch.equal(counts[..., 0], visited)
    out, counts = run(case, backend, skip_threshold=math.nan, counts=True)
    torch.testing.assert_close(out, dense, atol=0, rtol=0)
    assert (counts[..., 1] == 0).all()
    _, cal = run(case, backend, trials=dense_lams)
    assert (cal[..., 1] == 0).all() and torch.equal(cal[..., 0], visited.expand(-1, len(dense_lams)))
    # λ = None with return_skip_counts: dense, counted
    out, counts = run(case, backend, counts=True)
    torch.testing.assert_close(out, dense, atol=0, rtol=0)
    assert (counts[..., 1] == 0).all() and torch.equal(counts[..., 0], visited)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance(backend):
    case = mixed_case(seed=6, hq=3, hkv=1)
    lam = torch.tensor([0.05, 0.1, 0.3, 0.02, 0.5, 0.08])
    lam = safe_lambdas(case, lam)
    out, counts = run(case, backend, skip_threshold=lam, counts=True)
    for b in range(case.batch):
        sub = case.subset(b)
        o_b, c_b = run(sub, backend, skip_threshold=lam[b : b + 1], counts=True)
        q0, q1 = int(case.cu_seqlens_q[b]), int(case.cu_seqlens_q[b + 1])
        assert torch.equal(o_b, out[q0:q1]), f"sequence {b}"
        assert torch.equal(c_b[0], counts[b]), f"sequence {b}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_one_token_sequences(backend):
    case = make_case([0, 1, 0, 1], [0, 1, 5, 9], seed=7)
    out, counts = run(case, backend, skip_threshold=0.5, counts=True)
    assert out.shape[0] == 2
    assert torch.equal(counts[[0, 2]], torch.zeros(2, 1, 2, dtype=torch.int64))
    # one visited tile per query head, first tile never skipped
    assert counts[1].tolist() == [[4, 0]] and counts[3].tolist() == [[4, 0]]
    assert_close64(out, dense_attention_f64(case), torch.float32)
    # all-empty batch
    empty = make_case([0, 0], [3, 0], seed=8)
    out, counts = run(empty, backend, skip_threshold=0.5, counts=True)
    assert out.shape[0] == 0 and (counts == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_rows_use_anchored_splits(backend):
    kv = 2 * SPLIT_TOKENS + 300  # three splits
    case = make_case([1, 1], [kv, SPLIT_TOKENS + 1], hq=2, hkv=1, d=32, page=128, seed=9)
    lam = torch.tensor([quantile_lambda(case, b, 0.5) for b in range(2)])
    out, counts = run(case, backend, skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, 2))
    assert torch.equal(counts, ref.counts)
    n_tiles = [math.ceil(kv / 64), math.ceil((SPLIT_TOKENS + 1) / 64)]
    assert counts[:, 0, 0].tolist() == [2 * n for n in n_tiles]
    assert (counts[:, 0, 1] > 0).all()
    # only tile 0 and the recent window are exempt: a split's first tile is tested against the anchor (every
    # statistic before the window is finite)
    for st, n, length in zip(ref.tile_stats, n_tiles, [kv, SPLIT_TOKENS + 1], strict=True):
        before_window = semantics.first_droppable_window_tile(length - 1) - 1
        assert st.numel() == 2 * (n - 1) and int(torch.isfinite(st).sum()) == 2 * before_window
    assert_close64(out, ref.out, torch.float32)
    dense, _ = run(case, backend)
    assert_close64(dense, dense_attention_f64(case), torch.float32)


def chunk_of(case, start: int, stop: int):
    """Rows start..stop-1 of sequence 0 (a whole prompt) as vLLM would run that chunk, the cache holding keys
    0..stop-1, in one batch with the case's other sequences (each with all its rows)."""
    q0 = case.q[: case.q_lens[0]]
    q = torch.cat([q0[start:stop], case.q[case.q_lens[0] :]])
    q_lens = [stop - start, *case.q_lens[1:]]
    kv_lens = [stop, *case.kv_lens[1:]]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return type(case)(
        q=q, k_cache=case.k_cache, v_cache=case.v_cache, block_table=case.block_table, cu_seqlens_q=cu,
        seq_lens_k=torch.tensor(kv_lens, dtype=torch.int32), scale=case.scale, q_lens=q_lens, kv_lens=kv_lens,
    )  # fmt: skip


def law_kwargs(case, log_sf, gamma, prompt_lens):
    return dict(
        log_scale_factors=torch.tensor(log_sf, dtype=torch.float32).expand(case.batch, 2).contiguous(),
        length_exponents=torch.tensor(gamma, dtype=torch.float32),
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.int32),
    )


def law_oracle(case, log_sf, gamma, prompt_lens):
    law = (torch.tensor([log_sf] * case.batch).unsqueeze(1), torch.tensor([gamma] * case.batch), prompt_lens)
    return oracle(case, None, law=law)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("others", [False, True], ids=["alone", "batched"])
def test_rows_do_not_depend_on_chunking_or_batching(backend, others):
    """docs/skip_softmax.md's promise: a prompt served whole or cut into chunks at multiples of 64 (the last of a
    single token), alone or beside other sequences, gives every row the same output and the same counts; generated
    rows use the decode law whether they run as a decode step or inside a longer chunk."""
    prompt = 321
    q_lens, kv_lens = ([prompt + 1, 1, 40], [prompt + 1, 120, 40]) if others else ([prompt + 1], [prompt + 1])
    case = make_case(q_lens, kv_lens, hq=4, hkv=2, d=32, page=16, seed=21)
    prompts = [prompt, *(kv - 1 if ql == 1 else kv for ql, kv in zip(q_lens[1:], kv_lens[1:], strict=True))]
    # ModelOpt's law per phase (γ = 1): sf = λ · n with n = prompt length (prefill) or position + 1 (decode).
    log_sf, gamma = [math.log(0.12 * prompt), math.log(0.1 * prompt)], [1.0, 1.0]
    whole = chunk_of(case, 0, prompt)
    out_whole, c_whole = run(whole, backend, counts=True, **law_kwargs(whole, log_sf, gamma, prompts))
    expected = law_oracle(whole, log_sf, gamma, prompts)
    assert torch.equal(c_whole, expected.counts) and c_whole[0, 0, 1] > 0
    assert_close64(out_whole, expected.out, torch.float32)
    cuts = [0, 64, 192, 320, prompt]
    total = torch.zeros_like(c_whole[0])
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        part = chunk_of(case, a, b)
        o, c = run(part, backend, counts=True, **law_kwargs(part, log_sf, gamma, prompts))
        torch.testing.assert_close(o[: b - a], out_whole[a:b], atol=2e-6, rtol=1e-5)
        total += c[0]
    assert torch.equal(total, c_whole[0]), "counts must not depend on chunking"
    # the generated token at position `prompt`: a decode row with n = prompt + 1
    step = chunk_of(case, prompt, prompt + 1)
    o_step, c = run(step, backend, counts=True, **law_kwargs(step, log_sf, gamma, prompts))
    expected = law_oracle(step, log_sf, gamma, prompts)
    assert torch.equal(c, expected.counts)
    assert_close64(o_step, expected.out, torch.float32)
    # the same position inside a longer chunk (recomputed after preemption) gives the same row
    tail = chunk_of(case, 256, prompt + 1)
    o_tail, _ = run(tail, backend, **law_kwargs(tail, log_sf, gamma, prompts))
    torch.testing.assert_close(o_tail[prompt - 256 : prompt + 1 - 256], o_step[:1], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_nan_past_kv_len_never_reaches_outputs(backend):
    """Reused blocks hold anything past kv_len: NaN/inf there must not reach an output or a count."""
    for q_lens, kv_lens, page in (([3], [3], 16), ([1], [65], 128), ([70, 1], [130, 65], 64)):
        case = make_case(q_lens, kv_lens, hq=4, hkv=2, d=32, page=page, seed=23)
        clean = oracle(case, log_lams_tensor(0.05, case.batch))
        for b, kv in enumerate(kv_lens):
            n_pages = math.ceil(kv / page)
            last = int(case.block_table[b, n_pages - 1])
            case.k_cache[last, kv % page or page :] = math.inf
            case.v_cache[last, kv % page or page :] = math.nan
            for junk in case.block_table[b, n_pages:].tolist():  # pages past the sequence
                if junk not in case.block_table[:, :n_pages].flatten().tolist():
                    case.v_cache[junk] = math.nan
        lam = safe_lambdas(case, torch.full((case.batch,), 0.05))
        out, counts = run(case, backend, skip_threshold=lam, counts=True)
        ref = oracle(case, log_lams_tensor(lam, case.batch))
        assert torch.equal(counts, ref.counts) and torch.equal(counts[..., 0], clean.counts[..., 0])
        assert_close64(out, ref.out, torch.float32)
        dense, _ = run(case, backend)
        assert_close64(dense, dense_attention_f64(case), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_layouts(backend, layout):
    case = make_case([70, 1, 3], [390, 600, 40], hq=4, hkv=2, d=32, page=16, layout=layout, seed=10)
    base = make_case([70, 1, 3], [390, 600, 40], hq=4, hkv=2, d=32, page=16, layout="nhd", seed=10)
    lam = safe_lambdas(base, torch.tensor([0.1, 0.1, 0.1]))
    out, counts = run(case, backend, skip_threshold=lam, counts=True)
    ref = oracle(base, log_lams_tensor(lam, 3))
    assert torch.equal(counts, ref.counts)
    assert counts[..., 1].sum() > 0
    assert_close64(out, ref.out, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_queries_and_output(backend):
    check_strided_queries_and_output(backend)


def check_strided_queries_and_output(backend: str, layout: str = "nhd", seed: int = 11) -> None:
    """q as a view into packed QKV and `out` a strided view: only rows < total_q and the view's columns change."""
    case = make_case([65, 1], [100, 20], hq=4, hkv=2, d=32, layout=layout, seed=seed)
    total_q = case.q.shape[0]
    qkv = torch.randn(total_q, 8, 32)  # q is a slice of a packed qkv tensor
    qkv[:, :4] = case.q
    q = qkv[:, :4]
    assert not q.is_contiguous()
    big = torch.full((total_q + 2, 4, 64), math.nan)
    out = big[..., 16:48]  # [total_q + 2, Hq, D] with row stride 256
    lam = safe_lambdas(case, torch.tensor([0.2, 0.2]))
    _, counts = paged_skip_softmax_attention(
        q, case.k_cache, case.v_cache, case.block_table, case.cu_seqlens_q, case.seq_lens_k,
        softmax_scale=case.scale, skip_threshold=lam, return_skip_counts=True, out=out, backend=backend,
    )  # fmt: skip
    ref = oracle(case, log_lams_tensor(lam, 2))
    assert torch.equal(counts, ref.counts)
    assert_close64(out[:total_q], ref.out, torch.float32)
    assert torch.isnan(big[total_q:]).all() and torch.isnan(big[:, :, :16]).all() and torch.isnan(big[:, :, 48:]).all()


def test_reference_rejects_kv_shorter_than_queries():
    case = make_case([5], [5], seed=12)
    case.seq_lens_k[0] = 3
    with pytest.raises(ValueError, match="must include"):
        run(case, "torch")


def test_decode_tile_drops_are_the_oracles_decisions():
    """reference.decode_tile_drops (the benchmark's V-tile share) drops what the float64 oracle counts, across a
    split boundary; a decode row's GQA group decides together (version 4), and never drops its recent window."""
    from modelopt_ext.torch.kernels.sparsity.attention.reference import decode_tile_drops

    kv = SPLIT_TOKENS + 600
    case = make_case([1], [kv], hq=6, hkv=2, seed=int(torch.randint(0, 2**30, ()).item()))
    lam = quantile_lambda(case, 0, 0.6)
    k = gather_dense(case.k_cache, case.block_table[0], kv)
    drops = decode_tile_drops(case.q[0], k, case.scale, lam)  # [Hkv, group, n_tiles]
    assert drops.shape == (2, 3, math.ceil(kv / 64))
    counts = oracle(case, log_lams_tensor(lam, 1)).counts
    assert int(drops.sum()) == int(counts[0, 0, 1]) > 0
    assert not drops[..., 0].any()  # the anchor tile
    assert not drops[..., semantics.first_droppable_window_tile(kv - 1) :].any()  # the recent window
    assert torch.equal(drops, drops[:, :1].expand_as(drops))  # the group's heads agree
