"""The compiled CPU kernel (backend="cpu") against docs/skip_softmax.md, the float64 oracle and the reference.

It runs the same random cases the reference and Triton are tested on (the helpers of
test_skip_softmax_semantics.py: outputs within the stated tolerances of the float64 oracle, counts equal), and
what only a compiled kernel can get wrong: every dtype it compiles (fp32, bf16, fp16), vLLM's CPU cache layout
read in place (K transposed per block and head) beside the other layouts, page sizes that do and do not take the
in-place path, GQA group sizes that leave partial micro-kernel blocks, stale NaN/inf past kv_len in every layout,
key splits of long decode rows, thread-count invariance (bitwise), the dispatch of `backend="auto"`, attention
sinks (version 3) on every path test_sinks.py does not reach (the bf16 engines, vLLM's `amx` layout, key splits),
and version 4's decision units on every path: a prompt block's rows decided together in one work item (also when
a call starts inside the block), decode rows inside multi-row calls deciding as single decode steps, calibration
trials counting what serving drops. A row drops only tiles wholly before its 128 most recent keys, so cases reach
positions >= 255. Thresholds are nudged away from decision boundaries (`safe_lambdas`), so counts must match
exactly.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from skip_attention_helpers import (
    LAYOUTS,
    backend_law,
    default_prompt_lens,
    dense_attention_f64,
    gather_dense,
    log_lams_tensor,
    logical,
    make_case,
    oracle,
    quantile_lambda,
    safe_lambdas,
    safe_log_lambda,
)
from test_skip_softmax_semantics import (
    assert_close64,
    check_strided_queries_and_output,
    chunk_of,
    law_kwargs,
    law_oracle,
    mixed_case,
    run,
)

from modelopt_ext.torch.kernels.sparsity.attention import SPLIT_TOKENS, api, cpu_kernel

# (atol, rtol) vs float64 on the same (rounded) inputs: fp32 accumulates in fp32; bf16/fp16 round the output.
TOL = {torch.float32: (3e-5, 1e-4), torch.bfloat16: (2e-2, 1e-2), torch.float16: (4e-3, 4e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_kernel_builds():
    """The kernel must build wherever `make` built the environments (g++ and ninja are part of the setup)."""
    reason = cpu_kernel.unavailable_reason()
    if reason is not None and "switched off" in reason:
        pytest.skip(reason)
    assert reason is None, reason


@pytest.fixture(autouse=True)
def _needs_kernel(request):
    if "cannot_build" in request.node.name or request.node.name == "test_kernel_builds":
        return  # test_kernel_builds must fail, not skip, when the kernel does not build
    if cpu_kernel.unavailable_reason() is not None:
        pytest.skip(f"compiled CPU kernel unavailable: {cpu_kernel.unavailable_reason()}")


def close(out, expected, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.to(torch.float64), expected, atol=atol, rtol=rtol)


def unit_stats(case, prompt_lens=None, **kw) -> list[torch.Tensor]:
    """Per sequence, the oracle's statistics of every droppable unit-tile (version 4) with these prompt lengths
    (default: the API's, a one-row sequence being a decode step), `kw` the oracle's (softcap, sinks)."""
    prompt_lens = default_prompt_lens(case) if prompt_lens is None else list(prompt_lens)
    dense = torch.full((case.batch, 1, 2), -math.inf, dtype=torch.float64)
    return oracle(case, None, law=(dense, torch.zeros(case.batch, 2), prompt_lens), **kw).tile_stats


def quantile_log_lams(stats, quantile: float = 0.5) -> torch.Tensor:
    """Per sequence a ln λ near `quantile` of its finite unit statistics (-0.5 where it has none), nudged off every
    statistic of the sequence: [B, 1] float64."""
    out = []
    for st in stats:
        finite = st[torch.isfinite(st)]
        x = float(torch.quantile(finite, quantile)) + 1e-2 if finite.numel() else -0.5
        out.append(safe_log_lambda(min(x, -1e-3), st))
    return torch.tensor(out, dtype=torch.float64).unsqueeze(1)


def plain_law(log_lams: torch.Tensor, prompt_lens) -> tuple[dict, tuple]:
    """A plain λ per sequence (ln λ [B, 1], both phases, γ = 0) with explicit prompt lengths: the API's keyword
    arguments and the oracle's `law`."""
    batch = log_lams.shape[0]
    log_sf = log_lams.to(torch.float32).expand(batch, 2).contiguous()
    kw = dict(log_scale_factors=log_sf, length_exponents=torch.zeros(2),
              prompt_lens=torch.tensor(list(prompt_lens), dtype=torch.int32))  # fmt: skip
    return kw, (log_sf.double().unsqueeze(1), torch.zeros(batch, 2), list(prompt_lens))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_and_dtypes_match_oracle(layout, dtype):
    """Dense, serving and calibration on every layout and dtype: mixed prefill / decode / empty sequences."""
    case = mixed_case(dtype=dtype, hq=6, hkv=2, d=64, page=16, layout=layout, seed=31)
    dense, counts = run(case, "cpu")
    assert counts is None
    close(dense, dense_attention_f64(case), dtype)
    lam = torch.tensor([quantile_lambda(case, b, 0.5) for b in range(case.batch)])
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    assert torch.equal(counts, ref.counts)
    assert (counts[[0, 1], 0, 1] > 0).all(), "the case must skip tiles in prefill and decode"
    close(out, ref.out, dtype)
    trials = safe_lambdas(case, torch.tensor([1e-3, 0.05, 0.3]).expand(case.batch, -1).contiguous())
    out_cal, cal = run(case, "cpu", trials=trials)
    assert torch.equal(cal, oracle(case, log_lams_tensor(trials, case.batch), calibrate=True).counts)
    assert torch.equal(out_cal, dense), "calibration output is the dense output"


@pytest.mark.parametrize(
    "page,hq,hkv,d",
    [(16, 9, 3, 64), (32, 8, 1, 64), (128, 4, 2, 32), (5, 6, 2, 32), (24, 7, 7, 80), (64, 12, 4, 24)],
    ids=["p16-gqa3", "p32-mqa8", "p128", "p5", "p24-mha-d80", "p64-d24"],
)
@pytest.mark.parametrize("layout", ["cpu_t", "nhd"])
def test_page_sizes_and_head_groups(page, hq, hkv, d, layout):
    """In-place K (page a multiple of 16, keys contiguous) and repacked K, group sizes that leave micro-kernel
    tails, head sizes that are not a multiple of 16."""
    case = make_case([150, 1, 1, 9], [150, 2100, 33, 200], hq=hq, hkv=hkv, d=d, page=page, layout=layout, seed=32)
    lam = torch.tensor([quantile_lambda(case, b, 0.6) for b in range(case.batch)])
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    assert torch.equal(counts, ref.counts) and counts[..., 1].sum() > 0
    close(out, ref.out, torch.float32)
    dense, _ = run(case, "cpu")
    close(dense, dense_attention_f64(case), torch.float32)


def test_matches_reference_with_the_length_law():
    """Against the reference through the public API with the per-row law (prefill and decode phases, γ != 0)."""
    case = make_case([120, 1, 37, 1], [120, 700, 300, 64], hq=6, hkv=3, d=64, page=32, layout="cpu_t", seed=33)
    prompts = [120, 500, 280, 63]  # sequences 1 and 2 hold decode rows (spec-decode style for 2)
    kw = dict(
        log_scale_factors=torch.tensor([[math.log(0.2 * 120), math.log(0.1 * 500)]] * 4),
        length_exponents=torch.tensor([1.0, 0.8]),
        prompt_lens=torch.tensor(prompts, dtype=torch.int32),
    )
    law = (kw["log_scale_factors"].unsqueeze(1), kw["length_exponents"].expand(4, 2), prompts)
    expected = oracle(case, None, law=law)
    ours, c_ours = run(case, "cpu", counts=True, **kw)
    ref, c_ref = run(case, "torch", counts=True, **kw)
    assert torch.equal(c_ours, c_ref) and torch.equal(c_ours, expected.counts) and c_ours[..., 1].sum() > 0
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    close(ours, expected.out, torch.float32)


def test_dense_thresholds_and_counts_without_threshold():
    case = mixed_case(seed=34, hq=2, hkv=1)
    dense, _ = run(case, "cpu")
    visited = oracle(case, log_lams_tensor(0.0, case.batch)).counts[..., 0]
    out, counts = run(case, "cpu", skip_threshold=torch.tensor([1.0, 1.5, 0.0, -0.3, math.nan, math.inf]), counts=True)
    assert torch.equal(out, dense) and (counts[..., 1] == 0).all() and torch.equal(counts[..., 0], visited)
    out, counts = run(case, "cpu", counts=True)
    assert torch.equal(out, dense) and (counts[..., 1] == 0).all() and torch.equal(counts[..., 0], visited)


def test_batch_and_thread_invariance():
    """A sequence's rows are bitwise the same alone or batched, and with 1 or 2 threads."""
    case = mixed_case(seed=36, hq=3, hkv=1, page=32, layout="cpu_t")
    lam = safe_lambdas(case, torch.tensor([0.05, 0.1, 0.3, 0.02, 0.5, 0.08]))
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    for b in range(case.batch):
        o_b, c_b = run(case.subset(b), "cpu", skip_threshold=lam[b : b + 1], counts=True)
        q0, q1 = int(case.cu_seqlens_q[b]), int(case.cu_seqlens_q[b + 1])
        assert torch.equal(o_b, out[q0:q1]) and torch.equal(c_b[0], counts[b]), f"sequence {b}"
    torch.set_num_threads(2)  # the autouse fixture restores the count
    out2, counts2 = run(case, "cpu", skip_threshold=lam, counts=True)
    assert torch.equal(out2, out) and torch.equal(counts2, counts)


def test_empty_and_one_token_sequences():
    case = make_case([0, 1, 0, 1], [0, 1, 5, 9], seed=37)
    out, counts = run(case, "cpu", skip_threshold=0.5, counts=True)
    assert counts[[0, 2]].eq(0).all() and counts[1].tolist() == [[4, 0]] and counts[3].tolist() == [[4, 0]]
    close(out, dense_attention_f64(case), torch.float32)
    empty = make_case([0, 0], [3, 0], seed=38)
    out, counts = run(empty, "cpu", skip_threshold=0.5, counts=True)
    assert out.shape[0] == 0 and (counts == 0).all()


def test_fp32_probabilities_to_fp32_precision():
    """Two keys whose scaled scores differ by x, V rows e_0 and e_1: the output row is (1, e^x) / (1 + e^x), so it
    shows the exp the softmax uses, over the whole fp32 range (x from -100, past where e^x underflows to 0, to 30).
    Within 2e-7 + 1e-6 relative of float64: the probabilities are good to a few fp32 ulps of the row's largest (an
    exp good to bf16's 1e-4, as the packed bf16 path's, is 3e-5 off here); those far below it carry the rounding of
    y = s * scale * log2 e (up to 4e-8 * |y| relative), which moves an output by less than 1e-12."""
    x = torch.cat([torch.linspace(-100.0, 30.0, 61), torch.randn(19, dtype=torch.float64).float() * 8])
    n, d, page = x.numel(), 64, 16
    case = make_case([1] * n, [2] * n, hq=1, hkv=1, d=d, page=page, layout="cpu_t", seed=40)
    case.q.zero_()
    case.q[:, 0, 0] = math.sqrt(d)  # scaled score of key j = K[j, 0]
    k, v = logical(case.k_cache), logical(case.v_cache)
    blk = case.block_table[:, 0].long()  # each sequence's one page
    k[blk, :2] = torch.rand(n, 2, 1, d) - 0.5  # dims 1.. do not meet the query
    k[blk, 0, 0, 0], k[blk, 1, 0, 0] = 0.0, x
    v[blk, :2] = 0.0
    v[blk, 0, 0, 0], v[blk, 1, 0, 1] = 1.0, 1.0
    out, _ = run(case, "cpu")
    x64 = x.double()
    expected = torch.stack([1 / (1 + x64.exp()), x64.exp() / (1 + x64.exp())], dim=1)
    torch.testing.assert_close(out[:, 0, :2].double(), expected, rtol=1e-6, atol=2e-7)
    assert out[:, 0, 2:].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_rows_restart_at_splits_with_the_anchor(dtype):
    """Rows past 2048 keys: decode rows and short chunks (one item: a prompt block's rows) run as parallel key splits
    merged at the end, their recent window in the last split; a chunk over two items walks the splits in order; all
    restart the reference max at each split, seeded with tile 0."""
    kv = 2 * SPLIT_TOKENS + 300
    case = make_case([1, 1, 3, 4, 11], [kv, SPLIT_TOKENS + 1, kv, SPLIT_TOKENS + 42, 2311], hq=4, hkv=2, d=64,
                     page=128, layout="cpu_t", dtype=dtype, seed=39)  # fmt: skip
    # (the last sequence's rows 2300..2310 straddle 2304, a boundary of the items' row blocks (128 rows at 2 heads per
    # KV head, 256 on the packed path): two items, walked in order)
    lam = torch.tensor([quantile_lambda(case, b, 0.5) for b in range(case.batch)])
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    assert torch.equal(counts, ref.counts) and (counts[:, 0, 1] > 0).all()
    close(out, ref.out, dtype)
    dense, _ = run(case, "cpu")
    close(dense, dense_attention_f64(case), dtype)


@pytest.mark.parametrize("others", [False, True], ids=["alone", "batched"])
def test_rows_do_not_depend_on_chunking(others):
    """A prompt whole or cut into chunks at multiples of 64 (the last one a single token), alone or batched: same
    rows, same counts; the generated row the same as a decode step and inside a longer chunk. A chunk that starts
    inside a block (a cut the contract does not pin) decides over the block's rows it holds, as the oracle does."""
    prompt = 449
    q_lens, kv_lens = ([prompt + 1, 1, 40], [prompt + 1, 120, 40]) if others else ([prompt + 1], [prompt + 1])
    case = make_case(q_lens, kv_lens, hq=4, hkv=2, d=32, page=16, layout="cpu_t", seed=40, spread=2.0)
    prompts = [prompt, *(kv - 1 if ql == 1 else kv for ql, kv in zip(q_lens[1:], kv_lens[1:], strict=True))]
    whole = chunk_of(case, 0, prompt)
    # ModelOpt's law (γ = 1): the prefill λ drops about a third of the prompt's droppable unit-tiles
    log_lam = float(quantile_log_lams(unit_stats(whole, prompts)[:1], 0.3)[0, 0])
    log_sf, gamma = [log_lam + math.log(prompt), math.log(0.1 * prompt)], [1.0, 1.0]
    out_whole, c_whole = run(whole, "cpu", counts=True, **law_kwargs(whole, log_sf, gamma, prompts))
    expected = law_oracle(whole, log_sf, gamma, prompts)
    assert torch.equal(c_whole, expected.counts) and c_whole[0, 0, 1] > 0
    assert_close64(out_whole, expected.out, torch.float32)
    inside = chunk_of(case, 300, prompt)
    o, c = run(inside, "cpu", counts=True, **law_kwargs(inside, log_sf, gamma, prompts))
    expected = law_oracle(inside, log_sf, gamma, prompts)
    assert torch.equal(c, expected.counts)
    assert_close64(o, expected.out, torch.float32)
    total = torch.zeros_like(c_whole[0])
    cuts = [0, 64, 192, 320, 448, prompt]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        part = chunk_of(case, a, b)
        o, c = run(part, "cpu", counts=True, **law_kwargs(part, log_sf, gamma, prompts))
        torch.testing.assert_close(o[: b - a], out_whole[a:b], atol=2e-6, rtol=1e-5)
        total += c[0]
    assert torch.equal(total, c_whole[0])
    step = chunk_of(case, prompt, prompt + 1)
    o_step, c = run(step, "cpu", counts=True, **law_kwargs(step, log_sf, gamma, prompts))
    assert torch.equal(c, law_oracle(step, log_sf, gamma, prompts).counts)
    tail = chunk_of(case, 256, prompt + 1)
    o_tail, _ = run(tail, "cpu", **law_kwargs(tail, log_sf, gamma, prompts))
    torch.testing.assert_close(o_tail[prompt - 256 :], o_step, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(o_tail[: prompt - 256], out_whole[256:prompt], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["cpu_t", "nhd", "hnd5"])
@pytest.mark.parametrize("page", [16, 32, 128, 7])
def test_stale_nan_inf_past_kv_len_never_reaches_outputs(layout, page):
    """Slots past kv_len hold NaN/inf, pages past the sequence too, and the block table past a sequence's pages
    points anywhere (even outside the cache): nothing of it may reach an output or a count."""
    q_lens, kv_lens = [70, 1, 2, 1], [130, 65, 40, 2200]
    case = make_case(q_lens, kv_lens, hq=4, hkv=2, d=32, page=page, layout=layout, seed=41)
    clean = oracle(case, log_lams_tensor(0.05, case.batch))
    used = set()
    for b, kv in enumerate(kv_lens):
        used |= set(case.block_table[b, : math.ceil(kv / page)].tolist())
    for b, kv in enumerate(kv_lens):
        n_pages = math.ceil(kv / page)
        last = int(case.block_table[b, n_pages - 1])
        case.k_cache[last, kv % page or page :] = math.inf
        case.v_cache[last, kv % page or page :] = math.nan
        case.k_cache[last, (kv + 1) % page or page :] = -math.nan if kv % 2 else math.nan
        for junk in case.block_table[b, n_pages:].tolist():
            if junk not in used:
                case.k_cache[junk] = math.nan
                case.v_cache[junk] = math.inf
        case.block_table[b, n_pages:] = 10**6  # never dereferenced
    lam = safe_lambdas(case, torch.full((case.batch,), 0.05))
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    assert torch.equal(counts, ref.counts) and torch.equal(counts[..., 0], clean.counts[..., 0])
    close(out, ref.out, torch.float32)
    dense, _ = run(case, "cpu")
    close(dense, dense_attention_f64(case), torch.float32)


def test_strided_queries_and_output():
    check_strided_queries_and_output("cpu", layout="cpu_t", seed=42)


def test_block_table_entry_outside_the_cache_is_an_error():
    case = make_case([3], [40], page=16, seed=43)
    case.block_table[0, 1] = case.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        run(case, "cpu")
    case = make_case([5], [5], seed=44)
    case.seq_lens_k[0] = 3
    with pytest.raises(RuntimeError, match="must include"):
        run(case, "cpu")


def test_auto_dispatch(caplog):
    """auto takes the compiled kernel for CPU fp32/bf16/fp16, the reference for float64 (reason logged once);
    backend='cpu' refuses float64 with the fix named."""
    for dtype in DTYPES:
        case = make_case([3], [3], dtype=dtype, seed=45)
        assert api.resolve_backend("auto", case.q, case.k_cache) == "cpu"
    case = make_case([3], [3], dtype=torch.float64, seed=46)
    api._warn_fallback.cache_clear()
    with caplog.at_level(logging.WARNING, logger=api.__name__):
        for _ in range(3):
            assert api.resolve_backend("auto", case.q, case.k_cache) == "torch"
            run(case, "auto")
    warnings = [r for r in caplog.records if "using the PyTorch reference" in r.getMessage()]
    assert len(warnings) == 1 and "float64" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="backend='auto' or 'torch'"):
        run(case, "cpu")


FALLBACK_SCRIPT = """
import logging, sys, torch
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention, cpu_kernel
q = torch.randn(5, 2, 16)
k = torch.randn(2, 4, 1, 16)
v = torch.randn(2, 4, 1, 16)
args = (q, k, v, torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32))
ref = paged_skip_softmax_attention(*args, softmax_scale=0.25, backend="torch")
for _ in range(3):
    out = paged_skip_softmax_attention(*args, softmax_scale=0.25)
torch.testing.assert_close(out, ref)
print("REASON", cpu_kernel.unavailable_reason())
"""


@pytest.mark.parametrize("env", ["switched_off", "unwritable_cache"])
def test_where_it_cannot_build_auto_uses_the_reference_and_says_why_once(env, tmp_path):
    """A fresh process whose kernel cannot load: `auto` still computes (the reference), with one warning naming
    the reason. Needs no compiler, so it also runs where the kernel is unavailable."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    extra = {"MODELOPT_EXT_CPU_KERNEL": "0"} if env == "switched_off" else {"MODELOPT_EXT_CACHE_DIR": str(blocker)}
    proc = subprocess.run([sys.executable, "-c", FALLBACK_SCRIPT], env={**os.environ, **extra}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stdout.splitlines() if ln.startswith("WARNING") and "PyTorch reference" in ln]
    assert len(warnings) == 1, proc.stdout
    expected = "switched off (MODELOPT_EXT_CPU_KERNEL=0)" if env == "switched_off" else "did not build"
    assert expected in warnings[0]
    assert f"REASON the compiled CPU kernel {'is ' if env == 'switched_off' else ''}" in proc.stdout


def _cpu_flags() -> str:
    return Path("/proc/cpuinfo").read_text() if os.path.exists("/proc/cpuinfo") else ""


def use_bf16_engine(engine: str) -> None:
    """Select what bf16 prefill items run on: "amx" (AMX tiles), "dot" (AVX512-BF16 VDPBF16PS on the same packed
    pairs) or "vector" (fp32 FMAs); skips with the reason where this CPU or build cannot."""
    cpu_kernel.amx_tiles(engine == "amx")
    cpu_kernel.bf16_dot(engine == "dot")
    if cpu_kernel.bf16_engine() == engine:
        return
    flags = _cpu_flags()
    if engine == "amx":
        has = "amx_bf16" in flags and "amx_tile" in flags
        pytest.skip("AMX tiles unused: " + ("switched off or not granted by the OS" if has else
                                            "this CPU has no amx_tile/amx_bf16 flags"))  # fmt: skip
    pytest.skip("VDPBF16PS unused: " + ("switched off" if "avx512_bf16" in flags else
                                        "this CPU has no avx512_bf16 flag"))  # fmt: skip


@pytest.fixture
def bf16_engines():
    """Lets a test switch bf16 engines (use_bf16_engine); restores the process's setting after it."""
    before = (cpu_kernel.amx_tiles(), cpu_kernel.bf16_dot())
    yield use_bf16_engine
    cpu_kernel.amx_tiles(before[0])
    cpu_kernel.bf16_dot(before[1])


ENGINE_SCRIPT = """
from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel
print("ENGINE", cpu_kernel.bf16_engine(), cpu_kernel.bf16_dot())
"""


@pytest.mark.parametrize("off", [("MODELOPT_EXT_CPU_AMX",), ("MODELOPT_EXT_CPU_AMX", "MODELOPT_EXT_CPU_BF16_DOT")],
                         ids=["amx-off", "amx-and-dot-off"])  # fmt: skip
def test_bf16_engine_switches_from_the_environment(off):
    """`MODELOPT_EXT_CPU_AMX=0` leaves bf16 prefill to VDPBF16PS where the CPU has AVX512-BF16 (else the fp32 vector
    path); with `MODELOPT_EXT_CPU_BF16_DOT=0` too it runs the fp32 vector path everywhere. A fresh process, as a
    user starts one."""
    if not cpu_kernel.available():
        pytest.skip(f"compiled CPU kernel unavailable: {cpu_kernel.unavailable_reason()}")
    env = {**os.environ, "MODELOPT_EXT_CPU_BF16_DOT": "1", **{name: "0" for name in off}}
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("ENGINE"))
    dot = "avx512_bf16" in _cpu_flags() and "MODELOPT_EXT_CPU_BF16_DOT" not in off
    assert line.split()[1:] == (["dot", "True"] if dot else ["vector", "False"])


