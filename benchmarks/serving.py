#!/usr/bin/env python
"""Serving benchmark: a calibrated checkpoint served dense and sparse, measured with vLLM's own `vllm bench serve`.

    .venv-cpu/bin/python benchmarks/serving.py --checkpoint CKPT [--lengths 2k,4k,8k] [--concurrency 1,4,16] \
        [--num-prompts 16] [--output-len 128] [--targets calibrated,0.7] [--dtype bfloat16] [--out-dir DIR]
    .venv-cpu/bin/python benchmarks/serving.py --checkpoint CKPT --quick      # a tiny smoke run (~2-3 min, 2 cores)

CKPT must carry `sparse_attention_config` (README: `calibrate_sparse_attn.py ... --update_checkpoint_config`). Both
servers serve that same directory, both up at once, with vLLM's defaults (prefix caching, chunked prefill,
compiled mode) and the same KV cache size:

- dense: vLLM's own API server with `MODELOPT_EXT_SPARSE_ATTN=0` (the plugin's documented dense switch: vLLM's
  native attention and scheduler);
- sparse: `examples/vllm_serve/vllm_serve_sparse_attn.py` at the checkpoint's calibrated target; further targets
  (`--targets 0.7`) are the same server with the per-request key `vllm_xargs.sparse_attn_target`
  (docs/serving.md), sent by `vllm bench serve --extra-body`.

Prompt sets (written as vLLM's custom dataset JSONL): held-out prose and code cut to each length (less the output
and a tag line where the model's context is the limit), and a mixed set: the lengths in turn, each prompt opening
with one of two shared 1k-token system prompts, so prefix caching matters. Every (set, concurrency) cell runs on
both servers one after the other (the order alternates from cell to cell, so drift hits both alike) on one prompt
file whose tag line keeps it from hitting blocks an earlier cell cached.

Writes to --out-dir: serving.json (per run every field of vLLM's result file, the realized sparsity of sparse runs
from /metrics, the machine, vLLM's version, the server and bench commands, every non-default setting),
serving.png (TTFT, TPOT and output throughput against concurrency, dense beside sparse), table.md, and the logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from modelopt_ext.torch.sparsity.attention_sparsity.cli import serving_bench as sb  # noqa: E402
from modelopt_ext.torch.sparsity.attention_sparsity.cli.local_server import (  # noqa: E402
    free_port,
    running_server,
    server_env,
    sparse_metrics,
    tile_counts,
    tiles_between,
)
from modelopt_ext.torch.sparsity.attention_sparsity.request_keys import TARGET_KEY  # noqa: E402

log = logging.getLogger("serving")
SERVE = REPO / "examples" / "vllm_serve" / "vllm_serve_sparse_attn.py"
MODEL_NAME = "bench-model"
QUICK = {"lengths": "512", "concurrency": "1,2", "num_prompts": 2, "output_len": 8, "system_tokens": 64}


def parse_lengths(text: str) -> list[int]:
    """'2k,4k,8k' or '2048,4096' -> token counts."""
    out = []
    for item in filter(None, (t.strip().lower() for t in text.split(","))):
        out.append(int(float(item[:-1]) * 1024) if item.endswith("k") else int(item))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, type=Path, help="checkpoint with a sparse_attention_config")
    ap.add_argument("--lengths", default=None, help="prompt lengths in tokens (default 2k,4k,8k; quick: 512)")
    ap.add_argument("--no-mixed", action="store_true", help="leave out the mixed-length set")
    ap.add_argument("--concurrency", default=None, help="--max-concurrency sweep (default 1,4,16; quick: 1,2)")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per run (default 16; quick: 2)")
    ap.add_argument("--output-len", type=int, default=None, help="tokens generated per request (default 128)")
    ap.add_argument("--targets", default="calibrated",
                    help="sparse targets: 'calibrated' (the checkpoint's, no request keys) and/or numbers, served "
                         "as per-request targets on the same sparse server (default: calibrated)")  # fmt: skip
    ap.add_argument("--dtype", default=None, help="--dtype of both servers (default: vLLM's)")
    ap.add_argument("--kv-cache-gib", type=int, default=None,
                    help="VLLM_CPU_KVCACHE_SPACE of both servers (default: enough for the largest run)")
    ap.add_argument("--server-arg", action="append", default=[], help="one more argument for both servers")
    ap.add_argument("--no-warmup", action="store_true", help="skip the two short warm-up requests per server")
    ap.add_argument("--out-dir", type=Path, default=REPO / "artifacts" / "serving")
    ap.add_argument("--quick", action="store_true", help=f"a tiny smoke config: {QUICK}")
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--bench-timeout", type=float, default=7200.0)
    args = ap.parse_args(argv)
    base = QUICK if args.quick else {"lengths": "2k,4k,8k", "concurrency": "1,4,16", "num_prompts": 16,
                                     "output_len": 128, "system_tokens": 1024}  # fmt: skip
    args.lengths = parse_lengths(args.lengths or base["lengths"])
    args.concurrency = [int(c) for c in (args.concurrency or base["concurrency"]).split(",") if c.strip()]
    args.num_prompts = args.num_prompts or base["num_prompts"]
    args.output_len = args.output_len or base["output_len"]
    args.system_tokens = base["system_tokens"]
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    return args


def checkpoint_target(ckpt: Path) -> float:
    """The checkpoint's calibrated prefill target; exits naming the calibrate command when it has no block."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import load_sparse_attention_config

    settings = load_sparse_attention_config(ckpt)
    if settings is None or settings.phase("prefill") is None:
        raise SystemExit(f"error: {ckpt} carries no sparse_attention_config with a prefill phase; calibrate it "
                         "first: python examples/vllm_serve/calibrate_sparse_attn.py CKPT --target_sparse_ratio 0.5 "
                         "--update_checkpoint_config")  # fmt: skip
    return float(settings.phase("prefill").target_sparsity)


