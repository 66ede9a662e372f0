// Compiled CPU kernel of paged skip-softmax attention (docs/skip_softmax.md, version 2).
//
// One work item is (sequence, KV head, block of query rows[, key split]). Its rows are the (query row, query head)
// pairs of the block that share the KV head (GQA), m = r * group + h. For each key tile of 64 keys (aligned to
// absolute positions) the item computes the scores of every row that visits the tile, takes each row's tile max,
// decides per row against the reference max (running max within the tile's 2048-key split, seeded with the row's
// tile 0), and runs the online softmax and P·V only for the rows that keep the tile: a dropped row-tile costs no
// exp and no P·V, and a tile every row drops costs no V load at all.
//
// The cache is read in place through the block table with any strides. The fast path reads K as stored by vLLM's
// CPU backend (keys contiguous per dimension: last-dim stride = page) and V rows (last-dim stride 1); other layouts
// are repacked per tile into a small per-thread buffer. Keys at or past kv_len and past a row's causal limit never
// reach an output or a count: their scores are replaced (not scaled) by -inf, a column block of keys (16, 32 or 64,
// never crossing a page) that starts at or past kv_len is never read, and P·V only reads V rows that some kept row
// can see.
//
// Vectors are 16 floats wide where the compiler targets AVX-512 and 8 elsewhere (-march=native); the micro-kernels'
// register blocking follows the width (AVX-512 has twice the registers, so each step keeps more accumulators).
//
// Parallelism: items are sorted by estimated cost and taken dynamically from an atomic counter by the threads of
// torch's intra-op pool (at::parallel_for over thread slots). Sequences with a single row block are also split
// along the key axis at SPLIT_TOKENS boundaries (decode); each split decides exactly as the sequential loop would
// (the reference max restarts at each split, seeded with tile 0) and partial softmax states are merged at the end.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__F16C__) || defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// AMX tiles for bf16 (Sapphire Rapids and later): compiled where -march=native has them, used where the kernel asks
// the OS for tile state and gets it (Linux: arch_prctl ARCH_REQ_XCOMP_PERM).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#define MODELOPT_EXT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

// bf16 pairs: K and V interleaved into "VNNI" pairs (two consecutive elements of the reduction axis side by side),
// the operand layout of AMX tiles and of AVX512-BF16's VDPBF16PS. Compiled where -march=native has AVX512-BF16
// (every AMX CPU, and CPUs without tiles such as AMD Zen 4/5 and Intel Cooper Lake).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
#define MODELOPT_EXT_BF16_PAIRS 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int kTileK = 64;        // semantics.TILE_K
constexpr int kSplitTokens = 2048;  // semantics.SPLIT_TOKENS
constexpr int kSplitTiles = kSplitTokens / kTileK;
constexpr int kMaxChunks = kTileK / 16;  // most score column blocks per tile (16 keys each): sizes the prefetch list
constexpr float kLazyRescale = 8.f;       // packed bf16 path: raise a row's softmax max only past max + this
constexpr int kPrefetchPerStep = 4;      // prefetch slots per score micro-kernel step (one step per head dim)
constexpr int kFewRows = 4;  // items of at most this many rows (decode: one GQA group) run Q·K in 32-key blocks
// Items of at most this many (row, head) pairs prefetch the next K tile in software (decode: one GQA group, up to
// 32 heads per KV head); larger ones (prefill items) leave it to the hardware prefetcher on the AVX-512 vector path
// (see run_item; on the Xeon with AMX, fp32 prefill with the list was 0.94-0.98x as fast).
constexpr int kPrefetchMaxRows = 32;
// (row, head) pairs per prefill work item on the vector path: each item reads the K and V of its keys once, so more
// rows per item read the cache fewer times over a long prompt (Xeon with AMX, fp32, against 48: prefill 8k
// 1.06-1.15x, 4k 1.03-1.10x, 2k 1.00-1.04x; 96: 8k 1.07-1.09x).
constexpr int kTargetRows = 192;
// (row, head) pairs per item on the packed bf16 path (AMX tiles, VDPBF16PS): K and V are interleaved once per item and
// tile, so more rows (measured 1.06-1.22x faster bf16 prefill than 256 on the AMX machine)
constexpr int kPackedTargetRows = 512;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;  // exp(x) = 2^(x log2 e)

// Vector width: 16 floats where the machine has AVX-512 (32 vector registers), else 8 (AVX2: 16 registers). The
// micro-kernels are written for kLanes and scale their register blocking with it.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
constexpr int kAccumulators = kLanes == 16 ? 24 : 12;  // score accumulators per micro-kernel step
constexpr int kPvVectors = kLanes == 16 ? 4 : 2;       // output vectors per row in a P·V micro-kernel step
constexpr int kPvRows = 4;                            // rows per P·V micro-kernel call

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));

// ---------------------------------------------------------------------------------------------------------------
// AMX bf16 tiles (prefill Q·K and P·V). A tile is 16 rows of 64 bytes; TDPBF16PS adds A[16 x 32 bf16] ·
// B[32 x 16] into C[16 x 16 fp32], with B stored as 16 rows of (16 columns x 2 consecutive k) "VNNI" pairs. vLLM's
// `vec` cache keeps K as [dim][key] and V as [key][dim]: both become B tiles by interleaving two rows (two dims of
// 16 keys for K, two keys of 16 dims for V), one permute per 64 bytes, one pipeline stage before the tile loads
// that read them. Products are exact in fp32 and accumulate in fp32, so scores differ from the vector path only by
// summation order; P enters P·V rounded to bf16 (as in FlashAttention's bf16 kernels; the exp pass writes it as
// bf16 directly), its softmax denominator stays fp32. P·V accumulates onto each row's output in C tiles.
// ---------------------------------------------------------------------------------------------------------------
std::atomic<bool> g_amx_enabled{true};

