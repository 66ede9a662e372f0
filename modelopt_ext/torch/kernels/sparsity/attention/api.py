"""The entry points of the paged skip-softmax kernels.

- `paged_skip_softmax_attention`: the public entry for direct callers; checks and normalises every argument on each
  call, then dispatches to a backend.
- `kernel_launcher(backend)`: the internal launch entry of one resolved backend, for callers that checked shapes,
  dtypes, page size and backend once and normalise the law once per step (the vLLM plugin's impls): no checks, no
  normalisation, no copy of the query, no allocation beyond what the kernel itself writes (its counts).
"""

from __future__ import annotations

import functools
import logging
import math

import torch

from . import cpu_kernel
from .reference import paged_skip_softmax_attention_reference
from .semantics import (
    check_inputs,
    checked_kv_scale,
    checked_sinks,
    default_prompt_lens,
    is_fp8_cache,
    normalize_thresholds,
)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton", "cpu")


@functools.cache
def _warn_fallback(reason: str) -> None:
    logger.warning("skip-softmax attention: %s; using the PyTorch reference", reason)


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (on the CPU it runs only under TRITON_INTERPRET=1, set before import)."""
    try:  # imported here, not at module level: Triton is optional, and it reads TRITON_INTERPRET when imported
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def choose_backend(device_type: str, dtype=None, q=None, k_cache=None) -> tuple[str, str | None]:
    """What backend "auto" stands for: `(backend, why the fast kernel does not serve or None)`.

    The one decision for every caller: the public entry point per input (`q`, `k_cache`), the vLLM plugin once per
    engine (device type and model dtype). On the CPU the compiled kernel where it loads and covers the dtype, on
    CUDA Triton where it is installed and covers the input; otherwise the PyTorch reference, with the reason.
    """
    if device_type == "cpu":
        if q is not None:
            reason = cpu_kernel.unsupported_reason(q, k_cache)
        elif dtype is not None and dtype not in cpu_kernel.CPU_KERNEL_DTYPES:
            reason = f"the compiled CPU kernel does not cover {dtype}"
        else:
            reason = cpu_kernel.unavailable_reason()
        return ("torch", reason) if reason is not None else ("cpu", None)
    if device_type != "cuda":
        return "torch", f"no fast kernel for {device_type} tensors"
    if not triton_available():
        return "torch", "triton is not installed"
    if q is not None:
        from .triton_kernel import unsupported_reason  # Triton is optional (triton_available above)

        reason = unsupported_reason(q, k_cache)
        if reason is not None:
            return "torch", f"the Triton kernel does not cover this input ({reason})"
    return "triton", None


def resolve_backend(backend: str, q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """The backend `paged_skip_softmax_attention(..., backend=backend)` runs on this input: "auto" resolved by
    `choose_backend` (a fallback's reason logged once), an explicit backend checked (RuntimeError where it cannot
    run the input)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        chosen, reason = choose_backend(q.device.type, q=q, k_cache=k_cache)
        if reason is not None and (q.device.type == "cpu" or (q.is_cuda and triton_available())):
            _warn_fallback(reason)  # once per reason; CUDA without triton and other devices fall back quietly
        return chosen
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
    if backend == "cpu":
        reason = cpu_kernel.unsupported_reason(q, k_cache)
        if reason is not None:
            raise RuntimeError(f"backend='cpu' cannot run this input: {reason}; use backend='auto' or 'torch'")
    return backend


def _checked_prompt_lens(prompt_lens, batch: int, cu_seqlens_q, seq_lens_k, device) -> torch.Tensor:
    """[B] int32 prompt lengths on the query's device: the caller's, checked, or the kernel's default rule."""
    if prompt_lens is None:
        return default_prompt_lens(cu_seqlens_q, seq_lens_k)
    if prompt_lens.dim() != 1 or prompt_lens.shape[0] != batch:
        raise ValueError(f"prompt_lens must be [B]=[{batch}], got {tuple(prompt_lens.shape)}")
    return prompt_lens.to(device=device, dtype=torch.int32)


def _checked_softcap(logits_soft_cap: float | None) -> float:
    """The soft cap as the backends take it (0.0: off); refuses a negative or non-finite cap."""
    softcap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    if not (math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"logits_soft_cap must be a finite number >= 0 (0 or None: off), got {logits_soft_cap!r}")
    return softcap


