#!/usr/bin/env python
"""One prepared GPU check: the `gpu`-marked tests, then the kernel benchmark, then one summary table.

Run from the repository root on the GPU machine (nothing is installed from the network):

    python scripts/gpu_check.py --wheels .whl            # logs into $OUT (or gpu_logs/<time>)
    python scripts/gpu_check.py --dry-run                # CPU rehearsal: collect the gpu tests, CPU bench
                                                         # (no --budget: each phase 600 s, speed is not checked)

Phases, each with its own timeout so the whole run stays under --budget seconds (default 540, i.e. 9 min: with the
machine's start it leaves about 5 of a session's 15 device minutes for a second, shorter run);
a phase that times out is killed and the next one still runs, and every phase writes its log as it goes:

1. environment  -> env.txt (python, torch, CUDA, GPU, triton, nvidia-smi)
2. wheels       -> pure-Python wheels in --wheels that are not installed already (pytest, pluggy, ...) are
                   unzipped into a temporary folder put on PYTHONPATH (or `pip install --no-index --target`
                   with --pip-install). The nvidia-modelopt wheel is handed to the benchmark, which loads it.
3. gpu tests    -> pytest.log, pytest.xml (`pytest -m gpu` over the test modules that hold `gpu` tests only, so
                   the rest of the suite's dependencies — pydantic, ModelOpt, vLLM — need not exist there)
4. graphs       -> graphs.log, graphs/graphs.json|txt (benchmarks/bench_decode_graphs.py: the CUDA-graph self-test
                   the vLLM plugin runs at engine start, on the Triton kernel without vLLM, and decode latency eager
                   vs graph replay at batch 1/8/64 with 8k-token contexts; issue #26)
5. tune         -> tune.log, tune/tune.json|txt (benchmarks/studies/tune_triton.py: the kernels' launch
                   configurations and skip modes against the default in one run, through the launch path the vLLM
                   plugin uses);
                   tune_d64.log, tune_d64/: the same for D = 64 prefill (its default has not run on a GPU yet)
6. benchmark    -> bench.log, bench/results.json|csv, bench/summary.csv, bench/table.txt (on the captured real
                   attention in .cache/attention_inputs/, which must be carried along: checked before anything runs);
                   after each decode shape's bf16 rows, its FP8 (e4m3) cache rows: ours dense and at 0.5 / 0.7 (the
                   bf16 λ), and FlashInfer's dense FP8 decode where it is importable with prebuilt kernels
                   (bench_kernels.py --kv-cache-dtype / --fp8-phases / --fp8-baseline; issues #66, #68)
7. summary      -> summary.txt, summary.json (printed last)

First run on an H200: 2026-12-04 (docs/benchmarks.md, "The Triton kernels on an H200"). What a GPU must confirm
(changes made without one; read the table with these in mind):

- 2026-12-04, second H200 session: the default prefill launch is now 128 rows x 8 warps x 2 stages with
  `prefill_split_causal` and the `exp` skip mode (16k: 7.0 ms dense, 7.6 at s=0.7). Open: sparse prefill is not
  faster than our dense; the tune table shows whether a launch or skip mode changes that ("counts equal" must hold),
  first of all `prefetch` (V loaded a tile ahead, exp and P·V skipped by a branch; not measured yet).
- FP8 KV caches (issues #66, #68): the Triton kernels read e4m3 / e5m2 caches (the tile converted after its load), never
  timed on a GPU yet. The FP8 rows must check "ok" against SDPA on the FP8 values; what to read: x auto (our e4m3
  decode against our bf16 decode at the same case; half the bytes, so up to 2x where decode is read-bound) and x FP8b
  (against FlashInfer's dense FP8 decode, where its wheel travels with its prebuilt kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata as md
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `tune_triton.py --configs` for D = 64 prefill: the default (64 rows, 4 warps, branch) first, then what won at D = 128
D64_CONFIGS = (";prefill_split_causal=True,prefill_skip=exp;prefill_split_causal=True,prefill_skip=prefetch"
               ";prefill_block_q=128,prefill_warps=8,prefill_split_causal=True,prefill_skip=exp"
               ";prefill_block_q=128,prefill_warps=4,prefill_split_causal=True,prefill_skip=exp")
# --dry-run: every phase's timeout and the benchmarks' own time budgets. A CPU rehearsal checks the script's wiring
# (commands, logs, the summary), not speed, so --budget does not apply and a loaded 2-core machine passes it too.
DRY_RUN_PHASE_TIMEOUT = 600.0
BENCH = REPO / "benchmarks" / "bench_kernels.py"
GRAPHS = REPO / "benchmarks" / "bench_decode_graphs.py"
TUNE = REPO / "benchmarks" / "studies" / "tune_triton.py"
CAPTURES = REPO / ".cache" / "attention_inputs"  # benchmarks/attention_inputs.py capture: the benchmark's inputs


class Runner:
    def __init__(self, out: Path, budget: float, dry_run: bool = False):
        self.out = out
        self.t0 = time.monotonic()
        self.budget = budget
        self.dry_run = dry_run
        self.log_fh = open(out / "gpu_check.log", "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in main
        self.phases: dict[str, dict] = {}

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def phase_timeout(self, cap: float, reserve: float) -> float:
        """A phase's timeout: at most `cap`, and what the budget leaves after `reserve` seconds for the phases still
        to come; with --dry-run (no budget) DRY_RUN_PHASE_TIMEOUT, whatever the machine's speed."""
        if self.dry_run:
            return DRY_RUN_PHASE_TIMEOUT
        return min(cap, self.left() - reserve)

    def log(self, msg: str = "") -> None:
        print(msg, flush=True)
        self.log_fh.write(msg + "\n")

    def run(self, name: str, cmd: list[str], timeout: float, env: dict, log_name: str) -> dict:
        """Run cmd with a hard timeout (the whole process group is killed), streaming output into a log."""
        log_path = self.out / log_name
        info = {"cmd": " ".join(shlex.quote(c) for c in cmd), "log": log_name, "timeout_s": round(timeout, 1)}
        if timeout < 5:
            info.update(status="skipped", reason="no time left in the budget")
            self.log(f"[{name}] skipped: no time left")
            self.phases[name] = info
            return info
        self.log(f"[{name}] {info['cmd']}  (timeout {timeout:.0f} s, log {log_name})")
        t = time.monotonic()
        with open(log_path, "w", buffering=1, encoding="utf-8") as fh:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                encoding="utf-8", errors="replace", start_new_session=True, bufsize=1,
            )

            def pump() -> None:  # copy the child's output into the log and onto our stdout, line by line
                assert proc.stdout is not None
                for line in proc.stdout:
                    fh.write(line)
                    print(f"  {line}", end="", flush=True)

            reader = threading.Thread(target=pump, daemon=True)
            reader.start()
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
            finally:
                if proc.poll() is None:  # interrupted (Ctrl-C): do not leave the child running
                    _kill_group(proc)
            reader.join(15)
            if timed_out:
                fh.write(f"\n[gpu_check] killed after the {timeout:.0f} s phase timeout\n")
        rc = proc.returncode
        info.update(rc=rc, elapsed_s=round(time.monotonic() - t, 1), timed_out=timed_out)
        info["status"] = "timeout" if timed_out else ("ok" if rc == 0 else "failed")
        if name == "gpu tests" and rc == 5:  # pytest: nothing collected (or everything deselected)
            info["status"] = "no tests"
        self.log(f"[{name}] {info['status']} (rc={rc}, {info['elapsed_s']} s)")
        self.phases[name] = info
        return info


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, the child's process group (it was started in its own session)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _quick_cmd(cmd: list[str], timeout: float = 20, env: dict | None = None) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return (r.stdout + r.stderr).strip()
    except Exception as exc:
        return f"unavailable ({type(exc).__name__}: {exc})"


