"""Helpers of the end-to-end tests: run the example scripts as a user does (subprocesses, vLLM's default
multi-process engine), serve over HTTP, and account for every process by PID.

Timeouts: every subprocess / HTTP wait here stays well below pytest's per-test timeout of the e2e stage
(`--timeout=1200`, the Makefile's E2E_TIMEOUT), with room for the test's other work: a calibration 900 s, a server's
start 600 s, one request 120 s, a server's stop 90 s."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
    build_sparse_attention_config,
    linked_checkpoint_copy,
    write_sparse_attention_config,
)
from modelopt_ext.torch.sparsity.attention_sparsity.cli.local_server import free_port, sparse_metrics  # noqa: F401

FIXED_FITS = {"prefill": {"a": 0.0232, "b": 12.98}, "decode": {"a": 0.0075, "b": 13.02}}
"""ModelOpt's law with the fit SmolLM2 gets on the CPU engine's calibration (benchmarks/fidelity.py): λ in (0, 1) at
every length the e2e tests serve, so every row can drop tiles."""


def fixed_fit_checkpoint(src: Path, dst: Path, target_sparsity: float = 0.5) -> Path:
    """A linked copy of the checkpoint `src` at `dst` with a sparse block of `FIXED_FITS` at `target_sparsity` (no
    calibration run: for tests of serving, not of calibrating)."""
    ckpt = linked_checkpoint_copy(src, dst)
    write_sparse_attention_config(ckpt, build_sparse_attention_config(FIXED_FITS, target_sparsity=target_sparsity))
    return ckpt

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "vllm_serve"
CALIBRATE = EXAMPLES / "calibrate_sparse_attn.py"
SERVE = EXAMPLES / "vllm_serve_sparse_attn.py"
README = REPO / "README.md"
README_CKPT = "/path/to/ckpt"
LONG_PROMPT = " ".join(f"Item {i} is filed under drawer {i % 7}." for i in range(150)) + " Drawer of item 42?"


def env(**extra) -> dict:
    """The environment of a script run: the caller's, offline, a capped KV cache; never VLLM_ENABLE_V1_... and no
    VLLM_SERVER_DEV_MODE unless `extra` sets it."""
    out = dict(os.environ)
    out.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    out.pop("VLLM_SERVER_DEV_MODE", None)
    out.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it for the kernel tests, not for the engine
    out.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    out.setdefault("OMP_NUM_THREADS", "2")
    out.update(extra)
    return out


def readme_calibrate_command(ckpt: Path, *extra: str) -> list[str]:
    """The calibrate command of README.md's usage section, as written, with its checkpoint placeholder replaced,
    followed by the arguments the README gives for vLLM's CPU engine (`CPU engine ... add `--calib_samples ...``, its
    section "On vLLM's CPU engine"). `extra`: flag /
    value pairs, replacing the README's value of a flag it sets, else appended."""
    text = README.read_text()
    start = text.index("python examples/vllm_serve/calibrate_sparse_attn.py")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.split("#", 1)[0].rstrip())
        if not line.rstrip().endswith("\\"):
            break
    argv = shlex.split(" ".join(line.rstrip("\\") for line in lines))
    cpu = re.search(r"CPU engine.*?add `(--calib_samples[^`]*)`", text, re.DOTALL)
    assert cpu, "README.md no longer says which arguments make calibration short on the CPU engine"
    argv += shlex.split(cpu.group(1))
    assert argv[:2] == ["python", "examples/vllm_serve/calibrate_sparse_attn.py"] and README_CKPT in argv, argv
    cmd = [sys.executable, str(REPO / argv[1]), *[str(ckpt) if a == README_CKPT else a for a in argv[2:]]]
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        if flag in cmd:
            cmd[cmd.index(flag) + 1] = value
        else:
            cmd += [flag, value]
    return cmd


