"""Triton backend vs the PyTorch reference (and the float64 oracle of docs/skip_softmax.md).

On CPU-only machines Triton runs under its interpreter (conftest.py sets TRITON_INTERPRET=1): fp16 / fp32 only,
bf16 loads are wrong there, so bf16 is checked by the `gpu` tests. Outputs are compared with stated tolerances,
counts for equality; thresholds are kept away from decision boundaries (`safe_lambdas`). Contract version 4: rows
must reach position 255 before any tile can drop (tile 0 and the 128-key window are kept), prompt rows decide per
aligned 64-row block and decode rows per GQA group, also inside multi-row calls (`_decode_rows_kernel`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math

import pytest
import torch
from skip_attention_helpers import (
    backend_law,
    dense_attention_f64,
    log_lams_tensor,
    make_case,
    oracle,
    safe_lambdas,
    safe_log_lambda,
)

from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention, semantics, triton_kernel
from modelopt_ext.torch.kernels.sparsity.attention.reference import paged_skip_softmax_attention_reference
from modelopt_ext.torch.kernels.sparsity.attention.triton_kernel import paged_skip_softmax_attention_triton

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (atol, rtol) Triton vs reference: both accumulate in fp32; fp16 differs by the fp16 P in P·V and output rounding.
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (4e-3, 4e-3), torch.bfloat16: (2e-2, 2e-2)}


def both(case, log_lams, calibrate=False, prompt_lens=None, **kw):
    """Run reference and Triton backends directly (normalised arguments), `out` poisoned with NaN; `prompt_lens`
    (a list) replaces the default prompt lengths."""
    results = []
    law = backend_law(case, log_lams)
    if prompt_lens is not None:
        law["prompt_lens"] = torch.tensor(prompt_lens, dtype=torch.int32, device=case.q.device)
    for fn in (paged_skip_softmax_attention_reference, paged_skip_softmax_attention_triton):
        out = torch.full((case.q.shape[0] + 2, *case.q.shape[1:]), math.nan, dtype=case.q.dtype, device=case.q.device)
        counts = fn(*case.args(), softmax_scale=case.scale, calibrate=calibrate, out=out, **law, **kw)
        assert torch.isnan(out[case.q.shape[0] :]).all()
        results.append((out[: case.q.shape[0]], counts))
    return results


def assert_same(results, dtype):
    (o_ref, c_ref), (o_tri, c_tri) = results
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(o_tri.float(), o_ref.float(), atol=atol, rtol=rtol)
    if c_ref is None:
        assert c_tri is None
    else:
        assert c_tri.dtype == torch.int64 and torch.equal(c_tri.cpu(), c_ref.cpu())


@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_matches_reference_gqa_and_pages(group, page):
    hkv = 2 if group <= 3 else 1
    # a 70-row chunk from position 330 (mid-block), decode at position 699, a short chunk, an empty sequence
    case = make_case([70, 1, 2, 0], [400, 700, 40, 3], hq=group * hkv, hkv=hkv, d=32, page=page, seed=group * page)
    gen = torch.Generator().manual_seed(group * page)
    lams = torch.exp(torch.empty(case.batch).uniform_(math.log(0.05), math.log(0.9), generator=gen))  # per sequence
    lams = safe_lambdas(case, lams)
    log_lams = log_lams_tensor(lams, case.batch)
    results = both(case, log_lams)
    assert_same(results, torch.float32)
    counts = results[1][1]
    assert torch.equal(counts, oracle(case, log_lams).counts)
    # calibration on the same inputs: one trial per sequence's λ plus a shared one
    trials = torch.cat([lams[:, None], torch.full((case.batch, 1), 0.7)], dim=1)
    trials = safe_lambdas(case, trials)
    cal = both(case, log_lams_tensor(trials, case.batch), calibrate=True)
    assert_same(cal, torch.float32)
    assert torch.equal(cal[1][1][:, 0], counts[:, 0])
    assert cal[1][1][..., 1].sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_matches_reference_fp16_fp32(dtype):
    case = make_case([130, 1, 64, 1], [200, 300, 64, 65], hq=4, hkv=2, d=64, page=32, dtype=dtype, seed=5)
    lams = safe_lambdas(case, torch.tensor([0.05, 0.02, 0.1, 0.3]))
    results = both(case, log_lams_tensor(lams, case.batch))
    assert_same(results, dtype)
    assert results[1][1][..., 1].sum() > 0
    dense = both(case, None)
    assert_same(dense, dtype)
    atol = 4e-3 if dtype == torch.float16 else 3e-5
    torch.testing.assert_close(dense[1][0].double(), dense_attention_f64(case), atol=atol, rtol=atol)


@pytest.mark.parametrize("d", [16, 80, 128, 256])
def test_head_sizes(d):
    case = make_case([66, 1], [70, 90], hq=2, hkv=1, d=d, page=16, seed=d)
    lams = safe_lambdas(case, torch.tensor([0.3, 0.3]))
    assert_same(both(case, log_lams_tensor(lams, 2)), torch.float32)


def test_decode_split_merge_with_max_seqlen_hint():
    case = make_case([1, 1, 5], [4200, 100, 2100], hq=4, hkv=1, d=16, page=64, seed=3)
    lams = safe_lambdas(case, torch.tensor([0.1, 0.1, 0.1]))
    log_lams = log_lams_tensor(lams, 3)
    base = both(case, log_lams)
    assert_same(base, torch.float32)
    assert base[1][1][0, 0, 1] > 0
    out = torch.full_like(case.q, math.nan)
    counts = paged_skip_softmax_attention_triton(
        *case.args(), softmax_scale=case.scale, calibrate=False, out=out, max_seqlen_k=4200,
        **backend_law(case, log_lams),
    )
    assert torch.equal(out, base[1][0]) and torch.equal(counts, base[1][1])


def test_cpu_transposed_key_view_any_strides():
    """The vLLM-CPU K view (last-dim stride = page) also works in Triton: strides are runtime arguments."""
    case = make_case([65, 1], [80, 70], hq=2, hkv=1, d=32, page=16, layout="cpu_t", seed=4)
    assert case.k_cache.stride(-1) == 16
    lams = safe_lambdas(case, torch.tensor([0.2, 0.2]))
    assert_same(both(case, log_lams_tensor(lams, 2)), torch.float32)


def test_api_dispatches_to_triton():
    case = make_case([65, 1], [80, 70], hq=2, hkv=1, d=32, seed=6)
    lams = safe_lambdas(case, torch.tensor([0.2, 0.2]))
    outs = [
        paged_skip_softmax_attention(
            *case.args(), softmax_scale=case.scale, skip_threshold=lams, return_skip_counts=True, backend=backend
        )
        for backend in ("torch", "triton")
    ]
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-5, rtol=1e-4)
    assert torch.equal(outs[1][1], outs[0][1])


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"d": 8}, ValueError, "head sizes"),
        ({"d": 512}, ValueError, "head sizes"),
        ({"page": 8}, ValueError, "page size"),
        ({"page": 48}, ValueError, "page size"),
        ({"dtype": torch.float64}, TypeError, "backend='torch'"),
    ],
)
def test_unsupported_inputs_raise_clear_errors(kwargs, error, match):
    case = make_case([3], [3], hq=2, hkv=1, **{"d": 32, **kwargs})
    with pytest.raises(error, match=match):
        paged_skip_softmax_attention(*case.args(), softmax_scale=case.scale, backend="triton")


def test_serving_needs_one_trial():
    case = make_case([3], [3], hq=2, hkv=1, d=32)
    with pytest.raises(ValueError, match="T == 1"):
        paged_skip_softmax_attention_triton(
            *case.args(), softmax_scale=case.scale, calibrate=False, out=case.q.clone(),
            **backend_law(case, torch.zeros(1, 2)),
        )


def _constexpr_params(kernel) -> set[str]:
    fn = kernel.fn  # JITFunction and the interpreter's InterpretedFunction both keep the Python function
    return {n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)}


@pytest.mark.parametrize("kernel", ["_prefill_kernel", "_decode_kernel", "_decode_merge_kernel", "_decode_rows_kernel"])
def test_lambda_and_lengths_are_runtime_arguments(kernel):
    """λ (the law tensors), the scale, the soft-cap value, the sinks, lengths and strides are runtime values;
    constexprs are geometry, mode and launch configuration only (SOFTCAP, HAS_SINKS: whether scores are capped and
    sinks given at all; V_SKIP, FUSED_ACC, SPLIT_CAUSAL: `LaunchConfig`'s code shape)."""
    allowed = {
        "HEAD_DIM", "BLOCK_D", "GROUP", "PAGE", "BLOCK_Q", "BLOCK_K", "N_TRIALS", "TRIALS_P2", "MODE", "FP32_DOT",
        "BLOCK_G", "NUM_HEADS", "SPLIT_BLOCKS", "SPLIT_TOKENS", "SOFTCAP", "V_SKIP", "FUSED_ACC", "SPLIT_CAUSAL",
        "HAS_SINKS", "BLOCK_R",
    }  # fmt: skip
    params = _constexpr_params(getattr(triton_kernel, kernel))
    assert params and params <= allowed, params - allowed


def _compiled_variants(kernel) -> int:
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


@pytest.mark.gpu
@requires_cuda
def test_new_lambda_does_not_recompile():
    """Needs a GPU: under the interpreter there is no compile cache to count."""
    case = make_case([130, 1], [200, 3000], hq=4, hkv=2, d=64, page=16, dtype=torch.float16, seed=1)
    lams = [safe_lambdas(case, torch.tensor(lam)).tolist() for lam in ([0.1, 0.01], [0.3, 0.001], [0.05, 1.0])]
    case = _to_cuda(case)
    kernels = (triton_kernel._prefill_kernel, triton_kernel._decode_kernel, triton_kernel._decode_merge_kernel,
               triton_kernel._decode_rows_kernel)  # fmt: skip
    out = torch.empty_like(case.q)

    def call(lam):
        paged_skip_softmax_attention_triton(
            *case.args(), softmax_scale=case.scale, calibrate=False, out=out,
            **backend_law(case, log_lams_tensor(lam, 2)),
        )

    call(lams[0])
    before = [_compiled_variants(k) for k in kernels]
    for lam in (*lams[1:], [math.nan, 0.2]):
        call(lam)
    torch.cuda.synchronize()
    assert [_compiled_variants(k) for k in kernels] == before


def _to_cuda(case):
    for name in ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k"):
        setattr(case, name, getattr(case, name).cuda())
    return case


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("layout", ["nhd", "hnd5", "packed"])
def test_gpu_matches_reference(dtype, layout):
    case = make_case(
        [300, 1, 1, 77, 0, 1], [900, 5000, 40, 77, 3, 2049], hq=8, hkv=2, d=128, page=16, dtype=dtype, layout=layout,
        seed=11,
    )  # fmt: skip
    lams = safe_lambdas(case, torch.tensor([0.05, 0.02, 0.1, 0.3, 0.5, 0.01]))
    trials = safe_lambdas(case, torch.tensor([1e-3, 1e-2, 0.1, 0.5]).expand(case.batch, -1).contiguous())
    case = _to_cuda(case)
    results = both(case, log_lams_tensor(lams, case.batch).cuda())
    assert_same(results, dtype)
    assert results[1][1][..., 1].sum() > 0
    assert_same(both(case, log_lams_tensor(trials, case.batch).cuda(), calibrate=True), dtype)
    assert_same(both(case, None), dtype)
    # the 300-row call's last 20 rows as decode rows (verification rows): `_decode_rows_kernel`, compiled
    prompts = [880, 4999, 39, 77, 3, 2048]
    assert_same(both(case, log_lams_tensor(lams, case.batch).cuda(), prompt_lens=prompts), dtype)
    assert_same(both(case, log_lams_tensor(trials, case.batch).cuda(), calibrate=True, prompt_lens=prompts), dtype)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_int64_metadata_and_padded_queries(backend):
    """int64 block table / lengths, and q padded past cu_seqlens_q[-1] (CUDA-graph padding): pad rows untouched."""
    case = make_case([65, 1], [80, 70], hq=2, hkv=1, d=32, seed=13)
    lams = safe_lambdas(case, torch.tensor([0.2, 0.2]))
    expected = oracle(case, log_lams_tensor(lams, 2))
    q = torch.cat([case.q, torch.randn(5, 2, 32)])
    out = torch.full_like(q, math.nan)
    _, counts = paged_skip_softmax_attention(
        q, case.k_cache, case.v_cache, case.block_table.long(), case.cu_seqlens_q.long(), case.seq_lens_k.long(),
        softmax_scale=case.scale, skip_threshold=lams, return_skip_counts=True, out=out, backend=backend,
    )  # fmt: skip
    assert torch.equal(counts, expected.counts)
    torch.testing.assert_close(out[:66].double(), expected.out, atol=3e-5, rtol=1e-4)
    assert torch.isnan(out[66:]).all()


@pytest.mark.parametrize(
    "config",
    [
        triton_kernel.LaunchConfig(prefill_block_q=128, prefill_warps=4, prefill_stages=3),
        triton_kernel.LaunchConfig(prefill_skip="predicated", decode_skip="predicated", decode_warps=2),
        triton_kernel.LaunchConfig(prefill_skip="exp", decode_skip="exp", prefill_block_q=128),
        triton_kernel.LaunchConfig(prefill_block_q=128, prefill_fused_acc=True, decode_fused_acc=True,
                                   prefill_skip="predicated", decode_stages=4),
        triton_kernel.LaunchConfig(prefill_split_causal=True),
        triton_kernel.LaunchConfig(prefill_split_causal=True, prefill_block_q=128, prefill_skip="exp"),
        triton_kernel.LaunchConfig(prefill_skip="prefetch"),
        triton_kernel.LaunchConfig(prefill_split_causal=True, prefill_block_q=128, prefill_skip="prefetch"),
    ],
    ids=["rows128", "predicated", "exp", "fused-acc", "split-causal", "split-causal-rows128-exp", "prefetch",
         "split-causal-rows128-prefetch"],  # fmt: skip
)
def test_launch_configs_keep_decisions_and_rows(config):
    """Every `LaunchConfig` (rows per prefill program, skip modes, P·V accumulated in the dot) gives the
    oracle's counts exactly and its rows at fp32 tolerance, serving and calibrating; poisoned rows past total_q stay
    unwritten. Mixed batch: a 130-row chunk over 2300 keys from position 2170 (mid-block: programs of 6 and 124 rows
    at 128 rows, of 6, 64 and 60 at 64; whole tiles past a split boundary before the diagonal ones), decode across a
    split boundary (2100 keys), a 70-row prompt, a short decode."""
    case = make_case([130, 1, 70, 1], [2300, 2100, 70, 40], hq=4, hkv=2, d=32, page=16, seed=29)
    lams = safe_lambdas(case, torch.tensor([0.3, 0.05, 0.2, 0.5]))
    log_lams = log_lams_tensor(lams, case.batch)
    trials = safe_lambdas(case, torch.tensor([1e-3, 0.1, 0.6]).expand(case.batch, -1).contiguous())
    for ll, calibrate in ((log_lams, False), (log_lams_tensor(trials, case.batch), True), (None, False)):
        counts, expected = _launch_against_oracle(case, config, ll, calibrate)
        if ll is not None:
            assert counts[..., 1].sum() > 0


def _launch_against_oracle(case, config, log_lams, calibrate, sinks=None, law=None, softcap=0.0):
    """`launch_triton` at ln λ [B, T] (None: dense) against the oracle: rows at fp32 tolerance, counts exactly, poisoned
    rows past total_q unwritten. `law` = (log_sf [B, T, 2], gamma [B, 2], prompt_lens [B]) instead of `log_lams`: per
    phase values and the requests' prompt lengths. Returns (counts, the oracle's result)."""
    counts, out = _launch(case, config, log_lams, calibrate, sinks, law, softcap)
    expected = oracle(case, log_lams, calibrate=calibrate, sinks=sinks, softcap=softcap,
                      law=None if law is None else (law[0].double(), law[1], law[2].tolist()))  # fmt: skip
    torch.testing.assert_close(out[: case.q.shape[0]].double(), expected.out, atol=3e-5, rtol=1e-4)
    assert torch.isnan(out[case.q.shape[0] :]).all()
    if log_lams is None and law is None:
        assert counts is None
    else:
        assert torch.equal(counts, expected.counts)
    return counts, expected


def _launch(case, config, log_lams, calibrate, sinks=None, law=None, softcap=0.0):
    """`launch_triton` with `out` poisoned with NaN: (counts, out with 3 extra rows)."""
    out = torch.full((case.q.shape[0] + 3, *case.q.shape[1:]), math.nan, dtype=case.q.dtype)
    if law is None:
        kw = backend_law(case, None if log_lams is None else log_lams.to(torch.float32))
    else:
        kw = dict(log_sf=law[0].to(torch.float32).contiguous(), gamma=law[1].to(torch.float32),
                  prompt_lens=law[2].to(torch.int32))  # fmt: skip
    counts = triton_kernel.launch_triton(*case.args(), softmax_scale=case.scale, calibrate=calibrate, out=out,
                                         config=config, softcap=softcap,
                                         **({"sinks": sinks} if sinks is not None else {}), **kw)  # fmt: skip
    return counts, out


@pytest.mark.parametrize(
    "config",
    [
        triton_kernel.LaunchConfig(),
        triton_kernel.LaunchConfig(prefill_split_causal=True, prefill_block_q=128, prefill_skip="exp",
                                   decode_skip="exp"),
        triton_kernel.LaunchConfig(prefill_skip="prefetch", decode_skip="predicated", prefill_fused_acc=True,
                                   decode_fused_acc=True),
    ],
    ids=["branch", "split-causal-rows128-exp", "prefetch-predicated-fused"],
)
def test_sinks_in_every_launch_config(config):
    """Attention sinks (docs/skip_softmax.md v3) with the skip modes and blockings: the oracle's counts exactly, its
    rows at fp32 tolerance, serving, calibrating and dense. Prefill rows past a split boundary (the sink seeds the
    restarted split max), a decode row over three splits (only split 0 puts the sink in the softmax; every split
    tests against it), and sinks large enough to change decisions."""
    case = make_case([130, 1, 1], [2300, 4200, 40], hq=4, hkv=2, d=32, page=16, seed=31, spread=2.0)
    sinks = torch.tensor([3.5, -1.0, 1.5, 6.0], dtype=torch.float32)
    stats = oracle(case, None, sinks=sinks).tile_stats
    log_lams = torch.tensor([[safe_log_lambda(x, stats[b])] for b, x in enumerate((-1.5, -1.0, -2.0))])
    trials = torch.tensor([[safe_log_lambda(x, stats[b]) for x in (-3.0, -1.2)] for b in range(case.batch)])
    for ll, calibrate in ((log_lams, False), (trials, True), (None, False)):
        counts, _ = _launch_against_oracle(case, config, ll, calibrate, sinks)
        if ll is not None:
            assert (counts[..., 1] > oracle(case, ll, calibrate=calibrate).counts[..., 1]).any()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prefill_skip": "maybe"}, "prefill_skip must be one of"),
        ({"decode_skip": "branchy"}, "decode_skip must be one of"),
        ({"decode_skip": "prefetch"}, "decode_skip must be one of"),
        ({"prefill_block_q": 96}, "prefill_block_q must be one of"),
        ({"prefill_block_q": 32}, "prefill_block_q must be one of"),  # programs hold whole 64-row decision blocks
        ({"decode_warps": 3}, "decode_warps must be one of"),
        ({"prefill_stages": 0}, "prefill_stages must be an int >= 1"),
    ],
)
def test_launch_config_rejects_bad_values(kwargs, match):
    """A launch configuration Triton could not compile is refused when it is made, naming the field."""
    with pytest.raises(ValueError, match=match):
        triton_kernel.LaunchConfig(**kwargs)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("skip", sorted(triton_kernel.SKIP_MODES))
