"""Triton backend of paged skip-softmax attention (semantics: docs/skip_softmax.md, exact).

`paged_skip_softmax_attention_triton` has the same contract as `paged_skip_softmax_attention_reference`: same
inputs (already validated by `semantics.check_inputs`), same output rows, same int64 `[B, T, 2]` counts.

Kernels
-------
* `_prefill_kernel` (sequences with `q_len >= 2`): one program per (query block of TILE_Q rows, query head).
  Programs are laid out over a flattened grid of query blocks: sequence `b` owns the program ids
  `cu_seqlens_q[b] // TILE_Q + b + i` for its blocks `i`; these ranges never overlap, so the grid needs only
  `total_q // TILE_Q + B` programs (taken in reverse order, longest causal blocks first) and each program
  finds its sequence by a binary search over `cu_seqlens_q` — no host synchronisation. Key blocks of TILE_K
  keys are visited in increasing order (online softmax), keys gathered through the block table (any
  power-of-two page size >= 16; a key tile spans several pages when the page is smaller than TILE_K). The skip
  test uses the running max before the tile and natural-log units (`ln λ`, as the reference); a skipped tile
  does no `exp`, no V load and no `P·V`.
* `_decode_kernel` (sequences with `q_len == 1`): one program per (sequence, KV head, split of
  DECODE_SPLIT_TOKENS keys). The GQA group of query heads sharing the KV head is processed together (rows of one
  `tl.dot`), but every skip decision is per query-head row, as the document defines decode tiles; V is loaded
  only when at least one row keeps the tile. Sequences with one split write the output directly; otherwise
  each split stores its (max, sum, unnormalised accumulator) and `_decode_merge_kernel` merges them exactly
  (log-sum-exp). The number of splits is bounded by `block_table.shape[1] * page_size` (no host read); pass
  `max_seqlen_k` (a host int that must bound every `seq_lens_k`, e.g. vLLM's `max_seq_len`) to tighten it. The
  workspace is `B * Hq * splits * (BLOCK_D + 2)` fp32 (e.g. 256 x 32 x 64 x 130 x 4 B = 272 MB for a 128k-token
  block table without the hint, 8.5 MB with `max_seqlen_k=4096`).
* Mixed batches: both grids are launched over all sequences; programs whose sequence belongs to the other
  phase (or has `q_len == 0`) exit immediately, so no per-sequence phase split happens on the host. A pure
  decode batch still launches `(total_q // TILE_Q + B) x Hq` prefill programs that exit after the binary search
  (cheap but not free; a caller that knows the batch has no prefill could skip that launch).

Runtime values
--------------
`ln λ` is read from the `log_lams` tensor inside the kernels, never a `tl.constexpr`: changing λ never
compiles a new variant. Compile-time values are the geometry (TILE_Q, TILE_K, splits), the head size, the GQA
group, the page size, the dtype, the number of calibration trials and the mode (dense / serving / calibration).

Counts are accumulated per program in registers and added with one `tl.atomic_add` per (program, trial) into
the int64 `[B, T, 2]` buffer (integer adds: exact and order independent).

Supported: fp16 / bf16 / fp32 inputs (fp32 accumulation; fp32 inputs use IEEE fp32 dots, never TF32, so
skip decisions match the reference); head sizes 16 <= D <= 256 (non powers of two are padded with masks);
page sizes that are powers of two >= 16; any strides for q, out and the K/V cache views (Triton specialises
unit strides, so a contiguous last dimension costs nothing extra). float64 is reference-only.
Not checked on the device (would need a host sync): `seq_lens_k >= q_len` (the reference raises).

Being fast on an H200 (sm_90)
-----------------------------
The tile geometry is fixed by the semantics (64 x 64); only launch parameters may change per GPU, and they never
change results. Chosen here (`_launch_params`): prefill `num_warps=8` for D > 64 and 4 for D <= 64,
`num_stages=2`; decode `num_warps=4, num_stages=2`; merge `num_warps=1`. Compiled ahead of time for sm_90
without a GPU (ptxas -v, page 16, fp16, serving), the prefill kernel at D = 128 spills (~750 B) with 4 warps
(the 64 x 128 fp32 accumulator, the Q tile and the gathered K/V address tensors share one thread's registers) and
does not with 8; D = 64 fits 4 warps without spills; decode at D = 128 spills ~100 B with 4 warps.
Not measured on a device yet — worth trying there: `num_stages=3` (the gathered loads may not pipeline behind
the runtime skip branch), `num_warps=8` for decode at D >= 128, one K/V load per GQA group in prefill
(all query heads of a KV head in one program, skip decisions still per head) when groups are large, and
contiguous-page fast paths (page >= TILE_K: one page per tile, a scalar page id). Keep the skip test before the V
load so skipped tiles save the V bandwidth and the second GEMM: the ideal speedup from skipping exp + P·V is
2 / (2 - s).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .semantics import DECODE_SPLIT_TOKENS, TILE_K, TILE_Q

MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
MIN_PAGE_SIZE = 16


# --------------------------------------------------------------------------------------------------------------
# Prefill
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, kv_lens_ptr, log_lams_ptr, counts_ptr,
    softmax_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_bt, stride_lam,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    N_TRIALS: tl.constexpr, TRIALS_P2: tl.constexpr, MODE: tl.constexpr, FP32_DOT: tl.constexpr,
):  # fmt: skip
    # MODE: 0 dense without counts, 1 serving (skip tiles of trial 0), 2 calibration (dense, count all trials).
    # Reversed order: the last (longest, causal) query blocks start first, which shortens the tail of the grid.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    # Sequence of this program: the largest b with cu_q[b] // BLOCK_Q + b <= pid (starts strictly increase).
    lo = pid * 0
    hi = lo + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= pid, mid, lo)
        hi = tl.where(start <= pid, hi, mid)
    seq = lo
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    kv_len = tl.load(kv_lens_ptr + seq)
    q_block = pid - (q_start // BLOCK_Q + seq)
    if (q_len <= 1) | (q_block * BLOCK_Q >= q_len):
        return  # decode / empty sequence, or a block past the sequence's end

    rows = q_block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_in = rows < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_in[:, None] & d_in[None, :], other=0.0)

    # Last key each row sees (causal suffix); rows past q_len are never valid and never stored.
    last_key = kv_len - q_len + rows
    last_row = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    n_kblocks = (kv_len - q_len + last_row) // BLOCK_K + 1  # every one of them is visited

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    n_skip = tl.zeros([TRIALS_P2], tl.int32)
    trials = tl.arange(0, TRIALS_P2)
    if MODE == 2:
        lams = tl.load(log_lams_ptr + seq * stride_lam + trials, mask=trials < N_TRIALS, other=float("-inf"))
    else:
        lams = tl.full([TRIALS_P2], float("-inf"), tl.float32)
    lam0 = float("-inf")
    if MODE == 1:
        lam0 = tl.load(log_lams_ptr + seq * stride_lam)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for kb in range(0, n_kblocks):
        kpos = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = kpos < kv_len
        page_id = tl.load(bt_row + kpos // PAGE, mask=k_in, other=0).to(tl.int64)
        slot = kpos % PAGE
        kt_ptrs = (
            k_ptr
            + page_id[None, :] * stride_kb
            + slot[None, :] * stride_kp
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd
        )
        kt = tl.load(kt_ptrs, mask=k_in[None, :] & d_in[:, None], other=0.0)  # [BLOCK_D, BLOCK_K]
        if FP32_DOT:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * softmax_scale
        visible = k_in[None, :] & (kpos[None, :] <= last_key[:, None])
        s = tl.where(visible, s, float("-inf"))
        tile_max = tl.max(s, axis=1)
        valid = row_in & (kb * BLOCK_K <= last_key)
        gap = tile_max - m_i  # +inf on a row's first tile (m = -inf): never skipped

        keep = True
        if MODE == 1:
            n_fail = tl.sum((valid & ~(gap < lam0)).to(tl.int32), axis=0)
            keep = n_fail > 0
            n_skip += tl.where(trials == 0, 1 - keep.to(tl.int32), 0)
        if MODE == 2:
            fail = valid[:, None] & ~(gap[:, None] < lams[None, :])
            n_skip += (tl.sum(fail.to(tl.int32), axis=0) == 0).to(tl.int32)
        if keep:
            m_new = tl.maximum(m_i, tile_max)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_ptrs = (
                v_ptr
                + page_id[:, None] * stride_vb
                + slot[:, None] * stride_vp
                + kv_head * stride_vh
                + offs_d[None, :] * stride_vd
            )
            v = tl.load(v_ptrs, mask=k_in[:, None] & d_in[None, :], other=0.0)  # [BLOCK_K, BLOCK_D]
            if FP32_DOT:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_ptrs = out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od
    tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=row_in[:, None] & d_in[None, :])

    if MODE != 0:
        c_ptrs = counts_ptr + (seq * N_TRIALS + trials) * 2
        t_in = trials < N_TRIALS
        tl.atomic_add(c_ptrs, (n_skip * 0 + n_kblocks).to(tl.int64), mask=t_in)
        tl.atomic_add(c_ptrs + 1, n_skip.to(tl.int64), mask=t_in)


# --------------------------------------------------------------------------------------------------------------
# Decode (split-K) and merge
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["max_splits"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, kv_lens_ptr, log_lams_ptr, counts_ptr, ws_acc_ptr, ws_ml_ptr,
    softmax_scale, max_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vp, stride_vh, stride_vd,
    stride_bt, stride_lam,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    NUM_HEADS: tl.constexpr, PAGE: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_BLOCKS: tl.constexpr,
    N_TRIALS: tl.constexpr, TRIALS_P2: tl.constexpr, MODE: tl.constexpr, FP32_DOT: tl.constexpr,
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
    n_splits = tl.cdiv(n_kblocks_total, SPLIT_BLOCKS)

    g = tl.arange(0, BLOCK_G)
    g_in = g < GROUP
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_in = offs_d < HEAD_DIM
    q_row = q_start.to(tl.int64)
    q_ptrs = q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_in[:, None] & d_in[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n_skip = tl.zeros([TRIALS_P2], tl.int32)
    trials = tl.arange(0, TRIALS_P2)
    if MODE == 2:
        lams = tl.load(log_lams_ptr + seq * stride_lam + trials, mask=trials < N_TRIALS, other=float("-inf"))
    else:
        lams = tl.full([TRIALS_P2], float("-inf"), tl.float32)
    lam0 = float("-inf")
    if MODE == 1:
        lam0 = tl.load(log_lams_ptr + seq * stride_lam)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for kb in range(kb_start, kb_end):
        kpos = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_in = kpos < kv_len
        page_id = tl.load(bt_row + kpos // PAGE, mask=k_in, other=0).to(tl.int64)
        slot = kpos % PAGE
        kt_ptrs = (
            k_ptr
            + page_id[None, :] * stride_kb
            + slot[None, :] * stride_kp
            + kv_head * stride_kh
            + offs_d[:, None] * stride_kd
        )
        kt = tl.load(kt_ptrs, mask=k_in[None, :] & d_in[:, None], other=0.0)
        if FP32_DOT:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = tl.where(k_in[None, :], s * softmax_scale, float("-inf"))  # [BLOCK_G, BLOCK_K]
        tile_max = tl.max(s, axis=1)
        gap = tile_max - m_i  # +inf on the split's first tile: never skipped

        keep_row = g >= 0
        if MODE == 1:
            skip_row = g_in & (gap < lam0)
            keep_row = ~skip_row
            n_skip += tl.where(trials == 0, tl.sum(skip_row.to(tl.int32), axis=0), 0)
        if MODE == 2:
            skip_rt = g_in[:, None] & (gap[:, None] < lams[None, :])
            n_skip += tl.sum(skip_rt.to(tl.int32), axis=0)
        n_keep = tl.sum((keep_row & g_in).to(tl.int32), axis=0)
        if n_keep > 0:
            m_new = tl.where(keep_row, tl.maximum(m_i, tile_max), m_i)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.where(keep_row[:, None], tl.exp(s - m_safe[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_ptrs = (
                v_ptr
                + page_id[:, None] * stride_vb
                + slot[:, None] * stride_vp
                + kv_head * stride_vh
                + offs_d[None, :] * stride_vd
            )
            v = tl.load(v_ptrs, mask=k_in[:, None] & d_in[None, :], other=0.0)
            if FP32_DOT:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    if n_splits == 1:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        out_ptrs = out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=g_in[:, None] & d_in[None, :])
    else:
        ws_row = (seq.to(tl.int64) * NUM_HEADS + heads) * max_splits + split  # [BLOCK_G]
        tl.store(ws_acc_ptr + ws_row[:, None] * BLOCK_D + offs_d[None, :], acc, mask=g_in[:, None])
        tl.store(ws_ml_ptr + ws_row * 2, m_i, mask=g_in)
        tl.store(ws_ml_ptr + ws_row * 2 + 1, l_i, mask=g_in)

    if MODE != 0:
        c_ptrs = counts_ptr + (seq * N_TRIALS + trials) * 2
        t_in = trials < N_TRIALS
        n_visited = (kb_end - kb_start) * GROUP
        tl.atomic_add(c_ptrs, (n_skip * 0 + n_visited).to(tl.int64), mask=t_in)
        tl.atomic_add(c_ptrs + 1, n_skip.to(tl.int64), mask=t_in)


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
    n_splits = tl.cdiv(kv_len, SPLIT_TOKENS)
    if (q_len != 1) | (n_splits <= 1):
        return
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq.to(tl.int64) * NUM_HEADS + head) * max_splits
    m = tl.load(ws_ml_ptr + base * 2)  # split 0; every split has a finite max (its first tile is never skipped)
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
# Host wrapper
# --------------------------------------------------------------------------------------------------------------


def _launch_params(head_dim: int) -> tuple[int, int]:
    """(num_warps, num_stages) for the prefill kernel; they never change results (see the module docstring)."""
    return (8 if head_dim > 64 else 4), 2


def unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why the Triton backend cannot take these inputs (dtype, head size, page size), or None when it can.

    Lets a dispatcher fall back to the reference instead of raising (e.g. backend='auto' with float64).
    """
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton backend supports float16, bfloat16 and float32, got {q.dtype}; use backend='torch'"
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        return f"the Triton backend supports head sizes {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, got D={d}; use backend='torch'"
    page = k_cache.shape[1]
    if page < MIN_PAGE_SIZE or page & (page - 1):
        return f"the Triton backend needs a power-of-two page size >= {MIN_PAGE_SIZE}, got {page}; use backend='torch'"
    return None


