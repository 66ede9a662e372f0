// The packed bf16 path on AVX512-BF16 vectors (VDPBF16PS) for CPUs without AMX tiles: its Q·K and P·V
// micro-kernels on bf16 pairs (its on/off switch, dot_active, is in common.h).

#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

#if defined(MODELOPT_EXT_BF16_PAIRS)
// ---------------------------------------------------------------------------------------------------------------
// The packed bf16 path on vectors (CPUs with AVX512-BF16 but no AMX tiles): the same operands as the AMX tiles —
// bf16 Q rows, the tile's K as four 16-key groups of dimension pairs, P rows rounded to bf16, V as 32-key steps of
// key pairs per 16-dim tile — with VDPBF16PS in place of TDPBF16PS. A row's scores and output depend on its own
// operands only (batch and chunk invariance, as on tiles).
// ---------------------------------------------------------------------------------------------------------------
// Two consecutive bf16 at p broadcast as one 32-bit pair to every lane: the A operand of VDPBF16PS.
inline __m512bh pair_splat(const uint16_t* p) {
  int32_t x;
  std::memcpy(&x, p, sizeof(x));
  return (__m512bh)_mm512_set1_epi32(x);
}

inline __m512bh load_pairs(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// S[r][0 .. 63] (row stride kTileK) = Q[r] · K for R rows of bf16 Q (stride D) against the tile's four 16-key
// groups ([D/2][16][2] each): 4 R accumulators, one VDPBF16PS per row, group and dimension pair.
template <int R>
__attribute__((always_inline)) inline void qk_dot_kernel(const uint16_t* q, int D, const uint16_t* const* grp, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
  }
  for (int rp = 0; rp < D / 2; ++rp) {
    __m512bh k[4];
    for (int g = 0; g < 4; ++g) k[g] = load_pairs(grp[g] + 32 * rp);
    for (int r = 0; r < R; ++r) {
      const __m512bh qa = pair_splat(q + r * D + 2 * rp);
      for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], qa, k[g]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < 4; ++g) _mm512_storeu_ps(s + r * kTileK + 16 * g, acc[r][g]);
  }
}

template <int R>
__attribute__((always_inline)) inline void qk_dot_tail(const uint16_t* q, int D, int rows, const uint16_t* const* grp, float* s) {
  if constexpr (R > 0) {
    if (rows == R) {
      qk_dot_kernel<R>(q, D, grp, s);
    } else {
      qk_dot_tail<R - 1>(q, D, rows, grp, s);
    }
  }
}

// Scores of `rows` rows against a packed K tile; the prefetch list is spread over the row blocks.
// Inlined whole (with its micro-kernels) into each caller, as GCC did while it had a single one: bf16 prefill on
// it ran 4-6 % slower on Zen 4 when the FP8 instances' calls left it out of line.
__attribute__((always_inline)) inline void qk_dot_rows(const uint16_t* q, int D, int rows, const uint16_t* const* grp,
                                                       float* s, const char* const* pf, int npf) {
  constexpr int kRows = kAccumulators / 4;
  const int n_blocks = (rows + kRows - 1) / kRows;
  for (int r = 0, i = 0; r < rows; r += kRows, ++i) {
    prefetch_share(pf, npf, i, n_blocks);
    if (r + kRows <= rows) {
      qk_dot_kernel<kRows>(q + r * D, D, grp, s + r * kTileK);
    } else {
      qk_dot_tail<kRows - 1>(q + r * D, D, rows - r, grp, s + r * kTileK);
    }
  }
}

// O[r][d0 .. d0 + 16·NT - 1] += P[r] · V for R rows: P as bf16 rows of pp (stride kTileK), V as `n_steps` 32-key
// steps (step ks: 16-dim tile i at step[ks] + i·step_dt[ks], 16 key-pair rows of 64 bytes); the last step's first
// `last_pairs` pairs (the later ones hold zero V and zero P).
template <int R, int NT>
inline void pv_dot_block(const uint16_t* pp, float* const* o, int d0, int n_steps, int last_pairs,
                         const uint16_t* const* step, const int64_t* step_dt) {
  __m512 acc[R][NT];
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < NT; ++x) acc[r][x] = _mm512_loadu_ps(o[r] + d0 + 16 * x);
  }
  for (int ks = 0; ks < n_steps; ++ks) {
    const int64_t dt = step_dt[ks];
    const uint16_t* b = step[ks] + (d0 / 16) * dt;
    const int pairs = ks + 1 < n_steps ? 16 : last_pairs;
    for (int pr = 0; pr < pairs; ++pr) {
      __m512bh v[NT];
      for (int x = 0; x < NT; ++x) v[x] = load_pairs(b + x * dt + 32 * pr);
      for (int r = 0; r < R; ++r) {
        const __m512bh pa = pair_splat(pp + r * kTileK + 32 * ks + 2 * pr);
        for (int x = 0; x < NT; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], pa, v[x]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < NT; ++x) _mm512_storeu_ps(o[r] + d0 + 16 * x, acc[r][x]);
  }
}

template <int R>
inline void pv_dot_kernel(const uint16_t* pp, float* const* o, int D, int n_steps, int last_pairs,
                          const uint16_t* const* step, const int64_t* step_dt) {
  int d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_dot_block<R, 4>(pp, o, d0, n_steps, last_pairs, step, step_dt);
  for (; d0 < D; d0 += 16) pv_dot_block<R, 1>(pp, o, d0, n_steps, last_pairs, step, step_dt);  // D % 16 == 0
}

template <int R>
inline void pv_dot_tail(const uint16_t* pp, float* const* o, int rows, int D, int n_steps, int last_pairs,
                        const uint16_t* const* step, const int64_t* step_dt) {
  if constexpr (R > 0) {
    if (rows == R) {
      pv_dot_kernel<R>(pp, o, D, n_steps, last_pairs, step, step_dt);
    } else {
      pv_dot_tail<R - 1>(pp, o, rows, D, n_steps, last_pairs, step, step_dt);
    }
  }
}

inline void pv_dot_rows(const uint16_t* pp, float* const* o, int rows, int D, int n_steps, int last_pairs,
                        const uint16_t* const* step, const int64_t* step_dt) {
  constexpr int kRows = kAccumulators / 4;
  int r = 0;
  for (; r + kRows <= rows; r += kRows) {
    pv_dot_kernel<kRows>(pp + static_cast<size_t>(r) * kTileK, o + r, D, n_steps, last_pairs, step, step_dt);
  }
  if (rows > r) {
    pv_dot_tail<kRows - 1>(pp + static_cast<size_t>(r) * kTileK, o + r, rows - r, D, n_steps, last_pairs, step,
                           step_dt);
  }
}
#endif

}  // namespace