@pytest.mark.parametrize("rows", [64, 128])
def test_gpu_skip_modes_match_reference(skip, rows):
    """Each skip mode, with 64-row prefill programs and with 128-row ones that run their whole tiles unmasked
    (`prefill_split_causal`), compiles on the GPU's Triton and serves what the reference serves (bf16, exact
    counts). `predicated` runs in decode here, with `branch` prefill: Triton 3.6 on sm_90 cannot pipeline the
    predicated prefill ("pipeliner doesn't know how to predicate" the wgmma; H200, 2026-12-04), so predicated prefill
    is checked under the interpreter against the float64 reference (test_launch_configs_keep_decisions_and_rows,
    fp32; docs/design.md)."""
    case = make_case([300, 1, 77, 1], [900, 5000, 77, 2049], hq=8, hkv=2, d=128, page=16, dtype=torch.bfloat16,
                     layout="nhd", seed=17)  # fmt: skip
    lams = safe_lambdas(case, torch.tensor([0.05, 0.02, 0.3, 0.01]))
    case = _to_cuda(case)
    decode_skip = skip if skip in triton_kernel.DECODE_SKIP_MODES else "branch"
    prefill_skip = "branch" if skip == "predicated" else skip
    config = triton_kernel.LaunchConfig(prefill_block_q=rows, prefill_warps=8 if rows == 128 else 4,
                                        prefill_split_causal=rows == 128, prefill_skip=prefill_skip,
                                        decode_skip=decode_skip,
                                        decode_warps=2, decode_stages=3)
    law = backend_law(case, log_lams_tensor(lams, case.batch).cuda())
    outs = []
    triton_launch = functools.partial(triton_kernel.launch_triton, config=config)
    for launch in (paged_skip_softmax_attention_reference, triton_launch):
        out = torch.full((case.q.shape[0] + 2, *case.q.shape[1:]), math.nan, dtype=case.q.dtype, device="cuda")
        counts = launch(*case.args(), softmax_scale=case.scale, calibrate=False, out=out, **law)
        assert torch.isnan(out[case.q.shape[0] :]).all()
        outs.append((out[: case.q.shape[0]], counts))
    assert_same(outs, torch.bfloat16)
    assert outs[1][1][..., 1].sum() > 0