def sparse_variants(targets: list[str], calibrated: float) -> list[tuple[float, dict | None]]:
    """(target, extra request body) per sparse row: the calibrated target without keys, others by vllm_xargs."""
    out = []
    for t in targets:
        value = calibrated if t == "calibrated" else float(t)
        body = None if math.isclose(value, calibrated) else {"vllm_xargs": {TARGET_KEY: value}}
        if all(not math.isclose(value, v) for v, _ in out):
            out.append((value, body))
    return out


def build_sets(args, tokenizer, context: int) -> tuple[dict[str, tuple[list, dict]], list]:
    """{set name: (prompts, record)}: one set per length and the mixed set; and two short warm-up prompts."""
    text = sb.HeldOutText(tokenizer)
    warmup = [text.window("prose", 256) for _ in range(2)]
    budgets = {length: sb.prompt_budget(length, context, args.output_len) for length in args.lengths}
    sets = {}
    for length, budget in budgets.items():
        sets[f"{length}"] = sb.fixed_length_prompts(text, budget, args.num_prompts)
    if not args.no_mixed:
        sets[sb.MIXED] = sb.mixed_prompts(text, list(budgets.values()), args.num_prompts,
                                          system_tokens=args.system_tokens)  # fmt: skip
    return {name: (prompts, sb.dataset_record(prompts)) for name, prompts in sets.items()}, warmup


