"""The vLLM-engine path of benchmarks/fidelity.py: calibrate with the project's script, measure served sparsity.

Run through `benchmarks/fidelity.py` (default `--path engine`) with the interpreter of the environment that holds a
vLLM engine (`.venv-cpu` on a machine without a GPU). What it does, on one engine (vLLM's default multi-process
engine, our worker class, the checkpoint as users serve it):

1. The law: from `--config` (a written `sparse_attention_config.json`; its `.records.npz` beside it, when there,
   also gives ModelOpt's 1/kv_len law fitted on the same records) or, by default, by running
   `examples/vllm_serve/calibrate_sparse_attn.py` with `--calib-args` first (the command a user runs).
2. Dense reference (the engine starts dense): perplexity, next-token argmax and greedy tokens of the quality prompts.
3. Every (law, target) served for real (`sparse_attn_serve`): realized sparsity read from the serving counters
   (`sparse_attn_status`) after each held-out prompt sent alone; at `--serve-check-target` also all prompts as one
   mixed batch, whose counters must equal the sum of the alone runs; quality against the dense reference.
4. With `--dense-counts`: one calibration-mode pass with every (law, target) as a trial
   (`sparse_attn_enable_calibration(laws=...)`), i.e. what calibration, counting on dense activations, predicts.
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CALIBRATE = REPO / "examples" / "vllm_serve" / "calibrate_sparse_attn.py"
PHASES = ("prefill", "decode")

logger = logging.getLogger("fidelity")


# ------------------------------------------------------------------------------------------------------- the law


def _fit_from_calibration(calib):
    """A `PhaseFit` carrying a checkpoint phase's law (a, b, γ at the pivot, γ', n_ref), to evaluate it at any
    target."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import PhaseFit

    gamma, slope = float(calib.pivot_length_exponent), float(calib.length_exponent_slope)
    return PhaseFit(
        a=calib.a, b=calib.b, r2=calib.r2 if calib.r2 is not None else math.nan, n_points=calib.n_points or 0,
        sparsity_range=tuple(calib.observed_sparsity_range or (0.0, 1.0)), phase="",
        length_exponent=gamma, length_exponent_slope=slope,
        reference_length=calib.reference_length if (gamma, slope) != (1.0, 0.0) else None,
    )  # fmt: skip


def laws_from_config(config_path: Path, want: list[str]) -> tuple[dict, dict]:
    """{law: {phase: PhaseFit}} and a description of where they came from.

    "length": the config as written (our length law when it carries γ); "modelopt": ModelOpt's 1/kv_len law fitted on
    the records kept beside the config (the same counts), when they are there.
    """
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import fit_phases, points_from_merged_record
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        load_calibration_records,
        records_path_for,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        load_sparse_attention_config,
    )

    settings = load_sparse_attention_config(config_path)
    if settings is None:
        raise SystemExit(f"fidelity: {config_path} carries no sparse_attention_config")
    fits = {"length": {ph: _fit_from_calibration(settings.phase(ph)) for ph in PHASES if settings.phase(ph)}}
    source = {"config": str(config_path)}
    records = records_path_for(config_path)
    if "modelopt" in want and records.is_file():
        merged, meta = load_calibration_records(records)
        fits["modelopt"] = fit_phases(points_from_merged_record(merged), length_law=False)
        source["records"] = str(records)
        source["records_meta"] = meta
    elif "modelopt" in want:
        logger.warning("no %s beside the config: ModelOpt's law is not measured", records.name)
    source["attention_classes"] = list(settings.attention_classes or ())
    return {law: f for law, f in fits.items() if law in want and set(f) == set(PHASES)}, source


def calibrate_with_script(ckpt: Path, out_dir: Path, calib_args: str) -> tuple[Path, float]:
    """Run the project's calibration script as a user does; returns the written config and the seconds it took."""
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / "sparse_attention_config.json"
    cmd = [sys.executable, str(CALIBRATE), str(ckpt), *shlex.split(calib_args), "--output", str(output)]
    logger.info("calibrating: %s", " ".join(cmd))
    t0 = time.time()
    with open(out_dir / "calibrate.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=out_dir)
    if proc.returncode != 0:
        raise SystemExit(f"fidelity: calibration failed (exit {proc.returncode}); see {out_dir / 'calibrate.log'}")
    return output, time.time() - t0


def law_block(fits: dict, target: float, classes: list[str]) -> dict:
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        build_sparse_attention_config,
    )

    return build_sparse_attention_config(fits, target_sparsity=target, attention_classes=classes)


