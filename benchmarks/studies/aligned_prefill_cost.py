#!/usr/bin/env python
"""What aligned prefill chunks cost: vLLM's CPU engine with and without the plugin's aligned scheduler, same requests.

The aligned scheduler (plugins/vllm/aligned_scheduler.py) cuts every prefill chunk that ends inside a prompt back to
a multiple of 64 positions and every prefix-cache hit back to a multiple of 64 tokens (contract version 4's block
decisions). Its cost is budget a step does not use and cache hits it gives up. This runs one engine per (scheduler,
budget): vLLM's `Scheduler` with only the plugin's per-step check and trace (`CheckedScheduler`: vLLM's scheduling as
it is) and `AlignedScheduler`, on the plain checkpoint (no `sparse_attention_config`: dense attention, so only the
scheduling differs), chunked prefill on, prefix caching on. Each engine serves `--repeats` rounds (prefix cache
reset before each): one request holding the shared prefix, then all `--lengths` prompts at once (the first
`--shared-count` start with that prefix). It reports per round the wall time, the throughput (prompt + generated
tokens / s), the time to first token of the batch's requests (vLLM's `first_token_latency`), and from the engine
core's trace (MODELOPT_EXT_SCHEDULER_TRACE) the engine steps, the tokens scheduled per step while prompts were being
prefilled, the tokens the alignment cut per step and the prefix-cache hits. Rounds of the two schedulers alternate.

    .venv-cpu/bin/python benchmarks/studies/aligned_prefill_cost.py --budgets 200,1000 --repeats 3 \\
        --out artifacts/scheduler_alignment

Timing on a shared 2-core machine is noisy: the table gives the fastest round (the least disturbed) and the median
of each engine, the CPU seconds of its processes (less disturbed by other work), their ratios, and per-round
medians of the step and token counts (which vary a little with when the engine core sees the batch's requests).
`--table-from results.json` prints the table of an earlier run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
MODULE = "modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.aligned_scheduler"
SCHEDULERS = {"vllm": f"{MODULE}.CheckedScheduler", "aligned": f"{MODULE}.AlignedScheduler"}


def prompts(lengths: list[int], shared: int, shared_count: int) -> tuple[list[int], list[list[int]]]:
    """(the shared prefix, the batch's prompts) as token ids, deterministic, distinct after the prefix."""
    prefix = [(7 * i) % 30000 + 100 for i in range(shared)]
    batch = []
    for k, n in enumerate(lengths):
        head = prefix if k < shared_count else []
        batch.append(head + [(13 * i + 101 * k) % 30000 + 100 for i in range(n - len(head))])
    return prefix + [(17 * i) % 30000 + 100 for i in range(8)], batch


def run_engine(args) -> dict:
    """One engine (this process), `args.repeats` rounds; the engine core traces its steps into `args.trace`."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(args.model), dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True, seed=0,
              block_size=args.page, max_num_batched_tokens=args.budget, enable_chunked_prefill=True,
              enable_prefix_caching=True, kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
              scheduler_cls=SCHEDULERS[args.scheduler], disable_log_stats=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    seed, batch = prompts(args.lengths, args.shared, args.shared_count)
    llm.generate([{"prompt_token_ids": batch[-1][:64]}], params, use_tqdm=False)  # warm-up
    rounds = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        marker = _trace_lines(args.trace)
        llm.generate([{"prompt_token_ids": seed}], params, use_tqdm=False)  # the shared prefix, cached
        start_lines = _trace_lines(args.trace)
        cpu0, t0 = _engine_cpu_s(), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, _engine_cpu_s() - cpu0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        ttft = [o.metrics.first_token_latency for o in outs if getattr(o, "metrics", None) is not None]
        rounds.append({"wall_s": wall, "cpu_s": cpu, "prompt_tokens": sum(len(p) for p in batch),
                       "generated_tokens": generated, "ttft_s": ttft, "seed_trace_lines": [marker, start_lines],
                       "batch_trace_lines": [start_lines, _trace_lines(args.trace)]})  # fmt: skip
    return {"rounds": rounds}


def _engine_cpu_s() -> float:
    """CPU seconds (user + system) this process and vLLM's engine-core and worker processes have used: less
    disturbed by other work on the machine than wall time."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _trace_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def step_stats(steps: list[dict]) -> dict:
    """From the trace lines of one batch: steps, tokens per step while prefilling, tokens cut, first-chunk hits."""
    prefill_steps = [s for s in steps if s["prefill_chunks"]]
    first = {}
    for s in steps:
        for req_id, start, _, _ in s["prefill_chunks"]:
            first.setdefault(req_id, start)
    return {
        "steps": len(steps),
        "prefill_steps": len(prefill_steps),
        "scheduled_per_prefill_step": statistics.fmean(s["scheduled"] for s in prefill_steps) if prefill_steps else 0,
        "trimmed_tokens": sum(s["trimmed"] for s in steps),
        "trimmed_per_prefill_step": (statistics.fmean(s["trimmed"] for s in prefill_steps) if prefill_steps else 0),
        "hit_tokens": sum(v for v in first.values() if v > 0),
        "off_grid_chunks": sum(1 for s in steps for _, st, n, p in s["prefill_chunks"]
                               if st % 64 or (st + n < p and (st + n) % 64)),
    }  # fmt: skip


def child(args) -> None:
    result = run_engine(args)
    lines = [json.loads(x) for x in args.trace.read_text().splitlines()] if args.trace.is_file() else []
    for r in result["rounds"]:
        a, b = r.pop("batch_trace_lines")
        r.pop("seed_trace_lines")
        r.update(step_stats(lines[a:b]))
    print("RESULT " + json.dumps(result), flush=True)


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return platform.processor() or "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path(os.environ.get("MODELOPT_EXT_SMOLLM2", DEFAULT_MODEL)))
    parser.add_argument("--budgets", default="200,1000", help="max_num_batched_tokens values (comma-separated)")
    parser.add_argument("--lengths", default="700,1100,450,900,1300,600,1000,800", help="prompt lengths of the batch")
    parser.add_argument("--shared", type=int, default=300, help="shared-prefix length (not a multiple of 64)")
    parser.add_argument("--shared-count", type=int, default=4, help="how many prompts of the batch start with it")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--page", type=int, default=32, help="KV-cache page (block_size): hits come in its multiples")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-mib", type=int, default=512)
    parser.add_argument("--out", type=Path, default=REPO / "artifacts" / "scheduler_alignment")
    parser.add_argument("--table-from", type=Path, help="print the table of an earlier results.json and exit")
    parser.add_argument("--scheduler", choices=sorted(SCHEDULERS), help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if args.scheduler:
        child(args)
        return
    if args.table_from:
        print(table(json.loads(args.table_from.read_text())))
        return

    args.out.mkdir(parents=True, exist_ok=True)
    results = {"cpu": cpu_model(), "cores": os.cpu_count(), "args": {k: str(v) for k, v in vars(args).items()},
               "runs": []}  # fmt: skip
    budgets = [int(b) for b in args.budgets.split(",")]
    for i, budget in enumerate(budgets):
        order = ["vllm", "aligned"] if i % 2 == 0 else ["aligned", "vllm"]
        for name in order:
            with tempfile.TemporaryDirectory() as tmp:
                trace = Path(tmp) / "trace.jsonl"
                cmd = [sys.executable, __file__, "--scheduler", name, "--budget", str(budget), "--trace", str(trace),
                       "--model", str(args.model), "--lengths", ",".join(map(str, args.lengths)), "--shared",
                       str(args.shared), "--shared-count", str(args.shared_count), "--max-tokens", str(args.max_tokens),
                       "--page", str(args.page), "--repeats", str(args.repeats), "--dtype", args.dtype,
                       "--max-model-len", str(args.max_model_len), "--kv-cache-mib", str(args.kv_cache_mib)]
                env = {**os.environ, "MODELOPT_EXT_SCHEDULER_TRACE": str(trace), "HF_HUB_OFFLINE": "1"}
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not lines:
                    sys.exit(f"{name} at budget {budget} failed:\n{proc.stderr[-4000:]}")
                run = json.loads(lines[-1][len("RESULT ") :])
                run.update(scheduler=name, budget=budget, engine_s=time.perf_counter() - t0)
                results["runs"].append(run)
                print(f"{name:8s} budget {budget:5d}: " + ", ".join(f"{r['wall_s']:.2f} s" for r in run["rounds"]),
                      flush=True)  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))