def server_setup(args, ckpt: Path, hf_config: dict, context: int) -> tuple[dict, dict, list[str]]:
    """(per kind: command, environment, base URL), the settings both servers share, and their extra arguments."""
    extra = [*(["--dtype", args.dtype] if args.dtype else []), *args.server_arg]
    dtype_bytes = 4 if args.dtype in ("float32", "float") else 2
    tokens = max(args.concurrency) * context
    gib = args.kv_cache_gib or sb.kv_cache_gib(hf_config, dtype_bytes, tokens)
    fixed = {"VLLM_CPU_KVCACHE_SPACE": str(gib), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    servers = {}
    for kind in ("dense", "sparse"):
        port = free_port()
        env = sb.server_environment(kind, server_env(), fixed)
        cmd = sb.server_command(kind, ckpt, port, MODEL_NAME, extra, SERVE)
        servers[kind] = {"cmd": cmd, "env": env, "base_url": f"http://127.0.0.1:{port}"}
    return servers, fixed, extra


def non_defaults(servers: dict, fixed: dict, extra: list[str]) -> dict:
    """Every setting that is not what vLLM or the plugin ships, and why, for the results file."""
    inherited = {k: v for k, v in servers["sparse"]["env"].items()
                 if k.startswith(("VLLM_", "OMP_", "MODELOPT_EXT_", "KMP_")) and k not in fixed}  # fmt: skip
    return {
        "server_env_both": {**fixed, "why": "same KV cache on both servers, sized for the largest run"},
        "server_env_dense": {"MODELOPT_EXT_SPARSE_ATTN": "0", "why": "the plugin's dense switch"},
        "server_env_inherited": inherited,
        "why_log_every": "MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY=1 (local servers' setting, plugin default 256): the "
                         "workers write their tile totals after every step, so /metrics is exact after each run",
        "server_args_both": extra,
        "bench_args": {"--ignore-eos": "every request generates --output-len tokens",
                       "--max-concurrency": "the sweep", "--disable-shuffle": "prompts in file order",
                       "--ready-check-timeout-sec 0": "no initial test request (it would cache the first prompt)",
                       "--skip-chat-template": "the prompts are raw completions text",
                       "--custom-output-len": "the output length"},
    }  # fmt: skip


def run_cell(args, servers, ckpt, variants, set_name, concurrency, dataset, order, out,
             num_prompts: int | None = None) -> list[dict]:  # fmt: skip
    """One (set, concurrency) cell on every server row (reversed when `order` is odd); returns its records."""
    num_prompts = num_prompts or args.num_prompts
    rows = [("dense", None, None)] + [("sparse", t, body) for t, body in variants]
    if order % 2:
        rows = rows[::-1]
    records = []
    for kind, target, body in rows:
        label = kind if target is None else f"sparse{target:g}"
        run = sb.BenchRun(server=kind, label=label, base_url=servers[kind]["base_url"], model=MODEL_NAME,
                          tokenizer=str(ckpt), dataset=dataset, num_prompts=num_prompts,
                          concurrency=concurrency, output_len=args.output_len, result_dir=out / "runs",
                          result_file=f"{set_name}_c{concurrency}_{label}.json", extra_body=body)  # fmt: skip
        log.info("[%s c=%d] %s: %d prompts ...", set_name, concurrency, label, num_prompts)
        records.append(_one_run(run, args, out, {"set": set_name, "concurrency": concurrency, "server": kind,
                                                 "target": target}))  # fmt: skip
    return records


def _one_run(run: sb.BenchRun, args, out: Path, record: dict) -> dict:
    """One bench run and its record; a failed run is recorded with its error and the sweep goes on."""
    before = tile_counts(sparse_metrics(run.base_url)) if run.server == "sparse" else None
    t0 = time.monotonic()
    record.update(bench=sb.as_dict(run), command=sb.bench_command(run), result={})
    try:
        record["result"] = sb.run_bench(run, out / "logs" / f"bench_{run.result_file}.log", _bench_env(),
                                        args.bench_timeout)  # fmt: skip
    except (RuntimeError, OSError, ValueError) as exc:
        record["error"] = str(exc)
        log.error("[%s c=%d] %s failed: %s", record["set"], run.concurrency, run.label, exc)
        return record
    record["seconds"] = round(time.monotonic() - t0, 1)
    if before is not None:
        record["realized"] = tiles_between(before, tile_counts(sparse_metrics(run.base_url)))
    r = sb.summary_row(record)
    log.info("[%s c=%d] %s: TTFT %.0f ms, TPOT %.1f ms, %.2f output tok/s (%d/%d ok, %.0f s)%s", record["set"],
             run.concurrency, run.label, r["mean_ttft_ms"] or 0, r["mean_tpot_ms"] or 0, r["output_throughput"] or 0,
             r["completed"] or 0, run.num_prompts, record["seconds"], _sparsity_note(record))  # fmt: skip
    return record


def _bench_env() -> dict[str, str]:
    """The bench client's environment: this checkout first on the path (the launcher module is in it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _sparsity_note(record: dict) -> str:
    phases = record.get("realized") or {}
    parts = [f"{ph} {v['sparsity']:.2f}" for ph, v in phases.items() if v["sparsity"] is not None]
    return f", realized {', '.join(parts)}" if parts else ""


def _series_key(row: dict) -> str:
    return row["server"] if row["target"] is None else f"sparse @ {row['target']:g}"


def plot(rows: list[dict], path: Path, title: str) -> None:
    """TTFT, TPOT and output throughput against concurrency, one row of panels per set, dense beside sparse (one
    color per server row in every panel, whatever order the runs had)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["set"] for r in rows))
    targets = sorted({r["target"] for r in rows if r["target"] is not None})
    colors = {"dense": "tab:gray", **{f"sparse @ {t:g}": f"C{i}" for i, t in enumerate(targets)}}
    metrics = (("mean_ttft_ms", "TTFT mean (ms)"), ("mean_tpot_ms", "TPOT mean (ms)"),
               ("output_throughput", "output throughput (tok/s)"))  # fmt: skip
    fig, axes = plt.subplots(len(sets), 3, figsize=(13, 3.2 * len(sets)), squeeze=False)
    for i, name in enumerate(sets):
        for j, (field, label) in enumerate(metrics):
            ax = axes[i][j]
            for key, color in colors.items():
                rs = sorted((r for r in rows if r["set"] == name and _series_key(r) == key),
                            key=lambda r: r["concurrency"])  # fmt: skip
                if rs:
                    ax.plot([r["concurrency"] for r in rs], [r[field] for r in rs], marker="o", label=key,
                            color=color)  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max concurrency")
            ax.set_title(f"set {name}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(out: Path, data: dict) -> list[dict]:
    """serving.json (atomically: an interrupted run keeps what it measured) and the summary rows."""
    rows = [sb.summary_row(r) for r in data["runs"]]
    data["summary"] = {"rows": rows, "ratios": sb.ratios(rows)}
    tmp = out / "serving.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    tmp.replace(out / "serving.json")
    return rows


def _sigterm_to_interrupt() -> None:
    """SIGTERM ends the run like Ctrl-C, so the servers are stopped on the way out."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    if missing := sb.missing_bench_modules():
        raise SystemExit(f"error: vllm bench serve needs {', '.join(missing)} (vLLM's bench extra) to read its "
                         f"custom dataset; install it: {sys.executable} -m pip install {' '.join(missing)}")
    _sigterm_to_interrupt()
    from transformers import AutoTokenizer

    from modelopt_ext.torch.sparsity.attention_sparsity.cli.engine_setup import model_context_length

    ckpt, out = args.checkpoint.resolve(), args.out_dir.resolve()
    for sub in ("datasets", "runs", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    variants = sparse_variants(args.targets, checkpoint_target(ckpt))
    hf_config = json.loads((ckpt / "config.json").read_text())
    context = (model_context_length(hf_config) or (8192, ""))[0]
    sets, warmup = build_sets(args, AutoTokenizer.from_pretrained(str(ckpt)), context)
    servers, fixed, extra = server_setup(args, ckpt, hf_config, context)
    data = {"checkpoint": str(ckpt), "command": [sys.executable, *sys.argv], "args": vars(args),
            "machine": sb.machine_info(), "servers": {k: {"cmd": v["cmd"]} for k, v in servers.items()},
            "non_defaults": non_defaults(servers, fixed, extra), "sets": {n: r for n, (_, r) in sets.items()},
            "runs": [], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}  # fmt: skip
    log.info("%d sets x %d concurrencies x %d servers rows; out %s", len(sets), len(args.concurrency),
             1 + len(variants), out)  # fmt: skip
    with ExitStack() as stack:
        for kind, s in servers.items():
            log.info("starting the %s server", kind)
            stack.enter_context(running_server(s["cmd"], out / "logs" / f"server_{kind}.log", s["env"],
                                               s["base_url"], args.start_timeout))  # fmt: skip
        if not args.no_warmup:
            warm = sb.write_dataset(out / "datasets" / "warmup.jsonl", warmup, "[warm-up]\n")
            data["warmup"] = run_cell(args, servers, ckpt, variants[:1], "warmup", 2, warm, 0, out, len(warmup))
        cell = 0
        for name, (prompts, _) in sets.items():
            for c in args.concurrency:
                dataset = sb.write_dataset(out / "datasets" / f"{name}_c{c}.jsonl", prompts, sb.run_tag(name, c))
                data["runs"] += run_cell(args, servers, ckpt, variants, name, c, dataset, cell, out)
                cell += 1
                write_results(out, data)
    rows = write_results(out, data)
    table = sb.markdown_table(rows)
    (out / "table.md").write_text(table + "\n")
    title = f"{ckpt.name}, {data['machine']['cpu_model']}, vLLM {data['machine']['vllm']}, output {args.output_len}"
    plot(rows, out / "serving.png", title)
    print(table)
    log.info("wrote %s, %s, %s", out / "serving.json", out / "serving.png", out / "table.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
