#!/usr/bin/env python
"""Per-document decode sparsity and decode perplexity with and without decode feedback (issue #28), on vLLM's engine.

Never a timed test. Each held-out document (natural_text's held-out prose and code at the given lengths) is cut into
a prompt and its true continuation of `--skip + --tokens` tokens. One engine serves `--config`'s law at `--target`;
every document is sent three ways, through the per-request keys a user sets (`SamplingParams.extra_args`):

- dense (`sparse_attn_target: "dense"`): the reference;
- the checkpoint's law (no key): what serving does today;
- the same law with `sparse_attn_decode_feedback: true`.

Each run is teacher-forced through vLLM's decode (benchmarks/forced_continuation.py): the request generates the
document's own continuation, one decode step per token, and the logprob vLLM returns for each token is the model's
(raw, before the forcing). So all three runs see the same tokens, and the perplexity of the last `--tokens` tokens
is a decode-row perplexity of each variant. For the two sparse runs the request's own decode counters
(`sparse_attn_request_stats`) are read after `--skip` tokens and after `--skip + --tokens`: the decode sparsity of
the measured tokens is the difference. All documents of one run go in one batch: a request's tokens, logprobs and
counters do not depend on its batch (the load-invariance property, tests/e2e/test_invariance.py).

    .venv-cpu/bin/python benchmarks/decode_feedback.py --config CAL/sparse_attention_config.json \\
        --lengths 512,1024 --seeds 0,1 --out artifacts/decode_feedback

`benchmarks/fidelity.py --decode-feedback` runs the same view for each of its `--targets`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
MODES = {"dense": {"sparse_attn_target": "dense"}, "law": {}, "feedback": {"sparse_attn_decode_feedback": True}}

logger = logging.getLogger("decode_feedback")


def documents(tokenizer, sources, lengths, seeds, context: int, total: int):
    """[(source, length, seed, prompt ids, continuation ids)]: the continuation is the document's next `total`
    tokens; a length past the model's context is cut to fit."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration import natural_text

    out = []
    for source in sources:
        for length in lengths:
            n = min(length, context - total - 1)
            for seed in seeds:
                text, _ = natural_text.heldout_prompt(tokenizer, source, n + total, seed=seed)
                ids = tokenizer(text).input_ids
                out.append((source, length, seed, ids[: len(ids) - total], ids[len(ids) - total:]))
    return out


def _forced(llm, items, tokens: int, extra: dict) -> list[tuple[list[float], tuple[int, int]]]:
    """Per document, teacher-forced for `tokens` steps: (logprob of each forced token, its decode (visited,
    skipped))."""
    from forced_continuation import FORCE_KEY
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=0,
                             extra_args={**extra, FORCE_KEY: list(cont)}) for *_, cont in items]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": list(ids)} for *_, ids, _ in items], params, use_tqdm=False)
    stats = llm.collective_rpc("sparse_attn_request_stats", args=([o.request_id for o in outs],))[0]
    by_id = {v["user_request_id"]: v for v in stats.values()}
    rows = []
    for (*_, cont), o in zip(items, outs, strict=True):
        got = list(o.outputs[0].token_ids)
        assert got == list(cont[:tokens]), "the forcing logits processor did not hold"
        logprobs = [step[tok].logprob for step, tok in zip(o.outputs[0].logprobs, got, strict=True)]
        entry = by_id.get(o.request_id)
        counts = (entry["decode"]["visited"], entry["decode"]["skipped"]) if entry else (0, 0)
        rows.append((logprobs, counts))
    return rows


