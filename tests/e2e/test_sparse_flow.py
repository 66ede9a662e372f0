"""The whole product on vLLM's CPU engine with the real SmolLM2 checkpoint:
calibrate through vLLM -> export into config.json -> serve from the checkpoint -> one real HTTP request.

Runs the example scripts exactly as a user would (subprocesses, the OpenAI HTTP API on 127.0.0.1) and stops
the server by its PID. Kept to a few short prompts: CI has 2 cores and 90 minutes for everything.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "vllm_serve"
CALIBRATE = EXAMPLES / "calibrate_sparse_attn.py"
SERVE = EXAMPLES / "vllm_serve_sparse_attn.py"
NUM_LAYERS = 30  # SmolLM2-135M


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    env.setdefault("OMP_NUM_THREADS", "2")
    env.update(extra)
    return env


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private checkpoint: config.json copied (it gets rewritten), the large files linked."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "config.json":
            shutil.copy2(f, dst / f.name)
        else:
            (dst / f.name).symlink_to(f)
    return dst


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


@pytest.fixture(scope="module")
def calibrated(smollm2_checkpoint, tmp_path_factory):
    """Calibrate once (in-process engine, a few short prompts) and update the private checkpoint."""
    work = tmp_path_factory.mktemp("flow")
    ckpt = _copy_checkpoint(smollm2_checkpoint, work / "ckpt")
    out = work / "sparse_attention_config.json"
    cmd = [sys.executable, str(CALIBRATE), str(ckpt), "--target_sparse_ratio", "0.5", "--calib_samples", "4",
           "--calib_max_seqlen", "1024", "--decode_tokens", "8", "--dtype", "float32", "--output", str(out),
           "--update_checkpoint_config"]
    proc = subprocess.run(cmd, env=_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"), capture_output=True, text=True,
                          timeout=1200)
    log = proc.stdout + proc.stderr
    (work / "calibrate.log").write_text(log)
    assert proc.returncode == 0, log[-4000:]
    return ckpt, out, log


def test_calibration_writes_both_phases(calibrated):
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.sparse_attn_config import (
        load_sparse_attention_config,
    )

    ckpt, out, log = calibrated
    assert "calibration mode on 30 layer(s)" in log
    standalone = json.loads(out.read_text())
    config = json.loads((ckpt / "config.json").read_text())
    assert config["sparse_attention_config"] == standalone
    assert config["architectures"] == ["LlamaForCausalLM"]  # the rest of config.json is kept
    assert (ckpt / "config.json.bak").is_file()
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    settings = load_sparse_attention_config(ckpt)
    for phase in ("prefill", "decode"):
        calib = settings.phase(phase)
        assert calib is not None, phase
        assert calib.b > 0 and calib.a > 0 and calib.target_sparsity == 0.5
        lo, hi = calib.observed_sparsity_range
        assert 0.0 <= lo < hi <= 1.0


def test_serve_from_checkpoint_answers_and_reports_sparsity(calibrated, tmp_path):
    ckpt, _, _ = calibrated
    port = _free_port()
    log_path = tmp_path / "serve.log"
    cmd = [sys.executable, str(SERVE), str(ckpt), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--enforce-eager", "--served-model-name", "smol",
           "--no-enable-prefix-caching"]
    with log_path.open("w") as log:
        server = subprocess.Popen(cmd, env=_env(VLLM_SERVER_DEV_MODE="1", MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY="4"),
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, log_path.read_text()[-4000:]
            try:
                urllib.request.urlopen(base + "/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not become healthy:\n" + log_path.read_text()[-4000:]
                time.sleep(2)

        reply = _request(base + "/v1/completions", {"model": "smol", "prompt": "The capital of France is",
                                                    "max_tokens": 12, "temperature": 0})
        assert "Paris" in reply["choices"][0]["text"], reply

        # A longer prompt, so that tiles can be skipped (a tile is 64 keys; the first one never is).
        prompt = " ".join(f"Item {i} is filed under drawer {i % 7}." for i in range(150)) + " Drawer of item 42?"
        _request(base + "/v1/completions", {"model": "smol", "prompt": prompt, "max_tokens": 16, "temperature": 0})

        (status,) = _request(base + "/collective_rpc", {"method": "sparse_attn_status"})["results"]
        assert status["sparse_layers"] == NUM_LAYERS
        assert {v["impl"] for v in status["layers"].values()} == {"ModelOptSparseCPUAttentionImpl"}
        realized = status["realized"]
        assert realized["prefill"]["visited"] > 0 and realized["decode"]["visited"] > 0
        assert realized["prefill"]["skipped"] + realized["decode"]["skipped"] > 0, realized
    finally:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    log = log_path.read_text()
    assert f"sparse attention serving on {NUM_LAYERS} layer(s)" in log, log[-4000:]
    assert "realized sparsity prefill" in log


def test_malformed_config_fails_before_model_loads(smollm2_checkpoint, tmp_path):
    ckpt = _copy_checkpoint(smollm2_checkpoint, tmp_path / "bad")
    config = json.loads((ckpt / "config.json").read_text())
    config["sparse_attention_config"] = {"config_groups": {"group_0": {
        "algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": {"a": float("nan"), "b": 8.0}},
        "target_sparsity": {"prefill": 0.5}}}}
    (ckpt / "config.json").write_text(json.dumps(config))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SERVE), str(ckpt), "--port", str(_free_port())], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "threshold_scale_factor.prefill.a" in proc.stderr, proc.stderr[-3000:]
    assert "Initializing a V1 LLM engine" not in proc.stdout + proc.stderr
    assert time.monotonic() - start < 120


def test_calibrate_rejects_short_max_model_len(smollm2_checkpoint, tmp_path):
    proc = subprocess.run([sys.executable, str(CALIBRATE), str(smollm2_checkpoint), "--calib_samples", "2",
                           "--calib_max_seqlen", "1024", "--max_model_len", "256", "--output",
                           str(tmp_path / "x.json")], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--max_model_len 256 is shorter than the longest calibration prompt" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "x.json").exists()


def _impl_names(worker) -> list[str]:
    """Runs inside the (in-process) worker: the impl class of every attention layer."""
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm_worker import worker_model

    return sorted({type(m.impl).__name__ for m in worker_model(worker).modules() if hasattr(m, "impl")})


@pytest.mark.parametrize("switch", ["0", "1"])
def test_plain_vllm_picks_up_the_checkpoint_config(calibrated, monkeypatch, switch):
    """The vLLM general plugin (entry point) serves a calibrated checkpoint sparse without --worker-cls,
    unless MODELOPT_EXT_SPARSE_ATTN=0."""
    import gc

    from vllm import LLM, SamplingParams

    ckpt, _, _ = calibrated
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN", switch)
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=256 * 2**20, seed=0)
    try:
        text = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
        assert "Paris" in text[0].outputs[0].text
        (impls,) = llm.collective_rpc(_impl_names)
        expected = "ModelOptSparseCPUAttentionImpl" if switch == "1" else "CPUAttentionBackendImpl"
        assert impls == [expected]
    finally:
        del llm
        gc.collect()