@pytest.fixture(params=["amx", "dot"], ids=["amx-tiles", "dot"])
def packed_engine(request, bf16_engines):
    """The packed bf16 paths: AMX tiles and VDPBF16PS (each skipped with the reason where this CPU lacks it)."""
    bf16_engines(request.param)
    return request.param


@pytest.mark.parametrize("d,page,layout", [(64, 16, "cpu_t"), (128, 128, "cpu_t"), (32, 7, "cpu_t"), (96, 16, "nhd"),
                                           (80, 16, "cpu_t")],
                         ids=["d64-p16", "d128-p128", "d32-p7-repacked", "d96-nhd", "d80-p16"])  # fmt: skip
def test_packed_bf16_paths(packed_engine, bf16_engines, d, page, layout):
    """bf16 on packed pairs (Q·K and P·V on AMX tiles or VDPBF16PS, K and V interleaved into B-tile pairs per tile):
    exact counts and the float64 oracle's output at bf16 tolerance, dense and skipping, with stale NaN/inf past
    kv_len in the cache; the fp32 vector path gives the same counts and an output within the same tolerance. A
    head size of 80 is not a multiple of 32: AMX tiles leave it on the vector path, VDPBF16PS takes it."""
    q_lens, kv_lens = [450, 1, 3, 1, 40], [450, 2100, 270, 33, 40]
    case = make_case(q_lens, kv_lens, hq=6, hkv=2, d=d, page=page, layout=layout, dtype=torch.bfloat16, seed=47,
                     spread=2.0)  # fmt: skip
    for b, kv in enumerate(kv_lens):
        if kv % page:
            last = int(case.block_table[b, math.ceil(kv / page) - 1])
            case.k_cache[last, kv % page :] = math.nan
            case.v_cache[last, kv % page :] = math.inf
    lam = quantile_log_lams(unit_stats(case))[:, 0].exp().float()
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    results = {}
    for engine in (packed_engine, "vector"):
        bf16_engines(engine)
        out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
        assert torch.equal(counts, ref.counts) and (counts[[0, 1, 2], 0, 1] > 0).all(), engine
        close(out, ref.out, torch.bfloat16)
        dense, _ = run(case, "cpu")
        close(dense, dense_attention_f64(case), torch.bfloat16)
        results[engine] = out
    if packed_engine == "dot" or d % 32 == 0:
        assert not torch.equal(results[packed_engine], results["vector"]), "the two engines must take different paths"


