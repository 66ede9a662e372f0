"""The compiled CPU kernel (backend="cpu") on FP8 KV caches (docs/skip_softmax.md "Inputs", issue #66).

A slot's key and value ARE `float(k8) · k_scale` and `float(v8) · v_scale`: every case here quantizes random K/V
(make_case's, with sinks and spiky keys) to float8_e4m3fn or float8_e5m2 bytes, reads them in place through vLLM's
CPU `vec` layout (uint8 storage viewed as FP8, K stored transposed per block and head: last-dim stride = page) or a
plain NHD view, and compares with the float64 oracle run on float64 queries and the dequantized float64 caches
(`k8.double() * k_scale`): outputs within the tolerances of test_cpu_kernel.py (the kernel accumulates in fp32 and
rounds the output to the query's dtype; FP8 values are exact in fp32, so quantization adds no error of its own),
counts exactly (thresholds are nudged off every unit statistic, `safe_log_lambda`, so fp32 rounding of a score
cannot flip a decision). Every byte of the cache no sequence reads (slots past kv_len, unused pages) is an FP8 NaN,
and output rows past total_q are NaN that must stay untouched. With power-of-two scales the kernel's results are
bitwise those of the same kernel on the dequantized cache in the query's dtype (the scales fold exactly).
"""

from __future__ import annotations

import math

import pytest
import torch
from skip_attention_helpers import Case, make_case, oracle, safe_log_lambda
from test_skip_softmax_semantics import chunk_of, run

from modelopt_ext.torch.kernels.sparsity.attention import SPLIT_TOKENS, api, cpu_kernel, semantics

# (atol, rtol) vs float64 on the same (exact) dequantized values, as in test_cpu_kernel.py.
TOL = {torch.float32: (3e-5, 1e-4), torch.bfloat16: (2e-2, 1e-2), torch.float16: (4e-3, 4e-3)}
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
K_SCALE, V_SCALE = 0.37, 1.9
NAN_BYTE = 0x7F  # NaN in both formats (e4m3fn: S.1111.111; e5m2: S.11111.11)


@pytest.fixture(autouse=True)
def _needs_kernel():
    if cpu_kernel.unavailable_reason() is not None:
        pytest.skip(f"compiled CPU kernel unavailable: {cpu_kernel.unavailable_reason()}")


