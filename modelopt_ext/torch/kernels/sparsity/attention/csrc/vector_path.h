// The fp32 vector path (AVX2: 8 lanes, AVX-512: 16; -march=native picks): Q·K and P·V micro-kernels on vLLM's
// `vec` cache layout and on its bf16 `amx` layout read in place, and the exp of AVX2 builds.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

// exp(x) for x <= 0 (Cody-Waite range reduction, degree-6 minimax polynomial; about 1 ulp). x below -87.3, -inf
// included, gives exactly 0: the 2^n factor's exponent field underflows to zero, so no denormals are produced.
// The probabilities of AVX2 builds; with AVX-512 the vector path uses exp2_fine and the packed bf16 path, whose
// probabilities are rounded to bf16, exp2_coarse.
inline vf vexp(vf x) {
  const vf lo = splat(-88.0f);
  x = x < lo ? lo : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer
  vf n = (x * splat(kLog2e) + magic) - magic;
  vf r = x - n * splat(0.693359375f);
  r = r - n * splat(-2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * (r * r) + r + splat(1.0f);
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf pow2;
  std::memcpy(&pow2, &e, sizeof(pow2));
  return p * pow2;
}

// S[r][0 .. KB - 1] = sum_d q[r][d] * K[d][0 .. KB - 1] for R rows (KB keys = KB / kLanes vectors); K element
// (d, j) at k[d * sd + j]. Step d also prefetches pf[kPrefetchPerStep * d ...] (the next tile's K and the previous
// tile's kept V), so memory requests are spread over the compute instead of issued in bursts.
template <typename T, int R, int KB>
inline void qk_kernel(const float* q, int D, const T* k, int64_t sd, float* s, const char* const* pf, int npf) {
  constexpr int NV = KB / kLanes;
  vf acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = splat(0.f);
  }
  auto step = [&](int d) __attribute__((always_inline)) {
    const T* kp = k + d * sd;
    vf kv[NV];
    for (int v = 0; v < NV; ++v) kv[v] = loadv(kp + kLanes * v);
    for (int r = 0; r < R; ++r) {
      vf qb = splat(q[r * D + d]);
      for (int v = 0; v < NV; ++v) acc[r][v] += qb * kv[v];
    }
  };
  // Steps with prefetches first, then the rest without a branch per step (the list is padded to whole steps). The
  // lines go to L2 (locality 1), not L1: prefetches into L1 held its miss buffers against the score loop's own loads
  // (Zen 4, 1 thread: decode 8k 1.29-1.38x and 2k up to 1.5x faster, fp32 and bf16; prefill unchanged).
  const int d_pf = std::min(D, (npf + kPrefetchPerStep - 1) / kPrefetchPerStep);
  int d = 0;
  for (; d < d_pf; ++d) {
    for (int i = 0; i < kPrefetchPerStep; ++i) __builtin_prefetch(pf[kPrefetchPerStep * d + i], 0, 1);
    step(d);
  }
  for (; d < D; ++d) step(d);
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) storev(s + r * kTileK + kLanes * v, acc[r][v]);
  }
}

// The last `rows` rows (fewer than a full step), as one micro-kernel call of exactly that many rows.
template <typename T, int KB, int R>
inline void qk_tail(const float* q, int D, int rows, const T* k, int64_t sd, float* s, const char* const* pf,
                    int npf) {
  if constexpr (R > 0) {
    if (rows == R) {
      qk_kernel<T, R, KB>(q, D, k, sd, s, pf, npf);
    } else {
      qk_tail<T, KB, R - 1>(q, D, rows, k, sd, s, pf, npf);
    }
  }
}

// Scores of `rows` rows against one column block of KB keys; the prefetch list goes to the first call only.
template <typename T, int KB>
inline void qk_rows(const float* q, int D, int rows, const T* k, int64_t sd, float* s, const char* const* pf,
                    int npf) {
  constexpr int kRows = kAccumulators / (KB / kLanes);
  int r = 0;
  for (; r + kRows <= rows; r += kRows) {
    qk_kernel<T, kRows, KB>(q + r * D, D, k, sd, s + r * kTileK, pf, npf);
    npf = 0;
  }
  if (rows > r) qk_tail<T, KB, kRows - 1>(q + r * D, D, rows - r, k, sd, s + r * kTileK, pf, npf);
}

// O[r][d0 .. d0 + NV·kLanes - 1] += sum_j P[r][j] * V[j][d0 ...] for R rows given by pointers; V row j at vrow[j].
template <typename T, int R, int NV>
inline void pv_block(float* const* p, float* const* o, const T* const* vrow, int nj, int d0) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) acc[r][v] = loadv(o[r] + d0 + kLanes * v);
  }
  for (int j = 0; j < nj; ++j) {
    const T* vp = vrow[j] + d0;
    vf vv[NV];
    for (int v = 0; v < NV; ++v) vv[v] = loadv(vp + kLanes * v);
    for (int r = 0; r < R; ++r) {
      vf pb = splat(p[r][j]);
      for (int v = 0; v < NV; ++v) acc[r][v] += pb * vv[v];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NV; ++v) storev(o[r] + d0 + kLanes * v, acc[r][v]);
  }
}

