"""PyTorch reference of paged skip-softmax attention: any device, any cache strides, exact semantics.

It computes, per sequence, the scores of a chunk of query rows against all of the sequence's keys, derives
tile maxima and the exclusive running max per tile (docs/skip_softmax.md), decides which tiles are skipped,
and takes a softmax over the kept keys. Because a skipped tile never changes the running max, this is exactly
what an online-softmax kernel computes, and one dense pass yields the counts for any number of λ trials.
It also serves vLLM's CPU engine, so it is vectorised over heads, rows and tiles.
"""

from __future__ import annotations

import math

import torch

from .semantics import DECODE_SPLIT_TOKENS, TILE_K, TILE_Q

# Upper bound on score elements materialised per chunk (float32: 4 bytes each), keeps memory in check at 128k.
_MAX_SCORE_ELEMENTS = 1 << 25


def _gather_kv(cache: torch.Tensor, pages: torch.Tensor, kv_len: int, padded_len: int, dtype) -> torch.Tensor:
    """[kv_len padded to padded_len, Hkv, D] keys or values of one sequence, gathered from its pages."""
    page_size = cache.shape[1]
    n_pages = (kv_len + page_size - 1) // page_size
    x = cache[pages[:n_pages].long()].to(dtype)  # advanced indexing: works for any strides
    x = x.reshape(n_pages * page_size, cache.shape[2], cache.shape[3])[:kv_len]
    if padded_len > kv_len:
        x = torch.cat([x, x.new_zeros(padded_len - kv_len, x.shape[1], x.shape[2])], dim=0)
    return x


def _exclusive_running_max(tile_max: torch.Tensor, blocks_per_split: int | None) -> torch.Tensor:
    """Running max over previous tiles along the last dim; resets to -inf at each split start (decode)."""
    n_tiles = tile_max.shape[-1]
    if blocks_per_split is None or blocks_per_split >= n_tiles:
        inclusive = torch.cummax(tile_max, dim=-1).values
        neg = torch.full_like(inclusive[..., :1], -math.inf)
        return torch.cat([neg, inclusive[..., :-1]], dim=-1)
    n_splits = (n_tiles + blocks_per_split - 1) // blocks_per_split
    pad = n_splits * blocks_per_split - n_tiles
    padded = torch.nn.functional.pad(tile_max, (0, pad), value=-math.inf)
    shaped = padded.reshape(*tile_max.shape[:-1], n_splits, blocks_per_split)
    return _exclusive_running_max(shaped, None).reshape(*tile_max.shape[:-1], -1)[..., :n_tiles]