def write_env(runner: Runner, env: dict) -> None:
    probe = (
        "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, "
        "'cuda', torch.version.cuda, 'available', torch.cuda.is_available());\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0); print('gpu', p.name, 'cc', f'{p.major}.{p.minor}', "
        "'mem_GiB', round(p.total_memory / 2**30, 1), 'SMs', p.multi_processor_count)\n"
        "    print('cudnn', torch.backends.cudnn.version())\n"
        "import importlib.metadata as md\n"
        "for m in ('triton', 'transformers', 'pytest', 'nvidia-modelopt'):\n"
        "    try:\n"
        "        print(m, md.version(m))\n"
        "    except Exception as e:\n"
        "        print(m, 'not installed', type(e).__name__)\n"
    )
    text = _quick_cmd([sys.executable, "-c", probe], timeout=120, env=env)
    smi = _quick_cmd(["nvidia-smi"]) if shutil.which("nvidia-smi") else "nvidia-smi: not found"
    body = f"{text}\n\nPYTHONPATH={env.get('PYTHONPATH', '')}\n\n{smi}\n"
    (runner.out / "env.txt").write_text(body, encoding="utf-8")
    runner.log("[env] " + " | ".join(text.splitlines()))


def _dist_name(wheel: Path) -> str:
    return wheel.name.split("-")[0].replace("_", "-").lower()


