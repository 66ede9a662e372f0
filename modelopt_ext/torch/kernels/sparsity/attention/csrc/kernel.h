// The per-item driver of the compiled CPU kernel: class Kernel runs one work item (sequence, KV head, block of
// query rows[, key split]) tile by tile, choosing per item between the fp32 vector path (vector_path.h), the packed
// bf16 path on AMX tiles (amx_tiles.h, amx_path.h) or on VDPBF16PS (bf16_dot_path.h); it decides, masks and runs
// the online softmax the same way on all of them, and merges key splits.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>

// In the order of the single file they were split from: GCC's inlining decisions depend on the order of the
// definitions (this order compiles to the same code as that file did).
#include "common.h"
#include "vector_path.h"
#include "amx_tiles.h"
#include "bf16_dot_path.h"

namespace {

// Which items run on the packed bf16 pairs. Prefill items (at least one tile's 16 rows) run 2x faster there. Decode
// items (one GQA group of (row, head) pairs) run on AMX tiles when the group has at least kTileMinRows heads: the A
// and C tiles then hold the group's rows only (amx_configure). On vLLM's `amx` layout they run decode_tiles: on the
// Xeon with AMX (bf16, 1 thread, old / new) 1.00-1.22 against the vector path at SmolLM2's 3 heads per KV head and
// 0.98-1.38 against the pipelined tile path at 6 and 8; at 1 and 2 heads 0.91-1.23 by shape, so those stay on
// vectors. VDPBF16PS without tiles keeps 16: on Zen 4 decode on it ran 0.71-0.81x as fast as the vector path at 8
// heads per KV head (slower at 3 too); at 16 (where decode items reach it) the vector path measured 0.86-1.00x as
// fast dense and 1.04-1.14x sparse (6 rounds; kept as is). The decisions of a row are the same on every path up to
// float rounding of its scores (docs/skip_softmax.md "Precision"); the threshold depends on the item's pairs only,
// so a row takes the same path on either cache layout.
constexpr int kPackedMinRows = 16;
constexpr int kTileMinRows = 3;

// T: the query and output dtype; C: the cache element (T, or an FP8 byte: Fp8E4M3, Fp8E5M2). FP8 caches convert as
// they load (common.h) with the K scale folded into Params::scale and the V scale into Params::out_scale: on the fp32
// vector path, and for bf16 queries on VDPBF16PS, their K and V packed into bf16 pairs (kPairs); not on AMX tiles,
// and never in vLLM's `amx` layout (bf16 only).
template <typename T, typename C = T>
class Kernel {
 public:
  // Whether this instance compiles the packed bf16 paths (AMX tiles, VDPBF16PS): bf16 queries on a bf16 cache, or
  // on an FP8 cache whose K and V tiles are converted into the bf16 pairs (exact; VDPBF16PS only: Params::tiles).
  static constexpr bool kPairs = std::is_same_v<T, c10::BFloat16> && (std::is_same_v<C, T> || kIsFp8<C>);

  explicit Kernel(const Params& p) : p_(p) {}

  // vLLM's `amx` layout (Params::vnni; bf16 only): compiled out of the FP8 instances, whose calls never read it
  // (their extra call sites of its micro-kernels otherwise changed GCC's inlining of the bf16 ones).
  bool vnni() const { return std::is_same_v<C, T> && p_.vnni; }

  void run_item(const Item& it, Scratch& sc, float* ws) const {
    const Params& p = p_;
    const int b = it.b, kvh = it.kvh, group = static_cast<int>(p.group), D = static_cast<int>(p.D);
    const int n_rows = it.r1 - it.r0;
    const int M = n_rows * group;
    const int64_t q0 = p.cu[b], q_len = p.cu[b + 1] - p.cu[b];
    const int64_t kv_len = p.kvlen[b];
    const int64_t offset = kv_len - q_len;
    setup_item(it, sc);
    const int n_trials = static_cast<int>(p.T);

    const int32_t last_pos = static_cast<int32_t>(offset + it.r1 - 1);
    const int first_pos = static_cast<int>(offset + it.r0);
    int t_begin = 0, t_end = last_pos / kTileK + 1;
    if (it.split >= 0) {
      t_begin = it.split * kSplitTiles;
      t_end = std::min(t_end, t_begin + kSplitTiles);
    }
    // Version 5: each row's recent-window max seeds its reference max (sc.g0) before the anchor raises it; a dense
    // call decides nothing and skips it.
    if (p.log_sf != nullptr) window_max(it, sc, M, t_begin, t_end);
    if (t_begin > 0 && t_begin < t_end) {
      // Anchor: this split's reference max is raised with each row's tile-0 max (no exp, no P·V for it here).
      const int m_lo = first_active(sc, M, 0);
      scores(it, sc, 0, m_lo, M, sc.s.data(), 0);
      for (int m = m_lo; m < M; ++m) sc.g0[m] = std::max(sc.g0[m], sc.g[m]);
      if (p.sinks != nullptr) {  // the sink joins every split's anchor
        for (int m = m_lo; m < M; ++m) sc.g0[m] = std::max(sc.g0[m], sc.sink[m]);
      }
    }
    // Software pipeline: stage A of tile t (scores and decisions) runs before stage B of tile t - 1 (exp, P·V), and
    // A's score loop prefetches the K of tile t + 1 (on AMX tiles also the V rows tile t - 1 kept), so memory
    // streams while the core computes. Stage B runs in tile order, so the online softmax is exactly the sequential
    // one.
    // On AMX tiles the B tiles are packed well ahead of their tile loads (a tile load right after the vector stores
    // that wrote its data stalled on them): K of tile t + 1 right after stage A of tile t (its tile loads come in the
    // next stage A), V of tile t - 1 at the start of stage B (its tile loads come after B's exp). Both are
    // prefetched during A's Q·K.
    // Prefill items on the AVX-512 vector path leave K to the hardware prefetcher: their Q·K of many rows per tile
    // gives the stride prefetcher time to stay ahead, and building the list cost about 2.5 % of a prefill (Zen 4,
    // fp32 and bf16 prefill 1-7 % faster without it, also at 8 heads per KV head). Decode items keep it: without it
    // they ran 20-50 % slower at 3 heads per KV head and 13-20 % at 8, and 3-4 % at 16 and 32.
    const bool sw_prefetch = sc.packed || M <= kPrefetchMaxRows || kLanes != 16;
    int pending = -1;
#if defined(MODELOPT_EXT_AMX)
    if constexpr (kPairs) {
      if (sc.packed && p.tiles && vnni() && M < 16) {
        decode_tiles(it, sc, M, t_begin, t_end, first_pos);
        t_begin = t_end;  // the loop below runs no tile
      }
    }
#endif
    for (int t = t_begin; t < t_end; ++t) {
      const int slot = t & 1;
      const int npf = sw_prefetch ? prefetch_list(it, sc, t + 1 < t_end ? t + 1 : -1, pending, D) : 0;
      stage_scores(it, sc, t, slot, M, first_pos, npf);
      if constexpr (kPairs) {
        if (sc.packed && t + 1 < t_end) pack_k_pairs(it, sc, t + 1);
      }
      if (pending >= 0) stage_values(sc, pending, D);
      pending = sc.n_kept[slot] > 0 ? slot : -1;
    }
    if (pending >= 0) stage_values(sc, pending, D);
#if defined(MODELOPT_EXT_AMX)
    if (sc.packed && p.tiles) _tile_release();
#endif

    if (p.log_sf != nullptr) {
      for (int tr = 0; tr < n_trials; ++tr) {
        if (sc.skipped[tr] != 0) __atomic_fetch_add(p.skipped + 2 * (b * n_trials + tr), sc.skipped[tr], __ATOMIC_RELAXED);
      }
    }
    if (it.split >= 0) {
      for (int m = 0; m < M; ++m) {
        float* w = ws + it.ws + static_cast<int64_t>(m) * (D + 2);
        w[0] = sc.mx[m];
        w[1] = denominator(sc, m);
        std::memcpy(w + 2, sc.o.data() + static_cast<size_t>(m) * D, sizeof(float) * D);
      }
      return;
    }
    T* op = static_cast<T*>(p.out);
    for (int r = 0; r < n_rows; ++r) {
      const int64_t row = q0 + it.r0 + r;
      for (int hh = 0; hh < group; ++hh) {
        const int m = r * group + hh;
        const int64_t h = static_cast<int64_t>(kvh) * group + hh;
        const float inv = p.out_scale / denominator(sc, m);
        const float* src = sc.o.data() + static_cast<size_t>(m) * D;
        T* dst = op + row * p.so0 + h * p.so1;
        for (int d = 0; d < D; ++d) dst[d * p.so2] = static_cast<T>(src[d] * inv);
      }
    }
  }

