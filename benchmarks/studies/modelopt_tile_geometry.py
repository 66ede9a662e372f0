"""Same scores, same (a, b): realized sparsity of our kernel vs NVIDIA ModelOpt 0.47's own skip-softmax paths.

Our tile geometry (docs/skip_softmax.md v2: per row, 64-key tiles, splits of 2048 keys anchored on tile 0) differs
from ModelOpt's (blocks of 128 query rows x 128 keys in its PyTorch calibration path and in its Triton kernel's
measuring mode, a running max over all earlier blocks, a block skipped only when every row agrees). So one (a, b)
realizes a different sparsity under each. This script measures how much, on the CPU:

1. Real attention scores: SmolLM2-135M (fp32) on held-out natural text (`calibration.natural_text`), the query and
   key of every layer after RoPE, captured through transformers' attention interface.
2. Per scale factor sf (λ = sf / n, n = the row's length, ModelOpt's law, γ = 1) the realized sparsity of
   - ModelOpt's PyTorch path (`FlashSkipSoftmax.calc_correction_factor_and_p`, br = bc = 128, its calibrator's unit),
   - ModelOpt's Triton kernel under TRITON_INTERPRET=1 (`triton_fa.attention(..., measure_sparsity=True)`, its
     counting mode: BLOCK_M = BLOCK_N = 128), prefill only (slow in the interpreter; `--triton-layers`),
   - ours (`paged_skip_softmax_attention`, counts per (row, head, 64-key tile), calibration mode).
3. For each target its PyTorch path reaches, the scale factor a·exp(b·target) at which it does (what ModelOpt's
   calibration would fit on these scores), and the sparsity ours realizes at that same scale factor.

    TRITON_INTERPRET=1 python benchmarks/studies/modelopt_tile_geometry.py --model .cache/models/SmolLM2-135M-Instruct \
        --lengths 1024 2048 --out artifacts/modelopt_geometry
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (no GPU here)

import numpy as np  # noqa: E402
import torch  # noqa: E402

# λ·n trials, all below the shortest length measured (1024), so λ < 1 everywhere: ModelOpt's PyTorch path counts
# λ >= 1 as "skip everything" while its vLLM plugin and we serve it dense, and that is not a geometry difference.
SCALE_FACTORS = tuple(float(s) for s in np.logspace(-1, math.log10(900.0), 21))
TARGETS = (0.1, 0.2, 0.3, 0.5, 0.7)
DECODE_ROWS = 32


def capture_qk(model_dir: Path, length: int, seed: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], float]:
    """(q [H, L, D], k [Hkv, L, D]) per layer after RoPE, and the softmax scale, from one held-out prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text, _ = natural_text.heldout_prompt(tokenizer, "prose", length, seed=seed)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    scale_seen: list[float] = []
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def record(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured.append((query[0].detach().clone(), key[0].detach().clone()))
        scale_seen.append(float(scaling if scaling is not None else query.shape[-1] ** -0.5))
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register("record_qk", record)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="record_qk")
    with torch.no_grad():
        model(ids)
    return captured, scale_seen[0]


