// The Kernel's work on AMX tiles: Q·K and P·V of the pipelined path's 16-row blocks, and decode_tiles, decode on
// tiles with vLLM's `amx` cache layout read in place.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "common.h"
#include "kernel.h"

namespace {

// Raw scores of the 16 rows r..r+15 (Q padded past M) against the K tile packed in `buffer`: s[16][64].
template <typename T, typename C>
inline void Kernel<T, C>::qk_block_amx(const Scratch& sc, int r, int buffer, float* s) const {
#if defined(MODELOPT_EXT_AMX)
  const int D = static_cast<int>(p_.D);
  qk_groups_amx(sc.qb.data() + static_cast<size_t>(r) * D, D, sc.kgrp[buffer], s, NoHook{});
#else
  (void)sc, (void)r, (void)buffer, (void)s;
#endif
}

// O[row] += P[row] · V for up to 16 rows: P as bf16 rows of `pp` (rows past n are zeros), outputs at orow[0..n).
// C starts from each row's output, so every row adds its products to O in the same order whichever rows share its
// block (a row's result never depends on the other rows: batch and chunk invariance). Sixteen consecutive rows of
// O are loaded in place; other sets are gathered into a contiguous block and scattered back.
template <typename T, typename C>
inline void Kernel<T, C>::pv_block_amx(Scratch& sc, const uint16_t* pp, float* const* orow, int n, int n_steps,
                                    int slot) const {
#if defined(MODELOPT_EXT_AMX)
  const int D = static_cast<int>(p_.D);
  const bool direct = n == 16 && orow[15] - orow[0] == 15 * D;
  float* c = direct ? orow[0] : sc.ctmp.data();
  if (!direct) {
    for (int i = 0; i < n; ++i) copy_row(c + static_cast<size_t>(i) * D, orow[i], D);
  }
  pv_steps_amx(c, D, pp, n_steps, sc.vstep[slot], sc.vstep_dt[slot], NoHook{});
  if (!direct) {
    for (int i = 0; i < n; ++i) copy_row(orow[i], c + static_cast<size_t>(i) * D, D);
  }
#else
  (void)sc, (void)pp, (void)orow, (void)n, (void)n_steps, (void)slot;
#endif
}

#if defined(MODELOPT_EXT_AMX)
// Tiles t_begin..t_end-1 of an item of fewer than 16 (row, head) pairs (decode: one GQA group) on AMX tiles with
// the `amx` layout. Iteration t runs, in this order: Q·K of tile t from the cache's K groups in place (scores
// stored from the C tiles); P·V of tile t - 2 on all M rows (P rows of the rows that dropped it are zeros, so it
// adds nothing to their output), C loaded from and stored to the output rows in place; masks and decisions of
// tile t; the exp of tile t - 1 into the P rows (after P·V of t - 2 has read them and before its own P·V, so a
// lazy rescale of a row's output stays in order). Each round trip through memory (tile store, vector load; vector
// store, tile load) thus has other work between its two halves (on the pipelined path a tile load right after
// the vector stores of its data stalled on them).
// Decode reads each byte once, so what it waits for is memory: the V steps a tile's kept rows read are queued for
// prefetch into L1 right after its decisions (two iterations before its P·V; a tile every row drops is never
// read), the K of tile t + 3 after them, and the queue is issued 16 lines at a time, spread over the iteration
// (after every other tile instruction, about three times around the decisions and in the exp loop), so misses stay
// in flight while the core computes: issued in bursts (16 lines per tile instruction, none elsewhere) bf16 decode
// at batch 8 ran 3-8 % slower on the Xeon with AMX; V prefetched for every tile, kept or not, 16-32 % slower at
// s ~ 0.7 (docs/benchmarks.md). The masks, decisions and exp are the pipelined path's own functions
// (finish_scores, decide_tile, online_softmax_row), so decisions and counts match it, and outputs bitwise (a row's
// P·V adds the same products in the same order whichever rows share its tiles).
template <typename T, typename C>
inline void Kernel<T, C>::decode_tiles(const Item& it, Scratch& sc, int M, int t_begin, int t_end, int first_pos) const {
  const Params& p = p_;
  const int D = static_cast<int>(p.D);
  const int dtiles = D / 16;
  const int64_t kv_len = p.kvlen[it.b];
  const int64_t vdt = 16 * p.page;  // V: elements between dim tiles
  uint16_t* pb = sc.ppack.data();
  float* o = sc.o.data();
  const uint16_t* qb = sc.qb.data();
  const size_t slot_elems = static_cast<size_t>(M) * kTileK;  // 4 slots of M rows fit in sc.s (M < 16)
  sc.kept_g.resize(static_cast<size_t>(4) * M);
  uint32_t kept[4] = {0, 0, 0, 0};
  int j_end[4] = {0, 0, 0, 0};
  int n_steps[4] = {0, 0, 0, 0};
  const int row_pace = (M + 2) / 3;  // rows per prefetch block in the decision and exp loops: about 3 blocks each
  LineQueue pf;
  auto issue = [&pf]() __attribute__((always_inline)) { pf.issue16(); };
  auto queue_k = [&](int t) {  // tile t's K groups (those that start before kv_len)
    for (int g = 0; g < 4 && t < t_end; ++g) {
      const int64_t key0 = static_cast<int64_t>(t) * kTileK + 16 * g;
      if (key0 < kv_len) pf.add(k_group(it.b, it.kvh, key0), D / 2);
    }
  };
  for (int a = 0; a < 3; ++a) queue_k(t_begin + a);
  pf.drain_to(2 * D / 8);  // K of tile t_begin now, the next two during the first Q·K
  for (int t = t_begin; t < t_end + 2; ++t) {
    const int slot = t & 3;
    const int64_t kstart = static_cast<int64_t>(t) * kTileK;
    float* sbase = sc.s.data() + slot * slot_elems;
    if (t < t_end) {  // Q·K of tile t
      const uint16_t* grp[4];
      k_groups(it, sc, t, grp);
      qk_groups_amx(qb, D, grp, sbase, issue);
    }
    const int pv = (t - 2) & 3;
    if (t - 2 >= t_begin && j_end[pv] > 0) {  // P·V of tile t - 2
      pv_steps_amx(o, D, pb, n_steps[pv], sc.vstep[pv], sc.vstep_dt[pv], issue);
    }
    if (t < t_end) {  // masks and decisions of tile t; its V steps and a later K queued
      kept[slot] = 0;
      j_end[slot] = 0;
      const int m_lo = kstart <= first_pos ? 0 : first_active(sc, M, kstart);
      if (m_lo < M) {
        if (t % kSplitTiles == 0 && t > 0) std::fill(sc.srun.begin() + m_lo, sc.srun.begin() + M, kNegInf);
        finish_scores(it, sc, t, m_lo, M, sbase + static_cast<size_t>(m_lo) * kTileK);
        float* kept_g = sc.kept_g.data() + static_cast<size_t>(slot) * M;
        int kept_m[16];
        float kept_gc[16];
        pf.issue16();
        const int n_kept = decide_tile(sc, t, m_lo, M, kstart, kv_len, kept_m, kept_gc, j_end[slot]);
        for (int m = m_lo + row_pace; m < M; m += row_pace) pf.issue16();  // as many as one per row_pace rows
        for (int i = 0; i < n_kept; ++i) {
          kept[slot] |= 1u << kept_m[i];
          kept_g[kept_m[i]] = kept_gc[i];
        }
      }
      for (int ks = 0; ks < 2 && 32 * ks < j_end[slot]; ++ks) {
        sc.vstep[slot][ks] = v_pairs(it.b, it.kvh, kstart + 32 * ks);
        sc.vstep_dt[slot][ks] = vdt;
        for (int dt = 0; dt < dtiles; ++dt) pf.add(sc.vstep[slot][ks] + dt * vdt, 16);
      }
      queue_k(t + 3);
    }
    const int ex = (t - 1) & 3;
    if (t - 1 >= t_begin && t - 1 < t_end && j_end[ex] > 0) {  // exp of tile t - 1 into the P rows
      const float* kept_g = sc.kept_g.data() + static_cast<size_t>(ex) * M;
      const float* sx = sc.s.data() + ex * slot_elems;
      for (int m = 0; m < M; ++m) {
        uint16_t* prow = pb + static_cast<size_t>(m) * kTileK;
        if (m % row_pace == 0) pf.issue16();
        if (kept[ex] >> m & 1u) {
          online_softmax_row(sc, m, sx + static_cast<size_t>(m) * kTileK, kept_g[m], D, prow);
        } else {
          std::memset(prow, 0, sizeof(uint16_t) * kTileK);
        }
      }
      n_steps[ex] = pack_v_pairs(sc, nullptr, j_end[ex], ex);  // copies a partly read step only
    }
    pf.drain_to(2 * D / 8);  // at most two tiles' worth left queued
  }
}
#endif

}  // namespace
