"""FP8 KV caches in the Triton kernels (issue #66) against the float64 reference.

The contract (docs/skip_softmax.md "Inputs"): with an FP8 cache (`float8_e4m3fn`, `float8_e5m2`) the key and value of
a slot are `float(k8) · k_scale` and `float(v8) · v_scale`, and everything else is formed from those values as for
a bf16 cache. The oracle is the PyTorch reference in float64 (`paged_skip_softmax_attention(..., backend="torch")`)
on the query widened to float64 and float64 caches `k8.double() · k_scale`, `v8.double() · v_scale`: rows within
`TOL` (the kernels' own rounding: fp32 accumulation, P in q's dtype for fp16 / bf16, the output in q's dtype),
counts exactly (thresholds kept off decision boundaries by `safe_log_lambda`). Scales are not 1 (K_SCALE, V_SCALE),
so a kernel that dropped either would be off by far more than the tolerance.

Poison: every cache slot past every sequence's kv_len (page tails, unused pages) holds the byte 0x7F, NaN in both
formats (the float64 caches hold NaN there too); the interpreter reads it as a large finite value (480 for
e4m3fn), still a poison any unmasked read would show. Output rows past total_q are NaN and must stay NaN.

Under the interpreter (CPU), Triton 3.8 multiplies bf16 dot operands as their uint16 bit patterns (its
`create_dot` widens only 8-bit floats): the bf16 tests widen them to fp32 first (`_interpreter_bf16_dots`, exact:
a bf16 MMA's products are exact and it accumulates in fp32); the real bf16 MMA runs in the `gpu` test.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from skip_attention_helpers import make_cache_views, make_case, oracle, safe_log_lambda

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention, triton_kernel

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
K_SCALE, V_SCALE = 0.37, 1.9
NAN_BYTE = 0x7F  # NaN in float8_e4m3fn (S.1111.111) and in float8_e5m2 (S.11111.11)
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}  # (atol, rtol)

# A mixed batch (GQA 3 over one KV head, padded to 4): a 100-row chunk from position 350 (mid-block), a decode step
# over 3 splits (4200 keys: split-K and the merge) and one in a single split (330 keys), a 40-row call whose last 20
# rows are decode rows (`_decode_rows_kernel` when deciding), a whole 70-row prompt, an empty sequence.
Q_LENS, KV_LENS, PROMPTS = [100, 1, 1, 40, 70, 0], [450, 4200, 330, 330, 70, 3], [450, 4199, 329, 310, 70, 3]
DROPPING = [0, 1, 2, 3]  # sequences whose serving run must drop tiles


@pytest.fixture
def _interpreter_bf16_dots(monkeypatch):
    """Under TRITON_INTERPRET, bf16 dot operands widened to fp32 before the interpreter's matmul (see above)."""
    if not torch.cuda.is_available():
        import triton.language as tl
        from triton.runtime import interpreter

        create_dot = interpreter.InterpreterBuilder.create_dot

        def widen(h):
            if h.dtype.scalar != tl.bfloat16:
                return h
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

        def bf16_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", bf16_dot)


