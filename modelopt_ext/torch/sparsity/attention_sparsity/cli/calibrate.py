"""Calibrate skip-softmax thresholds through a vLLM engine and write `sparse_attention_config`.

    modelopt-ext-calibrate <ckpt> --target_sparse_ratio 0.5 \
        [--attention_backend FLASHINFER] [--tensor_parallel_size N] [--update_checkpoint_config] \
        [any vLLM engine argument: --block-size 32 --max-num-seqs 4 --kv-cache-dtype auto ...]
    modelopt-ext-calibrate <ckpt> --refit_from sparse_attention_config.records.npz \
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
import os
import sys
import time
from pathlib import Path

from . import engine_setup
from .arguments import (
    CALIBRATION_LENGTHS_KEY,
    CREATED,
    PHASES,
    ArgumentError,
    Plan,
    build_parser,
    check_args,
    remove_created_folders,
    vllm_cli,
)
from .engine_control import (
    Interrupted,
    end_leftover_processes,
    held_stderr,
    private_tmpdir,
    shutdown_engine,
    signals_ignored,
    signals_interrupt,
)

logger = logging.getLogger("calibrate_sparse_attn")

WRITTEN: list[Path] = []  # files this run has written, for an honest message when it is interrupted


def llm_kwargs(args, plan: Plan, max_model_len: int) -> dict:
    """`vllm.LLM` keyword arguments: vLLM's engine arguments as parsed (`EngineArgs.from_cli_args`, passed on as
    `LLM.from_engine_args` does), then what calibration needs, then --engine_kwargs."""
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import worker_extension_cls

    _, engine_args_cls = vllm_cli()
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
    """The CPU engine gets a capped KV cache and, with tensor parallelism, a CPU binding that works without one NUMA
    node per worker."""
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
    with private_tmpdir(), contextlib.ExitStack() as stop:
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
    with signals_ignored():  # a second Ctrl-C must not cut the shutdown short
        llm = get_llm()
        if llm is not None:
            shutdown_engine(llm)
        reaped = end_leftover_processes()
        if reaped:
            logger.warning("ended %d engine process(es) that outlived the engine's shutdown: %s", len(reaped), reaped)


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
    lengths = {p: [int(v) for v in fit.length_range] for p, fit in fits.items() if fit.length_range}
    if lengths:  # what the serve script compares with its --max-model-len (arguments.served_length_warning)
        block["producer"] = {**block["producer"], CALIBRATION_LENGTHS_KEY: lengths}
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
    log_calibrated_lengths(lengths)
    logger.info("wrote %s%s", output, f" and {plot_path}" if plot_path else "")
    if args.update_checkpoint_config:
        WRITTEN.append(write_sparse_attention_config(plan.ckpt, block))
        logger.info("updated %s", WRITTEN[-1])
    return 0


def log_calibrated_lengths(lengths: dict[str, list[int]]) -> None:
    """The calibrated length range, once, at the end: the law is measured there and extrapolated beyond it."""
    if not lengths:
        return
    longest = max(hi for _, hi in lengths.values())
    logger.info("calibrated length range: %s tokens; serve with --max-model-len up to about %d: longer prompts "
                "get the law extrapolated in length (the serve script warns; --calib_max_seqlen widens the range)",
                ", ".join(f"{p} {lo}..{hi}" for p, (lo, hi) in lengths.items()), longest)


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
            min_seqlen=args.calib_min_seqlen, seed=args.seed, data_dir=args.calib_data_dir, exact_top=True,
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


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    WRITTEN.clear()  # per run: a process that calls main twice (tests, a notebook) must not see the last run's files
    CREATED.clear()
    try:
        with signals_interrupt():
            with held_stderr():
                args = build_parser(__doc__).parse_args(argv)
                plan = check_args(args)
            return refit(args, plan) if args.refit_from else calibrate(args, plan)
    except Interrupted as exc:
        done = ", ".join(str(p) for p in WRITTEN) if WRITTEN else "nothing written"
        logger.error("interrupted by %s: engine shut down, %s", exc, done)
        return 128 + exc.signum
    finally:
        if not WRITTEN:
            remove_created_folders()


def console_main(argv=None) -> int:
    """The console script (`modelopt-ext-calibrate`) and the example script: an argument error is one line on stderr
    and exit status 2, no traceback."""
    try:
        return main(argv)
    except ArgumentError as err:
        print(err.text, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(console_main())
