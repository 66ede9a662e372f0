"""The model table: tiny random-weight checkpoints of the architectures people serve (tests/e2e/tiny_models.py),
each calibrated and served through vLLM's CPU engine (default multi-process engine) by tests/e2e/model_driver.py.

Per model:
- which layers serve sparse and which stay dense, and why (`sparse_attn_status`), as expected for the
  architecture: sliding-window layers (Gemma 2/3, gpt-oss) and chunk-local layers (Llama 4, a backend vLLM
  subclasses) stay on vLLM's own backend and impl; the rest goes sparse, Gemma 2's soft-capped layers and gpt-oss's
  full-attention layers with their attention sinks included;
- the whole model equals transformers (eager attention, float32) while calibrating (dense output): the dense-kept
  layers are vLLM's native attention with their windows, chunks and sinks, the sparse layers our kernel at no skip
  (with gpt-oss's sinks in the softmax).
  The same model with every layer global differs from transformers by far more than the tolerance, so the
  comparison sees the windows;
- served at the calibrated target 0.5, tiles are skipped and counted per phase; a model with no sparse layer serves
  exactly what it served before.

Two engines run at a time, each on its own core (2-core CI machines), to keep the stage short.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tiny_models
from e2e_lib import env

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
# The drivers, two at a time, all within this many seconds: below pytest's per-test timeout of the e2e stage
# (1200 s, which covers the module fixture), with room for the rest.
DRIVERS_TIMEOUT = 900.0
VOCAB = 49152  # SmolLM2's tokenizer
MODELS = {m.name: m for m in tiny_models.models(VOCAB)}
NATIVE_IMPL, SPARSE_IMPL = "CPUAttentionBackendImpl", "ModelOptSparseCPUAttentionImpl"
SLIDING = f"sliding window {tiny_models.WINDOW} is not supported"
CHUNK_LOCAL = "ChunkedLocalAttention"
# model -> (layers served sparse, {reason (substring) -> layers it keeps dense})
EXPECTED = {
    "Llama 3": (2, {}),
    "Qwen 2": (2, {}),
    "Qwen 3": (2, {}),
    "Mistral": (2, {}),
    "Phi-3": (2, {}),
    "Gemma 2": (2, {SLIDING: 2}),
    "Gemma 3": (2, {SLIDING: 2}),
    "gpt-oss": (2, {SLIDING: 2}),  # its full-attention layers serve sparse with their sinks
    "Llama 4": (2, {CHUNK_LOCAL: 2}),
}
MATCH_TRANSFORMERS = 1e-2  # max |Δ log p| over the probe's tokens, float32 (measured up to 2.2e-3: gpt-oss, its MoE)


def _run(name: str, ckpt: Path, cores: queue.Queue, work: Path, deadline: float) -> dict:
    core = cores.get()  # a core no other engine of this test runs on
    try:
        return _drive(name, ckpt, core, work, deadline)
    finally:
        cores.put(core)


def _drive(name: str, ckpt: Path, core: int, work: Path, deadline: float) -> dict:
    out, log = work / f"{ckpt.name}.json", work / f"{ckpt.name}.log"
    left = deadline - time.monotonic()  # what the drivers' shared timeout leaves this one
    if left < 1:
        return {"error": f"{name}: not run, the drivers' {DRIVERS_TIMEOUT:.0f} s were spent"}
    with log.open("w") as handle:
        try:
            proc = subprocess.run([sys.executable, str(HERE / "model_driver.py"), str(ckpt), str(out)],
                                  env=env(VLLM_CPU_OMP_THREADS_BIND=str(core), OMP_NUM_THREADS="1"), stdout=handle,
                                  stderr=subprocess.STDOUT, timeout=left)  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"{name}: driver killed at the drivers' {DRIVERS_TIMEOUT:.0f} s timeout:\n"
                             + log.read_text(errors="replace")[-4000:]}  # fmt: skip
    if proc.returncode != 0 or not out.is_file():
        return {"error": f"{name}: driver exited {proc.returncode}:\n" + log.read_text(errors="replace")[-4000:]}
    return json.loads(out.read_text())


def model_table(results: dict) -> str:
    """docs/models.md's model table from this run."""
    rows = ["| architecture | layers sparse / dense | kept dense because | realized sparsity prefill / decode |",
            "|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed | | |")
            continue
        status = r["status"]
        dense = len(status["layers"]) - status["sparse_layers"]
        why = "; ".join(f"{reason} ({n})" for reason, n in status["kept_dense"].items()) or "-"
        real = [status["realized"][p]["sparsity"] for p in ("prefill", "decode")]
        real_text = " / ".join("-" if s is None else f"{s:.2f}" for s in real)
        rows.append(f"| {name} (`{MODELS[name].model_class}`) | {status['sparse_layers']} / {dense} | {why} | "
                    f"{real_text} |")  # fmt: skip
    return "\n".join(rows)


