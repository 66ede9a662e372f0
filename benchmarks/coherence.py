#!/usr/bin/env python
"""Coherence report: how much of the skip-softmax work a GPU program can actually skip on real attention.

    python benchmarks/attention_inputs.py capture          # once: real Q/K/V in .cache/attention_inputs/
    python benchmarks/coherence.py --out artifacts/coherence.json

The contract (docs/skip_softmax.md, versions 2 and 3) decides per query row: row p drops key tile t > 0 (64 keys aligned
to absolute positions) when the tile's max scaled score minus the row's reference max (running max within the
tile's 2048-key split, seeded with tile 0) is below ln λ. A GPU program holds several rows and saves a tile's exp,
V load and P·V only when EVERY row it holds drops it:

- prefill: a program is a block of R query rows (16 / 64 / 128, aligned to absolute positions) of one query head
  against a key tile of 64 or 128 keys (a 128-key program tile is two contract tiles: every row must drop both);
  rows of the block that do not reach the tile (causal diagonal) do not need it;
- decode: a program is one decode row of a KV head's whole GQA group (Triton's decode kernel): a tile is saved
  when every query head of the group drops it. Every row of the last `--decode-rows` positions of a prefix is
  taken as a decode row of its own prefix (its decisions do not depend on the phase; docs/skip_softmax.md).

For each context length n (a prefix of the capture) and row-level target s, λ is found by bisection on ln λ so
that the pooled row-level sparsity (dropped / visited row-tiles over every captured layer, source and head) equals
s — one plain λ per (n, s, phase), as the prefill rows of one prompt share one λ under the law. The report gives
the share of (program, tile) pairs that are skippable at that λ (the work a kernel can save; its ideal speedup on
exp + P·V is 2/(2 − share)), and for the candidate rule **block decisions** (a tile is dropped for a whole aligned
block of R query rows of a head — decode: for a whole GQA group — only when the AND over the block says drop, i.e.
the decision a kernel can act on) the λ it needs for its skipped work to equal s, and the row-level sparsity that
results, beside the per-row sparsity the contract would give at that λ (the block rule drops a subset of it).

Decisions are the package reference's: tile maxima, the split-restarting reference max
(`reference.exclusive_running_max`) and the `gap < ln λ` test, vectorised over rows and computed once per
capture as each row-tile's gap g[t] − m[t] (float32 for float16 / float32 inputs, float64 for float64), so any λ
is a comparison; the unit test checks the counts against `paged_skip_softmax_attention(backend="torch")`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from modelopt_ext.torch.kernels.sparsity.attention.reference import exclusive_running_max
from modelopt_ext.torch.kernels.sparsity.attention.semantics import (
    RECENT_WINDOW,
    SPLIT_TOKENS,
    TILE_K,
    first_droppable_window_tile,
)

REPO = Path(__file__).resolve().parents[1]
TARGETS = (0.5, 0.7, 0.9)
LENGTHS = (2048, 4096, 8192)
BLOCK_ROWS = (16, 64, 128)
KEY_TILES = (64, 128)
DECODE_ROWS = 256
_SPLIT_TILES = SPLIT_TOKENS // TILE_K
_ROW_CHUNK = 256

logger = logging.getLogger("coherence")


# ------------------------------------------------------------------------------------------- per-row decisions


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def row_tile_gaps(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, positions: torch.Tensor,
                  softcap: float = 0.0, window_reference: bool = False) -> torch.Tensor:
    """g[t] − m[t] of docs/skip_softmax.md for rows of one sequence: q [R, Hq, D] at absolute `positions` [R]
    (sorted), k [>= max position + 1, Hkv, D] the sequence's keys. Returns gaps [Hq, R, n_tiles] with n_tiles
    covering the last position: +inf for tile 0 (never dropped), -inf for tiles a row does not visit, the gap
    otherwise. A visited row-tile is dropped at λ iff gap < ln λ (`drops`). `window_reference`: version 5's
    reference max (the row's recent-window tiles' max joins it, `stronger_reference`)."""
    rows, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    dtype = _compute_dtype(q)
    last = int(positions.max())
    n_tiles = last // TILE_K + 1
    kv_end = n_tiles * TILE_K
    kk = k[: min(kv_end, k.shape[0])].to(dtype)
    if kk.shape[0] < kv_end:
        kk = torch.nn.functional.pad(kk, (0, 0, 0, 0, 0, kv_end - kk.shape[0]))
    qh = q.to(dtype).reshape(rows, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, g, R, D]
    s = torch.matmul(qh, kk.permute(1, 2, 0).unsqueeze(1)).mul_(softmax_scale)  # [Hkv, g, R, kv_end]
    if softcap:
        s.div_(softcap).tanh_().mul_(softcap)
    cols = torch.arange(kv_end, device=q.device)
    s.masked_fill_(cols[None, :] > positions[:, None], -math.inf)
    s = s.reshape(hq, rows, kv_end)
    gaps = score_gaps(s, positions)
    if window_reference:  # contract version 5: the recent window's max joins the reference
        gaps = stronger_reference(gaps, s, positions, "window", RECENT_WINDOW)
    return gaps


def score_gaps(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`row_tile_gaps` from scaled scores [H, R, K] of rows at `positions` (causally masked with -inf; K a multiple
    of TILE_K covering the last position): [H, R, n_tiles]."""
    heads, rows, keys = scores.shape
    n_tiles = keys // TILE_K
    tile_max = scores.unflatten(-1, (n_tiles, TILE_K)).amax(-1)  # [H, R, nt]
    gap = tile_max - torch.maximum(exclusive_running_max(tile_max, _SPLIT_TILES), tile_max[..., :1])
    visited = (torch.arange(n_tiles, device=scores.device) * TILE_K)[None, :] <= positions[:, None]  # [R, nt]
    gap = torch.where(visited.unsqueeze(0), gap, torch.full_like(gap, -math.inf))
    gap[..., 0] = math.inf
    return gap