def fp8_views(k8: torch.Tensor, v8: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[blocks, page, H, D] FP8 views of logical FP8 K/V copied into `layout` storage: "vec" is vLLM's CPU cache
    ([blocks, H, page, 2D] uint8 seen as [blocks, H, 2 page, D]: per block and head K transposed, element (t, d) at
    d·page + t, then V rows; the views plugins/vllm/kv_cache.cpu_attn_kv_cache_views builds), "nhd" a plain copy."""
    nb, page, h, d = k8.shape
    if layout == "nhd":
        return k8.clone(), v8.clone()
    assert layout == "vec", layout
    storage = torch.empty(nb, h, page, 2 * d, dtype=torch.uint8)
    s_block, s_head = storage.stride(0), storage.stride(1)
    size = (nb, page, h, d)
    k_bytes = torch.as_strided(storage, size, (s_block, 1, s_head, page))
    v_bytes = torch.as_strided(storage, size, (s_block, d, s_head, 1), page * d)
    k_bytes.copy_(k8.view(torch.uint8))
    v_bytes.copy_(v8.view(torch.uint8))
    fp8 = storage.view(k8.dtype)
    k = torch.as_strided(fp8, size, (s_block, 1, s_head, page))
    v = torch.as_strided(fp8, size, (s_block, d, s_head, 1), page * d)
    assert k.stride(3) == page and k.data_ptr() == storage.data_ptr()
    return k, v


def read_slots(case: Case) -> torch.Tensor:
    """bool [blocks, page]: the slots some sequence reads (positions < kv_len through its block table)."""
    nb, page = case.k_cache.shape[:2]
    used = torch.zeros(nb, page, dtype=torch.bool)
    for b, kv in enumerate(case.kv_lens):
        if case.q_lens[b] == 0:
            continue
        pos = torch.arange(kv)
        used[case.block_table[b, pos // page].long(), pos % page] = True
    return used


def fp8_case(q_lens, kv_lens, *, fp8, dtype=torch.float32, layout="vec", k_scale=K_SCALE, v_scale=V_SCALE,
             **kw) -> tuple[Case, Case]:  # fmt: skip
    """(the kernel's case, the oracle's case): make_case's K/V quantized to `fp8` (k / k_scale rounded, as vLLM's
    write does), every slot no sequence reads a NaN byte, queries in `dtype`; the oracle's case holds the same
    queries in float64 and the dequantized caches in float64."""
    base = make_case(q_lens, kv_lens, dtype=torch.float32, layout="nhd", **kw)
    k8 = (base.k_cache / k_scale).to(fp8)
    v8 = (base.v_cache / v_scale).to(fp8)
    unread = ~read_slots(base)
    for t in (k8, v8):
        t.view(torch.uint8)[unread] = NAN_BYTE
    k_view, v_view = fp8_views(k8, v8, layout)
    q = base.q.to(dtype)
    common = dict(block_table=base.block_table, cu_seqlens_q=base.cu_seqlens_q, seq_lens_k=base.seq_lens_k,
                  scale=base.scale, q_lens=base.q_lens, kv_lens=base.kv_lens)  # fmt: skip
    kernel_case = Case(q=q, k_cache=k_view, v_cache=v_view, **common)
    oracle_case = Case(q=q.double(), k_cache=k8.double() * k_scale, v_cache=v8.double() * v_scale, **common)
    return kernel_case, oracle_case


def run_fp8(case: Case, k_scale=K_SCALE, v_scale=V_SCALE, **kw):
    """The API on backend="cpu" (out poisoned, rows past total_q checked untouched: test_skip_softmax_semantics.run)."""
    return run(case, "cpu", k_scale=k_scale, v_scale=v_scale, **kw)


def close(out, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.to(torch.float64), expected, atol=atol, rtol=rtol)


def unit_stats(case: Case, **kw) -> list[torch.Tensor]:
    """Per sequence the oracle's statistics of every droppable unit-tile, with the API's prompt lengths (a one-row
    sequence is a decode step) and the oracle's `kw` (softcap, sinks)."""
    dense = torch.full((case.batch, 1), -math.inf, dtype=torch.float64)
    return oracle(case, dense, **kw).tile_stats


def safe_log_lams(case: Case, quantiles, **kw) -> torch.Tensor:
    """ln λ [B, T] float64: per sequence and trial near that quantile of its finite unit statistics (-0.5 where it
    has none), nudged off every statistic."""
    stats = unit_stats(case, **kw)
    rows = []
    for st in stats:
        finite = st[torch.isfinite(st)]
        row = []
        for qt in quantiles:
            x = float(torch.quantile(finite, qt)) + 1e-2 if finite.numel() else -0.5
            row.append(safe_log_lambda(min(x, -1e-3), st))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def check_serving_and_calibration(case: Case, ref: Case, dtype, quantile=0.5, **kw):
    """Dense, serving (counts exact, some tiles dropped) and calibration (three trials, counts exact, output the
    dense output) against the oracle; `kw` are the API's and the oracle's (sinks, softcap). Returns the serving
    counts."""
    api_kw = {k: v for k, v in kw.items() if k == "sinks"}
    if "softcap" in kw:
        api_kw["logits_soft_cap"] = kw["softcap"]
    dense, counts = run_fp8(case, **api_kw)
    assert counts is None
    close(dense, oracle(ref, None, **kw).out, dtype)
    log_lams = safe_log_lams(ref, [quantile], **kw)
    out, counts = run_fp8(case, skip_threshold=log_lams[:, 0].exp().float(), counts=True, **api_kw)
    expected = oracle(ref, log_lams, **kw)
    assert torch.equal(counts, expected.counts)
    assert counts[..., 1].sum() > 0, "the case must drop tiles"
    close(out, expected.out, dtype)
    trials = safe_log_lams(ref, [0.1, 0.5, 0.8], **kw)
    out_cal, cal = run_fp8(case, trials=trials.exp().float(), **api_kw)
    assert torch.equal(cal, oracle(ref, trials, calibrate=True, **kw).counts)
    assert torch.equal(out_cal, dense), "calibration output is the dense output"
    return counts