def fits_record(fits: dict, laws, targets) -> dict:
    """The results file's `fits`: per law and phase the fitted law and, per target, the length at or below which it
    serves dense (both paths write the same record)."""
    return {law: {ph: dict(a=f.a, b=f.b, length_exponent=f.length_exponent,
                           length_exponent_slope=f.length_exponent_slope, reference_length=f.reference_length,
                           r2=f.r2, n_points=f.n_points, dense_below={str(t): f.dense_below(t) for t in targets})
                  for ph, f in fits[law].items()} for law in laws}  # fmt: skip


def trial_law(fits: dict, target: float) -> tuple[float, float, float, float]:
    """(c_prefill, c_decode, γ_prefill, γ_decode) serving `fits` at `target` (docs/skip_softmax.md)."""
    return (fits["prefill"].log_scale_factor(target), fits["decode"].log_scale_factor(target),
            fits["prefill"].exponent(target), fits["decode"].exponent(target))  # fmt: skip


# ----------------------------------------------------------------------------------------------------- the engine


def start_engine(ckpt: Path, max_model_len: int, max_num_seqs: int, dtype: str = "auto", **engine_args):
    """vLLM's default engine (multi-process) with our worker class, as the example scripts start it (`engine_args`:
    more `LLM` arguments, e.g. a benchmark's `logits_processors`: the engine's processes get benchmarks/ on their
    PYTHONPATH to import it)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")]))
    from vllm import LLM
    from vllm.platforms import current_platform

    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import worker_extension_cls

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: every held-out prompt at once fits
    return LLM(model=str(ckpt), max_model_len=max_model_len, enforce_eager=True, enable_prefix_caching=False,
               seed=0, max_num_seqs=max_num_seqs, dtype=dtype, worker_extension_cls=worker_extension_cls(),
               **engine_args)  # fmt: skip


def _token_prompts(prompts):
    return [{"prompt_token_ids": list(ids)} for ids in prompts]


def phase_totals(ranks) -> np.ndarray:
    """[2 (prefill, decode), T, 2 (visited, skipped)] summed over every sequence-step of merged records."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        merge_calibration_records,
    )

    merged = merge_calibration_records(ranks)
    counts = np.asarray(merged["counts"], dtype=np.int64)
    decode = np.asarray(merged["is_decode"], dtype=bool)
    return np.stack([counts[~decode].sum(0), counts[decode].sum(0)])


def count_trials(llm, prompts, trials, decode_tokens: int) -> list[np.ndarray]:
    """Calibration mode with `trials` as served laws: phase totals per trial (`phase_totals`) per prompt alone."""
    from vllm import SamplingParams

    llm.collective_rpc("sparse_attn_enable_calibration", args=(None, None, [list(t) for t in trials]))
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    llm.collective_rpc("sparse_attn_collect_counts")  # drop anything before
    alone = []
    for p in _token_prompts(prompts):
        llm.generate([p], params, use_tqdm=False)
        alone.append(phase_totals(llm.collective_rpc("sparse_attn_collect_counts")))
    return alone


def phase_ratios(totals: np.ndarray) -> dict:
    """{phase: skipped / visited} of [2 (prefill, decode), 2 (visited, skipped)] totals (None where nothing was
    visited)."""
    return {ph: (float(totals[p, 1] / totals[p, 0]) if totals[p, 0] else None) for p, ph in enumerate(PHASES)}


def _counter_totals(realized: dict) -> np.ndarray:
    """[2 (prefill, decode), 2 (visited, skipped)] from `sparse_attn_status()["realized"]`."""
    return np.array([[realized[ph]["visited"], realized[ph]["skipped"]] for ph in PHASES], dtype=np.int64)


def serve_counters(llm, block: dict, prompts, decode_tokens: int, batch: bool) -> tuple[list[np.ndarray], dict | None]:
    """Serve `block` for real; the serving counters (`_counter_totals`) after each prompt alone and, with `batch`,
    the comparison with all of them as one mixed batch (`batch_comparison`)."""
    from vllm import SamplingParams

    llm.collective_rpc("sparse_attn_serve", args=(block,))
    params = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    alone, tokens = [], []
    for p in _token_prompts(prompts):
        llm.collective_rpc("sparse_attn_reset_stats")
        tokens.append(list(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids))
        alone.append(_counter_totals(llm.collective_rpc("sparse_attn_status")[0]["realized"]))
    if not batch:
        return alone, None
    llm.collective_rpc("sparse_attn_reset_stats")
    outs = llm.generate(_token_prompts(prompts), params, use_tqdm=False)
    together = _counter_totals(llm.collective_rpc("sparse_attn_status")[0]["realized"])
    return alone, batch_comparison(sum(alone), together, tokens, [list(o.outputs[0].token_ids) for o in outs])


