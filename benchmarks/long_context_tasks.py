#!/usr/bin/env python3
"""Long-context task scores through vLLM's OpenAI server, dense and at calibrated targets (issue #56 item 1).

What it does, as a user would:

1. takes an HF checkpoint (`--model`); if its config.json has no `sparse_attention_config`, calibrates a linked
   copy of it (`<workdir>/<name>`) with `examples/vllm_serve/calibrate_sparse_attn.py <copy> <--calib-args>
   --update_checkpoint_config` (by default up to 4096-token prompts, `DEFAULT_CALIB_ARGS`) and serves that copy
   (a copy calibrated by an earlier run with the same arguments is reused);
2. starts ONE sparse server on it (`examples/vllm_serve/vllm_serve_sparse_attn.py`, 127.0.0.1, a free port, no
   development mode, `MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY=1` so `/metrics` is exact once a reply is back, prefix
   caching off so each mode computes every prompt token);
3. generates the prompts (`task_generation.py`: RULER-style tasks from a seed, filler from the package's held-out
   prose or code, lengths measured with the model's tokenizer through its chat template, the question at the end)
   and sends each once per mode to `/v1/chat/completions`, greedy (temperature 0, a few tokens), with
   `"vllm_xargs": {"sparse_attn_target": "dense" | t}`; reads the `modelopt_sparse_attn_tiles_*` counters of
   `/metrics` before and after every (mode, task, length) cell, so each cell has its realized prefill and decode
   sparsity;
4. stops the server (also on errors, Ctrl-C and SIGTERM), prints one table (task x length: dense score, each
   target's score beside it with the difference in points, n, realized sparsity) and writes the JSON (`--out`,
   atomically) with the machine, the model, the seeds, the arguments and every reply.

Scoring and seeds are `task_generation`'s: all-or-nothing exact match (every expected value present as a whole word,
case and whitespace normalized, no distractor value present); reported numbers use `REPORT_SEED` unless `--seed`
says otherwise, and `--tuning` draws the prompts anything may be tuned on (`TUNING_SEED`). A task whose dense score
is below 80 % at a length is flagged "below the 80 % dense bar: left out of the goal".

Run it with the interpreter of .venv-cpu (on a GPU machine: an environment with vLLM); the client side uses the
standard library and the model's tokenizer (transformers) only.

    .venv-cpu/bin/python benchmarks/long_context_tasks.py              # 2k, 4k, 8k; 20 prompts per cell
    .venv-cpu/bin/python benchmarks/long_context_tasks.py --quick      # 2k, 4k; 8 prompts per cell
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import json
import logging
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import task_generation as tg

from modelopt_ext.torch.sparsity.attention_sparsity.cli.local_server import (
    free_port,
    running_server,
    server_env,
    sparse_metrics,
    tile_counts,
    tiles_between,
)
from modelopt_ext.torch.sparsity.attention_sparsity.request_keys import PHASE_TARGET_KEYS, TARGET_KEY

log = logging.getLogger("long_context_tasks")
REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "vllm_serve"
DEFAULT_MODEL = REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
DEFAULT_WORKDIR = REPO / "artifacts" / "long_context_tasks"
# Calibration up to 4096-token prompts (about 3.5 minutes for SmolLM2 on 2 cores): the tasks are 2k-8k tokens long,
# and under contract version 4 a law fitted on 1k prompts serves prompts below ~3k tokens dense.
DEFAULT_CALIB_ARGS = "--target_sparse_ratio 0.5 --calib_samples 8 --calib_max_seqlen 4096"
DENSE_BAR = 0.80
BAR_NOTE = "below the 80 % dense bar: left out of the goal"
# max_tokens per request (the reply continues an answer prefix): a 7-digit number is 7 tokens with SmolLM2's
# tokenizer; five 5-letter names or four numbers fit in 32.
MAX_TOKENS_SINGLE, MAX_TOKENS_MULTI = 12, 32


# ------------------------------------------------------------------------------------------------ the checkpoint


def has_sparse_block(ckpt: Path) -> bool:
    return "sparse_attention_config" in json.loads((ckpt / "config.json").read_text())


def calibrated_checkpoint(
    model: Path, workdir: Path, calib_args: str, python: str, recalibrate: bool
) -> tuple[Path, dict]:
    """`model` itself when it carries a block, else a linked copy in `workdir` calibrated with the example script
    (reused when an earlier run calibrated it with the same arguments). Returns (checkpoint, what was done)."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import linked_checkpoint_copy

    if has_sparse_block(model):
        return model, {"calibrated": False, "note": "the checkpoint carries sparse_attention_config"}
    copy = workdir / model.name
    stamp = workdir / "calibration" / "calibrated_with.json"
    wanted = {"source": str(model), "calib_args": calib_args}
    if (not recalibrate and copy.is_dir() and has_sparse_block(copy) and stamp.is_file()
            and json.loads(stamp.read_text()) == wanted):  # fmt: skip
        log.info("reusing %s (calibrated earlier with the same arguments; --recalibrate to redo)", copy)
        return copy, {"calibrated": False, "reused": str(copy), **wanted}
    copy = linked_checkpoint_copy(model, copy, overwrite=True)
    out = workdir / "calibration"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [python, str(EXAMPLES / "calibrate_sparse_attn.py"), str(copy), *shlex.split(calib_args),
           "--output", str(out / "sparse_attention_config.json"), "--update_checkpoint_config"]  # fmt: skip
    log.info("calibrating (log: %s): %s", out / "calibrate.log", shlex.join(cmd))
    t0 = time.monotonic()
    with (out / "calibrate.log").open("wb") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_engine_env(), cwd=out)
    if proc.returncode != 0:
        raise RuntimeError(f"calibration failed (exit {proc.returncode}); see {out / 'calibrate.log'}")
    stamp.write_text(json.dumps(wanted))
    return copy, {"calibrated": True, "seconds": round(time.monotonic() - t0, 1), "command": shlex.join(cmd),
                  **wanted}  # fmt: skip