# --------------------------------------------------------------------------------------------------------------
# Version 4: decision units (aligned 64-row prompt blocks, GQA groups of decode rows) in the Triton programs
# --------------------------------------------------------------------------------------------------------------


def _rows_of(case, start: int, stop: int):
    """Rows at positions start .. stop - 1 of `case`'s one sequence (made with q_len == kv_len: every position's
    query) as a call over keys 0 .. stop - 1, the way a chunk, a decode step or a verification call sees them."""
    return dataclasses.replace(
        case, q=case.q[start:stop], cu_seqlens_q=torch.tensor([0, stop - start], dtype=torch.int32),
        seq_lens_k=torch.tensor([stop], dtype=torch.int32), q_lens=[stop - start], kv_lens=[stop],
    )  # fmt: skip


def _phase_law(log_lams: list[tuple[float, float]], prompt_lens: list[int]):
    """(log_sf [B, T, 2], gamma [B, 2], prompt_lens [B]): per trial a (prefill, decode) pair of ln λ, the same for
    every sequence, γ = 0 (a plain λ per phase)."""
    batch = len(prompt_lens)
    log_sf = torch.tensor(log_lams, dtype=torch.float32).unsqueeze(0).expand(batch, -1, -1).contiguous()
    return log_sf, torch.zeros(batch, 2), torch.tensor(prompt_lens, dtype=torch.int32)