def batch_comparison(alone: np.ndarray, together: np.ndarray, tokens_alone, tokens_together) -> dict:
    """Alone vs mixed batch, per phase. Decode counters can only match where the greedy tokens do: the context of
    a decode step is what was generated, and vLLM's dense layers (bf16 GEMMs whose blocking follows the batch) are
    not batch invariant, so a prompt may generate other tokens in a batch with no sparse layer at all."""
    differ = [i for i, (a, b) in enumerate(zip(tokens_alone, tokens_together, strict=True)) if a != b]
    return dict(prefill_equal=bool(np.array_equal(alone[0], together[0])),
                decode_equal=bool(np.array_equal(alone[1], together[1])), tokens_differ=differ,
                equal=bool(np.array_equal(alone, together)), alone=alone.tolist(), batch=together.tolist())  # fmt: skip


def quality_pass(llm, prompts, new_tokens: int, names=None) -> dict:
    """Per prompt: sum of prompt NLL and token count, next-token argmax per position, greedy continuation; with
    `names` (one per prompt, e.g. the held-out source) also the NLL and token count of each name."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(_token_prompts(prompts), params, use_tqdm=False)
    nll, tokens, argmax, greedy, by_name = 0.0, 0, [], [], {}
    for i, (ids, o) in enumerate(zip(prompts, outs, strict=True)):
        prompt_nll = 0.0
        for tok, lp in zip(ids[1:], o.prompt_logprobs[1:], strict=True):
            prompt_nll -= lp[tok].logprob
            argmax.append(next(t for t, v in lp.items() if v.rank == 1))
        nll += prompt_nll
        tokens += len(ids) - 1
        if names is not None:
            acc = by_name.setdefault(names[i], [0.0, 0])
            acc[0] += prompt_nll
            acc[1] += len(ids) - 1
        greedy.append(list(o.outputs[0].token_ids))
    return dict(nll=nll, tokens=tokens, argmax=argmax, greedy=greedy, by_name=by_name)


def quality_row(q: dict, dense: dict) -> dict:
    ppl, dense_ppl = math.exp(q["nll"] / q["tokens"]), math.exp(dense["nll"] / dense["tokens"])
    agree = [a == b for a, b in zip(q["argmax"], dense["argmax"], strict=True)]
    greedy = [a == b for x, y in zip(q["greedy"], dense["greedy"], strict=True) for a, b in zip(x, y, strict=True)]
    per_source = {name: math.exp((nll / n) - dense["by_name"][name][0] / dense["by_name"][name][1]) - 1.0
                  for name, (nll, n) in q.get("by_name", {}).items()}  # fmt: skip
    return dict(ppl=ppl, ppl_delta=ppl / dense_ppl - 1.0, next_token_agree=sum(agree) / len(agree),
                greedy_agree=sum(greedy) / len(greedy), ppl_delta_by_source=per_source)  # fmt: skip


# -------------------------------------------------------------------------------------------------------- the run


def heldout_prompts(tokenizer, sources, lengths, seeds, context: int, decode_tokens: int):
    """[(source, length, seed, token ids)]: a length past the model's context is cut to fit with the decode steps."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text

    out = []
    for source in sources:
        for length in lengths:
            n = min(length, context - decode_tokens - 1)
            for seed in seeds:
                text, _ = natural_text.heldout_prompt(tokenizer, source, n, seed=seed)
                out.append((source, length, seed, tokenizer(text).input_ids[:n]))
    return out