def _check_triton_inputs(q, k_cache, log_lams, calibrate) -> None:
    reason = unsupported_reason(q, k_cache)
    if reason is not None:
        dtype_problem = q.dtype not in (torch.float16, torch.bfloat16, torch.float32)
        raise (TypeError if dtype_problem else ValueError)(reason)
    if log_lams is not None:
        if log_lams.dim() != 2 or log_lams.dtype != torch.float32:
            raise ValueError(f"log_lams must be a float32 [B, T] tensor, got {log_lams.dtype} {tuple(log_lams.shape)}")
        if not calibrate and log_lams.shape[1] != 1:
            raise ValueError(f"serving takes one λ per sequence (T == 1), got T={log_lams.shape[1]}")


def paged_skip_softmax_attention_triton(
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
    max_seqlen_k: int | None = None,
) -> torch.Tensor | None:
    """Triton backend of `paged_skip_softmax_attention` (arguments validated and normalised by the caller).

    Same contract as `paged_skip_softmax_attention_reference`: `log_lams` is [B, T] float32 ln(λ) (-inf = dense)
    or None (dense, no counts); with `calibrate` the output is dense and counts cover all T trials, otherwise
    T == 1 and the tiles of that λ are skipped. Writes rows `< total_q` of `out` only. Returns int64 counts
    [B, T, 2] (visited, skipped) or None. `max_seqlen_k` (optional host int, an upper bound of `seq_lens_k`)
    only shrinks the decode grid and workspace; without it the bound is `block_table.shape[1] * page_size`.
    """
    _check_triton_inputs(q, k_cache, log_lams, calibrate)
    batch = seq_lens_k.shape[0]
    total_q, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    page = k_cache.shape[1]
    group = num_heads // num_kv_heads
    device = q.device

    if log_lams is None:
        mode, n_trials = 0, 1
        counts = None
        lams_arg = torch.empty(batch, 1, dtype=torch.float32, device=device)
    else:
        mode = 2 if calibrate else 1
        n_trials = log_lams.shape[1]
        counts = torch.zeros(batch, n_trials, 2, dtype=torch.int64, device=device)
        lams_arg = log_lams.contiguous()
    counts_arg = counts if counts is not None else torch.zeros(1, dtype=torch.int64, device=device)
    if batch == 0 or total_q == 0:
        return counts

    cu_q = cu_seqlens_q.to(torch.int32).contiguous()
    kv_lens = seq_lens_k.to(torch.int32).contiguous()
    bt = block_table if block_table.stride(1) == 1 else block_table.contiguous()
    block_d = max(MIN_HEAD_DIM, triton.next_power_of_2(head_dim))
    trials_p2 = triton.next_power_of_2(n_trials)
    fp32_dot = q.dtype == torch.float32
    common_strides = (
        *q.stride(), *out.stride(), *k_cache.stride(), *v_cache.stride(), bt.stride(0), lams_arg.stride(0),
    )  # fmt: skip

    # Prefill: flattened grid of query blocks (see the module docstring), one program per query head.
    warps, stages = _launch_params(head_dim)
    grid = (total_q // TILE_Q + batch, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, bt, cu_q, kv_lens, lams_arg, counts_arg,
        float(softmax_scale), batch, *common_strides,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, PAGE=page, BLOCK_Q=TILE_Q, BLOCK_K=TILE_K,
        N_TRIALS=n_trials, TRIALS_P2=trials_p2, MODE=mode, FP32_DOT=fp32_dot,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip

    # Decode: (sequence, KV head, split); the number of splits is bounded without reading seq_lens_k.
    max_kv = block_table.shape[1] * page
    if max_seqlen_k is not None:
        max_kv = min(max_kv, int(max_seqlen_k))
    max_splits = max(1, math.ceil(max_kv / DECODE_SPLIT_TOKENS))
    if max_splits > 1:
        ws_acc = torch.empty(batch * num_heads * max_splits * block_d, dtype=torch.float32, device=device)
        ws_ml = torch.empty(batch * num_heads * max_splits * 2, dtype=torch.float32, device=device)
    else:
        ws_acc = ws_ml = torch.empty(1, dtype=torch.float32, device=device)
    _decode_kernel[(batch, num_kv_heads, max_splits)](
        q, k_cache, v_cache, out, bt, cu_q, kv_lens, lams_arg, counts_arg, ws_acc, ws_ml,
        float(softmax_scale), max_splits, *common_strides,
        HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        NUM_HEADS=num_heads, PAGE=page, BLOCK_K=TILE_K, SPLIT_BLOCKS=DECODE_SPLIT_TOKENS // TILE_K,
        N_TRIALS=n_trials, TRIALS_P2=trials_p2, MODE=mode, FP32_DOT=fp32_dot,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if max_splits > 1:
        _decode_merge_kernel[(batch, num_heads)](
            out, cu_q, kv_lens, ws_acc, ws_ml, max_splits, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_HEADS=num_heads, SPLIT_TOKENS=DECODE_SPLIT_TOKENS,
            num_warps=1,
        )  # fmt: skip
    return counts
