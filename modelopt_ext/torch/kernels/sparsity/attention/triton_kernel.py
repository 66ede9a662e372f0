"""Triton backend of paged skip-softmax attention (semantics: docs/skip_softmax.md, exact).

`paged_skip_softmax_attention_triton` has the same contract as `paged_skip_softmax_attention_reference`: same
inputs (already validated by `semantics.check_inputs`), same output rows, same int64 `[B, T, 2]` counts.

Kernels
-------
The kernels walk key tiles in increasing order with the same `@triton.jit` pieces: `_load_k_tile` /
`_load_v_tile` (a tile through the block table and any strides; masked, so nothing past kv_len is ever read),
`_row_log_lambda` (the per-row law of docs/skip_softmax.md), `_window_max` (a row's recent-window max w),
`_effective_gap` (a row's tile max minus its reference max, +inf for tile 0, tiles it does not visit and tiles of
its recent window), `_segment_max` (the largest effective gap of a decision unit, broadcast to its members) and
`_online_softmax_update`.

The reference max (contract version 5) of a row's tile is max(σ_h, tile 0's max, w, running max of the earlier
tiles of its split), w the max of the row's recent-window tiles (max(0, pos − 127) // 64 .. pos // 64, whichever
split they are in). When deciding, every program (and every decode split) first scores those window tiles in a
short prepass (`_window_max`: the same load, dot, soft-cap and mask as the main loop, so w is its tiles' g; two
or three tiles per row, BLOCK_Q // 64 + 2 for a prefill program's rows together; none where no row can drop a
tile, pos < 255), and seeds the rows' anchor with w: tile 0's max joins it at kb == 0. Dense launches skip the
prepass. The main key loop is unchanged.

Decisions (since contract version 4) are per unit, and every kernel holds its units whole: the prompt rows of an aligned
block of 64 positions of one query head (a prefill program of 64 or 128 rows holds one or two such blocks: the max
over each 64-row segment of the program, a reshape to [BLOCK_Q // 64, 64] and a reduction, broadcast back), or a
decode row's GQA group (the decode kernels hold the group's heads as rows of one `tl.dot` and reduce over them). A
unit drops a tile iff that max is below ln λ, which its members share (a prompt block's rows have the same n and
phase). A program skips a tile's `exp`, V load and `P·V` when every unit it holds drops the tile (or its rows do not
visit it), and otherwise zeroes the probabilities of the rows whose unit drops it.

* `_prefill_kernel` (sequences with `q_len >= 2`): one program per (block of BLOCK_Q rows, query head), the blocks
  aligned to absolute positions (multiples of BLOCK_Q, itself a multiple of 64), so the first program of a call that
  starts mid-block holds fewer rows and a sequence needs up to `q_len // BLOCK_Q + 2` programs. Programs are laid
  out over a flattened grid: sequence `b` owns the program ids `cu_seqlens_q[b] // BLOCK_Q + 2b + i` for its
  blocks `i`; these ranges never overlap, so the grid needs only `total_q // BLOCK_Q + 2B` programs (taken in
  reverse order, longest causal blocks first) and each program finds its sequence by a binary search over
  `cu_seqlens_q` — no host synchronisation. Key blocks of TILE_K keys are visited in increasing order (online
  softmax), keys gathered through the block table (any power-of-two page size >= 16; a key tile spans several
  pages when the page is smaller than TILE_K). Each row keeps its anchor (w and tile 0's max) and its running max within
  the current split for the test, besides the softmax running max of the tiles it kept. When deciding (serving or
  calibration) a program holds only prompt rows (pos < prompt_len); dense launches compute every row here.
* `_decode_rows_kernel` (decode rows, pos >= prompt_len, of sequences with `q_len >= 2`: speculative-decoding
  verification rows, a request recomputed after preemption; launched only when deciding). Such a row decides with
  its GQA group, which a one-head prefill program cannot see, so the prefill kernel leaves these rows out and this
  kernel takes them: one program per (block of `32 // G` consecutive decode rows, KV head), the group's G heads
  (padded to a power of two) of each row packed into the M dimension of one `tl.dot`, the group max a segmented
  max over them, one pass over all keys (the split max restarting at each split, as everywhere). Whether a call has
  such rows is known only on the device, so the grid is sized like the prefill grid (`total_q // (32 // G) + B`
  programs per KV head; sequence `b` owns `cu_seqlens_q[b] // (32 // G) + b + i`, counted from its first decode
  row) and every program without decode rows exits after the binary search: CUDA-graph safe, no host read, one
  small launch of early exits where there are none. Chosen over putting the group's heads into every prefill
  program (a different, register-heavier prefill kernel for a rare case) and over one program per sequence that
  loops over its rows (serial over a long recomputed tail); it is not tuned (branch skip mode, 4 warps).
* `_decode_kernel` (sequences with `q_len == 1`): one program per (sequence, KV head, split of SPLIT_TOKENS
  keys); when deciding, every split scores the row's window tiles for w (they may lie in another split) and a split
  other than the first reads tile 0 once more for its rows' anchor. The GQA group of query heads
  sharing the KV head is processed together (rows of one `tl.dot`) and decides together (a prompt's last row run
  alone decides per head: its block's only member in the call); V is loaded only when the group keeps the tile.
  Sequences with one split write the output directly; otherwise
  each split stores its (max, sum, unnormalised accumulator) and `_decode_merge_kernel` merges them exactly
  (log-sum-exp). The number of splits is bounded by `block_table.shape[1] * page_size` (no host read); pass
  `max_seqlen_k` (a host int that must bound every `seq_lens_k`, e.g. vLLM's `max_seq_len`) to tighten it. The
  workspace is `B * Hq * splits * (BLOCK_D + 2)` fp32 (e.g. 256 x 32 x 64 x 130 x 4 B = 272 MB for a 128k-token
  block table without the hint, 8.5 MB with `max_seqlen_k=4096`).
* Mixed batches: all grids are launched over all sequences; programs whose sequence belongs to another kernel
  (or has `q_len == 0`) exit immediately, so no per-sequence phase split happens on the host. A pure
  decode batch still launches `(total_q // BLOCK_Q + 2B) x Hq` prefill programs (and, when deciding, the decode-row
  programs) that exit after the binary search (cheap but not free; a caller that knows the batch has no prefill
  passes `decode_only` and skips both launches).

Runtime values
--------------
`ln λ` of a row is computed inside the kernels from runtime tensors (`log_sf` [B, T, 2], `gamma` [B, 2],
`prompt_lens` [B]), never a `tl.constexpr`: changing λ or the law never compiles a new variant. Compile-time
values are the geometry (TILE_Q, TILE_K, splits), the head size, the GQA group, the page size, the dtype, the
number of calibration trials, the mode (dense / serving / calibration), soft-capping and attention sinks.

Attention sinks (`sinks`, float32 [Hq], docs/skip_softmax.md version 3) are a compiled variant (`HAS_SINKS`), so
a launch without them compiles the sinkless kernels unchanged. With them, the head's sink seeds every split's
running max (the skip test), and the program or split that holds tile 0 starts its online softmax from m = σ, l = 1,
acc = 0 (the sink in the denominator once, in the output never); the other decode splits start empty and the merge
is unchanged.

Counts are accumulated per program in registers and added with one `tl.atomic_add` per (program, trial) into
the int64 `[B, T, 2]` buffer (integer adds: exact and order independent).

FP8 KV caches (`float8_e4m3fn` / `float8_e5m2` views, docs/skip_softmax.md "Inputs": a key is k8 · k_scale, a value
v8 · v_scale) compile from the caches' pointer type (no constexpr of their own; a cache in q's dtype compiles the
same code as before, apart from the unused `v_scale` argument). The host folds k_scale into the softmax scale, so
scores, the window prepass, the soft cap and the skip test see (q·k8) · (softmax_scale · k_scale); a loaded FP8
tile is converted exactly to q's dtype (`_dot_input`) before its dot; v_scale, a runtime fp32 argument (host
float, fixed per layer: CUDA-graph safe), divides the softmax denominator once per row (`_normalized`; the decode
splits store l / v_scale, so the merge kernel is unchanged).

Supported: fp16 / bf16 / fp32 inputs (fp32 accumulation; fp32 inputs use IEEE fp32 dots, never TF32, so
skip decisions match the reference) over caches in q's dtype or FP8; head sizes 16 <= D <= 256 (non powers of two
are padded with masks); page sizes that are powers of two >= 16; any strides for q, out and the K/V cache views
(Triton specialises unit strides, so a contiguous last dimension costs nothing extra). float64 is reference-only.
Not checked on the device (would need a host sync): `seq_lens_k >= q_len` (the reference raises).

Being fast on an H200 (sm_90)
-----------------------------
The skip geometry is fixed by the semantics (64-key tiles, 2048-key splits); how the kernels are launched is a
`LaunchConfig` and never changes decisions or counts. Measured on an H200 (docs/benchmarks.md, bf16, D = 128,
`benchmarks/studies/tune_triton.py`), the default (`default_launch_config`) for D > 64 is 128-row prefill programs on
8 warps with 2 stages, the tiles all rows see whole walked in a first loop without the causal and length masks
(`prefill_split_causal`), skipping only the exp (`exp`: V loaded and P·V run for every tile), and decode on 2 warps
with 3 stages skipping by a branch; for D <= 64 (not measured) 64-row programs on 4 warps, no split, branch.
Measured 2026-12-04 at prefill 16k: 64 rows on 8 warps (the first default) 19.5 ms dense / 23.1 at s=0.7;
128 rows 10.0 / 12.0; with scores kept in Q·K units and the scale times log2(e) folded into the exp2's one FMA
per element 8.1 / 10.4; with the split and `exp` 7.0 / 7.6 (1.16x dense, 1.31-1.36x sparse at s=0.5-0.9, counts
equal; 64k the same). Why `exp` wins although it skips less work: Triton software-pipelines (async copies a stage
ahead, sm_90 TTGIR, pinned by tests/unit/kernels/test_triton_compile.py) a load only when its user is not inside
a branch, so `branch` leaves every V load synchronous. 3 stages: 6.4 ms dense but 7.6-8.1 sparse (not kept).
Prefill counts its drops per row and sums them once after the loop; decode keeps its per-tile sum (per row it was
1.3-1.6x slower there). Decode: `exp` and 4 warps 0.66-0.92x, `predicated` (V loads masked off, P·V on zeros)
0.92-0.97x of the default; predicated prefill does not compile in Triton 3.6 (the pipeliner cannot predicate the
wgmma). Still open on the GPU: prefill at 0.54x cuDNN dense, and sparse prefill is not faster than our dense
(s=0.7: 7.6 against 7.0 ms; 0.9: 7.2): with `exp` only the exps are skipped, and with `branch` the V load is not
pipelined. The ideal speedup from skipping exp + P·V is 2 / (2 - s). Not measured yet: `prefetch` (prefill):
every tile's V issued one tile ahead as a loop-carried value, exp and P·V behind the branch (sm_90 TTGIR: the V
load becomes an async copy outside the branch; 226 registers against `exp`'s 192, no spills).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .semantics import DECISION_BLOCK_ROWS, RECENT_WINDOW, SPLIT_TOKENS, TILE_K, TILE_Q

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
MIN_PAGE_SIZE = 16
LOG2E = tl.constexpr(1.4426950408889634)
UNIT_ROWS = tl.constexpr(DECISION_BLOCK_ROWS)  # prompt rows of one aligned block decide together
WINDOW = tl.constexpr(RECENT_WINDOW)  # a row never drops a tile holding one of its WINDOW most recent keys
DECODE_ROWS_M = 32
"""Rows of a `_decode_rows_kernel` program's tile (query rows times their GQA group's heads, padded to a power of
two): 32 // BLOCK_G call rows per program (at least one). 64 needed 254 registers at D = 128 on 4 warps (sm_90)
and spilled at D = 256 on 8; 32 compiles to 188-205 (D = 128) and 196-251 (D = 256) without spills."""


# --------------------------------------------------------------------------------------------------------------
# Tile-loop pieces shared by the prefill and decode kernels
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _load_k_tile(k_ptr, bt_row, kpos, k_in, kv_head, offs_d, d_in,
                 stride_kb, stride_kp, stride_kh, stride_kd, PAGE: tl.constexpr):  # fmt: skip
    """K^T of keys `kpos` ([BLOCK_D, BLOCK_K], zeros where masked) and their (page id, slot)."""
    page_id = tl.load(bt_row + kpos // PAGE, mask=k_in, other=0).to(tl.int64)
    slot = kpos % PAGE
    ptrs = k_ptr + page_id[None, :] * stride_kb + slot[None, :] * stride_kp + kv_head * stride_kh
    kt = tl.load(ptrs + offs_d[:, None] * stride_kd, mask=k_in[None, :] & d_in[:, None], other=0.0)
    return kt, page_id, slot


@triton.jit
def _dot_input(x, DOT_T: tl.constexpr):
    """A loaded cache tile as the input of its dot (`DOT_T`: q's dtype, fp32 for FP32_DOT). A cache in q's dtype: x
    itself (no code). An FP8 tile: through fp32, exact (FP8 values are exact in fp16, bf16 and fp32). Chosen over a
    direct conversion: Triton 3.8's interpreter flushes e5m2 subnormals converting straight to fp16; for sm_90 the
    fp16 PTX is the same either way, the bf16 PTX of a conversion-only kernel is shorter (cvt f16x2 <- e4m3x2 /
    e5m2x2, f32, bf16, where the direct e5m2 -> bf16 is an integer emulation), and in the attention kernels
    neither wins (D = 256, the one head size where either spills: prefill 72 bytes of spill stores against 32,
    decode rows 12 against 52; none at D <= 128). On sm_90 the
    converted tile goes back to shared memory for the wgmma (K^T and V are its B operands): with the conversion,
    the cost an FP8 cache adds."""
    if x.dtype.is_fp8():
        x = x.to(tl.float32)
    return x.to(DOT_T)


@triton.jit
def _load_v_tile(v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh, stride_vd,
                 DOT_T: tl.constexpr):  # fmt: skip
    """V of the tile's keys ([BLOCK_K, BLOCK_D]) as the P·V dot's input (`_dot_input`); masked keys (past kv_len)
    read as zeros, never as stale data."""
    ptrs = v_ptr + page_id[:, None] * stride_vb + slot[:, None] * stride_vp + kv_head * stride_vh
    v = tl.load(ptrs + offs_d[None, :] * stride_vd, mask=k_in[:, None] & d_in[None, :], other=0.0)
    return _dot_input(v, DOT_T)


@triton.jit
def _load_v_of_tile(v_ptr, bt_row, kb, kv_len, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh, stride_vd,
                    PAGE: tl.constexpr, BLOCK_K: tl.constexpr, DOT_T: tl.constexpr):  # fmt: skip
    """V of key tile `kb` (zeros past kv_len), page ids read from the block table: the `prefetch` skip mode loads
    the next tile's V this way one tile ahead."""
    kpos = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    k_in = kpos < kv_len
    page_id = tl.load(bt_row + kpos // PAGE, mask=k_in, other=0).to(tl.int64)
    return _load_v_tile(v_ptr, page_id, kpos % PAGE, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh,
                        stride_vd, DOT_T)


@triton.jit
def _normalized(acc, l_i, v_scale, V_FP8: tl.constexpr):
    """The output rows acc / l (l = 0: a row that kept nothing, acc = 0). From an FP8 cache the values are v8 ·
    v_scale: v_scale is folded into the per-row denominator (l / v_scale, one division per row rather than one
    product per element; P·V ran on the FP8 values); for other caches no code."""
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if V_FP8:
        l_safe = l_safe / v_scale
    return acc / l_safe[:, None]


@triton.jit
def _scores(q, kt, softmax_scale, softcap, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores of a tile in units of `_score_unit`: Q·K as is (the scale is applied per row to the tile's max, and
    folded with log2(e) into the exp's one FMA per element), or capped scaled scores. An FP8 K tile is converted
    to q's dtype first (`_dot_input`); its k_scale is in `softmax_scale` (folded on the host)."""
    kt = _dot_input(kt, q.dtype)
    if FP32_DOT:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    if SOFTCAP:  # cap·tanh(s / cap), tanh from exp(-2|x|) (no overflow)
        x = s * softmax_scale / softcap
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(x < 0, -t, t)
    return s


@triton.jit
def _score_unit(softmax_scale, SOFTCAP: tl.constexpr):
    """What a `_scores` value times gives the scaled score. A row max times it is exactly the max of the scaled
    scores (rounding is monotonic and the scale positive), so skip decisions see the same values as before."""
    if SOFTCAP:
        return 1.0
    return softmax_scale


@triton.jit
def _row_log_lambda(c_pre, c_dec, g_pre, g_dec, pos, prompt_len):
    """ln λ of rows at `pos` (broadcasting): decode iff pos >= prompt_len, n = prompt_len or pos + 1; -inf = keep."""
    is_dec = pos >= prompt_len
    n = tl.where(is_dec, pos + 1, tl.maximum(prompt_len, 1)).to(tl.float32)
    x = tl.where(is_dec, c_dec, c_pre) - tl.where(is_dec, g_dec, g_pre) * tl.log(n)
    return tl.where(x < 0.0, x, float("-inf"))


@triton.jit
def _window_max(q, pos, kv_len, first_pos, last_pos, k_ptr, bt_row, kv_head, offs_d, d_in,
                stride_kb, stride_kp, stride_kh, stride_kd, softmax_scale, softcap, unit, R: tl.constexpr,
                PAGE: tl.constexpr, BLOCK_K: tl.constexpr, FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr):  # fmt: skip
    """w of each of the R rows at `pos` [R] (version 5): the max of the row's recent-window tile maxes, tiles
    max(0, pos − W + 1) // 64 .. pos // 64 (whichever split they are in), scored like the main loop scores them
    (same load, dot, soft-cap and causal/length mask), so w equals those tiles' g. The tiles of the rows
    `first_pos .. last_pos` are walked once, each row taking the ones in its own window. Nothing is read when no
    row can drop a tile (last_pos < 2·64 + W − 1): w stays −inf, which the effective gap then never looks at."""
    w = tl.full([R], float("-inf"), tl.float32)
    w_first = tl.maximum(pos - (WINDOW - 1), 0) // BLOCK_K  # each row's first window tile
    t_lo = tl.maximum(first_pos - (WINDOW - 1), 0) // BLOCK_K
    t_hi = tl.where(last_pos >= 2 * BLOCK_K + WINDOW - 1, last_pos // BLOCK_K, t_lo - 1)
    for t in range(t_lo, t_hi + 1):
        kpos = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = (kpos < kv_len) & (kpos <= last_pos)
        kt, _page, _slot = _load_k_tile(
            k_ptr, bt_row, kpos, k_in, kv_head, offs_d, d_in, stride_kb, stride_kp, stride_kh, stride_kd, PAGE
        )
        s = _scores(q, kt, softmax_scale, softcap, FP32_DOT, SOFTCAP)
        s = tl.where(k_in[None, :] & (kpos[None, :] <= pos[:, None]), s, float("-inf"))
        tile_max = tl.max(s, axis=1) * unit
        w = tl.maximum(w, tl.where(t >= w_first, tile_max, float("-inf")))
    return w


@triton.jit
def _effective_gap(tile_max, m_anchor, m_split, kb, pos, droppable, BLOCK_K: tl.constexpr):
    """A row's effective gap of key tile `kb` (docs/skip_softmax.md, "The skip test"): its tile max minus its
    reference max where it may drop the tile (`droppable`: the row visits it and kb > 0) and the tile lies wholly
    before its recent window (kb·64 + 63 < pos − W + 1), +inf elsewhere (broadcasting). The reference max is
    max(m_anchor, m_split): `m_anchor` holds tile 0's max and the row's recent-window max w (version 5),
    `m_split` the sink and the running max of the earlier tiles of kb's split."""
    before_window = kb * BLOCK_K + (BLOCK_K + WINDOW - 1) <= pos
    return tl.where(droppable & before_window, tile_max - tl.maximum(m_anchor, m_split), float("inf"))


@triton.jit
def _segment_max(x, member, BLOCK: tl.constexpr, SEG: tl.constexpr):
    """For every element of `x` [BLOCK], the max of the members (`member`) of its aligned segment of SEG elements
    (a decision unit: SEG prompt rows of a block, or a decode row's SEG heads), broadcast back; -inf where a segment
    has no member."""
    x = tl.where(member, x, float("-inf"))
    if SEG == 1:
        return x
    elif BLOCK == SEG:
        return tl.full([BLOCK], 0.0, tl.float32) + tl.max(x, axis=0)
    else:
        seg = tl.max(tl.reshape(x, [BLOCK // SEG, SEG]), axis=1)
        return tl.reshape(tl.broadcast_to(seg[:, None], [BLOCK // SEG, SEG]), [BLOCK])


@triton.jit
def _softmax_step(m_i, l_i, s, tile_max, keep_row, unit):
    """The online-softmax part of folding a score tile in: new row max and sum, probabilities P of the kept rows
    (zero elsewhere) and the factor alpha that rescales the accumulator. `s` is in `_score_unit`s: P is
    exp2(s · unit · log2(e) - m · log2(e)), one FMA and one exp2 per element."""
    m_new = tl.where(keep_row, tl.maximum(m_i, tile_max), m_i)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.where(keep_row[:, None], tl.exp2(s * (unit * LOG2E) - (m_safe * LOG2E)[:, None]), 0.0)
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha


@triton.jit
def _accumulate(acc, alpha, p, v, FP32_DOT: tl.constexpr, FUSED: tl.constexpr):
    """acc · alpha + P·V. FUSED: the rescaled accumulator is the dot's accumulator input (one MMA chain, as
    flash-attention kernels do); else P·V is added after (the same sum in another fp32 order)."""
    if FUSED:
        if FP32_DOT:
            return tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        return tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    if FP32_DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv


@triton.jit
def _online_softmax_update(m_i, l_i, acc, s, tile_max, keep_row, unit, v, FP32_DOT: tl.constexpr,
                           FUSED: tl.constexpr):  # fmt: skip
    """Fold the kept rows of a score tile `s` [R, BLOCK_K] and its V into the running (max, sum, accumulator)."""
    m_new, l_new, p, alpha = _softmax_step(m_i, l_i, s, tile_max, keep_row, unit)
    return m_new, l_new, _accumulate(acc, alpha, p, v, FP32_DOT, FUSED)


@triton.jit
def _value_step(v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh, stride_vd,
                m_i, l_i, acc, s, tile_max, keep_row, unit, v_ahead, MODE: tl.constexpr, V_SKIP: tl.constexpr,
                FP32_DOT: tl.constexpr, FUSED_ACC: tl.constexpr, DOT_T: tl.constexpr):  # fmt: skip
    """Load the tile's V and fold the kept rows in. When serving (MODE 1) a tile no row keeps is skipped, per
    V_SKIP: 0 a branch around the V load, exp and P·V; 1 V loaded and P·V run for every tile, a branch around the
    exp only (P = 0 and alpha = 1 for a skipped tile: acc unchanged), so Triton software-pipelines the V load as in
    dense launches (it does not pipeline a load whose only user sits inside the branch, even one issued before it);
    2 no branch, the V load predicated off and the update run on zero probabilities (the same result); 3 (prefill
    only) a branch around exp and P·V of `v_ahead`, this tile's V loaded one tile earlier (a loop-carried value the
    compiler cannot sink into the branch, so its latency hides behind a tile of work). Dense and calibration (every
    visited tile has a kept row) load and fold."""
    if MODE == 1:
        any_keep = tl.sum(keep_row.to(tl.int32), axis=0) > 0
        if V_SKIP == 0:
            if any_keep:
                v = _load_v_tile(v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh,
                                 stride_vd, DOT_T)  # fmt: skip
                m_i, l_i, acc = _online_softmax_update(m_i, l_i, acc, s, tile_max, keep_row, unit, v, FP32_DOT,
                                                       FUSED_ACC)
        elif V_SKIP == 3:
            if any_keep:
                m_i, l_i, acc = _online_softmax_update(m_i, l_i, acc, s, tile_max, keep_row, unit, v_ahead, FP32_DOT,
                                                       FUSED_ACC)
        elif V_SKIP == 1:
            v = _load_v_tile(v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh,
                             stride_vd, DOT_T)  # fmt: skip
            p = tl.zeros(s.shape, tl.float32)
            alpha = tl.full(m_i.shape, 1.0, tl.float32)
            if any_keep:
                m_i, l_i, p, alpha = _softmax_step(m_i, l_i, s, tile_max, keep_row, unit)
            acc = _accumulate(acc, alpha, p, v, FP32_DOT, FUSED_ACC)
        else:
            v = _load_v_tile(v_ptr, page_id, slot, k_in & any_keep, kv_head, offs_d, d_in, stride_vb, stride_vp,
                             stride_vh, stride_vd, DOT_T)  # fmt: skip
            m_i, l_i, acc = _online_softmax_update(m_i, l_i, acc, s, tile_max, keep_row, unit, v, FP32_DOT,
                                                   FUSED_ACC)
    else:
        v = _load_v_tile(v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh,
                         stride_vd, DOT_T)  # fmt: skip
        m_i, l_i, acc = _online_softmax_update(m_i, l_i, acc, s, tile_max, keep_row, unit, v, FP32_DOT, FUSED_ACC)
    return m_i, l_i, acc


@triton.jit
def _law(log_sf_ptr, gamma_ptr, seq, trials, N_TRIALS: tl.constexpr, MODE: tl.constexpr):
    """Per-sequence law values: (c_prefill, c_decode) per trial ([TRIALS_P2], MODE 2) or scalars, and γ."""
    base = log_sf_ptr + seq.to(tl.int64) * (N_TRIALS * 2)
    if MODE == 2:
        t_in = trials < N_TRIALS
        c_pre = tl.load(base + trials * 2, mask=t_in, other=float("-inf"))
        c_dec = tl.load(base + trials * 2 + 1, mask=t_in, other=float("-inf"))
    else:
        c_pre = tl.load(base)
        c_dec = tl.load(base + 1)
    g_pre = tl.load(gamma_ptr + seq * 2)
    g_dec = tl.load(gamma_ptr + seq * 2 + 1)
    return c_pre, c_dec, g_pre, g_dec


@triton.jit
def _add_counts(counts_ptr, seq, trials, n_visited, n_drop, N_TRIALS: tl.constexpr):
    c_ptrs = counts_ptr + (seq * N_TRIALS + trials) * 2
    t_in = trials < N_TRIALS
    tl.atomic_add(c_ptrs, (n_drop * 0 + n_visited).to(tl.int64), mask=t_in)
    tl.atomic_add(c_ptrs + 1, n_drop.to(tl.int64), mask=t_in)


# --------------------------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _prefill_tile(kb, q, pos, row_in, kv_len, m_i, m_anchor, m_split, l_i, acc, drops, drops2, log_lam, log_lam2,
                  v_ahead, sink, unit, softmax_scale, softcap, k_ptr, v_ptr, bt_row, kv_head, offs_d, d_in,
                  stride_kb, stride_kp, stride_kh, stride_kd, stride_vb, stride_vp, stride_vh, stride_vd,
                  PAGE: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_BLOCKS: tl.constexpr, MODE: tl.constexpr,
                  FP32_DOT: tl.constexpr, SOFTCAP: tl.constexpr, V_SKIP: tl.constexpr, FUSED_ACC: tl.constexpr,
                  MASKED: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_Q: tl.constexpr):  # fmt: skip
    """One key tile of a prefill program: scores, decisions, softmax and P·V. MASKED: the causal and length masks;
    without, the caller guarantees every row of the block sees every key of the tile (rows outside the program's
    rows of the call stay out through `row_in`). `v_ahead`: this tile's V when serving with the `prefetch` skip
    mode, which returns the next tile's in its place (anything else is passed through). `sink`: the head's sink
    logit (HAS_SINKS), which every split's running max starts from. When deciding (MODE 1, 2) every row in `row_in`
    is a prompt row and its unit is the program's rows of its aligned 64-row segment: they share ln λ (`log_lam`
    scalar; `log_lam2` [TRIALS_P2] per trial) and drop the tile iff their largest effective gap is below it."""
    kpos = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    k_in = kpos < kv_len
    kt, page_id, slot = _load_k_tile(
        k_ptr, bt_row, kpos, k_in, kv_head, offs_d, d_in, stride_kb, stride_kp, stride_kh, stride_kd, PAGE
    )
    v_tile = v_ahead
    if MODE == 1:
        if V_SKIP == 3:  # issued before this tile's work, used by the next tile
            v_ahead = _load_v_of_tile(v_ptr, bt_row, kb + 1, kv_len, kv_head, offs_d, d_in, stride_vb, stride_vp,
                                      stride_vh, stride_vd, PAGE, BLOCK_K, q.dtype)  # fmt: skip
    s = _scores(q, kt, softmax_scale, softcap, FP32_DOT, SOFTCAP)
    if MASKED:
        s = tl.where(k_in[None, :] & (kpos[None, :] <= pos[:, None]), s, float("-inf"))
        valid = row_in & (kb * BLOCK_K <= pos)
    else:
        valid = row_in
    tile_max = tl.max(s, axis=1) * unit
    m_anchor = tl.where(kb == 0, tl.maximum(m_anchor, tile_max), m_anchor)  # seeded with w (version 5)
    if HAS_SINKS:  # the sink seeds every split's reference max, like the anchor
        m_split = tl.where(kb % SPLIT_BLOCKS == 0, sink, m_split)
    else:
        m_split = tl.where(kb % SPLIT_BLOCKS == 0, float("-inf"), m_split)
    keep_row = valid
    if MODE != 0:
        # the rows of one aligned 64-position block visit the same tiles, so a segment's members are all `valid`
        # or none is; the max runs over `row_in` (the unmasked loop's `valid`)
        gap = _effective_gap(tile_max, m_anchor, m_split, kb, pos, valid & (kb > 0), BLOCK_K)
        unit_gap = _segment_max(gap, row_in, BLOCK_Q, UNIT_ROWS)
        if MODE == 1:
            drop = valid & (unit_gap < log_lam)
            keep_row = valid & ~drop
            drops += drop.to(tl.int32)
        else:
            drop2 = valid[:, None] & (unit_gap[:, None] < log_lam2[None, :])
            drops2 += drop2.to(tl.int32)
    m_split = tl.maximum(m_split, tile_max)
    m_i, l_i, acc = _value_step(
        v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh, stride_vd,
        m_i, l_i, acc, s, tile_max, keep_row, unit, v_tile, MODE, V_SKIP, FP32_DOT, FUSED_ACC, q.dtype,
    )  # fmt: skip
    return m_i, m_anchor, m_split, l_i, acc, drops, drops2, v_ahead


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, kv_lens_ptr, prompt_ptr, log_sf_ptr, gamma_ptr, counts_ptr,
    sinks_ptr, softmax_scale, softcap, v_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    N_TRIALS: tl.constexpr, TRIALS_P2: tl.constexpr, MODE: tl.constexpr, FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr, V_SKIP: tl.constexpr, FUSED_ACC: tl.constexpr, SPLIT_CAUSAL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):  # fmt: skip
    # MODE: 0 dense without counts, 1 serving (drop per unit), 2 calibration (dense, count all trials).
    # Reversed order: the last (longest, causal) query blocks start first, which shortens the tail of the grid.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Sequence of this program: the largest b with cu_q[b] // BLOCK_Q + 2b <= pid (starts strictly increase).
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + 2 * mid
        lo = tl.where(start <= pid, mid, lo)
        hi = tl.where(start <= pid, hi, mid)
    seq = lo
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    prompt_len = tl.load(prompt_ptr + seq)
    # Program i of the sequence holds the call's rows at absolute positions [block_pos, block_pos + BLOCK_Q) of the
    # aligned block (first new position // BLOCK_Q) + i: a call that starts mid-block has a partial first program.
    first_new = kv_len - q_len  # position of the call's first row
    block_pos = (first_new // BLOCK_Q + pid - (q_start // BLOCK_Q + 2 * seq)) * BLOCK_Q
    row_end = kv_len  # one past the last position this program may hold
    if MODE != 0:
        row_end = tl.minimum(row_end, prompt_len)  # deciding: prompt rows only (decode rows: _decode_rows_kernel)
    first_pos = tl.maximum(block_pos, first_new)
    last_pos = tl.minimum(block_pos + BLOCK_Q, row_end) - 1
    if (q_len <= 1) | (last_pos < first_pos):
        return  # decode / empty sequence, a block past the sequence's end, or decode rows only

    pos = block_pos + tl.arange(0, BLOCK_Q)  # absolute position = last key each row sees
    rows = pos - first_new  # index among the call's rows
    row_in = (pos >= first_pos) & (pos <= last_pos)
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_in[:, None] & d_in[None, :], other=0.0)

    n_kblocks = last_pos // BLOCK_K + 1  # every one of them is visited by some row

    trials = tl.arange(0, TRIALS_P2)
    # The rows that decide are prompt rows: one ln λ for all of them (n = prompt_len), per trial when calibrating.
    log_lam = float("-inf")
    log_lam2 = tl.full([TRIALS_P2], float("-inf"), tl.float32)
    if MODE != 0:
        c_pre, c_dec, g_pre, g_dec = _law(log_sf_ptr, gamma_ptr, seq, trials, N_TRIALS, MODE)
        if MODE == 1:
            log_lam = _row_log_lambda(c_pre, c_dec, g_pre, g_dec, first_pos, prompt_len)
        else:
            log_lam2 = _row_log_lambda(c_pre, c_dec, g_pre, g_dec, first_pos, prompt_len)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    m_anchor = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    m_split = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    sink = float("-inf")
    if HAS_SINKS:  # the sink joins the denominator once and the output never: m = σ, l = exp(σ - σ) = 1, acc = 0
        sink = tl.load(sinks_ptr + head)
        m_i = tl.full([BLOCK_Q], 0.0, tl.float32) + sink
        l_i = tl.full([BLOCK_Q], 1.0, tl.float32)
    # Drops are counted per row and summed once after the loop: a sum over the block's rows inside the loop
    # is a cross-warp reduction (shared memory and a barrier) per tile.
    drops = tl.zeros([BLOCK_Q], tl.int32)
    drops2 = tl.zeros([BLOCK_Q, TRIALS_P2], tl.int32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    unit = _score_unit(softmax_scale, SOFTCAP)
    if MODE != 0:  # version 5: each row's recent-window max w seeds its anchor (tile 0's max joins it at kb == 0)
        m_anchor = _window_max(
            q, pos, kv_len, first_pos, last_pos, k_ptr, bt_row, kv_head, offs_d, d_in,
            stride_kb, stride_kp, stride_kh, stride_kd, softmax_scale, softcap, unit, BLOCK_Q,
            PAGE, BLOCK_K, FP32_DOT, SOFTCAP,
        )  # fmt: skip
    v_ahead = 0.0  # the `prefetch` skip mode's V of the next tile (loop-carried); unused otherwise
    if MODE == 1:
        if V_SKIP == 3:
            v_ahead = _load_v_of_tile(v_ptr, bt_row, 0, kv_len, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh,
                                      stride_vd, PAGE, BLOCK_K, q.dtype)  # fmt: skip
    kb_masked = 0
    if SPLIT_CAUSAL:  # tiles every row of the block sees whole (keys <= the first row's position): no mask
        kb_masked = tl.minimum((first_pos + 1) // BLOCK_K, n_kblocks)
        for kb in range(0, kb_masked):
            m_i, m_anchor, m_split, l_i, acc, drops, drops2, v_ahead = _prefill_tile(
                kb, q, pos, row_in, kv_len, m_i, m_anchor, m_split, l_i, acc, drops, drops2, log_lam, log_lam2,
                v_ahead, sink, unit, softmax_scale, softcap, k_ptr, v_ptr, bt_row, kv_head, offs_d, d_in,
                stride_kb, stride_kp, stride_kh, stride_kd, stride_vb, stride_vp, stride_vh, stride_vd,
                PAGE, BLOCK_K, SPLIT_BLOCKS, MODE, FP32_DOT, SOFTCAP, V_SKIP, FUSED_ACC, False, HAS_SINKS, BLOCK_Q,
            )  # fmt: skip
    for kb in range(kb_masked, n_kblocks):
        m_i, m_anchor, m_split, l_i, acc, drops, drops2, v_ahead = _prefill_tile(
            kb, q, pos, row_in, kv_len, m_i, m_anchor, m_split, l_i, acc, drops, drops2, log_lam, log_lam2,
            v_ahead, sink, unit, softmax_scale, softcap, k_ptr, v_ptr, bt_row, kv_head, offs_d, d_in,
            stride_kb, stride_kp, stride_kh, stride_kd, stride_vb, stride_vp, stride_vh, stride_vd,
            PAGE, BLOCK_K, SPLIT_BLOCKS, MODE, FP32_DOT, SOFTCAP, V_SKIP, FUSED_ACC, True, HAS_SINKS, BLOCK_Q,
        )  # fmt: skip

    o = _normalized(acc, l_i, v_scale, v_ptr.dtype.element_ty.is_fp8())
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & d_in[None, :])
    if MODE != 0:
        n_visited = tl.sum(tl.where(row_in, pos // BLOCK_K + 1, 0), axis=0)  # a row visits tiles 0 .. pos // BLOCK_K
        if MODE == 1:
            n_drop = tl.where(trials == 0, tl.sum(drops, axis=0), 0)
        else:
            n_drop = tl.sum(drops2, axis=0)
        _add_counts(counts_ptr, seq, trials, n_visited, n_drop, N_TRIALS)


# --------------------------------------------------------------------------------------------------------------
# Decode (split-K) and merge
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["max_splits"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, kv_lens_ptr, prompt_ptr, log_sf_ptr, gamma_ptr, counts_ptr,
    sinks_ptr, ws_acc_ptr, ws_ml_ptr,
    softmax_scale, softcap, v_scale, max_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    NUM_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    N_TRIALS: tl.constexpr, TRIALS_P2: tl.constexpr, MODE: tl.constexpr, FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr, V_SKIP: tl.constexpr, FUSED_ACC: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    n_kblocks_total = tl.cdiv(kv_len, BLOCK_K)
    kb_start = split * SPLIT_BLOCKS
    if (q_len != 1) | (kb_start >= n_kblocks_total):
        return
    kb_end = tl.minimum(kb_start + SPLIT_BLOCKS, n_kblocks_total)
    # Clamped to the grid: a caller whose max_seqlen_k does not bound seq_lens_k gets wrong rows, never a write
    # past the workspace (the CUDA-graph self-test relies on it to report a frozen bound instead of crashing).
    n_splits = tl.minimum(tl.cdiv(n_kblocks_total, SPLIT_BLOCKS), max_splits)

    g = tl.arange(0, BLOCK_G)
    g_in = g < GROUP
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < HEAD_DIM
    q_row = q_start.to(tl.int64)
    q_ptrs = q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_in[:, None] & d_in[None, :], other=0.0)

    pos = kv_len - 1
    trials = tl.arange(0, TRIALS_P2)
    prompt_len = tl.load(prompt_ptr + seq)
    is_prompt = pos < prompt_len
    log_lam = float("-inf")
    log_lam2 = tl.full([TRIALS_P2], float("-inf"), tl.float32)
    if MODE != 0:
        c_pre, c_dec, g_pre, g_dec = _law(log_sf_ptr, gamma_ptr, seq, trials, N_TRIALS, MODE)
        if MODE == 1:
            log_lam = _row_log_lambda(c_pre, c_dec, g_pre, g_dec, pos, prompt_len)
        else:
            log_lam2 = _row_log_lambda(c_pre, c_dec, g_pre, g_dec, pos, prompt_len)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    unit = _score_unit(softmax_scale, SOFTCAP)
    m_anchor = tl.full([BLOCK_G], float("-inf"), tl.float32)
    if MODE != 0:
        # version 5: the row's recent-window max w seeds the anchor; every split scores the (two or three) window
        # tiles itself, since they may lie in another split
        m_anchor = _window_max(
            q, tl.full([BLOCK_G], 0, tl.int32) + pos, kv_len, pos, pos, k_ptr, bt_row, kv_head, offs_d, d_in,
            stride_kb, stride_kp, stride_kh, stride_kd, softmax_scale, softcap, unit, BLOCK_G,
            PAGE, BLOCK_K, FP32_DOT, SOFTCAP,
        )  # fmt: skip
    if (MODE != 0) & (split > 0):  # the anchor of this split's rows: tile 0's max (and w)
        kpos0 = tl.arange(0, BLOCK_K)
        k_in0 = kpos0 < kv_len
        kt0, _p0, _s0 = _load_k_tile(
            k_ptr, bt_row, kpos0, k_in0, kv_head, offs_d, d_in, stride_kb, stride_kp, stride_kh, stride_kd, PAGE
        )
        s0 = tl.where(k_in0[None, :], _scores(q, kt0, softmax_scale, softcap, FP32_DOT, SOFTCAP), float("-inf"))
        m_anchor = tl.maximum(m_anchor, tl.max(s0, axis=1) * unit)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    m_split = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if HAS_SINKS:
        # Every split compares its tiles with the sink (it seeds the split's running max); only the split holding
        # tile 0 puts it in the softmax (m = σ, l = 1), so the merge counts it once.
        sink = tl.load(sinks_ptr + heads, mask=g_in, other=float("-inf"))
        m_split = sink
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    # Summed per tile here (unlike the prefill kernel): per-row sums after the loop made the 2-warp, 3-stage
    # launch 1.3-1.6x slower when serving on an H200 (bf16, B=1 at 128k and B=64 at 16k).
    n_drop = tl.zeros([TRIALS_P2], tl.int32)
    for kb in range(kb_start, kb_end):
        kpos = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = kpos < kv_len
        kt, page_id, slot = _load_k_tile(
            k_ptr, bt_row, kpos, k_in, kv_head, offs_d, d_in, stride_kb, stride_kp, stride_kh, stride_kd, PAGE
        )
        s = _scores(q, kt, softmax_scale, softcap, FP32_DOT, SOFTCAP)
        s = tl.where(k_in[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_K]
        tile_max = tl.max(s, axis=1) * unit
        m_anchor = tl.where(kb == 0, tl.maximum(m_anchor, tile_max), m_anchor)  # seeded with w (version 5)
        keep_row = g_in
        if MODE != 0:
            # a decode row's unit is its GQA group (the largest effective gap of the group's heads); a prompt row
            # alone in its call (a prompt's last row) is its own block's only member: it decides per head
            gap = _effective_gap(tile_max, m_anchor, m_split, kb, pos, g_in & (kb > 0), BLOCK_K)
            unit_gap = tl.where(is_prompt, gap, tl.max(tl.where(g_in, gap, float("-inf")), axis=0))
            if MODE == 1:
                drop = g_in & (unit_gap < log_lam)
                keep_row = g_in & ~drop
                n_drop += tl.where(trials == 0, tl.sum(drop.to(tl.int32), axis=0), 0)
            else:
                drop2 = g_in[:, None] & (unit_gap[:, None] < log_lam2[None, :])
                n_drop += tl.sum(drop2.to(tl.int32), axis=0)
        m_split = tl.maximum(m_split, tile_max)
        m_i, l_i, acc = _value_step(
            v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh, stride_vd,
            m_i, l_i, acc, s, tile_max, keep_row, unit, 0.0, MODE, V_SKIP, FP32_DOT, FUSED_ACC, q.dtype,
        )  # fmt: skip

    if n_splits == 1:
        o = _normalized(acc, l_i, v_scale, v_ptr.dtype.element_ty.is_fp8())
        out_ptrs = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_in[:, None] & d_in[None, :])
    else:
        ws_row = (seq.to(tl.int64) * NUM_HEADS + heads) * max_splits + split  # [BLOCK_G]
        tl.store(ws_acc_ptr + ws_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_in[:, None])
        tl.store(ws_ml_ptr + ws_row * 2, m_i, mask=g_in)
        if v_ptr.dtype.element_ty.is_fp8():  # v_scale in the denominator, as `_normalized`: the merge is unchanged
            l_i = l_i / v_scale
        tl.store(ws_ml_ptr + ws_row * 2 + 1, l_i, mask=g_in)
    if MODE != 0:
        _add_counts(counts_ptr, seq, trials, (kb_end - kb_start) * GROUP, n_drop, N_TRIALS)


@triton.jit(do_not_specialize=["max_splits"])
def _decode_merge_kernel(
    out_ptr, cu_q_ptr, kv_lens_ptr, ws_acc_ptr, ws_ml_ptr,
    max_splits, stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_HEADS: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    n_splits = tl.minimum(tl.cdiv(kv_len, SPLIT_TOKENS), max_splits)  # clamped as in the decode kernel
    if (q_len != 1) | (n_splits <= 1):
        return
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq.to(tl.int64) * NUM_HEADS + head) * max_splits
    m = tl.load(ws_ml_ptr + base * 2)  # split 0: finite (tile 0 is never dropped; it holds the sink, if any); a
    # later split may be all dropped (max -inf, sum 0): it then contributes exp(-inf) = 0
    l_tot = tl.load(ws_ml_ptr + base * 2 + 1)
    acc = tl.load(ws_acc_ptr + base * BLOCK_D + offs_d)
    for sp in range(1, n_splits):
        m_s = tl.load(ws_ml_ptr + (base + sp) * 2)
        l_s = tl.load(ws_ml_ptr + (base + sp) * 2 + 1)
        a_s = tl.load(ws_acc_ptr + (base + sp) * BLOCK_D + offs_d)
        m_new = tl.maximum(m, m_s)
        c_old = tl.exp(m - m_new)
        c_new = tl.exp(m_s - m_new)
        l_tot = l_tot * c_old + l_s * c_new
        acc = acc * c_old + a_s * c_new
        m = m_new
    o = acc / l_tot
    out_ptrs = out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + offs_d * stride_od
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# --------------------------------------------------------------------------------------------------------------
# Decode rows of multi-row calls
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_seqs"])
def _decode_rows_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, kv_lens_ptr, prompt_ptr, log_sf_ptr, gamma_ptr, counts_ptr,
    sinks_ptr, softmax_scale, softcap, v_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    N_TRIALS: tl.constexpr, TRIALS_P2: tl.constexpr, MODE: tl.constexpr, FP32_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):  # fmt: skip
    """Decode rows (pos >= prompt_len) of sequences with q_len >= 2 (speculative-decoding verification rows, a
    request recomputed after preemption), which the prefill kernel leaves out when deciding: one program per
    (BLOCK_R consecutive decode rows, KV head), the rows' GQA-group heads packed into the M dimension (element m is
    row m // BLOCK_G, head m % BLOCK_G), so each row's unit (its group's heads) is a segment of BLOCK_G elements.
    Sequence `b` owns program ids `cu_q[b] // BLOCK_R + b + i` for its decode-row blocks `i` (counted from its
    first decode row); every other program exits after the binary search. One pass over the keys (no split-K):
    the split max restarts at each split as in every other kernel. Serving skips with a branch (V_SKIP 0)."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_R + mid
        lo = tl.where(start <= pid, mid, lo)
        hi = tl.where(start <= pid, hi, mid)
    seq = lo
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    prompt_len = tl.load(prompt_ptr + seq)
    first_new = kv_len - q_len
    first_row = tl.maximum(prompt_len - first_new, 0) + (pid - (q_start // BLOCK_R + seq)) * BLOCK_R
    if (q_len <= 1) | (first_row >= q_len):
        return  # a decode step (the decode kernel's), an empty sequence, or no decode rows left for this program

    m = tl.arange(0, BLOCK_R * BLOCK_G)
    g = m % BLOCK_G
    rows = first_row + m // BLOCK_G
    row_in = (rows < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_in[:, None] & d_in[None, :], other=0.0)

    pos = first_new + rows
    last_pos = tl.minimum(first_new + first_row + BLOCK_R, kv_len) - 1
    n_kblocks = last_pos // BLOCK_K + 1

    trials = tl.arange(0, TRIALS_P2)
    c_pre, c_dec, g_pre, g_dec = _law(log_sf_ptr, gamma_ptr, seq, trials, N_TRIALS, MODE)
    log_lam = tl.full([BLOCK_R * BLOCK_G], float("-inf"), tl.float32)
    log_lam2 = tl.full([BLOCK_R * BLOCK_G, TRIALS_P2], float("-inf"), tl.float32)
    if MODE == 1:
        log_lam = _row_log_lambda(c_pre, c_dec, g_pre, g_dec, pos, prompt_len)
    else:
        log_lam2 = _row_log_lambda(c_pre[None, :], c_dec[None, :], g_pre, g_dec, pos[:, None], prompt_len)

    m_i = tl.full([BLOCK_R * BLOCK_G], float("-inf"), tl.float32)
    m_split = tl.full([BLOCK_R * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_R * BLOCK_G, BLOCK_D], tl.float32)
    sink = tl.full([BLOCK_R * BLOCK_G], float("-inf"), tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=g < GROUP, other=float("-inf"))
        m_i = sink
        l_i = tl.full([BLOCK_R * BLOCK_G], 1.0, tl.float32)
    drops = tl.zeros([BLOCK_R * BLOCK_G], tl.int32)
    drops2 = tl.zeros([BLOCK_R * BLOCK_G, TRIALS_P2], tl.int32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    unit = _score_unit(softmax_scale, SOFTCAP)
    # version 5: each row's recent-window max w seeds its anchor (tile 0's max joins it at kb == 0)
    m_anchor = _window_max(
        q, pos, kv_len, first_new + first_row, last_pos, k_ptr, bt_row, kv_head, offs_d, d_in,
        stride_kb, stride_kp, stride_kh, stride_kd, softmax_scale, softcap, unit, BLOCK_R * BLOCK_G,
        PAGE, BLOCK_K, FP32_DOT, SOFTCAP,
    )  # fmt: skip
    for kb in range(0, n_kblocks):
        kpos = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = kpos < kv_len
        kt, page_id, slot = _load_k_tile(
            k_ptr, bt_row, kpos, k_in, kv_head, offs_d, d_in, stride_kb, stride_kp, stride_kh, stride_kd, PAGE
        )
        s = _scores(q, kt, softmax_scale, softcap, FP32_DOT, SOFTCAP)
        s = tl.where(k_in[None, :] & (kpos[None, :] <= pos[:, None]), s, float("-inf"))
        valid = row_in & (kb * BLOCK_K <= pos)
        tile_max = tl.max(s, axis=1) * unit
        m_anchor = tl.where(kb == 0, tl.maximum(m_anchor, tile_max), m_anchor)  # seeded with w (version 5)
        m_split = tl.where(kb % SPLIT_BLOCKS == 0, sink, m_split)
        # a row's heads visit the same tiles: the group max runs over the row's real heads
        gap = _effective_gap(tile_max, m_anchor, m_split, kb, pos, valid & (kb > 0), BLOCK_K)
        unit_gap = _segment_max(gap, row_in, BLOCK_R * BLOCK_G, BLOCK_G)
        keep_row = valid
        if MODE == 1:
            drop = valid & (unit_gap < log_lam)
            keep_row = valid & ~drop
            drops += drop.to(tl.int32)
        else:
            drops2 += (valid[:, None] & (unit_gap[:, None] < log_lam2)).to(tl.int32)
        m_split = tl.maximum(m_split, tile_max)
        m_i, l_i, acc = _value_step(
            v_ptr, page_id, slot, k_in, kv_head, offs_d, d_in, stride_vb, stride_vp, stride_vh, stride_vd,
            m_i, l_i, acc, s, tile_max, keep_row, unit, 0.0, MODE, 0, FP32_DOT, False, q.dtype,
        )  # fmt: skip

    o = _normalized(acc, l_i, v_scale, v_ptr.dtype.element_ty.is_fp8())
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & d_in[None, :])
    n_visited = tl.sum(tl.where(row_in, pos // BLOCK_K + 1, 0), axis=0)
    if MODE == 1:
        n_drop = tl.where(trials == 0, tl.sum(drops, axis=0), 0)
    else:
        n_drop = tl.sum(drops2, axis=0)
    _add_counts(counts_ptr, seq, trials, n_visited, n_drop, N_TRIALS)


# --------------------------------------------------------------------------------------------------------------
# Host wrapper
# --------------------------------------------------------------------------------------------------------------


SKIP_MODES = {"branch": 0, "exp": 1, "predicated": 2, "prefetch": 3}
"""How a serving kernel skips a tile no row of its program keeps (`_value_step`): `branch` skips the V load, exp and
P·V; `exp` loads V and runs P·V for every tile and skips the exp only (the one mode whose V load Triton
software-pipelines when serving, as in dense launches); `predicated` has no branch (V load masked off, update on
zero probabilities; Triton 3.6 and 3.8 cannot pipeline it for prefill on sm_90); `prefetch` (prefill only) loads
every tile's V one tile ahead and skips exp and P·V by a branch."""
DECODE_SKIP_MODES = ("branch", "exp", "predicated")


@dataclass(frozen=True)
class LaunchConfig:
    """How the Triton kernels are launched: rows per prefill program, warps, pipeline stages, how a tile no row
    keeps is skipped (`SKIP_MODES`), whether P·V accumulates inside the dot, and whether a prefill program walks the
    tiles all its rows see whole in a loop without the causal mask (`prefill_split_causal`). None of it changes
    decisions or counts (outputs only by fp32 summation order); `benchmarks/studies/tune_triton.py` measures the
    choices on a GPU."""

    prefill_block_q: int = TILE_Q
    prefill_warps: int = 8
    prefill_stages: int = 2
    prefill_skip: str = "branch"
    prefill_fused_acc: bool = False
    prefill_split_causal: bool = False
    decode_warps: int = 4
    decode_stages: int = 2
    decode_skip: str = "branch"
    decode_fused_acc: bool = False

    def __post_init__(self):
        # checked here, not when Triton compiles the first launch in the middle of serving
        for name, allowed in (("prefill_skip", tuple(SKIP_MODES)), ("decode_skip", DECODE_SKIP_MODES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"LaunchConfig.{name} must be one of {sorted(allowed)}, got {value!r}")
        # prefill programs hold whole aligned 64-row decision blocks (docs/skip_softmax.md, version 4)
        choices = {"prefill_block_q": (64, 128, 256), "prefill_warps": (1, 2, 4, 8, 16),
                   "decode_warps": (1, 2, 4, 8, 16)}  # fmt: skip
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"LaunchConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("prefill_stages", "decode_stages"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"LaunchConfig.{name} must be an int >= 1, got {getattr(self, name)!r}")


@functools.cache
def default_launch_config(head_dim: int) -> LaunchConfig:
    """The launch configuration used when the caller passes none (measured on an H200, see the module docstring):
    for D > 64 128-row prefill programs on 8 warps with whole tiles in their own loop, skipping only the exp (the V
    load stays pipelined); 64 rows on 4 warps, no split, branch below (not measured). Decode on 2 warps with 3
    stages, tiles nobody keeps skipped by a branch. Made once per head size (every launch asks for it)."""
    if head_dim > 64:
        return LaunchConfig(prefill_block_q=128, prefill_warps=8, prefill_stages=2, prefill_skip="exp",
                            prefill_split_causal=True, decode_warps=2, decode_stages=3)
    return LaunchConfig(prefill_block_q=64, prefill_warps=4, prefill_stages=2, decode_warps=2, decode_stages=3)


def decode_rows_launch(group: int) -> dict:
    """Compile-time block sizes and launch options of `_decode_rows_kernel` for a GQA group of `group` query heads:
    the group padded to a power of two, 32 // that many call rows per program (at least one), 4 warps, 2 stages."""
    block_g = triton.next_power_of_2(group)
    return dict(BLOCK_G=block_g, BLOCK_R=max(1, DECODE_ROWS_M // block_g), num_warps=4, num_stages=2)


FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""FP8 caches the kernels read (as `*fp8e4nv` / `*fp8e5` pointers): a key is its FP8 value times k_scale, a value
times v_scale (docs/skip_softmax.md "Inputs")."""


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the Triton backend cannot take these inputs (dtype, head size, page size), or None when it can.

    Lets a dispatcher fall back to the reference instead of raising (e.g. backend='auto' with float64). The cache is
    in q's dtype or FP8 (`FP8_CACHE_DTYPES`).
    """
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton backend supports float16, bfloat16 and float32, got {q.dtype}; use backend='torch'"
    if k_cache.dtype != q.dtype and k_cache.dtype not in FP8_CACHE_DTYPES:
        return (f"the Triton backend reads caches in q's dtype ({q.dtype}) or FP8 {FP8_CACHE_DTYPES}, got "
                f"{k_cache.dtype}; use backend='torch'")
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        return f"the Triton backend supports head sizes {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got D={d}; use backend='torch'"
    if k_cache.dim() != 4:
        return "the Triton backend reads [num_blocks, page, Hkv, D] cache views (not the CPU amx layout's 6-D ones)"
    page = k_cache.shape[1]
    if page < MIN_PAGE_SIZE or page & (page - 1):
        return f"the Triton backend needs a power-of-two page size >= {MIN_PAGE_SIZE}, got {page}; use backend='torch'"
    return None


def _check_triton_inputs(q, k_cache, log_sf, calibrate) -> None:
    reason = unsupported_reason(q, k_cache)
    if reason is not None:
        dtype_problem = q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or (
            k_cache.dtype != q.dtype and k_cache.dtype not in FP8_CACHE_DTYPES
        )
        raise (TypeError if dtype_problem else ValueError)(reason)
    if log_sf is not None:
        if log_sf.dim() != 3 or log_sf.shape[2] != 2 or log_sf.dtype != torch.float32:
            raise ValueError(f"log_sf must be a float32 [B, T, 2] tensor, got {log_sf.dtype} {tuple(log_sf.shape)}")
        if not calibrate and log_sf.shape[1] != 1:
            raise ValueError(f"serving takes one law per sequence (T == 1), got T={log_sf.shape[1]}")


@functools.cache
def _placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor for pointer arguments a launch never touches (made once per device and dtype)."""
    return torch.zeros(1, dtype=dtype, device=device)


def paged_skip_softmax_attention_triton(
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
    max_seqlen_k: int | None = None,
    counts: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor | None:
    """Triton backend of `paged_skip_softmax_attention` (arguments validated and normalised by the caller).

    Same contract as `paged_skip_softmax_attention_reference`: `log_sf` [B, T, 2] float32 (per trial and phase,
    -inf = dense) or None (dense, no counts), `gamma` [B, 2], `prompt_lens` [B]; with `calibrate` the output is
    dense and counts cover all T trials, otherwise T == 1 and each row's drops are applied. Writes rows
    `< total_q` of `out` only. Returns int64 counts [B, T, 2] (visited, dropped row-tiles) or None.
    `max_seqlen_k` (optional host int, an upper bound of `seq_lens_k`) only shrinks the decode grid and
    workspace; without it the bound is `block_table.shape[1] * page_size`. `sinks`: None or float32 [Hq] attention
    sinks on q's device (`semantics.checked_sinks`). `k_scale`, `v_scale`: an FP8 cache's host-float scales (a key
    is its FP8 value times k_scale, a value times v_scale; ignored for a cache in q's dtype).
    """
    _check_triton_inputs(q, k_cache, log_sf, calibrate)
    return launch_triton(
        q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, softmax_scale=softmax_scale, log_sf=log_sf,
        gamma=gamma, prompt_lens=prompt_lens, calibrate=calibrate, out=out, max_seqlen_k=max_seqlen_k, counts=counts,
        softcap=softcap, sinks=sinks, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip


def _law_arguments(log_sf, calibrate, counts, batch, device):
    """(MODE, N_TRIALS, counts, log_sf argument) of a launch: dense without a law (no counts), else serving or
    calibration with `counts` zeroed on the device (or allocated when the caller keeps no buffer)."""
    if log_sf is None:
        return 0, 1, None, torch.empty(batch, 1, 2, dtype=torch.float32, device=device)
    n_trials = log_sf.shape[1]
    if counts is None:
        counts = torch.zeros(batch, n_trials, 2, dtype=torch.int64, device=device)
    else:
        counts.zero_()
    return (2 if calibrate else 1), n_trials, counts, log_sf.contiguous()


def _decode_splits(block_table, page, max_seqlen_k) -> int:
    """Split-K splits of the decode grid, bounded without reading seq_lens_k (so a captured grid fits every replay):
    from the block table's width, or `max_seqlen_k` when the caller knows a tighter bound."""
    max_kv = block_table.shape[1] * page
    if max_seqlen_k is not None:
        max_kv = min(max_kv, int(max_seqlen_k))
    return max(1, math.ceil(max_kv / SPLIT_TOKENS))


def _decode_workspace(workspace, batch, num_heads, max_splits, block_d, device):
    """(accumulators, max/sum) fp32 split-K workspace: the caller's persistent one, else allocated for this launch;
    a placeholder with one split (never read or written then)."""
    if max_splits <= 1:
        ws = _placeholder(device, torch.float32)
        return ws, ws
    if workspace is not None:
        ws_acc, ws_ml = workspace
        return ws_acc, ws_ml
    ws_acc = torch.empty(batch * num_heads * max_splits * block_d, dtype=torch.float32, device=device)
    ws_ml = torch.empty(batch * num_heads * max_splits * 2, dtype=torch.float32, device=device)
    return ws_acc, ws_ml


def launch_triton(
    q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *, softmax_scale, log_sf, gamma, prompt_lens,
    calibrate, out, max_seqlen_k=None, counts=None, workspace=None, decode_only=False, softcap=0.0, sinks=None,
    config=None, k_scale=1.0, v_scale=1.0,
):  # fmt: skip
    """The launch without checks (the vLLM plugin checked geometry once): same arguments as
    `paged_skip_softmax_attention_triton`, plus what makes it allocation-free and CUDA-graph safe:

    - `counts`: a persistent int64 [B, T, 2] buffer, zeroed here on the device and filled (else one is allocated);
    - `workspace`: persistent (accumulators, max/sum) fp32 tensors of at least `semantics.decode_workspace_numel`
      elements for this launch's B, Hq, head size and `max_seqlen_k` (else allocated per call);
    - `softcap` > 0: logit soft-capping (cap·tanh(s / cap)) before the skip test and the softmax (a compiled variant);
    - `sinks`: None or a contiguous float32 [Hq] tensor on q's device, the attention sinks of docs/skip_softmax.md
      (a compiled variant, HAS_SINKS; a launch without sinks compiles exactly the sinkless kernels);
    - `decode_only`: the caller knows every sequence has one new row (a uniform decode batch), so the prefill
      grid, whose programs would all exit, is not launched;
    - `config`: a `LaunchConfig` (default: `default_launch_config(head_size)`);
    - `k_scale`, `v_scale`: an FP8 cache's per-layer scales, host floats (runtime kernel arguments, graph safe: a
      captured launch keeps the layer's values); ignored for a cache in q's dtype.

    The grids depend only on B, the heads and `max_seqlen_k` (or the block table's width), never on the lengths in
    this step's tensors: a captured launch stays correct when lengths, block tables and λ change between replays
    (splits past a sequence's end and sequences with `q_len != 1` exit early).
    """
    batch = seq_lens_k.shape[0]
    total_q = q.shape[0]
    device = q.device

    mode, n_trials, counts, log_sf_arg = _law_arguments(log_sf, calibrate, counts, batch, device)
    counts_arg = counts if counts is not None else _placeholder(device, torch.int64)
    if batch == 0 or total_q == 0:
        return counts

    launch = _launch_arguments(
        q, k_cache, v_cache, out, block_table, cu_seqlens_q, seq_lens_k, prompt_lens, gamma, log_sf_arg, counts_arg,
        sinks, softmax_scale=softmax_scale, softcap=softcap, mode=mode, n_trials=n_trials,
        kv_scales=(k_scale, v_scale),
    )  # fmt: skip
    cfg = config if config is not None else default_launch_config(launch.head_dim)
    if not decode_only:
        _launch_prefill(launch, cfg, mode)
    _launch_decode(launch, cfg, block_table, max_seqlen_k, workspace)
    return counts


class _LaunchArguments(NamedTuple):
    """What the kernels of one `launch_triton` call share, worked out once: the pointer arguments they take first,
    the float scalars, the strides, the compile-time constants, and the shapes their grids are built from (a
    NamedTuple: the cheapest record to build on this per-step host path)."""

    tensors: tuple  # q, K/V caches, out, block table, cu_q, kv_lens, and the law's pointers (see _launch_arguments)
    scalars: tuple[float, float, float]  # softmax_scale (times an FP8 cache's k_scale), softcap, v_scale
    common_strides: tuple[int, ...]
    shared: dict  # compile-time constants every kernel takes
    out: torch.Tensor
    cu_q: torch.Tensor
    kv_lens: torch.Tensor
    batch: int
    total_q: int
    num_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    block_d: int
    page: int
    device: torch.device


def _launch_arguments(
    q, k_cache, v_cache, out, block_table, cu_seqlens_q, seq_lens_k, prompt_lens, gamma, log_sf_arg, counts_arg,
    sinks, *, softmax_scale, softcap, mode, n_trials, kv_scales=(1.0, 1.0),
) -> _LaunchArguments:  # fmt: skip
    """The kernels' shared arguments in the dtypes and layouts they read (int32 lengths, a unit-stride block table),
    so that each kernel launch only adds its grid and its own constants. An FP8 cache's k_scale is folded into the
    softmax scale here (every score, the window prepass and the soft cap see (q·k8)·(softmax_scale·k_scale)); its
    v_scale goes to the kernels, which fold it into the softmax denominator (`_normalized`)."""
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    page = k_cache.shape[1]
    group = num_heads // num_kv_heads
    device = q.device

    cu_q = cu_seqlens_q.to(torch.int32).contiguous()
    kv_lens = seq_lens_k.to(torch.int32).contiguous()
    prompts = prompt_lens.to(device=device, dtype=torch.int32).contiguous()
    gamma_arg = gamma.to(device=device, dtype=torch.float32).contiguous()
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    block_d = max(MIN_HEAD_DIM, triton.next_power_of_2(head_dim))
    common_strides = (*q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), bt.stride(0))
    # The pointer arguments both kernels take first (the law: prompt lengths, log_sf, γ, counts; the sinks), and the
    # compile-time constants they share.
    sinks_arg = sinks if sinks is not None else _placeholder(device, torch.float32)
    tensors = (q, k_cache, v_cache, out, bt, cu_q, kv_lens, prompts, log_sf_arg, gamma_arg, counts_arg, sinks_arg)
    shared = dict(
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, PAGE=page, BLOCK_K=TILE_K, SPLIT_BLOCKS=SPLIT_TOKENS // TILE_K,
        N_TRIALS=n_trials, TRIALS_P2=triton.next_power_of_2(n_trials), MODE=mode, FP32_DOT=q.dtype == torch.float32,
        SOFTCAP=softcap > 0, HAS_SINKS=sinks is not None,
    )  # fmt: skip
    k_scale, v_scale = map(float, kv_scales) if k_cache.dtype in FP8_CACHE_DTYPES else (1.0, 1.0)
    scalars = (float(softmax_scale) * k_scale, float(softcap), v_scale)
    return _LaunchArguments(
        tensors=tensors, scalars=scalars, common_strides=common_strides, shared=shared,
        out=out, cu_q=cu_q, kv_lens=kv_lens, batch=seq_lens_k.shape[0], total_q=total_q, num_heads=num_heads,
        num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_d=block_d, page=page, device=device,
    )  # fmt: skip


def _launch_prefill(a: _LaunchArguments, cfg, mode: int) -> None:
    """The multi-row launches, skipped for a uniform decode batch (`decode_only`), where all their programs would
    exit."""
    # Prefill: flattened grid of query blocks aligned to absolute positions (see the module docstring), one
    # program per query head; up to q_len // BLOCK_Q + 2 blocks per sequence.
    block_q = cfg.prefill_block_q
    _prefill_kernel[(a.total_q // block_q + 2 * a.batch, a.num_heads)](
        *a.tensors, *a.scalars, a.batch, *a.common_strides,
        BLOCK_Q=block_q, V_SKIP=SKIP_MODES[cfg.prefill_skip], FUSED_ACC=cfg.prefill_fused_acc,
        SPLIT_CAUSAL=cfg.prefill_split_causal, num_warps=cfg.prefill_warps, num_stages=cfg.prefill_stages,
        **a.shared,
    )  # fmt: skip

    if mode != 0:
        # Decode rows of multi-row calls (only the device knows whether there are any): their GQA group's heads
        # decide together, which a one-head prefill program cannot see. Dense launches leave them to the prefill
        # kernel (nothing is decided).
        meta = decode_rows_launch(a.group)
        _decode_rows_kernel[(a.total_q // meta["BLOCK_R"] + a.batch, a.num_kv_heads)](
            *a.tensors, *a.scalars, a.batch, *a.common_strides, **meta, **a.shared,
        )  # fmt: skip


def _launch_decode(a: _LaunchArguments, cfg, block_table, max_seqlen_k, workspace) -> None:
    """The one-row launches, always made: split-K over the KV length with a grid bounded without reading lengths
    (CUDA-graph safe), then the merge of the splits when there is more than one."""
    # Decode: (sequence, KV head, split).
    max_splits = _decode_splits(block_table, a.page, max_seqlen_k)
    ws_acc, ws_ml = _decode_workspace(workspace, a.batch, a.num_heads, max_splits, a.block_d, a.device)
    _decode_kernel[(a.batch, a.num_kv_heads, max_splits)](
        *a.tensors, ws_acc, ws_ml, *a.scalars, max_splits, *a.common_strides,
        BLOCK_G=max(16, triton.next_power_of_2(a.group)), NUM_HEADS=a.num_heads, V_SKIP=SKIP_MODES[cfg.decode_skip],
        FUSED_ACC=cfg.decode_fused_acc, num_warps=cfg.decode_warps, num_stages=cfg.decode_stages, **a.shared,
    )  # fmt: skip
    if max_splits > 1:
        _decode_merge_kernel[(a.batch, a.num_heads)](
            a.out, a.cu_q, a.kv_lens, ws_acc, ws_ml, max_splits, *a.out.stride(),
            HEAD_DIM=a.head_dim, BLOCK_D=a.block_d, NUM_HEADS=a.num_heads, SPLIT_TOKENS=SPLIT_TOKENS,
            num_warps=1,
        )  # fmt: skip