def _wheel_fits(wheel: Path) -> bool:
    """Pure wheels always; binary wheels only for this interpreter's cpXY tag."""
    tags = wheel.stem.split("-")[2:]
    py = tags[0] if tags else "py3"
    if py.startswith("py") or "none" in tags[1:2] or "abi3" in tags[1:2]:
        return True
    return f"cp{sys.version_info.major}{sys.version_info.minor}" in py.split(".")


def stage_wheels(runner: Runner, wheels: Path | None, pip_install: bool) -> tuple[str | None, list[str]]:
    """Make the wheels' packages importable for the child processes; returns (site dir, notes)."""
    if wheels is None:
        return None, []
    if not wheels.is_dir():
        return None, [f"--wheels {wheels} is not a folder"]
    notes, todo, staged = [], [], set()
    for whl in sorted(wheels.glob("*.whl")):
        name = _dist_name(whl)
        if name in staged:
            notes.append(f"{whl.name}: skipped, another {name} wheel is used")
            continue
        if name == "nvidia-modelopt":
            notes.append(f"{whl.name}: passed to the benchmark (--modelopt-wheels)")
            continue
        try:
            notes.append(f"{whl.name}: skipped, {name} {md.version(name)} already installed")
            continue
        except md.PackageNotFoundError:
            pass
        if not _wheel_fits(whl):
            notes.append(f"{whl.name}: skipped, not built for this Python")
            continue
        todo.append(whl)
        staged.add(name)
    if not todo:
        return None, notes
    site = tempfile.mkdtemp(prefix="gpu_check_site_")
    if pip_install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", site, *map(str, todo)]
        out = _quick_cmd(cmd, timeout=120)
        notes.append(f"pip install --no-index --target: {out.splitlines()[-1] if out else ''}")
    else:
        for whl in todo:
            with zipfile.ZipFile(whl) as zf:
                zf.extractall(site)
            notes.append(f"{whl.name}: unzipped")
    return site, notes


def gpu_test_files(root: Path) -> list[str]:
    """Test modules that hold `gpu`-marked tests: only these are imported, so the rest of the suite's dependencies
    (pydantic, ModelOpt, vLLM) need not exist on the GPU machine."""
    files = sorted(p for p in root.rglob("test_*.py") if "mark.gpu" in p.read_text(encoding="utf-8", errors="replace"))
    return [str(p.relative_to(REPO)) for p in files] or [str(root.relative_to(REPO))]