def scores_of(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal scaled scores [H, L, L] (float32, ModelOpt's eager path adds the mask as the dtype's min)."""
    group = q.shape[0] // k.shape[0]
    kk = k.repeat_interleave(group, dim=0)
    s = torch.einsum("hqd,hkd->hqk", q.double(), kk.double()) * scale
    n = q.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).triu(1)
    return s.float().masked_fill(mask, torch.finfo(torch.float32).min)


def modelopt_torch(scores: torch.Tensor, lambdas: list[float], phase: str) -> tuple[np.ndarray, float]:
    """ModelOpt's PyTorch-path sparsity per λ (its unit: 128x128 blocks) and the number of blocks it counts."""
    from modelopt.torch.sparsity.attention_sparsity.methods.flash_skip_softmax import FlashSkipSoftmax

    method = FlashSkipSoftmax({"thresholds": {phase: list(lambdas)}, "br": 128, "bc": 128, "backend": "pytorch",
                               "is_causal": True, "collect_stats": True})  # fmt: skip
    method.set_calibration_mode(True)
    method.thresholds = list(lambdas)
    _, stats = method.calc_correction_factor_and_p(scores[None], phase)
    return np.asarray(stats["sparsity"], dtype=np.float64), float(stats["total_blocks"] * scores.shape[0])


def modelopt_triton(q: torch.Tensor, k: torch.Tensor, scale: float, lam: float) -> float:
    """ModelOpt's Triton kernel (interpreted) in its counting mode: skipped / total tiles."""
    from modelopt.torch.kernels.common.attention.triton_fa import attention

    n = q.shape[1]
    qq, kk = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous()
    loc = torch.zeros(1, dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    real_device = torch.cuda.device
    # Its wrapper enters torch.cuda.device(q.device), which refuses a CPU tensor; the interpreter needs no device.
    torch.cuda.device = lambda device: contextlib.nullcontext() if torch.device(device).type == "cpu" else real_device(
        device
    )
    try:
        out = attention(qq, kk, kk.clone(), loc, lens, n, is_causal=True, softmax_scale=scale,
                        skip_softmax_threshold=lam, measure_sparsity=True)  # fmt: skip
    finally:
        torch.cuda.device = real_device
    return out._sparsity_skipped / max(out._sparsity_total, 1)


def ours(q: torch.Tensor, k: torch.Tensor, scale: float, scale_factors, decode_rows: int) -> tuple[np.ndarray, ...]:
    """Our counted (row) sparsity per scale factor: prefill (all rows) and decode (the last rows, one per step)."""
    from modelopt_ext.torch.kernels.sparsity.attention import paged_skip_softmax_attention

    hkv, n, d = k.shape
    cache = k.transpose(0, 1).contiguous()[None]  # one page of n tokens: [1, n, Hkv, D]
    log_sf = torch.tensor([math.log(s) for s in scale_factors], dtype=torch.float32)

    def counts(qrows, cu, seq_lens):
        b = seq_lens.shape[0]
        table = torch.zeros(b, 1, dtype=torch.int32)
        _, c = paged_skip_softmax_attention(
            qrows, cache, cache, table, cu, seq_lens, softmax_scale=scale,
            log_scale_factors=log_sf[None, :, None].expand(b, -1, 2).contiguous(), backend="torch",
        )  # fmt: skip
        c = c.sum(0).double()
        return (c[:, 1] / c[:, 0]).numpy()

    pre = counts(q.transpose(0, 1).contiguous(), torch.tensor([0, n], dtype=torch.int32),
                 torch.tensor([n], dtype=torch.int32))  # fmt: skip
    pos = torch.arange(n - decode_rows, n)
    dec = counts(q.transpose(0, 1)[pos].contiguous(), torch.arange(decode_rows + 1, dtype=torch.int32),
                 (pos + 1).to(torch.int32))  # fmt: skip
    return pre, dec


def interp_sparsity(sf_grid: np.ndarray, sparsity: np.ndarray, sf: float) -> float:
    return float(np.interp(math.log(sf), np.log(sf_grid), sparsity))


def summarize(rows: list[dict], sf_grid: np.ndarray) -> tuple[dict, list[dict]]:
    """Per length and phase: for each target ModelOpt's PyTorch path reaches inside the grid, the scale factor
    a·exp(b·target) at which it does (what its calibration would fit) and the sparsity ours realizes there."""
    summary: dict = {}
    for length in sorted({r["length"] for r in rows}):
        for phase in ("prefill", "decode"):
            sel = [r for r in rows if r["length"] == length]
            mo = np.mean([r[f"modelopt_torch_{phase}"] for r in sel], axis=0)
            us = np.mean([r[f"ours_{phase}"] for r in sel], axis=0)
            mono = np.maximum.accumulate(mo)  # sparsity grows with sf; guard the inverse against ties
            cells = {}
            for t in TARGETS:
                if not mono[0] <= t <= mono[-1]:
                    continue
                sf = math.exp(float(np.interp(t, mono + np.arange(len(mono)) * 1e-12, np.log(sf_grid))))
                cells[str(t)] = dict(scale_factor=sf, modelopt_torch=interp_sparsity(sf_grid, mo, sf),
                                     ours=interp_sparsity(sf_grid, us, sf))  # fmt: skip
            summary[f"{phase} L={length}"] = dict(
                targets=cells, modelopt_range=[float(mo.min()), float(mo.max())],
                ours_range=[float(us.min()), float(us.max())], mean_abs_gap=float(np.mean(np.abs(mo - us))),
            )  # fmt: skip
    triton_cmp = [
        dict(length=r["length"], layer=r["layer"], scale_factor=float(sf), modelopt_triton=v,
             modelopt_torch=interp_sparsity(sf_grid, np.asarray(r["modelopt_torch_prefill"]), float(sf)),
             ours=interp_sparsity(sf_grid, np.asarray(r["ours_prefill"]), float(sf)))
        for r in rows if "modelopt_triton_prefill" in r for sf, v in r["modelopt_triton_prefill"].items()
    ]  # fmt: skip
    return summary, triton_cmp


def report(summary: dict) -> None:
    print("\nSame (a, b) (the scale factor at which ModelOpt's PyTorch path realizes the target), same scores:")
    print("| phase, length | target | a·exp(b·t) | ModelOpt torch (128x128 blocks) | ours (row x 64-key tiles) |")
    print("|---|---|---|---|---|")
    for key, s in summary.items():
        for t, v in s["targets"].items():
            print(f"| {key} | {t} | {v['scale_factor']:.4g} | {v['modelopt_torch']:.3f} | {v['ours']:.3f} |")
        print(f"| {key} | (λ < 1 grid: ModelOpt {s['modelopt_range'][0]:.2f}..{s['modelopt_range'][1]:.2f}, "
              f"ours {s['ours_range'][0]:.2f}..{s['ours_range'][1]:.2f}) | | | |")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path(".cache/models/SmolLM2-135M-Instruct"))
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 8, 15, 22, 29])
    p.add_argument("--triton-layers", type=int, nargs="*", default=[15], help="layers also run through ModelOpt's "
                   "Triton kernel (interpreted: slow); at the first length only")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("artifacts/modelopt_geometry"))
    p.add_argument("--summarize", type=Path, help="only print the tables of an earlier modelopt_geometry.json")
    args = p.parse_args()
    if args.summarize is not None:
        saved = json.loads(args.summarize.read_text())
        summary, triton_cmp = summarize(saved["rows"], np.asarray(saved["scale_factors"]))
        report(summary)
        print(json.dumps(triton_cmp, indent=1))
        return 0
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    sf_grid = np.asarray(SCALE_FACTORS)
    rows = []
    for length in args.lengths:
        captured, scale = capture_qk(args.model, length, args.seed)
        for layer in args.layers:
            q, k = captured[layer]
            n = q.shape[1]
            t0 = time.time()
            s = scores_of(q, k, scale)
            mo_pre, _ = modelopt_torch(s, [sf / n for sf in SCALE_FACTORS], "prefill")
            mo_dec = np.zeros(len(SCALE_FACTORS))
            blocks = 0.0
            for r in range(n - DECODE_ROWS, n):  # the same decode rows as ours, each at its own length
                sp, nb = modelopt_torch(s[:, r : r + 1, : r + 1], [sf / (r + 1) for sf in SCALE_FACTORS], "decode")
                mo_dec += sp * nb
                blocks += nb
            mo_dec /= blocks
            our_pre, our_dec = ours(q, k, scale, SCALE_FACTORS, DECODE_ROWS)
            row = dict(length=n, layer=layer, modelopt_torch_prefill=mo_pre.tolist(),
                       modelopt_torch_decode=mo_dec.tolist(), ours_prefill=our_pre.tolist(),
                       ours_decode=our_dec.tolist())  # fmt: skip
            if layer in args.triton_layers and length == args.lengths[0]:
                row["modelopt_triton_prefill"] = {
                    str(sf): modelopt_triton(q, k, scale, sf / n) for sf in (SCALE_FACTORS[6], SCALE_FACTORS[10],
                                                                             SCALE_FACTORS[14])
                }  # fmt: skip
            row["seconds"] = time.time() - t0
            rows.append(row)
            print(f"L={n} layer {layer}: {row['seconds']:.1f} s", flush=True)

    summary, triton_cmp = summarize(rows, sf_grid)
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(model=str(args.model), lengths=args.lengths, layers=args.layers, scale_factors=SCALE_FACTORS,
                  rows=rows, summary=summary, triton=triton_cmp)  # fmt: skip
    (args.out / "modelopt_geometry.json").write_text(json.dumps(result, indent=1))

    report(summary)
    if triton_cmp:
        print("\n| L | layer | sf | ModelOpt Triton (interp.) | ModelOpt torch | ours |\n|---|---|---|---|---|---|")
        for c in triton_cmp:
            print(f"| {c['length']} | {c['layer']} | {c['scale_factor']:.4g} | {c['modelopt_triton']:.3f} | "
                  f"{c['modelopt_torch']:.3f} | {c['ours']:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