bool amx_permitted() {
#if defined(MODELOPT_EXT_AMX)
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Whether bf16 calls use AMX tiles: compiled in, granted by the OS and not switched off.
bool amx_active() { return g_amx_enabled.load(std::memory_order_relaxed) && amx_permitted(); }

// The same bf16 pairs on CPUs without tiles: VDPBF16PS (AVX512-BF16) adds a 32-bit pair of A times 16 pairs of B
// into 16 fp32 lanes, two products per lane and instruction where the fp32 path converts each bf16 and issues one
// FMA per product. Used for bf16 items on the packed path when AMX tiles are not (compiled in and not switched off).
std::atomic<bool> g_dot_enabled{true};

bool dot_active() {
#if defined(MODELOPT_EXT_BF16_PAIRS)
  return g_dot_enabled.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

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

#if defined(MODELOPT_EXT_AMX)
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0..7: 64 bytes per row; B tiles (1, 6: 16 pairs x 16 x 2 bf16) 16 rows, A (16 x 32 bf16) and C (16 x 16
// fp32) tiles m_rows: an item of fewer than 16 (row, head) pairs (decode: a GQA group) multiplies its own rows only.
inline void amx_configure(int m_rows) {
  TileConfig cfg{};
  cfg.palette_id = 1;
  for (int i = 0; i < 8; ++i) {
    cfg.colsb[i] = 64;
    cfg.rows[i] = (i == 1 || i == 6) ? 16 : m_rows;
  }
  _tile_loadconfig(&cfg);
}
#endif

#if defined(MODELOPT_EXT_BF16_PAIRS)
// 32 bf16 interleaved from 16 of a and 16 of b: (a0, b0, a1, b1, ...), one VNNI row of a B tile.
inline void interleave16(const uint16_t* a, const uint16_t* b, uint16_t* dst) {
  alignas(64) static const uint16_t kIdx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i va = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m512i vb = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  const __m512i idx = _mm512_load_si512(kIdx);
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(va, idx, vb));
}

// 32 fp32 (lo: the first 16, hi: the next 16) -> 32 bf16 at dst (round to nearest even).
inline void store_bf16_32(__m512 lo, __m512 hi, uint16_t* dst) {
  const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
  _mm512_storeu_si512(dst, reinterpret_cast<const __m512i&>(v));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 2^y for probabilities: y = n + f with n = floor(y) and f in [0, 1) from one VREDUCEPS, 2^f by the polynomial c
// (highest degree first) on f, 2^n applied by VSCALEFPS (which floors y itself). y below -125, -inf included, gives
// exactly 0 (no denormals); NaN stays NaN.
template <size_t N>
inline __m512 exp2_poly(__m512 y, const float (&c)[N]) {
  const __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-125.f), _CMP_NLT_UQ);
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // y - floor(y)
  __m512 p = _mm512_set1_ps(c[0]);
  for (size_t i = 1; i < N; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_maskz_scalef_ps(live, p, y);
}

// The packed path's probabilities, which are rounded to bf16 right after: degree 3, fitted (relative,
// Lawson-weighted least squares) on [0, 1], at most 7.5e-5 relative error in fp32, 26x below bf16's rounding error.
// Seven vector operations where scaling the score, subtracting the max and a base-e exp took about seventeen.
inline __m512 exp2_coarse(__m512 y) {
  static constexpr float kPoly[] = {0.07802419364452362f, 0.2260672152042389f, 0.6958337426185608f,
                                    0.9999251961708069f};
  return exp2_poly(y, kPoly);
}

// The fp32 vector path's probabilities: degree 5, minimax relative on [0, 1] (6e-8; 1.7e-7 with fp32 Horner
// rounding, about vexp's 1 ulp). Nine vector operations with the FMA that forms y, where vexp and its argument took
// about eighteen.
inline __m512 exp2_fine(__m512 y) {
  static constexpr float kPoly[] = {0.0018786415457725525f, 0.008985497988760471f, 0.05583132803440094f,
                                    0.24015097320079803f,   0.6931535005569458f,   0.9999999403953552f};
  return exp2_poly(y, kPoly);
}
#endif

// A broadcast. (`vf{} + x` compiles to a scalar add of 0.0 before the broadcast: IEEE -0.0 + 0.0 is +0.0, so the
// compiler may not drop it, and it sat on every row broadcast of the Q·K and P·V micro-kernels.)
inline vf splat(float x) {
#if defined(__AVX512F__)
  const __m512 b = _mm512_set1_ps(x);
#elif defined(__AVX__)
  const __m256 b = _mm256_set1_ps(x);
#else
  return vf{} + x;
#endif
#if defined(__AVX512F__) || defined(__AVX__)
  vf v;
  std::memcpy(&v, &b, sizeof(v));
  return v;
#endif
}

inline vi iota(int32_t start) {
  vi v;
  for (int i = 0; i < kLanes; ++i) v[i] = start + i;
  return v;
}

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 -> fp32: zero-extend to 32 bits and shift into the high half (one widening load and a shift; the generic
// vector conversion compiled to two half-width widenings plus an extract and an insert).
inline vf loadv(const c10::BFloat16* p) {
  vf v;
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  std::memcpy(&v, &w, sizeof(v));
#elif defined(__AVX2__)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  std::memcpy(&v, &w, sizeof(v));
#else
  vh h;
  std::memcpy(&h, p, sizeof(h));
  vu w = __builtin_convertvector(h, vu) << 16;
  std::memcpy(&v, &w, sizeof(v));
#endif
  return v;
}

inline vf loadv(const c10::Half* p) {
  vf v;
#if defined(__AVX512F__)
  __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &x, sizeof(v));
#elif defined(__F16C__)
  __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &x, sizeof(v));
#else
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
#endif
  return v;
}

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// D floats (a multiple of kLanes), inline: memcpy calls of a row in the AMX P·V gather and scatter were ~7 % of the
// kernel's samples (bf16 prefill, s≈0.5).
inline void copy_row(float* dst, const float* src, int D) {
  for (int d = 0; d < D; d += kLanes) storev(dst + d, loadv(src + d));
}

// Horizontal max and sum as shuffle trees: a loop over the lanes compiles to a serial chain of scalar ops with an
// extract per lane, which cost about a tenth of a prefill's time (two reductions per row and tile). Inputs are never
// NaN here (scores past a row's limit are -inf), so the tree gives the same max; the sum differs only in rounding.
#if defined(__AVX512F__)
inline float hmax(vf v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof(x));
  return _mm512_reduce_max_ps(x);
}

inline float hsum(vf v) {
  __m512 x;
  std::memcpy(&x, &v, sizeof(x));
  return _mm512_reduce_add_ps(x);
}

// The 16 horizontal maxima of v[0..15] in one vector (lane i: max of v[i]'s lanes): a transposing tree of 15 max
// operations (halves of two vectors side by side, then quarters, pairs, lanes) where hmax per vector takes 4 each
// plus its extract. Maxima are exact, so this is hmax's value row by row (no NaN here, as for hmax).
__attribute__((always_inline)) inline __m512 hmax16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // a[i]: lanes 0-7 halves of v[2i], lanes 8-15 of v[2i+1]
    a[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int i = 0; i < 4; ++i) {  // b[i]: 4 lanes each of v[4i .. 4i+3], in 128-bit lane order
    b[i] = _mm512_max_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int i = 0; i < 2; ++i) {  // within each 128-bit lane: two partials of two vectors
    c[i] = _mm512_max_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 d = _mm512_max_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // d's 128-bit lane k holds rows k, 4 + k, 8 + k, 12 + k: row r sits at 4 (r % 4) + r / 4
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, d);
}
#elif defined(__AVX__)
inline __m128 fold_halves(vf v, bool is_max) {
  __m256 x;
  std::memcpy(&x, &v, sizeof(x));
  const __m128 lo = _mm256_castps256_ps128(x), hi = _mm256_extractf128_ps(x, 1);
  __m128 r = is_max ? _mm_max_ps(lo, hi) : _mm_add_ps(lo, hi);
  const __m128 swapped = _mm_movehl_ps(r, r);
  r = is_max ? _mm_max_ps(r, swapped) : _mm_add_ps(r, swapped);
  const __m128 odd = _mm_movehdup_ps(r);
  return is_max ? _mm_max_ss(r, odd) : _mm_add_ss(r, odd);
}

inline float hmax(vf v) { return _mm_cvtss_f32(fold_halves(v, true)); }
inline float hsum(vf v) { return _mm_cvtss_f32(fold_halves(v, false)); }
#else
inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}
#endif

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
// vLLM's `amx` cache layout (bf16; ../shared/reference/cpu_amx_layout.md), read in place. Per block and KV head:
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

// Row block i of n_blocks prefetches its share of the list pf[0 .. npf - 1], so the memory requests of a tile are
// spread over its row blocks (AMX tiles and VDPBF16PS).
inline void prefetch_share(const char* const* pf, int npf, int i, int n_blocks) {
  for (int j = i * npf / n_blocks; j < (i + 1) * npf / n_blocks; ++j) __builtin_prefetch(pf[j], 0, 3);
}