  // The item's scratch (sized, cleared), its Q rows, positions and ln λ. Out of line: inside run_item, two statements
  // added here (version 4's) made fp32 decode about 5 % slower on Zen 4 with the tile loop unchanged (its code
  // compiled otherwise); out of line, decode runs as fast as before them.
  __attribute__((noinline)) void setup_item(const Item& it, Scratch& sc) const {
    const Params& p = p_;
    const int b = it.b, kvh = it.kvh, group = static_cast<int>(p.group), D = static_cast<int>(p.D);
    const int n_rows = it.r1 - it.r0;
    const int M = n_rows * group;
    const int64_t q0 = p.cu[b], q_len = p.cu[b + 1] - p.cu[b];
    const int64_t kv_len = p.kvlen[b];
    const int64_t offset = kv_len - q_len;
    const int n_trials = static_cast<int>(p.T);
    sc.q.resize(static_cast<size_t>(M) * D);
    sc.packed = p.packed && M >= (p.tiles ? kTileMinRows : kPackedMinRows);
    sc.slot_rows = sc.packed ? M + 16 : M;
    sc.s.resize(static_cast<size_t>(2) * sc.slot_rows * kTileK);
    sc.kept_g.resize(static_cast<size_t>(2) * M);
    sc.g.resize(M);
    sc.kept_m.resize(static_cast<size_t>(2) * M);
    sc.o.assign(static_cast<size_t>(M) * D, 0.f);
    sc.mx.assign(M, kNegInf);
    sc.l.assign(static_cast<size_t>(M) * kLanes, 0.f);
    sc.g0.assign(M, kNegInf);
    sc.srun.assign(M, kNegInf);
    sc.pos.resize(M);
    sc.lnl.assign(static_cast<size_t>(M) * std::max(n_trials, 1), kNegInf);
    sc.e.resize(M);
    sc.r_decode = static_cast<int>(std::clamp<int64_t>(p.plen[b] - (offset + it.r0), 0, n_rows));
    sc.skipped.assign(std::max(n_trials, 1), 0);
    sc.prow.resize(M);
    sc.orow.resize(M);
    sc.vrow.resize(2 * kTileK);
    sc.kbuf.resize(sizeof(C) * kTileK * D);
    sc.pf.resize(static_cast<size_t>(kPrefetchPerStep) * kMaxChunks * D);
    sc.vbuf.resize(sizeof(C) * 2 * kTileK * D);
    if (vnni() && sc.kzero.size() != static_cast<size_t>(16) * D) sc.kzero.assign(static_cast<size_t>(16) * D, 0);

    const T* qp = static_cast<const T*>(p.q);
    for (int r = 0; r < n_rows; ++r) {
      const int64_t row = q0 + it.r0 + r;
      const int32_t pos = static_cast<int32_t>(offset + it.r0 + r);
      for (int hh = 0; hh < group; ++hh) {
        const int m = r * group + hh;
        const int64_t h = static_cast<int64_t>(kvh) * group + hh;
        const T* src = qp + row * p.sq0 + h * p.sq1;
        float* dst = sc.q.data() + static_cast<size_t>(m) * D;
        if (!sc.packed) {  // the packed path reads its bf16 copy (prepare_packed)
          for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d * p.sq2]);
        }
        sc.pos[m] = pos;
      }
      if (p.log_sf != nullptr) row_log_lambdas(b, pos, sc.lnl.data() + static_cast<size_t>(r) * group, group, M);
    }
    if (p.sinks != nullptr) seed_sinks(it, sc, M);
    if constexpr (kPairs) {
      if (sc.packed) prepare_packed(it, sc, M);
    }
  }

  // Version 5 (docs/skip_softmax.md "The skip test"): each row's recent-window max w, the max of its tile maxima
  // g[t'] over its window tiles t' = max(0, pos - W + 1) // 64 .. pos // 64 (whichever split they are in), into
  // sc.g0, which the anchor (decide_tile at tile 0, or the split anchor in run_item) then raises with tile 0's max
  // and the sink: every path's decisions (decide_tile) thus compare with max(σ, g[0], w, running max) unchanged.
  // Scored by the paths' own scores() (so a window tile's max is the one its own tile pass finds, up to the rounding
  // of a different row blocking), one tile at a time over the rows whose window holds it. Only the rows that may
  // drop one of the item's tiles need it (the first such tile is max(t_begin, 1), dropped only by rows with
  // pos >= 64 t + 64 + W - 1, so pos >= 255); the others keep every tile whatever their reference max is (a unit
  // with a member that keeps the tile keeps it: unit_statistics). Out of line, like setup_item.
  __attribute__((noinline)) void window_max(const Item& it, Scratch& sc, int M, int t_begin, int t_end) const {
    const int group = static_cast<int>(p_.group);
    const int n_rows = M / group;
    const int t_lo = std::max(t_begin, 1);
    if (t_lo >= t_end || n_rows == 0) return;
    const int64_t pos0 = sc.pos[0];  // rows hold consecutive positions pos0, pos0 + 1, ... (heads innermost)
    const int64_t p_lo = std::max<int64_t>(pos0, static_cast<int64_t>(t_lo) * kTileK + kTileK + kRecentWindow - 1);
    const int64_t p_hi = pos0 + n_rows - 1;
    if (p_lo > p_hi) return;
    float* g0 = sc.g0.data();
    const float* g = sc.g.data();
    for (int64_t tw = (p_lo - kRecentWindow + 1) / kTileK; tw <= p_hi / kTileK; ++tw) {
      // Rows whose window holds tile tw: 64 tw <= pos (they see it) and pos - W + 1 <= 64 tw + 63.
      const int64_t a = std::max(p_lo, tw * kTileK), z = std::min(p_hi, tw * kTileK + kTileK + kRecentWindow - 2);
      if (a > z) continue;
      const int m_a = static_cast<int>(a - pos0) * group, m_z = static_cast<int>(z - pos0 + 1) * group;
      scores(it, sc, static_cast<int>(tw), m_a, m_z, sc.s.data(), 0);
      for (int m = m_a; m < m_z; ++m) g0[m] = std::max(g0[m], g[m]);
    }
  }

  // Merge the partial states of the key splits of (b, kvh, rows r0..r1-1) into the output.
  void merge(int b, int kvh, int r0, int r1, int n_splits, int64_t ws0, const float* ws) const {
    const Params& p = p_;
    const int group = static_cast<int>(p.group), D = static_cast<int>(p.D);
    const int M = (r1 - r0) * group;
    const int64_t stride = static_cast<int64_t>(M) * (D + 2);
    std::vector<float> acc(D);
    T* op = static_cast<T*>(p.out);
    for (int m = 0; m < M; ++m) {
      float mx = kNegInf;
      for (int s = 0; s < n_splits; ++s) mx = std::max(mx, ws[ws0 + s * stride + static_cast<int64_t>(m) * (D + 2)]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float l = 0.f;
      for (int s = 0; s < n_splits; ++s) {
        const float* w = ws + ws0 + s * stride + static_cast<int64_t>(m) * (D + 2);
        if (w[1] == 0.f) continue;  // this split holds no key of the row
        const float a = std::exp(w[0] - mx);
        l += a * w[1];
        for (int d = 0; d < D; ++d) acc[d] += a * w[2 + d];
      }
      const int r = m / group, hh = m % group;
      const int64_t row = p.cu[b] + r0 + r;
      const int64_t h = static_cast<int64_t>(kvh) * group + hh;
      T* dst = op + row * p.so0 + h * p.so1;
      const float inv = p.out_scale / l;
      for (int d = 0; d < D; ++d) dst[d * p.so2] = static_cast<T>(acc[d] * inv);
    }
  }

 private:
  const Params& p_;

  // Attention sinks (docs/skip_softmax.md "The softmax with a sink"): row m's head sink, for the anchor (decide_tile,
  // the split anchor); the item holding tile 0 seeds the online softmax with m = sink, l = 1 (one partial-sum lane),
  // so the sink joins the denominator once and the output never. Probabilities stay <= e^kLazyRescale on the packed
  // path: a tile raises the max past the sink exactly as past an earlier tile. Later splits start from -inf, 0.
  void seed_sinks(const Item& it, Scratch& sc, int M) const {
    const int group = static_cast<int>(p_.group);
    const float* sk = p_.sinks + static_cast<int64_t>(it.kvh) * group;
    sc.sink.resize(M);
    for (int m = 0; m < M; ++m) sc.sink[m] = sk[m % group];
    if (it.split > 0) return;
    for (int m = 0; m < M; ++m) {
      sc.mx[m] = sc.sink[m];
      sc.l[static_cast<size_t>(m) * kLanes] = 1.f;
    }
  }

  // The decisions of tile t (docs/skip_softmax.md "The skip test") for the rows m_lo..M-1 that visit it,
  // their tile maxima in sc.g: a unit — the prompt rows of one aligned block of kDecisionRows positions of one head,
  // or the heads of one decode row's GQA group — drops the tile iff the largest effective gap of its members is
  // below their (shared) ln λ. An item holds whole units: its rows start at the call's first row or at a multiple of
  // kDecisionRows (run), and it holds every head of its KV head. Writes the kept rows (m, g) in row order to kept_m /
  // kept_g and returns their number, raises j_end to the V rows they read, and counts every trial's dropped
  // row-tiles (calibration keeps every row, serving drops trial 0's). Every path (fp32 vectors, the packed pairs,
  // decode_tiles) decides here, so their decisions and counts agree up to the rounding of the scores.
  int decide_tile(Scratch& sc, int t, int m_lo, int M, int64_t kstart, int64_t kv_len, int* kept_m, float* kept_g,
                  int& j_end) const {
    const Params& p = p_;
    const float* g = sc.g.data();
    int m_u = M;  // rows m_u..M-1 form the units that may drop the tile; rows m_lo..m_u-1 keep it
    if (t == 0) {  // the anchor joins the reference max (with the head's sink) and is never dropped
      for (int m = m_lo; m < M; ++m) {
        sc.g0[m] = std::max(sc.g0[m], p.sinks != nullptr ? std::max(g[m], sc.sink[m]) : g[m]);
        sc.srun[m] = g[m];
      }
    } else if (p.log_sf != nullptr) {
      m_u = unit_statistics(sc, m_lo, M, kstart);
    }
    // Rows m_lo..m_u-1 keep the tile. (Copied inline: a memcpy call per tile, behind a vzeroupper, made fp32 decode
    // 3-4 % slower on Zen 4.)
    const int n_all = std::max(m_u - m_lo, 0);
    int i = 0;
#if defined(__AVX512F__)
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i < n_all; i += 16) {
      const __mmask16 in =
          n_all - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n_all - i)) - 1);
      _mm512_mask_storeu_epi32(kept_m + i, in, _mm512_add_epi32(_mm512_set1_epi32(m_lo + i), lane));
      _mm512_mask_storeu_ps(kept_g + i, in, _mm512_maskz_loadu_ps(in, g + m_lo + i));
    }
