"""The whole product on vLLM's CPU engine with the real SmolLM2 checkpoint:
calibrate through vLLM -> export into config.json (+ raw records) -> refit from the records without an engine ->
serve from the checkpoint -> real HTTP requests.

Runs the example scripts exactly as a user would: the calibrate command is read from README.md (default
multi-process engine, the README's CPU-engine arguments), the server is stopped by its PID and every process it
started is checked to have ended. Kept to a few short prompts: CI has 2 cores and 90 minutes for everything.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import urllib.error

import numpy as np
import pytest
from e2e_lib import (
    CALIBRATE,
    LONG_PROMPT,
    SERVE,
    env,
    free_port,
    http_json,
    readme_calibrate_command,
    sparse_metrics,
)
from e2e_lib import serving as serving_ctx

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import linked_checkpoint_copy

pytestmark = pytest.mark.e2e

NUM_LAYERS = 30  # SmolLM2-135M
# What a vLLM engine's start or a weight load prints (vLLM 0.32-0.33): none of it may appear where a command must stop
# before an engine, whatever the machine's speed.
ENGINE_MARKERS = ("Initializing a V1 LLM engine", "EngineCore", "Loading weights", "Loading safetensors")


def no_engine_started(output: str) -> bool:
    return not any(marker in output for marker in ENGINE_MARKERS)


@pytest.fixture(scope="module")
def calibrated(smollm2_checkpoint, tmp_path_factory):
    """Calibrate once with the README's command (default multiprocessing) and update the private checkpoint."""
    work = tmp_path_factory.mktemp("flow")
    ckpt = linked_checkpoint_copy(smollm2_checkpoint, work / "ckpt")
    cmd = readme_calibrate_command(ckpt)
    proc = subprocess.run(cmd, env=env(), cwd=work, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    (work / "calibrate.log").write_text(log)
    assert proc.returncode == 0, log[-4000:]
    return ckpt, work / "sparse_attention_config.json", log


def test_calibration_writes_both_phases_and_the_records(calibrated):
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        load_sparse_attention_config,
    )

    ckpt, out, log = calibrated
    assert "calibration mode on 30 layer(s) per rank, 1 rank(s)" in log
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
    # the raw records beside the config: per sequence-step law length, phase, counts of every trial
    records = out.with_name("sparse_attention_config.records.npz")
    assert records.stat().st_size < 200_000
    with np.load(records, allow_pickle=False) as data:
        phases, kv_lens, counts = data["phase"].tolist(), data["kv_lens"], data["counts"]
        assert counts.shape == (len(kv_lens), len(data["scale_factors"]), 2) and len(data["layers"]) == NUM_LAYERS
    decode_steps = 8 - 1  # --decode_tokens 8: the first token comes from the prefill step
    assert 0 < phases.count("decode") <= 4 * decode_steps and phases.count("prefill") >= 1
    assert (counts[..., 1] <= counts[..., 0]).all() and counts[..., 1].sum() > 0
    assert sorted(p.name for p in out.parent.iterdir() if p.name.startswith(".")) == []  # no temp files


