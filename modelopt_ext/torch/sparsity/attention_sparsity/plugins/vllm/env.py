"""The plugin's environment switches, read in one place (each engine reads them when it starts).

    MODELOPT_EXT_SPARSE_ATTN=0              serve dense: the checkpoint's block is not applied (and the log says so)
    MODELOPT_EXT_SPARSE_ATTN_BACKEND=NAME   kernel backend: auto (default), torch, triton, cpu
    MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY=N    log realized sparsity every N engine steps (default 256, 0: never)
    MODELOPT_EXT_SPARSE_ATTN_STRICT=1       all or nothing: a layer that cannot run sparse is an error, not kept dense
    MODELOPT_EXT_SPARSE_ATTN_CUDAGRAPH=X    full CUDA graphs for sparse decode: auto (default: a start-up self-test on
                                            the GPU decides), full (declare them, no self-test), never
    MODELOPT_EXT_SPARSE_ATTN_METRICS_DIR=D  where workers leave their totals for /metrics (default: a private
                                            directory the server makes and its workers inherit; plugins/vllm/metrics.py)
"""

from __future__ import annotations

import os

ENV_ENABLE = "MODELOPT_EXT_SPARSE_ATTN"
ENV_LOG_EVERY = "MODELOPT_EXT_SPARSE_ATTN_LOG_EVERY"
ENV_BACKEND = "MODELOPT_EXT_SPARSE_ATTN_BACKEND"
ENV_STRICT = "MODELOPT_EXT_SPARSE_ATTN_STRICT"
ENV_CUDAGRAPH = "MODELOPT_EXT_SPARSE_ATTN_CUDAGRAPH"
ENV_METRICS_DIR = "MODELOPT_EXT_SPARSE_ATTN_METRICS_DIR"
CUDAGRAPH_CHOICES = ("auto", "full", "never")
DEFAULT_LOG_EVERY = 256
_OFF = ("0", "false", "off", "no")


def env_flag(name: str, default: bool = True) -> bool:
    """A boolean switch: off for 0/false/off/no (any case), on for anything else, `default` when unset."""
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() not in _OFF


def sparse_attention_enabled() -> bool:
    """False when the user switched the plugin off with MODELOPT_EXT_SPARSE_ATTN=0 (or false/off/no)."""
    return env_flag(ENV_ENABLE)


def kernel_backend_choice() -> str:
    return os.environ.get(ENV_BACKEND, "auto")


def log_every() -> int:
    try:
        return max(0, int(os.environ.get(ENV_LOG_EVERY, DEFAULT_LOG_EVERY)))
    except ValueError:
        return DEFAULT_LOG_EVERY


def strict_mode() -> bool:
    """True when the user asked for all or nothing (MODELOPT_EXT_SPARSE_ATTN_STRICT=1): no layer is kept dense."""
    return env_flag(ENV_STRICT, default=False)


def cudagraph_choice() -> str:
    """auto, full or never (MODELOPT_EXT_SPARSE_ATTN_CUDAGRAPH); anything else is an error naming the choices."""
    value = os.environ.get(ENV_CUDAGRAPH, "auto").strip().lower() or "auto"
    if value not in CUDAGRAPH_CHOICES:
        raise ValueError(f"{ENV_CUDAGRAPH}={value!r}: use one of {', '.join(CUDAGRAPH_CHOICES)}")
    return value