def run(args, targets, lengths, sources, seeds, laws_wanted, out_dir: Path) -> dict:
    """The whole engine path; returns the result dict that fidelity.py reports."""
    from transformers import AutoConfig, AutoTokenizer

    from modelopt_ext.torch.sparsity.attention_sparsity.cli.engine_control import shutdown_engine

    ckpt = Path(args.model).resolve()
    calib_seconds = None
    if args.config:
        config = Path(args.config)
        config = config / "config.json" if config.is_dir() else config
    else:
        config, calib_seconds = calibrate_with_script(ckpt, out_dir, args.calib_args)
    fits, law_source = laws_from_config(config.resolve(), laws_wanted)
    laws = [law for law in laws_wanted if law in fits]
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    context = int(getattr(AutoConfig.from_pretrained(ckpt), "max_position_embeddings", 0) or 1 << 20)
    items = heldout_prompts(tokenizer, sources, lengths, seeds, context, args.decode_tokens)
    prompts = [ids for *_, ids in items]
    quality_prompts, quality_names = [], []
    if args.quality_length:
        quality_items = heldout_prompts(tokenizer, sources, [args.quality_length], [0], context, args.decode_tokens)
        quality_prompts = [ids for *_, ids in quality_items]
        quality_names = [source for source, *_ in quality_items]
    max_len = max(len(p) for p in prompts + quality_prompts) + max(args.decode_tokens, 16) + 1
    llm = start_engine(ckpt, min(max_len, context), max(len(prompts), len(quality_prompts), 1), args.dtype,
                       kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    classes = law_source["attention_classes"] or None
    keys = [(law, t) for law in laws for t in targets]
    check = (laws[0], args.serve_check_target)
    served, batch_check, quality, counted = {}, None, {}, None
    t0 = time.time()
    try:
        dense = quality_pass(llm, quality_prompts, 16, quality_names) if quality_prompts else None
        for law, t in keys:
            block = law_block(fits[law], t, classes)
            alone, compared = serve_counters(llm, block, prompts, args.decode_tokens, batch=(law, t) == check)
            served[(law, t)] = alone
            if compared is not None:
                batch_check = dict(law=law, target=t, dtype=args.dtype, **compared)
            if dense is not None:
                q = quality.setdefault(law, dict(dense_ppl=math.exp(dense["nll"] / dense["tokens"]), targets={}))
                q["targets"][t] = quality_row(quality_pass(llm, quality_prompts, 16, quality_names), dense)
            logger.info("served %s law at target %g: %d prompts, %.0f s so far", law, t, len(prompts), time.time() - t0)
        if args.dense_counts:  # what calibration-mode counting (dense activations) predicts for the same laws
            alone_c = count_trials(llm, prompts, [trial_law(fits[law], t) for law, t in keys], args.decode_tokens)
            counted = {key: [a[:, k] for a in alone_c] for k, key in enumerate(keys)}
    finally:
        shutdown_engine(llm)  # its processes now, not at garbage collection

    cells = []
    for source in sources:
        for length in lengths:
            idx = [i for i, (s, n, _, _) in enumerate(items) if s == source and n == length]
            n_tokens = len(items[idx[0]][3])
            realized, unreachable = {law: {} for law in laws}, {law: {} for law in laws}
            dense_activations = {law: {} for law in laws}
            for law, t in keys:
                realized[law][t] = phase_ratios(sum(served[(law, t)][i] for i in idx))
                unreachable[law][t] = {"prefill": fits[law]["prefill"].dense_below(t) >= n_tokens,
                                       "decode": fits[law]["decode"].dense_below(t) >= n_tokens + 1}  # fmt: skip
                if counted is not None:
                    dense_activations[law][t] = phase_ratios(sum(counted[(law, t)][i] for i in idx))
            # Each held-out document on its own too: a cell pools its documents' counts, and how far single
            # documents scatter around that pool is what a one-document cell can be off by from text alone.
            documents = [dict(seed=items[i][2], tokens=len(items[i][3]),
                              realized={law: {t: phase_ratios(served[(law, t)][i]) for t in targets} for law in laws})
                         for i in idx]  # fmt: skip
            cell = dict(source=source, length=length, tokens=n_tokens, prompts=len(idx), realized=realized,
                        unreachable=unreachable, documents=documents)  # fmt: skip
            if counted is not None:
                cell["counted_with_dense_activations"] = dense_activations
            cells.append(cell)
    return dict(
        path="engine", model=str(ckpt), laws=laws, law_source=law_source, targets=targets, lengths=lengths,
        seeds=seeds, sources=sources, decode_tokens=args.decode_tokens, calib_seconds=calib_seconds,
        serve_seconds=time.time() - t0, calib_args=None if args.config else args.calib_args,
        fits=fits_record(fits, laws, targets),
        cells=cells, batch_check=batch_check, quality=quality or None,
    )  # fmt: skip
