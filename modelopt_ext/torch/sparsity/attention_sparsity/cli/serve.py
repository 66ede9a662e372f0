"""Serve a checkpoint with calibrated skip-softmax sparse attention through vLLM's OpenAI-compatible server.

    modelopt-ext-serve <ckpt> [any vllm serve arguments]
    python examples/vllm_serve/vllm_serve_sparse_attn.py <ckpt> [any vllm serve arguments]

The checkpoint's `sparse_attention_config` (written by `modelopt-ext-calibrate`) is validated here, before the model
loads; then this process becomes vLLM's API server (same PID) with the plugin's worker RPCs
(`--worker-extension-cls`, composed with one you pass). The package's vLLM general plugin gives every attention
layer the sparse backend and impl after the model loads (before the KV cache exists) and logs which layers run
sparse. A checkpoint without the block serves dense. vLLM chooses the CUDA-graph mode from the sparse metadata
builders (piecewise by default; logged once), so no graph option is needed.
Realized sparsity: the worker logs it every MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY
steps, and `collective_rpc("sparse_attn_status")` returns it (with VLLM_SERVER_DEV_MODE=1, also over HTTP:
POST /collective_rpc {"method": "sparse_attn_status"}).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from . import engine_setup
from .arguments import served_length_warning

logger = logging.getLogger("vllm_serve_sparse_attn")

USAGE = "usage: modelopt-ext-serve <checkpoint> [vllm serve arguments]"


def check_checkpoint(ckpt: Path) -> None:
    """Fail before the model loads on a malformed config; say clearly when the checkpoint serves dense."""
    from modelopt_ext.torch.sparsity.attention_sparsity.checkpoint.config_io import (
        SparseAttentionConfigError,
        load_sparse_attention_config,
    )

    if not (ckpt / "config.json").is_file():
        raise SystemExit(f"error: {ckpt} is not a Hugging Face checkpoint directory (no config.json)")
    try:
        settings = load_sparse_attention_config(ckpt)
    except SparseAttentionConfigError as exc:
        raise SystemExit(
            f"error: {exc}\nfix the block or re-run calibrate_sparse_attn.py --update_checkpoint_config"
        ) from None
    if settings is None:
        logger.warning("%s has no sparse_attention_config: serving DENSE attention "
                       "(run calibrate_sparse_attn.py --update_checkpoint_config first)", ckpt)
        return
    for phase in ("prefill", "decode"):
        calib = settings.phase(phase)
        logger.info("%s: %s", phase, "dense" if calib is None else
                    f"target sparsity {calib.target_sparsity:.2f}, scale factor {calib.scale_factor:.4g}")


def _flag_value(args: list[str], name: str) -> tuple[int, str] | None:
    """(index, value) of `name VALUE` or `name=VALUE` among the arguments, None when absent."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag == name:
            return i, (value if eq else (args[i + 1] if i + 1 < len(args) else ""))
    return None


def server_command(ckpt: Path, extra: list[str]) -> list[str]:
    """vLLM's API server command line with the plugin's worker RPCs (`--worker-extension-cls`), composed with an
    extension class the user names."""
    from modelopt_ext.torch.sparsity.attention_sparsity.plugins.vllm.worker import worker_extension_cls

    extra = list(extra)
    found = _flag_value(extra, "--worker-extension-cls")
    if found is None:
        extra += ["--worker-extension-cls", worker_extension_cls()]
    else:
        i, user = found
        composed = worker_extension_cls(user)
        extra[i : i + (1 if "=" in extra[i] else 2)] = ["--worker-extension-cls", composed]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), *extra]


def _size_flag(args: list[str], names: tuple[str, ...]) -> int:
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in names:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        return int(value) if value.isdigit() else 1
    return 1


def tensor_parallel_size(args: list[str]) -> int:
    """The `--tensor-parallel-size` / `-tp` among vLLM serve arguments (1 when absent or unreadable)."""
    return _size_flag(args, ("--tensor-parallel-size", "--tensor_parallel_size", "-tp"))


def pipeline_parallel_size(args: list[str]) -> int:
    """The `--pipeline-parallel-size` / `-pp` among vLLM serve arguments (1 when absent or unreadable)."""
    return _size_flag(args, ("--pipeline-parallel-size", "--pipeline_parallel_size", "-pp"))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__)
        return 0 if argv else 2
    ckpt = Path(argv[0]).resolve()
    check_checkpoint(ckpt)
    note = served_length_warning(json.loads((ckpt / "config.json").read_text()), argv[1:])
    if note:  # once, at start-up: the law is extrapolated beyond the calibrated lengths
        logger.warning(note)

    from vllm.platforms import current_platform

    env = dict(os.environ)
    if current_platform.is_cpu():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM otherwise claims most of the RAM
        workers = tensor_parallel_size(argv[1:]) * pipeline_parallel_size(argv[1:])
        try:  # vLLM's "auto" binding needs a NUMA node per worker
            bind = engine_setup.set_cpu_threads_bind(env, workers)
        except ValueError as exc:
            raise SystemExit(f"error: --tensor-parallel-size: {exc}; lower it or --pipeline-parallel-size") from None
        if bind:
            logger.info("CPU engine with %d workers: %s=%s", workers, engine_setup.ENV_CPU_BIND, bind)
    cmd = server_command(ckpt, argv[1:])
    logger.info("starting: %s", " ".join(cmd))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)  # keep the PID: stopping this process stops the server
    return 0  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