def parse_junit(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tot = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed = []
    for s in suites:
        for k in tot:
            tot[k] += int(s.get(k, 0))
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    tot["passed"] = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
    tot["failed_tests"] = failed
    return tot


def pytest_tail(log: Path) -> str:
    if not log.is_file():
        return ""
    lines = [x for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x.strip()]
    for line in reversed(lines):
        if re.search(r"\b(passed|failed|skipped|error|no tests ran|deselected)\b", line):
            return line.strip("= ").strip()
    return lines[-1] if lines else ""


def _f(x, fmt: str) -> str:
    if x is None:
        width = "".join(c for c in fmt.split(".")[0] if c.isdigit())
        return "-".rjust(int(width or 0))
    return format(x, fmt)


def summary_table(rows: list[dict]) -> str:
    """The benchmark's rows: the model-dtype cache's, then each shape's FP8-cache rows (case "e4m3 dense", "e4m3 s50":
    x own vs our dense on that FP8 cache, x auto vs ours on the model-dtype cache at the same case, FP8b ms / x FP8b
    the dense baseline on the same FP8 cache, or the note says why there is none)."""
    head = (f"{'shape':<44} {'dtype':<5} {'case':<10} {'sparsity':>8} {'ours ms':>9} {'SDPA ms':>9} {'MO ms':>9} "
            f"{'x SDPA':>6} {'x own':>6} {'x MO':>6} {'2/(2-s)':>7} {'x auto':>6} {'FP8b ms':>9} {'x FP8b':>6}  note")
    lines = [head, "-" * len(head)]
    for r in rows:
        note = "; ".join(x for x in (r.get("error") or r.get("check") or "", r.get("fp8_base_note") or "") if x)
        if r.get("sdpa_backend"):
            note = f"[{r['sdpa_backend']}] {note}".strip()
        lines.append(
            f"{r['shape']:<44} {r['dtype']:<5} {r['case']:<10} {_f(r['sparsity'], '8.3f')} "
            f"{_f(r['ours_ms'], '9.3f')} {_f(r['sdpa_ms'], '9.3f')} {_f(r['modelopt_ms'], '9.3f')} "
            f"{_f(r['speedup_vs_sdpa'], '6.2f')} {_f(r['speedup_vs_own_dense'], '6.2f')} "
            f"{_f(r['speedup_vs_modelopt'], '6.2f')} {_f(r['bound'], '7.2f')} "
            f"{_f(r.get('speedup_vs_model_cache'), '6.2f')} {_f(r.get('fp8_base_ms'), '9.3f')} "
            f"{_f(r.get('speedup_vs_fp8_base'), '6.2f')}  {note}"
        )
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="log folder (default: $OUT if set, else gpu_logs/<UTC time>)")
    p.add_argument("--wheels", default=None, help="folder of wheels carried along (.whl); nothing is downloaded")
    p.add_argument("--pip-install", action="store_true",
                   help="pip install --no-index --no-deps --target instead of unzip")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check (default 540)")
    p.add_argument("--tests-timeout", type=float, default=170.0)
    p.add_argument("--tests-path", default=None, help="default: tests (tests/unit with --dry-run)")
    p.add_argument("--bench-args", default="", help="extra arguments for bench_kernels.py, one string")
    p.add_argument("--quick", action="store_true", help="quick benchmark shapes")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--skip-graphs", action="store_true")
    p.add_argument("--graphs-timeout", type=float, default=100.0)
    p.add_argument("--skip-tune", action="store_true")
    p.add_argument("--tune-timeout", type=float, default=150.0)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU rehearsal: collect the gpu tests only and run the CPU benchmark (--quick); it "
                        "checks the wiring, not speed: --budget does not apply, each phase gets "
                        f"{DRY_RUN_PHASE_TIMEOUT:.0f} s")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.environ.get("OUT") or str(REPO / "gpu_logs" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    return args


def bench_inputs_problem(bench_args: str, captures: Path = CAPTURES) -> str | None:
    """Why the benchmark phase would refuse to run (no captured real-attention inputs), before any GPU time."""
    words = shlex.split(bench_args)
    if "--synthetic" in words or "--inputs" in words or any(w.startswith("--inputs=") for w in words):
        return None
    if any(captures.glob("*.npz")):
        return None
    return (f"no captured attention inputs in {captures}: the benchmark runs on real attention. Make them with "
            "`python benchmarks/attention_inputs.py capture` on a machine with the model and carry the folder "
            "(e.g. run's carry: .cache/attention_inputs), or pass --bench-args \"--inputs FILE\" / \"--synthetic\"")


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = None if args.skip_bench else bench_inputs_problem(args.bench_args)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    with contextlib.suppress(Exception):  # never die on a non-UTF-8 console
        sys.stdout.reconfigure(encoding="utf-8", errors="replace")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, args.budget, dry_run=args.dry_run)
    budget = f"none (dry run: {DRY_RUN_PHASE_TIMEOUT:.0f} s a phase)" if args.dry_run else f"{args.budget:.0f} s"
    runner.log(f"gpu_check: out={out} budget={budget} dry_run={args.dry_run} "
               f"start={time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")

    env, notes = phase_environment(runner, args)
    if not args.skip_tests:
        phase_gpu_tests(runner, args, out, env)
    if not args.skip_graphs:
        phase_graphs(runner, args, out, env)
    if not args.skip_tune:
        phase_tune(runner, args, out, env)
    bench_out = out / "bench"
    if not args.skip_bench:
        phase_benchmark(runner, args, bench_out, env)
    write_summary(runner, args, out, bench_out, notes)
    fine = ("ok", "no tests") if args.dry_run else ("ok",)
    bad = [n for n, ph in runner.phases.items() if ph.get("status") not in fine]
    return 1 if bad else 0


