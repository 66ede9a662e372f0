#!/usr/bin/env python3
"""`make demo`: the whole product on the embedded default, on vLLM's CPU engine, no GPU needed.

1. calibrate skip-softmax thresholds for SmolLM2-135M through vLLM (examples/vllm_serve/calibrate_sparse_attn.py,
   four prompts, 256..2048 tokens, so it takes minutes, not hours): the longest reaches the server's
   --max-model-len, so the law is measured at the lengths the demo serves (its long prompt, ~1.7k tokens of
   held-out prose), not extrapolated to them;
2. export the fit into a copy of the checkpoint's config.json (`sparse_attention_config`);
3. serve that checkpoint with vLLM's OpenAI server and the sparse attention impls
   (examples/vllm_serve/vllm_serve_sparse_attn.py);
4. send real completions over HTTP, print the replies and the realized sparsity per phase, read on the server's
   Prometheus endpoint `/metrics` (the `modelopt_sparse_attn*` lines; it needs no development mode, so the server
   runs without VLLM_SERVER_DEV_MODE); stop the server.

Run it with the interpreter of .venv-cpu (the scripts run with ``--python``, default: this one).
Only the standard library is used here, so the client side never depends on vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import linked_checkpoint_copy
from modelopt_ext.torch.sparsity.attention_sparsity.cli.arguments import calibrated_lengths
from modelopt_ext.torch.sparsity.attention_sparsity.cli.local_server import (
    free_port,
    running_server,
    server_env,
    sparse_metrics,
    tile_counts,
)

log = logging.getLogger("demo")
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "vllm_serve"
# The long prompt: ~1.7k tokens of held-out prose (CPython's reference documentation, the split calibration never
# sees), the kind of text the law is calibrated for. A repeated synthetic list ("Item i is filed under drawer j.")
# realizes far more than its target (0.63 at 0.5, calibrated over its length): its attention is far more peaked.
LONG_PROMPT_CHARS = 7000  # 1672 SmolLM2 tokens
# The server's --max-model-len, and the longest calibration prompt: calibration covers every length served.
MAX_MODEL_LEN = 2048
CALIB_SAMPLES = 4  # one prompt per length bin: 2048, 1024, 512, 256 tokens


def calibrate(python: str, ckpt: Path, out_dir: Path, target: float) -> Path:
    """Run the calibration example on prompts up to the served length (vLLM's default multi-process engine, as a
    user runs it) and update `ckpt`'s config."""
    output = out_dir / "sparse_attention_config.json"
    cmd = [
        python, str(EXAMPLES / "calibrate_sparse_attn.py"), str(ckpt), "--target_sparse_ratio", str(target),
        "--calib_samples", str(CALIB_SAMPLES), "--calib_max_seqlen", str(MAX_MODEL_LEN),
        "--decode_tokens", "8", "--dtype", "float32", "--output", str(output), "--update_checkpoint_config",
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    log.info("calibrating: %s", " ".join(cmd))
    subprocess.run(cmd, env=env, check=True)
    return output


def long_prompt(chars: int = LONG_PROMPT_CHARS) -> str:
    """The first lines of the held-out prose (seed 0), at least `chars` characters."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.natural_text import line_stream

    out, n = [], 0
    for line in line_stream("prose", "heldout", 0):
        out.append(line)
        n += len(line) + 1
        if n >= chars:
            break
    return "\n".join(out)


def outside_note(tokens: int | None, lengths: dict[str, tuple[int, int]]) -> str:
    """'' when a prompt of `tokens` lies within the calibrated prefill lengths (or a tile, 64 tokens, or less:
    nothing to skip), else a note that its law is extrapolated in length."""
    if tokens is None or "prefill" not in lengths or tokens <= 64:
        return ""
    lo, hi = lengths["prefill"]
    if lo <= tokens <= hi:
        return ""
    return f"; outside the calibrated {lo}..{hi}: the law is extrapolated in length"


def http_json(url: str, payload: dict | None = None, timeout: float = 300.0) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else {}


def serve(python: str, model: Path, port: int, log_path: Path, extra_args: list[str], start_timeout: float):
    """The sparse-attention OpenAI server on the CPU engine, as a user serves it (no dev mode); yields its base URL and
    always stops it with its engine processes."""
    cmd = [
        python, str(EXAMPLES / "vllm_serve_sparse_attn.py"), str(model), "--served-model-name", model.name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
        *extra_args,
    ]  # fmt: skip
    env = server_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM would otherwise claim most of the RAM
    env.setdefault("HF_HUB_OFFLINE", "1")
    return running_server(cmd, log_path, env, f"http://127.0.0.1:{port}", start_timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="calibrate -> export -> serve -> request, on vLLM's CPU engine.")
    ap.add_argument("--model", type=Path, default=REPO / ".cache/models/SmolLM2-135M-Instruct")
    ap.add_argument("--python", default=sys.executable, help="interpreter with vllm-cpu (.venv-cpu)")
    ap.add_argument("--workdir", type=Path, default=REPO / "artifacts" / "demo",
                    help="where the calibrated checkpoint copy, the config, the plot and the logs go")
    ap.add_argument("--target", type=float, default=0.5, help="target sparsity for both phases")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("server_args", nargs="*", help="extra arguments for the vLLM server (after --)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    model = args.model.resolve()
    if not (model / "config.json").exists():
        log.error("no checkpoint at %s; run `make model` first", model)
        return 2
    print("== modelopt-ext demo: calibrate -> export -> serve -> request, SmolLM2-135M on vLLM's CPU engine ==",
          flush=True)
    t0 = time.monotonic()
    workdir = args.workdir.resolve()
    ckpt = linked_checkpoint_copy(model, workdir / model.name, overwrite=True)
    config_path = calibrate(args.python, ckpt, workdir, args.target)
    t_cal = time.monotonic() - t0
    block = json.loads((ckpt / "config.json").read_text())["sparse_attention_config"]
    scale = block["config_groups"]["group_0"]["threshold_scale_factor"]
    lengths = calibrated_lengths(block)
    print(f"calibrated in {t_cal:.0f} s -> {config_path} (plot: {config_path.with_suffix('.png')}, raw records: "
          f"{config_path.with_name(config_path.stem + '.records.npz')})")
    for phase in ("prefill", "decode"):
        span = f", calibrated on {lengths[phase][0]}..{lengths[phase][1]} tokens" if phase in lengths else ""
        print(f"  {phase:7s}: scale_factor = {scale[phase]['a']:.4g} * exp({scale[phase]['b']:.4g} * s){span}")

    port = args.port or free_port()
    with serve(args.python, ckpt, port, workdir / "server.log", args.server_args, args.start_timeout) as base:
        replies = []
        for prompt in (args.prompt, long_prompt()):
            payload = {"model": ckpt.name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.0}
            t1 = time.monotonic()
            reply = http_json(f"{base}/v1/completions", payload)
            tokens = (reply.get("usage") or {}).get("prompt_tokens")
            replies.append((prompt, reply["choices"][0]["text"], time.monotonic() - t1, tokens))
        metrics = sparse_metrics(base)
    for prompt, text, latency, tokens in replies:
        shown = prompt if len(prompt) < 60 else f"{prompt[:40]}... ({len(prompt)} chars)"
        print(f"prompt : {shown!r} ({tokens} tokens{outside_note(tokens, lengths)})\n"
              f"reply  : {text!r}  ({latency:.2f} s)")
    layers = {k: v for k, v in metrics.items() if k.startswith("modelopt_sparse_attn_layers{")}
    sparse = sum(v for k, v in layers.items() if 'served="sparse"' in k)
    print(f"sparse layers: {sparse:.0f}/{sum(layers.values()):.0f} (from {base}/metrics)")
    for phase, (visited, skipped) in tile_counts(metrics).items():
        sparsity = f"{skipped / visited:.3f}" if visited else "-"
        print(f"  {phase:7s}: realized sparsity {sparsity} ({skipped:.0f}/{visited:.0f} tiles skipped)")
    print(f"total demo {time.monotonic() - t0:.0f} s; server log: {workdir / 'server.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
