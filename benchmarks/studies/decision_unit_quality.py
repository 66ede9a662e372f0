#!/usr/bin/env python
"""What should a skip decision be: per query row, or per block of rows a GPU program holds? Quality at equal work.

A GPU program saves a key tile's V load, exp and P·V only when every row it holds drops the tile (prefill: its block
of query rows; decode: the query heads sharing a KV head). Contract versions 2 and 3 decide per row, so part of what it
drops costs accuracy without saving GPU work. This benchmark measures, on a real model and held-out text, perplexity
against the work GPU programs can skip, for decision rules applied in every layer:

- `row`: contract versions 2 and 3 (skip_softmax.md): a row drops tile t when g[t] - m[t] < ln λ, with m the running
  max of the row's tiles in t's split, seeded with tile 0 (the anchor); tile 0 is never dropped.
- `blockB`: the same test, but a tile is dropped for an aligned block of B prompt rows (absolute positions
  p // B equal) only when every row of the block that visits the tile would drop it (AND), as a program of B rows
  can act on.
- `gqa`: the AND over the query heads that share a KV head, per row (what one decode program can act on).
- `RULE+winW` (a quality lever of issue #56, any rule above): a row never drops a tile that holds one of its own W
  most recent keys (the diagonal tile always, with W <= 64), before the rule's AND; e.g. `gqa+win256`.
- `RULE+winW+ref` (another lever): the row's reference max also takes the max of those window tiles (kept anyway,
  so a kernel can score them first), `coherence.stronger_reference`; e.g. `block64+win128+ref`.

For each rule and each λ of a sweep, one teacher-forced forward of the held-out text gives the perplexity, the
row-level sparsity (the contract's count) and the share of (program, tile) pairs GPU programs of 64 and 128 rows and
GQA groups can skip. Attention is computed densely in float32 with the dropped tiles masked out (a faithful model of
what the kernels compute, not a kernel): the point is quality, not speed.

    .venv-cpu/bin/python benchmarks/studies/decision_unit_quality.py --out artifacts/decision_quality # ~30 min, 2 cores
    .venv-cpu/bin/python benchmarks/studies/decision_unit_quality.py --quick --out /tmp/dq             # ~3 min
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import time
from pathlib import Path

import _benchmarks_path  # noqa: F401  (benchmarks/ on sys.path: the shared modules below)
import torch
from coherence import block_stat, drops, group_stat, protect_window, score_gaps, stronger_reference, visited_mask

from modelopt_ext.torch.kernels.sparsity.attention.semantics import TILE_K

logger = logging.getLogger("decision_unit_quality")

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / ".cache" / "models" / "SmolLM2-135M-Instruct"
RULES = ("row", "block64", "block128", "gqa")
WINDOW = "+win"
REFERENCE = "+ref"
PROGRAM_ROWS = (64, 128)


# ------------------------------------------------------------------------------------------------- the decisions
# A rule is a transformation of the per-row gaps g[t] - m[t] (coherence.py, the contract's statistic): a row-tile is
# dropped at λ iff its effective gap < ln λ. The block rule gives every row of an aligned block the block's largest
# gap over its visiting rows (all drop, or none does), the group rule the largest over the GQA group's heads.


def split_rule(rule: str) -> tuple[str, int]:
    """("gqa", 256) for "gqa+win256"; (rule, 0) without a window; blockB for any B >= 1; a `+ref` ending (which
    needs a window) is `uses_window_reference`'s. ValueError otherwise."""
    if rule.endswith(REFERENCE) and WINDOW not in rule:
        raise ValueError(f"unknown rule {rule!r}: {REFERENCE} needs a window ({WINDOW}W{REFERENCE})")
    base, _, window = rule.removesuffix(REFERENCE).partition(WINDOW)
    block = base.startswith("block") and base[len("block"):].isdigit() and int(base[len("block"):]) >= 1
    if not (base in ("row", "gqa") or block) or (window and (not window.isdigit() or int(window) < 1)):
        raise ValueError(f"unknown rule {rule!r}: one of {', '.join(RULES)}, optionally with {WINDOW}W (W >= 1 keys)")
    return base, int(window or 0)


def uses_window_reference(rule: str) -> bool:
    return rule.endswith(REFERENCE)


def effective_gaps(rule: str, gaps: torch.Tensor, group: int) -> torch.Tensor:
    """Gaps [H, N, nt] of a prompt's rows 0..N-1 as the rule decides with them (same shape)."""
    rule, window = split_rule(rule)
    if window:
        gaps = protect_window(gaps, torch.arange(gaps.shape[1]), window)  # rows 0 .. N-1
    if rule == "row":
        return gaps
    if rule == "gqa":
        return group_stat(gaps, group).repeat_interleave(group, dim=0)
    rows = int(rule[len("block"):])
    stat, _ = block_stat(gaps, rows)
    visited = visited_mask(gaps.shape[1], gaps.shape[2])
    blocked = stat.repeat_interleave(rows, dim=1)[:, : gaps.shape[1]]
    return torch.where(visited, blocked, gaps)  # unvisited stays -inf, tile 0 +inf


