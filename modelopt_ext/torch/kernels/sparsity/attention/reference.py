"""PyTorch reference of paged skip-softmax attention: any device, any cache strides, exact semantics (v5).

For a chunk of query rows it computes the scores against the keys they can see, each row's tile maxima and its
reference max per tile (running max within the tile's split, seeded with the row's tile 0 and the head's attention
sink: docs/skip_softmax.md), decides per unit (the prompt rows of an aligned block of one head, or the heads of a
decode row's GQA group; no row drops a tile of its recent window) which tiles it drops, and takes a softmax over
the kept keys. The reference max is a function of
the scores alone, so this is exactly what an online-softmax kernel computes, and one dense pass yields the counts
for any number of λ trials.

It is vectorised: sequences with one new row are batched together (padded to the longest), others are processed
in chunks of query rows with causal truncation of the keys. Values past kv_len are zeroed after the gather, so
stale NaN/inf in reused cache slots never reach an output.
"""

from __future__ import annotations

import math

import torch

from .semantics import (
    DECISION_BLOCK_ROWS,
    SPLIT_TOKENS,
    TILE_K,
    TILE_Q,
    cache_geometry,
    first_droppable_window_tile,
    row_log_thresholds,
)

# Upper bound on score elements materialised at once; bounds memory at long contexts.
_MAX_SCORE_ELEMENTS = 1 << 24
# Upper bound on gathered K (or V) elements per single-row sub-batch.
_MAX_GATHER_ELEMENTS = 1 << 26
_PREFILL_ROWS = 4 * TILE_Q
_SPLIT_TILES = SPLIT_TOKENS // TILE_K


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _gather(cache: torch.Tensor, pages: torch.Tensor, n_keys: int, dtype, scale: float = 1.0) -> torch.Tensor:
    """Keys (or values) 0..n_keys-1 of a batch of page lists: [B, n_keys, Hkv, D]; padding rows are zero.

    An FP8 cache's elements are dequantized: its bytes as `dtype` times `scale` (docs/skip_softmax.md "Inputs").

    `pages` is [B, P] (page ids, possibly padding); advanced indexing copies, so any cache strides work, and the
    6-D split views (`cache_geometry`) reshape to [B, n, Hkv, D] since their split axes are adjacent and in order.
    """
    batch = pages.shape[0]
    _, page_size, hkv, d = cache_geometry(cache)
    n_pages = min(pages.shape[1], (n_keys + page_size - 1) // page_size)
    idx = pages[:, :n_pages].long().clamp(0, cache.shape[0] - 1)
    x = cache[idx].to(dtype).reshape(batch, n_pages * page_size, hkv, d)
    if scale != 1.0:
        x = x * scale
    if x.shape[1] >= n_keys:
        return x[:, :n_keys]
    return torch.cat([x, x.new_zeros(batch, n_keys - x.shape[1], hkv, d)], dim=1)


def _zero_past(x: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
    """Zero rows j >= kv_len of gathered [B, n, Hkv, D] values: p == 0 times a stale NaN would still be NaN."""
    pos = torch.arange(x.shape[1], device=x.device)
    return x.masked_fill((pos.unsqueeze(0) >= kv_lens.unsqueeze(1))[:, :, None, None], 0.0)


def exclusive_running_max(tile_max: torch.Tensor, blocks_per_split: int | None) -> torch.Tensor:
    """Running max over previous tiles along the last dim; resets to -inf at each split start."""
    n_tiles = tile_max.shape[-1]
    if blocks_per_split is None or blocks_per_split >= n_tiles:
        inclusive = torch.cummax(tile_max, dim=-1).values
        neg = torch.full_like(inclusive[..., :1], -math.inf)
        return torch.cat([neg, inclusive[..., :-1]], dim=-1)
    n_splits = (n_tiles + blocks_per_split - 1) // blocks_per_split
    pad = n_splits * blocks_per_split - n_tiles
    padded = torch.nn.functional.pad(tile_max, (0, pad), value=-math.inf)
    shaped = padded.reshape(*tile_max.shape[:-1], n_splits, blocks_per_split)
    return exclusive_running_max(shaped, None).reshape(*tile_max.shape[:-1], -1)[..., :n_tiles]


def _drop_decisions(s: torch.Tensor, positions: torch.Tensor, log_lams: torch.Tensor, sinks=None,
                    prompt_rows: torch.Tensor | None = None):
    """The tile decisions of docs/skip_softmax.md (version 5) for scores `s` [N, Hkv, g, R, n_tiles * TILE_K].

    positions: [N, R] absolute row positions, consecutive within each sequence (invisible keys of `s` already
    -inf; rows of a prompt block must all be here: callers chunk rows at multiples of DECISION_BLOCK_ROWS);
    log_lams: [N, T, R]; sinks: None or the attention sinks as [Hkv, g] (they seed every tile's reference max,
    like the anchor); prompt_rows: [N, R] bool, which rows are prompt rows (pos < prompt_len), None = none.
    Returns (visited [N, R, n_tiles] bool, dropped [N, T, Hkv, g, R, n_tiles] bool).

    A row's *effective gap* of a tile is its gap (tile max minus reference max) where the row may drop the tile
    (visited, not tile 0, wholly before its recent window) and +inf elsewhere. A unit — the prompt rows of one
    aligned block of one head, or the query heads of a decode row's GQA group — drops a tile iff the largest
    effective gap of its members is below ln λ (its members share λ), so one dense pass still serves every λ.
    """
    n_tiles = s.shape[-1] // TILE_K
    tile_max = s.unflatten(-1, (n_tiles, TILE_K)).amax(-1)  # [N, Hkv, g, R, nt]; -inf where nothing visible
    ref = torch.maximum(exclusive_running_max(tile_max, _SPLIT_TILES), tile_max[..., :1])
    if sinks is not None:
        ref = torch.maximum(ref, sinks.to(ref.dtype)[None, :, :, None, None])
    tiles = torch.arange(n_tiles, device=s.device)
    # Version 5: the max of the row's recent-window tiles (kept anyway) joins every tile's reference max.
    in_window = tiles.view(1, 1, -1) >= first_droppable_window_tile(positions)[..., None]  # [N, R, nt]
    ref = torch.maximum(ref, tile_max.masked_fill(~in_window[:, None, None], -math.inf).amax(-1, keepdim=True))
    visited = (tiles * TILE_K).view(1, 1, -1) <= positions.unsqueeze(-1)  # [N, R, nt]
    droppable = (tiles > 0).view(1, 1, -1) & (tiles.view(1, 1, -1) < first_droppable_window_tile(positions)[..., None])
    gap = (tile_max - ref).masked_fill(~(visited & droppable)[:, None, None], math.inf)  # effective gaps
    unit_gap = gap.amax(dim=2, keepdim=True).expand_as(gap)  # decode rows: the GQA group's largest
    if prompt_rows is not None and bool(prompt_rows.any()):
        unit_gap = torch.where(prompt_rows[:, None, None, :, None], _block_max(gap, positions, prompt_rows), unit_gap)
    dropped = visited[:, None, None, None] & (unit_gap.unsqueeze(1) < log_lams[:, :, None, None, :, None])
    return visited, dropped


def _block_max(gap: torch.Tensor, positions: torch.Tensor, prompt_rows: torch.Tensor) -> torch.Tensor:
    """For every row, the largest effective gap [N, Hkv, g, R, nt] over the prompt rows of its aligned block
    (positions // DECISION_BLOCK_ROWS; decode rows take no part); decode rows get anything (the caller masks them)."""
    block = positions // DECISION_BLOCK_ROWS
    local = block - block[:, :1]  # rows are consecutive: 0 .. n_blocks - 1 within each sequence
    n_blocks = int(local.max()) + 1
    member = gap.masked_fill(~prompt_rows[:, None, None, :, None], -math.inf)
    shape = (*gap.shape[:3], n_blocks, gap.shape[-1])
    index = local[:, None, None, :, None].expand_as(gap)
    per_block = gap.new_full(shape, -math.inf).scatter_reduce_(3, index, member, reduce="amax")
    return per_block.gather(3, index)


def decode_tile_drops(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, skip_threshold: float) -> torch.Tensor:
    """Which tiles each query head of one decode row drops at a constant λ: q [Hq, D], logical K [kv_len, Hkv, D]
    (any float dtype; scored in float64). Returns bool [Hkv, Hq // Hkv, n_tiles].

    A decode row decides per GQA group (version 4), so the heads of a group agree and a kernel skips the V of
    every tile they drop (benchmarks/bench_cpu.py reports it beside the row-tile sparsity).
    """
    kv_len, hkv, d = k.shape
    kv_pad = _ceil_to(kv_len, TILE_K)
    kp = torch.nn.functional.pad(k.double(), (0, 0, 0, 0, 0, kv_pad - kv_len))
    s = torch.einsum("hgd,jhd->hgj", q.double().view(hkv, -1, d), kp).mul_(softmax_scale)
    s[..., kv_len:] = -math.inf
    pos = torch.tensor([[kv_len - 1]], device=q.device)
    log_lam = torch.full((1, 1, 1), math.log(skip_threshold), dtype=torch.float64, device=q.device)
    _, dropped = _drop_decisions(s[None, :, :, None], pos, log_lam)
    return dropped[0, 0, :, :, 0]


def _count(visited, dropped, counts_out, hq: int) -> None:
    """Add row-tile counts of N sequences into counts_out [N, T, 2]."""
    counts_out[..., 0] += (visited.sum(dim=(1, 2)) * hq).unsqueeze(1)
    counts_out[..., 1] += dropped.sum(dim=(2, 3, 4, 5))


def softmax_with_sinks(s: torch.Tensor, sinks) -> torch.Tensor:
    """Softmax over the last dim of `s`, with each head's sink (broadcast to s[..., :1], or None) joining the
    denominator only (docs/skip_softmax.md, "The softmax with a sink"). Also the Hugging Face path's dense sinks."""
    if sinks is None:
        return torch.softmax(s, dim=-1)
    column = sinks.to(s.dtype).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]


def _sinks_by_kv_head(sinks, hkv: int, dtype):
    """The [Hq] sinks as [Hkv, G] (query head h = kv·G + i), or None."""
    return None if sinks is None else sinks.to(dtype).reshape(hkv, -1)


def _cap(s: torch.Tensor, softcap: float) -> torch.Tensor:
    """Logit soft-capping, in place: s = cap·tanh(s / cap) (docs/skip_softmax.md; 0 = off)."""
    return s.div_(softcap).tanh_().mul_(softcap) if softcap else s


def _single_row_batch(q, k_cache, v_cache, pages, kv_lens, scale, log_lams, apply_skip, dtype, softcap=0.0,
                      sinks=None, prompt_lens=None, kv_scales=(1.0, 1.0)):
    """Sequences with one new row each (decode steps, or a prompt's last row alone), batched: q [N, Hq, D]; pages
    [N, P]; kv_lens [N] int64; log_lams [N, T] or None; sinks [Hq] or None; prompt_lens [N] or None (every row
    a decode row); kv_scales the FP8 cache's (k_scale, v_scale). Returns (out [N, Hq, D] in `dtype`, counts [N, T, 2]
    or None)."""
    n, hq, d = q.shape
    hkv = cache_geometry(k_cache)[2]
    group = hq // hkv
    sink_hg = _sinks_by_kv_head(sinks, hkv, dtype)
    kv_pad = _ceil_to(int(kv_lens.max()), TILE_K)
    k = _gather(k_cache, pages, kv_pad, dtype, kv_scales[0])  # [N, kv_pad, Hkv, D]
    v = _zero_past(_gather(v_cache, pages, kv_pad, dtype, kv_scales[1]), kv_lens)
    qh = q.to(dtype).reshape(n, hkv, group, d)
    s = _cap(torch.matmul(qh, k.permute(0, 2, 3, 1)).mul_(scale), softcap)  # [N, Hkv, g, kv_pad]
    pos = torch.arange(kv_pad, device=q.device)
    s.masked_fill_((pos.unsqueeze(0) >= kv_lens.unsqueeze(1))[:, None, None, :], -math.inf)
    counts = None
    if log_lams is not None:
        s5 = s.unsqueeze(3)  # one row: [N, Hkv, g, 1, kv_pad]
        positions = (kv_lens - 1).unsqueeze(1)
        prompt_rows = None if prompt_lens is None else positions < prompt_lens.to(positions).unsqueeze(1)
        visited, dropped = _drop_decisions(s5, positions, log_lams.unsqueeze(-1), sink_hg, prompt_rows)
        counts = torch.zeros(n, log_lams.shape[1], 2, dtype=torch.int64, device=q.device)
        _count(visited, dropped, counts, hq)
        if apply_skip:
            s5.unflatten(-1, (-1, TILE_K)).masked_fill_(dropped[:, 0].unsqueeze(-1), -math.inf)
    p = softmax_with_sinks(s, None if sink_hg is None else sink_hg[None, :, :, None])
    out = torch.matmul(p, v.permute(0, 2, 1, 3))  # [N, Hkv, g, D]
    return out.reshape(n, hq, d), counts


def _multi_row_sequence(q, k, v, kv_len, scale, log_lams_fn, n_trials, apply_skip, softcap=0.0, sinks=None,
                        prompt_len=None):
    """One sequence with several new rows: q [q_len, Hq, D], k/v [kv_pad, Hkv, D] (compute dtype, v zeroed past
    kv_len). `log_lams_fn(positions [R]) -> [T, R]` or None; sinks [Hq] or None; prompt_len: the request's (rows
    before it are prompt rows; None = kv_len). Rows are taken in chunks aligned to absolute multiples of
    DECISION_BLOCK_ROWS, so a prompt block's rows decide together. Returns (out [q_len, Hq, D], counts [T, 2] or
    None)."""
    q_len, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    sink_hg = _sinks_by_kv_head(sinks, hkv, q.dtype)
    counts = None if log_lams_fn is None else torch.zeros(1, n_trials, 2, dtype=torch.int64, device=q.device)

    kt = k.permute(1, 2, 0)  # [Hkv, D, kv_pad]
    vh = v.permute(1, 0, 2)  # [Hkv, kv_pad, D]
    qh = q.permute(1, 0, 2).reshape(hkv, group, q_len, d)
    out = torch.empty(q_len, hq, d, dtype=q.dtype, device=q.device)
    offset = kv_len - q_len  # row p sits at position offset + p and sees keys 0 .. offset + p

    prompt_len = kv_len if prompt_len is None else prompt_len
    budget_rows = _MAX_SCORE_ELEMENTS // max(1, hq * k.shape[0])
    rows_per_chunk = max(1, min(_PREFILL_ROWS, budget_rows) // DECISION_BLOCK_ROWS) * DECISION_BLOCK_ROWS
    for r0, r1 in _aligned_chunks(offset, q_len, rows_per_chunk):
        n_rows = r1 - r0
        kv_end = _ceil_to(offset + r1, TILE_K)  # keys any row of the chunk can see, whole tiles
        s = _cap(torch.matmul(qh[:, :, r0:r1], kt[:, :, :kv_end].unsqueeze(1)).mul_(scale), softcap)  # [Hkv,g,R,kv]
        first_hidden = offset + r0 + 1  # keys before this are visible to every row of the chunk
        cols = torch.arange(first_hidden, kv_end, device=q.device)
        positions = torch.arange(offset + r0, offset + r1, device=q.device)
        s[..., first_hidden:].masked_fill_(cols.unsqueeze(0) > positions.unsqueeze(1), -math.inf)
        if log_lams_fn is not None:
            s5 = s.unsqueeze(0)
            visited, dropped = _drop_decisions(s5, positions.unsqueeze(0), log_lams_fn(positions).unsqueeze(0),
                                               sink_hg, (positions < prompt_len).unsqueeze(0))
            _count(visited, dropped, counts, hq)
            if apply_skip:
                s5.unflatten(-1, (-1, TILE_K)).masked_fill_(dropped[:, 0].unsqueeze(-1), -math.inf)
        p = softmax_with_sinks(s, None if sink_hg is None else sink_hg[:, :, None, None])
        o = torch.matmul(p, vh[:, :kv_end].unsqueeze(1))  # [Hkv, g, R, D]
        out[r0:r1] = o.reshape(hq, n_rows, d).permute(1, 0, 2)
    return out, None if counts is None else counts[0]


def _aligned_chunks(offset: int, q_len: int, rows: int):
    """(r0, r1) row ranges covering 0 .. q_len whose cuts fall on absolute positions that are multiples of `rows`."""
    r0 = 0
    while r0 < q_len:
        r1 = min(q_len, ((offset + r0) // rows + 1) * rows - offset)
        yield r0, r1
        r0 = r1


def _decode_sub_batches(single: list[int], lens: list[int], per_key: int):
    """(start, stop) slices of `single` (the one-row sequences) run together: each gathers its K padded to its
    longest sequence, so a slice grows only while that stays within `_MAX_GATHER_ELEMENTS` (at least one each)."""
    start = 0
    while start < len(single):
        longest = 0
        stop = start
        while stop < len(single):
            longest_next = max(longest, _ceil_to(lens[single[stop]], TILE_K))
            if stop > start and (stop - start + 1) * longest_next * per_key > _MAX_GATHER_ELEMENTS:
                break
            longest = longest_next
            stop += 1
        yield start, stop
        start = stop


def _reference_single_rows(q, k_cache, v_cache, block_table, cu, lens, seq_lens_k, *, softmax_scale, log_sf, gamma,
                           prompt_lens, apply_skip, dtype, softcap, out, counts, sinks, kv_scales) -> None:
    """The one-row (decode) sequences, batched: writes their rows of `out` and, when counting, of `counts`."""
    batch = seq_lens_k.shape[0]
    single = [b for b in range(batch) if cu[b + 1] - cu[b] == 1]
    _, _, hkv, d = cache_geometry(k_cache)
    for start, stop in _decode_sub_batches(single, lens, hkv * d):
        idx = torch.tensor(single[start:stop], device=q.device)
        rows = torch.tensor([cu[b] for b in single[start:stop]], device=q.device)
        kv_lens = seq_lens_k.index_select(0, idx).long()
        log_lams = None
        if log_sf is not None:
            log_lams = row_log_thresholds(
                log_sf.index_select(0, idx), gamma.index_select(0, idx), prompt_lens.index_select(0, idx),
                (kv_lens - 1).unsqueeze(1),
            )[..., 0]
        o, c = _single_row_batch(
            q.index_select(0, rows), k_cache, v_cache, block_table.index_select(0, idx), kv_lens,
            softmax_scale, log_lams, apply_skip, dtype, softcap, sinks,
            None if prompt_lens is None else prompt_lens.index_select(0, idx), kv_scales,
        )
        out.index_copy_(0, rows, o.to(out.dtype))
        if c is not None:
            counts.index_copy_(0, idx, c)


def _reference_multi_rows(q, k_cache, v_cache, block_table, cu, lens, seq_lens_k, *, softmax_scale, log_sf, gamma,
                          prompt_lens, apply_skip, dtype, softcap, out, counts, n_trials, sinks, kv_scales) -> None:
    """The sequences with several query rows (prefill, chunks), one at a time: writes their rows and counts."""
    for b in range(seq_lens_k.shape[0]):
        q0, q1, kv_len = cu[b], cu[b + 1], lens[b]
        if q1 - q0 <= 1:
            continue
        kv_pad = _ceil_to(kv_len, TILE_K)
        k = _gather(k_cache, block_table[b : b + 1], kv_pad, dtype, kv_scales[0])[0]
        v = _gather(v_cache, block_table[b : b + 1], kv_pad, dtype, kv_scales[1])
        v = _zero_past(v, seq_lens_k[b : b + 1].long())[0]
        log_lams_fn = None
        if log_sf is not None:
            def log_lams_fn(positions, b=b):
                return row_log_thresholds(log_sf[b : b + 1], gamma[b : b + 1], prompt_lens[b : b + 1],
                                          positions.unsqueeze(0))[0]
        o, c = _multi_row_sequence(
            q[q0:q1].to(dtype), k, v, kv_len, softmax_scale, log_lams_fn, n_trials, apply_skip, softcap, sinks,
            None if prompt_lens is None else int(prompt_lens[b]),
        )
        out[q0:q1] = o.to(out.dtype)
        if c is not None:
            counts[b] = c


def paged_skip_softmax_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_k: torch.Tensor,
    *,
    softmax_scale: float,
    log_sf: torch.Tensor | None,
    gamma: torch.Tensor,
    prompt_lens: torch.Tensor,
    calibrate: bool,
    out: torch.Tensor,
    counts: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | None:
    """Reference backend of `paged_skip_softmax_attention` (arguments already validated and normalised).

    `log_sf` is [B, T, 2] float32 (per trial and phase; -inf = dense) or None (dense, no counts), `gamma` [B, 2]
    the length exponents and `prompt_lens` [B]: ln λ of a row follows docs/skip_softmax.md. With `calibrate` the
    output is dense and counts cover all T trials; otherwise T == 1 and each row's drops are applied.
    `counts`: optional int64 [B, T, 2] buffer to fill instead of a new tensor; `softcap` > 0 caps every score
    (cap·tanh(s / cap)) before the skip test and the softmax; `sinks` (None or float32 [Hq]) are the attention
    sinks of version 3; `k_scale` / `v_scale` dequantize an FP8 cache (docs/skip_softmax.md "Inputs"). Returns counts
    [B, T, 2] or None.
    """
    if counts is not None and log_sf is not None:
        counts.copy_(paged_skip_softmax_attention_reference(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, softmax_scale=softmax_scale, log_sf=log_sf,
            gamma=gamma, prompt_lens=prompt_lens, calibrate=calibrate, out=out, softcap=softcap, sinks=sinks,
            k_scale=k_scale, v_scale=v_scale,
        ))  # fmt: skip
        return counts
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    batch = seq_lens_k.shape[0]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    n_trials = 0 if log_sf is None else log_sf.shape[1]
    counts = None
    if log_sf is not None:
        counts = torch.zeros(batch, n_trials, 2, dtype=torch.int64, device=q.device)
    for b in range(batch):
        if lens[b] < cu[b + 1] - cu[b]:
            raise ValueError(f"sequence {b}: seq_lens_k ({lens[b]}) must include its {cu[b + 1] - cu[b]} new tokens")
    step = dict(softmax_scale=softmax_scale, log_sf=log_sf, gamma=gamma, prompt_lens=prompt_lens,
                apply_skip=not calibrate, dtype=dtype, softcap=softcap, out=out, counts=counts, sinks=sinks,
                kv_scales=(float(k_scale), float(v_scale)))
    _reference_single_rows(q, k_cache, v_cache, block_table, cu, lens, seq_lens_k, **step)
    _reference_multi_rows(q, k_cache, v_cache, block_table, cu, lens, seq_lens_k, n_trials=n_trials, **step)
    return counts