def _live_slots(case) -> torch.Tensor:
    """[num_blocks, page] True where some sequence keeps a key (position < its kv_len)."""
    live = torch.zeros(case.k_cache.shape[:2], dtype=torch.bool)
    page = case.k_cache.shape[1]
    for b, kv in enumerate(case.kv_lens):
        pos = torch.arange(kv)
        live[case.block_table[b, pos // page].long(), pos % page] = True
    return live


def fp8_case(fp8, q_dtype, *, q_lens=Q_LENS, kv_lens=KV_LENS, layout="nhd", hq=3, hkv=1, d=32, seed=0, **kw):
    """(FP8 case, float64 case): q in `q_dtype` and FP8 caches in `layout` holding round(K / K_SCALE) and
    round(V / V_SCALE), every dead slot NAN_BYTE; the float64 case holds the same q and the caches' values
    (k8 · K_SCALE, v8 · V_SCALE) in a plain layout."""
    base = make_case(q_lens, kv_lens, hq=hq, hkv=hkv, d=d, page=16, seed=seed, **kw)
    limit = torch.finfo(fp8).max
    k8 = (base.k_cache / K_SCALE).clamp(-limit, limit).to(fp8)
    v8 = (base.v_cache / V_SCALE).clamp(-limit, limit).to(fp8)
    dead = ~_live_slots(base)
    for cache in (k8, v8):
        cache.view(torch.uint8)[dead] = NAN_BYTE
    q = base.q.to(q_dtype)
    k_view, v_view = make_cache_views(k8, v8, layout)
    case8 = dataclasses.replace(base, q=q, k_cache=k_view, v_cache=v_view)
    case64 = dataclasses.replace(base, q=q.double(), k_cache=k8.double() * K_SCALE, v_cache=v8.double() * V_SCALE)
    return case8, case64


def _law(log_lams, prompts, device="cpu") -> dict:
    """Public-entry law of ln λ [B, T, 2] (per sequence, trial and phase; γ = 0) and the requests' prompt lengths."""
    log_sf = torch.as_tensor(log_lams, dtype=torch.float32, device=device)
    return dict(log_scale_factors=log_sf[:, 0] if log_sf.shape[1] == 1 else log_sf,
                length_exponents=torch.zeros(2, device=device), return_skip_counts=log_sf.shape[1] == 1,
                prompt_lens=torch.tensor(prompts, dtype=torch.int32, device=device))  # fmt: skip


def _safe_law(case64, quantiles, prompts, logits_soft_cap=0.0, sinks=None) -> list:
    """ln λ [B, T, 2] per sequence: per trial the `quantiles` (prefill, decode) of the sequence's unit statistics
    (the float64 oracle's, with these prompt lengths, soft cap and sinks), each moved off every statistic."""
    dummy = (torch.zeros(case64.batch, 1, 2, dtype=torch.float64), torch.zeros(case64.batch, 2), prompts)
    law = []
    for stats in oracle(case64, None, law=dummy, softcap=logits_soft_cap, sinks=sinks).tile_stats:
        finite = stats[torch.isfinite(stats)]
        trials = []
        for pair in quantiles:
            values = [float(torch.quantile(finite, x)) if finite.numel() else -1.0 for x in pair]
            trials.append([safe_log_lambda(min(v + 1e-2, -1e-2), stats) for v in values])
        law.append(trials)
    return law


def run(case, backend, law=None, prompts=None, **kw):
    """(rows, counts or None) of the public entry on `backend` (the FP8 scales given for an FP8 cache); rows past
    total_q start NaN and must stay NaN."""
    n = case.q.shape[0]
    out = torch.full((n + 3, *case.q.shape[1:]), math.nan, dtype=case.q.dtype, device=case.q.device)
    law_kw = {} if law is None else _law(law, prompts, case.q.device)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE) if case.k_cache.dtype in FP8.values() else {}
    res = paged_skip_softmax_attention(*case.args(), softmax_scale=case.scale, out=out, backend=backend, **law_kw,
                                       **scales, **kw)  # fmt: skip
    assert torch.isnan(out[n:]).all(), backend
    return out[:n], (res[1] if isinstance(res, tuple) else None)


def run_both(case8, case64, law=None, prompts=None, **kw):
    """The float64 reference and the Triton backend on the same values: [(rows, counts)] of each."""
    return [run(case64, "torch", law, prompts, **kw), run(case8, "triton", law, prompts, **kw)]


def assert_matches(results, q_dtype):
    """Rows within TOL of the float64 reference, counts exactly."""
    (o_ref, c_ref), (o_tri, c_tri) = results
    atol, rtol = TOL[q_dtype]
    torch.testing.assert_close(o_tri.double().cpu(), o_ref.cpu(), atol=atol, rtol=rtol)
    assert (c_ref is None) == (c_tri is None)
    if c_ref is not None:
        assert c_tri.dtype == torch.int64 and torch.equal(c_tri.cpu(), c_ref.cpu())
    return c_tri


@pytest.mark.usefixtures("_interpreter_bf16_dots")
@pytest.mark.parametrize(
    ("fp8", "q_dtype"),
    [("e4m3", torch.bfloat16), ("e4m3", torch.float32), ("e5m2", torch.bfloat16), ("e5m2", torch.float32),
     ("e5m2", torch.float16)],
    ids=["e4m3-bf16", "e4m3-fp32", "e5m2-bf16", "e5m2-fp32", "e5m2-fp16"],
)  # fmt: skip
def test_fp8_serving_matches_float64_reference(fp8, q_dtype):
    """Prefill, a chunk, decode over 1 and 3 splits (split-K and merge), decode rows of a multi-row call, GQA,
    served with thresholds that drop tiles in every deciding kernel, against the float64 reference on the
    dequantized values."""
    case8, case64 = fp8_case(FP8[fp8], q_dtype, seed=7 if fp8 == "e4m3" else 8)
    law = _safe_law(case64, [(0.3, 0.4)], PROMPTS)
    served = assert_matches(run_both(case8, case64, law, PROMPTS), q_dtype)
    assert (served[DROPPING, 0, 1] > 0).all(), served


@pytest.mark.usefixtures("_interpreter_bf16_dots")
@pytest.mark.parametrize(("fp8", "q_dtype"), [("e4m3", torch.bfloat16), ("e5m2", torch.float32)],
                         ids=["e4m3-bf16", "e5m2-fp32"])  # fmt: skip
def test_fp8_dense_and_calibration_match_float64_reference(fp8, q_dtype):
    """The same batch dense (no counts; the decode rows in the prefill kernel) and calibrating two trials of
    (prefill, decode) thresholds (dense rows, every trial's counts), against the float64 reference."""
    case8, case64 = fp8_case(FP8[fp8], q_dtype, seed=7 if fp8 == "e4m3" else 8)
    assert_matches(run_both(case8, case64), q_dtype)
    law = _safe_law(case64, [(0.3, 0.4), (0.1, 0.7)], PROMPTS)
    calibrated = assert_matches(run_both(case8, case64, law, PROMPTS), q_dtype)
    assert (calibrated[DROPPING, :, 1] > 0).all(), calibrated


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        (triton_kernel.LaunchConfig(prefill_skip="prefetch", decode_skip="predicated"), "hnd5"),
        (triton_kernel.LaunchConfig(prefill_block_q=128, prefill_split_causal=True, prefill_skip="exp",
                                    decode_skip="exp", prefill_fused_acc=True, decode_fused_acc=True), "cpu_t"),
        (triton_kernel.LaunchConfig(prefill_skip="predicated"), "packed"),
    ],
    ids=["prefetch-predicated-hnd5", "rows128-exp-fused-cpu_t", "predicated-packed"],
)
def test_fp8_launch_configs_and_strided_views(config, layout):
    """`launch_triton` with other skip modes and blockings (every V load path: branch, `exp`, `predicated`, the
    `prefetch` one tile ahead, P·V fused into the dot) over strided FP8 cache views (HND, packed K|V, the vLLM-CPU K
    transposed per page): the float64 reference's counts exactly and its rows at fp32 tolerance."""
    case8, case64 = fp8_case(torch.float8_e4m3fn, torch.float32, q_lens=[130, 1, 40], kv_lens=[450, 2100, 330],
                             layout=layout, hq=4, hkv=2, seed=21)  # fmt: skip
    prompts = [450, 2099, 310]
    law = _safe_law(case64, [(0.3, 0.4)], prompts)
    o_ref, c_ref = run(case64, "torch", law, prompts)
    out = torch.full((case8.q.shape[0] + 3, *case8.q.shape[1:]), math.nan)
    log_sf = torch.tensor(law, dtype=torch.float32)
    counts = triton_kernel.launch_triton(
        *case8.args(), softmax_scale=case8.scale, log_sf=log_sf, gamma=torch.zeros(3, 2),
        prompt_lens=torch.tensor(prompts, dtype=torch.int32), calibrate=False, out=out, config=config,
        k_scale=K_SCALE, v_scale=V_SCALE,
    )  # fmt: skip
    assert_matches([(o_ref, c_ref), (out[: case8.q.shape[0]], counts)], torch.float32)
    assert torch.isnan(out[case8.q.shape[0] :]).all() and (counts[:, 0, 1] > 0).all()