def _kv_cache_for(hf_config, tokens: int, dtype: str) -> None:
    """On vLLM's CPU engine: a KV cache that holds every document at once (`VLLM_CPU_KVCACHE_SPACE`, GiB), so no
    request is preempted (a preempted request's recomputed rows would count as prefill)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "VLLM_CPU_KVCACHE_SPACE" in os.environ:
        return
    text = hf_config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * heads * head_dim * (4 if dtype in ("float32", "fp32") else 2)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(2, math.ceil(2 * tokens * per_token / 2**30)))


def _ppl(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / max(len(logprobs), 1))


def run(model, config_path, target: float, lengths, sources, seeds, skip: int, tokens: int, dtype: str) -> dict:
    """The per-document view at one target (see the module docstring); a JSON-ready dict."""
    from fidelity_engine import start_engine
    from forced_continuation import FQCN
    from transformers import AutoConfig, AutoTokenizer

    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        build_sparse_attention_config,
        linked_checkpoint_copy,
        parse_sparse_attention_config,
        write_sparse_attention_config,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.cli.engine_control import shutdown_engine

    config = json.loads(Path(config_path).read_text())
    block = config.get("sparse_attention_config", config)
    settings = parse_sparse_attention_config(block)
    fits = {phase: settings.phase(phase) for phase in ("prefill", "decode")}
    model = Path(model).resolve()
    tmp = tempfile.TemporaryDirectory(prefix="decode_feedback_")  # the checkpoint copy (linked weights)
    work = Path(tmp.name)
    ckpt = linked_checkpoint_copy(model, work / "ckpt")
    write_sparse_attention_config(ckpt, build_sparse_attention_config(fits, target_sparsity=target))
    tokenizer = AutoTokenizer.from_pretrained(model)
    context = int(getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", 0) or 1 << 20)
    total = skip + tokens
    items = documents(tokenizer, list(sources), list(lengths), list(seeds), context, total)
    max_len = min(max(len(ids) for *_, ids, _ in items) + total + 1, context)
    _kv_cache_for(AutoConfig.from_pretrained(model), len(items) * max_len, dtype)
    llm = start_engine(ckpt, max_len, len(items), dtype, logits_processors=[FQCN])
    runs, t0 = {}, time.time()
    try:
        for mode, extra in MODES.items():
            at_skip = _forced(llm, items, skip, extra) if mode != "dense" else None
            runs[mode] = (_forced(llm, items, total, extra), at_skip)
            logger.info("%s: %d documents teacher-forced for %d tokens, %.0f s", mode, len(items), total,
                        time.time() - t0)  # fmt: skip
    finally:
        shutdown_engine(llm)
        tmp.cleanup()
    rows = []
    for i, (source, length, seed, ids, _) in enumerate(items):
        row = dict(source=source, length=length, seed=seed, tokens=len(ids))
        for mode, (full, at_skip) in runs.items():
            logprobs, (v1, s1) = full[i]
            entry = dict(ppl=_ppl(logprobs[skip:]), ppl_whole=_ppl(logprobs), nll=-sum(logprobs[skip:]))
            if at_skip is not None:
                _, (v0, s0) = at_skip[i]
                entry.update(after_skip=(s1 - s0) / max(v1 - v0, 1), whole=s1 / max(v1, 1))
            row[mode] = entry
        rows.append(row)
    pooled = {mode: math.exp(sum(r[mode]["nll"] for r in rows) / (tokens * len(rows))) for mode in MODES}
    return dict(model=str(model), config=str(config_path), target=target, skip=skip, tokens=tokens, dtype=dtype,
                seconds=time.time() - t0, pooled_ppl=pooled, documents=rows)  # fmt: skip


def report(result: dict) -> None:
    """The markdown table of one `run`."""
    lo, hi = result["skip"] + 1, result["skip"] + result["tokens"]
    print(f"\ntarget {result['target']:g}: decode sparsity and teacher-forced perplexity of tokens {lo}..{hi}, "
          f"without / with decode feedback")
    print("| document | prompt tokens | sparsity: law | feedback | perplexity: dense | law | feedback |")
    print("|---|---|---|---|---|---|---|")
    for r in result["documents"]:
        print(f"| {r['source']} {r['length']} seed {r['seed']} | {r['tokens']} | {r['law']['after_skip']:.3f} | "
              f"{r['feedback']['after_skip']:.3f} | {r['dense']['ppl']:.3f} | {r['law']['ppl']:.3f} | "
              f"{r['feedback']['ppl']:.3f} |")  # fmt: skip
    p = result["pooled_ppl"]
    print(f"| all (pooled) | | | | {p['dense']:.4f} | {p['law']:.4f} | {p['feedback']:.4f} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=str(DEFAULT_MODEL))
    p.add_argument("--config", required=True, help="a calibrated sparse_attention_config.json (or config.json)")
    p.add_argument("--target", type=float, default=0.5)
    p.add_argument("--lengths", default="512,1024")
    p.add_argument("--sources", default="prose,code")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--skip", type=int, default=64, help="generated tokens before the measured ones")
    p.add_argument("--tokens", type=int, default=64, help="generated tokens measured after --skip")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=Path("artifacts/decode_feedback"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run(args.model, args.config, args.target, [int(x) for x in args.lengths.split(",")],
                 args.sources.split(","), [int(x) for x in args.seeds.split(",")], args.skip, args.tokens, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
