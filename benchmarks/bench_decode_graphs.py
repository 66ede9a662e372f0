#!/usr/bin/env python
"""Sparse decode in CUDA graphs, without vLLM: the start-up self-test, and eager launch vs graph replay latency.

    python benchmarks/bench_decode_graphs.py --device cuda --out gpu_logs/graphs   # on a GPU (scripts/gpu_check.py)
    python benchmarks/bench_decode_graphs.py --device cpu --quick                  # CPU rehearsal (no capture)

1. Self-test: `graph_check.decode_graph_self_test` with the Triton kernel at Llama-3-8B decode shapes (32 query
   heads, 8 KV heads, head 128, page 16, max_model_len 32768) in bf16 and fp16: the same test the vLLM plugin runs at
   engine start before it declares full decode graphs.
2. Latency: one decode launch per step as the plugin issues it (persistent counts and split-K workspace, grid from
   max_model_len), B = 1, 8, 64 sequences of 8192 tokens, λ from the law with a target that drops tiles: the eager
   launch (host work + launch) against the replay of the same launch captured in a CUDA graph, timed with CUDA
   events over many steps. The ratio is what full decode graphs save per layer and step.

On the CPU (`--device cpu`) the self-test uses `replay_by_call` (everything but the capture) with the compiled CPU
kernel, and latency rows time the eager launch only. Results: `<out>/graphs.json` and `<out>/graphs.txt`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from modelopt_ext.torch.kernels.sparsity.attention.api import kernel_launcher
from modelopt_ext.torch.kernels.sparsity.attention.graph_check import (
    cuda_graph_capture,
    decode_graph_self_test,
    replay_by_call,
)
from modelopt_ext.torch.kernels.sparsity.attention.semantics import decode_workspace_numel

LLAMA_8B = dict(num_heads=32, num_kv_heads=8, head_size=128, page_size=16)
SMALL = dict(num_heads=4, num_kv_heads=2, head_size=32, page_size=16)


def self_tests(device, backend, shapes, max_model_len, dtypes) -> list[dict]:
    rows = []
    for dtype in dtypes:
        start = time.perf_counter()
        problem = decode_graph_self_test(
            kernel_launcher(backend), dtype=dtype, device=device, max_model_len=max_model_len, batch_sizes=(1, 8),
            capture=cuda_graph_capture if device.type == "cuda" else replay_by_call, **shapes,
        )  # fmt: skip
        rows.append({"test": "self-test", "dtype": str(dtype).replace("torch.", ""), "passed": problem is None,
                     "problem": problem, "seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
    return rows


def _time(fn, steps: int, device) -> float:
    """Milliseconds per call (CUDA events on a GPU, wall clock on the CPU)."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / steps
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / steps


def latency(device, backend, shapes, batch, context, max_model_len, dtype, steps) -> dict:
    """Eager launch vs graph replay of one sparse decode launch of `batch` sequences of `context` tokens."""
    hq, hkv, d, page = shapes["num_heads"], shapes["num_kv_heads"], shapes["head_size"], shapes["page_size"]
    pages = math.ceil(context / page)
    torch.manual_seed(0)
    k = torch.randn(batch * pages + 1, page, hkv, d, device=device, dtype=dtype)
    v = torch.randn(batch * pages + 1, page, hkv, d, device=device, dtype=dtype)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    out = torch.empty_like(q)
    table = torch.zeros(batch, math.ceil(max_model_len / page), dtype=torch.int32)
    table[:, :pages] = (torch.randperm(batch * pages) + 1).view(batch, pages).to(torch.int32)
    block_table = table.to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device)
    prompt_lens = torch.full((batch,), context - 100, dtype=torch.int32, device=device)
    log_sf = torch.full((batch, 1, 2), math.log(0.5 * context), dtype=torch.float32, device=device)  # λ ≈ 0.5
    gamma = torch.ones(batch, 2, dtype=torch.float32, device=device)
    counts = torch.zeros(batch, 1, 2, dtype=torch.int64, device=device)
    workspace = tuple(torch.empty(n, dtype=torch.float32, device=device)
                      for n in decode_workspace_numel(batch, hq, d, max_model_len))  # fmt: skip
    launch = kernel_launcher(backend)

    def step():
        launch(q, k, v, block_table, cu_q, seq_lens, softmax_scale=d**-0.5, log_sf=log_sf, gamma=gamma,
               prompt_lens=prompt_lens, calibrate=False, out=out, max_seqlen_k=max_model_len, counts=counts,
               workspace=workspace, decode_only=True)  # fmt: skip

    eager = _time(step, steps, device)
    row = {"test": "latency", "batch": batch, "context": context, "dtype": str(dtype).replace("torch.", ""),
           "eager_ms": round(eager, 4), "skipped": round(float(counts[:, 0, 1].sum() / counts[:, 0, 0].sum()), 3)}
    if device.type == "cuda":
        replay = cuda_graph_capture(step)
        graph = _time(replay, steps, device)
        row.update(graph_ms=round(graph, 4), eager_over_graph=round(eager / graph, 2))
    return row


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        if r["test"] == "self-test":
            lines.append(f"self-test {r['dtype']}: {'passed' if r['passed'] else 'FAILED: ' + str(r['problem'])} "
                         f"({r['seconds']} s)")
    lines += ["", "| batch | context | dtype | eager ms | graph ms | eager / graph | skipped tiles |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["test"] == "latency":
            lines.append(f"| {r['batch']} | {r['context']} | {r['dtype']} | {r['eager_ms']:.4f} | "
                         f"{r.get('graph_ms', '-')} | {r.get('eager_over_graph', '-')} | {r['skipped']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="folder for graphs.json and graphs.txt")
    p.add_argument("--quick", action="store_true", help="small shapes (CPU rehearsal)")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    backend = "triton" if cuda else "cpu"
    shapes = SMALL if args.quick else LLAMA_8B
    max_model_len = 8192 if args.quick else 32768
    dtypes = (torch.bfloat16, torch.float16) if cuda else (torch.float32,)
    rows = self_tests(device, backend, shapes, max_model_len, dtypes)
    for batch in (1, 8, 64):
        context = 1024 if args.quick else 8192
        rows.append(latency(device, backend, shapes, batch, context, max_model_len, dtypes[0],
                            args.steps if cuda else 5))  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "shapes": shapes, "max_model_len": max_model_len, "backend": backend}  # fmt: skip
    text = table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "graphs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1), encoding="utf-8")
        (out / "graphs.txt").write_text(text + "\n", encoding="utf-8")
    return 0 if all(r.get("passed", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
