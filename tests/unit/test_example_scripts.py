"""The example scripts' argument handling and pre-load checks (no engine: these must fail before any model loads)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vllm_serve"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


calibrate = _load("calibrate_sparse_attn")
serve = _load("vllm_serve_sparse_attn")


def test_target_parsing():
    assert calibrate.parse_targets("0.5") == {"prefill": 0.5, "decode": 0.5}
    assert calibrate.parse_targets("prefill=0.6,decode=0.3") == {"prefill": 0.6, "decode": 0.3}
    for bad, msg in (("1.2", r"\[0, 1\)"), ("half", "not a number"), ("verify=0.5", "unknown phase")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            calibrate.parse_targets(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine_kwargs", "{not json"], "--engine_kwargs is not valid JSON"),
        (["--engine_kwargs", "[1]"], "must be a JSON object"),
        (["--decode_tokens", "0"], "--decode_tokens must be >= 1"),
        (["--scale_factors", "1,x"], "--scale_factors must be comma-separated numbers"),
        (["--scale_factors", "1,2"], "at least 3 positive values"),
    ],
)
def test_calibrate_rejects_bad_arguments_before_loading(tmp_path, args, message):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(SystemExit) as exc:
        calibrate.main([str(ckpt), *args, "--output", str(tmp_path / "out.json")])
    assert message in str(exc.value)
    assert not (tmp_path / "out.json").exists()


def test_calibrate_needs_a_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="not a Hugging Face checkpoint directory"):
        calibrate.main([str(tmp_path)])


def test_attention_class_names_follow_modelopt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert calibrate._attention_classes(tmp_path) == ["Qwen3Attention"]
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert calibrate._attention_classes(tmp_path) == ["Attention"]


def test_serve_command_defaults(tmp_path):
    cmd = serve.server_command(tmp_path, ["--port", "8000"], "w.Worker")
    assert cmd[cmd.index("--worker-cls") + 1] == "w.Worker"
    assert "--compilation-config" not in cmd  # vLLM picks the graph mode from the sparse builders
    # the user's choices win
    cmd = serve.server_command(tmp_path, ["--enforce-eager", "--worker-cls=my.W"], "w.Worker")
    assert cmd.count("--worker-cls=my.W") == 1 and "--worker-cls" not in cmd


def test_serve_checks_the_config_before_loading(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with caplog.at_level(logging.WARNING):
        serve.check_checkpoint(tmp_path)
    assert "serving DENSE attention" in caplog.text
    block = {"config_groups": {"g": {"algorithm": "skip_softmax",
                                     "threshold_scale_factor": {"decode": {"a": -1.0, "b": 9.0}},
                                     "target_sparsity": {"decode": 0.5}}}}
    (tmp_path / "config.json").write_text(json.dumps({"sparse_attention_config": block}))
    with pytest.raises(SystemExit, match=r"threshold_scale_factor\.decode\.a"):
        serve.check_checkpoint(tmp_path)