def _fp8_scales(k_cache, k_scale, v_scale) -> dict:
    """An FP8 cache's scales as the backends take them (host floats), or {} for a cache in q's dtype (no argument, so
    every backend build keeps the launch it always had)."""
    if not is_fp8_cache(k_cache):
        return {}
    return dict(k_scale=checked_kv_scale(k_scale, "k_scale"), v_scale=checked_kv_scale(v_scale, "v_scale"))


def _run_backend(chosen: str, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *, max_seqlen_k, **kwargs):
    """Run the resolved backend on already normalized arguments; its counts (None when it counts nothing)."""
    if chosen == "triton":
        from .triton_kernel import paged_skip_softmax_attention_triton  # Triton is optional (triton_available)

        return paged_skip_softmax_attention_triton(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_k=max_seqlen_k, **kwargs
        )
    if chosen == "cpu":
        return cpu_kernel.paged_skip_softmax_attention_cpu(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, **kwargs
        )
    return paged_skip_softmax_attention_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, **kwargs)


def paged_skip_softmax_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    softmax_scale: float,
    skip_threshold: float | torch.Tensor | None = None,
    threshold_trials=None,
    return_skip_counts: bool = False,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    max_seqlen_k: int | None = None,
    log_scale_factors: torch.Tensor | None = None,
    length_exponents: torch.Tensor | None = None,
    prompt_lens: torch.Tensor | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
):
    """Causal varlen attention over a paged KV cache, dropping key tiles per row per docs/skip_softmax.md.

    Args:
        q: [total_q, Hq, D] packed queries (any strides).
        k_cache, v_cache: [num_blocks, page_size, Hkv, D] views of the paged cache (any strides for "torch"), or
            the 6-D split views of vLLM's CPU `amx` layout (`semantics.cache_geometry`; "torch" and "cpu"). In q's
            dtype, or FP8 (`torch.float8_e4m3fn` / `torch.float8_e5m2`) with q in fp16, bf16 or fp32.
        block_table: [B, max_pages] int32 page ids per sequence.
        cu_seqlens_q: [B+1] int32 query offsets; seq_lens_k: [B] int32 key counts including the new tokens.
        softmax_scale: score scale (usually D ** -0.5).
        skip_threshold: None (dense), a float λ, or a per-sequence [B] tensor of λ (λ <= 0 or >= 1: dense).
        threshold_trials: calibration λ trials ([T] or [B, T]) for every row; the output stays dense.
        return_skip_counts: also return [B, 1, 2] (visited, skipped) row-tile counts of what was dropped.
        out: optional [>= total_q, Hq, D] output; rows past total_q are left untouched.
        backend: "torch" (reference), "triton", "cpu" (compiled CPU kernel, built on first use), or "auto" (Triton
            on CUDA / the compiled kernel on CPU when it covers the input, else the reference, the reason logged).
        max_seqlen_k: optional host int bounding every `seq_lens_k` (e.g. vLLM's `max_seq_len`); lets the Triton
            decode path size its split-K workspace without a device read.
        log_scale_factors: the calibrated law instead of a plain λ: [B, 2] (serving) or [B, T, 2] (calibration,
            dense output) float32 `c` per (prefill, decode) phase, ln λ_row = c - γ·ln(n) (-inf: dense phase).
        length_exponents: γ per phase, [2] or [B, 2] (default 1: NVIDIA ModelOpt's λ = sf / n law).
        prompt_lens: [B] int32 prompt length of each request: rows before it are prefill rows with n =
            prompt_len, later rows decode rows with n = position + 1. Default: q_len > 1 is all prompt,
            q_len == 1 is decode. Pass the request's real prompt length to make results chunking-invariant.
        logits_soft_cap: logit soft-capping (Gemma 2's `attn_logit_softcapping`): every score becomes
            cap·tanh(score / cap) before the skip test and the softmax (None or 0: off).
        sinks: attention sinks (gpt-oss), one finite logit per query head ([Hq], scaled-score units, never capped):
            each joins its head's softmax denominator and the skip test's reference max (docs/skip_softmax.md v3).
        k_scale, v_scale: an FP8 cache's per-layer scales (vLLM's `layer._k_scale_float` / `_v_scale_float`): a
            key is its FP8 value times k_scale, a value times v_scale (None: 1.0; ignored for other caches).

    Returns:
        `out`, or `(out, counts)` with counts [B, T, 2] int64 when calibrating or `return_skip_counts`.
    """
    check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, out)
    batch = seq_lens_k.shape[0]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

    log_sf, gamma, calibrate = normalize_thresholds(
        batch, q.device, skip_threshold=skip_threshold, threshold_trials=threshold_trials,
        log_scale_factors=log_scale_factors, length_exponents=length_exponents,
        return_skip_counts=return_skip_counts,
    )
    prompt_lens = _checked_prompt_lens(prompt_lens, batch, cu_seqlens_q, seq_lens_k, q.device)
    want_counts = calibrate or return_skip_counts
    softcap = _checked_softcap(logits_soft_cap)
    sinks = checked_sinks(sinks, q.shape[1], q.device)
    fp8 = _fp8_scales(k_cache, k_scale, v_scale)

    chosen = resolve_backend(backend, q, k_cache)
    counts = _run_backend(
        chosen, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, max_seqlen_k=max_seqlen_k,
        softmax_scale=softmax_scale, log_sf=log_sf, gamma=gamma, prompt_lens=prompt_lens, calibrate=calibrate,
        out=out, softcap=softcap, sinks=sinks, **fp8,
    )
    return (out, counts) if want_counts else out