def phase_environment(runner: Runner, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """Stage the carried wheels and build the environment every phase's child runs in (the repository and the
    staged wheels on PYTHONPATH, unbuffered UTF-8 output), written to env.txt: (env, the wheel notes)."""
    site, notes = stage_wheels(runner, Path(args.wheels).resolve() if args.wheels else None, args.pip_install)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), site, env.get("PYTHONPATH")) if x)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONIOENCODING"] = "utf-8"
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "gpu_check_inductor"))
    for n in notes:
        runner.log(f"[wheels] {n}")
    write_env(runner, env)
    return env, notes


def phase_gpu_tests(runner: Runner, args: argparse.Namespace, out: Path, env: dict) -> None:
    """The `gpu`-marked tests (collected only in a dry run), leaving the later phases the time they need."""
    tests_path = args.tests_path or ("tests/unit" if args.dry_run else "tests")
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *gpu_test_files(REPO / tests_path), "-p",
           "no:cacheprovider", "-rA", "--continue-on-collection-errors", f"--junitxml={out / 'pytest.xml'}"]
    cmd += ["--collect-only", "-q"] if args.dry_run else ["-q"]
    # what the later phases need at least (H200, 2026-12-04: graphs 13 s, tune 53 s; the benchmark fills the
    # rest), not their timeouts: the tests compile every kernel variant first (about 90 s there)
    bench_reserve = (
        (0 if args.skip_bench else (60 if args.dry_run else 150))
        + (0 if args.skip_graphs else min(args.graphs_timeout, 40 if args.dry_run else 30))
        + (0 if args.skip_tune else min(args.tune_timeout, 60 if args.dry_run else 90))
    )
    timeout = runner.phase_timeout(args.tests_timeout, bench_reserve + 15)
    runner.run("gpu tests", cmd, timeout, env, "pytest.log")


def phase_graphs(runner: Runner, args: argparse.Namespace, out: Path, env: dict) -> None:
    """CUDA graphs: the plugin's capture self-test and eager vs replay decode latency."""
    timeout = runner.phase_timeout(args.graphs_timeout, (0 if args.skip_bench else 150) + 15)
    cmd = [sys.executable, str(GRAPHS), "--device", "cpu" if args.dry_run else "cuda", "--out", str(out / "graphs")]
    cmd += ["--quick"] if args.dry_run else []
    runner.run("graphs", cmd, timeout, env, "graphs.log")