#endif
    for (; i < n_all; ++i) {
      kept_m[i] = m_lo + i;
      kept_g[i] = g[m_lo + i];
    }
    int last = m_lo + n_all - 1;  // the last kept row (not read back from kept_m: a masked store forwards slowly)
    const int n_kept = n_all + (m_u < M ? compare_units(sc, m_u, M, kept_m + n_all, kept_g + n_all, last) : 0);
    if (n_kept > 0) {  // rows are sorted by position: the last kept row reads the most V rows
      const int64_t visible = std::min<int64_t>(sc.pos[last] - kstart + 1, std::min<int64_t>(kTileK, kv_len - kstart));
      j_end = std::max(j_end, static_cast<int>(visible));
    }
    return n_kept;
  }

  // For a tile t > 0 (first key kstart) and the rows m_lo..M-1 that visit it: each row's gap (its tile max less its
  // reference max, the running max of the split seeded with the anchor, the sink and the window max) into sc.e, its
  // running max raised; then, for the rows of units that may drop the tile (every member holds it wholly before its
  // recent window, pos >= kstart + 64 + W - 1, so visits it), each unit's statistic (the largest gap of its members)
  // into sc.e of every member. Returns the first of those rows (M: none). Rows of the item are sorted by position, heads innermost.
  int unit_statistics(Scratch& sc, int m_lo, int M, int64_t kstart) const {
    const int group = static_cast<int>(p_.group);
    float* e = sc.e.data();
    float* srun = sc.srun.data();
    const float* g = sc.g.data();
    const float* g0 = sc.g0.data();
    int m = m_lo;
#if defined(__AVX512F__)
    for (; m < M; m += 16) {
      const __mmask16 in = M - m >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (M - m)) - 1);
      const __m512 gv = _mm512_maskz_loadu_ps(in, g + m);
      const __m512 sv = _mm512_maskz_loadu_ps(in, srun + m);
      // ref = max(g0, srun) and srun = max(srun, g) as std::max: MAXPS returns its second operand unless the first
      // is greater
      _mm512_mask_storeu_ps(e + m, in, _mm512_sub_ps(gv, _mm512_max_ps(sv, _mm512_maskz_loadu_ps(in, g0 + m))));
      _mm512_mask_storeu_ps(srun + m, in, _mm512_max_ps(gv, sv));
    }
