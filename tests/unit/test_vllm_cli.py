"""The calibrate and serve commands (package code and the example scripts that wrap them): argument handling and
pre-load checks (no engine: these must fail before any model loads)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from modelopt_ext.torch.sparsity.attention_sparsity.cli import (
    arguments,
    calibrate,
    engine_setup,
    serve,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vllm_serve"


SMOL_LIKE = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192, "num_attention_heads": 9,
             "num_key_value_heads": 3}


def _ckpt(tmp_path, config=None) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(config if config is not None else SMOL_LIKE))
    return ckpt


def _refused(tmp_path, args, ckpt=None):
    """Run the calibrate script's main in-process; it must stop with an ArgumentError before any engine."""
    ckpt = ckpt or _ckpt(tmp_path)
    with pytest.raises(SystemExit) as exc:
        calibrate.main([str(ckpt), *args, "--output", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()
    return str(exc.value)


def test_target_parsing():
    assert arguments.parse_targets("0.5") == {"prefill": 0.5, "decode": 0.5}
    assert arguments.parse_targets("prefill=0.6,decode=0.3") == {"prefill": 0.6, "decode": 0.3}
    assert arguments.parse_targets("prefill=0.6,decode=dense") == {"prefill": 0.6, "decode": None}
    for bad, msg in (("1.2", r"\[0, 1\)"), ("half", "not a number"), ("verify=0.5", "unknown phase")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            arguments.parse_targets(bad)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine_kwargs", "{not json"], "--engine_kwargs is not valid JSON"),
        (["--engine_kwargs", "[1]"], "must be a JSON object"),
        (["--decode_tokens", "0"], "--decode_tokens must be >= 1"),
        (["--scale_factors", "1,x"], "--scale_factors must be comma-separated numbers"),
        (["--scale_factors", "1,2"], "at least 3 positive values"),
        (["--target_sparse_ratio", "prefill=0.5"], "--target_sparse_ratio: no target for decode; give one number "
                                                   "for both phases, or add decode=<ratio>"),
        (["--target_sparse_ratio", "decode=0.5"], "no target for prefill"),
        (["--target_sparse_ratio", "dense"], "every phase is dense"),
        (["--calib_max_seqlen", "16384"], "--calib_max_seqlen: 16384 plus --decode_tokens 32 exceeds the model's "
                                          "context (max_position_embeddings 8192 in config.json); lower "
                                          "--calib_max_seqlen to 8160 or less"),
        (["--calib_min_seqlen", "4096", "--calib_max_seqlen", "1024"], "--calib_min_seqlen"),
        (["--max_model_len", "9000"], "--max_model_len: 9000 exceeds the model's context"),
        (["--tensor_parallel_size", "2"], "--tensor_parallel_size: the model's 9 attention heads are not divisible "
                                          "by 2; use one of 1, 3, 9"),
        (["--tensor_parallel_size", "0"], "--tensor_parallel_size: must be >= 1"),
        (["--calib_data_dir", "/nonexistent/essays"], "--calib_data_dir"),
        (["--refit_from", "/nonexistent/r.records.npz"], "--refit_from: /nonexistent/r.records.npz does not exist"),
    ],
)
def test_calibrate_rejects_bad_arguments_before_loading(tmp_path, args, message):
    assert message in _refused(tmp_path, args)


def test_default_max_seqlen_follows_the_models_context(tmp_path):
    args = arguments.build_parser().parse_args([str(_ckpt(tmp_path)), "--output", str(tmp_path / "o.json")])
    plan = arguments.check_args(args)
    assert plan.max_seqlen == 8192 - 32 and plan.context == (8192, "max_position_embeddings 8192")
    (tmp_path / "long").mkdir()
    args.checkpoint = str(_ckpt(tmp_path / "long", dict(SMOL_LIKE, max_position_embeddings=131072)))
    assert arguments.check_args(args).max_seqlen == arguments.DEFAULT_MAX_SEQLEN
    (tmp_path / "yarn").mkdir()
    yarn = dict(SMOL_LIKE, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    args.checkpoint = str(_ckpt(tmp_path / "yarn", yarn))
    assert arguments.check_args(args).context == (32768, "max_position_embeddings 8192 x yarn rope factor 4")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (None, None, "does not exist"),
        ("empty.txt", "\n \n", "no prompts (the file is empty)"),
        ("bad.jsonl", '{"prompt": "a"}\n{not json\n', "bad.jsonl:2: not valid JSON"),
        ("schema.jsonl", '{"text": "a"}\n', 'expected an object with a string "prompt" field'),
        ("list.json", '["a", "b"]', "is a .json file"),
        ("latin1.txt", b"caf\xe9\n", "is not UTF-8 text"),
    ],
)
def test_prompts_file_problems_are_argument_errors(tmp_path, name, content, message):
    path = tmp_path / (name or "missing.txt")
    if content is not None:
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    text = _refused(tmp_path, ["--prompts_file", str(path)])
    assert text.startswith("error: --prompts_file: ") and message in text and "JSONL" in text, text


def test_triton_without_a_gpu_is_refused(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the Triton kernel is allowed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # tests/conftest.py sets it for the kernel tests
    assert "--kernel_backend: triton needs a CUDA GPU" in _refused(tmp_path, ["--kernel_backend", "triton"])


def test_checkpoint_with_an_invalid_block_is_refused(tmp_path):
    block = {"config_groups": {"g": {"algorithm": "skip_softmax", "threshold_scale_factor": {"decode": {"a": -1.0,
             "b": 9.0}}, "target_sparsity": {"decode": 0.5}}}}
    ckpt = _ckpt(tmp_path, dict(SMOL_LIKE, sparse_attention_config=block))
    text = _refused(tmp_path, [], ckpt=ckpt)
    assert text.startswith("error: checkpoint: its sparse_attention_config is invalid") and "fix or remove" in text


def test_calibrate_needs_a_checkpoint(tmp_path):
    with pytest.raises(SystemExit, match="not a Hugging Face checkpoint directory"):
        calibrate.main([str(tmp_path)])


def test_output_folder_is_created(tmp_path):
    args = arguments.build_parser().parse_args([str(_ckpt(tmp_path)), "--output", str(tmp_path / "a" / "b" / "o.json")])
    plan = arguments.check_args(args)
    assert plan.output == tmp_path / "a" / "b" / "o.json" and plan.output.parent.is_dir()
    assert plan.records.parent == plan.output.parent
    # a run that writes nothing (here: refused by a later check) leaves no folder behind either
    with pytest.raises(SystemExit, match="--decode_tokens must be >= 1"):
        calibrate.main([str(_ckpt(tmp_path)), "--decode_tokens", "0", "--output", str(tmp_path / "c" / "d" / "o.json")])
    assert not (tmp_path / "c").exists()


def test_output_folder_that_cannot_be_created_is_refused(tmp_path):
    """Tests run as root, who writes anywhere: a folder under a regular file cannot be created by anyone."""
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exc:
        calibrate.main([str(_ckpt(tmp_path)), "--output", str(tmp_path / "afile" / "sub" / "out.json")])
    text = str(exc.value)
    assert text.startswith(f"error: --output: cannot create folder {tmp_path / 'afile' / 'sub'} (") and "\n" not in text
    assert "; pick a path in a folder you can write" in text
    assert (tmp_path / "afile").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ckpt"]


def test_existing_flags_keep_their_names(tmp_path):
    """The README's and the e2e tests' spellings (underscores), own options and vLLM's alike."""
    ckpt = _ckpt(tmp_path)
    args = arguments.build_parser().parse_args([
        str(ckpt), "--target_sparse_ratio", "prefill=0.4,decode=0.3", "--attention_backend", "FLASHINFER",
        "--tensor_parallel_size", "3", "--update_checkpoint_config", "--calib_samples", "3", "--calib_max_seqlen",
        "512", "--calib_min_seqlen", "128", "--decode_tokens", "4", "--prompts_file", "p.txt", "--max_model_len",
        "1024", "--dtype", "float32", "--kernel_backend", "torch", "--scale_factors", "1,10,100", "--engine_kwargs",
        "{}", "--output", "o.json", "--refit_from", "r.npz", "--seed", "7", "--calib_data_dir", "essays",
    ])  # fmt: skip
    assert args.checkpoint == str(ckpt) and args.target_sparse_ratio == {"prefill": 0.4, "decode": 0.3}
    assert (args.attention_backend, args.tensor_parallel_size, args.max_model_len, args.dtype, args.seed) == (
        "FLASHINFER", 3, 1024, "float32", 7)
    assert args.update_checkpoint_config and (args.calib_samples, args.calib_max_seqlen, args.calib_min_seqlen,
                                              args.decode_tokens) == (3, 512, 128, 4)
    assert (args.prompts_file, args.kernel_backend, args.scale_factors, args.engine_kwargs, args.output,
            args.refit_from, args.calib_data_dir) == ("p.txt", "torch", "1,10,100", "{}", "o.json", "r.npz", "essays")
    defaults = arguments.build_parser().parse_args([str(ckpt)])
    assert (defaults.seed, defaults.max_model_len, defaults.tensor_parallel_size, defaults.dtype) == (
        0, None, 1, "auto")
    assert defaults.target_sparse_ratio == {"prefill": 0.5, "decode": 0.5} and defaults.calib_samples == 24


def _llm_kwargs(tmp_path, *flags):
    args = arguments.build_parser().parse_args([str(_ckpt(tmp_path)), *flags, "--output", str(tmp_path / "o.json")])
    return calibrate.llm_kwargs(args, arguments.check_args(args), 640)


def test_vllm_engine_flags_reach_the_engine(tmp_path):
    kwargs = _llm_kwargs(tmp_path, "--block-size", "32", "--max-num-seqs", "4", "--kv-cache-dtype", "auto",
                         "--attention_backend", "FLASHINFER", "--tensor_parallel_size", "3", "--dtype", "float32",
                         "--enable-prefix-caching", "--engine_kwargs", '{"gpu_memory_utilization": 0.5}')
    assert (kwargs["block_size"], kwargs["max_num_seqs"], kwargs["kv_cache_dtype"]) == (32, 4, "auto")
    assert (kwargs["attention_backend"], kwargs["tensor_parallel_size"], kwargs["dtype"]) == (
        "FLASHINFER", 3, "float32")
    assert kwargs["gpu_memory_utilization"] == 0.5 and kwargs["seed"] == 0
    # the script's own requirements on top: its checkpoint, its context length, no prefix caching, eager mode
    assert kwargs["model"] == str(tmp_path / "ckpt") and kwargs["max_model_len"] == 640
    assert kwargs["enable_prefix_caching"] is False and kwargs["enforce_eager"] is True
    # --engine_kwargs is applied last
    assert _llm_kwargs(tmp_path, "--max-num-seqs", "4", "--engine_kwargs", '{"max_num_seqs": 2}')["max_num_seqs"] == 2


def test_calibrate_composes_the_users_worker_extension(tmp_path):
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import SparseAttnWorkerExtension

    assert _resolve(_llm_kwargs(tmp_path)["worker_extension_cls"]) is SparseAttnWorkerExtension
    composed = _resolve(_llm_kwargs(tmp_path, "--worker-extension-cls", "argparse.Namespace")["worker_extension_cls"])
    assert issubclass(composed, argparse.Namespace) and issubclass(composed, SparseAttnWorkerExtension)


def test_calibrate_refuses_a_second_model(tmp_path):
    assert _refused(tmp_path, ["--model", "Qwen/Qwen3-0.6B"]).startswith("error: --model: ")


def test_help_lists_the_scripts_options_and_vllms(capsys):
    with pytest.raises(SystemExit) as exc:
        calibrate.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--target-sparse-ratio" in out and "--calib-samples" in out
    assert "CacheConfig" in out and "ModelConfig" in out  # vLLM's config groups (--help=<group> lists them)


def _script_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


@pytest.mark.parametrize(
    "args",
    [
        ["--target_sparse_ratio", "prefill=0.5"],
        ["--target_sparse_ratio", "prefill=2"],  # argparse's own error
        ["--calib_max_seqlen", "16384"],
        ["--prompts_file", "/nonexistent.jsonl"],
        ["--kernel_backend", "triton"],
        ["--block_size", "many"],  # argparse's error on one of vLLM's engine flags
    ],
)
def test_mistakes_print_one_line_and_no_traceback(tmp_path, args):
    """As a user runs it: exit status 2, one line on stderr naming the argument, before any engine."""
    import torch

    if "triton" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "calibrate_sparse_attn.py"), str(_ckpt(tmp_path)), *args,
                           "--output", str(tmp_path / "out.json")], capture_output=True, text=True,
                          env=_script_env(), timeout=240)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "--" in lines[0] and "Traceback" not in proc.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("script", ["modelopt-ext-calibrate", "modelopt-ext-serve"])
