"""PyTorch reference of paged skip-softmax attention: any device, any cache strides, exact semantics.

It computes the scores of a chunk of query rows against the keys they can see, derives tile maxima and the
exclusive running max per tile (docs/skip_softmax.md), decides which tiles are skipped, and takes a softmax over
the kept keys. Because a skipped tile never changes the running max, this is exactly what an online-softmax
kernel computes, and one dense pass yields the counts for any number of λ trials.

It also serves vLLM's CPU engine, so it is vectorised: decode sequences are batched together (padded to the
longest), prefill sequences are processed in chunks of query rows with causal truncation of the keys.
"""

from __future__ import annotations

import math

import torch

from .semantics import DECODE_SPLIT_TOKENS, TILE_K, TILE_Q

# Upper bound on score elements materialised at once; bounds memory at long contexts.
_MAX_SCORE_ELEMENTS = 1 << 24
# Upper bound on gathered K (or V) elements per decode sub-batch.
_MAX_GATHER_ELEMENTS = 1 << 26
_PREFILL_ROWS = 4 * TILE_Q


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _gather(cache: torch.Tensor, pages: torch.Tensor, n_keys: int, dtype) -> torch.Tensor:
    """Keys (or values) 0..n_keys-1 of a batch of page lists: [B, n_keys, Hkv, D]; padding rows are zero.

    `pages` is [B, P] (page ids, possibly padding); advanced indexing copies, so any cache strides work.
    """
    batch = pages.shape[0]
    page_size, hkv, d = cache.shape[1], cache.shape[2], cache.shape[3]
    n_pages = min(pages.shape[1], (n_keys + page_size - 1) // page_size)
    idx = pages[:, :n_pages].long().clamp(0, cache.shape[0] - 1)
    x = cache[idx].to(dtype).reshape(batch, n_pages * page_size, hkv, d)
    if x.shape[1] >= n_keys:
        return x[:, :n_keys]
    return torch.cat([x, x.new_zeros(batch, n_keys - x.shape[1], hkv, d)], dim=1)


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


def _decode_batch(q, k_cache, v_cache, pages, kv_lens, scale, log_lams, apply_skip, dtype):
    """Decode rows (q_len == 1) of several sequences at once.

    q: [Bd, Hq, D]; pages: [Bd, P]; kv_lens: [Bd] int64; log_lams: [Bd, T] or None.
    Returns (out [Bd, Hq, D] in `dtype`, counts [Bd, T, 2] or None).
    """
    bd, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    kv_pad = _ceil_to(int(kv_lens.max()), TILE_K)
    n_tiles = kv_pad // TILE_K
    k = _gather(k_cache, pages, kv_pad, dtype)  # [Bd, kv_pad, Hkv, D]
    v = _gather(v_cache, pages, kv_pad, dtype)
    qh = q.to(dtype).reshape(bd, hkv, group, d)
    s = torch.matmul(qh, k.permute(0, 2, 3, 1)).mul_(scale)  # [Bd, Hkv, group, kv_pad]
    pos = torch.arange(kv_pad, device=q.device)
    s.masked_fill_((pos.unsqueeze(0) >= kv_lens.unsqueeze(1))[:, None, None, :], -math.inf)
    counts = None
    if log_lams is not None:
        n_trials = log_lams.shape[1]
        tiles = s.view(bd, hkv, group, n_tiles, TILE_K)
        tile_max = tiles.amax(-1)
        m_prev = _exclusive_running_max(tile_max, DECODE_SPLIT_TOKENS // TILE_K)
        gap = tile_max - m_prev  # +inf on each split's first tile
        visited = (torch.arange(n_tiles, device=q.device) * TILE_K).unsqueeze(0) < kv_lens.unsqueeze(1)  # [Bd, nt]
        visited = visited[:, None, None, :]
        counts = torch.zeros(bd, n_trials, 2, dtype=torch.int64, device=q.device)
        counts[:, :, 0] = (visited.sum(dim=(1, 2, 3)) * hq).unsqueeze(1)
        # [Bd, T, Hkv, g, nt]: all trials at once (a decode tile has one row).
        skipped = visited.unsqueeze(1) & (gap.unsqueeze(1) < log_lams[:, :, None, None, None])
        counts[:, :, 1] = skipped.sum(dim=(2, 3, 4))
        if apply_skip:
            tiles.masked_fill_(skipped[:, 0].unsqueeze(-1), -math.inf)
    p = torch.softmax(s, dim=-1)
    out = torch.matmul(p, v.permute(0, 2, 1, 3))  # [Bd, Hkv, group, D]
    return out.reshape(bd, hq, d), counts


def _prefill_sequence(q, k, v, kv_len, scale, log_lams, apply_skip):
    """One prefill sequence: q [q_len, Hq, D], k/v [kv_pad, Hkv, D] (compute dtype), log_lams [T] or None."""
    q_len, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    n_trials = 0 if log_lams is None else log_lams.shape[0]
    counts = torch.zeros(n_trials, 2, dtype=torch.int64, device=q.device) if log_lams is not None else None

    kt = k.permute(1, 2, 0)  # [Hkv, D, kv_pad]
    vh = v.permute(1, 0, 2)  # [Hkv, kv_pad, D]
    qh = q.permute(1, 0, 2).reshape(hkv, group, q_len, d)
    out = torch.empty(q_len, hq, d, dtype=q.dtype, device=q.device)
    offset = kv_len - q_len  # row p sees keys 0 .. offset + p

    budget_rows = _MAX_SCORE_ELEMENTS // max(1, hq * k.shape[0]) // TILE_Q * TILE_Q
    rows_per_chunk = max(TILE_Q, min(_PREFILL_ROWS, budget_rows))
    for r0 in range(0, q_len, rows_per_chunk):
        r1 = min(q_len, r0 + rows_per_chunk)
        n_rows = r1 - r0
        kv_end = _ceil_to(offset + r1, TILE_K)  # keys any row of the chunk can see, whole tiles
        n_tiles = kv_end // TILE_K
        s = torch.matmul(qh[:, :, r0:r1], kt[:, :, :kv_end].unsqueeze(1)).mul_(scale)  # [Hkv, g, R, kv_end]
        first_hidden = offset + r0 + 1  # keys before this are visible to every row of the chunk
        cols = torch.arange(first_hidden, kv_end, device=q.device)
        rows = torch.arange(r0, r1, device=q.device)
        s[..., first_hidden:].masked_fill_(cols.unsqueeze(0) > (offset + rows).unsqueeze(1), -math.inf)
        if log_lams is not None:
            tiles = s.view(hkv, group, n_rows, n_tiles, TILE_K)
            tile_max = tiles.amax(-1)  # -inf where the row sees no key of the tile
            gap = tile_max - _exclusive_running_max(tile_max, None)  # +inf on the first tile, NaN where not valid
            # A row is valid in tile t iff it sees key t*TILE_K.
            row_valid = (torch.arange(n_tiles, device=q.device) * TILE_K).unsqueeze(0) <= (offset + rows).unsqueeze(1)
            n_blocks = (n_rows + TILE_Q - 1) // TILE_Q  # chunks start on block boundaries
            pad_rows = n_blocks * TILE_Q - n_rows
            valid_b = torch.nn.functional.pad(row_valid, (0, 0, 0, pad_rows), value=False)
            valid_b = valid_b.reshape(n_blocks, TILE_Q, n_tiles)
            visited = valid_b.any(dim=1)  # [nb, n_tiles], same for every head
            # A tile is skipped at λ iff its largest gap over valid rows is below ln λ: reduce once, then compare
            # every trial on the small [Hkv, g, nb, n_tiles] tensor.
            gap = gap.masked_fill(~row_valid, -math.inf)
            gap = torch.nn.functional.pad(gap, (0, 0, 0, pad_rows), value=-math.inf)
            tile_gap = gap.reshape(hkv, group, n_blocks, TILE_Q, n_tiles).amax(dim=3)
            counts[:, 0] += visited.sum() * hq
            skipped = visited & (tile_gap.unsqueeze(0) < log_lams[:, None, None, None, None])  # [T, Hkv, g, nb, nt]
            counts[:, 1] += skipped.sum(dim=(1, 2, 3, 4))
            if apply_skip:
                per_row = skipped[0].repeat_interleave(TILE_Q, dim=2)[:, :, :n_rows]  # [Hkv, g, R, n_tiles]
                tiles.masked_fill_(per_row.unsqueeze(-1), -math.inf)
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, vh[:, :kv_end].unsqueeze(1))  # [Hkv, g, R, D]
        out[r0:r1] = o.reshape(hq, n_rows, d).permute(1, 0, 2)
    return out, counts


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
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch = seq_lens_k.shape[0]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    n_trials = 0 if log_lams is None else log_lams.shape[1]
    counts = None
    if log_lams is not None:
        counts = torch.zeros(batch, n_trials, 2, dtype=torch.int64, device=q.device)
    for b in range(batch):
        if lens[b] < cu[b + 1] - cu[b]:
            raise ValueError(f"sequence {b}: seq_lens_k ({lens[b]}) must include its {cu[b + 1] - cu[b]} new tokens")
    apply_skip = not calibrate

    decode = [b for b in range(batch) if cu[b + 1] - cu[b] == 1]
    per_key = k_cache.shape[2] * k_cache.shape[3]
    start = 0
    while start < len(decode):  # sub-batches bounded by gathered K size
        longest = 0
        stop = start
        while stop < len(decode):
            longest_next = max(longest, _ceil_to(lens[decode[stop]], TILE_K))
            if stop > start and (stop - start + 1) * longest_next * per_key > _MAX_GATHER_ELEMENTS:
                break
            longest = longest_next
            stop += 1
        idx = torch.tensor(decode[start:stop], device=q.device)
        rows = torch.tensor([cu[b] for b in decode[start:stop]], device=q.device)
        o, c = _decode_batch(
            q.index_select(0, rows),
            k_cache,
            v_cache,
            block_table.index_select(0, idx),
            seq_lens_k.index_select(0, idx).long(),
            softmax_scale,
            None if log_lams is None else log_lams.index_select(0, idx),
            apply_skip,
            dtype,
        )
        out.index_copy_(0, rows, o.to(out.dtype))
        if c is not None:
            counts.index_copy_(0, idx, c)
        start = stop

    for b in range(batch):
        q0, q1, kv_len = cu[b], cu[b + 1], lens[b]
        if q1 - q0 <= 1:
            continue
        kv_pad = _ceil_to(kv_len, TILE_K)
        k = _gather(k_cache, block_table[b : b + 1], kv_pad, dtype)[0]
        v = _gather(v_cache, block_table[b : b + 1], kv_pad, dtype)[0]
        o, c = _prefill_sequence(
            q[q0:q1].to(dtype), k, v, kv_len, softmax_scale, None if log_lams is None else log_lams[b], apply_skip
        )
        out[q0:q1] = o.to(out.dtype)
        if c is not None:
            counts[b] = c
    return counts