def test_refit_from_records_needs_no_engine_and_reproduces_the_fit(calibrated, tmp_path):
    ckpt, out, _ = calibrated
    records = out.with_name("sparse_attention_config.records.npz")
    proc = subprocess.run([sys.executable, str(CALIBRATE), str(ckpt), "--refit_from", str(records),
                           "--output", str(tmp_path / "same.json")], env=env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stderr + proc.stdout
    assert f"refitting from {records.resolve()}" in output, output[-3000:]  # the records were the source ...
    assert no_engine_started(output), output[-3000:]  # ... and no engine started, no weight loaded
    same = json.loads((tmp_path / "same.json").read_text())
    engine_run = json.loads(out.read_text())
    same.pop("producer"), engine_run.pop("producer")
    assert same == engine_run
    # another phase policy from the same records: prefill only, another target
    proc = subprocess.run([sys.executable, str(CALIBRATE), str(ckpt), "--refit_from", str(records),
                           "--target_sparse_ratio", "prefill=0.3,decode=dense", "--output", str(tmp_path / "p.json")],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    group = json.loads((tmp_path / "p.json").read_text())["config_groups"]["group_0"]
    assert group["target_sparsity"] == {"prefill": 0.3} and "decode" not in group["threshold_scale_factor"]
    assert (tmp_path / "p.records.npz").is_file()


def test_serve_from_checkpoint_answers_and_reports_sparsity(calibrated, tmp_path):
    """Served as a user serves it, without vLLM's development mode: realized sparsity is read on the Prometheus
    /metrics endpoint, which needs nothing (the per-layer RPC over HTTP, an opt-in, is test_tensor_parallel.py's)."""
    ckpt, _, _ = calibrated
    log_path = tmp_path / "serve.log"
    skipped = {phase: f'modelopt_sparse_attn_tiles_skipped_total{{phase="{phase}"}}' for phase in ("prefill", "decode")}
    visited = {phase: f'modelopt_sparse_attn_tiles_visited_total{{phase="{phase}"}}' for phase in ("prefill", "decode")}
    with serving_ctx(ckpt, log_path) as base:
        # no development mode: the worker RPC endpoint does not exist
        with pytest.raises(urllib.error.HTTPError) as err:
            http_json(base + "/collective_rpc", {"method": "sparse_attn_status"})
        assert err.value.code == 404, err.value.read()[-2000:]
        reply = http_json(base + "/v1/completions", {"model": "smol", "prompt": "The capital of France is",
                                                     "max_tokens": 12, "temperature": 0})
        assert "Paris" in reply["choices"][0]["text"], reply
        # A longer prompt, so that tiles can be skipped (a tile is 64 keys; the first one never is).
        http_json(base + "/v1/completions", {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 16,
                                             "temperature": 0})
        # Every layer served sparse, both phases counted, tiles dropped (the workers write after every step).
        metrics = sparse_metrics(base)
        assert metrics.get('modelopt_sparse_attn_layers{reason="",served="sparse"}') == NUM_LAYERS, metrics
        assert metrics[visited["prefill"]] > 0 and metrics[visited["decode"]] > 0, metrics
        assert metrics[skipped["prefill"]] + metrics[skipped["decode"]] > 0, metrics
        for phase in ("prefill", "decode"):
            ratio = metrics[f'modelopt_sparse_attn_realized_sparsity{{phase="{phase}"}}']
            assert ratio == pytest.approx(metrics[skipped[phase]] / metrics[visited[phase]]), metrics
        # Per-request targets (vllm_xargs): a bad one is an HTTP 400 naming the key, and the server keeps serving;
        # a request that asks for dense drops nothing.
        for xargs, needle in (({"sparse_attn_target": 2}, "sparse_attn_target=2"),
                              ({"sparse_attn_tagret": 0.5}, "did you mean sparse_attn_target")):
            with pytest.raises(urllib.error.HTTPError) as err:
                http_json(base + "/v1/completions", {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 4,
                                                     "vllm_xargs": xargs})
            assert err.value.code == 400 and needle in err.value.read().decode(), xargs
        before = sparse_metrics(base)
        http_json(base + "/v1/completions", {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 16,
                                             "temperature": 0, "vllm_xargs": {"sparse_attn_target": "dense"}})
        dense = sparse_metrics(base)
        assert [dense[skipped[p]] for p in skipped] == [before[skipped[p]] for p in skipped], (before, dense)
        # ... while the same request at the checkpoint's target drops tiles again: the counters above were live
        http_json(base + "/v1/completions", {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 16,
                                             "temperature": 0})
        after = sparse_metrics(base)
        assert sum(after[skipped[p]] for p in skipped) > sum(dense[skipped[p]] for p in skipped), (dense, after)
    log = log_path.read_text()
    assert f"sparse attention serving on {NUM_LAYERS} layer(s)" in log, log[-4000:]
    assert "realized sparsity prefill" in log


def test_malformed_config_fails_before_model_loads(smollm2_checkpoint, tmp_path):
    ckpt = linked_checkpoint_copy(smollm2_checkpoint, tmp_path / "bad")
    config = json.loads((ckpt / "config.json").read_text())
    config["sparse_attention_config"] = {"config_groups": {"group_0": {
        "algorithm": "skip_softmax", "threshold_scale_factor": {"prefill": {"a": float("nan"), "b": 8.0}},
        "target_sparsity": {"prefill": 0.5}}}}
    (ckpt / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, str(SERVE), str(ckpt), "--port", str(free_port())], env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "threshold_scale_factor.prefill.a" in proc.stderr, proc.stderr[-3000:]
    # refused before the model loads: no engine process, no weight read
    assert no_engine_started(proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
    # the calibrate script refuses it too, in one line, before its engine
    proc = subprocess.run([sys.executable, str(CALIBRATE), str(ckpt), "--output", str(tmp_path / "x.json")],
                          env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith("error: checkpoint: its sparse_attention_config is "
                                                           "invalid"), proc.stderr[-3000:]


def test_calibrate_rejects_short_max_model_len(smollm2_checkpoint, tmp_path):
    """Known only once the prompts are tokenized: still before the engine, still one line."""
    proc = subprocess.run([sys.executable, str(CALIBRATE), str(smollm2_checkpoint), "--calib_samples", "2",
                           "--calib_max_seqlen", "1024", "--max_model_len", "256", "--output",
                           str(tmp_path / "x.json")], env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --max_model_len: --max_model_len 256 is shorter than the longest calibration "
                           "prompt"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and no_engine_started(proc.stdout + proc.stderr)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("switch", ["0", "1"])
def test_plain_vllm_picks_up_the_checkpoint_config(calibrated, vllm_cpu_env, monkeypatch, switch):
    """The vLLM general plugin (entry point) serves a calibrated checkpoint sparse without --worker-cls,
    unless MODELOPT_EXT_SPARSE_ATTN=0 (plain vllm.LLM, default multi-process engine)."""
    from vllm import LLM, SamplingParams

    ckpt, _, _ = calibrated
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN", switch)
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=256 * 2**20, seed=0)
    try:
        text = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
        assert "Paris" in text[0].outputs[0].text
        (status,) = llm.collective_rpc("sparse_attn_status")
        expected = "ModelOptSparseCPUAttentionImpl" if switch == "1" else "CPUAttentionBackendImpl"
        assert {v["impl"] for v in status["layers"].values()} == {expected}
        assert status["sparse_layers"] == (NUM_LAYERS if switch == "1" else 0)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
