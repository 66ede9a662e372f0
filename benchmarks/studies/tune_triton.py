#!/usr/bin/env python
"""Launch-configuration sweep of the Triton kernels (`triton_kernel.LaunchConfig`) on a GPU.

Never a timed test. It answers which launch parameters to make the default on a GPU: rows per prefill program
(64 or 128), warps, pipeline stages, and how a serving kernel skips a tile no row keeps (`SKIP_MODES`: a branch
around the V load, exp and P·V; V loaded and P·V run for every tile, a branch around the exp only; or no branch).
None of them changes skip decisions or counts; the sweep checks that against the default configuration.

    python benchmarks/studies/tune_triton.py --out gpu_logs/tune                  # on the GPU (about 3 minutes)
    TRITON_INTERPRET=1 python benchmarks/studies/tune_triton.py --quick --device cpu --dtype fp16   # CPU rehearsal

Per shape (the structured inputs of bench_kernels.py): λ for the target sparsity from a calibration sweep, then
for every configuration the dense (λ=None) and the sparse time (CUDA events, median), each beside the default
configuration and cuDNN/flash SDPA measured in the same run. Writes tune.json and tune.txt into --out after
every shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import _benchmarks_path  # noqa: F401  (benchmarks/ on sys.path: bench_kernels)
import torch
from bench_kernels import (
    DTYPES,
    Inputs,
    Shape,
    find_lambdas,
    ours_launch,
    sdpa,
    sdpa_backends,
    time_fn,
)

from modelopt_ext.torch.kernels.sparsity.attention import triton_kernel as tk

# (rows per program, warps, stages, skip mode, causal mask only on the diagonal tiles): after the default, the
# launches measured on an H200 on 2026-12-04 (docs/benchmarks.md): the two earlier defaults, the runners-up and the
# branch-free skip (which Triton 3.6 could not compile for prefill there); then `prefetch` (not measured yet: V
# loaded a tile ahead so exp and P·V can be skipped by a branch without a synchronous V load).
PREFILL_SWEEP = [
    (128, 8, 2, "prefetch", True),
    (128, 8, 3, "prefetch", True),
    (64, 4, 2, "prefetch", True),
    (128, 8, 2, "branch", False),
    (64, 8, 2, "branch", False),
    (128, 8, 3, "exp", True),
    (64, 4, 2, "exp", True),
    (128, 8, 2, "branch", True),
    (128, 8, 2, "exp", False),
    (128, 8, 2, "predicated", True),
]


def prefill_configs(head_dim: int) -> list[tk.LaunchConfig]:
    base = tk.default_launch_config(head_dim)
    out = [base]
    for bq, warps, stages, skip, split in PREFILL_SWEEP:
        cfg = dataclasses.replace(base, prefill_block_q=bq, prefill_warps=warps, prefill_stages=stages,
                                  prefill_skip=skip, prefill_split_causal=split)  # fmt: skip
        if cfg not in out:
            out.append(cfg)
    return out


# (warps, stages, skip mode): on the H200 4 or 8 warps with 3-4 stages were 1.2-1.5x slower than 2 x 3 at B=1.
DECODE_SWEEP = [(2, 3, "exp"), (2, 3, "predicated"), (2, 4, "branch"), (4, 2, "branch"), (4, 2, "exp")]


def decode_configs(head_dim: int) -> list[tk.LaunchConfig]:
    base = tk.default_launch_config(head_dim)
    out = [base]
    for warps, stages, skip in DECODE_SWEEP:
        cfg = dataclasses.replace(base, decode_warps=warps, decode_stages=stages, decode_skip=skip)
        if cfg not in out:
            out.append(cfg)
    return out


def parse_configs(text: str, head_dim: int) -> list[tk.LaunchConfig]:
    """`--configs`: ';'-separated LaunchConfig overrides of the default, e.g. 'prefill_block_q=64,prefill_warps=4'
    (an empty item is the default itself)."""
    base = tk.default_launch_config(head_dim)
    out = []
    for item in text.split(";"):
        kw = {}
        for pair in filter(None, (x.strip() for x in item.split(","))):
            key, value = pair.split("=")
            if key.endswith("_skip"):
                kw[key] = value
            elif key.endswith(("_acc", "_causal")):
                kw[key] = value.lower() in ("1", "true", "yes")
            else:
                kw[key] = int(value)
        cfg = dataclasses.replace(base, **kw)
        if cfg not in out:
            out.append(cfg)
    return out


def label(cfg: tk.LaunchConfig, phase: str) -> str:
    if phase == "prefill":
        extra = (" fused" if cfg.prefill_fused_acc else "") + (" split" if cfg.prefill_split_causal else "")
        return f"q{cfg.prefill_block_q} w{cfg.prefill_warps} s{cfg.prefill_stages}{extra} {cfg.prefill_skip}"
    return f"w{cfg.decode_warps} s{cfg.decode_stages} {cfg.decode_skip}"


def sweep_shape(shape: Shape, dtype, args, deadline: float, log) -> dict:
    inp = Inputs(shape, dtype, args.device, seed=0)
    chosen, method = find_lambdas(inp, [args.sparsity], "triton")
    lam, predicted = chosen[args.sparsity]
    rec: dict = {"shape": shape.label, "dtype": args.dtype, "lambda": lam, "lambda_method": method, "rows": []}
    if args.device == "cuda":
        best = None
        for name, be in sdpa_backends("cuda"):
            try:
                t = time_fn(lambda _i, be=be: sdpa(inp, be, "native"), 1, "cuda", args)["ms"]
            except Exception as exc:  # noqa: BLE001 - a backend that does not take this shape
                log(f"  {name}: {type(exc).__name__}: {exc}")
                continue
            if best is None or t < best[1]:
                best = (name, t)
        rec["sdpa"] = best
    if args.configs is not None:
        configs = parse_configs(args.configs, shape.head_dim)
    else:
        configs = prefill_configs(shape.head_dim) if shape.phase == "prefill" else decode_configs(shape.head_dim)
    ref = {}
    labels = {label(c, shape.phase) for c in configs}
    for i, cfg in enumerate(configs):
        if time.monotonic() > deadline:
            rec["rows"].append({"config": label(cfg, shape.phase), "error": "time budget"})
            continue
        row = {"config": label(cfg, shape.phase), "default": i == 0}
        try:
            for mode, lam_m in (("dense", None), ("sparse", lam)):
                twin = label(cfg, shape.phase).rpartition(" ")[0] + " branch"
                if mode == "dense" and twin != row["config"] and twin in labels:
                    continue  # the skip mode only matters when serving: dense time is its branch twin's
                run = ours_launch(inp, lam_m, "triton", config=cfg)
                o, c = run(inp)
                o = o.clone()
                if i == 0:
                    ref[mode] = (o, None if c is None else c.clone())
                    if c is not None:
                        v = c[:, 0].sum(0).double()
                        row["sparsity"] = float(v[1] / v[0])
                else:
                    diff = float((o.float() - ref[mode][0].float()).abs().max())
                    same_counts = c is None or torch.equal(c, ref[mode][1])
                    row[f"{mode}_maxdiff"] = diff
                    row[f"{mode}_counts_equal"] = same_counts
                row[f"{mode}_ms"] = time_fn(lambda _i, run=run: run(inp), 1, args.device, args)["ms"]
        except Exception as exc:  # noqa: BLE001 - a configuration that does not compile (shared memory)
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rec["rows"].append(row)
        log(f"  {row}")
    # the dense time of an exp / predicated twin is its branch twin's
    by_label = {r["config"]: r for r in rec["rows"]}
    for r in rec["rows"]:
        head, _, mode = r["config"].rpartition(" ")
        if mode != "branch" and "dense_ms" not in r:
            twin = by_label.get(f"{head} branch", {})
            if "dense_ms" in twin:
                r["dense_ms"] = twin["dense_ms"]
    rec["predicted_sparsity"] = predicted
    return rec


def table(recs: list[dict]) -> str:
    lines = []
    for rec in recs:
        sd = rec.get("sdpa")
        lines.append(f"{rec['shape']} {rec['dtype']}  λ={rec['lambda']:.3g}  "
                     f"SDPA {sd[0]} {sd[1]:.3f} ms" if sd else f"{rec['shape']} {rec['dtype']}  λ={rec['lambda']:.3g}")
        base = rec["rows"][0] if rec["rows"] else {}
        lines.append(f"  {'config':<22} {'dense ms':>9} {'sparse ms':>9} {'x def dn':>8} {'x def sp':>8} "
                     f"{'x SDPA dn':>9} {'x SDPA sp':>9}  check")
        for r in rec["rows"]:
            if "error" in r:
                lines.append(f"  {r['config']:<22} {r['error']}")
                continue

            def ratio(a, b):
                return f"{a / b:8.2f}" if a and b else "       -"

            dn, sp = r.get("dense_ms"), r.get("sparse_ms")
            sdpa_ms = sd[1] if sd else None
            check = "default" if r.get("default") else (
                f"maxdiff {max(r.get('dense_maxdiff', 0), r.get('sparse_maxdiff', 0)):.1e} counts "
                f"{'equal' if r.get('sparse_counts_equal', True) else 'DIFFER'}")
            lines.append(f"  {r['config']:<22} {dn or math.nan:9.3f} {sp or math.nan:9.3f} "
                         f"{ratio(base.get('dense_ms'), dn)} {ratio(base.get('sparse_ms'), sp)} "
                         f"{ratio(sdpa_ms, dn)} {ratio(sdpa_ms, sp)}  {check}")
        lines.append("")
    lines.append("x def: default config's time / this config's (>1 = faster); x SDPA: fastest dense SDPA / ours.")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--quick", action="store_true", help="small shapes (CPU rehearsal under TRITON_INTERPRET=1)")
    p.add_argument("--shapes", default=None,
                   help="comma list of phase:batch:kv_len, default prefill:1:16384,decode:1:131072,decode:64:16384")
    p.add_argument("--heads", default="32/8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--sparsity", type=float, default=0.7)
    p.add_argument("--time-budget", type=float, default=240.0)
    p.add_argument("--configs", default=None,
                   help="';'-separated LaunchConfig overrides (first: the baseline), instead of the built-in sweep")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.warmup, args.min_iters, args.max_iters = 3, 5, 50
    args.target_seconds = 0.25 if args.device == "cuda" else 0.05
    if args.quick:
        args.warmup, args.min_iters, args.max_iters = 1, 1, 2
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    default = "prefill:1:256,decode:2:4096" if args.quick else "prefill:1:16384,decode:1:131072,decode:64:16384"
    hq, hkv = (int(x) for x in args.heads.split("/"))
    shapes = []
    for item in (args.shapes or default).split(","):
        phase, b, n = item.split(":")
        shapes.append(Shape(phase, int(b), int(n), hq, hkv, args.head_dim, args.page))
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.time_budget

    def log(msg: str) -> None:
        print(msg, flush=True)

    recs = []
    meta = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu", "torch": torch.__version__}
    weights = [2.0 if s.phase == "prefill" else 1.0 for s in shapes]  # prefill: more configurations, slower calls
    for i, shape in enumerate(shapes):
        now = time.monotonic()
        if now > deadline:
            log(f"{shape.label}: skipped (time budget)")
            continue
        share = min(deadline, now + 1.3 * (deadline - now) * weights[i] / sum(weights[i:]))  # later shapes keep theirs
        log(f"{shape.label} {args.dtype}")
        recs.append(sweep_shape(shape, DTYPES[args.dtype], args, share, log))
        if out:
            (out / "tune.json").write_text(json.dumps({"meta": meta, "shapes": recs}, indent=1), encoding="utf-8")
            (out / "tune.txt").write_text(table(recs) + "\n", encoding="utf-8")
    log(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
