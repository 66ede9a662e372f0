#!/usr/bin/env python
"""Accuracy of calibrated skip-softmax attention on a real small model (SmolLM2-135M) on the CPU.

Never a timed test. Examples:

    python benchmarks/accuracy.py --quick
    python benchmarks/accuracy.py .cache/models/SmolLM2-135M-Instruct --out artifacts/accuracy.json

What it does:

1. Loads the HF checkpoint (fp32), sparsifies every self-attention module and calibrates prefill and decode once
   on the shared RULER-style prompts (`calibration.data`, seed 0): chunked prefill + greedy decode steps.
2. Builds held-out text the calibration never saw: the same builder with another seed (other needles, numbers,
   words and lengths), so no download is needed.
3. Dense baseline (all modules disabled: transformers' sdpa path), then for each target sparsity (the fit does
   not depend on the target, so no recalibration): perplexity of the held-out text (one prefill forward per
   text), greedy-token agreement with dense (teacher-forced next-token argmax over the text, and a greedy
   continuation generated from each text's first part: chunked prefill then decode, compared position-wise),
   and realized sparsity per phase on that held-out data against the target.
4. Prints a markdown table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"

logger = logging.getLogger("accuracy")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL), help="HF checkpoint dir (default: `make model`)")
    p.add_argument("--quick", action="store_true", help="few, short prompts (minutes on 2 CPU cores)")
    p.add_argument("--targets", default="0.3,0.5,0.7", help="comma list of target sparsities (both phases)")
    p.add_argument("--calib-samples", type=int, default=None)
    p.add_argument("--calib-max-seqlen", type=int, default=None)
    p.add_argument("--heldout-samples", type=int, default=None)
    p.add_argument("--heldout-max-seqlen", type=int, default=None)
    p.add_argument("--decode-tokens", type=int, default=None, help="greedy tokens compared per held-out text")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--out", default=None, help="JSON path (default: artifacts/accuracy[_quick].json)")
    p.add_argument("--cache-dir", default=None, help="calibration prompt cache (default: the builder's)")
    return p.parse_args(argv)


def _settings(args) -> dict:
    quick = dict(calib_samples=6, calib_max_seqlen=1024, heldout_samples=2, heldout_max_seqlen=1024, decode_tokens=16)
    full = dict(calib_samples=24, calib_max_seqlen=4096, heldout_samples=6, heldout_max_seqlen=4096, decode_tokens=32)
    s = quick if args.quick else full
    for key in s:
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    return s


@torch.no_grad()
def perplexity_and_argmax(model, ids: torch.Tensor) -> tuple[float, torch.Tensor, int]:
    """Summed NLL, next-token argmax [L-1] and token count of one teacher-forced prefill forward."""
    logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
    return nll, logits.argmax(-1), ids.shape[1] - 1


@torch.no_grad()
def greedy(model, ids: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.calibrate import run_sample

    return run_sample(model, ids, chunk_size=chunk, decode_tokens=n)[0]


def evaluate(model, texts, decode_tokens: int, chunk: int) -> dict:
    nll = n_tok = 0.0
    argmaxes, continuations = [], []
    for ids in texts:
        s, am, n = perplexity_and_argmax(model, ids)
        nll, n_tok = nll + s, n_tok + n
        argmaxes.append(am)
        prompt = ids[:, : max(2, ids.shape[1] * 3 // 4)]
        continuations.append(greedy(model, prompt, decode_tokens, chunk))
    return {"ppl": math.exp(nll / n_tok), "argmax": argmaxes, "greedy": continuations, "tokens": int(n_tok)}


def agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    same = sum(int((x == y).sum()) for x, y in zip(a, b, strict=True))
    total = sum(x.numel() for x in a)
    return same / total if total else math.nan


def prefix_agreement(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Mean fraction of the greedy continuation generated before the first divergence from dense."""
    fracs = []
    for x, y in zip(a, b, strict=True):
        diff = (x != y).nonzero()
        fracs.append((int(diff[0]) if diff.numel() else x.numel()) / max(1, x.numel()))
    return sum(fracs) / len(fracs)


CHUNK = 1024
"""Prefill chunk of calibration and of the greedy continuations."""


def _calibrated_model(ckpt: Path, s: dict, cache_dir):
    """(model, tokenizer, start time, calibration seconds, exported block): the fp32 checkpoint with every
    self-attention module sparsified and calibrated once for both phases on the shared prompts (seed 0). The clock
    starts after the imports, as the benchmark's total time does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modelopt_ext.torch.sparsity.attention_sparsity as mtsa

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="sdpa").eval()
    calib = {
        "target_sparse_ratio": {"prefill": 0.5, "decode": 0.5},
        "samples": s["calib_samples"],
        "max_seqlen": s["calib_max_seqlen"],
        "min_seqlen": min(256, s["calib_max_seqlen"]),
        "num_decode_tokens": 8,
        "chunk_size": CHUNK,
        "seed": 0,
        "cache_dir": cache_dir,
    }
    config = {"sparse_cfg": {"calibration": calib, "*self_attn*": {"method": "skip_softmax", "backend": "auto"}}}
    model = mtsa.sparsify(model, config, tokenizer=tokenizer)
    calib_s = time.time() - t0
    block = mtsa.export_sparse_attention_config(model)
    logger.info("calibrated in %.0f s: %s", calib_s, json.dumps(block["config_groups"]["group_0"]))
    return model, tokenizer, t0, calib_s, block


def _heldout(tokenizer, s: dict, cache_dir):
    """(prompts, token ids) of the held-out text: the calibration builder with another seed (no download)."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import build_calibration_prompts

    heldout = build_calibration_prompts(
        tokenizer,
        num_samples=s["heldout_samples"],
        max_seqlen=s["heldout_max_seqlen"],
        min_seqlen=min(512, s["heldout_max_seqlen"]),
        seed=12345,
        cache_dir=cache_dir,
    )
    return heldout, [tokenizer(h.prompt, return_tensors="pt").input_ids for h in heldout]