def protect_window(gaps: torch.Tensor, positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Contract version 4's recent window on row-tile gaps [H, R, nt] of rows at `positions` [R]: a visited tile
    holding one of the row's RECENT_WINDOW most recent keys gets +inf (never dropped, and it keeps the tile for a
    block or group whose statistic is the largest gap). `window`: another number of keys (a lever to measure)."""
    recent = recent_tiles(gaps.shape[-1], positions.to(gaps.device), window)
    return gaps.masked_fill(recent.unsqueeze(0) & (gaps > -math.inf), math.inf)


def recent_tiles(n_tiles: int, positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """[R, n_tiles] bool: the tiles holding one of each row's `window` most recent keys (default RECENT_WINDOW,
    the contract's); tiles past the row are included (the callers mask them by visit)."""
    first = first_droppable_window_tile(positions) if window is None else (positions - window + 1) // TILE_K
    return torch.arange(n_tiles, device=positions.device)[None, :] >= first[:, None]


def stronger_reference(gaps: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, reference: str,
                       window: int) -> torch.Tensor:
    """Gaps against a larger reference max than version 4's running max: "window" (version 5) also takes the max of the
    row's recent-window tiles (kept anyway, so a kernel could score them first), "row" the row's true max over
    every visited key (an oracle a one-pass kernel cannot have)."""
    keys = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, gaps.shape[-1] * TILE_K - keys), value=-math.inf)
    tile_max = padded.unflatten(-1, (gaps.shape[-1], TILE_K)).amax(-1)  # [H, R, nt]
    if reference == "row":
        best = tile_max.amax(-1, keepdim=True)
    elif reference == "window":
        recent = recent_tiles(gaps.shape[-1], positions.to(gaps.device), window)
        best = tile_max.masked_fill(~recent.unsqueeze(0), -math.inf).amax(-1, keepdim=True)
    else:
        raise ValueError(f"unknown reference {reference!r}: window or row")
    finite = (gaps > -math.inf) & (gaps < math.inf)
    return torch.where(finite, torch.minimum(gaps, tile_max.to(gaps.dtype) - best.to(gaps.dtype)), gaps)


