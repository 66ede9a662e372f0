#!/usr/bin/env python
"""Which lever makes decode at a high target cheap? Decode-row perplexity at equal skipped work (issue #56).

A faithful model of what serving does to decode rows under contract version 4 (docs/skip_softmax.md: GQA-group
decisions, the anchor, the 128-key recent window, λ from the checkpoint's decode law at each row's length), on
held-out documents cut the way `decode_feedback.py` cuts them: a prompt of `--length` tokens, then the document's
true continuation of `--tokens` tokens teacher-forced as decode rows. One HF forward of each prompt (dense, its
cache kept); every variant re-runs only the continuation against that cache, with the tiles its decode rows drop
masked out of a float32 dense attention (quality, not speed; the unit test checks it against the package
reference). Perplexity is over continuation tokens 2 .. `--tokens` (every token a decode row predicts), pooled over
documents, with a bootstrap interval over documents.

Each variant is a sweep of one offset added to every row's ln λ, so variants compare at equal skipped decode work
(the group count, what a decode program skips) by interpolation:

- the law as served (`--windows` adds the same law with a larger recent window: `win256`, ...);
- `--layer-sensitivity`: one layer sparse at a time (the others dense), each offset: per-layer skipped share and
  NLL change, on any split (`--split calibration` for text calibration may use);
- `--layer-offsets FILE`: per-layer offsets (JSON {layer: offset}) on top of every sweep point; `--allocate-from
  SENSITIVITY_JSON` writes the offsets that minimize the summed single-layer NLL change at the law's skipped work
  (a Lagrangian choice among the measured offsets per layer, "dense" included).

    .venv-cpu/bin/python benchmarks/studies/decode_levers.py --config CAL/sparse_attention_config.json --target 0.7 \\
        --source prose --length 2048 --seeds 0,1,2,3,4,5,6,7,8,9,10,11 --windows 256,512 --out artifacts/levers
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from pathlib import Path

import _benchmarks_path  # noqa: F401  (benchmarks/ on sys.path: the shared modules below)
import torch
from coherence import group_stat, protect_window, score_gaps, stronger_reference

from modelopt_ext.torch.kernels.sparsity.attention.semantics import RECENT_WINDOW, TILE_K
from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.atomic_io import write_json_atomic

logger = logging.getLogger("decode_levers")
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / ".cache" / "models" / "SmolLM2-135M-Instruct"
DENSE_LAYER = -1e9  # a layer offset that keeps the layer dense (its rows never compute a decision)


def decode_law(config: Path, target: float) -> tuple[float, float]:
    """(c, γ) of the checkpoint's decode phase served at `target`, as the plugin computes them."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import load_sparse_attention_config

    settings = load_sparse_attention_config(config)
    if settings is None or settings.decode is None:
        raise SystemExit(f"{config}: no calibrated decode phase (run calibrate_sparse_attn.py first)")
    law = settings.decode.at_target(target)
    return law.log_scale_factor, law.length_exponent