// Cache lines to bring into L1 ahead of their tile loads, in order: runs of whole 1 KiB blocks (16 lines: a 16-row B
// tile of the `amx` layout) queued as soon as their addresses are known, issued one block at a time between other
// work (decode_tiles), without a list of line addresses built per tile.
class LineQueue {
 public:
  void add(const void* p, int lines) {
    if (tail_ - head_ == kCap) return;
    start_[tail_ & (kCap - 1)] = static_cast<const char*>(p);
    blocks_[tail_ & (kCap - 1)] = lines / 16;
    ++tail_;
    queued_ += lines / 16;
  }
  __attribute__((always_inline)) void issue16() {
    if (head_ == tail_) return;
    const char* q = start_[head_ & (kCap - 1)] + 1024 * j_;
    for (int l = 0; l < 16; ++l) _mm_prefetch(q + 64 * l, _MM_HINT_T0);
    --queued_;
    if (++j_ == blocks_[head_ & (kCap - 1)]) {
      ++head_;
      j_ = 0;
    }
  }
  // Issue blocks until at most `blocks` are queued.
  void drain_to(int blocks) {
    while (queued_ > blocks) issue16();
  }

 private:
  static constexpr int kCap = 128;  // runs: two tiles' K groups and V steps of up to 32 dim tiles
  const char* start_[kCap];
  int blocks_[kCap];
  int head_ = 0, tail_ = 0, j_ = 0, queued_ = 0;
};

#if defined(MODELOPT_EXT_AMX)
struct NoHook {
  void operator()() const {}
};

