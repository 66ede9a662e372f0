#!/usr/bin/env python3
"""Calibrate skip-softmax thresholds through a vLLM engine and write `sparse_attention_config`.

    python examples/vllm_serve/calibrate_sparse_attn.py <ckpt> --target_sparse_ratio 0.5 \
        [--attention_backend FLASHINFER] [--tensor_parallel_size N] [--update_checkpoint_config]

Every attention layer runs in calibration mode (dense output; per sequence the visited/skipped tile counts of
each scale-factor trial). Counts are merged over layers and tensor-parallel ranks by raw counts, the law
`scale_factor = a * exp(b * sparsity)` is fitted per phase (prefill, decode), and the ModelOpt-schema block is
written to ./sparse_attention_config.json (with a PNG of the fit beside it) and, with
--update_checkpoint_config, into <ckpt>/config.json (atomically, with a backup).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
logger = logging.getLogger("calibrate_sparse_attn")


def parse_targets(text: str) -> dict[str, float]:
    """'0.5' -> both phases; 'prefill=0.5,decode=0.3' -> per phase."""
    targets = {}
    for part in text.split(","):
        if "=" in part:
            phase, value = part.split("=", 1)
            phase = phase.strip()
        else:
            phase, value = None, part
        try:
            number = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--target_sparse_ratio: {value!r} is not a number") from None
        if not 0.0 <= number < 1.0:
            raise argparse.ArgumentTypeError(f"--target_sparse_ratio must lie in [0, 1), got {number}")
        for p in ((phase,) if phase else ("prefill", "decode")):
            if p not in ("prefill", "decode"):
                raise argparse.ArgumentTypeError(f"--target_sparse_ratio: unknown phase {p!r} (prefill, decode)")
            targets[p] = number
    return targets


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="Hugging Face checkpoint directory (config.json, weights, tokenizer)")
    p.add_argument("--target_sparse_ratio", type=parse_targets, default=parse_targets("0.5"),
                   help="target sparsity: one number for both phases or 'prefill=0.5,decode=0.3' (default 0.5)")
    p.add_argument("--calib_data_dir", default=None, help="optional folder of essay .txt files as extra haystacks")
    p.add_argument("--calib_samples", type=int, default=24, help="number of calibration prompts (default 24)")
    p.add_argument("--calib_max_seqlen", type=int, default=16384, help="longest calibration prompt in tokens")
    p.add_argument("--calib_min_seqlen", type=int, default=None, help="shortest calibration prompt in tokens")
    p.add_argument("--decode_tokens", type=int, default=32, help="decode steps per prompt (calibrates decode)")
    p.add_argument("--prompts_file", default=None, help="text (one prompt per line) or JSONL with 'prompt'; "
                   "replaces the built-in calibration data")
    p.add_argument("--max_model_len", type=int, default=None,
                   help="engine context length (default: the longest prompt plus --decode_tokens)")
    p.add_argument("--dtype", default="auto", help="model dtype for vLLM (default auto)")
    p.add_argument("--attention_backend", default=None,
                   help="vLLM attention backend, e.g. FLASHINFER or FLASH_ATTN (the CPU engine always uses CPU_ATTN)")
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--kernel_backend", default="auto", choices=("auto", "torch", "triton"),
                   help="skip-softmax kernel: Triton on CUDA, the PyTorch reference elsewhere (auto)")
    p.add_argument("--scale_factors", default=None,
                   help="comma-separated threshold trials as scale factors λ·kv_len (default: 1e-2..1e5 log-spaced)")
    p.add_argument("--engine_kwargs", default="{}", help="extra vllm.LLM keyword arguments as JSON")
    p.add_argument("--output", default="sparse_attention_config.json", help="where to write the config block")
    p.add_argument("--update_checkpoint_config", action="store_true",
                   help="also write the block into <checkpoint>/config.json (atomically, with a backup)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _prompts(args, tokenizer):
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.data import (
        build_calibration_prompts,
        load_prompts_file,
        samples_from_prompts,
    )

    if args.prompts_file:
        return samples_from_prompts(tokenizer, load_prompts_file(args.prompts_file))
    return build_calibration_prompts(
        tokenizer, num_samples=args.calib_samples, max_seqlen=args.calib_max_seqlen,
        min_seqlen=args.calib_min_seqlen, seed=args.seed, data_dir=args.calib_data_dir,
    )


def _check_args(args) -> dict:
    """Everything that can be wrong before the model loads: fail here, with the fix in the message."""
    ckpt = Path(args.checkpoint)
    if not (ckpt / "config.json").is_file():
        raise SystemExit(f"error: {ckpt} is not a Hugging Face checkpoint directory (no config.json)")
    if args.decode_tokens < 1:
        raise SystemExit("error: --decode_tokens must be >= 1 (decode needs at least one step to calibrate)")
    if args.calib_samples < 1:
        raise SystemExit("error: --calib_samples must be >= 1")
    try:
        engine_kwargs = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"error: --engine_kwargs is not valid JSON: {exc}") from None
    if not isinstance(engine_kwargs, dict):
        raise SystemExit("error: --engine_kwargs must be a JSON object, e.g. '{\"gpu_memory_utilization\": 0.8}'")
    return engine_kwargs


def _scale_factors(args) -> list[float]:
    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import default_threshold_trials

    if not args.scale_factors:
        return default_threshold_trials()
    try:
        values = [float(v) for v in args.scale_factors.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"error: --scale_factors must be comma-separated numbers: {args.scale_factors!r}") from None
    if len(values) < 3 or any(v <= 0 for v in values):
        raise SystemExit("error: --scale_factors needs at least 3 positive values")
    return sorted(values)


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


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_kwargs = _check_args(args)
    ckpt = Path(args.checkpoint).resolve()
    scale_factors = _scale_factors(args)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    samples = _prompts(args, tokenizer)
    longest = max(s.num_tokens for s in samples)
    max_model_len = args.max_model_len or longest + args.decode_tokens
    if longest + args.decode_tokens > max_model_len:
        raise SystemExit(
            f"error: --max_model_len {max_model_len} is shorter than the longest calibration prompt ({longest} tokens)"
            f" plus --decode_tokens {args.decode_tokens}; raise --max_model_len or lower --calib_max_seqlen"
        )
    logger.info("%d calibration prompts, %d..%d tokens; %d scale-factor trials", len(samples),
                min(s.num_tokens for s in samples), longest, len(scale_factors))

    # The worker module must import in vLLM's worker processes too.
    sys.path.insert(0, str(HERE))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    from sparse_attn_worker import default_worker_cls
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM otherwise claims most of the RAM
    llm_kwargs = dict(
        model=str(ckpt), dtype=args.dtype, max_model_len=max_model_len, tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=True, enable_prefix_caching=False, seed=args.seed, worker_cls=default_worker_cls(),
    )
    if args.attention_backend:
        llm_kwargs["attention_backend"] = args.attention_backend
    llm_kwargs.update(engine_kwargs)
    llm = LLM(**llm_kwargs)

    from tqdm import tqdm

    from modelopt_ext.torch.sparsity.attention_sparsity.calibration.fit import (
        CalibrationFitError,
        fit_phases,
        plot_fit,
        points_from_merged_record,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.sparse_attn_config import (
        build_sparse_attention_config,
        write_json_atomic,
        write_sparse_attention_config,
    )
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm_calibration_records import (
        merge_calibration_records,
    )

    status = llm.collective_rpc("sparse_attn_enable_calibration", args=(scale_factors, args.kernel_backend))
    logger.info("calibration mode on %s layer(s) per rank (%s)", status[0]["layers"],
                ", ".join(status[0]["native_impls"]))
    params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for sample in tqdm(samples, desc="calibrating", unit="prompt"):
        llm.generate([sample.prompt], params, use_tqdm=False)
    logger.info("ran %d prompts in %.1f s", len(samples), time.perf_counter() - start)

    merged = merge_calibration_records(llm.collective_rpc("sparse_attn_collect_counts"))
    points = points_from_merged_record(merged)
    try:
        fits = fit_phases(points)
    except CalibrationFitError as exc:
        logger.error("calibration failed, nothing written: %s", exc)
        return 2
    missing = [p for p in ("prefill", "decode") if p not in fits]
    if missing:
        logger.error("no calibration points for %s, nothing written: run prompts with decode steps "
                     "(--decode_tokens) and prompts longer than one tile (64 tokens)", ", ".join(missing))
        return 2

    block = build_sparse_attention_config(fits, target_sparsity=args.target_sparse_ratio,
                                          attention_classes=_attention_classes(ckpt))
    output = write_json_atomic(Path(args.output), block)
    try:
        plot_path = plot_fit(points, fits, output.with_suffix(".png"))
    except ImportError as exc:  # the plot is a convenience; the config is what matters
        logger.warning("no plot written: %s", exc)
        plot_path = None
    for phase, fit in fits.items():
        target = args.target_sparse_ratio[phase]
        logger.info("%s: a=%.4g b=%.4g (R²=%.3f, %d points, observed sparsity %.2f..%.2f); target %.2f -> "
                    "scale factor %.4g", phase, fit.a, fit.b, fit.r2, fit.n_points, *fit.sparsity_range, target,
                    fit.scale_factor(target))
    logger.info("wrote %s%s", output, f" and {plot_path}" if plot_path else "")
    if args.update_checkpoint_config:
        logger.info("updated %s", write_sparse_attention_config(ckpt, block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