def test_console_scripts_are_installed_with_the_package(tmp_path, script):
    """The package's console scripts (pyproject.toml) run the same programs as the example scripts: a checkpoint
    folder without config.json is refused with one line, exit status 2 (serve: a SystemExit message)."""
    exe = Path(sys.executable).with_name(script)
    assert exe.is_file(), f"{exe} missing: reinstall the package (pip install -e .) to get its console scripts"
    proc = subprocess.run([str(exe), str(tmp_path)], capture_output=True, text=True, env=_script_env(), timeout=240)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and "config.json" in proc.stderr, proc.stderr


def test_read_only_checkpoint_with_update_is_refused(tmp_path):
    """A checkpoint folder this user cannot write: refused before anything loads, config.json untouched. As root
    (who writes anywhere), the script runs without the capability that lets root ignore permissions."""
    ckpt = _ckpt(tmp_path)
    before = (ckpt / "config.json").read_bytes()
    cmd = [sys.executable, str(EXAMPLES / "calibrate_sparse_attn.py"), str(ckpt), "--update_checkpoint_config",
           "--output", str(tmp_path / "o.json")]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot make a folder read-only for this process")
        caps = "-dac_override,-dac_read_search"
        cmd = [setpriv, "--bounding-set", caps, "--inh-caps", caps, *cmd]
    ckpt.chmod(0o555)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_script_env(), timeout=240)
    finally:
        ckpt.chmod(0o755)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("error: --update_checkpoint_config: ") and "read-only" in proc.stderr
    assert (ckpt / "config.json").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_attention_class_names_follow_modelopt(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert calibrate._attention_classes(tmp_path) == ["Qwen3Attention"]
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert calibrate._attention_classes(tmp_path) == ["Attention"]


def test_serve_reads_the_tensor_parallel_size():
    assert serve.tensor_parallel_size(["--port", "1", "--tensor-parallel-size", "2"]) == 2
    assert serve.tensor_parallel_size(["-tp=4"]) == 4 and serve.tensor_parallel_size([]) == 1
    assert serve.pipeline_parallel_size(["-tp", "2", "--pipeline-parallel-size", "2"]) == 2
    assert serve.pipeline_parallel_size(["-pp=3"]) == 3 and serve.pipeline_parallel_size(["-tp", "2"]) == 1


def test_cpu_engine_thread_binding_splits_the_cpus():
    assert engine_setup.cpu_threads_bind(2, [0, 1]) == "0|1"
    assert engine_setup.cpu_threads_bind(2, [4, 5, 6, 7, 8]) == "4,5,6|7,8"
    with pytest.raises(ValueError, match=r"a CPU per worker \(tensor x pipeline parallel size\): 4 workers, 2 CPUs"):
        engine_setup.cpu_threads_bind(4, [0, 1])
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    assert engine_setup.set_cpu_threads_bind(env, 2) is None and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"


def _resolve(qualname: str):
    module, _, attr = qualname.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def test_serve_command_adds_the_worker_extension_composed_with_the_users(tmp_path):
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import SparseAttnWorkerExtension

    cmd = serve.server_command(tmp_path, ["--port", "8000"])
    assert _resolve(cmd[cmd.index("--worker-extension-cls") + 1]) is SparseAttnWorkerExtension
    assert "--compilation-config" not in cmd and "--worker-cls" not in cmd  # vLLM picks graphs and worker
    # the user's extension is kept: one class that has both its methods and the plugin's RPCs
    for user in (["--worker-extension-cls=argparse.Namespace"], ["--worker-extension-cls", "argparse.Namespace"]):
        cmd = serve.server_command(tmp_path, ["--enforce-eager", *user])
        assert cmd.count("--worker-extension-cls") == 1 and "argparse.Namespace" not in cmd
        composed = _resolve(cmd[cmd.index("--worker-extension-cls") + 1])
        assert issubclass(composed, argparse.Namespace) and issubclass(composed, SparseAttnWorkerExtension)
        assert _resolve(cmd[cmd.index("--worker-extension-cls") + 1]) is composed  # one class per process


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


LEFTOVERS = r"""
import json, multiprocessing.resource_tracker as rt, subprocess, sys, time
import psutil
from modelopt_ext.torch.sparsity.attention_sparsity.cli import engine_control

rt.ensure_running()
tracker = rt._resource_tracker._pid
engine = subprocess.Popen(["sh", "-c", "sleep 300 & wait"])  # an "engine" process with a child of its own
time.sleep(0.5)
tree = [engine.pid] + [p.pid for p in psutil.Process(engine.pid).children(recursive=True)]
ended = engine_control.end_leftover_processes(grace=0.5)
alive = [pid for pid in tree if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
print(json.dumps({"tree": tree, "ended": ended, "alive": alive, "tracker": psutil.Process(tracker).is_running()}))
"""


def test_leftover_engine_processes_end_and_the_resource_tracker_stays():
    """vLLM's kill_process_tree ends what outlived the engine's shutdown (with its children); multiprocessing's
    resource tracker is kept. In a child Python, so that no process of the test runner is touched."""
    proc = subprocess.run([sys.executable, "-c", LEFTOVERS], capture_output=True, text=True,
                          env=_script_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(result["tree"]) == 2 and sorted(result["ended"]) == sorted(result["tree"]), result
    assert result["alive"] == [] and result["tracker"] is True, result
