"""Full CUDA graphs for sparse decode: what the sparse metadata builders declare to vLLM, decided once per engine.

vLLM asks each builder class `get_cudagraph_support(vllm_config, kv_cache_spec)` when it sets up its KV cache and
resolves its CUDA-graph mode from the weakest answer. The sparse builders answer:

- their native builder's support when the engine serves dense (no calibrated phase: every forward is native);
- at most `UNIFORM_SINGLE_TOKEN_DECODE` (never more than the native builder) when full decode graphs are safe:
  vLLM then captures full graphs for uniform decode batches (its default `FULL_AND_PIECEWISE`), and prefill and
  mixed batches stay piecewise;
- `NEVER` otherwise (vLLM falls back to piecewise graphs with attention run eagerly), with the reason logged.

Safe means: a CUDA device, the Triton kernel, serving (calibration appends counts on the host every step), and
the start-up self-test passing on this machine at this engine's shapes (kernels/.../graph_check.py: a captured
launch replayed with new lengths, block tables and λ equals eager launches). `MODELOPT_EXT_SPARSE_ATTN_CUDAGRAPH`
forces `full` (no self-test) or `never`.

What makes the captured launch right at every replay is in the plan (plugins/vllm/plan.py): for a uniform decode
batch the decode grid is sized from `max_model_len`, not from this step's lengths, no host branch picks the dense
path, and counts and the split-K workspace live in persistent buffers. vLLM calls `build` for the padded batch
before every replay (tests/gpu_vllm/.../test_vllm_full_decode_dispatch.py reads both model runners), so the
persistent buffers hold each step's values.

A captured graph also freezes *which* path a layer runs, so an engine that runs full decode graphs refuses to be
switched between serving sparse, serving dense and calibrating (`check_graph_path`); changing λ is fine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from modelopt_ext.torch.kernels.sparsity.attention.api import kernel_launcher
from modelopt_ext.torch.kernels.sparsity.attention.graph_check import decode_graph_self_test

from .compat import impl_sinks
from .env import ENV_CUDAGRAPH, cudagraph_choice
from .kernel_pages import TRITON_PAGE_SIZES
from .kv_cache import fp8_view_dtype

logger = logging.getLogger(__name__)

SELF_TEST_BATCH_SIZES = (1, 8)


@dataclass(frozen=True)
class GraphDecision:
    """Whether the sparse builders of an engine declare full-graph support for uniform decode, and why."""

    full: bool
    reason: str


_SELF_TESTS: dict[tuple, str | None] = {}  # shapes -> the self-test's problem (None: passed), once per process


def graph_path(context) -> str:
    """Which forward a captured decode graph of this context holds: "calibrate", "dense" (native) or "sparse"."""
    if context.calibrating:
        return "calibrate"
    return "dense" if context.serves_dense else "sparse"


def check_graph_path(context, new) -> None:
    """Refuse to reconfigure an engine that replays full decode graphs onto a different forward path."""
    captured = getattr(context, "graph_path", None)
    if captured is None or graph_path(new) == captured:
        return
    raise ValueError(
        f"sparse attention: this engine replays full CUDA graphs captured for {captured} decode, so it cannot switch "
        f"to {graph_path(new)} (a graph replays the path it captured). Start the engine with --enforce-eager or "
        f"-cc.cudagraph_mode=PIECEWISE, or set {ENV_CUDAGRAPH}=never, to switch modes at run time"
    )


def decide(vllm_config, kv_cache_spec, context) -> GraphDecision:
    """The engine's full-graph decision for sparse decode (runs the self-test on a GPU, once per shape)."""
    choice = cudagraph_choice()
    if choice == "never":
        return GraphDecision(False, f"{ENV_CUDAGRAPH}=never")
    if context.calibrating:
        return GraphDecision(False, "calibration records counts on the host every step")
    if choice == "full":
        return GraphDecision(True, f"{ENV_CUDAGRAPH}=full (self-test skipped)")
    device = torch.device(getattr(getattr(vllm_config, "device_config", None), "device", None) or "cpu")
    if device.type != "cuda":
        return GraphDecision(False, f"no CUDA graphs on {device.type}")
    if context.kernel_backend != "triton":
        return GraphDecision(False, f"the {context.kernel_backend} kernel is not capturable (only Triton is)")
    shapes = self_test_shapes(vllm_config, kv_cache_spec)
    key = tuple(sorted(shapes.items(), key=lambda kv: kv[0]))
    if key not in _SELF_TESTS:
        start = time.perf_counter()
        _SELF_TESTS[key] = decode_graph_self_test(
            kernel_launcher("triton"), device=device, batch_sizes=SELF_TEST_BATCH_SIZES, **shapes
        )
        logger.info("sparse attention: CUDA-graph self-test at %s: %s in %.1f s", shapes,
                    "passed" if _SELF_TESTS[key] is None else "failed", time.perf_counter() - start)
    problem = _SELF_TESTS[key]
    if problem is not None:
        return GraphDecision(False, f"the start-up self-test failed ({problem})")
    return GraphDecision(True, f"the start-up self-test passed (batch {', '.join(map(str, SELF_TEST_BATCH_SIZES))})")


def _engine_has_sinks(vllm_config) -> bool:
    """Whether any attention layer of the engine serves with attention sinks (gpt-oss): its decode graphs then
    launch the kernel's sinks variant, which is what the self-test must replay."""
    layers = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    return any(impl_sinks(getattr(layer, "impl", None)) is not None for layer in layers.values())


def self_test_shapes(vllm_config, kv_cache_spec) -> dict:
    """The engine's decode launch for the self-test: heads, head size, page size, max_model_len, dtype, sinks."""
    model = vllm_config.model_config
    page = int(kv_cache_spec.block_size)
    return {
        "sinks": _engine_has_sinks(vllm_config),
        "num_heads": int(model.get_num_attention_heads(vllm_config.parallel_config)),
        "num_kv_heads": int(kv_cache_spec.num_kv_heads),
        "head_size": int(kv_cache_spec.head_size),
        "page_size": page if page in TRITON_PAGE_SIZES else TRITON_PAGE_SIZES[0],
        "max_model_len": int(model.max_model_len),
        "dtype": model.dtype,
        "cache_dtype": fp8_view_dtype(getattr(vllm_config.cache_config, "cache_dtype", None)),
    }