// O[r][:] += sum_j P[r][j] * V[j][:] for R rows (contiguous dims): kPvVectors vectors at a time, then one, then
// scalars for head sizes that are not a multiple of the vector width.
template <typename T, int R>
inline void pv_kernel(float* const* p, float* const* o, const T* const* vrow, int nj, int D) {
  int d0 = 0;
  for (; d0 + kPvVectors * kLanes <= D; d0 += kPvVectors * kLanes) pv_block<T, R, kPvVectors>(p, o, vrow, nj, d0);
  for (; d0 + kLanes <= D; d0 += kLanes) pv_block<T, R, 1>(p, o, vrow, nj, d0);
  for (; d0 < D; ++d0) {
    for (int r = 0; r < R; ++r) {
      float acc = o[r][d0];
      for (int j = 0; j < nj; ++j) acc += p[r][j] * static_cast<float>(vrow[j][d0]);
      o[r][d0] = acc;
    }
  }
}

template <typename T, int R>
inline void pv_tail(float* const* p, float* const* o, int rows, const T* const* vrow, int nj, int D) {
  if constexpr (R > 0) {
    if (rows == R) {
      pv_kernel<T, R>(p, o, vrow, nj, D);
    } else {
      pv_tail<T, R - 1>(p, o, rows, vrow, nj, D);
    }
  }
}

template <typename T>
inline void pv_rows(float* const* p, float* const* o, int rows, const T* const* vrow, int nj, int D) {
  int r = 0;
  for (; r + kPvRows <= rows; r += kPvRows) pv_kernel<T, kPvRows>(p + r, o + r, vrow, nj, D);
  if (rows > r) pv_tail<T, kPvRows - 1>(p + r, o + r, rows - r, vrow, nj, D);
}

// ---------------------------------------------------------------------------------------------------------------
// vLLM's `amx` cache layout (bf16; docs/cpu_amx_layout.md), read in place. Per block and KV head:
//   K region [page/16][D/2][16][2]: a 16-key group is D/2 rows of 64 bytes, row r = dims (2r, 2r+1) of 16 keys;
//   V region [D/16][page/2][16][2]: a 16-dim tile is page/2 rows of 64 bytes, row r = keys (2r, 2r+1) of 16 dims.
// Both are B tiles as AMX loads them. On the vector path a row read as 32-bit lanes holds one key (K) or one dim (V)
// per lane: `lane << 16` is its first bf16 as fp32, `lane & 0xffff0000` its second, both exact. The vector kernels
// below then do the same fp32 operations in the same order as the kernels above on the `vec` layout (scores add
// dim d then d + 1, P·V adds key j then j + 1), so their results are bitwise those of the `vec` layout.
// ---------------------------------------------------------------------------------------------------------------
inline void vnni_split(const uint16_t* p, vf& first, vf& second) {
  vu w;
  std::memcpy(&w, p, sizeof(w));
  const vu lo = w << 16, hi = w & (vu{} + 0xffff0000u);
  std::memcpy(&first, &lo, sizeof(first));
  std::memcpy(&second, &hi, sizeof(second));
}

// S[r][0 .. 16·NG - 1] (row stride kTileK) = Q[r] · K of NG 16-key groups, for R rows of fp32 Q (stride D).
// pf[0 .. npf - 1] (npf <= 4) are the next tile's K groups: step rp (one dim pair, one 64-byte row of each group)
// prefetches row rp of each into L2, so the D/2 steps cover them whole.
template <int R, int NG>
inline void qk_vnni_kernel(const float* q, int D, const uint16_t* const* grp, float* s, const char* const* pf,
                           int npf) {
  constexpr int NH = 16 / kLanes;  // vectors per group
  vf acc[R][NG * NH];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NG * NH; ++v) acc[r][v] = splat(0.f);
  }
  for (int rp = 0; rp < D / 2; ++rp) {
    for (int g = 0; g < kTileK / 16; ++g) {
      if (g < npf) __builtin_prefetch(pf[g] + 64 * rp, 0, 1);
    }
    vf k0[NG * NH], k1[NG * NH];
    for (int g = 0; g < NG; ++g) {
      for (int h = 0; h < NH; ++h) vnni_split(grp[g] + 32 * rp + 2 * kLanes * h, k0[g * NH + h], k1[g * NH + h]);
    }
    for (int r = 0; r < R; ++r) {
      const vf qa = splat(q[r * D + 2 * rp]), qb = splat(q[r * D + 2 * rp + 1]);
      for (int v = 0; v < NG * NH; ++v) {
        acc[r][v] += qa * k0[v];
        acc[r][v] += qb * k1[v];
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < NG * NH; ++v) storev(s + r * kTileK + kLanes * v, acc[r][v]);
  }
}