def _sequence(
    q: torch.Tensor,  # [q_len, Hq, D] (compute dtype)
    k: torch.Tensor,  # [kv_pad, Hkv, D]
    v: torch.Tensor,  # [kv_pad, Hkv, D]
    kv_len: int,
    scale: float,
    log_lams: torch.Tensor | None,  # [T] ln λ for skip decisions (-inf = dense), or None for plain dense
    apply_skip: bool,  # True: serving (skip tiles of log_lams[0]); False: dense output, count every trial
) -> tuple[torch.Tensor, torch.Tensor | None]:
    q_len, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    kv_pad = k.shape[0]
    n_tiles = kv_pad // TILE_K
    decode = q_len == 1
    blocks_per_split = DECODE_SPLIT_TOKENS // TILE_K if decode else None
    n_trials = 0 if log_lams is None else log_lams.shape[0]
    counts = torch.zeros(max(n_trials, 1), 2, dtype=torch.int64, device=q.device)

    kt = k.permute(1, 2, 0)  # [Hkv, D, kv_pad]
    vh = v.permute(1, 0, 2)  # [Hkv, kv_pad, D]
    # Query heads grouped by their KV head: [Hkv, group, q_len, D].
    qh = q.permute(1, 0, 2).reshape(hkv, group, q_len, d)
    out = torch.empty(q_len, hq, d, dtype=q.dtype, device=q.device)

    rows_per_chunk = max(TILE_Q, (_MAX_SCORE_ELEMENTS // max(1, hq * kv_pad)) // TILE_Q * TILE_Q)
    key_pos = torch.arange(kv_pad, device=q.device)
    for r0 in range(0, q_len, rows_per_chunk):
        r1 = min(q_len, r0 + rows_per_chunk)
        n_rows = r1 - r0
        s = torch.matmul(qh[:, :, r0:r1], kt.unsqueeze(1)) * scale  # [Hkv, group, R, kv_pad]
        last_visible = kv_len - q_len + torch.arange(r0, r1, device=q.device)  # [R]
        visible = key_pos.unsqueeze(0) <= last_visible.unsqueeze(1)  # [R, kv_pad]
        s = s.masked_fill(~visible, -math.inf)
        if log_lams is None:
            keep = visible
        else:
            tile_max = s.reshape(hkv, group, n_rows, n_tiles, TILE_K).amax(-1)  # -inf where the row is not valid
            m_prev = _exclusive_running_max(tile_max, blocks_per_split)
            row_valid = tile_max > -math.inf  # [Hkv, g, R, n_tiles]
            gap = tile_max - m_prev  # +inf on each row's first tile, NaN where the row is not valid
            # Group rows into query blocks (prefill) — decode has one row and one block.
            # chunks start on block boundaries (rows_per_chunk is a multiple of TILE_Q)
            n_blocks = (n_rows + TILE_Q - 1) // TILE_Q
            pad_rows = n_blocks * TILE_Q - n_rows
            valid_b = torch.nn.functional.pad(row_valid, (0, 0, 0, pad_rows), value=False)
            valid_b = valid_b.reshape(hkv, group, n_blocks, TILE_Q, n_tiles)
            gap_b = torch.nn.functional.pad(gap, (0, 0, 0, pad_rows), value=math.inf)
            gap_b = gap_b.reshape(hkv, group, n_blocks, TILE_Q, n_tiles)
            visited = valid_b.any(dim=3)  # [Hkv, g, nb, n_tiles]
            trial_skips = []
            for t in range(n_trials):
                ok = (~valid_b) | (gap_b < log_lams[t])
                skipped = visited & ok.all(dim=3)
                counts[t, 1] += skipped.sum()
                trial_skips.append(skipped)
            counts[:, 0] += visited.sum()
            if apply_skip:
                skipped = trial_skips[0]  # [Hkv, g, nb, n_tiles]
                skipped_rows = skipped.unsqueeze(3).expand(hkv, group, n_blocks, TILE_Q, n_tiles)
                skipped_rows = skipped_rows.reshape(hkv, group, n_blocks * TILE_Q, n_tiles)[:, :, :n_rows]
                keep_tiles = ~skipped_rows.repeat_interleave(TILE_K, dim=-1)  # [Hkv, g, R, kv_pad]
                s = s.masked_fill(~keep_tiles, -math.inf)
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, vh.unsqueeze(1))  # [Hkv, group, R, D]
        out[r0:r1] = o.reshape(hq, n_rows, d).permute(1, 0, 2)
    return out, (counts if log_lams is not None else None)


def paged_skip_softmax_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    softmax_scale: float,
    log_lams: torch.Tensor | None,
    calibrate: bool,
    out: torch.Tensor,
) -> torch.Tensor | None:
    """Reference backend of `paged_skip_softmax_attention` (arguments already validated and normalised).

    `log_lams` is [B, T] float32 ln(λ) (-inf = dense) or None. With `calibrate` the output is dense and counts
    cover all T trials; otherwise T == 1 and the tiles of that trial are skipped. Returns counts [B, T, 2] or None.
    """
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch = seq_lens_k.shape[0]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    n_trials = 0 if log_lams is None else log_lams.shape[1]
    counts = None
    if log_lams is not None:
        counts = torch.zeros(batch, n_trials, 2, dtype=torch.int64, device=q.device)
    for b in range(batch):
        q0, q1, kv_len = cu[b], cu[b + 1], lens[b]
        q_len = q1 - q0
        if q_len <= 0:
            continue
        if kv_len < q_len:
            raise ValueError(f"sequence {b}: seq_lens_k ({kv_len}) must include its {q_len} new query tokens")
        kv_pad = (kv_len + TILE_K - 1) // TILE_K * TILE_K
        k = _gather_kv(k_cache, block_table[b], kv_len, kv_pad, compute_dtype)
        v = _gather_kv(v_cache, block_table[b], kv_len, kv_pad, compute_dtype)
        o, c = _sequence(
            q[q0:q1].to(compute_dtype),
            k,
            v,
            kv_len,
            softmax_scale,
            None if log_lams is None else log_lams[b],
            apply_skip=not calibrate,
        )
        out[q0:q1] = o.to(out.dtype)
        if c is not None:
            counts[b] = c[:n_trials]
    return counts
