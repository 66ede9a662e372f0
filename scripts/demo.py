#!/usr/bin/env python3
"""`make demo`: serve the embedded default model with vLLM's OpenAI server on the CPU engine and query it.

Today this is DENSE serving only: it proves the environment, the offline SmolLM2 checkpoint and vLLM's
HTTP API work on a machine without a GPU. The sparse flow (calibrate -> export the
sparse_attention_config -> serve with the skip-softmax impls) lands with issue 5 and slots into
``main()`` as extra steps before ``serve()``.

Run it with the interpreter of .venv-cpu (the server is started with ``--python``, default: this one).
Only the standard library is used here, so the client side never depends on vLLM.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("demo")
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, payload: dict | None = None, timeout: float = 300.0) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body = resp.read()
    return json.loads(body) if body else {}


@contextmanager
def serve(python: str, model: Path, port: int, log_path: Path, extra_args: list[str], start_timeout: float):
    """Start vLLM's OpenAI server on the CPU engine; yield its base URL; always stop it by its PID."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", model.name,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
        *extra_args,
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM would otherwise claim most of the RAM
    env.setdefault("HF_HUB_OFFLINE", "1")
    log.info("starting: %s (log: %s)", " ".join(cmd), log_path)
    with log_path.open("wb") as out:
        # Own session: if SIGTERM to the server is not enough, its engine children can be reached by group id.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {proc.returncode} before becoming healthy")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() - t0 > start_timeout:
                raise TimeoutError(f"vLLM server not healthy after {start_timeout:.0f} s")
            time.sleep(1.0)
        log.info("server healthy after %.1f s (pid %d)", time.monotonic() - t0, proc.pid)
        yield base
    except BaseException:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        log.error("server log tail:\n%s", "\n".join(tail))
        raise
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    if proc.poll() is None:
        log.info("stopping server pid %d", proc.pid)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.warning("server pid %d ignored SIGTERM for %.0f s; killing its process group", proc.pid, grace)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Children (EngineCore, workers) exit with the server; make sure none outlived it.
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Dense-serving demo on vLLM's CPU engine (sparse flow: issue 5).")
    ap.add_argument("--model", type=Path, default=REPO / ".cache/models/SmolLM2-135M-Instruct")
    ap.add_argument("--python", default=sys.executable, help="interpreter with vllm-cpu (.venv-cpu)")
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
    print("== modelopt-ext demo: DENSE serving on vLLM's CPU engine "
          "(sparse calibrate -> export -> serve lands with issue 5) ==", flush=True)  # fmt: skip
    port = args.port or free_port()
    log_dir = Path(tempfile.mkdtemp(prefix="modelopt-ext-demo-"))
    t0 = time.monotonic()
    with serve(args.python, model, port, log_dir / "server.log", args.server_args, args.start_timeout) as base:
        payload = {
            "model": model.name,
            "prompt": args.prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
        }
        t1 = time.monotonic()
        reply = http_json(f"{base}/v1/completions", payload)
        latency = time.monotonic() - t1
    text = reply["choices"][0]["text"]
    usage = reply.get("usage", {})
    print(f"prompt : {args.prompt!r}")
    print(f"reply  : {text!r}")
    print(f"tokens : {usage.get('completion_tokens')} in {latency:.2f} s; total demo {time.monotonic() - t0:.1f} s")
    print(f"server log: {log_dir / 'server.log'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