template <int NG, int R>
inline void qk_vnni_tail(const float* q, int D, int rows, const uint16_t* const* grp, float* s, const char* const* pf,
                         int npf) {
  if constexpr (R > 0) {
    if (rows == R) {
      qk_vnni_kernel<R, NG>(q, D, grp, s, pf, npf);
    } else {
      qk_vnni_tail<NG, R - 1>(q, D, rows, grp, s, pf, npf);
    }
  }
}

// Scores of `rows` rows against the 64 keys of a tile given as its four 16-key groups (NG groups per call). The
// prefetch list (the next tile's groups, at most four) goes to the first call only: its D/2 dim-pair steps issue
// one line of each group per step.
inline void qk_vnni_rows(const float* q, int D, int rows, const uint16_t* const* grp, float* s, const char* const* pf,
                         int npf) {
  constexpr int NG = kLanes == 16 ? 4 : 2;
  constexpr int kRows = kAccumulators / (NG * 16 / kLanes);
  for (int g0 = 0; g0 < 4; g0 += NG) {
    for (int r = 0; r < rows; r += kRows) {
      const float* qr = q + r * D;
      float* sr = s + r * kTileK + 16 * g0;
      if (rows - r >= kRows) {
        qk_vnni_kernel<kRows, NG>(qr, D, grp + g0, sr, pf, npf);
      } else {
        qk_vnni_tail<NG, kRows - 1>(qr, D, rows - r, grp + g0, sr, pf, npf);
      }
      npf = 0;  // later calls issue none
    }
  }
}

// Offset (elements) of dims d .. d + kLanes - 1 within a key pair's rows of the V region: tile d / 16, then lanes.
inline int64_t vnni_dim_offset(int d, int64_t page) { return (d / 16) * 16 * page + 2 * (d % 16); }

// O[r][d0 .. d0 + NV·kLanes - 1] += sum_j P[r][j] V[j][d0 ...] for keys j < nj of one 32-key step whose pair rows
// start at `v` (V region of the step's page, offset to its first pair).
template <int R, int NV>
inline void pv_vnni_block(float* const* p, float* const* o, const uint16_t* v, int nj, int d0, int64_t page) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < NV; ++x) acc[r][x] = loadv(o[r] + d0 + kLanes * x);
  }
  int64_t off[NV];
  for (int x = 0; x < NV; ++x) off[x] = vnni_dim_offset(d0 + kLanes * x, page);
  int j = 0;
  for (; j + 1 < nj; j += 2) {
    vf v0[NV], v1[NV];
    for (int x = 0; x < NV; ++x) vnni_split(v + off[x] + 16 * j, v0[x], v1[x]);
    for (int r = 0; r < R; ++r) {
      const vf pa = splat(p[r][j]), pb = splat(p[r][j + 1]);
      for (int x = 0; x < NV; ++x) {
        acc[r][x] += pa * v0[x];
        acc[r][x] += pb * v1[x];
      }
    }
  }
  if (j < nj) {  // an odd count: the last pair's first key only (its second may be past kv_len)
    vf v0[NV], v1[NV];
    for (int x = 0; x < NV; ++x) vnni_split(v + off[x] + 16 * j, v0[x], v1[x]);
    for (int r = 0; r < R; ++r) {
      const vf pa = splat(p[r][j]);
      for (int x = 0; x < NV; ++x) acc[r][x] += pa * v0[x];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int x = 0; x < NV; ++x) storev(o[r] + d0 + kLanes * x, acc[r][x]);
  }
}

template <int R>
inline void pv_vnni_kernel(float* const* p, float* const* o, const uint16_t* v, int nj, int D, int64_t page) {
  int d0 = 0;
  for (; d0 + kPvVectors * kLanes <= D; d0 += kPvVectors * kLanes) pv_vnni_block<R, kPvVectors>(p, o, v, nj, d0, page);
  for (; d0 < D; d0 += kLanes) pv_vnni_block<R, 1>(p, o, v, nj, d0, page);  // D % 16 == 0 on this layout
}

template <int R>
inline void pv_vnni_tail(float* const* p, float* const* o, int rows, const uint16_t* v, int nj, int D, int64_t page) {
  if constexpr (R > 0) {
    if (rows == R) {
      pv_vnni_kernel<R>(p, o, v, nj, D, page);
    } else {
      pv_vnni_tail<R - 1>(p, o, rows, v, nj, D, page);
    }
  }
}

inline void pv_vnni_rows(float* const* p, float* const* o, int rows, const uint16_t* v, int nj, int D, int64_t page) {
  int r = 0;
  for (; r + kPvRows <= rows; r += kPvRows) pv_vnni_kernel<kPvRows>(p + r, o + r, v, nj, D, page);
  if (rows > r) pv_vnni_tail<kPvRows - 1>(p + r, o + r, rows - r, v, nj, D, page);
}

}  // namespace