@pytest.fixture(scope="module")
def results(smollm2_checkpoint, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("models")
    ckpts = {name: tiny_models.build(m, smollm2_checkpoint, work / m.model_class) for name, m in MODELS.items()}
    cores = queue.Queue()
    for core in sorted(os.sched_getaffinity(0))[:2]:
        cores.put(core)
    with ThreadPoolExecutor(max_workers=cores.qsize()) as pool:
        deadline = time.monotonic() + DRIVERS_TIMEOUT
        jobs = {name: pool.submit(_run, name, ckpt, cores, work, deadline) for name, ckpt in ckpts.items()}
    done = {name: job.result() for name, job in jobs.items()}
    (work / "model_table.md").write_text(model_table(done) + "\n")
    print(f"\nmodel table ({work / 'model_table.md'}):\n{model_table(done)}")
    return done


def _max_diff(a, b) -> float:
    assert len(a) == len(b) > 100
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", list(MODELS))
def test_model_is_served_sparse_where_it_can_and_native_elsewhere(results, name):
    r = results[name]
    assert "error" not in r, r.get("error")
    sparse_layers, dense_reasons = EXPECTED[name]
    layers = r["status"]["layers"]
    assert len(layers) == MODELS[name].layers
    # which layers, and why
    assert r["status"]["sparse_layers"] == sparse_layers, r["status"]
    for reason, count in dense_reasons.items():
        assert sum(any(reason in why for why in v["dense_reasons"]) for v in layers.values()) == count, layers
    for layer, v in layers.items():
        assert v["impl"] == (SPARSE_IMPL if v["sparse"] else NATIVE_IMPL), (layer, v)
        assert bool(v["dense_reasons"]) != v["sparse"], (layer, v)
    assert r["calibrated_layers"] == sparse_layers
    assert r["prepared"]["kept_dense"] == r["status"]["kept_dense"], "reasons changed when serving was reconfigured"
    # the whole model against transformers, dense output (calibration mode)
    assert _max_diff(r["calibration_mode"], r["hf"]) < MATCH_TRANSFORMERS
    if dense_reasons.keys() & {SLIDING, CHUNK_LOCAL}:
        assert _max_diff(r["hf_all_global"], r["hf"]) > 100 * MATCH_TRANSFORMERS, "windows do not change the output"
    # served at the calibrated target
    realized = r["status"]["realized"]
    assert r["decoded_tokens"] == 16
    if sparse_layers:
        assert set(r["fits"]) == {"prefill", "decode"}
        assert all(realized[p]["visited"] > 0 for p in ("prefill", "decode")), realized
        assert realized["prefill"]["skipped"] + realized["decode"]["skipped"] > 0, realized
    else:
        assert "fits" not in r and realized["prefill"]["visited"] == realized["decode"]["visited"] == 0
        assert r["served"] == r["calibration_mode"]