def phase_tune(runner: Runner, args: argparse.Namespace, out: Path, env: dict) -> None:
    """The launch-configuration sweep (ours against ours), at D = 128 and then D = 64 prefill; before the
    benchmark, which fills what time is left."""
    timeout = runner.phase_timeout(args.tune_timeout, (0 if args.skip_bench else 150) + 15)
    cmd = [sys.executable, str(TUNE), "--out", str(out / "tune"), "--time-budget", f"{max(10.0, timeout - 30):.0f}"]
    if args.dry_run:
        cmd += ["--device", "cpu", "--quick", "--dtype", "fp16", "--shapes", "decode:1:2200", "--heads", "2/1",
                "--configs", ";decode_skip=exp"]  # fmt: skip
    tune_env = dict(env, TRITON_INTERPRET="1") if args.dry_run else env  # Triton runs as Python on a CPU
    runner.run("tune", cmd, timeout, tune_env, "tune.log")
    # D = 64 (Llama 3.2 1B, SmolLM2): its default launch has never run on a GPU; the D = 128 winners against it
    timeout = runner.phase_timeout(60.0, (0 if args.skip_bench else 150) + 15)
    cmd = [sys.executable, str(TUNE), "--out", str(out / "tune_d64"), "--head-dim", "64", "--time-budget",
           f"{max(10.0, timeout - 25):.0f}", "--configs", D64_CONFIGS]  # fmt: skip
    cmd += (["--device", "cpu", "--quick", "--dtype", "fp16", "--shapes", "prefill:1:200", "--heads", "2/1"]
            if args.dry_run else ["--shapes", "prefill:1:16384"])  # fmt: skip
    runner.run("tune d64", cmd, timeout, tune_env, "tune_d64.log")


def phase_benchmark(runner: Runner, args: argparse.Namespace, bench_out: Path, env: dict) -> None:
    """The kernel benchmark, last: it gets whatever time is left (its own budget a margin below the timeout)."""
    timeout = runner.phase_timeout(float("inf"), 15)
    device = "cpu" if args.dry_run else "cuda"
    cmd = [sys.executable, str(BENCH), "--device", device, "--out", str(bench_out),
           "--time-budget", f"{max(10.0, timeout - (20 if args.dry_run else 75)):.0f}"]
    if args.quick or args.dry_run:
        cmd.append("--quick")
    if args.wheels:
        cmd += ["--modelopt-wheels", str(Path(args.wheels).resolve())]
    if args.dry_run:
        cmd += ["--modelopt", "kernel-only"]
    cmd += shlex.split(args.bench_args)
    runner.run("benchmark", cmd, timeout, env, "bench.log")


def write_summary(runner: Runner, args: argparse.Namespace, out: Path, bench_out: Path, notes: list[str]) -> None:
    """Summary phase: one text (environment, each phase's outcome, the benchmark table) written to summary.txt and
    printed, and the same facts as summary.json; closes the log."""
    summary: dict = {"out": str(out), "dry_run": args.dry_run, "phases": runner.phases, "wheels": notes}
    lines = ["", "=" * 30 + " GPU CHECK SUMMARY " + "=" * 30]
    env_txt = (out / "env.txt").read_text(encoding="utf-8").splitlines() if (out / "env.txt").is_file() else []
    keep = ("python", "torch", "gpu", "cudnn", "triton", "pytest", "nvidia-modelopt")
    lines += [x for x in env_txt if x.startswith(keep)]
    lines += _tests_summary(runner, args, out, summary)
    bench_lines, rows, meta = _benchmark_summary(runner, bench_out)
    lines += bench_lines
    lines += _reports_summary(runner, out)
    summary["bench_meta"] = meta
    summary["bench_rows"] = rows
    table_txt = bench_out / "table.txt"
    variants = [x for x in table_txt.read_text(encoding="utf-8").splitlines() if "compiled variants" in x] \
        if table_txt.is_file() else []
    lines += ["", summary_table(rows) if rows else "(no benchmark rows)", *variants, "",
              "x SDPA: vs the fastest dense SDPA backend (named in the note); x own: vs our dense kernel (λ=None); "
              "x MO: vs ModelOpt 0.47 at the same λ; 2/(2-s): ideal bound at realized tile sparsity s. FP8 rows "
              "(case 'e4m3 ...', the model-dtype cache's λ): x own vs our dense on that FP8 cache; x auto: ours on "
              "the model-dtype cache / ours on FP8; FP8b: the dense baseline on the same FP8 cache, x FP8b its time "
              "/ ours.",
              f"total {time.monotonic() - runner.t0:.0f} s; logs in {out}"]
    text = "\n".join(lines)
    (out / "summary.txt").write_text(text + "\n", encoding="utf-8")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str), encoding="utf-8")
    runner.log(text)
    runner.log_fh.close()