// Raw scores of the configured rows of bf16 Q (row stride D) against one 64-key tile given as its four 16-key K
// groups (B tiles of D/2 rows of 32 bf16): s[row][64]. `between` runs after every other tile product (decode_tiles
// issues prefetches there).
template <typename Hook>
__attribute__((always_inline)) inline void qk_groups_amx(const uint16_t* q, int D, const uint16_t* const* grp, float* s,
                                                         Hook&& between) {
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  for (int ks = 0; ks < D / 32; ++ks) {
    _tile_loadd(0, q + 32 * ks, D * 2);
    const int row = ks * 16 * 32;  // rows 16ks.. of each group's [D/2][32]
    _tile_loadd(1, grp[0] + row, 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(6, grp[1] + row, 64);
    _tile_dpbf16ps(3, 0, 6);
    between();
    _tile_loadd(1, grp[2] + row, 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(6, grp[3] + row, 64);
    _tile_dpbf16ps(5, 0, 6);
    between();
  }
  _tile_stored(2, s, kTileK * 4);
  _tile_stored(3, s + 16, kTileK * 4);
  _tile_stored(4, s + 32, kTileK * 4);
  _tile_stored(5, s + 48, kTileK * 4);
}

// O += P · V for the configured rows: O fp32 rows of D in C tiles (row stride D), P bf16 rows of 64 (A tiles), V as
// `n_steps` 32-key steps of B tiles, dim tile i of step ks at vstep[ks] + i · vstep_dt[ks]. `between` runs after
// every other tile product.
template <typename Hook>
__attribute__((always_inline)) inline void pv_steps_amx(float* o, int D, const uint16_t* p, int n_steps,
                                                        const uint16_t* const* vstep, const int64_t* vstep_dt,
                                                        Hook&& between) {
  for (int dt = 0; dt < D / 16; dt += 2) {  // D % 32 == 0: dim tiles come in pairs
    _tile_loadd(2, o + 16 * dt, D * 4);
    _tile_loadd(3, o + 16 * (dt + 1), D * 4);
    for (int ks = 0; ks < n_steps; ++ks) {
      _tile_loadd(0, p + 32 * ks, kTileK * 2);
      const uint16_t* v = vstep[ks] + dt * vstep_dt[ks];
      _tile_loadd(1, v, 64);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(6, v + vstep_dt[ks], 64);
      _tile_dpbf16ps(3, 0, 6);
      between();
    }
    _tile_stored(2, o + 16 * dt, D * 4);
    _tile_stored(3, o + 16 * (dt + 1), D * 4);
  }
}
#endif

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
inline void qk_dot_kernel(const uint16_t* q, int D, const uint16_t* const* grp, float* s) {
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
inline void qk_dot_tail(const uint16_t* q, int D, int rows, const uint16_t* const* grp, float* s) {
  if constexpr (R > 0) {
    if (rows == R) {
      qk_dot_kernel<R>(q, D, grp, s);
    } else {
      qk_dot_tail<R - 1>(q, D, rows, grp, s);
    }
  }
}

// Scores of `rows` rows against a packed K tile; the prefetch list is spread over the row blocks.
inline void qk_dot_rows(const uint16_t* q, int D, int rows, const uint16_t* const* grp, float* s,
                        const char* const* pf, int npf) {
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

struct Params {
  int64_t B, Hq, Hkv, D, group, page, nblocks, P, T;
  const int32_t* bt;
  const int32_t* cu;
  const int32_t* kvlen;
  const int32_t* plen;
  const void* q;
  int64_t sq0, sq1, sq2;
  const void* k;
  int64_t sk0, sk1, sk2, sk3;
  const void* v;
  int64_t sv0, sv1, sv2, sv3;
  void* out;
  int64_t so0, so1, so2;
  float scale;
  float softcap;  // > 0: scores are cap * tanh(s / cap) before the skip test and the softmax
  const float* log_sf;  // [B, T, 2] or null (dense, no counts)
  const float* gamma;   // [B, 2]
  bool calibrate;
  int kc;         // keys per K prefetch / packing block: 32, or 16 when the page is not a multiple of 32
  bool k_direct;  // K blocks readable in place: keys contiguous (stride 1) and a block never crosses a page
  bool v_direct;  // V rows contiguous
  int64_t* skipped;  // counts[..., 1] of [B, T, 2] int64: element (b, t) at skipped[2 * (b * T + t)]
  bool packed;  // bf16 on packed pairs (AMX tiles, or VDPBF16PS): Q·K and P·V of items of >= kTileMinRows pairs on
                // tiles, >= kPackedMinRows on VDPBF16PS
  bool tiles;   // the packed path runs on AMX tiles (head size % 32 == 0); else on VDPBF16PS (head size % 16 == 0)
  bool vnni;  // vLLM's `amx` cache layout (bf16): k/v point at the K and V regions, sk0/sv0 = block stride,
              // sk2/sv2 = head stride; K groups and V pair rows are read in place (see vnni_split)
};

struct Item {
  int32_t b, kvh, r0, r1;  // rows r0..r1-1 of sequence b (0-based among its new rows)
  int32_t split;           // -1: every key tile in order; else key split index (partial state to workspace)
  int64_t ws;              // workspace offset (floats) of this item's partial state
  int64_t cost;
};

// Per-thread buffers, reused across items and calls. Tiles are processed in two stages (scores and decisions of
// tile t, then exp and P·V of tile t - 1), so the per-tile buffers have two slots.
// Scratch buffers start on a cache line: their rows (64 floats or bf16 pairs, tile rows of 64 bytes) then never
// straddle two lines. With malloc's 16-byte alignment a bf16 prefill on AMX tiles ran 11.8-13.3 ms per call
// (2k, 1 thread) depending on where the process's buffers happened to land.
template <typename E>
struct LineAligned {
  using value_type = E;
  static constexpr std::align_val_t kAlign{64};
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  E* allocate(size_t n) { return static_cast<E*>(::operator new(n * sizeof(E), kAlign)); }
  void deallocate(E* ptr, size_t) { ::operator delete(ptr, kAlign); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAligned<U>&) const { return false; }
};
template <typename E>
using lines = std::vector<E, LineAligned<E>>;

struct Scratch {
  // l: each row's softmax denominator as kLanes partial sums (summed once per item, not once per tile);
  // g: each row's max over the current tile (scores()).
  lines<float> q, s, o, mx, l, g0, srun, lnl, kept_g, g;
  std::vector<int32_t> pos, kept_m;
  lines<unsigned char> kbuf, vbuf;
  std::vector<const void*> vrow;
  std::vector<const char*> pf;
  std::vector<float*> prow, orow;
  std::vector<int64_t> skipped;
  // AMX: Q rows as bf16 (16 rows of padding), the tile's K and V as B tiles, P rows as bf16, one P·V result tile.
  lines<uint16_t> qb, kpack, vpack, ppack;
  lines<float> ctmp;
  bool packed;    // this item runs on packed bf16 pairs (AMX tiles or VDPBF16PS: Params::tiles)
  int slot_rows;  // rows per score slot: on tiles M + 16, so a 16-row tile starting at any row stays in its slot
  int n_kept[2], j_end[2];
  int k_tile[2];  // AMX: the tile whose K each kpack buffer holds (-1: none)
  // `amx` cache layout: per buffer / slot, the tile's four 16-key K groups and its two 32-key V steps (in the
  // cache, or zeros / a packed copy where keys past kv_len would be read); dim tile stride of each V step.
  const uint16_t* kgrp[2][4];
  const uint16_t* vstep[4][2];  // decode_tiles: four slots
  int64_t vstep_dt[4][2];
  lines<uint16_t> kzero;
};

template <typename T>
class Kernel {
 public:
  explicit Kernel(const Params& p) : p_(p) {}

  void run_item(const Item& it, Scratch& sc, float* ws) const {
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
    sc.skipped.assign(std::max(n_trials, 1), 0);
    sc.prow.resize(M);
    sc.orow.resize(M);
    sc.vrow.resize(2 * kTileK);
    sc.kbuf.resize(sizeof(T) * kTileK * D);
    sc.pf.resize(static_cast<size_t>(kPrefetchPerStep) * kMaxChunks * D);
    sc.vbuf.resize(sizeof(T) * 2 * kTileK * D);
    if (p.vnni && sc.kzero.size() != static_cast<size_t>(16) * D) sc.kzero.assign(static_cast<size_t>(16) * D, 0);

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
      if (p.log_sf != nullptr) row_log_lambdas(b, pos, sc.lnl.data() + static_cast<size_t>(r) * group * n_trials, group);
    }
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (sc.packed) prepare_packed(it, sc, M);
    }

    const int32_t last_pos = static_cast<int32_t>(offset + it.r1 - 1);
    const int first_pos = static_cast<int>(offset + it.r0);
    int t_begin = 0, t_end = last_pos / kTileK + 1;
    if (it.split >= 0) {
      t_begin = it.split * kSplitTiles;
      t_end = std::min(t_end, t_begin + kSplitTiles);
    }
    if (t_begin > 0 && t_begin < t_end) {
      // Anchor: this split's reference max is seeded with each row's tile-0 max (no exp, no P·V for it here).
      const int m_lo = first_active(sc, M, 0);
      scores(it, sc, 0, m_lo, M, sc.s.data(), 0);
      std::copy(sc.g.begin() + m_lo, sc.g.begin() + M, sc.g0.begin() + m_lo);
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
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (sc.packed && p.tiles && p.vnni && M < 16) {
        decode_tiles(it, sc, M, t_begin, t_end, first_pos);
        t_begin = t_end;  // the loop below runs no tile
      }
    }
#endif
    for (int t = t_begin; t < t_end; ++t) {
      const int slot = t & 1;
      const int npf = sw_prefetch ? prefetch_list(it, sc, t + 1 < t_end ? t + 1 : -1, pending, D) : 0;
      stage_scores(it, sc, t, slot, M, first_pos, npf);
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
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
        const float inv = 1.f / denominator(sc, m);
        const float* src = sc.o.data() + static_cast<size_t>(m) * D;
        T* dst = op + row * p.so0 + h * p.so1;
        for (int d = 0; d < D; ++d) dst[d * p.so2] = static_cast<T>(src[d] * inv);
      }
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
      const float inv = 1.f / l;
      for (int d = 0; d < D; ++d) dst[d * p.so2] = static_cast<T>(acc[d] * inv);
    }
  }

 private:
  const Params& p_;

  // Row m's decision for tile t (docs/skip_softmax.md): tile 0 seeds the reference max; later tiles compare the
  // tile max g with it, count every trial's drop and keep the tile unless trial 0 drops it (calibration keeps all).
  __attribute__((always_inline)) bool decide(Scratch& sc, int t, int m, float g) const {
    const Params& p = p_;
    if (t == 0) {
      sc.g0[m] = g;
      sc.srun[m] = g;
      return true;
    }
    const float ref = std::max(sc.g0[m], sc.srun[m]);
    const float gap = g - ref;
    sc.srun[m] = std::max(sc.srun[m], g);
    if (p.log_sf == nullptr) return true;
    const int n_trials = static_cast<int>(p.T);
    const float* lnl = sc.lnl.data() + static_cast<size_t>(m) * n_trials;
    for (int tr = 0; tr < n_trials; ++tr) sc.skipped[tr] += gap < lnl[tr] ? 1 : 0;
    return p.calibrate || !(gap < lnl[0]);
  }

#if defined(__AVX512F__)
  // decide() for rows m_lo..M-1 of a tile t > 0 with at most one trial (serving, or dense without counts), 16 rows
  // per step instead of one (the scalar loop was about a seventh of a bf16 prefill on AMX tiles; decode's GQA group
  // of a few rows stays on the scalar loop): the same float operations, with the max operands in the order that
  // makes NaN and signed zeros pick what std::max picks, and the kept rows compressed in row order. Returns their
  // number and raises j_end to what they read.
  int decide_rows16(Scratch& sc, int m_lo, int M, int64_t kstart, int64_t kv_len, int* kept_m, float* kept_g,
                    int& j_end) const {
    const bool counting = p_.log_sf != nullptr;
    const bool keep_all = !counting || p_.calibrate;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i lim = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(kTileK, kv_len - kstart)));
    const __m512i shift = _mm512_set1_epi32(static_cast<int32_t>(1 - kstart));  // visible = pos - kstart + 1
    __m512i reach = _mm512_setzero_si512();
    int n_kept = 0;
    int64_t dropped = 0;
    for (int m = m_lo; m < M; m += 16) {
      const __mmask16 in = M - m >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (M - m)) - 1);
      const __m512 g = _mm512_maskz_loadu_ps(in, sc.g.data() + m);
      const __m512 srun = _mm512_maskz_loadu_ps(in, sc.srun.data() + m);
      // ref = max(g0, srun) and srun = max(srun, g) as std::max: MAXPS returns its second operand unless the first
      // is greater
      const __m512 gap = _mm512_sub_ps(g, _mm512_max_ps(srun, _mm512_maskz_loadu_ps(in, sc.g0.data() + m)));
      _mm512_mask_storeu_ps(sc.srun.data() + m, in, _mm512_max_ps(g, srun));
      __mmask16 keep = in;
      if (counting) {
        const __mmask16 drop =
            _mm512_mask_cmp_ps_mask(in, gap, _mm512_maskz_loadu_ps(in, sc.lnl.data() + m), _CMP_LT_OQ);
        dropped += __builtin_popcount(drop);
        if (!keep_all) keep = static_cast<__mmask16>(in & ~drop);
      }
      // Compressed in registers, then a masked store of the first popcount lanes: the compressing store to memory
      // is microcoded on Zen 4 (its two took about a sixth of the kernel's time outside Q·K and P·V, fp32 prefill).
      const __mmask16 first = static_cast<__mmask16>((1u << __builtin_popcount(keep)) - 1);
      _mm512_mask_storeu_epi32(kept_m + n_kept, first,
                               _mm512_maskz_compress_epi32(keep, _mm512_add_epi32(_mm512_set1_epi32(m), lane)));
      _mm512_mask_storeu_ps(kept_g + n_kept, first, _mm512_maskz_compress_ps(keep, g));
      const __m512i pos = _mm512_maskz_loadu_epi32(in, sc.pos.data() + m);
      const __m512i visible = _mm512_min_epi32(_mm512_add_epi32(pos, shift), lim);
      reach = _mm512_mask_max_epi32(reach, keep, reach, visible);
      n_kept += __builtin_popcount(keep);
    }
    if (counting) sc.skipped[0] += dropped;
    j_end = std::max(j_end, _mm512_reduce_max_epi32(reach));
    return n_kept;
  }