def calibrate_with_readme_command(ckpt: Path, work: Path, *extra: str) -> tuple[str, dict]:
    """Run the README calibrate command on `ckpt` in `work`, one OpenMP thread per worker (`extra`: flag / value
    pairs, replacing the README's value of a flag it sets); the log is kept as work/calibrate.log. Returns the log
    and the records it wrote ({"layers": [...], "counts": array})."""
    import numpy as np

    cmd = readme_calibrate_command(ckpt, *extra)
    proc = subprocess.run(cmd, env=env(OMP_NUM_THREADS="1"), cwd=work, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    (work / "calibrate.log").write_text(log)
    assert proc.returncode == 0, log[-4000:]
    assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in log  # the script binds one core per worker itself
    with np.load(work / "sparse_attention_config.records.npz", allow_pickle=False) as data:
        records = {"layers": data["layers"].tolist(), "counts": data["counts"]}
    assert (records["counts"][..., 1] <= records["counts"][..., 0]).all() and records["counts"][..., 1].sum() > 0
    return log, records


def http_json(url: str, body: dict | None = None, timeout: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def still_running(procs, wait: float = 15.0) -> list[str]:
    """Which of `procs` (psutil.Process) still run after up to `wait` seconds (zombies count as ended)."""
    import psutil

    deadline = time.monotonic() + wait
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {p.name()}")
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def wait_for_log(proc: subprocess.Popen, log: Path, needle: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"exited ({proc.returncode}) before {needle!r}:\n" + log.read_text()[-4000:]
        assert time.monotonic() < deadline, f"no {needle!r} after {timeout:.0f} s:\n" + log.read_text()[-4000:]
        time.sleep(0.5)


@dataclass
class ServerProcess:
    """A started OpenAI server: its base URL, its Popen, and the processes it had started once healthy (filled in
    again at the stop, so a test can ask which process did what)."""

    base: str
    popen: subprocess.Popen
    procs: list = field(default_factory=list)


@contextmanager
def server_process(cmd: list[str], port: int, log_path: Path, *, extra_env: dict | None = None,
                   start_timeout: float = 600.0):  # fmt: skip
    """Start `cmd` (an OpenAI server listening on 127.0.0.1:`port`) in its own session, wait until /health answers,
    yield a `ServerProcess`; on exit SIGTERM it by PID and check that every process it started has ended."""
    with log_path.open("w") as log:
        popen = subprocess.Popen(cmd, env=env(**(extra_env or {})), stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    server = ServerProcess(f"http://127.0.0.1:{port}", popen)
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            assert popen.poll() is None, log_path.read_text()[-4000:]
            try:
                urllib.request.urlopen(server.base + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not become healthy:\n" + log_path.read_text()[-4000:]
                time.sleep(2)
        server.procs = descendants(popen.pid)
        yield server
    finally:
        server.procs = server.procs or descendants(popen.pid)
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
            raise AssertionError("the server ignored SIGTERM for 90 s") from None
    left = still_running(server.procs)
    assert not left, f"processes left after the server stopped: {left}"


@contextmanager
def serving(ckpt: Path, log_path: Path, *extra: str, start_timeout: float = 600.0, eager: bool = True,
            dev_mode: bool = False):
    """The serve script (vLLM's OpenAI server, sparse impls) on a free port; yields its base URL. Stops it with
    SIGTERM by PID and checks that every process it started has ended. `eager=False` keeps vLLM's compiled default
    (pipeline parallelism on the CPU engine needs it). Started as a user starts it: without vLLM's development mode,
    so /collective_rpc does not exist and realized sparsity is read on /metrics (`sparse_metrics`); the workers write
    their totals there after every engine step (MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY=1), so /metrics is exact once a
    reply is back. `dev_mode=True`: VLLM_SERVER_DEV_MODE=1, the documented opt-in for the per-layer / per-request
    RPCs over HTTP (POST /collective_rpc)."""
    port = free_port()
    cmd = [sys.executable, str(SERVE), str(ckpt), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", *(["--enforce-eager"] if eager else []), "--served-model-name", "smol",
           "--no-enable-prefix-caching", *extra]
    extra_env = {"MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY": "1", **({"VLLM_SERVER_DEV_MODE": "1"} if dev_mode else {})}
    with server_process(cmd, port, log_path, extra_env=extra_env, start_timeout=start_timeout) as server:
        yield server.base
