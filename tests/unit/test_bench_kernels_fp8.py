"""The kernel benchmark's FP8-cache rows (issues #66, #68) on the CPU: the quantized cache, the options, the rows and
their dense FP8 baseline (a stand-in for FlashInfer with its paged decode's plan/run interface)."""

from __future__ import annotations

import math
import types
from pathlib import Path

import pytest
import torch
from benchmark_modules import load_benchmark, load_script

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("bench_kernels", "bench_kernels_fp8_under_test")


def test_quantize_saturates_and_rounds_to_nearest(bench):
    x = torch.tensor([[0.0, 1.0, -1.0, 500.0, -1e4, 1.0625, 1.07, 300.0]])
    q = bench.quantize_fp8(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn
    # ±448 saturate (an unclamped cast makes NaN), 1.0625 ties to even (1.0), 1.07 rounds up (1.125), 300 -> 288
    assert q.float().tolist() == [[0.0, 1.0, -1.0, 448.0, -448.0, 1.0, 1.125, 288.0]]
    big = bench.quantize_fp8(torch.tensor([[1e6]]), torch.float8_e5m2)
    assert big.float().item() == 57344.0


def test_fp8_options(bench):
    args = bench.parse_args(["--device", "cpu"])
    assert args.fp8_caches == ["fp8"] and args.fp8_phases == ["decode"] and args.fp8_sparsities == [0.5, 0.7]
    assert bench.parse_args(["--device", "cpu", "--kv-cache-dtype", "auto"]).fp8_caches == []
    both = bench.parse_args(["--device", "cpu", "--kv-cache-dtype", "fp8_e4m3,fp8,fp8_e5m2", "--page-sizes", "16,64"])
    assert both.fp8_caches == ["fp8", "fp8_e5m2"]  # one name per format
    assert bench.fp8_applies(bench.Shape("decode", 2, 4096, 8, 2, 64, 16), both)
    assert not bench.fp8_applies(bench.Shape("decode", 2, 4096, 8, 2, 64, 64), both)  # other page sizes: no FP8 rows
    assert not bench.fp8_applies(bench.Shape("prefill", 1, 1024, 8, 2, 64, 16), both)
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--kv-cache-dtype", "auto,int8"])
    assert "CUDA" in bench.load_flashinfer("auto", "cpu").reason
    assert "off" in bench.load_flashinfer("off", "cuda").reason


class _FakeDecodeWrapper:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper interface, computing dense attention from the plan's page
    metadata (so wrong indices or last-page lengths show as a differing output)."""

    plans: list = []

    def __init__(self, workspace, layout, use_tensor_cores=False):
        assert layout == "NHD" and workspace.dtype == torch.uint8

    def plan(self, indptr, indices, last, hq, hkv, d, page, pos_encoding_mode, q_data_type, kv_data_type, sm_scale):
        assert pos_encoding_mode == "NONE" and kv_data_type in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.meta = (indptr, indices, last, hq, hkv, d, page, sm_scale)
        _FakeDecodeWrapper.plans.append(self.meta)

    def run(self, q, kv_cache, k_scale, v_scale, out):
        indptr, indices, last, hq, hkv, d, page, scale = self.meta
        assert kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        for b in range(indptr.numel() - 1):
            pages = indices[indptr[b] : indptr[b + 1]].long()
            n = (pages.numel() - 1) * page + int(last[b])
            k = kv_cache[pages, 0].reshape(-1, hkv, d)[:n].float() * k_scale
            v = kv_cache[pages, 1].reshape(-1, hkv, d)[:n].float() * v_scale
            k, v = (x.repeat_interleave(hq // hkv, dim=1) for x in (k, v))
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * scale, dim=-1)
            out[b] = torch.einsum("hn,nhd->hd", p, v).to(out.dtype)
        return out


def test_fp8_rows_beside_the_model_dtype_rows(bench):
    """A decode shape gets e4m3 rows (dense, s50, s70) after its fp32 rows, each checked, timed and set beside ours on
    the fp32 cache and the dense FP8 baseline; the GPU check's summary table shows them."""
    args = bench.parse_args(["--device", "cpu", "--synthetic", "--sparsities", "0.5,0.7", "--target-seconds",
                             "0.01", "--max-iters", "2", "--min-iters", "1"])  # fmt: skip
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeDecodeWrapper)
    fi = bench.FlashInferFP8(fake, "fake")
    shape = bench.Shape("decode", 2, 2000, 4, 2, 64, 16)  # long enough for the λ search to reach 0.5 and 0.7
    mo = bench.ModelOptBaseline(reason="test")
    recs = bench.run_shape(shape, args, torch.float32, mo, math.inf, lambda m: None, fi=fi)
    indptr, indices, last, *_ = _FakeDecodeWrapper.plans[-1]
    assert indptr.tolist() == [0, 125, 250] and last.tolist() == [2000 - 124 * 16] * 2 and indices.numel() == 250
    rows = bench.summarize(recs)
    cases = [r["case"] for r in rows]
    assert cases == ["dense", "tiny", "s50", "s70", "e4m3 dense", "e4m3 s50", "e4m3 s70"]
    fp8 = [r for r in rows if r["kv"] == "e4m3"]
    for r in fp8:
        assert not r["error"] and r["ours_ms"] > 0 and r["ours_dense_ms"] > 0, r
        assert r["speedup_vs_model_cache"] > 0 and r["fp8_base_ms"] > 0 and r["speedup_vs_fp8_base"] > 0, r
        assert r["fp8_base_note"] == "FP8 dense baseline: FlashInfer (ok)", r
    assert fp8[0]["check"] == "ok (vs SDPA on the FP8 values)" and fp8[0]["sparsity"] == 0.0
    for r8, r in zip(fp8[1:], rows[2:4], strict=True):  # at the fp32 cache's λ, about its sparsity
        assert r8["lam"] == r["lam"] and abs(r8["sparsity"] - r["sparsity"]) < 0.1, (r8, r)
    dense8 = next(r for r in recs if r["variant"] == "ours_e4m3_dense")
    assert 0 < dense8["err_vs_model_dtype_cache"] < 0.5  # e4m3 rounding moves the output a little
    table = bench.format_table(rows)
    assert "e4m3 s50" in table and "x auto" in table and "FP8b ms" in table
    check = load_script(REPO / "scripts" / "gpu_check.py", "gpu_check_fp8_under_test")
    text = check.summary_table(rows)
    assert "e4m3 s70" in text and "FP8 dense baseline: FlashInfer (ok)" in text


def test_fp8_rows_without_a_baseline_say_why(bench):
    args = bench.parse_args(["--device", "cpu", "--synthetic", "--sparsities", "0.5", "--target-seconds", "0.01",
                             "--max-iters", "2", "--min-iters", "1", "--fp8-phases", "prefill,decode"])  # fmt: skip
    shape = bench.Shape("prefill", 1, 256, 4, 2, 64, 16)
    fi = bench.load_flashinfer("auto", "cpu")
    recs = bench.run_shape(shape, args, torch.float32, bench.ModelOptBaseline(reason="test"), math.inf,
                           lambda m: None, fi=fi)  # fmt: skip
    fp8 = [r for r in bench.summarize(recs) if r["kv"] == "e4m3"]
    assert [r["case"] for r in fp8] == ["e4m3 dense", "e4m3 s50"]
    assert fp8[0]["check"].startswith("ok")
    assert all(r["fp8_base_ms"] is None and "needs a CUDA device" in r["fp8_base_note"] for r in fp8)
    assert all(not r["error"] for r in fp8)