#endif
    for (; m < M; ++m) {
      e[m] = g[m] - std::max(g0[m], srun[m]);
      srun[m] = std::max(srun[m], g[m]);
    }
    const int n_rows = M / group;
    const int64_t pos0 = sc.pos[0];
    // The first row that holds the tile wholly before its recent window (64 t + 63 < pos - W + 1); all later rows do.
    int r = static_cast<int>(std::clamp<int64_t>(kstart + kTileK + kRecentWindow - 1 - pos0, 0, n_rows));
    const int r_dec = sc.r_decode;
    // A prompt block drops only where all its rows may: the first such block starts at r, or at the next block start
    // (row 0 starts a block: the item's first row is the call's first or sits at a multiple of kDecisionRows).
    if (r > 0 && r < r_dec && (pos0 + r) % kDecisionRows != 0) {
      r = static_cast<int>(std::min<int64_t>(r + kDecisionRows - (pos0 + r) % kDecisionRows, r_dec));
    }
    if (r >= n_rows) return M;
    const int m_u = r * group;
    while (r < r_dec) {  // prompt blocks (each starts at r): per head, the largest gap of the block's prompt rows
      const int r_end = static_cast<int>(std::min<int64_t>(r + kDecisionRows - (pos0 + r) % kDecisionRows, r_dec));
      block_max(e + static_cast<size_t>(r) * group, r_end - r, group);
      r = r_end;
    }
    if (group > 1) {
      for (; r < n_rows; ++r) {  // decode rows: the largest gap of the row's heads
        float* x = e + static_cast<size_t>(r) * group;
        float u = x[0];
        for (int hh = 1; hh < group; ++hh) u = std::max(u, x[hh]);
        for (int hh = 0; hh < group; ++hh) x[hh] = u;
      }
    }
    return m_u;
  }

  // x[r * group + hh] for r < rows replaced by its head's largest value over the rows (maxima are exact: any order).
  static void block_max(float* x, int rows, int group) {
#if defined(__AVX512F__)
    if (16 % group == 0) {
      const int n = rows * group;  // lane l holds head l % group in every 16-element step
      __m512 acc = _mm512_set1_ps(kNegInf);
      for (int i = 0; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
        acc = _mm512_mask_max_ps(acc, in, acc, _mm512_maskz_loadu_ps(in, x + i));
      }
      const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      for (int w = 8; w >= group; w /= 2) {  // fold lanes of the same head
        acc = _mm512_max_ps(acc, _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(w)), acc));
      }
      for (int i = 0; i < n; i += 16) {
        const __mmask16 in = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(x + i, in, acc);
      }
      return;
    }
#endif
    for (int hh = 0; hh < group; ++hh) {
      float u = x[hh];
      for (int r = 1; r < rows; ++r) u = std::max(u, x[static_cast<size_t>(r) * group + hh]);
      for (int r = 0; r < rows; ++r) x[static_cast<size_t>(r) * group + hh] = u;
    }
  }

  // Rows m_u..M-1 (whole units, their statistics in sc.e): count each trial's drops (unit statistic < the row's
  // ln λ), and write the rows serving keeps (calibration: all) compressed in row order. Returns their number; `last`
  // becomes the last of them, if any.
  int compare_units(Scratch& sc, int m_u, int M, int* kept_m, float* kept_g, int& last) const {
    const int n_trials = static_cast<int>(p_.T);
    const bool keep_all = p_.calibrate;
    const float* e = sc.e.data();
    const float* lnl = sc.lnl.data();
    const float* g = sc.g.data();
    int n_kept = 0;
#if defined(__AVX512F__)
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int m = m_u; m < M; m += 16) {
      const __mmask16 in = M - m >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (M - m)) - 1);
      const __m512 u = _mm512_maskz_loadu_ps(in, e + m);
      __mmask16 drop0 = 0;
      for (int tr = 0; tr < n_trials; ++tr) {
        const __mmask16 drop = _mm512_mask_cmp_ps_mask(
            in, u, _mm512_maskz_loadu_ps(in, lnl + static_cast<size_t>(tr) * M + m), _CMP_LT_OQ);
        sc.skipped[tr] += __builtin_popcount(drop);
        if (tr == 0) drop0 = drop;
      }
      const __mmask16 keep = keep_all ? in : static_cast<__mmask16>(in & ~drop0);
      // Compressed in registers, then a masked store of the first popcount lanes: the compressing store to memory
      // is microcoded on Zen 4 (its two took about a sixth of the kernel's time outside Q·K and P·V, fp32 prefill).
      const __mmask16 first = static_cast<__mmask16>((1u << __builtin_popcount(keep)) - 1);
      _mm512_mask_storeu_epi32(kept_m + n_kept, first,
                               _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(_mm512_set1_epi32(m), lane)));
      _mm512_mask_storeu_ps(kept_g + n_kept, first, _mm512_maskz_compress_ps(keep, _mm512_maskz_loadu_ps(in, g + m)));
      n_kept += __builtin_popcount(keep);
      if (keep != 0) last = m + 31 - __builtin_clz(static_cast<unsigned>(keep));
    }
#else
    for (int m = m_u; m < M; ++m) {
      bool drop0 = false;
      for (int tr = 0; tr < n_trials; ++tr) {
        const bool drop = e[m] < lnl[static_cast<size_t>(tr) * M + m];
        sc.skipped[tr] += drop ? 1 : 0;
        if (tr == 0) drop0 = drop;
      }
      if (keep_all || !drop0) {
        kept_m[n_kept] = m;
        kept_g[n_kept] = g[m];
        ++n_kept;
        last = m;
      }
    }
