#!/usr/bin/env python
"""Does a calibrated target hold? Realized sparsity per phase against the target, on held-out text, by length.

Never a timed test. Two paths, the same kernels, semantics and fit code:

    # vLLM's CPU engine (default; run with .venv-cpu): calibrate with the project's script as a user does, then
    # measure on held-out prose and code at 1k..8k tokens (about an hour on 2 cores)
    .venv-cpu/bin/python benchmarks/fidelity.py --lengths 1024,2048,4096,8192
    .venv-cpu/bin/python benchmarks/fidelity.py --config ckpt/config.json   # an already calibrated checkpoint
    # Hugging Face path (mtsa; any env with transformers): calibration and measurement in one process
    python benchmarks/fidelity.py --path hf --quick

Engine path (benchmarks/fidelity_engine.py): `examples/vllm_serve/calibrate_sparse_attn.py <model> <--calib-args>`
writes the config and its records; ModelOpt's 1/kv_len law is refitted from the same records (`--law both`). One
engine then counts, per held-out prompt sent alone and for all of them as one mixed batch, exactly what serving each
(law, target) drops (calibration mode with the served laws as trials), checks one law against the real serving
counters, and serves every (law, target) for the quality columns (perplexity delta, next-token and greedy agreement
with dense at `--quality-length`).

HF path: calibrates on `calibration.data` at several lengths with `mtsa`'s collector and the shared fit, then
measures the held-out prompts the same way (chunked prefill as vLLM chunks it, a few decode steps).

Held-out text: `calibration.natural_text`, split `heldout` (documents calibration never saw); `--seeds` gives several
documents orders per (source, length), their counts summed per cell; the engine path also scores each document alone
(summary `per_document`, `per_order`, `document_spread`: how far one document strays from its cell, i.e. how much of
a one-document cell's error is the text rather than the law). A cell where the law cannot reach the target (λ >= 1 at
that length: the row runs dense) is reported as "dense (unreachable)" and does not count towards the error summary.
Prints markdown tables, writes JSON and a PNG per law (realized vs length, one panel per phase).

`--decode-feedback` (engine path): the per-document view of per-request decode feedback instead
(benchmarks/decode_feedback.py, issue #28): each held-out document at each target, teacher-forced on its own
continuation through vLLM's decode, its decode sparsity and perplexity after the first `--feedback-skip` tokens
without and with `sparse_attn_decode_feedback`.
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
PHASES = ("prefill", "decode")

logger = logging.getLogger("fidelity")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL), help="HF checkpoint dir (default: `make model`)")
    p.add_argument("--path", choices=("engine", "hf"), default="engine",
                   help="measure on a vLLM engine (default) or through the Hugging Face model (mtsa)")
    p.add_argument("--config", default=None, help="engine: a calibrated sparse_attention_config.json or checkpoint "
                   "(default: calibrate first with examples/vllm_serve/calibrate_sparse_attn.py)")
    p.add_argument("--calib-args", default="--calib_max_seqlen 4096 --calib_samples 8",
                   help="engine: arguments of calibrate_sparse_attn.py (default: %(default)s)")
    p.add_argument("--seeds", default="0", help="held-out document orders per (source, length), e.g. 0,1,2")
    p.add_argument("--serve-check-target", type=float, default=0.5,
                   help="engine: at this target of the first law, all prompts are also served as one mixed batch")
    p.add_argument("--dtype", default="auto", help="engine: model dtype for vLLM (default auto, as users serve; "
                   "float32 makes vLLM's dense layers batch invariant for the mixed-batch check)")
    p.add_argument("--kv-cache-dtype", default="auto", help="engine: vLLM's KV-cache dtype (auto, fp8, fp8_e4m3, "
                   "fp8_e5m2); dense reference and sparse serving on the same cache")
    p.add_argument("--dense-counts", action="store_true",
                   help="engine: also count every law in calibration mode (dense activations, one pass) to show "
                        "how far serving's own drops move later layers' decisions")
    p.add_argument("--quick", action="store_true", help="short lengths and few samples")
    p.add_argument("--targets", default="0.3,0.5,0.7")
    p.add_argument("--lengths", default=None, help="held-out lengths (default 1024,2048,4096; quick: 512,1024)")
    p.add_argument("--calib-lengths", default=None, help="calibration lengths (default: the held-out lengths up "
                   "to 4096)")  # fmt: skip
    p.add_argument("--calib-samples-per-length", type=int, default=None, help="default 6 (one per task)")
    p.add_argument("--sources", default="prose,code")
    p.add_argument("--decode-tokens", type=int, default=None, help="decode steps per prompt (engine 32, hf 8)")
    p.add_argument("--chunk-size", type=int, default=1024, help="prefill chunk (vLLM-style chunked prefill)")
    p.add_argument("--law", choices=("length", "modelopt", "both"), default="both",
                   help="fit law(s) measured on the same calibration data and held-out passes")
    p.add_argument("--quality-length", type=int, default=None, help="0 skips the quality columns")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--decode-feedback", action="store_true",
                   help="engine: the per-document view of decode feedback instead (benchmarks/decode_feedback.py): "
                        "each document teacher-forced at each target, decode sparsity and perplexity after "
                        "--feedback-skip tokens without and with sparse_attn_decode_feedback")
    p.add_argument("--feedback-skip", type=int, default=64, help="generated tokens before the measured ones")
    p.add_argument("--feedback-tokens", type=int, default=64, help="generated tokens measured after the skip")
    p.add_argument("--out", default=None, help="output dir (default artifacts/fidelity[_quick])")
    return p.parse_args(argv)


def per_document_feedback(args, targets, lengths, sources, out_dir: Path) -> int:
    """`--decode-feedback`: benchmarks/decode_feedback.py at each target, on the engine path, from `--config` (or a
    calibration run first); writes decode_feedback.json and prints one table per target."""
    import decode_feedback
    import fidelity_engine

    if args.path != "engine":
        sys.exit("fidelity: --decode-feedback measures vLLM's engine (decode feedback lives in its plan); "
                 "drop --path hf")
    config = Path(args.config) if args.config else fidelity_engine.calibrate_with_script(
        Path(args.model).resolve(), out_dir, args.calib_args)[0]
    config = config / "config.json" if config.is_dir() else config
    results = []
    for target in targets:
        results.append(decode_feedback.run(args.model, config, target, lengths, sources, _ints(args.seeds),
                                           args.feedback_skip, args.feedback_tokens, args.dtype))  # fmt: skip
        decode_feedback.report(results[-1])
    (out_dir / "decode_feedback.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {out_dir / 'decode_feedback.json'}")
    return 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def calibrate(model, tokenizer, states, lengths, per_length, chunk_size, decode_tokens, laws):
    """Fit both phases with each law on the calibration data at `lengths`: ({law: {phase: PhaseFit}}, seconds)."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.calibrate import collect_counts, run_sample
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import build_calibration_prompts
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import (
        aggregate_counts,
        default_threshold_trials,
        fit_phase,
    )

    samples = []
    for length in lengths:
        samples += build_calibration_prompts(tokenizer, num_samples=per_length, max_seqlen=length, min_seqlen=length)
    trials = default_threshold_trials()

    def loop(m):
        for i, sample in enumerate(samples):
            ids = tokenizer(sample.prompt, return_tensors="pt").input_ids
            logger.info("calibration %d/%d: %s, %d tokens", i + 1, len(samples), sample.task, ids.shape[1])
            run_sample(m, ids, chunk_size=chunk_size, decode_tokens=decode_tokens)

    t0 = time.time()
    collector = collect_counts(model, states, loop, trials)
    points = aggregate_counts(collector.records, trials)
    fits = {law: {ph: fit_phase(points[ph], phase=ph, length_law=law == "length") for ph in PHASES} for law in laws}
    return fits, time.time() - t0


