"""Tile geometry and input checks shared by every skip-softmax path (see docs/skip_softmax.md).

The constants fix which tiles exist, so calibration counts, serving skips and the reference agree on every
device. Never tune them per GPU: change them here (and in the document) or not at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# The version of docs/skip_softmax.md every path implements (defined once, free of torch, for the checkpoint too).
from ..contract_version import CONTRACT_VERSION as CONTRACT_VERSION

TILE_K = 64
"""Keys per tile, aligned to absolute key positions."""

SPLIT_TOKENS = 2048
"""Keys per split (aligned to absolute positions): a row's reference max restarts at each split, seeded with its
first tile (the anchor), so decode kernels can process splits in parallel."""

DECODE_SPLIT_TOKENS = SPLIT_TOKENS
"""Version-1 name of `SPLIT_TOKENS` (splits now apply to every row, not only decode)."""

TILE_Q = 64
"""Rows per work block of the kernels (a multiple of `DECISION_BLOCK_ROWS`, aligned the same way)."""

DECISION_BLOCK_ROWS = 64
"""Prompt rows decide per aligned block of this many absolute positions (`pos // DECISION_BLOCK_ROWS`) of one query
head: a block drops a tile only when every one of its prompt rows in the call drops it. For the decisions not to
depend on chunking, a caller cuts prompts into calls only at multiples of it (the vLLM plugin's scheduler does)."""

RECENT_WINDOW = 128
"""A row never drops a tile holding one of its own `RECENT_WINDOW` most recent keys (`pos - RECENT_WINDOW + 1 ..
pos`), before its block's or its group's AND."""

assert SPLIT_TOKENS % TILE_K == 0
assert TILE_Q % DECISION_BLOCK_ROWS == 0


def first_droppable_window_tile(pos):
    """Tiles `t` with `t < first_droppable_window_tile(pos)` lie wholly before the row's recent window (keys
    `pos - RECENT_WINDOW + 1 .. pos`); the row may drop only those (and never tile 0). Works on ints and tensors."""
    return (pos - RECENT_WINDOW + 1) // TILE_K


def decode_workspace_numel(batch: int, num_heads: int, head_size: int, max_seqlen_k: int) -> tuple[int, int]:
    """Elements (fp32 accumulators, fp32 max/sum pairs) of the split-K workspace a decode launch of this shape
    needs (the Triton kernel: one slot per sequence, query head and split, the head padded to a power of two >= 16);
    what a caller keeping a persistent workspace must provide. (1, 1) when every sequence fits one split."""
    splits = max(1, math.ceil(max_seqlen_k / SPLIT_TOKENS))
    if splits == 1:
        return 1, 1
    block_d = max(16, 1 << max(0, head_size - 1).bit_length())
    return batch * num_heads * splits * block_d, batch * num_heads * splits * 2

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""FP8 cache dtypes every path reads (docs/skip_softmax.md "Inputs"): vLLM's `fp8` / `fp8_e4m3` and `fp8_e5m2`."""
FP8_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Query (model) dtypes served over an FP8 cache."""
_FNUZ_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))


def is_fp8_cache(cache: torch.Tensor) -> bool:
    """True for an FP8 cache view (its keys and values are the bytes times the layer's scales)."""
    return cache.dtype in FP8_CACHE_DTYPES


def checked_kv_scale(scale, name: str) -> float:
    """A K or V cache scale as the backends take it: a host float (None: 1.0), finite and > 0. A tensor is read once
    here (a host sync): the vLLM plugin passes the layer's `_k_scale_float` / `_v_scale_float` instead."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"{name} must be one per-layer scale (a float or a 1-element tensor), got shape "
                             f"{tuple(scale.shape)}")
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a float (the layer's FP8 cache scale), got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{name} must be finite and > 0 (1.0 when the checkpoint has no KV-cache scales), got {scale}")
    return float(scale)


def is_dense_threshold(lam: float | None) -> bool:
    """True when a threshold means 'skip nothing' (None, NaN, <= 0 or >= 1)."""
    return lam is None or not (0.0 < lam < 1.0)


def log_thresholds(lam: torch.Tensor) -> torch.Tensor:
    """ln(λ) as float32, with dense entries (<= 0, >= 1, NaN) mapped to -inf so no tile ever passes the test."""
    lam = lam.to(torch.float64)
    dense = ~((lam > 0) & (lam < 1))
    out = torch.log(torch.where(dense, torch.ones_like(lam), lam))
    return torch.where(dense, torch.full_like(out, -math.inf), out).to(torch.float32)


def as_threshold_tensor(skip_threshold, batch: int, device) -> torch.Tensor | None:
    """Normalise `skip_threshold` (None, float, or [B] tensor) to a float32 [B] tensor on `device`, or None."""
    if skip_threshold is None:
        return None
    if isinstance(skip_threshold, (int, float)):
        return torch.full((batch,), float(skip_threshold), dtype=torch.float32, device=device)
    if not isinstance(skip_threshold, torch.Tensor):
        raise TypeError(f"skip_threshold must be None, a float or a [B] tensor, got {type(skip_threshold).__name__}")
    if skip_threshold.dim() != 1 or skip_threshold.shape[0] != batch:
        raise ValueError(f"skip_threshold must have shape [B]=[{batch}], got {tuple(skip_threshold.shape)}")
    return skip_threshold.to(device=device, dtype=torch.float32)


def normalize_thresholds(
    batch: int,
    device,
    *,
    skip_threshold=None,
    threshold_trials=None,
    log_scale_factors=None,
    length_exponents=None,
    return_skip_counts: bool = False,
):
    """Every way of giving λ, as the one form the backends take: `(log_sf [B, T, 2], gamma [B, 2], calibrate)`.

    ln λ of a row = log_sf[b, t, phase] - gamma[b, phase] * ln(n) (docs/skip_softmax.md), phase 0 = prefill,
    1 = decode. `log_sf` is None when nothing is skipped and nothing is counted. A plain λ (`skip_threshold`,
    `threshold_trials`) is `log_sf = ln λ` for both phases with `gamma = 0`; entries that are dense (λ <= 0,
    λ >= 1, NaN) become -inf.
    """
    given = [n for n, v in (("skip_threshold", skip_threshold), ("threshold_trials", threshold_trials),
                            ("log_scale_factors", log_scale_factors)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of skip_threshold, threshold_trials, log_scale_factors (got {given})")
    if length_exponents is not None and log_scale_factors is None:
        raise ValueError("length_exponents needs log_scale_factors")
    zeros = torch.zeros(batch, 2, dtype=torch.float32, device=device)
    if threshold_trials is not None:
        log_lam = log_thresholds(as_trials_tensor(threshold_trials, batch, device))
        return log_lam.unsqueeze(-1).expand(-1, -1, 2).contiguous(), zeros, True
    if log_scale_factors is not None:
        if not isinstance(log_scale_factors, torch.Tensor):
            raise TypeError("log_scale_factors must be a [B, 2] (serving) or [B, T, 2] (calibration) tensor")
        calibrate = log_scale_factors.dim() == 3
        log_sf = log_scale_factors.to(device=device, dtype=torch.float32)
        if not calibrate:
            log_sf = log_sf.unsqueeze(1)
        if log_sf.dim() != 3 or log_sf.shape[0] != batch or log_sf.shape[2] != 2 or log_sf.shape[1] == 0:
            raise ValueError(
                f"log_scale_factors must be [B={batch}, 2] or [B={batch}, T, 2], got {tuple(log_scale_factors.shape)}"
            )
        log_sf = torch.nan_to_num(log_sf, nan=-math.inf, posinf=-math.inf).contiguous()
        if length_exponents is None:
            gamma = torch.ones(batch, 2, dtype=torch.float32, device=device)
        else:
            gamma = torch.as_tensor(length_exponents, dtype=torch.float32, device=device)
            if gamma.dim() == 1 and gamma.shape[0] == 2:
                gamma = gamma.unsqueeze(0).expand(batch, 2)
            if gamma.shape != (batch, 2):
                raise ValueError(f"length_exponents must be [2] or [B={batch}, 2], got {tuple(gamma.shape)}")
            gamma = gamma.contiguous()
        return log_sf, gamma, calibrate
    lam = as_threshold_tensor(skip_threshold, batch, device)
    if lam is None:
        if not return_skip_counts:
            return None, zeros, False
        lam = torch.zeros(batch, dtype=torch.float32, device=device)  # dense, but counted
    log_lam = log_thresholds(lam)
    return log_lam[:, None, None].expand(-1, 1, 2).contiguous(), zeros, False


def default_prompt_lens(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor) -> torch.Tensor:
    """Prompt lengths when the caller has none: q_len > 1 is all prompt, q_len == 1 is a decode step."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    return torch.where(q_lens == 1, seq_lens_k - 1, seq_lens_k).to(torch.int32)


def row_log_thresholds(
    log_sf: torch.Tensor, gamma: torch.Tensor, prompt_lens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """ln λ [N, T, R] (float32) of rows at absolute `positions` [N, R] of N sequences; -inf where nothing drops.

    log_sf: [N, T, 2], gamma: [N, 2], prompt_lens: [N]. The per-row law of docs/skip_softmax.md, written once
    for torch code: phase = decode iff pos >= prompt_len; n = prompt_len (prefill) or pos + 1 (decode).
    """
    prompt = prompt_lens.to(positions.device, torch.int64).unsqueeze(1)
    decode = positions >= prompt
    n = torch.where(decode, positions + 1, prompt.clamp_min(1).expand_as(positions)).to(torch.float64)
    phase = decode.long()
    n_seq, n_trials = log_sf.shape[0], log_sf.shape[1]
    c = torch.gather(log_sf.to(torch.float64), 2, phase.unsqueeze(1).expand(n_seq, n_trials, phase.shape[1]))
    g = torch.gather(gamma.to(torch.float64), 1, phase)
    out = (c - (g * torch.log(n)).unsqueeze(1)).to(torch.float32)
    return torch.where(out < 0, out, torch.full_like(out, -math.inf))  # NaN, >= 0 (λ >= 1): no drop


def as_trials_tensor(threshold_trials, batch: int, device) -> torch.Tensor | None:
    """Normalise calibration trials (a sequence of λ, a [T] or a [B, T] tensor) to float32 [B, T], or None."""
    if threshold_trials is None:
        return None
    if isinstance(threshold_trials, torch.Tensor):
        trials = threshold_trials.to(device=device, dtype=torch.float32)
    elif isinstance(threshold_trials, Sequence):
        trials = torch.tensor([float(t) for t in threshold_trials], dtype=torch.float32, device=device)
    else:
        raise TypeError("threshold_trials must be a sequence of floats or a [T] / [B, T] tensor")
    if trials.dim() == 1:
        trials = trials.unsqueeze(0).expand(batch, -1)
    if trials.dim() != 2 or trials.shape[0] != batch or trials.shape[1] == 0:
        raise ValueError(f"threshold_trials must be [T] or [B={batch}, T] with T >= 1, got {tuple(trials.shape)}")
    return trials.contiguous()


def checked_sinks(sinks, num_heads: int, device) -> torch.Tensor | None:
    """The attention sinks as the backends take them: None, or a contiguous float32 [Hq] tensor on `device`.

    One finite logit per query head, in the units of the scaled scores (docs/skip_softmax.md, version 3).
    """
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"sinks must be None or a [Hq] float tensor (one logit per query head), got {type(sinks).__name__}"
        )
    if sinks.dim() != 1 or sinks.shape[0] != num_heads:
        raise ValueError(
            f"sinks must have shape [Hq]=[{num_heads}] (one logit per query head), got {tuple(sinks.shape)}"
        )
    if not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor, got {sinks.dtype}")
    out = sinks.detach().to(device=device, dtype=torch.float32).contiguous()
    if not bool(torch.isfinite(out).all()):
        raise ValueError("sinks must be finite (pass sinks=None for a model without attention sinks)")
    return out


def cache_geometry(cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_blocks, page_size, Hkv, D) of a K or V cache view.

    A view is `[num_blocks, page, Hkv, D]`, or 6-D `[num_blocks, page // p2, p2, Hkv, D // d2, d2]` with token
    and dim axes split, element (b, t, h, d) at `[b, t // p2, t % p2, h, d // d2, d % d2]`: the only zero-copy views
    of vLLM's CPU `amx` layout (K: p2 = 16, d2 = 2; V: p2 = 2, d2 = 16; docs/cpu_amx_layout.md §3).
    """
    if cache.dim() == 6:
        return cache.shape[0], cache.shape[1] * cache.shape[2], cache.shape[3], cache.shape[4] * cache.shape[5]
    return cache.shape[0], cache.shape[1], cache.shape[2], cache.shape[3]


def check_inputs(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, out) -> None:
    """Validate shapes and dtypes early, with errors that say what vLLM-style input is expected."""
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, Hq, D], got shape {tuple(q.shape)}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() not in (4, 6):
            raise ValueError(
                f"{name} must be a [num_blocks, page_size, Hkv, D] view, or the 6-D split view of `cache_geometry` "
                f"(use the plugin's KV-cache view helpers), got shape {tuple(cache.shape)}"
            )
        if cache.dtype in _FNUZ_DTYPES:
            raise TypeError(f"{name} is {cache.dtype} (ROCm's FP8); the kernels read FP8 caches of {FP8_CACHE_DTYPES}")
    if k_cache.dim() != v_cache.dim() or cache_geometry(k_cache) != cache_geometry(v_cache):
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must hold the same "
                         "[num_blocks, page_size, Hkv, D]")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"unsupported query dtype {q.dtype}; expected one of {SUPPORTED_DTYPES}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share one dtype")
    if is_fp8_cache(k_cache):
        if q.dtype not in FP8_QUERY_DTYPES:
            raise TypeError(f"an FP8 cache ({k_cache.dtype}) is read with a query in {FP8_QUERY_DTYPES}, not {q.dtype}")
    elif k_cache.dtype != q.dtype:
        raise TypeError(f"q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share one dtype "
                        f"(or the caches be FP8: {FP8_CACHE_DTYPES})")
    hq, d = q.shape[1], q.shape[2]
    _, _, hkv, cache_d = cache_geometry(k_cache)
    if cache_d != d:
        raise ValueError(f"head size mismatch: q has D={d}, the cache has D={cache_d}")
    if hq % hkv != 0:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"block_table must be an int32 [B, max_pages] tensor, got {block_table.dtype} {tuple(block_table.shape)}"
        )
    batch = block_table.shape[0]
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"cu_seqlens_q must be [B+1]=[{batch + 1}], got {tuple(cu_seqlens_q.shape)}")
    if seq_lens_k.dim() != 1 or seq_lens_k.shape[0] != batch:
        raise ValueError(f"seq_lens_k must be [B]=[{batch}], got {tuple(seq_lens_k.shape)}")
    if out is not None:
        if out.dim() != 3 or out.shape[1:] != q.shape[1:] or out.shape[0] < q.shape[0]:
            raise ValueError(f"out must be [>= total_q, Hq, D] like q {tuple(q.shape)}, got {tuple(out.shape)}")