#endif
    return n_kept;
  }

  // Stage A of tile t: scores of the rows that visit it, each row's decision, counts, the kept rows (slot).
  void stage_scores(const Item& it, Scratch& sc, int t, int slot, int M, int first_pos, int npf) const {
    const int64_t kv_len = p_.kvlen[it.b];
    const int64_t kstart = static_cast<int64_t>(t) * kTileK;
    sc.n_kept[slot] = 0;
    // Rows are sorted by position: the rows that visit tile t are a suffix.
    const int m_lo = kstart <= first_pos ? 0 : first_active(sc, M, kstart);
    if (m_lo >= M) return;
    float* sbase = sc.s.data() + static_cast<size_t>(slot) * sc.slot_rows * kTileK;
    scores(it, sc, t, m_lo, M, sbase, npf);
    int j_end = 0;  // V rows 0..j_end-1 of the tile are needed by some kept row
    int* kept_m = sc.kept_m.data() + static_cast<size_t>(slot) * M;
    float* kept_g = sc.kept_g.data() + static_cast<size_t>(slot) * M;
    if (t % kSplitTiles == 0 && t > 0) std::fill(sc.srun.begin() + m_lo, sc.srun.end(), kNegInf);
    const int n_kept = decide_tile(sc, t, m_lo, M, kstart, kv_len, kept_m, kept_g, j_end);
    sc.n_kept[slot] = n_kept;
    sc.j_end[slot] = j_end;
    if (n_kept == 0) return;  // a tile every row drops: its V is never read
    if (vnni()) {  // the tile's 32-key V steps that some kept row reads, in place
      for (int ks = 0; ks < 2 && 32 * ks < j_end; ++ks) {
        sc.vstep[slot][ks] = v_pairs(it.b, it.kvh, kstart + 32 * ks);
        sc.vstep_dt[slot][ks] = 16 * p_.page;
      }
      return;
    }
    const C** vrow = reinterpret_cast<const C**>(sc.vrow.data()) + slot * kTileK;
    value_rows(it, sc, kstart, j_end, vrow, slot);
  }

  // Stage B: online softmax (exp) and P·V of the rows that kept the tile held in `slot` (vector path).
  void stage_values(Scratch& sc, int slot, int D) const {
    const int M = static_cast<int>(sc.kept_m.size() / 2);
    const int n_kept = sc.n_kept[slot];
    float* sbase = sc.s.data() + static_cast<size_t>(slot) * sc.slot_rows * kTileK;
    const int* kept_m = sc.kept_m.data() + static_cast<size_t>(slot) * M;
    const float* kept_g = sc.kept_g.data() + static_cast<size_t>(slot) * M;
    const C* const* vrow = reinterpret_cast<const C* const*>(sc.vrow.data()) + slot * kTileK;
    if constexpr (kPairs) {
      if (sc.packed) {
        const int n_steps = pack_v_pairs(sc, vrow, sc.j_end[slot], slot);  // before the exp loop: see run_item
        uint16_t* pp = sc.ppack.data();
        for (int i = 0; i < n_kept; ++i) {
          const int m = kept_m[i];
          online_softmax_row(sc, m, sbase + static_cast<size_t>(m) * kTileK, kept_g[i], D, pp + static_cast<size_t>(i) * kTileK);
          sc.orow[i] = sc.o.data() + static_cast<size_t>(m) * D;
        }
        if (!p_.tiles) {
#if defined(MODELOPT_EXT_BF16_PAIRS)
          const int last_pairs = (sc.j_end[slot] - 32 * (n_steps - 1) + 1) / 2;
          pv_dot_rows(pp, sc.orow.data(), n_kept, D, n_steps, last_pairs, sc.vstep[slot], sc.vstep_dt[slot]);
#endif
          return;
        }
        const int padded = (n_kept + 15) / 16 * 16;
        if (padded > n_kept) std::memset(pp + static_cast<size_t>(n_kept) * kTileK, 0, sizeof(uint16_t) * kTileK * (padded - n_kept));
        for (int i0 = 0; i0 < n_kept; i0 += 16) {
          pv_block_amx(sc, pp + static_cast<size_t>(i0) * kTileK, sc.orow.data() + i0, std::min(16, n_kept - i0),
                       n_steps, slot);
        }
        return;
      }
    }
    for (int i = 0; i < n_kept; ++i) {
      const int m = kept_m[i];
      float* s = sbase + static_cast<size_t>(m) * kTileK;
      online_softmax_row(sc, m, s, kept_g[i], D, s);
      sc.prow[i] = s;
      sc.orow[i] = sc.o.data() + static_cast<size_t>(m) * D;
    }
    if (vnni()) {  // step by step (a 64-key tile may span two pages of 32)
      for (int ks = 0; ks < 2 && 32 * ks < sc.j_end[slot]; ++ks) {
        if (ks > 0) {
          for (int i = 0; i < n_kept; ++i) sc.prow[i] += 32;
        }
        pv_vnni_rows(sc.prow.data(), sc.orow.data(), n_kept, sc.vstep[slot][ks], std::min(32, sc.j_end[slot] - 32 * ks),
                     D, p_.page);
      }
      return;
    }
    pv_rows<C>(sc.prow.data(), sc.orow.data(), n_kept, vrow, sc.j_end[slot], D);
  }

  // Cache lines to prefetch during tile t's score loop: K of tile `next_t` (in place only: on `vec` its rows are
  // strided by the page; on `amx`, read by the vector path, its four 16-key groups are D/2 contiguous 64-byte rows
  // each: without them bf16 decode at batch 8 on a Xeon with AMX ran 1.14-1.21x slower). V (contiguous rows) is
  // left to the hardware prefetcher: software prefetches of V stalled the score loop on fill buffers (Xeon with AMX,
  // decode 4-18 % faster without them, 11-20 % on the `amx` layout; on Zen 4 V prefetched into L2 was within ±10 %
  // of none, by shape). Returns the list length, padded to whole micro-kernel steps.
  int prefetch_list(const Item& it, Scratch& sc, int next_t, int pending_slot, int D) const {
    const Params& p = p_;
    const int cap = static_cast<int>(sc.pf.size());
    const char** pf = sc.pf.data();
    int n = 0;
    if (next_t >= 0 && p.k_direct) {
      const int64_t kv_len = p.kvlen[it.b];
      const int64_t bytes = static_cast<int64_t>(p.kc) * sizeof(C);
      const int64_t stride = p.sk3 * static_cast<int64_t>(sizeof(C));
      for (int c = 0; c < kTileK / p.kc; ++c) {
        const int64_t key0 = static_cast<int64_t>(next_t) * kTileK + c * p.kc;
        if (key0 >= kv_len) break;
        const char* base = reinterpret_cast<const char*>(key_base(it.b, it.kvh, key0));
        for (int d = 0; d < D; ++d) {
          for (int64_t off = 0; off < bytes && n < cap; off += 64) pf[n++] = base + d * stride + off;
        }
      }
    }
    // `amx` layout on the vector path: each 16-key group is D/2 contiguous rows of 64 bytes, so the list holds the
    // groups' starts and qk_vnni_kernel steps through their rows (a list of all 4 x D/2 lines, built per tile and
    // read back per step, made bf16 decode 1-10 % slower on the Xeon with AMX; V prefetched the same way: 0.86-1.06).
    if (vnni() && !sc.packed) {
      const int64_t kv_len = p.kvlen[it.b];
      for (int g = 0; next_t >= 0 && g < kTileK / 16; ++g) {
        const int64_t key0 = static_cast<int64_t>(next_t) * kTileK + 16 * g;
        if (key0 >= kv_len) break;
        pf[n++] = reinterpret_cast<const char*>(k_group(it.b, it.kvh, key0));
      }
      return n;
    }
    if (sc.packed && pending_slot >= 0 && p.v_direct) {
      const C* const* vrow = reinterpret_cast<const C* const*>(sc.vrow.data()) + pending_slot * kTileK;
      const int64_t bytes = static_cast<int64_t>(D) * sizeof(C);
      for (int j = 0; j < sc.j_end[pending_slot]; ++j) {
        const char* row = reinterpret_cast<const char*>(vrow[j]);
        for (int64_t off = 0; off < bytes && n < cap; off += 64) pf[n++] = row + off;
      }
    }
    while (n % kPrefetchPerStep != 0 && n > 0) {  // whole steps for qk_kernel (cap is a multiple of the step)
      pf[n] = pf[n - 1];
      ++n;
    }
    return n;
  }

  // ln λ of a row for every trial, copied for its `group` heads (trial tr at dst[tr * stride]): docs/skip_softmax.md
  // "λ of a row".
  void row_log_lambdas(int b, int32_t pos, float* dst, int group, int stride) const {
    const Params& p = p_;
    const int n_trials = static_cast<int>(p.T);
    const int64_t prompt = p.plen[b];
    const bool decode = pos >= prompt;
    const double n = decode ? static_cast<double>(pos) + 1.0 : static_cast<double>(std::max<int64_t>(prompt, 1));
    const int phase = decode ? 1 : 0;
    const double ln_n = std::log(n);
    for (int tr = 0; tr < n_trials; ++tr) {
      const double c = p.log_sf[(static_cast<int64_t>(b) * n_trials + tr) * 2 + phase];
      const float x = static_cast<float>(c - static_cast<double>(p.gamma[b * 2 + phase]) * ln_n);
      const float lnl = x < 0.f ? x : kNegInf;  // NaN and λ >= 1: no drop
      for (int hh = 0; hh < group; ++hh) dst[static_cast<size_t>(tr) * stride + hh] = lnl;
    }
  }

  static int first_active(const Scratch& sc, int M, int64_t kstart) {
    int m = 0;
    while (m < M && sc.pos[m] < kstart) ++m;
    return m;
  }

  const C* key_base(int b, int kvh, int64_t key) const {
    const Params& p = p_;
    const int64_t blk = p.bt[b * p.P + key / p.page];
    return static_cast<const C*>(p.k) + blk * p.sk0 + (key % p.page) * p.sk1 + kvh * p.sk2;
  }

  const C* value_base(int b, int kvh, int64_t key) const {
    const Params& p = p_;
    const int64_t blk = p.bt[b * p.P + key / p.page];
    return static_cast<const C*>(p.v) + blk * p.sv0 + (key % p.page) * p.sv1 + kvh * p.sv2;
  }

  // `amx` layout: the 16-key K group that starts at key0 (key0 % 16 == 0): D/2 rows of 64 bytes.
  const uint16_t* k_group(int b, int kvh, int64_t key0) const {
    const Params& p = p_;
    const int64_t blk = p.bt[b * p.P + key0 / p.page];
    return static_cast<const uint16_t*>(p.k) + blk * p.sk0 + kvh * p.sk2 + (key0 % p.page) / 16 * 16 * p.D;
  }

  // `amx` layout: the row of keys key0, key0 + 1 (key0 even) in dim tile 0 of the V region (tile i: + i·16·page).
  const uint16_t* v_pairs(int b, int kvh, int64_t key0) const {
    const Params& p = p_;
    const int64_t blk = p.bt[b * p.P + key0 / p.page];
    return static_cast<const uint16_t*>(p.v) + blk * p.sv0 + kvh * p.sv2 + (key0 % p.page) / 2 * 32;
  }

  // `amx` layout: tile t's four K groups; a group that starts at or past kv_len (its page may not exist) is zeros.
  void k_groups(const Item& it, const Scratch& sc, int t, const uint16_t** grp) const {
    const int64_t kv_len = p_.kvlen[it.b];
    for (int g = 0; g < kTileK / 16; ++g) {
      const int64_t key0 = static_cast<int64_t>(t) * kTileK + 16 * g;
      grp[g] = key0 < kv_len ? k_group(it.b, it.kvh, key0) : sc.kzero.data();
    }
  }

  // Scaled, masked scores of rows m_lo..M-1 against tile t into sc.s (row stride 64): -inf past kv_len and past
  // each row's causal limit. Each row's max over the tile goes to sc.g[m] in the same pass.
  void scores(const Item& it, Scratch& sc, int t, int m_lo, int M, float* sbase, int npf) const {
    // Keys per micro-kernel step. Many rows (prefill): with 16 lanes the whole 64-key tile where K is read in place
    // from pages of whole tiles (6 rows x 4 vectors), else 32 keys (12 x 2); with 8 lanes 16 keys (6 x 2). Few rows
    // (decode, a GQA group): 32 keys where the page allows (8 lanes: 3 x 4; 16 lanes: 12 x 2), else 16.
    if constexpr (kPairs) {
      if (sc.packed) {  // Q·K in row blocks (16 on tiles, 6 on VDPBF16PS), prefetches spread over them
        if (sc.k_tile[t & 1] != t) pack_k_pairs(it, sc, t);
        if (p_.tiles) {
          const int n_blocks = (M - m_lo + 15) / 16;
          for (int r = m_lo, i = 0; r < M; r += 16, ++i) {
            prefetch_share(sc.pf.data(), npf, i, n_blocks);
            qk_block_amx(sc, r, t & 1, sbase + static_cast<size_t>(r) * kTileK);
            if (r > m_lo) finish_scores(it, sc, t, r - 16, r, sbase + static_cast<size_t>(r - 16) * kTileK);
          }
          const int last = m_lo + 16 * (n_blocks - 1);
          finish_scores(it, sc, t, last, M, sbase + static_cast<size_t>(last) * kTileK);
          return;
        } else {
#if defined(MODELOPT_EXT_BF16_PAIRS)
          const int D = static_cast<int>(p_.D);
          qk_dot_rows(sc.qb.data() + static_cast<size_t>(m_lo) * D, D, M - m_lo, sc.kgrp[t & 1],
                      sbase + static_cast<size_t>(m_lo) * kTileK, sc.pf.data(), npf);
#endif
        }
        finish_scores(it, sc, t, m_lo, M, sbase + static_cast<size_t>(m_lo) * kTileK);
        return;
      }
    }
    if (vnni()) {
      const uint16_t* grp[4];
      k_groups(it, sc, t, grp);
      const int D = static_cast<int>(p_.D);
      float* s = sbase + static_cast<size_t>(m_lo) * kTileK;
      qk_vnni_rows(sc.q.data() + static_cast<size_t>(m_lo) * D, D, M - m_lo, grp, s, sc.pf.data(), npf);
      finish_scores(it, sc, t, m_lo, M, s);
      return;
    }
    if (kLanes == 16 && M - m_lo > kFewRows && p_.k_direct && p_.page % kTileK == 0) {
      scores_kb<kTileK>(it, sc, t, m_lo, M, sbase, npf);
    } else if (p_.kc == 32 && (kLanes == 16 || M - m_lo <= kFewRows)) {
      scores_kb<32>(it, sc, t, m_lo, M, sbase, npf);
    } else {
      scores_kb<16>(it, sc, t, m_lo, M, sbase, npf);
    }
  }

  template <int kc>
  void scores_kb(const Item& it, Scratch& sc, int t, int m_lo, int M, float* sbase, int npf) const {
    const Params& p = p_;
    const int D = static_cast<int>(p.D);
    const int64_t kv_len = p.kvlen[it.b];
    const int64_t kstart = static_cast<int64_t>(t) * kTileK;
    const int rows = M - m_lo;
    const float* q = sc.q.data() + static_cast<size_t>(m_lo) * D;
    float* s = sbase + static_cast<size_t>(m_lo) * kTileK;
    const int per_chunk = kPrefetchPerStep * D;
    for (int c = 0; c < kTileK / kc; ++c) {
      const int64_t key0 = kstart + c * kc;
      if (key0 >= kv_len) break;  // never read a column block past kv_len (its page may not exist)
      const char* const* pf = sc.pf.data() + static_cast<size_t>(c) * per_chunk;
      const int n_pf = std::max(0, std::min(per_chunk, npf - c * per_chunk));
      if (p.k_direct) {
        qk_rows<C, kc>(q, D, rows, key_base(it.b, it.kvh, key0), p.sk3, s + c * kc, pf, n_pf);
      } else {
        C* buf = reinterpret_cast<C*>(sc.kbuf.data()) + static_cast<size_t>(c) * kc * D;
        for (int jj = 0; jj < kc; ++jj) {
          const int64_t key = key0 + jj;
          if (key < kv_len) {
            const C* src = key_base(it.b, it.kvh, key);
            for (int d = 0; d < D; ++d) buf[d * kc + jj] = src[d * p.sk3];
          } else {
            for (int d = 0; d < D; ++d) buf[d * kc + jj] = C{};
          }
        }
        qk_rows<C, kc>(q, D, rows, buf, kc, s + c * kc, pf, n_pf);
      }
    }
    finish_scores(it, sc, t, m_lo, M, s);
  }

  // Mask the raw scores of rows m_lo..M-1 in place (soft-capped rows are also scaled and capped here); each row's
  // tile max, scaled, to sc.g[m]. Without soft-capping the scale is applied in the exp pass (exp_scale()): rounding
  // is monotonic, so round(scale * max) is the max of the rounded scaled scores and the decisions are unchanged, and
  // the pass over the tile saves a multiply and, on tiles no key of which is masked, its store.
  // Row m's scores are at s_lo + (m - m_lo) * kTileK.
  __attribute__((always_inline)) void finish_scores(const Item& it, Scratch& sc, int t, int m_lo, int M, float* s_lo) const {
    const Params& p = p_;
    const int64_t kv_len = p.kvlen[it.b];
    const int64_t kstart = static_cast<int64_t>(t) * kTileK;
    const vf ninf = splat(kNegInf);
    const bool capped = p.softcap > 0.f;
    const float g_scale = capped ? 1.f : p.scale;
    // Row m's masked (and capped) scores stored back, and their lane-wise max.
    auto row_max = [&](int m) __attribute__((always_inline)) {
      float* sr = s_lo + static_cast<size_t>(m - m_lo) * kTileK;
      // Keys kstart + j with j >= lim are invisible to this row (causal limit or kv_len).
      const int64_t lim = std::min<int64_t>(sc.pos[m] + 1, kv_len) - kstart;
      vf mx = ninf;
      for (int j = 0; j < kTileK; j += kLanes) {
        vf x = loadv(sr + j);
        bool store = false;
        if (capped) {  // logit soft-capping (Gemma 2), lane by lane, on the scaled scores
          alignas(64) float lanes[kLanes];
          storev(lanes, x * splat(p.scale));
          for (int l = 0; l < kLanes; ++l) lanes[l] = p.softcap * std::tanh(lanes[l] / p.softcap);
          x = loadv(lanes);
          store = true;
        }
        if (j + kLanes > lim) {
          const vi lv = vi{} + static_cast<int32_t>(std::max<int64_t>(lim, -1));
          x = iota(j) < lv ? x : ninf;  // replaces stale NaN/inf too (chunks never computed included)
          store = true;
        }
        if (store) storev(sr + j, x);
        mx = x > mx ? x : mx;
      }
      return mx;
    };
    int m = m_lo;
#if defined(__AVX512F__)
    for (; m + 16 <= M; m += 16) {  // 16 rows' maxima in one transposing tree (hmax16)
      __m512 mxs[16];
      // Rows are sorted by position: where the first row sees the whole tile, all 16 do and no score is masked, so
      // each row's max is four loads and the same chain of MAXPS as row_max (the generic loop tested the soft cap
      // and the limit per vector: ~40 % of the Q·K stage of a bf16 prefill on AMX tiles).
      if (!capped && std::min<int64_t>(sc.pos[m] + 1, kv_len) - kstart >= kTileK) {
        for (int i = 0; i < 16; ++i) {
          const float* sr = s_lo + static_cast<size_t>(m + i - m_lo) * kTileK;
          __m512 mx = _mm512_max_ps(_mm512_loadu_ps(sr), _mm512_set1_ps(kNegInf));
          for (int j = kLanes; j < kTileK; j += kLanes) mx = _mm512_max_ps(_mm512_loadu_ps(sr + j), mx);
          mxs[i] = mx;
        }
        _mm512_storeu_ps(sc.g.data() + m, _mm512_mul_ps(hmax16(mxs), _mm512_set1_ps(g_scale)));
        continue;
      }
      for (int i = 0; i < 16; ++i) {
        const vf mx = row_max(m + i);
        std::memcpy(&mxs[i], &mx, sizeof(mx));
      }
      _mm512_storeu_ps(sc.g.data() + m, _mm512_mul_ps(hmax16(mxs), _mm512_set1_ps(g_scale)));
    }
#endif
    for (; m < M; ++m) sc.g[m] = hmax(row_max(m)) * g_scale;
  }

  // The factor the exp pass applies to the stored scores: the softmax scale, or 1 where finish_scores scaled them.
  float exp_scale() const { return p_.softcap > 0.f ? 1.f : p_.scale; }

  // bf16 Q rows of the item (raw bits) with 16 zero rows of padding; on AMX the tile configuration of this thread.
  void prepare_packed(const Item& it, Scratch& sc, int M) const {
#if defined(MODELOPT_EXT_BF16_PAIRS)
    const Params& p = p_;
    const int group = static_cast<int>(p.group), D = static_cast<int>(p.D);
    sc.qb.assign(static_cast<size_t>(M + 16) * D, 0);
    sc.kpack.resize(static_cast<size_t>(2) * kTileK * D);
    sc.k_tile[0] = sc.k_tile[1] = -1;
    sc.vpack.resize(static_cast<size_t>(kTileK) * D);
    sc.ppack.resize(static_cast<size_t>(M + 16) * kTileK);
    sc.ctmp.resize(static_cast<size_t>(16) * D);
    sc.kbuf.resize(std::max(sc.kbuf.size(), sizeof(uint16_t) * 16 * D));
    const uint16_t* qp = static_cast<const uint16_t*>(p.q);
    const int64_t q0 = p.cu[it.b];
    for (int r = 0; r < it.r1 - it.r0; ++r) {
      for (int hh = 0; hh < group; ++hh) {
        const uint16_t* src = qp + (q0 + it.r0 + r) * p.sq0 + (static_cast<int64_t>(it.kvh) * group + hh) * p.sq1;
        uint16_t* dst = sc.qb.data() + static_cast<size_t>(r * group + hh) * D;
        for (int d = 0; d < D; ++d) dst[d] = src[d * p.sq2];
      }
    }
#if defined(MODELOPT_EXT_AMX)
    if (p.tiles) amx_configure(std::min(M, 16));
#endif
#else
    (void)it, (void)sc, (void)M;
#endif
  }

  // K of tile t as B tiles in buffer t & 1: each 16-key group interleaved by dimension pairs (kpack: [buffer]
  // [group][D/2][16][2]); a group that starts at or past kv_len is zeros (its scores are masked after).
  // Out of line, as GCC compiled it before the FP8 instances were added (inlined since, bf16 prefill on VDPBF16PS
  // ran 4-6 % slower on Zen 4, together with qk_dot_rows no longer inlined: bf16_dot_path.h).
  __attribute__((noinline)) void pack_k_pairs(const Item& it, Scratch& sc, int t) const {
#if defined(MODELOPT_EXT_BF16_PAIRS)
    const Params& p = p_;
    const int D = static_cast<int>(p.D);
    const int64_t kv_len = p.kvlen[it.b];
    const int64_t kstart = static_cast<int64_t>(t) * kTileK;
    const int64_t group_elems = static_cast<int64_t>(D / 2) * 32;
    uint16_t* kpack = sc.kpack.data() + static_cast<size_t>(t & 1) * 4 * group_elems;
    sc.k_tile[t & 1] = t;
    if (vnni()) {  // the groups are B tiles in the cache already
      k_groups(it, sc, t, sc.kgrp[t & 1]);
      return;
    }
    for (int g = 0; g < kTileK / 16; ++g) {
      const int64_t key0 = kstart + 16 * g;
      uint16_t* dst = kpack + g * group_elems;
      sc.kgrp[t & 1][g] = dst;
      if (key0 >= kv_len) {
        std::memset(dst, 0, sizeof(uint16_t) * group_elems);
        continue;
      }
      const C* src;
      int64_t sd;
      if (p.k_direct) {  // 16 keys contiguous within one page (page % 16 == 0)
        src = key_base(it.b, it.kvh, key0);
        sd = p.sk3;
      } else {
        C* buf = reinterpret_cast<C*>(sc.kbuf.data());
        for (int jj = 0; jj < 16; ++jj) {
          const int64_t key = key0 + jj;
          const C* ks = key < kv_len ? key_base(it.b, it.kvh, key) : nullptr;
          for (int d = 0; d < D; ++d) buf[d * 16 + jj] = ks != nullptr ? ks[d * p.sk3] : C{};
        }
        src = buf;
        sd = 16;
      }
      for (int dp = 0; dp < D / 2; ++dp) interleave16(src + 2 * dp * sd, src + (2 * dp + 1) * sd, dst + dp * 32);
    }
#else
    (void)it, (void)sc, (void)t;
#endif
  }

  // AMX tiles: defined in amx_path.h.
  void qk_block_amx(const Scratch& sc, int r, int buffer, float* s) const;

  // V rows 0..nj-1 of a tile as B tiles, interleaved by key pairs (vpack: [key step of 32][D/16][16][16][2]; keys
  // >= nj are zeros, so unread rows never meet a zero probability). Returns the number of 32-key steps; their B
  // tiles go to sc.vstep[slot] (base, dim tile stride). On the `amx` layout the cache holds them already: a step
  // whose 32 keys are all read is used in place, only a partial step is copied (its keys >= nj as zeros).
  int pack_v_pairs(Scratch& sc, const C* const* vrow, int nj, int slot) const {
#if defined(MODELOPT_EXT_BF16_PAIRS)
    const int n_steps = (nj + 31) / 32;
    const int dtiles = static_cast<int>(p_.D) / 16;
    uint16_t* vpack = sc.vpack.data();
    alignas(64) static const C kZeros[16] = {};
    if (vnni()) {
      for (int ks = 0; ks < n_steps; ++ks) {
        const int n_in = std::min(32, nj - 32 * ks);
        if (n_in == 32) continue;  // in place (set by stage_scores)
        const uint16_t* src = sc.vstep[slot][ks];
        uint16_t* dst = vpack + static_cast<size_t>(ks) * dtiles * 512;
        for (int dt = 0; dt < dtiles; ++dt) {
          for (int pr = 0; pr < 16; ++pr) {
            const uint16_t* a = src + dt * sc.vstep_dt[slot][ks] + 32 * pr;
            uint16_t* o = dst + dt * 512 + 32 * pr;
            for (int e = 0; e < 32; ++e) o[e] = 2 * pr + (e & 1) < n_in ? a[e] : 0;
          }
        }
        sc.vstep[slot][ks] = dst;
        sc.vstep_dt[slot][ks] = 512;
      }
      return n_steps;
    }
    for (int ks = 0; ks < n_steps; ++ks) {
      sc.vstep[slot][ks] = vpack + static_cast<size_t>(ks) * dtiles * 512;
      sc.vstep_dt[slot][ks] = 512;
    }
    for (int pr = 0; pr < 16 * n_steps; ++pr) {
      const int j0 = 2 * pr, j1 = 2 * pr + 1;
      const C* a = j0 < nj ? vrow[j0] : nullptr;
      const C* b = j1 < nj ? vrow[j1] : nullptr;
      uint16_t* dst = vpack + static_cast<size_t>(pr / 16) * dtiles * 512 + (pr % 16) * 32;
      for (int dt = 0; dt < dtiles; ++dt) {
        interleave16(a != nullptr ? a + 16 * dt : kZeros, b != nullptr ? b + 16 * dt : kZeros, dst + dt * 512);
      }
    }
    return n_steps;
#else
    (void)sc, (void)vrow, (void)nj, (void)slot;
    return 0;
#endif
  }

  // AMX tiles: defined in amx_path.h.
  void pv_block_amx(Scratch& sc, const uint16_t* pp, float* const* orow, int n, int n_steps, int slot) const;

