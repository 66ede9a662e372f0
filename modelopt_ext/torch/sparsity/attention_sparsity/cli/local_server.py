"""A sparse vLLM OpenAI server on this machine for scripts and benchmarks: start it, wait until healthy, read its
realized sparsity from `/metrics`, stop it with everything it started. Standard library only (no vLLM import).

The server runs as a user runs it: the serve command in its own process session (so its engine processes can be
reached by group id), without `VLLM_SERVER_DEV_MODE` (it would let any HTTP caller run any worker method; `/metrics`
needs nothing), with `MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY=1` unless set (workers write their totals after every
step, so `/metrics` is exact once a reply is back).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

METRIC_PREFIX = "modelopt_sparse_attn"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a local server: the caller's, no dev mode, totals after every step."""
    env = dict(os.environ if base is None else base)
    env.pop("VLLM_SERVER_DEV_MODE", None)
    env.setdefault("MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY", "1")
    return env


def sparse_metrics(base_url: str, timeout: float = 60.0) -> dict[str, float]:
    """The server's `modelopt_sparse_attn*` samples on its Prometheus `/metrics`: {'name{labels}': value}, e.g.
    'modelopt_sparse_attn_tiles_skipped_total{phase="prefill"}'."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(METRIC_PREFIX):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def tile_counts(metrics: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{phase: (visited, skipped)} from `sparse_metrics` samples."""
    out = {}
    for phase in ("prefill", "decode"):
        label = f'{{phase="{phase}"}}'
        out[phase] = (metrics.get(f"{METRIC_PREFIX}_tiles_visited_total{label}", 0.0),
                      metrics.get(f"{METRIC_PREFIX}_tiles_skipped_total{label}", 0.0))  # fmt: skip
    return out


def tiles_between(before: dict, after: dict) -> dict:
    """Per phase, the tiles visited and skipped between two `tile_counts` readings and their share skipped (None when
    none was visited): the realized sparsity of what the server did in between."""
    out = {}
    for phase in ("prefill", "decode"):
        visited = after[phase][0] - before[phase][0]
        skipped = after[phase][1] - before[phase][1]
        out[phase] = {"visited": visited, "skipped": skipped, "sparsity": skipped / visited if visited else None}
    return out


def stop_server(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the server, SIGKILL its process group if it lingers past `grace`; then SIGTERM whatever of its
    group (EngineCore, workers) outlived it. Never anything outside the group."""
    if proc.poll() is None:
        logger.info("stopping server pid %d", proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            logger.warning("server pid %d ignored SIGTERM for %.0f s; killing its process group", proc.pid, grace)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def _wait_healthy(proc: subprocess.Popen, base_url: str, start_timeout: float) -> float:
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() - start > start_timeout:
            raise TimeoutError(f"the server was not healthy after {start_timeout:.0f} s")
        time.sleep(1.0)


@contextmanager
def running_server(cmd: list[str], log_path: Path, env: dict[str, str], base_url: str,
                   start_timeout: float = 600.0) -> Iterator[str]:  # fmt: skip
    """Run the server command `cmd` (output to `log_path`, own session), wait for `base_url`/health, yield
    `base_url`; always stop it. On a failure the log's tail is logged."""
    logger.info("starting server (log: %s): %s", log_path, " ".join(cmd))
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        seconds = _wait_healthy(proc, base_url, start_timeout)
        logger.info("server healthy after %.1f s (pid %d)", seconds, proc.pid)
        yield base_url
    except BaseException:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        logger.error("server log tail:\n%s", "\n".join(tail))
        raise
    finally:
        stop_server(proc)