def _launch_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *, max_seqlen_k=None,
                      workspace=None, decode_only=False, **kwargs):
    return paged_skip_softmax_attention_reference(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, **kwargs)


def _adding_totals(launch):
    """A launch that also adds trial 0's counts into `totals` = (phase index [B], totals [phases, 2]) (device op)."""

    @functools.wraps(launch)
    def run(*args, totals=None, **kwargs):
        counts = launch(*args, **kwargs)
        if totals is not None and counts is not None:
            totals[1].index_add_(0, totals[0], counts[:, 0, :])
        return counts

    return run


@functools.cache
def kernel_launcher(backend: str):
    """The launch function of a resolved kernel backend ("torch", "triton" or "cpu"), all with one signature:

        launch(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *, softmax_scale, log_sf, gamma,
               prompt_lens, calibrate, out, max_seqlen_k=None, counts=None, workspace=None, decode_only=False,
               totals=None, softcap=0.0, sinks=None[, k_scale=1.0, v_scale=1.0]) -> counts [B, T, 2] int64, or None

    The arguments must already be in the backends' form (`normalize_thresholds`: `log_sf` [B, T, 2] float32 with
    -inf for dense phases, or None; `gamma` [B, 2] float32; int32 contiguous `prompt_lens`, `cu_seqlens_q`,
    `seq_lens_k` and `block_table`); q and out may be strided views with more rows than `cu_seqlens_q[-1]` (those
    are neither read nor written). Nothing is checked: `paged_skip_softmax_attention` is the entry that checks.
    `counts` is a persistent int64 [B, T, 2] buffer the launch zeroes and fills (no allocation); `totals` =
    (phase index [B] int64, totals [phases, 2] int64) also adds trial 0's counts into totals[phase[b]] (serving
    statistics; inside the op for the compiled CPU kernel); `softcap` > 0 caps scores (cap·tanh(s / cap)); `sinks`
    None or a contiguous float32 [Hq] tensor of attention-sink logits (`semantics.checked_sinks`); `k_scale` /
    `v_scale` host floats dequantizing an FP8 cache (passed only with one, so builds without them still launch);
    `workspace` and `decode_only` are the Triton kernel's (`triton_kernel.launch_triton`), ignored by the others.
    Resolved once per backend (cached).
    """
    if backend == "cpu":
        return cpu_kernel.launch_cpu
    if backend == "triton":
        from .triton_kernel import launch_triton  # Triton is optional (triton_available)

        return _adding_totals(launch_triton)
    if backend == "torch":
        return _adding_totals(_launch_reference)
    raise ValueError(f"kernel_launcher takes a resolved backend ('torch', 'triton', 'cpu'), got {backend!r}")