def _tests_summary(runner: Runner, args: argparse.Namespace, out: Path, summary: dict) -> list[str]:
    """The gpu tests' summary line (counts from pytest.xml, failed tests named) when the phase ran; records the
    parsed JUnit report as summary["tests"]."""
    if "gpu tests" not in runner.phases:
        return []
    lines = []
    ph = runner.phases["gpu tests"]
    junit = parse_junit(out / "pytest.xml")
    summary["tests"] = junit
    tail = pytest_tail(out / "pytest.log")
    if junit and not args.dry_run:
        lines.append(f"gpu tests: {ph['status']}: {junit['passed']} passed, {junit['failures']} failed, "
                     f"{junit['errors']} errors, {junit['skipped']} skipped  ({tail})")
        lines += [f"  FAILED {t}" for t in junit["failed_tests"]]
    else:
        lines.append(f"gpu tests: {ph['status']} ({tail or ph.get('reason', '')})")
    return lines


def _benchmark_summary(runner: Runner, bench_out: Path) -> tuple[list[str], list, dict]:
    """The benchmark's lines (outcome, ModelOpt baseline, shapes the time budget cut short) from results.json:
    (lines, its summary rows, its meta); an unreadable results.json is said, not raised."""
    lines = []
    data: dict = {}
    res = bench_out / "results.json"
    if res.is_file():
        try:
            data = json.loads(res.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            lines.append(f"benchmark: results.json unreadable ({exc})")
    rows, meta = data.get("summary", []), data.get("meta", {})
    if "benchmark" in runner.phases:
        ph = runner.phases["benchmark"]
        lines.append(f"benchmark: {ph['status']} ({ph.get('elapsed_s', '-')} s), {len(rows)} rows; "
                     f"{meta.get('modelopt', 'ModelOpt baseline: unknown (no results)')}")
        fp8 = [c for c in meta.get("kv_cache_dtypes", []) if c != "auto"]
        if fp8:
            n_fp8 = sum(1 for r in rows if r.get("kv") not in (None, r.get("dtype")))
            lines.append(f"  FP8 caches {', '.join(fp8)}: {n_fp8} rows; {meta.get('fp8_baseline', '')}")
        skipped = sorted({r["shape"] for r in data.get("records", []) if "time budget" in str(r.get("error"))})
        if skipped:
            lines.append(f"  not (fully) reached in the time budget: {', '.join(skipped)}")
    return lines, rows, meta


def _reports_summary(runner: Runner, out: Path) -> list[str]:
    """The graphs and tune phases' outcomes, each followed by the text report its script wrote (graphs.txt,
    tune.txt)."""
    lines = []
    graphs_txt = out / "graphs" / "graphs.txt"
    if "graphs" in runner.phases:
        lines.append(f"graphs: {runner.phases['graphs']['status']}")
        lines += graphs_txt.read_text(encoding="utf-8").splitlines() if graphs_txt.is_file() else []
    for phase, folder in (("tune", "tune"), ("tune d64", "tune_d64")):
        tune_txt = out / folder / "tune.txt"
        if phase in runner.phases:
            lines.append(f"{phase}: {runner.phases[phase]['status']}")
            lines += tune_txt.read_text(encoding="utf-8").splitlines() if tune_txt.is_file() else []
    return lines

if __name__ == "__main__":
    sys.exit(main())
