#!/usr/bin/env python
"""Per-document decode sparsity with and without decode feedback (issue #28), on vLLM's engine.

Never a timed test. Each held-out document (benchmarks/fidelity_engine.py's `heldout_prompts`: prose and code at
the given lengths) is sent alone to one engine serving `--config`'s law at `--target`, three ways, through the
per-request keys a user sets (`SamplingParams.extra_args`):

- dense (`sparse_attn_target: "dense"`): the reference tokens;
- the checkpoint's law (no key): what serving does today;
- the same law with `sparse_attn_decode_feedback: true`.

For the last two, the request's own decode counters (`sparse_attn_request_stats`) are read after `--skip` greedy
tokens and after `--skip + --tokens`: the decode sparsity of the tokens after the first `--skip` is the
difference. Greedy decoding makes the first `--skip` tokens of both runs the same. Quality: the share of the
`--skip + --tokens` greedy tokens equal to the dense run's, position by position (not a perplexity: decode rows
cannot be teacher-forced through vLLM's generate).

    .venv-cpu/bin/python benchmarks/decode_feedback.py --config CAL/sparse_attention_config.json \\
        --lengths 512,1024 --seeds 0,1 --out artifacts/decode_feedback

`benchmarks/fidelity.py --decode-feedback` runs the same view for each of its `--targets`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
DEFAULT_MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"

logger = logging.getLogger("decode_feedback")


def _decode(stats: dict, request_id: str) -> tuple[int, int]:
    entry = next(v for v in stats.values() if v["user_request_id"] == request_id)
    return entry["decode"]["visited"], entry["decode"]["skipped"]


def _generate(llm, ids, tokens: int, extra: dict | None):
    """(greedy tokens, this request's decode (visited, skipped)) of one request alone."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    out = llm.generate([{"prompt_token_ids": list(ids)}], params, use_tqdm=False)[0]
    stats = llm.collective_rpc("sparse_attn_request_stats", args=([out.request_id],))[0]
    return list(out.outputs[0].token_ids), _decode(stats, out.request_id)


def run(model, config_path, target: float, lengths, sources, seeds, skip: int, tokens: int, dtype: str) -> dict:
    """The per-document view at one target (see the module docstring); a JSON-ready dict."""
    from fidelity_engine import _shutdown, heldout_prompts, start_engine
    from transformers import AutoConfig, AutoTokenizer

    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        build_sparse_attention_config,
        linked_checkpoint_copy,
        parse_sparse_attention_config,
        write_sparse_attention_config,
    )

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
    items = heldout_prompts(tokenizer, list(sources), list(lengths), list(seeds), context, total)
    llm = start_engine(ckpt, min(max(len(ids) for *_, ids in items) + total + 1, context), 1, dtype)
    rows, t0 = [], time.time()
    try:
        for source, length, seed, ids in items:
            dense, _ = _generate(llm, ids, total, {"sparse_attn_target": "dense"})
            row = dict(source=source, length=length, seed=seed, tokens=len(ids))
            for mode, extra in (("law", None), ("feedback", {"sparse_attn_decode_feedback": True})):
                _, (v0, s0) = _generate(llm, ids, skip, extra)
                greedy, (v1, s1) = _generate(llm, ids, total, extra)
                row[mode] = dict(after_skip=(s1 - s0) / max(v1 - v0, 1), whole=s1 / max(v1, 1),
                                 greedy_agree=sum(a == b for a, b in zip(greedy, dense, strict=True)) / total)
            rows.append(row)
            logger.info("%s %d seed %d: decode sparsity after %d tokens %.3f (law) / %.3f (feedback); %.0f s",
                        source, length, seed, skip, row["law"]["after_skip"], row["feedback"]["after_skip"],
                        time.time() - t0)  # fmt: skip
    finally:
        _shutdown(llm)
        tmp.cleanup()
    return dict(model=str(model), config=str(config_path), target=target, skip=skip, tokens=tokens, dtype=dtype,
                seconds=time.time() - t0, documents=rows)  # fmt: skip


def report(result: dict) -> None:
    """The markdown table of one `run`."""
    print(f"\ntarget {result['target']:g}: decode sparsity of generated tokens {result['skip'] + 1}.."
          f"{result['skip'] + result['tokens']}, without / with decode feedback")
    print("| document | tokens | law | feedback | greedy = dense: law | feedback |")
    print("|---|---|---|---|---|---|")
    for r in result["documents"]:
        print(f"| {r['source']} {r['length']} seed {r['seed']} | {r['tokens']} | {r['law']['after_skip']:.3f} | "
              f"{r['feedback']['after_skip']:.3f} | {r['law']['greedy_agree']:.2f} | "
              f"{r['feedback']['greedy_agree']:.2f} |")  # fmt: skip


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
