"""Pipeline-parallel calibration and serving on vLLM's CPU engine (issue #27): `--pipeline_parallel_size 2`, two
stage workers, each stage's layer records merged into one calibration, then the checkpoint served with
`--pipeline-parallel-size 2`, sparse on both stages.

A tiny random-weight Llama 3 of 4 layers (tests/e2e/tiny_models.py), so each stage holds 2 attention layers and the
two engine starts stay short. vLLM's CPU engine runs pipeline stages only in its compiled mode (the plugin refuses
`--enforce-eager` there, docs/serving.md), so the server here keeps vLLM's compiled default. Each worker gets one
core of the 2-core CI machine; the scripts bind them themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.request

import pytest
import tiny_models
from e2e_lib import LONG_PROMPT, calibrate_with_readme_command, http_json, serving

pytestmark = pytest.mark.e2e

PP = 2
NUM_LAYERS = 4
VOCAB = 49152  # SmolLM2's tokenizer


@pytest.fixture(scope="module")
def pp_calibrated(smollm2_checkpoint, tmp_path_factory):
    if len(os.sched_getaffinity(0)) < PP:
        pytest.skip(f"pipeline parallelism {PP} on the CPU engine needs {PP} CPUs")
    work = tmp_path_factory.mktemp("pp")
    llama = next(m for m in tiny_models.models(VOCAB) if m.name == "Llama 3")
    llama = dataclasses.replace(llama, kwargs={**llama.kwargs, "num_hidden_layers": NUM_LAYERS}, layers=NUM_LAYERS)
    ckpt = tiny_models.build(llama, smollm2_checkpoint, work / "ckpt")
    log, records = calibrate_with_readme_command(ckpt, work, "--pipeline_parallel_size", str(PP))
    return ckpt, records, log


def test_pipeline_parallel_calibration_merges_both_stages(pp_calibrated):
    ckpt, records, log = pp_calibrated
    assert f"calibration mode on {NUM_LAYERS // PP} layer(s) per rank, {PP} rank(s)" in log, log[-4000:]
    layers = records["layers"]
    assert len(layers) == NUM_LAYERS and len(set(layers)) == NUM_LAYERS, layers  # each stage its own layers
    block = json.loads((ckpt / "config.json").read_text())["sparse_attention_config"]
    assert set(block["config_groups"]["group_0"]["target_sparsity"]) == {"prefill", "decode"}


def test_pipeline_parallel_serving_is_sparse_on_both_stages(pp_calibrated, tmp_path):
    ckpt, _, _ = pp_calibrated
    with serving(ckpt, tmp_path / "serve.log", "--pipeline-parallel-size", str(PP), eager=False) as base:
        http_json(base + "/v1/completions", {"model": "smol", "prompt": LONG_PROMPT, "max_tokens": 16,
                                             "temperature": 0})  # fmt: skip
        statuses = http_json(base + "/collective_rpc", {"method": "sparse_attn_status"})["results"]
        assert len(statuses) == PP, statuses
        assert [s["sparse_layers"] for s in statuses] == [NUM_LAYERS // PP] * PP, statuses
        names = [name for s in statuses for name in s["layers"]]
        assert len(set(names)) == NUM_LAYERS, names  # the stages serve different layers
        for s in statuses:
            realized = s["realized"]
            assert realized["prefill"]["visited"] > 0 and realized["decode"]["visited"] > 0, realized
            assert realized["prefill"]["skipped"] + realized["decode"]["skipped"] > 0, realized
        # /metrics sums the stages' totals (each worker writes its own every LOG_EVERY=4 steps).
        scrape = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
        prefix = 'modelopt_sparse_attn_tiles_visited_total{phase="prefill"}'
        line = next((ln for ln in scrape.splitlines() if ln.startswith(prefix)), None)
        assert line is not None, scrape[-3000:]
        per_stage = [s["realized"]["prefill"]["visited"] for s in statuses]
        assert max(per_stage) < float(line.split()[-1]) <= sum(per_stage), (line, per_stage)
        # each stage's layers once: every layer of the model, served sparse
        assert f'modelopt_sparse_attn_layers{{reason="",served="sparse"}} {float(NUM_LAYERS)}' in scrape