#if defined(MODELOPT_EXT_AMX)
  // AMX tiles: defined in amx_path.h.
  void decode_tiles(const Item& it, Scratch& sc, int M, int t_begin, int t_end, int first_pos) const;
#endif

  // A row's softmax denominator: the sum of its kLanes partial sums.
  static float denominator(const Scratch& sc, int m) {
    return hsum(loadv(sc.l.data() + static_cast<size_t>(m) * kLanes));
  }

  // Online softmax of row m for one tile: rescale its state if the tile raises its max, then exp(scale * s - max)
  // of the tile's 64 scores, summed into the row's denominator. Exp'd values go to `dst` (fp32, in place on the
  // vector path; rounded to bf16 straight into the P·V A-tile rows on AMX tiles, so P is not stored twice).
  // On the packed bf16 path the max is raised only when the tile's exceeds it by more than kLazyRescale: the
  // probabilities then reach up to e^kLazyRescale (bf16 and fp32 hold them with the same relative precision), and
  // most rows stop rescaling their state after their first tiles (each rescale writes the output row that P·V's C
  // tiles load next). Skip decisions use their own running max (decide_tile), so they do not change. The packed path
  // takes the exp as 2^(s · scale · log2 e − max · log2 e): one FMA and exp2_coarse.
  template <typename P>
  void online_softmax_row(Scratch& sc, int m, const float* s, float g, int D, P* dst) const {
    float mx = sc.mx[m];
    float* lm = sc.l.data() + static_cast<size_t>(m) * kLanes;
    if (g > mx + (std::is_same_v<P, uint16_t> ? kLazyRescale : 0.f)) {
      if (mx != kNegInf) {
        const float a = std::exp(mx - g);
        storev(lm, loadv(lm) * splat(a));
        float* o = sc.o.data() + static_cast<size_t>(m) * D;
        for (int d = 0; d < D; ++d) o[d] *= a;
      }
      mx = g;
      sc.mx[m] = g;
    }
    vf sum = splat(0.f);
    if constexpr (std::is_same_v<P, uint16_t>) {
#if defined(MODELOPT_EXT_BF16_PAIRS)
      // exp(scale * s - mx) = 2^(s * scale * log2 e - mx * log2 e)
      const __m512 c1 = _mm512_set1_ps(exp_scale() * kLog2e), c2 = _mm512_set1_ps(mx * kLog2e);
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < kTileK; j += 2 * kLanes) {
        const __m512 lo = exp2_coarse(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), c1, c2));
        const __m512 hi = exp2_coarse(_mm512_fmsub_ps(_mm512_loadu_ps(s + j + kLanes), c1, c2));
        acc = _mm512_add_ps(acc, _mm512_add_ps(lo, hi));
        store_bf16_32(lo, hi, dst + j);
      }
      std::memcpy(&sum, &acc, sizeof(sum));
