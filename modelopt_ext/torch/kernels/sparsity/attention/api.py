"""`paged_skip_softmax_attention`: the one entry point for calibration and serving, dispatching to a backend."""

from __future__ import annotations

import functools
import logging

import torch

from .reference import paged_skip_softmax_attention_reference
from .semantics import as_threshold_tensor, as_trials_tensor, check_inputs, log_thresholds

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")


@functools.cache
def _warn_fallback(reason: str) -> None:
    logger.warning("skip-softmax attention: the Triton kernel does not cover this input (%s); "
                   "using the PyTorch reference", reason)


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (on the CPU it runs only under TRITON_INTERPRET=1, set before import)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def _resolve_backend(backend: str, q: torch.Tensor, k_cache: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if not (q.is_cuda and triton_available()):
            return "torch"
        from .triton_kernel import unsupported_reason

        reason = unsupported_reason(q, k_cache)
        if reason is not None:
            _warn_fallback(reason)
            return "torch"
        return "triton"
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' needs the triton package; install it or use backend='torch'")
    return backend


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
):
    """Causal varlen attention over a paged KV cache, skipping tiles per docs/skip_softmax.md.

    Args:
        q: [total_q, Hq, D] packed queries (any strides).
        k_cache, v_cache: [num_blocks, page_size, Hkv, D] views of the paged cache (any strides for "torch").
        block_table: [B, max_pages] int32 page ids per sequence.
        cu_seqlens_q: [B+1] int32 query offsets; seq_lens_k: [B] int32 key counts including the new tokens.
        softmax_scale: score scale (usually D ** -0.5).
        skip_threshold: None (dense), a float λ, or a per-sequence [B] tensor of λ (λ <= 0 or >= 1: dense).
        threshold_trials: calibration λ trials ([T] or [B, T]); the output stays dense.
        return_skip_counts: also return [B, 1, 2] (visited, skipped) tile counts of what was skipped.
        out: optional [>= total_q, Hq, D] output; rows past total_q are left untouched.
        backend: "torch" (reference), "triton", or "auto" (Triton on CUDA when it covers the input, else the
            reference, with one warning).
        max_seqlen_k: optional host int bounding every `seq_lens_k` (e.g. vLLM's `max_seq_len`); lets the Triton
            decode path size its split-K workspace without a device read.

    Returns:
        `out`, or `(out, counts)` with counts [B, T, 2] int64 when `threshold_trials` or `return_skip_counts`.
    """
    check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, out)
    if threshold_trials is not None and skip_threshold is not None:
        raise ValueError("threshold_trials (calibration, dense output) and skip_threshold (serving) are exclusive")
    batch = seq_lens_k.shape[0]
    total_q = q.shape[0]
    if out is None:
        out = torch.empty(total_q, q.shape[1], q.shape[2], dtype=q.dtype, device=q.device)

    calibrate = threshold_trials is not None
    if calibrate:
        log_lams = log_thresholds(as_trials_tensor(threshold_trials, batch, q.device))
    else:
        lam = as_threshold_tensor(skip_threshold, batch, q.device)
        if lam is None and return_skip_counts:
            lam = torch.zeros(batch, dtype=torch.float32, device=q.device)  # dense, but counted
        log_lams = None if lam is None else log_thresholds(lam).unsqueeze(1)
    want_counts = calibrate or return_skip_counts

    chosen = _resolve_backend(backend, q, k_cache)
    if chosen == "triton":
        from .triton_kernel import paged_skip_softmax_attention_triton

        counts = paged_skip_softmax_attention_triton(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k,
            softmax_scale=softmax_scale, log_lams=log_lams, calibrate=calibrate, out=out, max_seqlen_k=max_seqlen_k,
        )
    else:
        counts = paged_skip_softmax_attention_reference(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k,
            softmax_scale=softmax_scale, log_lams=log_lams, calibrate=calibrate, out=out,
        )
    return (out, counts) if want_counts else out