def skipped_shares(gaps: torch.Tensor, ln_lambda: float, group: int) -> dict[str, tuple[int, int]]:
    """(skipped, visited) of rows ("row"), of prefill programs of R rows ("progR") and of decode programs holding a
    GQA group ("gqa"), for effective gaps at ln λ."""
    heads, rows, tiles = gaps.shape
    visited = int(visited_mask(rows, tiles).sum())
    out = {"row": (int(drops(gaps, ln_lambda).sum()), visited * heads),
           "gqa": (int(drops(group_stat(gaps, group), ln_lambda).sum()), visited * (heads // group))}
    for r in PROGRAM_ROWS:
        stat, needed = block_stat(gaps, r)
        out[f"prog{r}"] = (int(((stat < ln_lambda) & needed).sum()), int(needed.sum()) * heads)
    return out


# ----------------------------------------------------------------------------------------- the model's attention


class Recorder:
    """Rule and λ of the current forward, and what its decisions counted (summed over layers)."""

    def __init__(self, group: int):
        self.group = group
        self.rule = "dense"
        self.ln_lambda = -math.inf
        self.reset()

    def reset(self) -> None:
        self.counts = {"row": [0, 0], "gqa": [0, 0], **{f"prog{r}": [0, 0] for r in PROGRAM_ROWS}}

    def add(self, name: str, skipped: int, visited: int) -> None:
        self.counts[name][0] += skipped
        self.counts[name][1] += visited

    def shares(self) -> dict[str, float]:
        return {k: (s / v if v else 0.0) for k, (s, v) in self.counts.items()}


def decided_attention(recorder: Recorder, q, k, v, scale: float) -> torch.Tensor:
    """Causal attention of one sequence (q [Hq, Q, D], k/v [Hkv, K, D]) with the rule's dropped tiles masked out."""
    heads, rows, _ = q.shape
    keys = k.shape[1]
    k = k.repeat_interleave(heads // k.shape[0], dim=0)
    v = v.repeat_interleave(heads // v.shape[0], dim=0)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the contract's score precision
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(1, 2)) * scale
    if rows != keys:
        raise ValueError("decision_unit_quality runs whole prompts (teacher-forced): no cached prefix, no decode step")
    positions = torch.arange(rows)
    causal = torch.arange(keys)[None, :] > positions[:, None]
    scores.masked_fill_(causal[None], -math.inf)
    if recorder.rule != "dense":
        padded = torch.nn.functional.pad(scores, (0, -keys % TILE_K), value=-math.inf)
        gaps = score_gaps(padded, positions)
        if uses_window_reference(recorder.rule):
            gaps = stronger_reference(gaps, padded, positions, "window", split_rule(recorder.rule)[1])
        gaps = effective_gaps(recorder.rule, gaps, recorder.group)
        for name, (skipped, visited) in skipped_shares(gaps, recorder.ln_lambda, recorder.group).items():
            recorder.add(name, skipped, visited)
        key_drop = drops(gaps, recorder.ln_lambda).repeat_interleave(TILE_K, dim=-1)[..., :keys]
        scores.masked_fill_(key_drop, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.to(dtype)).to(q.dtype)


def register(recorder: Recorder) -> str:
    """A transformers attention function (AttentionInterface) running `decided_attention`; returns its name."""
    from transformers import AttentionInterface

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = torch.stack([decided_attention(recorder, query[b], key[b], value[b], scale)
                           for b in range(query.shape[0])])
        return out.transpose(1, 2).contiguous(), None

    name = "modelopt_ext_decision_quality"
    AttentionInterface.register(name, forward)
    return name


# ------------------------------------------------------------------------------------------------------- the run


def perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        logits = model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="mean")
    return float(torch.exp(nll))


def texts(tokenizer, lengths: dict[str, int]) -> dict[str, torch.Tensor]:
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.natural_text import heldout_prompt

    out = {}
    for spec, n in lengths.items():
        source = spec.split(":")[0]
        text, _ = heldout_prompt(tokenizer, source, n)
        out[f"{source} {n // 1024}k"] = tokenizer(text, return_tensors="pt").input_ids[:, :n]
    return out


def machine() -> dict:
    info = {"platform": platform.platform(), "threads": torch.get_num_threads()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def run(args) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(args.model)
    group = config.num_attention_heads // config.num_key_value_heads
    recorder = Recorder(group)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.set_attn_implementation(register(recorder))
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    docs = texts(tokenizer, {f"{s}:{i}": n for i, (s, n) in enumerate(args.texts)})
    results = {"machine": machine(), "model": str(args.model), "rules": list(args.rules),
               "ln_lambdas": args.ln_lambdas, "docs": {}}  # fmt: skip
    for name, ids in docs.items():
        start = time.perf_counter()
        recorder.rule = "dense"
        dense = perplexity(model, ids)
        rows = []
        for rule in args.rules:
            for ln_lambda in args.ln_lambdas:
                recorder.rule, recorder.ln_lambda = rule, ln_lambda
                recorder.reset()
                ppl = perplexity(model, ids)
                rows.append({"rule": rule, "ln_lambda": ln_lambda, "ppl": ppl, "ppl_vs_dense": ppl / dense - 1,
                             **recorder.shares()})  # fmt: skip
                logger.info("%s %s ln λ=%.1f: ppl %+.2f %%, row %.3f, prog64 %.3f, prog128 %.3f, gqa %.3f", name,
                            rule, ln_lambda, 100 * (ppl / dense - 1), *(rows[-1][k] for k in
                                                                        ("row", "prog64", "prog128", "gqa")))
        results["docs"][name] = {"tokens": ids.shape[1], "dense_ppl": dense, "rows": rows,
                                 "seconds": time.perf_counter() - start}  # fmt: skip
        write_json(args.out / "results.json", results)
    return results


def interpolate(rows: list[dict], rule: str, share_key: str, share: float) -> float | None:
    """Perplexity change of `rule` at a skippable share, interpolated linearly between the sweep's points."""
    pts = sorted((r[share_key], r["ppl_vs_dense"]) for r in rows if r["rule"] == rule)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= share <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (share - x0) / (x1 - x0)
    return None


def merged(paths: list[Path]) -> dict:
    """Several runs' results.json as one (rows of the same text joined): sweeps extended by later runs."""
    out: dict = {"docs": {}}
    for path in paths:
        data = json.loads(path.read_text())
        for name, doc in data["docs"].items():
            out["docs"].setdefault(name, {**doc, "rows": []})["rows"].extend(doc["rows"])
    return out


def table(results: dict, shares=(0.3, 0.4, 0.5, 0.6, 0.7)) -> str:
    """Perplexity change per rule at equal GPU work: prefill programs of 128 rows, and decode GQA groups."""
    lines = []
    present = list(dict.fromkeys(r["rule"] for doc in results["docs"].values() for r in doc["rows"]))

    def having(*bases):
        return [r for r in present if split_rule(r)[0] in bases]

    for key, what, rules in (("prog128", "prefill programs of 128 rows", having("row", "block64", "block128")),
                             ("prog64", "prefill programs of 64 rows", having("row", "block64")),
                             ("gqa", "decode GQA groups", having("row", "gqa")),
                             ("row", "row-tiles (the contract's count; what the CPU kernel saves in prefill)",
                              present)):
        lines += [f"\nPerplexity vs dense at equal skipped work of {what}:", "",
                  "| text | rule | " + " | ".join(f"skip {s:.1f}" for s in shares) + " |",
                  "|---|---|" + "---|" * len(shares)]
        for name, doc in results["docs"].items():
            for rule in rules:
                cells = [interpolate(doc["rows"], rule, key, s) for s in shares]
                lines.append(f"| {name} | {rule} | " + " | ".join("-" if c is None else f"{100 * c:+.2f} %"
                                                                  for c in cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--texts", default="prose:4096,code:2048",
                   help="held-out texts as source:tokens, comma-separated (sources: prose, code)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--ln-lambdas", default="-14,-11,-9,-7,-5.5,-4,-3")
    p.add_argument("--quick", action="store_true", help="one 1k prose text, three λ")
    p.add_argument("--out", type=Path, default=Path("artifacts/decision_quality"))
    p.add_argument("--table-from", type=Path, nargs="+", metavar="RESULTS_JSON",
                   help="print the table of earlier runs (merged) instead of running the model")
    args = p.parse_args(argv)
    if args.table_from:
        print(table(merged(args.table_from)))
        return 0
    if args.quick:
        args.texts, args.ln_lambdas = "prose:1024", "-9,-6,-4"
    args.texts = [(s.split(":")[0], int(s.split(":")[1])) for s in args.texts.split(",")]
    args.rules = [r for r in args.rules.split(",") if r]
    for rule in args.rules:
        try:
            split_rule(rule)
        except ValueError as e:
            p.error(f"--rules: {e}")
    args.ln_lambdas = [float(x) for x in args.ln_lambdas.split(",")]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    results = run(args)
    text = table(results)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