def test_fp8_softcap_and_sinks():
    """Soft-capping and attention sinks over an e5m2 cache: the cap applies to the scores of the dequantized keys
    (k_scale inside the capped value), the sinks are compared with them; serving and calibration."""
    case8, case64 = fp8_case(torch.float8_e5m2, torch.float32, q_lens=[100, 1, 1], kv_lens=[450, 2100, 330], hq=2,
                             hkv=1, seed=23, spread=2.0)  # fmt: skip
    prompts = [450, 2099, 329]
    extra = dict(logits_soft_cap=6.0, sinks=torch.tensor([3.5, 1.5]))
    law = _safe_law(case64, [(0.3, 0.3), (0.6, 0.6)], prompts, **extra)
    served = assert_matches(run_both(case8, case64, [t[:1] for t in law], prompts, **extra), torch.float32)
    assert served[:, 0, 1].sum() > 0
    assert_matches(run_both(case8, case64, law, prompts, **extra), torch.float32)


def test_scales_are_ignored_for_a_cache_in_q_dtype():
    """k_scale / v_scale dequantize an FP8 cache only: with a cache in q's dtype `launch_triton` ignores them (as the
    public entry, which passes them only with an FP8 cache)."""
    case = make_case([70, 1], [70, 300], hq=4, hkv=2, d=32, page=16, seed=3)
    outs = []
    for scales in ({}, dict(k_scale=K_SCALE, v_scale=V_SCALE)):
        out = torch.full_like(case.q, math.nan)
        triton_kernel.launch_triton(*case.args(), softmax_scale=case.scale, log_sf=None, gamma=torch.zeros(2, 2),
                                    prompt_lens=torch.tensor([70, 299], dtype=torch.int32), calibrate=False, out=out,
                                    **scales)  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("fp8", sorted(FP8))