#endif
    } else {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
      // exp(scale * s - mx) = 2^(s * scale * log2 e - mx * log2 e), as on the packed path but to fp32 precision
      const __m512 c1 = _mm512_set1_ps(exp_scale() * kLog2e), c2 = _mm512_set1_ps(mx * kLog2e);
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < kTileK; j += kLanes) {
        const __m512 e = exp2_fine(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), c1, c2));
        _mm512_storeu_ps(dst + j, e);
        acc = _mm512_add_ps(acc, e);
      }
      std::memcpy(&sum, &acc, sizeof(sum));
#else
      const vf mv = splat(mx);
      const vf sv = splat(exp_scale());
      for (int j = 0; j < kTileK; j += kLanes) {
        const vf e = vexp(loadv(s + j) * sv - mv);
        storev(dst + j, e);
        sum += e;
      }
#endif
    }
    storev(lm, loadv(lm) + sum);
  }

  // Pointers to V rows kstart .. kstart + nj - 1 (all < kv_len), in place or repacked. The page and the slot in it
  // advance with the key instead of being divided out per row (a 64-bit division per V row and tile cost several
  // percent of a prefill).
  void value_rows(const Item& it, Scratch& sc, int64_t kstart, int nj, const C** vrow, int slot) const {
    const Params& p = p_;
    const int D = static_cast<int>(p.D);
    const int32_t* pages = p.bt + it.b * p.P;
    int64_t page = kstart / p.page, in_page = kstart % p.page;
    const C* row = value_base(it.b, it.kvh, kstart);
    C* buf = reinterpret_cast<C*>(sc.vbuf.data()) + static_cast<size_t>(slot) * kTileK * D;
    for (int j = 0; j < nj; ++j) {
      if (p.v_direct) {
        vrow[j] = row;
      } else {
        C* dst = buf + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; ++d) dst[d] = row[d * p.sv3];
        vrow[j] = dst;
      }
      if (++in_page == p.page) {
        in_page = 0;
        ++page;
        if (j + 1 < nj) row = static_cast<const C*>(p.v) + pages[page] * p.sv0 + it.kvh * p.sv2;
      } else {
        row += p.sv1;
      }
    }
  }
};

}  // namespace