def _sweep_targets(model, texts, s: dict, targets: list[float]) -> tuple[dict, list[dict]]:
    """(dense evaluation, one row per target plus the dense row first): the fit does not depend on the target, so
    each target only moves λ (no recalibration)."""
    import modelopt_ext.torch.sparsity.attention_sparsity as mtsa

    mtsa.disable_sparse_attention(model, "*")
    dense = evaluate(model, texts, s["decode_tokens"], CHUNK)
    logger.info("dense: ppl %.4f", dense["ppl"])
    mtsa.enable_sparse_attention(model, "*")

    rows = [{"target": 0.0, "ppl": dense["ppl"], "argmax_agree": 1.0, "greedy_agree": 1.0, "greedy_prefix": 1.0,
             "sparsity_prefill": 0.0, "sparsity_decode": 0.0}]  # fmt: skip
    for target in targets:
        mtsa.set_target_sparsity(model, target)
        mtsa.reset_sparse_attention_stats(model)
        res = evaluate(model, texts, s["decode_tokens"], CHUNK)
        real = mtsa.realized_sparsity(model)
        cal = next(iter(mtsa.sparse_attention_states(model, enabled_only=True).values())).calibration
        rows.append(
            {
                "target": target,
                "ppl": res["ppl"],
                "argmax_agree": agreement(res["argmax"], dense["argmax"]),
                "greedy_agree": agreement(res["greedy"], dense["greedy"]),
                "greedy_prefix": prefix_agreement(res["greedy"], dense["greedy"]),
                "sparsity_prefill": real["prefill"],
                "sparsity_decode": real["decode"],
                # λ = scale_factor / kv_len; λ >= 1 (scale factor >= kv_len) means dense for that sequence.
                "scale_factor_prefill": None if cal["prefill"] is None else cal["prefill"].scale_factor,
                "scale_factor_decode": None if cal["decode"] is None else cal["decode"].scale_factor,
            }
        )
        logger.info("target %.2f: %s", target, rows[-1])
    return dense, rows


def _markdown_table(rows: list[dict], dense_ppl: float) -> str:
    """The rows as the markdown table the benchmark prints (Δppl against the dense perplexity)."""
    header = (
        "| target | ppl | Δppl % | next-token agree | greedy agree | greedy prefix | sparsity prefill "
        "| sparsity decode | λ·kv_len prefill | λ·kv_len decode |"
    )
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        dppl = 100.0 * (r["ppl"] / dense_ppl - 1.0)
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        sci = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
        label = "dense" if r["target"] == 0 else f"{r['target']:.2f}"
        lines.append(
            f"| {label} | {r['ppl']:.4f} | {dppl:+.2f} | "
            f"{r['argmax_agree']:.4f} | {r['greedy_agree']:.3f} | {r['greedy_prefix']:.3f} | "
            f"{fmt(r['sparsity_prefill'])} | {fmt(r['sparsity_decode'])} | "
            f"{sci(r.get('scale_factor_prefill'))} | {sci(r.get('scale_factor_decode'))} |"
        )
    return "\n".join(lines)


def _report(args, meta: dict, rows: list[dict], table: str, heldout, block: dict, dense: dict) -> None:
    """Print the table with its notes, and write the JSON (meta, rows, table) to --out."""
    print(f"\nSmolLM2 skip-softmax accuracy ({'quick' if args.quick else 'full'}, held-out tokens "
          f"{dense['tokens']}, {meta['total_seconds']:.0f} s)\n")  # fmt: skip
    print(table)
    print(
        "\nλ = (λ·kv_len) / kv_len per sequence; where λ·kv_len >= kv_len the sequence runs dense (λ >= 1). "
        f"Held-out lengths: {[h.num_tokens for h in heldout]}; calibration observed sparsity range: "
        + ", ".join(f"{p} {v}" for p, v in block["config_groups"]["group_0"].get("observed_sparsity_range", {}).items())
    )
    out = Path(args.out) if args.out else REPO / "artifacts" / f"accuracy{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows, "table": table}, indent=1) + "\n")
    print(f"\nwrote {out}")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("transformers", "modelopt_ext.torch.sparsity.attention_sparsity.calibration.data"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = Path(args.model)
    if not (ckpt / "config.json").is_file():
        print(f"no HF checkpoint at {ckpt}: build it with `make model` or pass its path", file=sys.stderr)
        return 2
    s = _settings(args)
    targets = [float(t) for t in args.targets.split(",")]

    model, tokenizer, t0, calib_s, block = _calibrated_model(ckpt, s, args.cache_dir)
    heldout, texts = _heldout(tokenizer, s, args.cache_dir)
    dense, rows = _sweep_targets(model, texts, s, targets)
    table = _markdown_table(rows, dense["ppl"])
    meta = {
        "model": str(ckpt),
        "quick": args.quick,
        "settings": s,
        "heldout": [{"task": h.task, "tokens": h.num_tokens} for h in heldout],
        "heldout_tokens": dense["tokens"],
        "calibration_seconds": round(calib_s, 1),
        "total_seconds": round(time.time() - t0, 1),
        "threads": torch.get_num_threads(),
        "sparse_attention_config": block,
    }
    _report(args, meta, rows, table, heldout, block, dense)
    return 0


if __name__ == "__main__":
    sys.exit(main())