class Variant:
    """How decode rows decide in the current forward (law, offsets, window) and what they skipped, per layer."""

    def __init__(self, c: float, gamma: float):
        self.c, self.gamma = c, gamma
        self.dense = True
        self.offset = 0.0
        self.layer_offsets: dict[int, float] = {}
        self.window = RECENT_WINDOW
        self.reference = "window"  # contract version 5; "running" is version 4
        self.reset()

    def reset(self) -> None:
        self.per_layer: dict[int, list[int]] = {}  # layer -> [skipped, visited] group-tiles

    def counts(self) -> tuple[int, int]:
        return sum(s for s, _ in self.per_layer.values()), sum(v for _, v in self.per_layer.values())

    def log_lambdas(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """ln λ of decode rows at `positions` (n = position + 1), float32 like the kernels' comparison."""
        n = (positions + 1).double()
        return (self.c - self.gamma * torch.log(n) + self.offset + self.layer_offsets.get(layer, 0.0)).float()


def attention(variant: Variant, layer: int, q, k, v, scale: float) -> torch.Tensor:
    """Causal attention of the last R positions of one sequence (q [Hq, R, D]; k, v [Hkv, K, D]); when the call
    holds fewer rows than keys (the continuation after a cached prompt) its rows decide as decode rows."""
    hq, rows, _ = q.shape
    hkv, keys, _ = k.shape
    group = hq // hkv
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    positions = torch.arange(keys - rows, keys)
    scores = torch.matmul(q.to(dtype), k.repeat_interleave(group, 0).to(dtype).transpose(1, 2)) * scale
    scores.masked_fill_(torch.arange(keys)[None, :] > positions[:, None], -math.inf)
    if not variant.dense and rows < keys and variant.layer_offsets.get(layer, 0.0) > DENSE_LAYER / 2:
        padded = torch.nn.functional.pad(scores, (0, -keys % TILE_K), value=-math.inf)
        gaps = score_gaps(padded, positions)  # [Hq, R, nt]: the contract's per-row statistic
        if variant.reference != "running":
            gaps = stronger_reference(gaps, padded, positions, variant.reference, variant.window)
        gaps = protect_window(gaps, positions, variant.window)
        stat = group_stat(gaps, group)  # [Hkv, R, nt]: a decode program's statistic
        visited = stat > -math.inf
        drop = (stat < variant.log_lambdas(layer, positions)[None, :, None]) & visited
        acc = variant.per_layer.setdefault(layer, [0, 0])
        acc[0] += int(drop.sum())
        acc[1] += int(visited.sum())
        key_drop = drop.repeat_interleave(group, 0).repeat_interleave(TILE_K, -1)[..., :keys]
        scores.masked_fill_(key_drop, -math.inf)
    return torch.matmul(torch.softmax(scores, -1), v.repeat_interleave(group, 0).to(dtype)).to(q.dtype)


def register(variant: Variant) -> str:
    """A transformers attention function (AttentionInterface) running `attention`; returns its name."""
    from transformers import AttentionInterface

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = torch.stack([attention(variant, module.layer_idx, query[b], key[b], value[b], scale)
                           for b in range(query.shape[0])])
        return out.transpose(1, 2).contiguous(), None

    name = "modelopt_ext_decode_levers"
    AttentionInterface.register(name, forward)
    return name


def documents(tokenizer, source: str, length: int, seeds, tokens: int, split: str = "heldout"):
    """[(seed, prompt ids, continuation ids)], as decode_feedback.py cuts held-out documents (any split)."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text

    out = []
    for seed in seeds:
        if split == "heldout":
            text, _ = natural_text.heldout_prompt(tokenizer, source, length + tokens, seed=seed)
            ids = tokenizer(text).input_ids
        else:
            lines = natural_text.line_stream(source, split, seed)
            ids = tokenizer(natural_text.render_prefix(lines, len(lines))).input_ids[: length + tokens]
        out.append((seed, ids[: len(ids) - tokens], ids[len(ids) - tokens:]))
    return out


class Doc:
    """A prompt run once (its cache kept) and its continuation, re-run per variant."""

    def __init__(self, model, prompt, cont):
        from transformers import DynamicCache

        self.model = model
        self.cont = torch.tensor([cont])
        self.cache = DynamicCache()
        with torch.no_grad():
            model(torch.tensor([prompt]), past_key_values=self.cache, use_cache=True)

    def nll(self) -> list[float]:
        """NLL of each continuation token from the 2nd on (the ones decode rows predict)."""
        fed = self.cont[:, :-1]
        with torch.no_grad():
            logits = self.model(fed, past_key_values=self.cache, use_cache=True).logits[0].float()
        self.cache.crop(-fed.shape[1])
        return torch.nn.functional.cross_entropy(logits, self.cont[0, 1:], reduction="none").tolist()


def run_variant(variant: Variant, docs: list[Doc]) -> dict:
    variant.reset()
    per_doc = []
    for d in docs:
        before = variant.counts()
        nll = d.nll()
        after = variant.counts()
        skipped, visited = after[0] - before[0], after[1] - before[1]
        per_doc.append({"nll": sum(nll), "tokens": len(nll), "sparsity": skipped / visited if visited else 0.0})
    skipped, visited = variant.counts()
    return {"nll": sum(x["nll"] for x in per_doc), "tokens": sum(x["tokens"] for x in per_doc),
            "sparsity": skipped / visited if visited else 0.0, "docs": per_doc,
            "per_layer": {k: s / v for k, (s, v) in sorted(variant.per_layer.items())}}  # fmt: skip


def ppl_change(row: dict, dense: dict, docs: list[int] | None = None) -> float:
    """Pooled perplexity of `row` vs dense over the documents `docs` (all by default): exp(ΔNLL / tokens) − 1."""
    docs = range(len(dense["docs"])) if docs is None else docs
    delta = sum(row["docs"][i]["nll"] - dense["docs"][i]["nll"] for i in docs)
    return math.exp(delta / sum(dense["docs"][i]["tokens"] for i in docs)) - 1


def at_share(rows: list[dict], dense: dict, share: float, docs: list[int] | None = None) -> float | None:
    """Perplexity change at a skipped decode share, linear between the sweep's points (None outside them)."""
    pts = sorted((r["sparsity"], ppl_change(r, dense, docs)) for r in rows)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= share <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (share - x0) / (x1 - x0)
    return None


def bootstrap(rows: list[dict], dense: dict, share: float, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % interval of `at_share` over documents resampled with replacement (shares kept: they move little)."""
    rng = random.Random(seed)
    n = len(dense["docs"])
    values = sorted(v for v in (at_share(rows, dense, share, [rng.randrange(n) for _ in range(n)])
                                for _ in range(draws)) if v is not None)  # fmt: skip
    return values[int(0.025 * len(values))], values[int(0.975 * len(values)) - 1]


def allocate(sensitivity: dict, layers: int, base: float = 0.0) -> dict[int, float]:
    """Per-layer offsets minimizing the summed single-layer NLL change with a mean skipped share at least the
    law's at offset `base`; each layer picks one of its measured offsets or dense. Returned relative to `base` (a
    sweep around offset `base` then compares them with the law at equal work)."""
    options = {layer: [(DENSE_LAYER, 0.0, 0.0)] for layer in range(layers)}
    for r in sensitivity["rows"]:
        layer = r["layer"]
        options[layer].append((r["offset"], r["per_layer"][str(layer)], r["nll_delta"]))
    share_at_base = sum(s for opts in options.values() for off, s, _ in opts if off == base) / layers
    best = None
    for i in range(400):
        mu = i / 10
        pick = {layer: min(opts, key=lambda o: o[2] - mu * o[1]) for layer, opts in options.items()}
        share = sum(p[1] for p in pick.values()) / layers
        cost = sum(p[2] for p in pick.values())
        if share >= share_at_base and (best is None or cost < best[0]):
            best = (cost, pick)
    if best is None:
        raise SystemExit("no allocation reaches the law's skipped share: measure more offsets")
    return {layer: p[0] if p[0] == DENSE_LAYER else p[0] - base for layer, p in best[1].items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--config", type=Path, help="a calibrated sparse_attention_config.json (or checkpoint)")
    p.add_argument("--target", type=float, default=0.7, help="the decode target the law is served at")
    p.add_argument("--source", default="prose", choices=("prose", "code"))
    p.add_argument("--length", type=int, default=2048, help="prompt tokens before the continuation")
    p.add_argument("--split", default="heldout", choices=("heldout", "calibration"))
    p.add_argument("--seeds", default="0,1,2,3,4,5", help="document orders, one document each")
    p.add_argument("--tokens", type=int, default=128, help="continuation tokens (teacher-forced decode rows)")
    p.add_argument("--offsets", default="-0.5,0,0.5,1", help="offsets on ln λ of the sweep")
    p.add_argument("--windows", default="", help="extra recent windows (keys), e.g. 256,512")
    p.add_argument("--references", default="", help="extra reference maxima beside version 5's window max: running "
                   "(version 4: anchor and earlier tiles only), row (the row's true max, an oracle)")
    p.add_argument("--layer-sensitivity", action="store_true", help="one layer sparse at a time, at each offset")
    p.add_argument("--layer-offsets", type=Path, help="JSON {layer: offset} added to every sweep point")
    p.add_argument("--allocate-from", type=Path, metavar="SENSITIVITY_JSON",
                   help="write --out/layer_offsets.json from a --layer-sensitivity run and stop")
    p.add_argument("--allocate-base", type=float, default=0.0,
                   help="the sensitivity run's offset whose skipped share the allocation must reach")
    p.add_argument("--shares", default="0.6,0.65,0.7", help="skipped shares of the summary table")
    p.add_argument("--out", type=Path, default=Path("artifacts/decode_levers"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.allocate_from:
        sens = json.loads(args.allocate_from.read_text())
        offsets = allocate(sens, 1 + max(r["layer"] for r in sens["rows"]), args.allocate_base)
        write_json_atomic(args.out / "layer_offsets.json", offsets)
        logger.info("offsets: %s", offsets)
        return 0
    if args.config is None:
        p.error("--config is required (a calibrated sparse_attention_config.json)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    variant = Variant(*decode_law(args.config, args.target))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.set_attn_implementation(register(variant))
    model.eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    seeds = [int(s) for s in args.seeds.split(",")]
    docs = [Doc(model, pr, co) for _, pr, co in documents(tok, args.source, args.length, seeds, args.tokens,
                                                          args.split)]  # fmt: skip
    logger.info("%d prompts run in %.0f s", len(docs), time.perf_counter() - start)
    dense = run_variant(variant, docs)
    variant.dense = False
    offsets = [float(x) for x in args.offsets.split(",")]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "c": variant.c, "gamma": variant.gamma,
              "dense": dense, "rows": []}  # fmt: skip
    if args.layer_offsets:
        variant.layer_offsets = {int(k): float(v) for k, v in json.loads(args.layer_offsets.read_text()).items()}
    layers = model.config.num_hidden_layers
    if args.layer_sensitivity:  # (name, window, reference, layer offsets, the one sparse layer)
        sweeps = [(f"layer {layer}", RECENT_WINDOW, "window", {j: DENSE_LAYER for j in range(layers) if j != layer},
                   layer) for layer in range(layers)]  # fmt: skip
    else:
        windows = [int(w) for w in args.windows.split(",") if w]
        sweeps = [("law", RECENT_WINDOW, "window", variant.layer_offsets, None)]
        sweeps += [(f"win{w}", w, "window", variant.layer_offsets, None) for w in windows]
        sweeps += [(f"ref-{ref}", RECENT_WINDOW, ref, variant.layer_offsets, None)
                   for ref in args.references.split(",") if ref]  # fmt: skip
    for name, window, reference, layer_offsets, layer in sweeps:
        variant.window, variant.reference, variant.layer_offsets = window, reference, layer_offsets
        for off in offsets:
            variant.offset = off
            r = run_variant(variant, docs)
            r.update(variant=name, window=window, offset=off, ppl_vs_dense=ppl_change(r, dense),
                     nll_delta=r["nll"] - dense["nll"])  # fmt: skip
            if layer is not None:
                r["layer"] = layer
            result["rows"].append(r)
            logger.info("%s offset %+.2f: decode sparsity %.3f, ppl %+.2f %%", name, off, r["sparsity"],
                        100 * r["ppl_vs_dense"])
        write_json_atomic(args.out / "results.json", result)
    if not args.layer_sensitivity:
        print(summary(result, [float(s) for s in args.shares.split(",")]))
    return 0


def summary(result: dict, shares: list[float]) -> str:
    """Markdown: perplexity change of each variant at equal skipped decode work, with bootstrap intervals."""
    lines = ["| variant | " + " | ".join(f"skip {s:.2f}" for s in shares) + " |", "|---|" + "---|" * len(shares)]
    for name in dict.fromkeys(r["variant"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["variant"] == name]
        cells = []
        for s in shares:
            v = at_share(rows, result["dense"], s)
            if v is None:
                cells.append("-")
                continue
            lo, hi = bootstrap(rows, result["dense"], s)
            cells.append(f"{100 * v:+.2f} % ({100 * lo:+.1f}..{100 * hi:+.1f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