def _median(run, key):
    return statistics.median(r[key] for r in run["rounds"])


def _min(run, key):
    return min(r[key] for r in run["rounds"])


def table(results: dict) -> str:
    rows = [f"CPU: {results['cpu']} ({results['cores']} cores)",
            "| budget | scheduler | wall s (min / median) | CPU s (min / median) | tok/s (best) | TTFT mean s (median) "
            "| steps | tokens/prefill step | cut/prefill step | hit tokens | off-grid chunks |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {(r["budget"], r["scheduler"]): r for r in results["runs"]}
    for budget in sorted({r["budget"] for r in results["runs"]}):
        for name in ("vllm", "aligned"):
            run = by.get((budget, name))
            if run is None:
                continue
            r0 = run["rounds"][0]
            tok = (r0["prompt_tokens"] + r0["generated_tokens"]) / _min(run, "wall_s")
            rows.append(f"| {budget} | {name} | {_min(run, 'wall_s'):.2f} / {_median(run, 'wall_s'):.2f} | "
                        f"{_cpu(run, min)} / {_cpu(run, statistics.median)} | {tok:.0f} | "
                        f"{_ttft(run):.2f} | {_median(run, 'steps'):g} "
                        f"| {_median(run, 'scheduled_per_prefill_step'):.1f} | "
                        f"{_median(run, 'trimmed_per_prefill_step'):.1f} | {_median(run, 'hit_tokens'):g} | "
                        f"{max(r['off_grid_chunks'] for r in run['rounds'])} |")  # fmt: skip
        if (budget, "vllm") in by and (budget, "aligned") in by:
            base, al = by[(budget, "vllm")], by[(budget, "aligned")]
            rows.append(f"| {budget} | aligned / vllm | {_min(al, 'wall_s') / _min(base, 'wall_s'):.3f} / "
                        f"{_median(al, 'wall_s') / _median(base, 'wall_s'):.3f} | {_cpu_ratio(al, base)} | "
                        f"{_min(base, 'wall_s') / _min(al, 'wall_s'):.3f} | "
                        f"{_ttft(al) / _ttft(base):.3f} | | | | | |")  # fmt: skip
    return "\n".join(rows)


def _cpu(run, how) -> str:
    values = [r["cpu_s"] for r in run["rounds"] if "cpu_s" in r]
    return f"{how(values):.1f}" if values else "-"


def _cpu_ratio(al, base) -> str:
    a, b = ([r["cpu_s"] for r in x["rounds"] if "cpu_s" in r] for x in (al, base))
    if not a or not b:
        return "-"
    return f"{min(a) / min(b):.3f} / {statistics.median(a) / statistics.median(b):.3f}"


def _ttft(run) -> float:
    return statistics.median(statistics.fmean(r["ttft_s"]) for r in run["rounds"] if r["ttft_s"])


if __name__ == "__main__":
    main()