def _quantile_log_lambda(stats: torch.Tensor, quantile: float) -> float:
    """ln λ just above the `quantile` of the finite unit statistics, nudged off every one of them."""
    finite = stats[torch.isfinite(stats)]
    return safe_log_lambda(float(torch.quantile(finite, quantile)) + 1e-2, stats)


ROWS128 = [triton_kernel.LaunchConfig(prefill_block_q=128, prefill_split_causal=True, prefill_skip=skip)
           for skip in ("branch", "exp", "prefetch", "predicated")]  # fmt: skip


@pytest.mark.parametrize("config", ROWS128, ids=[c.prefill_skip for c in ROWS128])
def test_128_row_program_holds_two_blocks_that_decide_apart(config, monkeypatch):
    """A 128-row program (positions 384..511, aligned) holds two 64-row decision blocks: at this λ they drop different
    tiles (the oracle of each block alone differs, and the oracle with 128-row units drops nothing), and the program
    applies each block's decisions to its rows only, in every skip mode (`branch` and `prefetch` skip a tile's V only
    when both blocks drop it). The same rows cut into the two blocks' calls (aligned cuts) give the same rows and
    counts."""
    full = make_case([512], [512], hq=2, hkv=1, d=32, page=16, seed=40)
    call = _rows_of(full, 384, 512)
    log_lams = torch.tensor([[_quantile_log_lambda(oracle(call, None).tile_stats[0], 0.3)]])
    counts, expected = _launch_against_oracle(call, config, log_lams, False)
    halves = [_rows_of(full, 384, 448), _rows_of(full, 448, 512)]
    per_block = [oracle(h, log_lams).counts for h in halves]
    assert per_block[0][..., 1] > 0 and per_block[1][..., 1] > 0 and not torch.equal(per_block[0], per_block[1])
    with monkeypatch.context() as m:  # one unit of 128 rows: not what the contract decides
        m.setattr(semantics, "DECISION_BLOCK_ROWS", 128)
        assert not torch.equal(oracle(call, log_lams).counts, expected.counts)
    _, out = _launch(call, config, log_lams, False)
    total = torch.zeros_like(counts)
    for i, half in enumerate(halves):
        c, o = _launch(half, config, log_lams, False)
        torch.testing.assert_close(o[:64], out[64 * i : 64 * (i + 1)], atol=2e-6, rtol=1e-5)
        total += c
    assert torch.equal(total, counts)