def measure(model, tokenizer, states, fits_by_law, targets, source, length, chunk_size, decode_tokens):
    """Exact realized sparsity of one held-out prompt: {law: {target: {phase: sparsity}}}, every law and target
    measured in the same dense pass."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.calibrate import collect_counts, run_sample

    text, n = natural_text.heldout_prompt(tokenizer, source, length)
    ids = tokenizer(text, return_tensors="pt").input_ids
    keys = [(law, t) for law in fits_by_law for t in targets]
    trials = [
        (tuple(fits_by_law[law][ph].log_scale_factor(t) for ph in PHASES),
         tuple(fits_by_law[law][ph].exponent(t) for ph in PHASES))
        for law, t in keys
    ]  # fmt: skip
    collector = collect_counts(
        model, states, lambda m: run_sample(m, ids, chunk_size=chunk_size, decode_tokens=decode_tokens), law=trials
    )
    totals = {ph: torch.zeros(len(keys), 2, dtype=torch.int64) for ph in PHASES}
    for rec in collector.records:
        totals[rec.phase] += torch.as_tensor(rec.counts)
    realized: dict = {law: {} for law in fits_by_law}
    for i, (law, t) in enumerate(keys):
        realized[law][t] = {
            ph: (float(totals[ph][i, 1]) / float(totals[ph][i, 0]) if totals[ph][i, 0] else None) for ph in PHASES
        }
    return realized, ids.shape[1]


@torch.no_grad()
def quality(model, tokenizer, states, fits, targets, sources, length, decode_tokens):
    """Perplexity delta and greedy agreement with dense at each target, served sparse, on held-out prompts."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text

    texts = [natural_text.heldout_prompt(tokenizer, src, length)[0] for src in sources]
    ids = [tokenizer(t, return_tensors="pt").input_ids for t in texts]

    def run(enabled: bool):
        for state in states:
            state.enabled = enabled
        nll, tokens, argmaxes, greedy = 0.0, 0, [], []
        for x in ids:
            logits = model(x).logits[0, :-1]
            nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            tokens += x.shape[1] - 1
            argmaxes.append(logits.argmax(-1))
            half = x[:, : x.shape[1] // 2]
            greedy.append(model.generate(half, max_new_tokens=decode_tokens, do_sample=False)[0, half.shape[1] :])
        return math.exp(nll / tokens), argmaxes, greedy

    dense_ppl, dense_arg, dense_greedy = run(False)
    rows = {}
    for t in targets:
        for state in states:
            for ph in PHASES:
                state.calibration[ph] = fits[ph].to_phase_calibration(t)
        ppl, arg, greedy = run(True)
        rows[t] = dict(
            ppl=ppl,
            ppl_delta=ppl / dense_ppl - 1.0,
            next_token_agree=float(torch.cat([a == b for a, b in zip(arg, dense_arg, strict=True)]).float().mean()),
            greedy_agree=float(
                torch.cat([a == b for a, b in zip(greedy, dense_greedy, strict=True)]).float().mean()
            ),
        )
    for state in states:
        state.enabled = True
    return dict(dense_ppl=dense_ppl, targets=rows)


def _error_stats(errs: list[float]) -> dict:
    return dict(mean_abs_error=float(sum(errs) / len(errs)) if errs else None,
                max_abs_error=float(max(errs)) if errs else None,
                within_0_05=sum(e <= 0.05 for e in errs), within_0_10=sum(e <= 0.10 for e in errs))  # fmt: skip


def summarize(cells, targets, law):
    """Mean and max |realized - target| per phase over reachable cells, and how many are within 0.05.

    Where cells pool several documents (engine path, `--seeds`), also: `per_document`, the same errors as if each
    document were a cell of its own; `per_order`, the summary of each document order alone (what a one-document run
    with that seed reports); and `document_spread`, the root mean square and max of document − cell, i.e. how much
    of a one-document cell's error is the text rather than the law."""
    out = {}
    for ph in PHASES:
        errs, doc_errs, spread, by_order = [], [], [], {}
        for c in cells:
            for t in targets:
                r = c["realized"][law][t][ph]
                if r is None or c["unreachable"][law][t][ph]:
                    continue
                errs.append(abs(r - t))
                docs = [d for d in c.get("documents", ()) if d["realized"][law][t][ph] is not None]
                if len(docs) > 1:
                    for d in docs:
                        x = d["realized"][law][t][ph]
                        doc_errs.append(abs(x - t))
                        spread.append(x - r)
                        by_order.setdefault(d["seed"], []).append(abs(x - t))
        out[ph] = dict(_error_stats(errs), cells=len(errs))
        if doc_errs:
            out[ph]["per_document"] = dict(_error_stats(doc_errs), documents=len(doc_errs))
            out[ph]["per_order"] = {seed: dict(_error_stats(e), cells=len(e)) for seed, e in sorted(by_order.items())}
            out[ph]["document_spread"] = dict(rms=float(math.sqrt(sum(d * d for d in spread) / len(spread))),
                                              max=float(max(abs(d) for d in spread)))  # fmt: skip
    return out


def table(cells, targets, sources, lengths, phase, law) -> str:
    head = "| target | " + " | ".join(f"{s} {n}" for s in sources for n in lengths) + " |"
    lines = [head, "|" + "---|" * (1 + len(sources) * len(lengths))]
    by = {(c["source"], c["length"]): c for c in cells}
    for t in targets:
        row = [f"{t:g}"]
        for s in sources:
            for n in lengths:
                c = by[(s, n)]
                r = c["realized"][law][t][phase]
                dense = c["unreachable"][law][t][phase]
                row.append("dense (unreachable)" if dense else ("-" if r is None else f"{r:.3f}"))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(cells, targets, sources, law, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    for i, ph in enumerate(PHASES):
        ax = fig.add_subplot(1, 2, i + 1)
        for j, t in enumerate(targets):
            ax.axhline(t, color=f"C{j}", lw=0.8, ls=":")
            for k, (s, marker) in enumerate(zip(sources, "os^", strict=False)):
                pts = sorted((c["length"], c["realized"][law][t][ph]) for c in cells if c["source"] == s
                             and c["realized"][law][t][ph] is not None
                             and not c["unreachable"][law][t][ph])  # fmt: skip
                if pts:
                    xs, ys = zip(*pts, strict=True)
                    ax.plot(xs, ys, marker=marker, color=f"C{j}", label=f"target {t:g}, {s}")
                docs = [(c["length"], d["realized"][law][t][ph]) for c in cells if c["source"] == s
                        and len(c.get("documents", ())) > 1 and not c["unreachable"][law][t][ph]
                        for d in c["documents"] if d["realized"][law][t][ph] is not None]  # fmt: skip
                if docs:  # each document of a pooled cell, faint: how far one document strays from its cell
                    xs, ys = zip(*docs, strict=True)
                    shift = 1.0 + 0.04 * (k - (len(sources) - 1) / 2)  # sources side by side
                    ax.scatter([x * shift for x in xs], ys, marker=marker, s=10, color=f"C{j}", alpha=0.3, lw=0)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("realized sparsity (dropped / visited row-tiles)")
        pooled = max((len(c.get("documents", ())) for c in cells), default=0)
        docs_note = f"\n{pooled} documents per cell (faint: each document alone)" if pooled > 1 else ""
        ax.set_title(f"{ph}: realized vs target (dotted), held-out text, {law} law{docs_note}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def run_hf(args, targets, lengths, sources, laws, quality_length) -> dict:
    """The Hugging Face path: calibrate and measure in this process (mtsa)."""
    from fidelity_engine import fits_record
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modelopt_ext.torch.sparsity.attention_sparsity as mtsa

    if args.threads:
        torch.set_num_threads(args.threads)
    decode_tokens = args.decode_tokens or 8
    calib_lengths = _ints(args.calib_lengths) if args.calib_lengths else [n for n in lengths if n <= 4096]
    per_length = args.calib_samples_per_length or (3 if args.quick else 6)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    model = mtsa.sparsify(model, mtsa.SKIP_SOFTMAX_DEFAULT)
    states = list(mtsa.sparse_attention_states(model).values())
    fits, calib_s = calibrate(model, tokenizer, states, calib_lengths, per_length, args.chunk_size, decode_tokens, laws)
    cells = []
    for source in sources:
        for length in lengths:
            t0 = time.time()
            realized, n_tokens = measure(
                model, tokenizer, states, fits, targets, source, length, args.chunk_size, decode_tokens
            )
            unreachable = {
                law: {t: {"prefill": fits[law]["prefill"].dense_below(t) >= n_tokens,
                          "decode": fits[law]["decode"].dense_below(t) >= n_tokens + 1} for t in targets}
                for law in laws
            }  # fmt: skip
            cells.append(dict(source=source, length=length, tokens=n_tokens, realized=realized,
                              unreachable=unreachable, seconds=time.time() - t0))  # fmt: skip
            logger.info("%s %d (%.0f s): %s", source, length, time.time() - t0, realized)
    result = dict(
        path="hf", model=str(args.model), laws=laws, targets=targets, lengths=lengths, calib_lengths=calib_lengths,
        calib_samples_per_length=per_length, calib_seconds=calib_s,
        fits=fits_record(fits, laws, targets),
        cells=cells,
    )  # fmt: skip
    if quality_length:
        result["quality"] = {
            law: quality(model, tokenizer, states, fits[law], targets, sources, quality_length, 16) for law in laws
        }
    return result


def report(result: dict, targets, sources, lengths, quality_length) -> None:
    for law in result["laws"]:
        fits = result["fits"][law]
        print(f"\n## {law} law ({result['path']} path); fits: " + "; ".join(
            f"{ph} a={f['a']:.4g} b={f['b']:.4g} γ={f['length_exponent']:.3f}{f['length_exponent_slope']:+.3f}·(s−0.5) "
            f"R²={f['r2']:.3f}"
            for ph, f in fits.items()))  # fmt: skip
        for ph in PHASES:
            print(f"\n{ph} realized sparsity (held-out, {', '.join(sources)}):")
            print(table(result["cells"], targets, sources, lengths, ph, law))
            s = result["summary"][law][ph]
            if s["cells"]:
                print(f"mean |realized - target| {s['mean_abs_error']:.3f}, max {s['max_abs_error']:.3f}, "
                      f"{s['within_0_05']}/{s['cells']} cells within 0.05")
            if "per_document" in s:
                d, spread = s["per_document"], s["document_spread"]
                print(f"single documents: mean |realized - target| {d['mean_abs_error']:.3f}, max "
                      f"{d['max_abs_error']:.3f}, {d['within_0_05']}/{d['documents']} within 0.05, "
                      f"{d['within_0_10']}/{d['documents']} within 0.10; spread around their cell: rms "
                      f"{spread['rms']:.3f}, max {spread['max']:.3f}")
                print("each document order alone (mean / max): " + ", ".join(
                    f"seed {seed} {o['mean_abs_error']:.3f} / {o['max_abs_error']:.3f}"
                    for seed, o in s["per_order"].items()))  # fmt: skip
        if result.get("quality"):
            q = result["quality"][law]
            print(f"\nquality at {quality_length} tokens (dense ppl {q['dense_ppl']:.4f}):")
            print("| target | ppl | Δppl | Δppl by source | next-token agree | greedy agree |\n"
                  "|---|---|---|---|---|---|")
            for t, r in q["targets"].items():
                deltas = r.get("ppl_delta_by_source", {})
                by_source = ", ".join(f"{name} {100 * d:+.2f} %" for name, d in deltas.items())
                print(f"| {float(t):g} | {r['ppl']:.4f} | {100 * r['ppl_delta']:+.2f} % | {by_source or '-'} "
                      f"| {r['next_token_agree']:.3f} | "
                      f"{r['greedy_agree']:.3f} |")
    if result.get("batch_check") is not None:
        b = result["batch_check"]
        same = {ph: "identical" if b[f"{ph}_equal"] else "DIFFER" for ph in PHASES}
        print(f"\nmixed batch vs each prompt alone ({b['law']} law, target {b['target']:g}, dtype {b['dtype']}): "
              f"prefill counters {same['prefill']}, decode counters {same['decode']} (alone {b['alone']}, batch "
              f"{b['batch']}); greedy tokens differ for {len(b['tokens_differ'])} of the prompts"
              + (" (vLLM's dense layers are not batch invariant at this dtype: decode then runs on other contexts)"
                 if b["tokens_differ"] else ""))  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    targets = [float(x) for x in args.targets.split(",")]
    lengths = _ints(args.lengths) if args.lengths else ([512, 1024] if args.quick else [1024, 2048, 4096])
    sources = [s for s in args.sources.split(",") if s]
    quality_length = args.quality_length if args.quality_length is not None else (256 if args.quick else 1024)
    suffix = ("_hf" if args.path == "hf" else "") + ("_quick" if args.quick else "")
    out_dir = Path(args.out or REPO / "artifacts" / f"fidelity{suffix}").resolve()  # the calibration runs in it
    if not Path(args.model, "config.json").is_file():
        sys.exit(f"fidelity: {args.model} is not a Hugging Face checkpoint directory; run `make model` first")
    laws = ["length", "modelopt"] if args.law == "both" else [args.law]
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.decode_feedback:
        return per_document_feedback(args, targets, lengths, sources, out_dir)
    if args.path == "engine":
        import fidelity_engine

        args.decode_tokens = args.decode_tokens or 32
        args.quality_length = quality_length
        result = fidelity_engine.run(args, targets, lengths, sources, _ints(args.seeds), laws, out_dir)
    else:
        result = run_hf(args, targets, lengths, sources, laws, quality_length)
    laws = result["laws"]
    result["summary"] = {law: summarize(result["cells"], targets, law) for law in laws}
    (out_dir / "fidelity.json").write_text(json.dumps(result, indent=1, default=str))
    for law in laws:
        plot(result["cells"], targets, sources, law, out_dir / f"fidelity_{law}.png")
    report(result, targets, sources, lengths, quality_length)
    print(f"\nwrote {out_dir / 'fidelity.json'} and the PNGs beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