def sequence_gaps(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, length: int | None = None,
                  softcap: float = 0.0, window_reference: bool = False) -> torch.Tensor:
    """`row_tile_gaps` of every row 0 .. length − 1 of a prompt (row p at position p): [Hq, length, n_tiles]."""
    length = length or q.shape[0]
    n_tiles = -(-length // TILE_K)
    out = torch.empty(q.shape[1], length, n_tiles, dtype=_compute_dtype(q))
    for r0 in range(0, length, _ROW_CHUNK):
        r1 = min(length, r0 + _ROW_CHUNK)
        g = row_tile_gaps(q[r0:r1], k, softmax_scale, torch.arange(r0, r1), softcap, window_reference)
        out[:, r0:r1, : g.shape[-1]] = g
        out[:, r0:r1, g.shape[-1]:] = -math.inf
    return out


def visited_mask(length: int, n_tiles: int | None = None) -> torch.Tensor:
    """[length, n_tiles] bool: row p visits tiles 0 .. p // TILE_K."""
    n_tiles = n_tiles or -(-length // TILE_K)
    return (torch.arange(n_tiles) * TILE_K)[None, :] <= torch.arange(length)[:, None]


def drops(gaps: torch.Tensor, log_lam: float) -> torch.Tensor:
    """Per-row decisions at ln λ: True where a visited row-tile is dropped (unvisited and tile 0: False)."""
    return (gaps < log_lam) & (gaps > -math.inf)


# ----------------------------------------------------------------------------------------------- program stats


def block_stat(gaps: torch.Tensor, block_rows: int, key_tile: int = TILE_K) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, row block, program tile): the largest gap over the block's visiting row-tiles (the program skips
    the tile at λ iff this is < ln λ: every row that needs the tile drops it) and whether any row visits it.
    gaps [H, N, nt] (N a multiple of block_rows is not required: the last block is partial). Returns
    (stat [H, nb, nt'], needed [nb, nt'] bool)."""
    h, n, nt = gaps.shape
    m = key_tile // TILE_K
    nb, ntp = -(-n // block_rows), -(-nt // m)
    g = torch.nn.functional.pad(gaps, (0, ntp * m - nt, 0, nb * block_rows - n), value=-math.inf)
    stat = g.reshape(h, nb, block_rows, ntp, m).amax(dim=(2, 4))
    vis = torch.nn.functional.pad(visited_mask(n, nt), (0, ntp * m - nt, 0, nb * block_rows - n))
    needed = vis.reshape(nb, block_rows, ntp, m).any(dim=3).any(dim=1)
    return stat, needed


def block_rows_visiting(length: int, block_rows: int, n_tiles: int) -> torch.Tensor:
    """[nb, nt] number of rows of each aligned block that visit each 64-key tile."""
    nb = -(-length // block_rows)
    vis = torch.nn.functional.pad(visited_mask(length, n_tiles), (0, 0, 0, nb * block_rows - length))
    return vis.reshape(nb, block_rows, n_tiles).sum(1)


def group_stat(gaps: torch.Tensor, group: int) -> torch.Tensor:
    """Per (KV head, row, tile): the largest gap over the GQA group's query heads ([Hq, N, nt] -> [Hkv, N, nt]);
    a decode program of the group skips the tile at λ iff this is < ln λ."""
    h, n, nt = gaps.shape
    return gaps.reshape(h // group, group, n, nt).amax(1)


def prefill_program_share(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, lam: float, block_rows: int,
                          key_tile: int = TILE_K, max_blocks: int | None = 64, length: int | None = None,
                          window: bool = False) -> dict:
    """At a plain λ, on one prompt (row p at position p; q [N, Hq, D], k [N, Hkv, D]): the share of (query head,
    row block, key tile) programs every needing row drops ("program"), and the row-tile sparsity ("row") of per-row
    decisions (versions 2-3). With more than `max_blocks` blocks, evenly spaced blocks are measured (an estimate;
    None: all). `window`: rows keep their recent window first (`protect_window`; 64-row blocks are then version 4)."""
    length = length or q.shape[0]
    log_lam = math.log(lam)
    nb = -(-length // block_rows)
    chosen = range(nb) if max_blocks is None or nb <= max_blocks else \
        sorted({int(i * (nb - 1) / (max_blocks - 1)) for i in range(max_blocks)})
    skipped = needed_n = row_drop = row_vis = 0
    for b in chosen:
        r0, r1 = b * block_rows, min(length, (b + 1) * block_rows)
        gaps = row_tile_gaps(q[r0:r1], k, softmax_scale, torch.arange(r0, r1, device=q.device),
                             window_reference=window).cpu()
        pos = torch.arange(r0, r1)
        if window:
            gaps = protect_window(gaps, pos)
        nt = gaps.shape[-1]
        vis = (torch.arange(nt) * TILE_K)[None, :] <= pos[:, None]
        m = key_tile // TILE_K
        ntp = -(-nt // m)
        g = torch.nn.functional.pad(gaps, (0, ntp * m - nt), value=-math.inf)
        stat = g.reshape(gaps.shape[0], r1 - r0, ntp, m).amax(dim=(1, 3))  # [H, nt']
        need = torch.nn.functional.pad(vis, (0, ntp * m - nt)).reshape(r1 - r0, ntp, m).any(2).any(0)
        skipped += int(((stat < log_lam) & need).sum())
        needed_n += int(need.sum()) * gaps.shape[0]
        row_drop += int(drops(gaps, log_lam).sum())
        row_vis += int(vis.sum()) * gaps.shape[0]
    return dict(program=skipped / needed_n if needed_n else 0.0, row=row_drop / row_vis if row_vis else 0.0,
                blocks=len(chosen), of_blocks=nb)


def decode_group_share(q_row: torch.Tensor, k: torch.Tensor, softmax_scale: float, lam: float,
                       window: bool = False) -> dict:
    """At a plain λ, one decode row (q_row [Hq, D] at position len(k) − 1): the share of (KV head, tile) pairs the
    whole GQA group drops ("program": V tiles a decode program skips; version 4's count with `window`) and the
    row-tile sparsity of per-row decisions ("row")."""
    hq, hkv = q_row.shape[0], k.shape[1]
    pos = torch.tensor([k.shape[0] - 1], device=q_row.device)
    gaps = row_tile_gaps(q_row[None], k, softmax_scale, pos, window_reference=window).cpu()  # [Hq, 1, nt]
    if window:
        gaps = protect_window(gaps, pos.cpu())
    log_lam = math.log(lam)
    nt = gaps.shape[-1]
    grp = group_stat(gaps, hq // hkv)
    return dict(program=float((grp < log_lam).sum()) / (hkv * nt), row=float(drops(gaps, log_lam).sum()) / (hq * nt))


class ProgramShare:
    """The skippable share of one benchmark input as a function of λ, from statistics computed once: for prefill
    (q [N, Hq, D] at positions 0..N−1) the block maxima of `max_blocks` evenly spaced aligned blocks of `block_rows`
    rows (all blocks when fewer), for decode (q [1, Hq, D] at position len(k) − 1) the GQA-group maxima. `share(λ)`
    is then the fraction of (program, 64-key tile) pairs the program can skip, `row(λ)` the row-tile sparsity of
    the same rows. `group_heads`: a prefill program holds the block's rows of a KV head's whole GQA group (the
    compiled CPU kernel's work item) instead of one query head. Computed on the inputs' device, kept on the CPU.
    `window` (default: contract version 5): rows keep their recent window before the program's AND and take its max
    into their reference, so for 64-row programs and decode `share(λ)` is what the version-5 kernels skip;
    `row(λ)` stays the per-row rate."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, softmax_scale: float, phase: str, block_rows: int = 64,
                 max_blocks: int = 64, group_heads: bool = False, rows: bool = True, window: bool = True):
        self.phase, self.block_rows = phase, block_rows
        keep_rows = rows  # `row(λ)` needs every row-tile gap; the benchmarks need only `share`
        stats, needs, rows, vis = [], [], [], []
        if phase == "decode":
            pos = torch.tensor([k.shape[0] - 1], device=q.device)
            gaps = row_tile_gaps(q[-1:], k, softmax_scale, pos, window_reference=window)
            if window:
                gaps = protect_window(gaps, pos)
            hq, hkv = q.shape[1], k.shape[1]
            stats.append(group_stat(gaps, hq // hkv).cpu().float())
            needs.append(torch.ones(gaps.shape[1:], dtype=torch.bool))
            rows.append(gaps.cpu().float() if keep_rows else gaps[:, :0].cpu())
            vis.append(torch.ones(gaps.shape[1:], dtype=torch.bool))
        else:
            n = q.shape[0]
            nb = -(-n // block_rows)
            chosen = range(nb) if nb <= max_blocks else sorted({int(i * (nb - 1) / (max_blocks - 1))
                                                                 for i in range(max_blocks)})
            for b in chosen:
                r0, r1 = b * block_rows, min(n, (b + 1) * block_rows)
                pos = torch.arange(r0, r1, device=q.device)
                gaps = row_tile_gaps(q[r0:r1], k, softmax_scale, pos, window_reference=window)
                if window:
                    gaps = protect_window(gaps, pos)
                v = ((torch.arange(gaps.shape[-1], device=q.device) * TILE_K)[None, :] <= pos[:, None])
                stat = gaps.amax(1)  # [H, nt]
                if group_heads:
                    stat = stat.unflatten(0, (k.shape[1], -1)).amax(1)  # [Hkv, nt]
                stats.append(stat.cpu().float())
                needs.append(v.any(0).cpu()[None])
                rows.append(gaps.cpu().float() if keep_rows else gaps[:, :0].cpu())
                vis.append(v.cpu())
        self._stats = [(s, n_) for s, n_ in zip(stats, needs, strict=True)]
        self._rows = [(g[:, v], int(v.sum()) * g.shape[0]) for g, v in zip(rows, vis, strict=True)] if keep_rows else []
        self.blocks = len(stats)

    def share(self, lam: float | None) -> float:
        if lam is None or not 0.0 < lam < 1.0:
            return 0.0
        ll = math.log(lam)
        skipped = sum(int(((s < ll) & n).sum()) for s, n in self._stats)
        total = sum(int(n.expand_as(s).sum()) for s, n in self._stats)
        return skipped / total if total else 0.0

    def row(self, lam: float | None) -> float:
        if not self._rows:
            raise ValueError("built with rows=False: no row-tile gaps kept")
        if lam is None or not 0.0 < lam < 1.0:
            return 0.0
        ll = math.log(lam)
        dropped = sum(int(((g < ll) & (g > -math.inf)).sum()) for g, _ in self._rows)
        total = sum(t for _, t in self._rows)
        return dropped / total if total else 0.0


# ------------------------------------------------------------------------------------------------------ report


@dataclass
class Capture:
    name: str
    gaps: torch.Tensor  # [Hq, N, nt]
    group: int


class Pool:
    """Pooled counts over captures of `stat < ln λ` (optionally weighted) against a fixed denominator."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.total = 0

    def add(self, stat: torch.Tensor, total: int, weight: torch.Tensor | None = None) -> None:
        keep = torch.isfinite(stat) if weight is None else torch.isfinite(stat) & (weight > 0)
        if weight is None:
            self.parts.append((stat[keep].float().contiguous(), None))
        else:
            self.parts.append((stat[keep].float().contiguous(), weight.expand_as(stat)[keep].float().contiguous()))
        self.total += total

    def share(self, log_lam: float) -> float:
        n = 0.0
        for s, w in self.parts:
            below = s < log_lam
            n += float(below.sum()) if w is None else float(w[below].sum())
        return n / self.total if self.total else 0.0


def bisect(pool: Pool, target: float, iters: int = 48) -> tuple[float, float]:
    """(ln λ, share) with the smallest ln λ in [-60, 0) whose share reaches `target` (bisection on ln λ); when even
    ln λ → 0 falls short, (0, the largest share)."""
    lo, hi = -60.0, -1e-9
    if pool.share(hi) < target:
        return 0.0, pool.share(hi)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if pool.share(mid) < target else (lo, mid)
    return hi, pool.share(hi)


def _total(mask: torch.Tensor, heads: int) -> int:
    return int(mask.sum()) * heads


def report(captures: list[Capture], targets=TARGETS, lengths=LENGTHS, block_rows=BLOCK_ROWS, key_tiles=KEY_TILES,
           decode_rows: int = DECODE_ROWS) -> dict:
    """The coherence table: {"prefill": [...], "decode": [...]} rows per (length, target)."""
    out = {"prefill": [], "decode": []}
    for n in lengths:
        caps = [c for c in captures if c.gaps.shape[1] >= n]
        if not caps:
            continue
        nt = -(-n // TILE_K)
        row, dec_row, dec_grp = Pool(), Pool(), Pool()
        prog = {(r, kt): Pool() for r in block_rows for kt in key_tiles}
        rule_rows = {r: Pool() for r in block_rows}
        d0 = max(0, n - decode_rows)
        for c in caps:
            g = c.gaps[:, :n, :nt]
            h = g.shape[0]
            vis = visited_mask(n, nt)
            row.add(g, _total(vis, h))
            for r in block_rows:
                for kt in key_tiles:
                    stat, need = block_stat(g, r, kt)
                    prog[r, kt].add(torch.where(need[None], stat, torch.full_like(stat, math.inf)), _total(need, h))
                stat64, need64 = block_stat(g, r, TILE_K)
                w = block_rows_visiting(n, r, nt)[None].to(torch.float32)  # rows a block-rule drop leaves out
                rule_rows[r].add(torch.where(need64[None], stat64, torch.full_like(stat64, math.inf)),
                                 _total(vis, h), weight=w)
            gd = g[:, d0:n]
            vd = vis[d0:n]
            dec_row.add(gd, _total(vd, h))
            grp = group_stat(gd, c.group)
            dec_grp.add(grp, _total(vd, grp.shape[0]))
        for t in targets:
            ll, got = bisect(row, t)
            entry = dict(length=n, target=t, lam=math.exp(ll), row_sparsity=got,
                         program_share={f"{r}x{kt}": prog[r, kt].share(ll) for r in block_rows for kt in key_tiles},
                         block_rule={})
            for r in block_rows:
                llb, share = bisect(prog[r, TILE_K], t)
                entry["block_rule"][str(r)] = dict(lam=math.exp(llb), program_share=share,
                                                   row_sparsity=rule_rows[r].share(llb),
                                                   per_row_sparsity_at_lam=row.share(llb))
            out["prefill"].append(entry)
            ll, got = bisect(dec_row, t)
            llg, gshare = bisect(dec_grp, t)
            out["decode"].append(dict(length=n, target=t, lam=math.exp(ll), row_sparsity=got,
                                      group_share=dec_grp.share(ll),
                                      group_rule=dict(lam=math.exp(llg), group_share=gshare,
                                                      row_sparsity=gshare,
                                                      per_row_sparsity_at_lam=dec_row.share(llg))))
    return out


def markdown(result: dict, block_rows=BLOCK_ROWS, key_tiles=KEY_TILES) -> str:
    lines = ["**Prefill** (per-row contract: λ for the row-level target; share of (head, R-row block, key tile) "
             "programs every row drops; block rule: λ for the same skipped work = target, row-level sparsity "
             "it gives / per-row sparsity at that λ)", ""]
    cols = [f"{r}×{kt}" for r in block_rows for kt in key_tiles]
    lines.append("| n | s | λ | " + " | ".join(cols) + " | " +
                 " | ".join(f"block {r}: λ (×), rows / per-row" for r in block_rows) + " |")
    lines.append("|---|---|---|" + "---:|" * len(cols) + "---|" * len(block_rows))
    for e in result["prefill"]:
        shares = " | ".join(f"{e['program_share'][f'{r}x{kt}']:.3f}" for r in block_rows for kt in key_tiles)
        rules = " | ".join(
            f"{b['lam']:.3g} (×{b['lam'] / e['lam']:.3g}), {b['row_sparsity']:.3f} / {b['per_row_sparsity_at_lam']:.3f}"
            + ("" if b["program_share"] >= e["target"] - 1e-6 else f" (max {b['program_share']:.3f})")
            for b in (e["block_rule"][str(r)] for r in block_rows))
        lines.append(f"| {e['length']} | {e['target']} | {e['lam']:.3g} | {shares} | {rules} |")
    lines += ["", "**Decode** (each of the last rows of the prefix as a decode row; program = the GQA group of a KV "
              "head: a V tile is skipped when every query head of the group drops it)", "",
              "| n | s | λ | row sparsity | group share | group rule: λ (×), share / per-row at λ |",
              "|---|---|---|---:|---:|---|"]
    for e in result["decode"]:
        g = e["group_rule"]
        lines.append(f"| {e['length']} | {e['target']} | {e['lam']:.3g} | {e['row_sparsity']:.3f} | "
                     f"{e['group_share']:.3f} | {g['lam']:.3g} (×{g['lam'] / e['lam']:.3g}), "
                     f"{g['group_share']:.3f} / {g['per_row_sparsity_at_lam']:.3f} |")
    return "\n".join(lines)


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return ""


def _floats(text):
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text):
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    import attention_inputs

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", type=Path, default=attention_inputs.DEFAULT_DIR,
                   help="a capture file or a folder of them (default: %(default)s)")
    p.add_argument("--targets", type=_floats, default=list(TARGETS))
    p.add_argument("--lengths", type=_ints, default=list(LENGTHS))
    p.add_argument("--block-rows", type=_ints, default=list(BLOCK_ROWS))
    p.add_argument("--key-tiles", type=_ints, default=list(KEY_TILES))
    p.add_argument("--decode-rows", type=int, default=DECODE_ROWS, help="last rows of a prefix taken as decode rows")
    p.add_argument("--out", type=Path, default=None, help="JSON file for the raw result")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    files = [args.inputs] if args.inputs.is_file() else attention_inputs.capture_files(args.inputs)
    if not files:
        print(attention_inputs.missing_message(args.inputs), file=sys.stderr)
        return 2
    if any(kt % TILE_K for kt in args.key_tiles):
        p.error(f"key tiles must be multiples of {TILE_K}")
    t0 = time.perf_counter()
    captures, metas = [], []
    longest = max(args.lengths)
    for f in files:
        inp = attention_inputs.load_inputs(f)
        n = min(inp.length, longest)
        gaps = sequence_gaps(inp.q, inp.k, inp.softmax_scale, n, float(inp.meta.get("softcap") or 0.0))
        captures.append(Capture(f.name, gaps, inp.meta["heads"] // inp.meta["kv_heads"]))
        metas.append({k: v for k, v in inp.meta.items() if k != "path"} | {"file": f.name})
        logger.info("%s: gaps of %d rows (%.0f s)", f.name, n, time.perf_counter() - t0)
    result = report(captures, args.targets, [n for n in args.lengths], args.block_rows, args.key_tiles,
                    args.decode_rows)
    table = markdown(result, args.block_rows, args.key_tiles)
    print(table)
    meta = dict(date=datetime.date.today().isoformat(), git=_git_rev(), cpu=platform.processor() or platform.machine(),
                torch=torch.__version__, seconds=round(time.perf_counter() - t0, 1), captures=metas,
                targets=args.targets, lengths=args.lengths, block_rows=args.block_rows, key_tiles=args.key_tiles,
                decode_rows=args.decode_rows, contract="docs/skip_softmax.md version 2",
                lambda_search="bisection on ln λ of the pooled row-level sparsity (one plain λ per length, target, "
                              "phase; pooled over every capture and head)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(meta=meta, **result), indent=1))
        logger.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