def test_unsupported_reason_accepts_fp8_caches(fp8):
    """FP8 caches with q in fp16 / bf16 / fp32 are taken; a cache in another dtype than q's (not FP8) is not, and the
    checked entry raises a TypeError naming the dtypes."""
    cache = torch.zeros(2, 16, 1, 32, dtype=FP8[fp8])
    for q_dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert triton_kernel.unsupported_reason(torch.zeros(1, 2, 32, dtype=q_dtype), cache) is None
    assert "float64" in triton_kernel.unsupported_reason(torch.zeros(1, 2, 32, dtype=torch.float64), cache)
    q = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
    half_cache = torch.zeros(2, 16, 1, 32, dtype=torch.float16)
    assert "q's dtype" in triton_kernel.unsupported_reason(q, half_cache)
    with pytest.raises(TypeError, match="q's dtype"):
        triton_kernel.paged_skip_softmax_attention_triton(
            q, half_cache, half_cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32), softmax_scale=0.1, log_sf=None, gamma=torch.zeros(1, 2),
            prompt_lens=torch.tensor([1], dtype=torch.int32), calibrate=False, out=torch.empty_like(q),
        )  # fmt: skip


def _to_cuda(case):
    names = ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k")
    return dataclasses.replace(case, **{n: getattr(case, n).cuda() for n in names})


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("fp8", sorted(FP8))
def test_gpu_fp8_matches_float64_reference(fp8, q_dtype):
    """The compiled kernels (the real bf16 / fp16 MMA on converted FP8 tiles, D = 128, GQA 8, the default launch
    configuration) against the float64 reference on the CPU: dense, serving and calibration."""
    case8, case64 = fp8_case(FP8[fp8], q_dtype, hq=8, d=128, seed=31)
    case8 = _to_cuda(case8)
    assert_matches(run_both(case8, case64), q_dtype)
    law = _safe_law(case64, [(0.3, 0.4), (0.1, 0.7)], PROMPTS)
    served = assert_matches(run_both(case8, case64, [trials[:1] for trials in law], PROMPTS), q_dtype)
    assert (served[DROPPING, 0, 1] > 0).all(), served
    assert_matches(run_both(case8, case64, law, PROMPTS), q_dtype)