def mixed(fp8, dtype=torch.float32, layout="vec", page=16, seed=71, **kw):
    """Prefill over two row blocks, a chunk, decode rows at 1, 2 and 3 key splits (kv > 2048), an empty sequence,
    a decode row at kv_len 1; SmolLM2's 9 query heads on 3 KV heads, head size 64."""
    q_lens = [80, 1, 0, 33, 1, 1, 1]
    kv_lens = [400, 2 * SPLIT_TOKENS + 300, 7, 300, 1, SPLIT_TOKENS + 40, 700]
    return fp8_case(q_lens, kv_lens, fp8=fp8, dtype=dtype, layout=layout, hq=9, hkv=3, d=64, page=page, seed=seed,
                    **kw)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("layout,page", [("vec", 16), ("vec", 64), ("nhd", 16)], ids=["vec16", "vec64", "nhd16"])
def test_matches_float64_oracle(layout, page, fp8, dtype):
    """Dense, serving and calibration on FP8 caches: K read in place (vec: in-place key blocks of 16, and of whole
    64-key tiles at page 64) or repacked (nhd), GQA 9/3, prefill, a chunk, decode over several key splits."""
    case, ref = mixed(fp8, dtype, layout, page)
    counts = check_serving_and_calibration(case, ref, dtype)
    assert (counts[[0, 1, 5], 0, 1] > 0).all(), "prefill and split decode rows must drop tiles"


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_matches_the_torch_reference(fp8):
    """The same call on backend="torch" with float64 queries and the dequantized float64 caches (the reference of
    docs/skip_softmax.md) gives the same counts and, to fp32 rounding, the same output; and the reference reading
    the FP8 cache itself agrees."""
    case, ref = mixed(fp8, seed=72)
    log_lams = safe_log_lams(ref, [0.5])
    lam = log_lams[:, 0].exp().float()
    out, counts = run_fp8(case, skip_threshold=lam, counts=True)
    out_ref, counts_ref = run(ref, "torch", skip_threshold=lam, counts=True)
    assert torch.equal(counts, counts_ref) and counts[..., 1].sum() > 0
    close(out, out_ref, torch.float32)
    out_fp8_ref, counts_fp8_ref = run(case, "torch", skip_threshold=lam, counts=True, k_scale=K_SCALE,
                                      v_scale=V_SCALE)  # fmt: skip
    assert torch.equal(counts, counts_fp8_ref)
    close(out, out_fp8_ref.double(), torch.float32)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("extra", ["sinks", "softcap", "both"])
def test_sinks_and_softcap(fp8, extra):
    """Attention sinks (one logit per query head, in the reference max and the denominator) and logit soft-capping
    (cap·tanh(s / cap) of the dequantized scores) on an FP8 cache, bf16 queries."""
    case, ref = mixed(fp8, torch.bfloat16, seed=73)
    kw = {}
    if extra in ("sinks", "both"):
        kw["sinks"] = torch.tensor([0.5, 2.0, 4.0] * 3, dtype=torch.float32)
    if extra in ("softcap", "both"):
        kw["softcap"] = 6.0
    check_serving_and_calibration(case, ref, torch.bfloat16, **kw)