def test_packed_rows_do_not_depend_on_chunking_or_batch(packed_engine):
    """On packed pairs (AMX tiles or VDPBF16PS) a row's result does not depend on the other rows of its work item: a
    prompt alone or batched, whole or in chunks cut at multiples of 64, gives bitwise the same rows wherever the
    row's item runs packed in both runs (an item of at least 16 (row, head) pairs: here every chunk of 8 rows or
    more). A one-row chunk (the prompt's last row, its block's only one) runs on the vector path: the same
    decisions (counts) and its row within bf16 rounding."""
    prompt = 321
    case = make_case([prompt, 1, 40], [prompt, 400, 40], hq=4, hkv=2, d=64, page=16, layout="cpu_t",
                     dtype=torch.bfloat16, seed=48, spread=2.0)  # fmt: skip
    prompts = [prompt, 399, 40]
    law, _ = plain_law(quantile_log_lams(unit_stats(case, prompts)), prompts)
    out, counts = run(case, "cpu", counts=True, **law)
    assert (counts[:2, 0, 1] > 0).all()
    alone_law = {**law, "log_scale_factors": law["log_scale_factors"][:1], "prompt_lens": law["prompt_lens"][:1]}
    alone, c_alone = run(case.subset(0), "cpu", counts=True, **alone_law)
    assert torch.equal(alone, out[:prompt]) and torch.equal(c_alone[0], counts[0])
    total = torch.zeros_like(counts[0])
    for a, b in [(0, 64), (64, 320), (320, 321)]:
        o, c = run(chunk_of(case.subset(0), a, b), "cpu", counts=True, **alone_law)
        if b - a >= 8:
            assert torch.equal(o[: b - a], out[a:b]), f"chunk {a}..{b}"
        else:
            torch.testing.assert_close(o[: b - a], out[a:b], atol=2e-2, rtol=1e-2)
        total += c[0]
    assert torch.equal(total, counts[0])