# ---------------------------------------------------------------------------------------------------- the server


def _engine_env() -> dict:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (the example scripts cap it too)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def http_json(url: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from e
    return json.loads(body) if body else {}


def sparse_server(python: str, ckpt: Path, name: str, port: int, max_model_len: int, log_path: Path,
                  extra_args: list[str], start_timeout: float):  # fmt: skip
    """The sparse OpenAI server on 127.0.0.1 (as the serve example starts it, as a user serves it: no dev mode),
    prefix caching off (every request computes its whole prompt); yields its base URL and always stops it."""
    cmd = [python, str(EXAMPLES / "vllm_serve_sparse_attn.py"), str(ckpt), "--served-model-name", name,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
           "--no-enable-prefix-caching", *extra_args]  # fmt: skip
    return running_server(cmd, log_path, server_env(_engine_env()), f"http://127.0.0.1:{port}", start_timeout)


def sparse_counters(base: str) -> dict[str, tuple[float, float]]:
    """{phase: (visited, skipped)} from the server's /metrics."""
    return tile_counts(sparse_metrics(base))


def _sigterm_to_interrupt() -> None:
    """SIGTERM ends the run like Ctrl-C: the server is stopped by the context manager's `finally`."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)


# --------------------------------------------------------------------------------------------------- the prompts


def chat_messages(text: str, prefix: str) -> list[dict]:
    """The user message and the start of the assistant's reply, which the server continues
    (`continue_final_message`)."""
    return [{"role": "user", "content": text}, {"role": "assistant", "content": prefix}]


def chat_length_fn(tokenizer):
    """Tokens of a prompt as the server sees it: the chat template with the assistant's reply started (or the bare
    text and the prefix with the tokenizer's special tokens when the model has no template)."""
    if getattr(tokenizer, "chat_template", None):

        def length(text: str, prefix: str) -> int:
            s = tokenizer.apply_chat_template(chat_messages(text, prefix), add_generation_prompt=False,
                                              continue_final_message=True, tokenize=False)  # fmt: skip
            return len(tokenizer(s, add_special_tokens=False).input_ids)

        return length
    return lambda text, prefix: len(tokenizer(f"{text}\n{prefix}").input_ids)


def max_tokens_for(task: str) -> int:
    return MAX_TOKENS_MULTI if task in tg.MULTI_ANSWER else MAX_TOKENS_SINGLE


def prompt_length(nominal: int, context: int) -> int:
    """A nominal length capped so that the prompt and the longest reply fit the model's context ("8k" on an 8192
    context: 8192 - 32 - 24 = 8136 tokens)."""
    return min(nominal, context - MAX_TOKENS_MULTI - 24)


# ------------------------------------------------------------------------------------------------------- the run


def parse_mode(text: str) -> str:
    """A served mode from `--targets`: `T` (both phases at target T) or `PHASE:T` (that phase at T, the other
    dense), T in (0, 1); normalized (`0.70` -> `0.7`). Raises ValueError with the accepted forms."""
    phase, _, value = text.strip().rpartition(":")
    try:
        target = float(value)
    except ValueError:
        target = math.nan
    if phase not in ("", *PHASE_TARGET_KEYS) or not 0 < target < 1:
        raise ValueError(f"{text!r}: give a target in (0, 1), or prefill:T / decode:T for one phase (the other dense)")
    return f"{phase}:{target:g}" if phase else f"{target:g}"


def mode_xargs(mode: str) -> dict:
    """The request's `vllm_xargs` for a mode (the plugin's per-request target keys, docs/serving.md)."""
    if mode == "dense" or ":" not in mode:
        return {TARGET_KEY: mode if mode == "dense" else float(mode)}
    phase, value = mode.split(":")
    return {key: float(value) if p == phase else "dense" for p, key in PHASE_TARGET_KEYS.items()}


def ask(base: str, name: str, p: tg.TaskPrompt, mode: str, timeout: float, use_chat: bool) -> dict:
    payload = {"model": name, "max_tokens": max_tokens_for(p.task), "temperature": 0.0,
               "vllm_xargs": mode_xargs(mode)}  # fmt: skip
    t0 = time.monotonic()
    if use_chat:
        payload.update(messages=chat_messages(p.text, p.answer_prefix), add_generation_prompt=False,
                       continue_final_message=True)  # fmt: skip
        reply = http_json(f"{base}/v1/chat/completions", payload, timeout)
        text = reply["choices"][0]["message"]["content"] or ""
    else:
        reply = http_json(f"{base}/v1/completions", {**payload, "prompt": f"{p.text}\n{p.answer_prefix}"}, timeout)
        text = reply["choices"][0]["text"]
    return {
        "index": p.index,
        "reply": text,
        "score": tg.score(text, p.answers, p.distractors),
        "items": tg.item_fraction(text, p.answers, p.distractors),
        "prompt_tokens": reply.get("usage", {}).get("prompt_tokens"),
        "expected_tokens": p.tokens,
        "seconds": round(time.monotonic() - t0, 2),
    }


def run_cells(base: str, name: str, prompts: dict, modes: list[str], args) -> dict:
    """{mode: {task: {length: cell}}}: every cell's replies, score and realized sparsity (counters read around
    it)."""
    results: dict = {}
    total = len(modes) * sum(len(v) for v in prompts.values())
    done, t_start = 0, time.monotonic()
    for mode in modes:
        results[mode] = {}
        for (task, length), cell_prompts in prompts.items():
            before = sparse_counters(base)
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                rows = list(pool.map(lambda p, m=mode: ask(base, name, p, m, args.request_timeout, args.chat),
                                     cell_prompts))  # fmt: skip
            realized = tiles_between(before, sparse_counters(base))
            done += len(rows)
            n = len(rows)
            cell = {"n": n, "score": sum(r["score"] for r in rows) / n, "items": sum(r["items"] for r in rows) / n,
                    "seconds": round(time.monotonic() - t0, 1), "realized": realized, "replies": rows}  # fmt: skip
            results[mode].setdefault(task, {})[str(length)] = cell
            elapsed = time.monotonic() - t_start
            log.info("%-6s %-18s %5d: score %.2f, realized prefill %s decode %s (%.0f s; %d/%d requests, %.0f s)",
                     mode, task, length, cell["score"], _fmt_sp(realized["prefill"]["sparsity"]),
                     _fmt_sp(realized["decode"]["sparsity"]), cell["seconds"], done, total, elapsed)  # fmt: skip
    return results


# ------------------------------------------------------------------------------------------------ the reporting


def _fmt_sp(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def summarize(results: dict, modes: list[str], cells: list[tuple[str, int]]) -> list[dict]:
    rows = []
    for task, length in cells:
        dense = results["dense"][task][str(length)]
        row = {"task": task, "length": length, "n": dense["n"], "dense": dense["score"],
               "below_dense_bar": dense["score"] < DENSE_BAR, "targets": {}}  # fmt: skip
        for mode in modes[1:]:
            c = results[mode][task][str(length)]
            row["targets"][mode] = {"score": c["score"], "delta_points": 100 * (c["score"] - dense["score"]),
                                    "prefill": c["realized"]["prefill"]["sparsity"],
                                    "decode": c["realized"]["decode"]["sparsity"]}  # fmt: skip
        rows.append(row)
    return rows


def mode_totals(results: dict) -> dict:
    out = {}
    for mode, tasks in results.items():
        sums = {"prefill": [0.0, 0.0], "decode": [0.0, 0.0]}
        for cells in tasks.values():
            for c in cells.values():
                for phase in sums:
                    sums[phase][0] += c["realized"][phase]["visited"]
                    sums[phase][1] += c["realized"][phase]["skipped"]
        out[mode] = {ph: (s / v if v else None) for ph, (v, s) in sums.items()}
    return out


def table(rows: list[dict], modes: list[str]) -> str:
    targets = modes[1:]
    head = ["task", "length", "n", "dense"] + [f"target {t}: score (dense, Δ pts)" for t in targets]
    head += [f"realized {t} prefill / decode" for t in targets] + ["note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["task"], str(r["length"]), str(r["n"]), f"{100 * r['dense']:.0f} %"]
        for t in targets:
            c = r["targets"][t]
            cells.append(f"{100 * c['score']:.0f} % ({100 * r['dense']:.0f} %, {c['delta_points']:+.0f})")
        for t in targets:
            c = r["targets"][t]
            cells.append(f"{_fmt_sp(c['prefill'])} / {_fmt_sp(c['decode'])}")
        cells.append(BAR_NOTE if r["below_dense_bar"] else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("Model name", "Architecture", "CPU(s)", "Thread(s) per core"):
                info[key.strip()] = value.strip()
            if key.strip() == "Flags":
                flags = value.split()
                info["isa_flags"] = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception:  # noqa: BLE001 - the version is informative only
        info["vllm"] = None
    return info


def write_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1, default=str)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 is not what a results file should be
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="HF checkpoint (calibrated or not)")
    ap.add_argument("--python", default=sys.executable, help="interpreter with vLLM for the scripts (default: this)")
    ap.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="calibrated copy, logs")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default <workdir>/results.json)")
    ap.add_argument("--calib-args", default=DEFAULT_CALIB_ARGS, help="calibration arguments (default: %(default)s)")
    ap.add_argument("--recalibrate", action="store_true", help="calibrate even when an earlier copy fits")
    ap.add_argument("--tasks", default=",".join(tg.DEFAULT_TASKS), help=f"of {', '.join(tg.TASKS)}")
    ap.add_argument("--lengths", default=None, help="nominal prompt lengths (default 2048,4096,8192; quick 2048,4096)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per task and length (default 20; quick 8)")
    ap.add_argument("--targets", default="0.5,0.7",
                    help="sparse modes served beside dense: T (both phases) or prefill:T / decode:T (that phase "
                         "only, to tell which phase costs a task; default %(default)s)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=None, help=f"prompt seed (default: the reporting seed "
                    f"{tg.REPORT_SEED}; tuning seed {tg.TUNING_SEED})")  # fmt: skip
    ap.add_argument("--tuning", action="store_true", help=f"the tuning prompts (seed {tg.TUNING_SEED})")
    ap.add_argument("--filler", choices=tg.FILLERS, default="prose", help="held-out filler text (default prose)")
    ap.add_argument("--quick", action="store_true", help="8 prompts per cell, 2k and 4k")
    ap.add_argument("--completions", action="store_true",
                    help="send /v1/completions with the raw text instead of chat (no chat template)")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight per cell (default 1)")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("server_args", nargs="*", help="more vLLM server arguments (after --), e.g. --dtype float32")
    args = ap.parse_args(argv)
    if args.seed is not None and args.tuning:
        ap.error("--seed and --tuning: give one")
    args.seed = tg.TUNING_SEED if args.tuning else (tg.REPORT_SEED if args.seed is None else args.seed)
    args.lengths = [int(x) for x in (args.lengths or ("2048,4096" if args.quick else "2048,4096,8192")).split(",")]
    args.prompts = args.prompts or (8 if args.quick else 20)
    args.tasks = [t for t in args.tasks.split(",") if t]
    for t in args.tasks:
        if t not in tg.TASKS:
            ap.error(f"--tasks: unknown task {t!r}; known: {', '.join(tg.TASKS)}")
    args.chat = not args.completions
    try:
        args.targets = [parse_mode(x) for x in args.targets.split(",") if x.strip()]
    except ValueError as e:
        ap.error(f"--targets: {e}")
    if args.prompts < 1 or args.concurrency < 1:
        ap.error("--prompts and --concurrency must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    _sigterm_to_interrupt()
    model = args.model.resolve()
    if not (model / "config.json").is_file():
        log.error("no HF checkpoint at %s (`make model` builds the default)", model)
        return 2
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    out_path = (args.out or workdir / "results.json").resolve()
    t_start = time.monotonic()

    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    context = int(getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", 8192))
    length_fn = chat_length_fn(tokenizer) if args.chat else (lambda t, a: len(tokenizer(f"{t}\n{a}").input_ids))
    units = tg.filler_units(args.filler)
    prompts: dict = {}
    for task in args.tasks:
        for nominal in args.lengths:
            prompts[(task, nominal)] = tg.generate_cell(task, prompt_length(nominal, context), args.prompts,
                                                        args.seed, length_fn, units)  # fmt: skip
    log.info("generated %d prompts in %.0f s", sum(len(v) for v in prompts.values()), time.monotonic() - t_start)

    ckpt, calibration = calibrated_checkpoint(model, workdir, args.calib_args, args.python, args.recalibrate)
    modes = ["dense"] + args.targets
    name = model.name
    t_serve = time.monotonic()
    with sparse_server(args.python, ckpt, name, args.port or free_port(), context, workdir / "server.log",
                       args.server_args, args.start_timeout) as base:  # fmt: skip
        results = run_cells(base, name, prompts, modes, args)
    cells = list(prompts)
    rows = summarize(results, modes, cells)
    mismatched = sum(1 for m in results.values() for t in m.values() for c in t.values() for r in c["replies"]
                     if r["prompt_tokens"] is not None and r["prompt_tokens"] != r["expected_tokens"])  # fmt: skip
    data = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(argv),
        "machine": machine(),
        "model": str(model), "checkpoint": str(ckpt), "calibration": calibration,
        "sparse_attention_config": json.loads((ckpt / "config.json").read_text())["sparse_attention_config"],
        "seeds": {"used": args.seed, "reporting_default": tg.REPORT_SEED, "tuning": tg.TUNING_SEED},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "scoring": "all-or-nothing: every expected value present as a whole word (case and whitespace normalized) "
                   "and no distractor value; `items` is the per-item fraction",
        "dense_bar": DENSE_BAR,
        "prompt_lengths": {f"{t}@{n}": [p.tokens for p in ps] for (t, n), ps in prompts.items()},
        "prompt_token_mismatches": mismatched,
        "max_tokens": {t: max_tokens_for(t) for t in args.tasks},
        "realized_per_mode": mode_totals(results),
        "rows": rows,
        "cells": results,
        "seconds": {"total": round(time.monotonic() - t_start, 1), "serving": round(time.monotonic() - t_serve, 1)},
    }  # fmt: skip
    write_atomic(out_path, data)
    print(
        f"\nlong-context tasks, {name}, seed {args.seed}, {args.prompts} prompts per cell, filler {args.filler} "
        f"(held-out), {len(cells) * len(modes) * args.prompts} requests in {data['seconds']['total']:.0f} s"
    )
    print(table(rows, modes))
    for mode, sp in data["realized_per_mode"].items():
        print(f"realized sparsity, {mode}: prefill {_fmt_sp(sp['prefill'])}, decode {_fmt_sp(sp['decode'])}")
    if mismatched:
        print(f"warning: {mismatched} replies report another prompt length than the tokenizer measured")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