@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_chunked_prefill(fp8):
    """A prompt of 321 served whole or in chunks cut at multiples of 64 (the last a single token), beside a decode
    row: every row the same (fp32 rounding of a different row blocking) and the counts the same; each against the
    oracle."""
    prompt = 321
    case, ref = fp8_case([prompt, 1], [prompt, 900], fp8=fp8, hq=9, hkv=3, d=64, page=16, seed=74)
    log_lams = safe_log_lams(ref, [0.5])
    lam = log_lams[:, 0].exp().float()
    out_whole, c_whole = run_fp8(case, skip_threshold=lam, counts=True)
    assert torch.equal(c_whole, oracle(ref, log_lams).counts) and c_whole[0, 0, 1] > 0
    total = torch.zeros_like(c_whole[0])
    cuts = [0, 64, 192, 320, prompt]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        part, part_ref = chunk_of(case, a, b), chunk_of(ref, a, b)
        prompts = torch.tensor([prompt, 899], dtype=torch.int32)
        law = dict(log_scale_factors=log_lams.float().expand(2, 2).contiguous(), length_exponents=torch.zeros(2),
                   prompt_lens=prompts)  # fmt: skip
        o, c = run_fp8(part, counts=True, **law)
        expected = oracle(part_ref, None, law=(log_lams.unsqueeze(-1).expand(2, 1, 2), torch.zeros(2, 2),
                                               [prompt, 899]))  # fmt: skip
        assert torch.equal(c, expected.counts)
        close(o, expected.out, torch.float32)
        torch.testing.assert_close(o[: b - a], out_whole[a:b], atol=2e-6, rtol=1e-5)
        total += c[0]
    assert torch.equal(total, c_whole[0]), "counts must not depend on chunking"


def _dequantized(case: Case, dtype, k_scale, v_scale) -> Case:
    """The same cache dequantized into `dtype` (exact: FP8 values times powers of two), in the same strides."""
    def like(cache, scale):
        storage = torch.full((cache.untyped_storage().nbytes(),), math.nan, dtype=dtype)  # one byte per FP8 element
        view = torch.as_strided(storage, cache.shape, cache.stride(), cache.storage_offset())
        view.copy_(cache.to(torch.float32) * scale)
        return view

    k, v = like(case.k_cache, k_scale), like(case.v_cache, v_scale)
    return Case(q=case.q, k_cache=k, v_cache=v, block_table=case.block_table, cu_seqlens_q=case.cu_seqlens_q,
                seq_lens_k=case.seq_lens_k, scale=case.scale, q_lens=case.q_lens, kv_lens=case.kv_lens)  # fmt: skip