@pytest.mark.parametrize("config", [triton_kernel.LaunchConfig(), ROWS128[1]], ids=["rows64", "rows128-exp"])
def test_call_starting_mid_block_decides_over_its_rows(config):
    """A call whose first row sits inside an aligned block (positions 300..419, beside a decode step and a call from
    position 200): the first program holds fewer rows, and its block decides over the rows the call holds (the
    oracle's reading of the contract), serving and calibrating; the whole prompt in one call decides those rows
    differently (the cut matters when it is not a multiple of 64)."""
    full = make_case([420], [420], hq=4, hkv=2, d=32, page=16, seed=46)
    call = _rows_of(full, 300, 420)
    stats = oracle(call, None).tile_stats[0]
    log_lams = torch.tensor([[_quantile_log_lambda(stats, 0.2)]])
    counts, expected = _launch_against_oracle(call, config, log_lams, False)
    assert counts[0, 0, 1] > 0
    trials = torch.tensor([[_quantile_log_lambda(stats, q) for q in (0.1, 0.2, 0.4)]])
    calibrated, _ = _launch_against_oracle(call, config, trials, True)
    assert torch.equal(calibrated[:, 1], counts[:, 0])
    whole = oracle(_rows_of(full, 0, 420), log_lams).out[300:]
    assert (whole - expected.out).abs().max() > 1e-3
    batch = make_case([120, 1, 220], [420, 500, 420], hq=4, hkv=2, d=32, page=16, seed=44)
    stats = oracle(batch, None).tile_stats
    log_lams = torch.tensor([[_quantile_log_lambda(stats[b], 0.1)] for b in range(3)])
    counts, _ = _launch_against_oracle(batch, config, log_lams, False)
    assert (counts[[0, 2], 0, 1] > 0).all()