def _climb_keys(case, page):
    """Scores that climb by the key's position: K[pos, every head, dim 0] = pos (exact in bf16 below 256) and
    Q[..., 0] = sqrt(D), so with the 1/sqrt(D) scale each 64-key tile's max is about 64 above the last one's. Writes
    the 4-D (`vec`) or the 6-D (`amx`) views in place."""
    q0 = 0
    for b, kv in enumerate(case.kv_lens):
        pos = torch.arange(kv)
        blk, t = case.block_table[b, pos // page].long(), pos % page
        val = pos.to(case.k_cache.dtype).unsqueeze(-1)
        if case.k_cache.dim() == 6:
            case.k_cache[blk, t // 16, t % 16, :, 0, 0] = val
        else:
            logical(case.k_cache)[blk, t, :, 0] = val
        case.q[q0 : q0 + case.q_lens[b], :, 0] = math.sqrt(case.q.shape[-1])
        q0 += case.q_lens[b]


def test_packed_rows_rescale_when_scores_climb(packed_engine):
    """The packed path raises a row's softmax max only when a tile's max exceeds it by more than 8: scores that climb
    by 64 per 64-key tile (to about 200) make every row rescale its state at almost every tile, and short diagonal
    tiles stay under the margin. Outputs match the float64 oracle at bf16 tolerance with exact counts (no tile is
    skippable here); a row that stopped rescaling would overflow exp(s - max) past its first tiles (e^88)."""
    case = make_case([200, 70], [200, 70], hq=4, hkv=2, d=64, page=16, layout="nhd", dtype=torch.bfloat16, seed=49)
    _climb_keys(case, 16)
    dense, _ = run(case, "cpu")
    assert torch.isfinite(dense).all()
    close(dense, dense_attention_f64(case), torch.bfloat16)
    lam = torch.tensor([0.05, 0.05])
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    ref = oracle(case, log_lams_tensor(lam, case.batch))
    assert torch.equal(counts, ref.counts)
    close(out, ref.out, torch.bfloat16)


@pytest.fixture(params=["amx", "dot", "vector"], ids=["amx-tiles", "dot", "vector"])
def bf16_path(request, bf16_engines):
    """Every bf16 engine: AMX tiles, VDPBF16PS (where this CPU has them; skipped with the reason elsewhere) and the
    fp32 vector path."""
    bf16_engines(request.param)
    return request.param


def test_bf16_softcap_on_every_engine(bf16_path):
    """Logit soft-capping in bf16 on each engine (the packed engines cap their scores in the shared mask pass):
    counts equal the float64 oracle's on the capped scores, outputs within bf16 tolerance, and the cap changes
    the decisions."""
    cap = 2.5
    case = make_case([70, 1, 1, 3], [330, 2300, 90, 3], hq=4, hkv=2, d=32, page=16, dtype=torch.bfloat16, seed=51,
                     spread=2.0)  # fmt: skip
    log_lams = quantile_log_lams(unit_stats(case, softcap=cap))
    expected = oracle(case, log_lams, softcap=cap)
    out, counts = run(case, "cpu", skip_threshold=log_lams[:, 0].exp().float(), counts=True, logits_soft_cap=cap)
    assert torch.equal(counts, expected.counts) and counts[..., 1].sum() > 0
    close(out, expected.out, torch.bfloat16)
    assert not torch.equal(oracle(case, log_lams).counts, expected.counts), "capped scores must drop other tiles"
    dense, _ = run(case, "cpu", logits_soft_cap=cap)
    close(dense, oracle(case, None, softcap=cap).out, torch.bfloat16)


def test_prefill_blocks_at_every_tile_boundary(bf16_path):
    """A 16-row block takes the tile-max pass without masking only where its first row sees the whole tile. Prefill
    chunks starting at every offset around the first two tile boundaries put the first row of each block at 63, 64
    and 65 visible keys of a tile (one query head per KV head: row m sits at offset + m): counts equal the float64
    oracle's and outputs stay within tolerance, skipping and dense, in bf16 on each engine and (with the vector
    engine) in fp32. The last key of every tile carries a V 50x the others, so a score the causal mask should have
    hidden from a block's first row (a block taken as whole one key too early) moves that row's output far past the
    bf16 tolerance."""
    offsets = [*range(284, 324), *range(348, 388)]  # past position 255: rows drop tiles before their recent window
    q_lens, kv_lens = [48] * len(offsets), [o + 48 for o in offsets]
    dtypes = [torch.bfloat16] + ([torch.float32] if bf16_path == "vector" else [])
    for dtype in dtypes:
        case = make_case(q_lens, kv_lens, hq=2, hkv=2, d=64, page=32, dtype=dtype, seed=52, spread=2.0)
        for b, kv in enumerate(kv_lens):
            for pos in range(63, kv, 64):
                case.v_cache[case.block_table[b, pos // 32], pos % 32] *= 50
        lam = quantile_log_lams(unit_stats(case))[:, 0].exp().float()
        ref = oracle(case, log_lams_tensor(lam, case.batch))
        out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
        assert torch.equal(counts, ref.counts) and counts[..., 1].sum() > 0
        close(out, ref.out, dtype)
        close(run(case, "cpu")[0], dense_attention_f64(case), dtype)


# ---------------------------------------------------------------------------------------------------------------
# Version 4's decision units on every path: a prompt block's rows and a decode row's heads decide together.
# ---------------------------------------------------------------------------------------------------------------
def _use_path(bf16_engines, path: str):
    """The dtype of a test path: "fp32" (the vector path), or bf16 on the engine named ("amx-tiles", "dot",
    "vector"; skipped with the reason where this CPU lacks it)."""
    if path == "fp32":
        return torch.float32
    bf16_engines(path.split("-")[0])
    return torch.bfloat16


@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2)], ids=["mha", "gqa3"])
@pytest.mark.parametrize("path", ["fp32", "amx-tiles", "dot"])
def test_prompt_block_decides_together(bf16_engines, path, hq, hkv):
    """The prompt rows of an aligned 64-position block of one head decide together (one work item holds the block):
    counts equal the float64 oracle's and outputs its within tolerance; the same rows each in a call of its own
    (each then its own unit) drop strictly more, each exactly as the oracle decides for that call."""
    dtype = _use_path(bf16_engines, path)
    prompt, first = 400, 255  # rows from 255 on hold tiles wholly before their recent window
    case = make_case([prompt], [prompt], hq=hq, hkv=hkv, d=64, page=16, layout="cpu_t", dtype=dtype, seed=60,
                     spread=2.0)  # fmt: skip
    singles = [chunk_of(case, a, a + 1) for a in range(first, prompt)]
    stats = torch.cat([*unit_stats(case, [prompt]), *(unit_stats(c, [prompt])[0] for c in singles)])
    log_lam = safe_log_lambda(float(quantile_log_lams(unit_stats(case, [prompt]), 0.5)), stats)
    law, oracle_law = plain_law(torch.tensor([[log_lam]], dtype=torch.float64), [prompt])
    expected = oracle(case, None, law=oracle_law)
    out, counts = run(case, "cpu", counts=True, **law)
    assert torch.equal(counts, expected.counts) and counts[0, 0, 1] > 0
    close(out, expected.out, dtype)
    rows = torch.zeros(2, dtype=torch.int64)
    for single in singles:
        _, c = run(single, "cpu", counts=True, **law)
        assert torch.equal(c, oracle(single, None, law=oracle_law).counts)
        rows += c[0, 0]
    _, blocks = run(chunk_of(case, first + 1, prompt), "cpu", counts=True, **law)  # 256: a block start
    assert rows[1] > blocks[0, 0, 1], "a block drops a tile only where every one of its rows does"


@pytest.mark.parametrize("path,layout", [("fp32", "cpu_t"), ("vector", "cpu_t"), ("dot", "cpu_t"),
                                         ("amx-tiles", "cpu_t"), ("vector", "cpu_amx"), ("dot", "cpu_amx"),
                                         ("amx-tiles", "cpu_amx")])  # fmt: skip
def test_decode_rows_inside_multi_row_calls_decide_as_decode_steps(bf16_engines, path, layout):
    """Decode rows (pos >= prompt_len) decide per GQA group wherever they run: speculative rows verified in one call,
    and a call recomputing a prompt's last block with the generated rows after it (after preemption), give every
    decode row the decisions (counts) and the output (to rounding of the path its item takes) of its own decode
    step, and every prompt row those of the whole prompt; counts equal the float64 oracle's. On vLLM's `amx` layout
    (decode steps on AMX tiles: decode_tiles) bitwise the results of the same K/V on the `vec` layout."""
    dtype = _use_path(bf16_engines, path)
    prompt, n_gen = 300, 6
    kw = dict(hq=8, hkv=2, d=64, page=32, dtype=dtype, seed=61, spread=2.0)

    def calls(case):
        steps = [chunk_of(case, p, p + 1) for p in range(prompt, prompt + n_gen)]
        spec, recompute, whole = (chunk_of(case, a, b) for a, b in ((prompt, prompt + n_gen), (256, prompt + n_gen),
                                                                     (0, prompt)))  # fmt: skip
        return steps, spec, recompute, whole

    case = make_case([prompt + n_gen], [prompt + n_gen], layout=layout, **kw)
    steps, spec, recompute, whole = calls(case)
    stats = torch.cat([unit_stats(c, [prompt])[0] for c in [*steps, spec, recompute, whole]])
    finite = stats[torch.isfinite(stats)]
    log_lam = safe_log_lambda(float(torch.quantile(finite, 0.4)), stats)
    law, oracle_law = plain_law(torch.tensor([[log_lam]], dtype=torch.float64), [prompt])
    results = {}
    for name, call in [*((f"step{i}", s) for i, s in enumerate(steps)), ("spec", spec), ("recompute", recompute),
                       ("whole", whole)]:  # fmt: skip
        out, counts = run(call, "cpu", counts=True, **law)
        expected = oracle(call, None, law=oracle_law)
        assert torch.equal(counts, expected.counts), name
        close(out, expected.out, dtype)
        results[name] = (out, counts)
    step_out = torch.cat([results[f"step{i}"][0] for i in range(n_gen)])
    step_counts = sum(results[f"step{i}"][1] for i in range(n_gen))
    assert step_counts[0, 0, 1] > 0, "the decode steps must drop tiles"
    atol, rtol = (2e-6, 1e-5) if dtype == torch.float32 else TOL[dtype]
    assert torch.equal(results["spec"][1], step_counts)
    torch.testing.assert_close(results["spec"][0], step_out, atol=atol, rtol=rtol)
    recomputed = results["recompute"][0]
    torch.testing.assert_close(recomputed[prompt - 256 :], step_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(recomputed[: prompt - 256], results["whole"][0][256:], atol=atol, rtol=rtol)
    if layout == "cpu_amx":
        vec = make_case([prompt + n_gen], [prompt + n_gen], layout="cpu_t", **kw)
        steps, spec, recompute, whole = calls(vec)
        for name, call in [*((f"step{i}", s) for i, s in enumerate(steps)), ("spec", spec),
                           ("recompute", recompute), ("whole", whole)]:  # fmt: skip
            out, counts = run(call, "cpu", counts=True, **law)
            assert torch.equal(out, results[name][0]) and torch.equal(counts, results[name][1]), name


@pytest.mark.parametrize("path", ["fp32", "amx-tiles", "dot", "vector"])
def test_calibration_trials_count_what_serving_drops(bf16_engines, path):
    """Calibration (T trials, dense output) counts for each trial exactly what serving at that trial drops, with a
    λ per phase and explicit prompt lengths: a prompt chunk starting inside a block, speculative decode rows in one
    call, a decode step, a call of prompt rows and decode rows (recompute), a decode row over three key splits;
    both equal the float64 oracle's."""
    dtype = _use_path(bf16_engines, path)
    long = 2 * SPLIT_TOKENS + 300
    q_lens, kv_lens, prompts = [200, 5, 1, 70, 1], [450, 305, 400, 340, long], [450, 300, 399, 320, long - 1]
    case = make_case(q_lens, kv_lens, hq=6, hkv=2, d=64, page=32, layout="cpu_t", dtype=dtype, seed=62, spread=2.0)
    stats = unit_stats(case, prompts)
    # [B, T, 2]: the prefill and decode λ of a trial differ
    log_sf = torch.stack(
        [torch.cat([quantile_log_lams(stats, x), quantile_log_lams(stats, 1 - x)], dim=1) for x in (0.2, 0.5, 0.8)],
        dim=1,
    ).float()
    law = dict(length_exponents=torch.zeros(2), prompt_lens=torch.tensor(prompts, dtype=torch.int32))
    expected = oracle(case, None, calibrate=True, law=(log_sf.double(), torch.zeros(case.batch, 2), prompts))
    out_cal, cal = run(case, "cpu", log_scale_factors=log_sf, **law)
    assert torch.equal(cal, expected.counts) and (cal[:, 1:, 1] > 0).all()
    assert torch.equal(out_cal, run(case, "cpu", **law, log_scale_factors=torch.full((case.batch, 2), -math.inf))[0])
    for t in range(log_sf.shape[1]):
        _, served = run(case, "cpu", counts=True, log_scale_factors=log_sf[:, t].contiguous(), **law)
        assert torch.equal(served[:, 0], cal[:, t]), f"trial {t}"


def _poison_amx_case(case, page):
    """NaN/inf in every slot past each sequence's kv_len (its last page) and in every page no sequence uses."""
    k, v = case.k_cache, case.v_cache  # 6-D split views: (b, t, h, d) at [b, t // p2, t % p2, h, ...]
    used = set()
    for b, kv in enumerate(case.kv_lens):
        used |= set(case.block_table[b, : math.ceil(kv / page)].tolist())
    for b, kv in enumerate(case.kv_lens):
        last = int(case.block_table[b, math.ceil(kv / page) - 1])
        for t in range(kv % page or page, page):
            k[last, t // 16, t % 16] = math.nan if t % 2 else math.inf
            v[last, t // 2, t % 2] = math.inf if t % 2 else math.nan
    for blk in set(range(k.shape[0])) - used:
        k[blk] = math.nan
        v[blk] = math.inf


@pytest.mark.parametrize("d,page,hq,hkv", [(64, 32, 6, 2), (128, 64, 8, 1), (96, 32, 9, 3), (64, 32, 12, 2)],
                         ids=["d64-p32", "d128-p64-mqa", "d96-gqa3", "d64-p32-gqa6"])  # fmt: skip
def test_vllm_amx_cache_layout_read_in_place(bf16_path, d, page, hq, hkv):
    """vLLM's CPU `amx` layout (bf16 K/V stored as AMX B tiles; 6-D split views) read in place: counts equal the
    oracle's, outputs within bf16 tolerance of the float64 oracle, dense and skipping, with NaN/inf in every slot
    past kv_len and in unused pages; and bitwise the outputs of the same K/V in the `vec` layout ("cpu_t") on the
    same path (the same fp32 operations in the same order). Prefill blocks, short and split (> 2048 keys) decode
    rows; on AMX tiles decode rows (3, 6 and 8 heads per KV head here) run on tiles of the group's rows
    (decode_tiles)."""
    q_lens, kv_lens = [450, 1, 3, 1, 40], [450, 2100, 270, 33, 40]
    kw = dict(hq=hq, hkv=hkv, d=d, page=page, dtype=torch.bfloat16, seed=49, spread=2.0)
    case = make_case(q_lens, kv_lens, layout="cpu_amx", **kw)
    vec = make_case(q_lens, kv_lens, layout="cpu_t", **kw)
    assert case.k_cache.dim() == 6 and torch.equal(case.q, vec.q)
    _poison_amx_case(case, page)
    stats = unit_stats(vec)
    lam = quantile_log_lams(stats)[:, 0].exp().float()
    ref = oracle(vec, log_lams_tensor(lam, case.batch))
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    assert torch.equal(counts, ref.counts) and (counts[[0, 1, 2], 0, 1] > 0).all()
    close(out, ref.out, torch.bfloat16)
    out_vec, counts_vec = run(vec, "cpu", skip_threshold=lam, counts=True)
    assert torch.equal(out, out_vec) and torch.equal(counts, counts_vec)
    dense, _ = run(case, "cpu")
    close(dense, dense_attention_f64(vec), torch.bfloat16)
    assert torch.equal(dense, run(vec, "cpu")[0])
    trials = torch.cat([quantile_log_lams(stats, x) for x in (0.1, 0.5, 0.9)], dim=1).exp().float()
    out_cal, cal = run(case, "cpu", trials=trials)
    assert torch.equal(cal, oracle(vec, log_lams_tensor(trials, case.batch), calibrate=True).counts)
    assert torch.equal(out_cal, dense) and torch.equal(cal, run(vec, "cpu", trials=trials)[1])


@pytest.mark.parametrize("hq,hkv,d", [(6, 2, 64), (5, 1, 32), (15, 1, 128)], ids=["gqa3-d64", "gqa5-d32",
                                                                               "gqa15-d128"])  # fmt: skip
def test_amx_layout_decode_on_tiles_of_the_group(bf16_engines, hq, hkv, d):
    """Decode rows and short chunks of 3 to 15 (row, head) pairs on vLLM's `amx` layout run on AMX tiles of those
    rows, tile by tile, their next K and kept V prefetched (decode_tiles): counts equal the float64 oracle's
    (serving, and calibration trials), outputs within bf16 tolerance of it and bitwise those of the same K/V on the
    `vec` layout (the pipelined tile path), with and without soft-capping, across key splits (2100 keys), at tile
    and page boundaries, with NaN/inf past kv_len and in unused pages. Scores that climb about 64 per tile make
    each row rescale its output between two P·V steps (the exp of a tile runs after P·V of the one before)."""
    bf16_engines("amx")
    page = 32
    q_lens, kv_lens = [1, 1, 1, 2, 3, 1], [2100, 33, 64, 330, 270, 297]
    kw = dict(hq=hq, hkv=hkv, d=d, page=page, dtype=torch.bfloat16, seed=53, spread=2.0)
    case, vec = make_case(q_lens, kv_lens, layout="cpu_amx", **kw), make_case(q_lens, kv_lens, layout="cpu_t", **kw)
    _poison_amx_case(case, page)
    for cap in (0.0, 2.5):
        log_lams = quantile_log_lams(unit_stats(vec, softcap=cap))
        lam = log_lams[:, 0].exp().float()
        ref = oracle(vec, log_lams, softcap=cap)
        out, counts = run(case, "cpu", skip_threshold=lam, counts=True, logits_soft_cap=cap)
        assert torch.equal(counts, ref.counts) and counts[0, 0, 1] > 0, cap
        assert cap or counts[1:, 0, 1].sum() > 0, "uncapped, the short calls drop tiles too"
        close(out, ref.out, torch.bfloat16)
        out_vec, counts_vec = run(vec, "cpu", skip_threshold=lam, counts=True, logits_soft_cap=cap)
        assert torch.equal(out, out_vec) and torch.equal(counts, counts_vec), cap
        dense, _ = run(case, "cpu", logits_soft_cap=cap)
        close(dense, oracle(vec, None, softcap=cap).out, torch.bfloat16)
        assert torch.equal(dense, run(vec, "cpu", logits_soft_cap=cap)[0])
    stats = unit_stats(vec)
    trials = torch.cat([quantile_log_lams(stats, x) for x in (0.1, 0.5, 0.9)], dim=1).exp().float()
    out_cal, cal = run(case, "cpu", trials=trials)
    assert torch.equal(cal, oracle(vec, log_lams_tensor(trials, case.batch), calibrate=True).counts)
    assert torch.equal(out_cal, run(case, "cpu")[0])

    q_lens, kv_lens = [1, 2, 1], [200, 130, 70]
    case, vec = make_case(q_lens, kv_lens, layout="cpu_amx", **kw), make_case(q_lens, kv_lens, layout="cpu_t", **kw)
    _climb_keys(case, page)
    _climb_keys(vec, page)
    dense, _ = run(case, "cpu")
    assert torch.isfinite(dense).all()
    close(dense, dense_attention_f64(vec), torch.bfloat16)
    assert torch.equal(dense, run(vec, "cpu")[0])
    lam = torch.full((case.batch,), 0.05)
    out, counts = run(case, "cpu", skip_threshold=lam, counts=True)
    ref = oracle(vec, log_lams_tensor(lam, case.batch))
    assert torch.equal(counts, ref.counts)
    close(out, ref.out, torch.bfloat16)


def test_vllm_amx_cache_layout_in_the_reference_and_auto():
    """The PyTorch reference reads the 6-D views too (bitwise what it computes on the `vec` layout: it gathers
    the same logical K/V); `auto` takes the compiled kernel for them in bf16. 6-D views are the amx layout only:
    float32 in that shape is refused by backend='cpu' with the reason, and `auto` computes it with the reference."""
    kw = dict(hq=4, hkv=2, d=64, page=32, seed=50)
    case = make_case([40, 1], [40, 100], layout="cpu_amx", dtype=torch.bfloat16, **kw)
    vec = make_case([40, 1], [40, 100], layout="cpu_t", dtype=torch.bfloat16, **kw)
    lam = safe_lambdas(vec, torch.tensor([0.05, 0.05]))
    ref_amx, c_amx = run(case, "torch", skip_threshold=lam, counts=True)
    ref_vec, c_vec = run(vec, "torch", skip_threshold=lam, counts=True)
    assert torch.equal(ref_amx, ref_vec) and torch.equal(c_amx, c_vec)
    assert api.resolve_backend("auto", case.q, case.k_cache) == "cpu"
    f32 = make_case([40, 1], [40, 100], layout="cpu_amx", dtype=torch.float32, **kw)
    assert "amx layout" in cpu_kernel.unsupported_reason(f32.q, f32.k_cache)
    with pytest.raises(RuntimeError, match="amx layout"):
        run(f32, "cpu")
    close(run(f32, "auto")[0], dense_attention_f64(f32), torch.float32)


def _sinks_near_the_anchor(case, offsets=(-3.0, 0.5, 3.0)) -> torch.Tensor:
    """Attention sinks (float32 [Hq]) around each head's typical tile-0 max (the median over the rows of the max
    scaled score of keys 0..63), offset per head by `offsets` in turn: some heads' sinks sit below their rows'
    anchors, some above (those raise the reference max and dominate the denominator)."""
    hq = case.q.shape[1]
    group = hq // logical(case.k_cache).shape[2]
    anchors = [[] for _ in range(hq)]
    for b in range(case.batch):
        q0, ql, kv = int(case.cu_seqlens_q[b]), case.q_lens[b], case.kv_lens[b]
        if ql == 0:
            continue
        k = gather_dense(case.k_cache, case.block_table[b], min(kv, 64))
        q = case.q[q0 : q0 + ql].to(torch.float64)
        pos = kv - ql + torch.arange(ql)
        for h in range(hq):
            s = case.scale * q[:, h] @ k[:, h // group].T
            s = s.masked_fill(torch.arange(k.shape[0])[None, :] > pos[:, None], -math.inf)
            anchors[h].append(s.amax(-1))
    med = torch.stack([torch.cat(a).median() for a in anchors])
    return (med + torch.tensor([offsets[h % len(offsets)] for h in range(hq)], dtype=torch.float64)).float()


def _sink_log_lams(case, sinks, log_lam: float, vec=None) -> torch.Tensor:
    """ln λ [B, 1] off every tile statistic with the sinks (of `vec`, the same K/V in the `vec` layout, if given)."""
    stats = oracle(vec if vec is not None else case, None, sinks=sinks).tile_stats
    return torch.tensor([[safe_log_lambda(log_lam, stats[b])] for b in range(case.batch)], dtype=torch.float64)


def _check_sinks(case, sinks, log_lam, dtype, vec=None):
    """Serving (exact counts, output), dense and calibration with sinks against the float64 oracle (computed on
    `vec`, the same K/V in the `vec` layout, where given); the sinks must change decisions and outputs. Returns
    (serving output, counts, dense output, calibration output) for bitwise comparisons."""
    ref_case = vec if vec is not None else case
    log_lams = _sink_log_lams(case, sinks, log_lam, vec)
    expected = oracle(ref_case, log_lams, sinks=sinks)
    out, counts = run(case, "cpu", skip_threshold=log_lams[:, 0].exp().float(), counts=True, sinks=sinks)
    assert torch.equal(counts, expected.counts) and counts[..., 1].sum() > 0
    close(out, expected.out, dtype)
    assert not torch.equal(expected.counts, oracle(ref_case, log_lams).counts), "the sinks must change decisions"
    dense, _ = run(case, "cpu", sinks=sinks)
    expected_dense = dense_attention_f64(ref_case, sinks)
    close(dense, expected_dense, dtype)
    atol = TOL[dtype][0]
    assert (expected_dense - dense_attention_f64(ref_case)).abs().max() > 20 * atol, "the sinks must change outputs"
    stats = oracle(ref_case, None, sinks=sinks).tile_stats
    trials = [math.exp(safe_log_lambda(x, torch.cat(stats))) for x in (-3.0, log_lam, -0.3)]
    out_cal, cal = run(case, "cpu", trials=trials, sinks=sinks)
    expected_cal = oracle(ref_case, torch.log(torch.tensor(trials, dtype=torch.float64)).expand(case.batch, -1),
                          calibrate=True, sinks=sinks)  # fmt: skip
    assert torch.equal(cal, expected_cal.counts)
    assert torch.equal(out_cal, dense), "calibration output is the dense output"
    return out, counts, dense, out_cal


# prefill rows (one chunk after a prefix, over several row blocks and past a split: walked in order, each split's
# reference max seeded with the anchor and the sink), a decode row past two splits (parallel key splits, merged),
# a short chunk, decode rows at tile and page boundaries
SINK_Q_LENS, SINK_KV_LENS = [200, 1, 3, 1, 1, 40], [2300, 2 * SPLIT_TOKENS + 300, 70, 64, 33, 40]


def test_sinks_on_every_bf16_engine(bf16_path):
    """Attention sinks in bf16 on each engine (AMX tiles, VDPBF16PS, fp32 vectors), `vec` layout with stale NaN/inf
    past kv_len: prefill items on the packed pairs (their lazy rescale starts from the sink), decode items, key
    splits. Exact counts, outputs within bf16 tolerance of the float64 oracle, serving, dense and calibration."""
    case = make_case(SINK_Q_LENS, SINK_KV_LENS, hq=6, hkv=2, d=64, page=16, layout="cpu_t", dtype=torch.bfloat16,
                     seed=54)  # fmt: skip
    for b, kv in enumerate(SINK_KV_LENS):
        if kv % 16:
            last = int(case.block_table[b, math.ceil(kv / 16) - 1])
            case.k_cache[last, kv % 16 :] = math.nan
            case.v_cache[last, kv % 16 :] = math.inf
    _check_sinks(case, _sinks_near_the_anchor(case), -1.0, torch.bfloat16)


def test_sinks_in_fp32_and_fp16_across_splits():
    """The same with fp32 and fp16 on the vector path (fp32 at its tight tolerance)."""
    for dtype in (torch.float32, torch.float16):
        case = make_case(SINK_Q_LENS, SINK_KV_LENS, hq=6, hkv=2, d=64, page=32, layout="cpu_t", dtype=dtype, seed=55)
        _check_sinks(case, _sinks_near_the_anchor(case), -1.0, dtype)


@pytest.mark.parametrize("hq,hkv,d,page", [(6, 2, 64, 32), (8, 1, 128, 64)], ids=["gqa3", "gqa8-mqa"])
def test_sinks_on_the_vllm_amx_layout(bf16_path, hq, hkv, d, page):
    """Sinks on vLLM's `amx` layout read in place, with NaN/inf past kv_len and in unused pages: decode rows of 3
    and 8 heads per KV head (on AMX tiles: decode_tiles; at 8 also the pipelined tile path for the short chunk),
    key splits, prefill on the packed path. Counts exact and outputs within bf16 tolerance of the float64 oracle;
    bitwise the results of the same K/V in the `vec` layout on the same engine (serving, dense, calibration)."""
    kw = dict(hq=hq, hkv=hkv, d=d, page=page, dtype=torch.bfloat16, seed=56)
    case = make_case(SINK_Q_LENS, SINK_KV_LENS, layout="cpu_amx", **kw)
    vec = make_case(SINK_Q_LENS, SINK_KV_LENS, layout="cpu_t", **kw)
    _poison_amx_case(case, page)
    sinks = _sinks_near_the_anchor(vec)
    results = _check_sinks(case, sinks, -1.0, torch.bfloat16, vec=vec)
    results_vec = _check_sinks(vec, sinks, -1.0, torch.bfloat16)
    for a, b in zip(results, results_vec, strict=True):
        assert torch.equal(a, b)


def test_sinks_with_climbing_scores_rescale_past_the_sink(bf16_path):
    """Scores that climb about 64 per tile (to about 255) with sinks from far below to far above them: rows start
    their online softmax at the sink and raise it (on the packed paths only past sink + 8, the lazy rescale), or
    never reach it (a sink above every score: the output is nearly zero). Finite outputs within bf16 tolerance of
    the float64 oracle, on the `amx` layout (decode_tiles on AMX tiles) and on the `vec` layout (prefill too). The
    decode rows at 255 drop tile 1 where their whole group's sinks sit above it."""
    hq, hkv, page = 6, 2, 32
    sinks = torch.tensor([-30.0, 5.0, 70.0, 140.0, 190.0, 260.0])
    kw = dict(hq=hq, hkv=hkv, d=64, page=page, dtype=torch.bfloat16, seed=57)
    for layout, q_lens, kv_lens in (("cpu_amx", [1, 2, 1], [256, 130, 70]), ("cpu_t", [256, 1, 70], [256, 256, 70])):
        case = make_case(q_lens, kv_lens, layout=layout, **kw)
        _climb_keys(case, page)
        dense, _ = run(case, "cpu", sinks=sinks)
        assert torch.isfinite(dense).all()
        close(dense, dense_attention_f64(case, sinks), torch.bfloat16)
        lam = torch.full((case.batch,), 0.05)
        out, counts = run(case, "cpu", skip_threshold=lam, counts=True, sinks=sinks)
        ref = oracle(case, log_lams_tensor(lam, case.batch), sinks=sinks)
        assert torch.equal(counts, ref.counts) and counts[..., 1].sum() > 0, layout
        close(out, ref.out, torch.bfloat16)


def test_sinks_through_the_launcher_and_bad_sinks():
    """`kernel_launcher("cpu")` (the vLLM plugin's launch) with sinks gives bitwise the public entry's result, and
    without them bitwise the sinkless one; the op refuses sinks that are not a contiguous float32 [Hq] tensor."""
    case = make_case([40, 1], [40, 300], hq=4, hkv=2, d=32, page=16, layout="cpu_t", seed=58)
    sinks = _sinks_near_the_anchor(case)
    log_lams = _sink_log_lams(case, sinks, -1.0)
    lam = log_lams[:, 0].exp().float()
    launch = api.kernel_launcher("cpu")
    law = backend_law(case, log_lams_tensor(lam, case.batch))
    for s in (sinks, None):
        out = torch.empty_like(case.q)
        counts = launch(*case.args(), softmax_scale=case.scale, calibrate=False, out=out, sinks=s, **law)
        expected, expected_counts = run(case, "cpu", skip_threshold=lam, counts=True, sinks=s)
        assert torch.equal(out, expected) and torch.equal(counts, expected_counts)
    for bad in (sinks.double(), sinks[:3], torch.stack([sinks, sinks], 1)[:, 0]):
        with pytest.raises(RuntimeError, match="sinks must be a contiguous float32"):
            launch(*case.args(), softmax_scale=case.scale, calibrate=False, out=torch.empty_like(case.q), sinks=bad,
                   **law)  # fmt: skip