@pytest.mark.parametrize(
    "dtype,dot",
    [(torch.float32, False), (torch.float16, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["fp32", "fp16", "bf16-vector", "bf16-dot"],
)
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_power_of_two_scales_are_bitwise_the_dequantized_cache(fp8, dtype, dot):
    """With scales that are powers of two, k_scale folded into the softmax scale and v_scale into the output are
    exact: outputs and counts are bitwise those of the same kernel on the dequantized cache in the query's dtype
    (the same strides, so the same path). bf16 prefill items run on the fp32 vectors or on VDPBF16PS (`dot`, where
    compiled: FP8 K and V converted into the bf16 pairs, exactly); AMX tiles, which FP8 caches do not take, off."""
    if dot and not cpu_kernel.bf16_dot():
        pytest.skip("no AVX512-BF16 (VDPBF16PS) in this build")
    k_scale, v_scale = 0.5, 4.0
    case, _ = mixed(fp8, dtype, seed=75, k_scale=k_scale, v_scale=v_scale)
    plain = _dequantized(case, dtype, k_scale, v_scale)
    lam = torch.full((case.batch,), 0.02)
    dot_was, amx_was = cpu_kernel.bf16_dot(), cpu_kernel.amx_tiles()
    cpu_kernel.bf16_dot(dot)
    cpu_kernel.amx_tiles(False)
    try:
        for kw in ({}, dict(skip_threshold=lam, counts=True), dict(logits_soft_cap=5.0, skip_threshold=lam)):
            out, counts = run_fp8(case, k_scale=k_scale, v_scale=v_scale, **kw)
            out_plain, counts_plain = run(plain, "cpu", **kw)
            assert torch.equal(out, out_plain)
            assert (counts is None and counts_plain is None) or torch.equal(counts, counts_plain)
    finally:
        cpu_kernel.bf16_dot(dot_was)
        cpu_kernel.amx_tiles(amx_was)


def test_bf16_prefill_takes_the_packed_path():
    """bf16 queries on an FP8 cache run prefill on the packed bf16 pairs where this build has VDPBF16PS (their
    probabilities rounded to bf16, as on a bf16 cache): with it switched off the output changes (fp32 P·V)."""
    if not cpu_kernel.bf16_dot():
        pytest.skip("no AVX512-BF16 (VDPBF16PS) in this build")
    case, ref = fp8_case([200], [200], fp8=torch.float8_e4m3fn, dtype=torch.bfloat16, hq=9, hkv=3, d=64, seed=78)
    packed, _ = run_fp8(case)
    cpu_kernel.bf16_dot(False)
    try:
        vector, _ = run_fp8(case)
    finally:
        cpu_kernel.bf16_dot(True)
    assert not torch.equal(packed, vector)
    close(packed, oracle(ref, None).out, torch.bfloat16)


def test_scales_reach_the_op_and_old_calls_still_launch():
    """k_scale scales every score and v_scale the output: an FP8 cache with scales (a, b) is the cache with scales
    (1, 1) at softmax scale · a, output · b (bitwise, dense); scales of 1.0 pass no scale arguments (launch_cpu),
    so builds older than FP8 caches launch the same calls."""
    case, _ = mixed(torch.float8_e4m3fn, seed=76)
    out, _ = run_fp8(case, k_scale=0.25, v_scale=8.0)
    case_unit = Case(q=case.q, k_cache=case.k_cache, v_cache=case.v_cache, block_table=case.block_table,
                     cu_seqlens_q=case.cu_seqlens_q, seq_lens_k=case.seq_lens_k, scale=case.scale * 0.25,
                     q_lens=case.q_lens, kv_lens=case.kv_lens)  # fmt: skip
    out_unit, _ = run_fp8(case_unit, k_scale=1.0, v_scale=1.0)
    assert torch.equal(out, out_unit * 8.0)
    calls = []
    op = cpu_kernel._load()[0]

    def spy(*args):
        calls.append(len(args))
        return op(*args)

    law = api_free_law(case)
    out_buf = torch.empty_like(case.q)
    cpu_kernel.launch_cpu(*case.args(), softmax_scale=case.scale, out=out_buf, op=spy, **law)
    cpu_kernel.launch_cpu(*case.args(), softmax_scale=case.scale, out=out_buf, op=spy, k_scale=0.5, **law)
    assert calls == [16, 19]


def api_free_law(case: Case) -> dict:
    """launch_cpu's dense keyword arguments for `case` (int32 contiguous tensors as the plugin holds them)."""
    return dict(log_sf=None, gamma=torch.zeros(case.batch, 2), calibrate=False,
                prompt_lens=torch.tensor([kv - 1 if ql == 1 else kv for ql, kv in zip(case.q_lens, case.kv_lens,
                                                                                        strict=True)],
                                         dtype=torch.int32))  # fmt: skip


def test_unsupported_reason_and_checks():
    """FP8 4-D views with fp32 / bf16 / fp16 queries are covered; a 6-D FP8 view (vLLM's `amx` layout is bf16) and
    float64 queries are not, each naming why; the op refuses scales that are not finite and > 0."""
    case, _ = mixed(torch.float8_e5m2, seed=77)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert cpu_kernel.unsupported_reason(case.q.to(dtype), case.k_cache) is None
    assert "float64" in cpu_kernel.unsupported_reason(case.q.double(), case.k_cache)
    six_d = torch.empty(4, 1, 16, 3, 32, 2, dtype=torch.float8_e4m3fn)
    assert "4-D" in cpu_kernel.unsupported_reason(case.q.to(torch.bfloat16), six_d)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(RuntimeError, match="k_scale and v_scale"):
            cpu_kernel.paged_skip_softmax_attention_cpu(
                *case.args(), softmax_scale=case.scale, out=torch.empty_like(case.q), k_scale=bad, v_scale=1.0,
                calibrate=False, **{k: v for k, v in api_free_law(case).items() if k != "calibrate"})  # fmt: skip
    assert semantics.FP8_CACHE_DTYPES == tuple(FP8)
    assert api.resolve_backend("auto", case.q, case.k_cache) == "cpu"