def _batch_of(calls):
    """One launch of several one-sequence calls over the same cache (each keeps its own block-table row)."""
    q_lens = [c.q_lens[0] for c in calls]
    return dataclasses.replace(
        calls[0], q=torch.cat([c.q for c in calls]), block_table=torch.cat([c.block_table for c in calls]),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens_k=torch.cat([c.seq_lens_k for c in calls]), q_lens=q_lens, kv_lens=[c.kv_lens[0] for c in calls],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("group", "hkv", "first", "prompt", "kv", "variant"),
    [
        (3, 2, 380, 405, 420, "plain"),  # GQA 3 (padded to 4): 16 rows per program, 15 decode rows, mid-block start
        (8, 1, 256, 300, 331, "softcap"),  # GQA 8: 8 decode rows per program, 31 decode rows (4 programs)
        (2, 2, 2040, 2052, 2062, "sinks"),  # decode rows past the split at 2048, attention sinks
        (4, 1, 300, 290, 330, "plain"),  # every row of the call a decode row (a recomputed generated tail)
    ],
)
def test_decode_rows_in_multi_row_calls_equal_decode_steps(group, hkv, first, prompt, kv, variant):
    """Decode-phase rows (pos >= prompt_len) inside a multi-row call (speculative-decoding verification, a request
    recomputed after preemption) decide per GQA group, as decode steps do: each such row gives the output (to fp32
    summation order) and the counts of the same row run as a decode step, its prompt rows those of the prompt rows'
    call alone; serving with per-phase λ and calibrating, against the oracle."""
    hq = group * hkv
    full = make_case([kv], [kv], hq=hq, hkv=hkv, d=32, page=16, seed=50 + group, spread=1.5)
    sinks = (torch.linspace(2.0, 8.0, hq) if variant == "sinks" else None)
    softcap = 4.0 if variant == "softcap" else 0.0
    call = _rows_of(full, first, kv)
    steps = [_rows_of(full, p, p + 1) for p in range(max(first, prompt), kv)]
    parts = ([_rows_of(full, first, prompt)] if prompt > first else []) + steps
    split = _batch_of(parts)
    per_part = oracle(split, None, sinks=sinks, softcap=softcap).tile_stats
    stats = torch.cat([*oracle(call, None, sinks=sinks, softcap=softcap).tile_stats, *per_part])
    dec_stats = torch.cat(per_part[-len(steps) :])
    dec = float(torch.quantile(dec_stats[torch.isfinite(dec_stats)], 0.4))  # the decode rows drop some tiles
    pre, dec = (safe_log_lambda(min(x, -1e-2), stats) for x in (dec - 0.5, dec))

    def law(trials, batch):
        return _phase_law(trials, [prompt] * batch)

    for trials, calibrate in (([(pre, dec)], False), ([(pre, dec), (dec, pre), (-2.0, -1.0)], True)):
        trials = [tuple(safe_log_lambda(x, stats) for x in t) for t in trials]
        counts, _ = _launch_against_oracle(call, None, None, calibrate, sinks, law(trials, 1), softcap)
        parts_counts, _ = _launch_against_oracle(split, None, None, calibrate, sinks, law(trials, len(parts)),
                                                 softcap)  # fmt: skip
        assert torch.equal(counts[0], parts_counts.sum(0))
        if not calibrate:
            assert parts_counts[-len(steps) :, 0, 1].sum() > 0, "the decode rows must drop tiles"
            _, out = _launch(call, None, None, False, sinks, law(trials, 1), softcap)
            _, out_parts = _launch(split, None, None, False, sinks, law(trials, len(parts)), softcap)
            n = kv - first
            torch.testing.assert_close(out[:n], out_parts[:n], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("config", [triton_kernel.LaunchConfig(), ROWS128[1]], ids=["rows64", "rows128-exp"])
def test_calibration_counts_equal_serving_counts_per_trial(config):
    """Calibration (MODE 2) counts every trial with the units' statistics serving compares with its one λ: per trial,
    the calibration counts are the serving counts at that trial's (prefill, decode) λ, in a batch with a 150-row call
    from position 234 (mid-block; two blocks per 128-row program), a decode step, a multi-row call whose last 20 rows
    are decode rows, and a prompt's last row run alone (a prompt row in the decode kernel: it decides per head)."""
    case = make_case([150, 1, 40, 1], [384, 601, 330, 300], hq=6, hkv=2, d=32, page=16, seed=61)
    prompts = [384, 500, 310, 300]
    stats = torch.cat(oracle(case, None, law=_phase_law([(-1.0, -1.0)], prompts)).tile_stats)
    finite = stats[torch.isfinite(stats)]
    values = [float(torch.quantile(finite, q)) for q in (0.1, 0.3, 0.5)]
    trials = [tuple(safe_log_lambda(min(x, -1e-2), stats) for x in pair)
              for pair in ((values[1], values[0]), (values[0], values[2]), (values[2], values[1]))]  # fmt: skip
    calibrated, expected = _launch_against_oracle(case, config, None, True, law=_phase_law(trials, prompts))
    assert (calibrated[..., 1] > 0).any(dim=1).all(), "every sequence drops tiles at some trial"
    for t, pair in enumerate(trials):
        served, _ = _launch_against_oracle(case, config, None, False, law=_phase_law([pair], prompts))
        assert torch.equal(served[:, 0], calibrated[:, t]), f"trial {t}"
