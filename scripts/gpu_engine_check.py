#!/usr/bin/env python3
"""The first vLLM engine with this plugin on the offline GPU machine (issue #68), rehearsed on the CPU engine.

The GPU machine cannot download a model, so this makes one: a random-weight checkpoint with Llama's attention
geometry (32 query / 8 KV heads, head dim 128; few layers, small vocabulary) and a tokenizer trained here with the
`tokenizers` library. It serves the checkpoint twice with vLLM's OpenAI server as a user runs it
(examples/vllm_serve/vllm_serve_sparse_attn.py): once without `sparse_attention_config` (dense) and once with a
fixed-fit block (sparse; vLLM's default full decode CUDA graphs on a GPU, where the plugin logs its CUDA-graph
self-test decision). It streams the same greedy requests to both, reads realized sparsity from `/metrics`, and
prints one table: time to first token, time per output token, realized sparsity, and whether the replies equal
dense where nothing was dropped (prompts shorter than one key tile). The device (cuda / cpu) is detected.

    python scripts/gpu_engine_check.py --out DIR [--layers 4] [--prompt-tokens 4096] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    build_sparse_attention_config,
    linked_checkpoint_copy,
    write_sparse_attention_config,
)
from modelopt_ext.torch.sparsity.attention_sparsity.cli.local_server import (  # noqa: E402
    free_port,
    running_server,
    server_env,
    sparse_metrics,
    tile_counts,
    tiles_between,
)

LOG = logging.getLogger("gpu_engine_check")
SERVE = REPO / "examples" / "vllm_serve" / "vllm_serve_sparse_attn.py"
# ModelOpt's law with SmolLM2's CPU-engine fit, the numbers tests/e2e/e2e_lib.py serves (FIXED_FITS): λ in (0, 1)
# at every length served here, so every row can drop tiles. The weights are random, so the realized share is
# whatever this model's scores give; the check is that the engine runs and reports it, not the value.
FITS = {"prefill": {"a": 0.0232, "b": 12.98}, "decode": {"a": 0.0075, "b": 13.02}}
WORDS = ("drawer item filed under the key value cache page tile row head model token prompt reply server engine "
         "graph kernel sparse dense prefill decode batch layer query block length law target fit").split()
# The plugin's log lines that say what decided CUDA graphs (plugins/vllm/cudagraphs.py, backends/base.py).
GRAPH_MARKS = ("sparse attention: CUDA-graph self-test", "sparse attention: full CUDA graphs",
               "vLLM runs CUDA graph mode")


def detect_device(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def corpus(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(100) if rng.random() < 0.3 else ''}" for _ in range(n_words))


def make_tokenizer(dest: Path, vocab: int):
    """A byte-level BPE tokenizer trained here on generated text (no download), saved as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([corpus(200, seed) for seed in range(200)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=1 << 16)
    fast.save_pretrained(dest)
    return fast


def make_checkpoint(dest: Path, layers: int, dtype: str, qk_scale: float, max_len: int, seed: int) -> Path:
    """Random-weight Llama geometry: 32 query / 8 KV heads of dim 128, a narrow residual stream (512) and MLP."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dest.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(dest, vocab=1024)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=max_len, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False, torch_dtype=dtype)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # wider scores than the init's near-uniform attention, so some tiles fall far behind
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_scale)
            layer.self_attn.k_proj.weight.mul_(qk_scale)
    model.to(getattr(torch, dtype)).save_pretrained(dest, safe_serialization=True)
    return dest


def stream_completion(base: str, prompt: str, max_tokens: int, timeout: float = 600.0) -> dict:
    """One greedy streamed completion: its text, time to first token and mean time per later token (client side)."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    start, stamps, text = time.perf_counter(), [], []
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            piece = chunk["choices"][0].get("text", "")
            if piece:
                stamps.append(time.perf_counter())
                text.append(piece)
    if not stamps:
        raise RuntimeError("the server streamed no tokens")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")
    return {"text": "".join(text), "ttft_s": stamps[0] - start, "tpot_s": tpot, "chunks": len(stamps)}


def prompts_of(tokenizer, tokens: int, count: int, seed: int) -> list[str]:
    """`count` prompts of exactly about `tokens` tokens of generated text."""
    out = []
    for i in range(count):
        ids = tokenizer(corpus(tokens * 2, seed + i))["input_ids"][:tokens]
        out.append(tokenizer.decode(ids))
    return out


def server_command(ckpt: Path, port: int, args, device: str) -> list[str]:
    cmd = [sys.executable, str(SERVE), str(ckpt), "--host", "127.0.0.1", "--port", str(port),
           "--served-model-name", "m", "--max-model-len", str(args.max_model_len), "--dtype", args.dtype,
           "--seed", "0", "--max-num-seqs", "8"]
    if device == "cuda":
        cmd += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    if args.attention_backend:
        cmd += ["--attention-backend", args.attention_backend]
    return cmd + list(args.serve_arg or [])


def graph_lines(log: Path) -> list[str]:
    """The server log's lines about CUDA graphs and the plugin's self-test (what decided full decode graphs)."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return [line.split("] ", 1)[-1].strip()[:240] for line in text if any(m in line for m in GRAPH_MARKS)][:6]


def run_mode(name: str, ckpt: Path, args, device: str, short: list[str], long: list[str]) -> dict:
    """Serve `ckpt`, warm up, then the short prompts (nothing to drop) and the long ones, counting tiles between."""
    port = free_port()
    log = Path(args.out) / f"server_{name}.log"
    env = server_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = "1"
    started = time.monotonic()
    with running_server(server_command(ckpt, port, args, device), log, env, f"http://127.0.0.1:{port}",
                        start_timeout=args.start_timeout) as base:
        start_s = time.monotonic() - started
        stream_completion(base, short[0], 4)  # warm-up: first-request compilation stays out of the timings
        m0 = tile_counts(sparse_metrics(base))
        short_out = [stream_completion(base, p, args.short_tokens) for p in short]
        m1 = tile_counts(sparse_metrics(base))
        long_out = [stream_completion(base, p, args.max_tokens) for p in long]
        m2 = tile_counts(sparse_metrics(base))
    return {"mode": name, "start_s": start_s, "short": short_out, "long": long_out,
            "short_tiles": tiles_between(m0, m1), "long_tiles": tiles_between(m1, m2), "graph_log": graph_lines(log)}


def median(values: list[float]) -> float:
    vals = sorted(values)
    return vals[len(vals) // 2] if vals else float("nan")


def table(device: str, runs: dict, args) -> str:
    dense = runs["dense"]
    rows = ["| mode | TTFT ms | TPOT ms | realized prefill | realized decode | short replies = dense | graphs |",
            "|---|---|---|---|---|---|---|"]
    for run in runs.values():
        ttft = median([r["ttft_s"] for r in run["long"]]) * 1e3
        tpot = median([r["tpot_s"] for r in run["long"]]) * 1e3
        lt, st = run["long_tiles"], run["short_tiles"]
        dropped_short = sum(st[p]["skipped"] for p in st)
        same = [a["text"] == b["text"] for a, b in zip(run["short"], dense["short"], strict=True)]
        eq = (f"{sum(same)}/{len(same)}" if dropped_short == 0 else f"n/a ({dropped_short:.0f} tiles dropped)")
        spars = [f"{lt[p]['sparsity']:.3f}" if lt[p]["visited"] else "-" for p in ("prefill", "decode")]
        decision = [g for g in run["graph_log"] if "full CUDA graphs" in g]
        graphs = decision[0].split("uniform decode ", 1)[-1] if decision else "-"
        rows.append(f"| {run['mode']} | {ttft:.1f} | {tpot:.2f} | {spars[0]} | {spars[1]} | "
                    f"{eq if run['mode'] != 'dense' else 'reference'} | {graphs} |")
    head = (f"device {device}, {args.layers} layers, 32/8 heads, D=128, {args.dtype}, long prompts "
            f"{args.prompt_tokens} tokens + {args.max_tokens} out (median of {args.long_count}), short prompts "
            f"{args.short_count} x ~12 tokens + {args.short_tokens} out, target {args.target}")
    return head + "\n" + "\n".join(rows)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the checkpoints, server logs and results")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--layers", type=int, default=None, help="default 4 on cuda, 2 on cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 4096 on cuda, 768 on cpu")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 64 on cuda, 16 on cpu")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--long-count", type=int, default=3)
    ap.add_argument("--short-count", type=int, default=3)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--target", type=float, default=0.5, help="target sparsity of the block (both phases)")
    ap.add_argument("--qk-scale", type=float, default=8.0, help="scale of the random q/k projections")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--attention-backend", default=None, help="vLLM's --attention-backend (default: vLLM's choice)")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--serve-arg", action="append", help="one more argument for the server (repeatable)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="gpu_engine_check: %(message)s")
    args = parse(argv)
    device = detect_device(args.device)
    gpu = device == "cuda"
    args.layers = args.layers or (4 if gpu else 2)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.prompt_tokens = args.prompt_tokens or (4096 if gpu else 768)
    args.max_tokens = args.max_tokens or (64 if gpu else 16)
    args.max_model_len = args.max_model_len or max(2048, args.prompt_tokens + args.max_tokens + 64)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dense = make_checkpoint(out / "ckpt_dense", args.layers, args.dtype, args.qk_scale, args.max_model_len, seed=0)
    sparse = linked_checkpoint_copy(dense, out / "ckpt_sparse", overwrite=True)
    write_sparse_attention_config(sparse, build_sparse_attention_config(FITS, target_sparsity=args.target))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dense)
    short = prompts_of(tok, 12, args.short_count, seed=1000)
    long = prompts_of(tok, args.prompt_tokens, args.long_count, seed=2000)
    runs = {}
    for name, ckpt in (("dense", dense), ("sparse", sparse)):
        LOG.info("serving %s on %s", name, device)
        runs[name] = run_mode(name, ckpt, args, device, short, long)
    text = table(device, runs, args)
    (out / "engine_check.json").write_text(json.dumps({"device": device, "args": vars(args), "runs": runs},
                                                      indent=1, default=str) + "\n")
    print(text)
    for line in runs["sparse"]["graph_log"]:
        print(f"  graph log: {line}")
    ok = runs["sparse"]["long_tiles"]["prefill"]["visited"] > 0
    if not ok:
        LOG.error("the sparse server counted no prefill tiles: the plugin did not serve sparse (see server_sparse.log)")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
