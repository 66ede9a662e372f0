"""Test helpers for the skip-softmax kernels: input builders, cache layouts and a float64 oracle of the docs.

The oracle (`oracle`) is written straight from docs/skip_softmax.md (version 3: per-row decisions, sinks) with loops
over (sequence, key tile), vectorised over heads and rows: it is independent of reference.py and semantics.py,
so tests can pin the documented semantics on every backend. It also returns, per sequence, every droppable
row-tile's statistic `G = tile max - reference max` (the row drops the tile iff G < ln λ of the row), which
`safe_lambdas` uses to keep test thresholds away from decision boundaries (float32 rounding must not flip a
decision between backends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from modelopt_ext.torch.kernels.sparsity.attention import semantics
from modelopt_ext.torch.kernels.sparsity.attention.semantics import SPLIT_TOKENS, TILE_K


def kernel_backends() -> list:
    """The backends a per-backend test runs on, as pytest params: the reference, the compiled CPU kernel and Triton
    (under the interpreter on the CPU), each skipped with the reason where it cannot run."""
    import pytest

    from modelopt_ext.torch.kernels.sparsity.attention import cpu_kernel
    from modelopt_ext.torch.kernels.sparsity.attention.api import triton_available

    return [
        pytest.param("torch"),
        pytest.param("cpu", marks=pytest.mark.skipif(not cpu_kernel.available(),
                                                     reason=str(cpu_kernel.unavailable_reason()))),
        pytest.param("triton", marks=pytest.mark.skipif(not triton_available(), reason="no triton")),
    ]  # fmt: skip


LAYOUTS = ("nhd", "nhd5", "hnd5", "packed", "cpu_t")
"""Cache layouts: plain NHD; NHD view of [blocks, 2, page, H, D]; HND-strided [blocks, 2, H, page, D];
packed [blocks, H, page, 2D] split into K/V; vLLM-CPU style K transposed per (block, head) (last-dim stride = page).
Also "cpu_amx" (bf16 only, page % 32 == 0): vLLM's CPU `amx` layout, K and V as AMX B tiles, as 6-D split views.
"""


def amx_layout_views(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """6-D K/V views of a [blocks, H, page, 2D] cache in vLLM's CPU `amx` layout, written here from the measured
    formulas (docs/cpu_amx_layout.md §3), independently of the plugin's views:
    K(b,h,t,d) at (t//16)*16*D + (d//2)*32 + (t%16)*2 + d%2 and V(b,h,t,d) at page*D + (d//16)*16*page + (t//2)*32
    + (d%16)*2 + t%2 within block b, head h. Element (b, t, h, d) is K[b, t//16, t%16, h, d//2, d%2] and
    V[b, t//2, t%2, h, d//16, d%16]."""
    nb, h, page, d2 = c.shape
    d = d2 // 2
    sb, sh = c.stride(0), c.stride(1)
    k = c.as_strided((nb, page // 16, 16, h, d // 2, 2), (sb, 16 * d, 2, sh, 32, 1))
    v = c.as_strided((nb, page // 2, 2, h, d // 16, 16), (sb, 32, 1, sh, 16 * page, 2), page * d)
    return k, v


def logical(cache: torch.Tensor) -> torch.Tensor:
    """[blocks, page, H, D] of a cache view (a copy for the 6-D split views)."""
    if cache.dim() == 6:
        return cache.reshape(cache.shape[0], cache.shape[1] * cache.shape[2], cache.shape[3], -1)
    return cache


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens_k: torch.Tensor
    scale: float
    q_lens: list[int]
    kv_lens: list[int]

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q, self.seq_lens_k

    def subset(self, b: int) -> Case:
        """Sequence `b` alone (same cache, its own block-table row)."""
        q0 = int(self.cu_seqlens_q[b])
        q1 = int(self.cu_seqlens_q[b + 1])
        return Case(
            q=self.q[q0:q1],
            k_cache=self.k_cache,
            v_cache=self.v_cache,
            block_table=self.block_table[b : b + 1],
            cu_seqlens_q=torch.tensor([0, q1 - q0], dtype=torch.int32),
            seq_lens_k=self.seq_lens_k[b : b + 1],
            scale=self.scale,
            q_lens=[self.q_lens[b]],
            kv_lens=[self.kv_lens[b]],
        )


def make_cache_views(k: torch.Tensor, v: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Copy logical [blocks, page, H, D] K/V into `layout` storage; return [blocks, page, H, D] views of it."""
    nb, page, h, d = k.shape
    if layout == "nhd":
        return k.clone(), v.clone()
    if layout == "nhd5":
        c = torch.empty(nb, 2, page, h, d, dtype=k.dtype)
        kv, vv = c[:, 0], c[:, 1]
    elif layout == "hnd5":
        c = torch.empty(nb, 2, h, page, d, dtype=k.dtype)
        kv, vv = c[:, 0].transpose(1, 2), c[:, 1].transpose(1, 2)
    elif layout == "packed":
        c = torch.empty(nb, h, page, 2 * d, dtype=k.dtype)
        kv, vv = c[..., :d].transpose(1, 2), c[..., d:].transpose(1, 2)
    elif layout == "cpu_t":
        # [blocks, H, 2*page, D] region per (block, head): K stored transposed [D, page], then V as [page, D].
        c = torch.empty(nb, h, 2 * page * d, dtype=k.dtype)
        kv = c[:, :, : page * d].reshape(nb, h, d, page).permute(0, 3, 1, 2)
        vv = c[:, :, page * d :].reshape(nb, h, page, d).transpose(1, 2)
        assert kv.stride(3) == page
    elif layout == "cpu_amx":
        c = torch.empty(nb, h, page, 2 * d, dtype=k.dtype)
        kv, vv = amx_layout_views(c)
        kv.copy_(k.reshape(nb, page // 16, 16, h, d // 2, 2))
        vv.copy_(v.reshape(nb, page // 2, 2, h, d // 16, 16))
        return kv, vv
    else:
        raise ValueError(layout)
    kv.copy_(k)
    vv.copy_(v)
    return kv, vv


def make_case(
    q_lens: list[int],
    kv_lens: list[int] | None = None,
    *,
    hq: int = 4,
    hkv: int = 2,
    d: int = 64,
    page: int = 16,
    dtype=torch.float32,
    layout: str = "nhd",
    seed: int = 0,
    spread: float = 1.0,
    extra_blocks: int = 3,
) -> Case:
    """Random paged inputs with realistic score spread (an attention sink and a few spiky keys per sequence).

    Scores mix noise (~N(0, 1)) with a shared direction per KV head: the first keys (sink) and ~5 % of the others
    are aligned with the queries, so later tiles sit several nats below the running max (skippable at moderate
    λ) while spiky tiles are not. Block tables are shuffled; `extra_blocks` unused pages hold random data.
    """
    g = torch.Generator().manual_seed(seed)
    kv_lens = list(q_lens) if kv_lens is None else list(kv_lens)
    assert all(kv >= ql for ql, kv in zip(q_lens, kv_lens, strict=True))
    batch = len(q_lens)
    total_q = sum(q_lens)
    group = hq // hkv
    n_pages = [max(1, math.ceil(kv / page)) for kv in kv_lens]
    nb = sum(n_pages) + extra_blocks
    perm = torch.randperm(nb, generator=g)
    width = max(n_pages) + 1
    bt = torch.randint(0, nb, (batch, width), generator=g, dtype=torch.int32)  # junk past each sequence's pages
    i = 0
    for b in range(batch):
        bt[b, : n_pages[b]] = perm[i : i + n_pages[b]].to(torch.int32)
        i += n_pages[b]

    u = torch.randn(hkv, d, generator=g)
    u = u / u.norm(dim=-1, keepdim=True) * math.sqrt(d)  # |u|^2 = d
    q = torch.randn(total_q, hq, d, generator=g) * 0.7
    q += torch.repeat_interleave(u, group, dim=0).unsqueeze(0) * (0.5 + 0.5 * torch.rand(total_q, hq, 1, generator=g))
    # Logical K/V per sequence position, then scattered into pages.
    k = torch.randn(nb, page, hkv, d, generator=g) * 0.7
    v = torch.randn(nb, page, hkv, d, generator=g)
    for b in range(batch):
        kv = kv_lens[b]
        beta = 0.25 * torch.randn(kv, hkv, generator=g)
        beta[: min(kv, 2)] += spread * 1.1  # attention sink
        spikes = torch.rand(kv, hkv, generator=g) < 0.05
        beta = torch.where(spikes, spread * (0.5 + 0.6 * torch.rand(kv, hkv, generator=g)), beta)
        pos = torch.arange(kv)
        pages = bt[b, pos // page].long()
        k[pages, pos % page] += beta.unsqueeze(-1) * u.unsqueeze(0)
    q = q.to(dtype)
    k = k.to(dtype)
    v = v.to(dtype)
    k_cache, v_cache = make_cache_views(k, v, layout)
    cu = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    return Case(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=bt,
        cu_seqlens_q=cu,
        seq_lens_k=torch.tensor(kv_lens, dtype=torch.int32),
        scale=d**-0.5,
        q_lens=list(q_lens),
        kv_lens=kv_lens,
    )


def gather_dense(cache: torch.Tensor, pages: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[kv_len, H, D] float64 keys/values of one sequence, position by position through the block table."""
    cache = logical(cache)
    page = cache.shape[1]
    pos = torch.arange(kv_len)
    return cache[pages[pos // page].long(), pos % page].to(torch.float64)


def softmax_with_sink(s: torch.Tensor, sink: float | None) -> torch.Tensor:
    """float64 softmax over the last dim with an attention sink in the denominator only (written out, not the
    reference's concatenation): exp(s - M) / (exp(sink - M) + sum exp(s - M)), M = max(sink, max s)."""
    if sink is None:
        return torch.softmax(s, dim=-1)
    m = torch.clamp(s.amax(-1, keepdim=True), min=sink)
    e = torch.exp(s - m)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sink - m))


def dense_attention_f64(case: Case, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain float64 causal-suffix attention (no tiles): [total_q, Hq, D]; `sinks` [Hq] join each head's
    denominator."""
    total_q, hq, d = case.q.shape
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    group = hq // semantics.cache_geometry(case.k_cache)[2]
    for b in range(case.batch):
        q0, ql, kv = int(case.cu_seqlens_q[b]), case.q_lens[b], case.kv_lens[b]
        if ql == 0:
            continue
        k = gather_dense(case.k_cache, case.block_table[b], kv)
        v = gather_dense(case.v_cache, case.block_table[b], kv)
        q = case.q[q0 : q0 + ql].to(torch.float64)
        for h in range(hq):
            s = case.scale * q[:, h] @ k[:, h // group].T  # [ql, kv]
            mask = torch.arange(kv)[None, :] <= (kv - ql + torch.arange(ql))[:, None]
            s = s.masked_fill(~mask, -math.inf)
            sink = None if sinks is None else float(sinks[h])
            out[q0 : q0 + ql, h] = softmax_with_sink(s, sink) @ v[:, h // group]
    return out


@dataclass
class OracleResult:
    out: torch.Tensor  # float64 [total_q, Hq, D]
    counts: torch.Tensor  # int64 [B, T, 2]
    tile_stats: list[torch.Tensor]  # per sequence: G of every droppable row-tile (float64)


def row_log_lambdas(log_sf_b, gamma_b, prompt_len: int, positions: torch.Tensor) -> torch.Tensor:
    """float64 ln λ [T, R] of rows at `positions` (docs/skip_softmax.md "λ of a row"), -inf where nothing drops."""
    out = torch.empty(log_sf_b.shape[0], positions.shape[0], dtype=torch.float64)
    for r, pos in enumerate(positions.tolist()):
        decode = pos >= prompt_len
        n = pos + 1 if decode else max(prompt_len, 1)
        phase = 1 if decode else 0
        for t in range(log_sf_b.shape[0]):
            x = float(log_sf_b[t, phase]) - float(gamma_b[phase]) * math.log(n)
            out[t, r] = x if x < 0 else -math.inf  # NaN and λ >= 1 drop nothing
    return out


def default_prompt_lens(case: Case) -> list[int]:
    return [kv - 1 if ql == 1 else kv for ql, kv in zip(case.q_lens, case.kv_lens, strict=True)]


def oracle(case: Case, log_lams: torch.Tensor | None, calibrate: bool = False, *, law=None,
           softcap: float = 0.0, sinks: torch.Tensor | None = None) -> OracleResult:
    """float64 implementation of docs/skip_softmax.md (v5), row by row, unit by unit.

    `log_lams`: [B, T] ln λ for every row (-inf = dense) or None; or `law = (log_sf [B, T, 2], gamma [B, 2],
    prompt_lens [B])`. Serving (calibrate=False) drops the tiles of trial 0; calibration keeps the output dense
    and counts every trial. `softcap` > 0: scores are cap·tanh(s / cap) before everything else. `sinks` [Hq]:
    attention sinks (never capped), in every tile's reference max and in the softmax denominator.
    `tile_stats` are the units' statistics (the largest effective gap of a prompt block's rows or a decode row's
    GQA group) of every droppable unit-tile: the values a threshold must stay clear of.
    """
    total_q, hq, d = case.q.shape
    group = hq // semantics.cache_geometry(case.k_cache)[2]
    if law is None and log_lams is not None:
        law = (log_lams.to(torch.float64).unsqueeze(-1).expand(-1, -1, 2), torch.zeros(case.batch, 2),
               default_prompt_lens(case))
    n_trials = 1 if law is None else law[0].shape[1]
    split_tiles = SPLIT_TOKENS // TILE_K
    out = torch.zeros(total_q, hq, d, dtype=torch.float64)
    counts = torch.zeros(case.batch, n_trials, 2, dtype=torch.int64)
    stats = []
    for b in range(case.batch):
        q0, ql, kv = int(case.cu_seqlens_q[b]), case.q_lens[b], case.kv_lens[b]
        if ql == 0:
            stats.append(torch.zeros(0, dtype=torch.float64))
            continue
        k = gather_dense(case.k_cache, case.block_table[b], kv)
        v = gather_dense(case.v_cache, case.block_table[b], kv)
        q = case.q[q0 : q0 + ql].to(torch.float64)
        positions = kv - ql + torch.arange(ql)  # absolute position of each new row
        kk = k.repeat_interleave(group, dim=1).permute(1, 2, 0)  # [Hq, D, kv]
        s = case.scale * torch.matmul(q.permute(1, 0, 2), kk)  # [Hq, ql, kv]
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        visible = torch.arange(kv)[None, :] <= positions[:, None]  # [ql, kv]
        s = s.masked_fill(~visible, -math.inf)
        keep = visible.expand(hq, ql, kv).clone()
        n_kb = math.ceil(kv / TILE_K)
        g = torch.stack([s[..., t * TILE_K : (t + 1) * TILE_K].amax(-1) for t in range(n_kb)], -1)  # [Hq, ql, nt]
        lams = None
        prompt_len = kv if law is None else int(law[2][b])
        if law is not None:
            lams = row_log_lambdas(law[0][b], law[1][b], prompt_len, positions)  # [T, ql]
        # Version 5: each row's reference also holds the max over the tiles that hold one of its RECENT_WINDOW
        # most recent keys (keys pos - RECENT_WINDOW + 1 .. pos), whichever split they are in.
        window_max = torch.full((hq, ql), -math.inf, dtype=torch.float64)
        for r, pos in enumerate(positions.tolist()):
            first_key = max(0, pos - semantics.RECENT_WINDOW + 1)
            tiles = range(first_key // TILE_K, pos // TILE_K + 1)
            window_max[:, r] = g[:, r, list(tiles)].amax(-1)
        seq_stats = []
        for t in range(n_kb):
            rows_visiting = positions >= t * TILE_K  # [ql]
            counts[b, :, 0] += hq * int(rows_visiting.sum())
            if t == 0:
                continue  # the anchor tile is never dropped
            split_start = (t // split_tiles) * split_tiles
            ref = g[..., 0]
            if sinks is not None:
                ref = torch.maximum(ref, sinks.to(torch.float64)[:, None])
            if t > split_start:
                ref = torch.maximum(ref, g[..., split_start:t].amax(-1))
            ref = torch.maximum(ref, window_max)  # version 5
            gap = g[..., t] - ref  # [Hq, ql]
            unit = unit_statistics(gap, positions, t, prompt_len, group)  # [Hq, ql]
            seq_stats.append(unit[:, rows_visiting].flatten())
            if lams is None:
                continue
            drop = rows_visiting.unsqueeze(0).unsqueeze(0) & (unit.unsqueeze(0) < lams.unsqueeze(1))  # [T, Hq, ql]
            counts[b, :, 1] += drop.sum(dim=(1, 2))
            if not calibrate:
                keep[..., t * TILE_K : (t + 1) * TILE_K] &= ~drop[0].unsqueeze(-1)
        s = s.masked_fill(~keep, -math.inf)
        p = torch.stack([softmax_with_sink(s[h], None if sinks is None else float(sinks[h])) for h in range(hq)])
        out[q0 : q0 + ql] = torch.matmul(p, v.repeat_interleave(group, dim=1).transpose(0, 1)).transpose(0, 1)
        stats.append(torch.cat(seq_stats) if seq_stats else torch.zeros(0, dtype=torch.float64))
    return OracleResult(out=out, counts=counts if law is not None else None, tile_stats=stats)


def unit_statistics(gap: torch.Tensor, positions: torch.Tensor, t: int, prompt_len: int, group: int) -> torch.Tensor:
    """Version 4's decision statistic of tile t for every (query head, row) of one sequence's call, by the letter of
    docs/skip_softmax.md: a row's effective gap is its gap where it may drop t (it visits t and t lies wholly
    before its recent window) and +inf elsewhere; a prompt row takes the largest effective gap over the prompt
    rows of its aligned block (same head, in this call), a decode row the largest over its GQA group's heads."""
    hq, ql = gap.shape
    eff = gap.clone()
    for r, pos in enumerate(positions.tolist()):
        window_start = pos - semantics.RECENT_WINDOW + 1
        if t * TILE_K > pos or t * TILE_K + TILE_K - 1 >= window_start:
            eff[:, r] = math.inf
    unit = torch.empty_like(eff)
    for r, pos in enumerate(positions.tolist()):
        if pos < prompt_len:
            block = [i for i, p in enumerate(positions.tolist())
                     if p < prompt_len and p // semantics.DECISION_BLOCK_ROWS == pos // semantics.DECISION_BLOCK_ROWS]
            unit[:, r] = eff[:, block].amax(dim=1)
        else:
            for h in range(hq):
                first = h // group * group
                unit[h, r] = eff[first : first + group, r].max()
    return unit


def safe_log_lambda(log_lam: float, stats: torch.Tensor, margin: float = 2e-3) -> float:
    """Move ln λ off every finite tile statistic by at least `margin` (relative to |G| when larger than 1).

    Large cases (10^5 row-tile statistics, e.g. 300 rows x 8 heads x 57 tiles) leave no gap of 2e-3 anywhere, so the
    margin shrinks tenfold (twice) until one is found: 2e-5 still exceeds the fp32 rounding of a gap (about 1e-6
    for D = 128) twentyfold.
    """
    finite = stats[torch.isfinite(stats)]
    if finite.numel() == 0:
        return float(log_lam)
    for m in (margin, margin / 10, margin / 100):
        tol = m * torch.clamp(finite.abs(), min=1.0)
        x = float(log_lam)
        for _ in range(1000):
            if not bool(((finite - x).abs() < tol).any()):
                return x
            x -= m
    raise AssertionError("no safe threshold found")


def safe_lambdas(case: Case, lams: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] λ (in (0, 1)) nudged so that no tile sits within rounding distance of a decision boundary."""
    stats = oracle_stats(case)
    flat = lams.reshape(case.batch, -1).clone().to(torch.float64)
    for b in range(case.batch):
        for t in range(flat.shape[1]):
            lam = float(flat[b, t])
            if 0.0 < lam < 1.0:
                flat[b, t] = math.exp(safe_log_lambda(math.log(lam), stats[b]))
    return flat.reshape(lams.shape).to(torch.float32)


def oracle_stats(case: Case) -> list[torch.Tensor]:
    return oracle(case, None).tile_stats


def quantile_lambda(case: Case, b: int, quantile: float) -> float:
    """A safe λ that skips about `quantile` of sequence b's skippable tiles."""
    stats = oracle_stats(case)[b]
    finite = stats[torch.isfinite(stats)]
    if finite.numel() == 0:  # a single tile per row (or an empty sequence): nothing can be skipped
        return 0.5
    lam = math.exp(float(torch.quantile(finite, quantile)) + 1e-2)
    return math.exp(safe_log_lambda(math.log(min(lam, 0.999)), stats))


def log_lams_tensor(lams, batch: int) -> torch.Tensor:
    """ln λ [B, T] float32 as api.py builds it (dense → -inf)."""
    t = torch.as_tensor(lams, dtype=torch.float32)
    if t.dim() == 0:
        t = t.expand(batch)
    if t.dim() == 1:
        t = t.unsqueeze(1)
    return semantics.log_thresholds(t)


def backend_law(case: Case, log_lams: torch.Tensor | None) -> dict:
    """Backend keyword arguments (log_sf, gamma, prompt_lens) for a plain ln λ [B, T] on every row, as api.py
    normalises `skip_threshold` / `threshold_trials`: γ = 0 and the default prompt lengths."""
    device = case.q.device
    log_sf = None
    if log_lams is not None:
        log_sf = log_lams.to(device=device, dtype=torch.float32).unsqueeze(-1).expand(-1, -1, 2).contiguous()
    return dict(
        log_sf=log_sf,
        gamma=torch.zeros(case.batch, 2, dtype=torch.float32, device=device),
        prompt_lens=torch.tensor(default_prompt_lens(case), dtype=torch.int32, device=device),
    )