#endif

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
    int n_kept = 0;
    int j_end = 0;  // V rows 0..j_end-1 of the tile are needed by some kept row
    int* kept_m = sc.kept_m.data() + static_cast<size_t>(slot) * M;
    float* kept_g = sc.kept_g.data() + static_cast<size_t>(slot) * M;
    if (t % kSplitTiles == 0 && t > 0) std::fill(sc.srun.begin() + m_lo, sc.srun.end(), kNegInf);
#if defined(__AVX512F__)
    if (t > 0 && M - m_lo >= 16 && (p_.log_sf == nullptr || p_.T == 1)) {  // decode's few rows: scalar
      n_kept = decide_rows16(sc, m_lo, M, kstart, kv_len, kept_m, kept_g, j_end);
    } else
#endif
    for (int m = m_lo; m < M; ++m) {
      const float g = sc.g[m];
      if (!decide(sc, t, m, g)) continue;
      const int64_t visible = std::min<int64_t>(sc.pos[m] - kstart + 1, std::min<int64_t>(kTileK, kv_len - kstart));
      j_end = std::max(j_end, static_cast<int>(visible));
      kept_m[n_kept] = m;
      kept_g[n_kept] = g;
      ++n_kept;
    }
    sc.n_kept[slot] = n_kept;
    sc.j_end[slot] = j_end;
    if (n_kept == 0) return;  // a tile every row drops: its V is never read
    if (p_.vnni) {  // the tile's 32-key V steps that some kept row reads, in place
      for (int ks = 0; ks < 2 && 32 * ks < j_end; ++ks) {
        sc.vstep[slot][ks] = v_pairs(it.b, it.kvh, kstart + 32 * ks);
        sc.vstep_dt[slot][ks] = 16 * p_.page;
      }
      return;
    }
    const T** vrow = reinterpret_cast<const T**>(sc.vrow.data()) + slot * kTileK;
    value_rows(it, sc, kstart, j_end, vrow, slot);
  }

  // Stage B: online softmax (exp) and P·V of the rows that kept the tile held in `slot` (vector path).
  void stage_values(Scratch& sc, int slot, int D) const {
    const int M = static_cast<int>(sc.kept_m.size() / 2);
    const int n_kept = sc.n_kept[slot];
    float* sbase = sc.s.data() + static_cast<size_t>(slot) * sc.slot_rows * kTileK;
    const int* kept_m = sc.kept_m.data() + static_cast<size_t>(slot) * M;
    const float* kept_g = sc.kept_g.data() + static_cast<size_t>(slot) * M;
    const T* const* vrow = reinterpret_cast<const T* const*>(sc.vrow.data()) + slot * kTileK;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
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
    if (p_.vnni) {  // step by step (a 64-key tile may span two pages of 32)
      for (int ks = 0; ks < 2 && 32 * ks < sc.j_end[slot]; ++ks) {
        if (ks > 0) {
          for (int i = 0; i < n_kept; ++i) sc.prow[i] += 32;
        }
        pv_vnni_rows(sc.prow.data(), sc.orow.data(), n_kept, sc.vstep[slot][ks], std::min(32, sc.j_end[slot] - 32 * ks),
                     D, p_.page);
      }
      return;
    }
    pv_rows<T>(sc.prow.data(), sc.orow.data(), n_kept, vrow, sc.j_end[slot], D);
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
      const int64_t bytes = static_cast<int64_t>(p.kc) * sizeof(T);
      const int64_t stride = p.sk3 * static_cast<int64_t>(sizeof(T));
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
    if (p.vnni && !sc.packed) {
      const int64_t kv_len = p.kvlen[it.b];
      for (int g = 0; next_t >= 0 && g < kTileK / 16; ++g) {
        const int64_t key0 = static_cast<int64_t>(next_t) * kTileK + 16 * g;
        if (key0 >= kv_len) break;
        pf[n++] = reinterpret_cast<const char*>(k_group(it.b, it.kvh, key0));
      }
      return n;
    }
    if (sc.packed && pending_slot >= 0 && p.v_direct) {
      const T* const* vrow = reinterpret_cast<const T* const*>(sc.vrow.data()) + pending_slot * kTileK;
      const int64_t bytes = static_cast<int64_t>(D) * sizeof(T);
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

  // ln λ of a row for every trial, copied for its `group` heads: docs/skip_softmax.md "λ of a row".
  void row_log_lambdas(int b, int32_t pos, float* dst, int group) const {
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
      for (int hh = 0; hh < group; ++hh) dst[hh * n_trials + tr] = lnl;
    }
  }

  static int first_active(const Scratch& sc, int M, int64_t kstart) {
    int m = 0;
    while (m < M && sc.pos[m] < kstart) ++m;
    return m;
  }

  const T* key_base(int b, int kvh, int64_t key) const {
    const Params& p = p_;
    const int64_t blk = p.bt[b * p.P + key / p.page];
    return static_cast<const T*>(p.k) + blk * p.sk0 + (key % p.page) * p.sk1 + kvh * p.sk2;
  }

  const T* value_base(int b, int kvh, int64_t key) const {
    const Params& p = p_;
    const int64_t blk = p.bt[b * p.P + key / p.page];
    return static_cast<const T*>(p.v) + blk * p.sv0 + (key % p.page) * p.sv1 + kvh * p.sv2;
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
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
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
    if (p_.vnni) {
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
        qk_rows<T, kc>(q, D, rows, key_base(it.b, it.kvh, key0), p.sk3, s + c * kc, pf, n_pf);
      } else {
        T* buf = reinterpret_cast<T*>(sc.kbuf.data()) + static_cast<size_t>(c) * kc * D;
        for (int jj = 0; jj < kc; ++jj) {
          const int64_t key = key0 + jj;
          if (key < kv_len) {
            const T* src = key_base(it.b, it.kvh, key);
            for (int d = 0; d < D; ++d) buf[d * kc + jj] = src[d * p.sk3];
          } else {
            for (int d = 0; d < D; ++d) buf[d * kc + jj] = T(0.f);
          }
        }
        qk_rows<T, kc>(q, D, rows, buf, kc, s + c * kc, pf, n_pf);
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
  void pack_k_pairs(const Item& it, Scratch& sc, int t) const {
#if defined(MODELOPT_EXT_BF16_PAIRS)
    const Params& p = p_;
    const int D = static_cast<int>(p.D);
    const int64_t kv_len = p.kvlen[it.b];
    const int64_t kstart = static_cast<int64_t>(t) * kTileK;
    const int64_t group_elems = static_cast<int64_t>(D / 2) * 32;
    uint16_t* kpack = sc.kpack.data() + static_cast<size_t>(t & 1) * 4 * group_elems;
    sc.k_tile[t & 1] = t;
    if (p.vnni) {  // the groups are B tiles in the cache already
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
      const uint16_t* src;
      int64_t sd;
      if (p.k_direct) {  // 16 keys contiguous within one page (page % 16 == 0)
        src = reinterpret_cast<const uint16_t*>(key_base(it.b, it.kvh, key0));
        sd = p.sk3;
      } else {
        uint16_t* buf = reinterpret_cast<uint16_t*>(sc.kbuf.data());
        for (int jj = 0; jj < 16; ++jj) {
          const int64_t key = key0 + jj;
          const uint16_t* ks = key < kv_len ? reinterpret_cast<const uint16_t*>(key_base(it.b, it.kvh, key)) : nullptr;
          for (int d = 0; d < D; ++d) buf[d * 16 + jj] = ks != nullptr ? ks[d * p.sk3] : 0;
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

  // Raw scores of the 16 rows r..r+15 (Q padded past M) against the K tile packed in `buffer`: s[16][64].
  void qk_block_amx(const Scratch& sc, int r, int buffer, float* s) const {
#if defined(MODELOPT_EXT_AMX)
    const int D = static_cast<int>(p_.D);
    qk_groups_amx(sc.qb.data() + static_cast<size_t>(r) * D, D, sc.kgrp[buffer], s, NoHook{});
#else
    (void)sc, (void)r, (void)buffer, (void)s;
#endif
  }

  // V rows 0..nj-1 of a tile as B tiles, interleaved by key pairs (vpack: [key step of 32][D/16][16][16][2]; keys
  // >= nj are zeros, so unread rows never meet a zero probability). Returns the number of 32-key steps; their B
  // tiles go to sc.vstep[slot] (base, dim tile stride). On the `amx` layout the cache holds them already: a step
  // whose 32 keys are all read is used in place, only a partial step is copied (its keys >= nj as zeros).
  int pack_v_pairs(Scratch& sc, const T* const* vrow, int nj, int slot) const {
#if defined(MODELOPT_EXT_BF16_PAIRS)
    const int n_steps = (nj + 31) / 32;
    const int dtiles = static_cast<int>(p_.D) / 16;
    uint16_t* vpack = sc.vpack.data();
    alignas(64) static const uint16_t kZeros[16] = {};
    if (p_.vnni) {
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
      const uint16_t* a = j0 < nj ? reinterpret_cast<const uint16_t*>(vrow[j0]) : nullptr;
      const uint16_t* b = j1 < nj ? reinterpret_cast<const uint16_t*>(vrow[j1]) : nullptr;
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

  // O[row] += P[row] · V for up to 16 rows: P as bf16 rows of `pp` (rows past n are zeros), outputs at orow[0..n).
  // C starts from each row's output, so every row adds its products to O in the same order whichever rows share its
  // block (a row's result never depends on the other rows: batch and chunk invariance). Sixteen consecutive rows of
  // O are loaded in place; other sets are gathered into a contiguous block and scattered back.
  void pv_block_amx(Scratch& sc, const uint16_t* pp, float* const* orow, int n, int n_steps, int slot) const {
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
  // (after every other tile instruction, about three times in each of the decision and exp loops), so misses stay
  // in flight while the core computes: issued in bursts (16 lines per tile instruction, none elsewhere) bf16 decode
  // at batch 8 ran 3-8 % slower on the Xeon with AMX; V prefetched for every tile, kept or not, 16-32 % slower at
  // s ~ 0.7 (docs/benchmarks.md). The masks, decisions and exp are the pipelined path's own functions
  // (finish_scores, decide, online_softmax_row), so decisions and counts match it, and outputs bitwise (a row's P·V
  // adds the same products in the same order whichever rows share its tiles).
  void decode_tiles(const Item& it, Scratch& sc, int M, int t_begin, int t_end, int first_pos) const {
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
          for (int m = m_lo; m < M; ++m) {
            const float g = sc.g[m];
            if (m % row_pace == 0) pf.issue16();
            if (!decide(sc, t, m, g)) continue;
            kept[slot] |= 1u << m;
            kept_g[m] = g;
            const int64_t visible =
                std::min<int64_t>(sc.pos[m] - kstart + 1, std::min<int64_t>(kTileK, kv_len - kstart));
            j_end[slot] = std::max(j_end[slot], static_cast<int>(visible));
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
  // tiles load next). Skip decisions use their own running max (decide), so they do not change. The packed path
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
  void value_rows(const Item& it, Scratch& sc, int64_t kstart, int nj, const T** vrow, int slot) const {
    const Params& p = p_;
    const int D = static_cast<int>(p.D);
    const int32_t* pages = p.bt + it.b * p.P;
    int64_t page = kstart / p.page, in_page = kstart % p.page;
    const T* row = value_base(it.b, it.kvh, kstart);
    T* buf = reinterpret_cast<T*>(sc.vbuf.data()) + static_cast<size_t>(slot) * kTileK * D;
    for (int j = 0; j < nj; ++j) {
      if (p.v_direct) {
        vrow[j] = row;
      } else {
        T* dst = buf + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; ++d) dst[d] = row[d * p.sv3];
        vrow[j] = dst;
      }
      if (++in_page == p.page) {
        in_page = 0;
        ++page;
        if (j + 1 < nj) row = static_cast<const T*>(p.v) + pages[page] * p.sv0 + it.kvh * p.sv2;
      } else {
        row += p.sv1;
      }
    }
  }
};

template <typename T>
void run(const Params& p) {
  Kernel<T> kernel(p);
  const int64_t group = p.group;
  const int target_rows = p.packed ? kPackedTargetRows : kTargetRows;
  const int rows_per_item = static_cast<int>(std::max<int64_t>(1, target_rows / group));
  std::vector<Item> items;
  struct Merge {
    int32_t b, kvh, r0, r1, n_splits;
    int64_t ws0;
  };
  std::vector<Merge> merges;
  int64_t ws_size = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t q_len = p.cu[b + 1] - p.cu[b];
    if (q_len <= 0) continue;
    const int64_t kv_len = p.kvlen[b];
    const int64_t offset = kv_len - q_len;
    // Row blocks aligned to absolute positions, so a row's blocking does not depend on chunking.
    std::vector<std::pair<int32_t, int32_t>> blocks;
    for (int64_t pos = offset; pos < kv_len;) {
      const int64_t stop = std::min<int64_t>(kv_len, (pos / rows_per_item + 1) * rows_per_item);
      blocks.emplace_back(static_cast<int32_t>(pos - offset), static_cast<int32_t>(stop - offset));
      pos = stop;
    }
    const int64_t n_splits = (kv_len + kSplitTokens - 1) / kSplitTokens;
    const bool split = blocks.size() == 1 && n_splits > 1;
    for (int64_t kvh = 0; kvh < p.Hkv; ++kvh) {
      for (const auto& blk : blocks) {
        const int64_t rows = blk.second - blk.first;
        const int64_t tiles = (offset + blk.second - 1) / kTileK + 1;
        if (!split) {
          items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(kvh), blk.first, blk.second, -1, 0,
                           rows * group * tiles});
          continue;
        }
        const int64_t M = rows * group;
        merges.push_back({static_cast<int32_t>(b), static_cast<int32_t>(kvh), blk.first, blk.second,
                          static_cast<int32_t>(n_splits), ws_size});
        for (int64_t s = 0; s < n_splits; ++s) {
          const int64_t split_tiles = std::min<int64_t>(kSplitTiles, tiles - s * kSplitTiles) + (s > 0 ? 1 : 0);
          items.push_back({static_cast<int32_t>(b), static_cast<int32_t>(kvh), blk.first, blk.second,
                           static_cast<int32_t>(s), ws_size, M * split_tiles});
          ws_size += M * (p.D + 2);
        }
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<float> ws(static_cast<size_t>(ws_size));
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t n_workers = std::min<int64_t>(at::get_num_threads(), n_items);
  at::parallel_for(0, n_workers, 1, [&](int64_t begin, int64_t end) {
    static thread_local Scratch tls_scratch;
    // The buffers are reached through a pointer the compiler cannot see through: otherwise GCC specialises run_item
    // and its callees for the thread_local object and calls __tls_get_addr (after a vzeroupper) on each access to
    // it, once per row and tile in the score pass (fp32 prefill 5-17 % faster without).
    Scratch* sc = &tls_scratch;
    asm volatile("" : "+r"(sc));
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) kernel.run_item(items[i], *sc, ws.data());
    }
  });
  at::parallel_for(0, static_cast<int64_t>(merges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Merge& mg = merges[i];
      kernel.merge(mg.b, mg.kvh, mg.r0, mg.r1, mg.n_splits, mg.ws0, ws.data());
    }
  });
}

at::Tensor skip_softmax_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                                  const at::Tensor& seq_lens_k, double softmax_scale,
                                  const std::optional<at::Tensor>& log_sf, const at::Tensor& gamma,
                                  const at::Tensor& prompt_lens, bool calibrate, at::Tensor out,
                                  const std::optional<at::Tensor>& counts_out,
                                  const std::optional<at::Tensor>& phase_index,
                                  const std::optional<at::Tensor>& phase_totals, double softcap) {
  TORCH_CHECK(q.device().is_cpu(), "skip_softmax_attention (CPU kernel): q must be a CPU tensor");
  const bool vnni = k_cache.dim() == 6;
  TORCH_CHECK(q.dim() == 3 && (k_cache.dim() == 4 || vnni) && v_cache.dim() == k_cache.dim() && out.dim() == 3,
              "skip_softmax_attention: expected q [total_q, Hq, D], caches [blocks, page, Hkv, D] (or the 6-D views "
              "of vLLM's amx layout), out [N, Hq, D]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "skip_softmax_attention: q, caches and out must share one dtype");
  for (const at::Tensor* t : {&block_table, &cu_seqlens_q, &seq_lens_k, &prompt_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "skip_softmax_attention: block_table, cu_seqlens_q, seq_lens_k, prompt_lens must be contiguous int32");
  }
  Params p{};
  p.B = seq_lens_k.size(0);
  p.Hq = q.size(1);
  p.D = q.size(2);
  p.nblocks = k_cache.size(0);
  p.P = block_table.size(1);
  p.vnni = vnni;
  if (vnni) {
    // vLLM's amx layout as 6-D views [blocks, page/16, 16, Hkv, D/2, 2] (K) and [blocks, page/2, 2, Hkv, D/16, 16]
    // (V) of one [blocks, Hkv, page, 2D] cache (../shared/reference/cpu_amx_layout.md); only these exact strides.
    p.page = 16 * k_cache.size(1);
    p.Hkv = k_cache.size(3);
    const int64_t D = p.D, page = p.page;
    const bool k_ok = k_cache.sizes() == at::IntArrayRef({p.nblocks, page / 16, 16, p.Hkv, D / 2, 2}) &&
                      k_cache.stride(1) == 16 * D && k_cache.stride(2) == 2 && k_cache.stride(4) == 32 &&
                      k_cache.stride(5) == 1;
    const bool v_ok = v_cache.sizes() == at::IntArrayRef({p.nblocks, page / 2, 2, p.Hkv, D / 16, 16}) &&
                      v_cache.stride(0) == k_cache.stride(0) && v_cache.stride(3) == k_cache.stride(3) &&
                      v_cache.stride(1) == 32 && v_cache.stride(2) == 1 && v_cache.stride(4) == 16 * page &&
                      v_cache.stride(5) == 2;
    TORCH_CHECK(k_ok && v_ok && q.scalar_type() == at::kBFloat16 && page % 32 == 0 && D % 16 == 0,
                "skip_softmax_attention: 6-D caches must be the bf16 views of vLLM's amx layout (page % 32 == 0, "
                "head size % 16 == 0)");
  } else {
    p.Hkv = k_cache.size(2);
    p.page = k_cache.size(1);
    TORCH_CHECK(k_cache.size(3) == p.D && v_cache.sizes() == k_cache.sizes(),
                "skip_softmax_attention: head counts / sizes mismatch");
  }
  p.group = p.Hq / p.Hkv;
  TORCH_CHECK(p.Hq % p.Hkv == 0, "skip_softmax_attention: head counts / sizes mismatch");
  TORCH_CHECK(block_table.size(0) == p.B && cu_seqlens_q.size(0) == p.B + 1 && prompt_lens.size(0) == p.B,
              "skip_softmax_attention: batch size mismatch");
  p.bt = block_table.data_ptr<int32_t>();
  p.cu = cu_seqlens_q.data_ptr<int32_t>();
  p.kvlen = seq_lens_k.data_ptr<int32_t>();
  p.plen = prompt_lens.data_ptr<int32_t>();
  TORCH_CHECK(p.cu[0] == 0 && p.cu[p.B] <= q.size(0) && p.cu[p.B] <= out.size(0),
              "skip_softmax_attention: cu_seqlens_q must start at 0 and end within q and out");
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t q_len = p.cu[b + 1] - p.cu[b];
    const int64_t kv_len = p.kvlen[b];
    TORCH_CHECK(q_len >= 0, "skip_softmax_attention: cu_seqlens_q must be non-decreasing");
    TORCH_CHECK(kv_len >= q_len, "sequence ", b, ": seq_lens_k (", kv_len, ") must include its ", q_len,
                " new tokens");
    if (q_len == 0) continue;
    const int64_t pages = (kv_len + p.page - 1) / p.page;
    TORCH_CHECK(pages <= p.P, "sequence ", b, ": ", kv_len, " keys need ", pages, " pages but block_table has ", p.P);
    for (int64_t i = 0; i < pages; ++i) {
      const int32_t blk = p.bt[b * p.P + i];
      TORCH_CHECK(blk >= 0 && blk < p.nblocks, "sequence ", b, ": block_table[", i, "] = ", blk,
                  " is outside the cache (", p.nblocks, " blocks)");
    }
  }
  p.q = q.data_ptr();
  p.sq0 = q.stride(0);
  p.sq1 = q.stride(1);
  p.sq2 = q.stride(2);
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  if (vnni) {  // block and head strides; the rest of the layout is fixed
    p.sk0 = k_cache.stride(0);
    p.sk2 = k_cache.stride(3);
    p.sv0 = v_cache.stride(0);
    p.sv2 = v_cache.stride(3);
  } else {
    p.sk0 = k_cache.stride(0);
    p.sk1 = k_cache.stride(1);
    p.sk2 = k_cache.stride(2);
    p.sk3 = k_cache.stride(3);
    p.sv0 = v_cache.stride(0);
    p.sv1 = v_cache.stride(1);
    p.sv2 = v_cache.stride(2);
    p.sv3 = v_cache.stride(3);
  }
  p.out = out.data_ptr();
  p.so0 = out.stride(0);
  p.so1 = out.stride(1);
  p.so2 = out.stride(2);
  p.scale = static_cast<float>(softmax_scale);
  TORCH_CHECK(softcap >= 0.0, "skip_softmax_attention: softcap must be >= 0 (0: off)");
  p.softcap = static_cast<float>(softcap);
  p.calibrate = calibrate;
  p.kc = p.page % 32 == 0 || p.sk1 != 1 ? 32 : 16;
  p.k_direct = !vnni && p.sk1 == 1 && p.page % p.kc == 0;
  p.v_direct = !vnni && p.sv3 == 1;
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  p.tiles = bf16 && p.D % 32 == 0 && amx_active();
  p.packed = p.tiles || (bf16 && p.D % 16 == 0 && dot_active());

  at::Tensor counts;
  at::Tensor log_sf_c, gamma_c;
  if (log_sf.has_value()) {
    log_sf_c = log_sf->to(at::kFloat).contiguous();
    gamma_c = gamma.to(at::kFloat).contiguous();
    TORCH_CHECK(log_sf_c.dim() == 3 && log_sf_c.size(0) == p.B && log_sf_c.size(2) == 2 && log_sf_c.size(1) >= 1,
                "skip_softmax_attention: log_sf must be [B, T, 2]");
    TORCH_CHECK(gamma_c.dim() == 2 && gamma_c.size(0) == p.B && gamma_c.size(1) == 2,
                "skip_softmax_attention: gamma must be [B, 2]");
    p.T = log_sf_c.size(1);
    TORCH_CHECK(calibrate || p.T == 1, "skip_softmax_attention: serving takes one trial (T == 1), got ", p.T);
    p.log_sf = log_sf_c.data_ptr<float>();
    p.gamma = gamma_c.data_ptr<float>();
    if (counts_out.has_value()) {  // the caller's persistent buffer (no allocation per call)
      counts = *counts_out;
      TORCH_CHECK(counts.scalar_type() == at::kLong && counts.is_contiguous() && counts.dim() == 3 &&
                      counts.size(0) == p.B && counts.size(1) == p.T && counts.size(2) == 2,
                  "skip_softmax_attention: counts must be a contiguous int64 [B, T, 2] tensor");
      counts.zero_();
    } else {
      counts = at::zeros({p.B, p.T, 2}, at::kLong);
    }
    p.skipped = counts.data_ptr<int64_t>() + 1;
  }

  switch (q.scalar_type()) {
    case at::kFloat: run<float>(p); break;
    case at::kBFloat16: run<c10::BFloat16>(p); break;
    case at::kHalf: run<c10::Half>(p); break;
    default: TORCH_CHECK(false, "skip_softmax_attention (CPU kernel): unsupported dtype ", q.scalar_type(),
                         "; float32, bfloat16 and float16 are compiled (float64 uses the reference)");
  }

  if (!log_sf.has_value()) return at::empty({0}, at::kLong);
  // visited = (row, query head, key tile) triples: row at position pos visits tiles 0 .. pos // 64.
  auto cacc = counts.accessor<int64_t, 3>();
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t q_len = p.cu[b + 1] - p.cu[b];
    const int64_t kv_len = p.kvlen[b];
    int64_t visited = 0;
    for (int64_t pos = kv_len - q_len; pos < kv_len; ++pos) visited += pos / kTileK + 1;
    for (int64_t tr = 0; tr < p.T; ++tr) cacc[b][tr][0] = visited * p.Hq;
  }
  if (phase_totals.has_value()) {  // serving statistics: add trial 0 of each sequence into totals[phase[b]]
    TORCH_CHECK(phase_index.has_value() && phase_index->scalar_type() == at::kLong && phase_index->numel() >= p.B &&
                    phase_index->is_contiguous(),
                "skip_softmax_attention: phase_totals needs a contiguous int64 phase_index of >= B entries");
    TORCH_CHECK(phase_totals->scalar_type() == at::kLong && phase_totals->is_contiguous() &&
                    phase_totals->dim() == 2 && phase_totals->size(1) == 2,
                "skip_softmax_attention: phase_totals must be a contiguous int64 [phases, 2] tensor");
    const int64_t* ph = phase_index->data_ptr<int64_t>();
    int64_t* tot = phase_totals->data_ptr<int64_t>();
    const int64_t phases = phase_totals->size(0);
    for (int64_t b = 0; b < p.B; ++b) {
      TORCH_CHECK(ph[b] >= 0 && ph[b] < phases, "skip_softmax_attention: phase_index out of range");
      tot[2 * ph[b]] += cacc[b][0][0];
      tot[2 * ph[b] + 1] += cacc[b][0][1];
    }
  }
  return counts;
}

// Whether bf16 calls use AMX tiles; `enable` switches them on or off for the process first (benchmarks, tests).
bool amx_tiles(std::optional<bool> enable) {
  if (enable.has_value()) g_amx_enabled.store(*enable, std::memory_order_relaxed);
  return amx_active();
}

// Whether bf16 calls can run the packed path on VDPBF16PS (where AMX tiles are not used); `enable` switches it on or
// off for the process first.
bool bf16_dot(std::optional<bool> enable) {
  if (enable.has_value()) g_dot_enabled.store(*enable, std::memory_order_relaxed);
  return dot_active();
}

}  // namespace

TORCH_LIBRARY(modelopt_ext_cpu, m) {
  m.def(
      "skip_softmax_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cu_seqlens_q, "
      "Tensor seq_lens_k, float softmax_scale, Tensor? log_sf, Tensor gamma, Tensor prompt_lens, bool calibrate, "
      "Tensor(a!) out, Tensor(b!)? counts=None, Tensor? phase_index=None, Tensor(c!)? phase_totals=None, float softcap=0.0) -> Tensor");
  m.def("amx_tiles(bool? enable=None) -> bool", &amx_tiles);
  m.def("bf16_dot(bool? enable=None) -> bool", &bf16_dot);
}

TORCH_LIBRARY_IMPL(modelopt_ext_cpu, CPU, m) { m.impl("skip_softmax_attention", &skip_softmax_attention); }
