// Shared by every instruction-set path of the compiled CPU kernel (skip_softmax_cpu.cpp, the one compiled file):
// the instruction sets compiled in and whether bf16 uses them (AMX tiles, VDPBF16PS), tile geometry and tuning
// constants, the vector type and its primitives (loads, broadcasts, horizontal reductions, exp2), the bf16 pair
// helpers of the packed paths, and the kernel's parameters, work items and per-thread scratch buffers.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

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

// The contract's numbers (docs/skip_softmax.md) have one source, semantics.py: cpu_kernel.py passes them as -D
// defines (cpu_kernel.contract_defines(), part of the build key) and the library reports them back (op `contract`).
#if !defined(MODELOPT_EXT_CONTRACT_VERSION) || !defined(MODELOPT_EXT_TILE_K) || !defined(MODELOPT_EXT_SPLIT_TOKENS) || \
    !defined(MODELOPT_EXT_DECISION_BLOCK_ROWS) || !defined(MODELOPT_EXT_RECENT_WINDOW)
#error "build with cpu_kernel.py: it passes semantics.py's constants as -D defines (cpu_kernel.contract_defines())"
#endif
constexpr int kContractVersion = MODELOPT_EXT_CONTRACT_VERSION;
constexpr int kTileK = MODELOPT_EXT_TILE_K;                   // keys per tile, aligned to absolute positions
constexpr int kSplitTokens = MODELOPT_EXT_SPLIT_TOKENS;       // keys per split: the reference max restarts at each
constexpr int kSplitTiles = kSplitTokens / kTileK;
constexpr int kDecisionRows = MODELOPT_EXT_DECISION_BLOCK_ROWS;  // prompt rows decide per aligned block of this many
constexpr int kRecentWindow = MODELOPT_EXT_RECENT_WINDOW;    // a row never drops a tile of its most recent keys
// What the code below is written for: a different TILE_K needs new packed bf16 paths (two 32-key steps per tile,
// AMX tiles of 16 keys), not only a new number.
static_assert(kTileK == 64, "the packed bf16 paths (AMX tiles, VDPBF16PS) are written for 64-key tiles");
static_assert(kSplitTokens > 0 && kSplitTokens % kTileK == 0, "a split holds whole tiles");
static_assert(kDecisionRows > 0 && kRecentWindow >= 0, "decision blocks hold rows; the recent window is not negative");
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

// Whether the paths compiled in are used. AMX tiles (amx_tiles.h, amx_path.h): switched on for the process and
// granted by the OS.
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

// FP8 cache elements (docs/skip_softmax.md "Inputs": a slot's key is float(k8) · k_scale), the raw byte. A load
// converts through fp16, exactly: e5m2 is the high byte of an fp16; e4m3fn's sign, exponent and mantissa moved into
// an fp16 (sign to bit 15, the rest shifted by 7) read as its value times 2^-8, subnormals included (both formats'
// subnormals land on fp16 subnormals), so e4m3 elements load in units of 2^-8 and the op folds kCacheUnit = 2^8
// into the K and V scales. e4m3fn's NaN bytes (0x7f, 0xff) load as ±480, e5m2's as NaN: such bytes may only sit at
// or past kv_len, where scores are replaced by -inf and V rows are not read.
struct Fp8E4M3 {
  uint8_t bits;
  uint16_t half_bits() const { return static_cast<uint16_t>(((bits & 0x80) << 8) | ((bits & 0x7f) << 7)); }
  explicit operator float() const { return static_cast<float>(c10::Half(half_bits(), c10::Half::from_bits())); }
};
struct Fp8E5M2 {
  uint8_t bits;
  uint16_t half_bits() const { return static_cast<uint16_t>(bits << 8); }
  explicit operator float() const { return static_cast<float>(c10::Half(half_bits(), c10::Half::from_bits())); }
};
static_assert(sizeof(Fp8E4M3) == 1 && sizeof(Fp8E5M2) == 1, "FP8 cache elements are one byte");

// What one loaded cache element is worth in units of its value: 2^-8 for e4m3 (see Fp8E4M3), else 1. The op
// multiplies the K and V scales by the inverse.
template <typename C>
constexpr float kCacheUnitInverse = 1.f;
template <>
constexpr float kCacheUnitInverse<Fp8E4M3> = 256.f;

template <typename C>
constexpr bool kIsFp8 = std::is_same_v<C, Fp8E4M3> || std::is_same_v<C, Fp8E5M2>;

// kLanes FP8 bytes as fp16 halves (see Fp8E4M3), then fp32 by VCVTPH2PS (exact).
#if defined(__AVX512F__)
template <typename C, std::enable_if_t<kIsFp8<C>, int> = 0>
inline vf loadv(const C* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i h;
  if constexpr (std::is_same_v<C, Fp8E5M2>) {
    h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
  } else {  // sign-extended, shifted by 7: bit 15 the sign, bit 14 a copy of it (cleared), bits 7-13 the rest
    h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7), _mm256_set1_epi16(static_cast<short>(0xbf80)));
  }
  const __m512 x = _mm512_cvtph_ps(h);
  vf v;
  std::memcpy(&v, &x, sizeof(v));
  return v;
}
#elif defined(__AVX2__) && defined(__F16C__)
template <typename C, std::enable_if_t<kIsFp8<C>, int> = 0>
inline vf loadv(const C* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m128i h;
  if constexpr (std::is_same_v<C, Fp8E5M2>) {
    h = _mm_slli_epi16(_mm_cvtepu8_epi16(b), 8);
  } else {
    h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(b), 7), _mm_set1_epi16(static_cast<short>(0xbf80)));
  }
  const __m256 x = _mm256_cvtph_ps(h);
  vf v;
  std::memcpy(&v, &x, sizeof(v));
  return v;
}
#else
template <typename C, std::enable_if_t<kIsFp8<C>, int> = 0>
inline vf loadv(const C* p) {
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
#endif

inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

#if defined(MODELOPT_EXT_BF16_PAIRS)
// interleave16 of cache elements: bf16 as they are; FP8 converted to bf16 first (exact: an FP8 value in its load
// units, 2^-8 for e4m3, is a bf16 value), for the packed path's K groups and V pair rows.
template <typename C>
inline void interleave16(const C* a, const C* b, uint16_t* dst) {
  if constexpr (kIsFp8<C>) {
    alignas(64) static const uint16_t kIdx[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                  8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const vf fa = loadv(a), fb = loadv(b);
    __m512 xa, xb;
    std::memcpy(&xa, &fa, sizeof(xa));
    std::memcpy(&xb, &fb, sizeof(xb));
    const __m512bh v = _mm512_cvtne2ps_pbh(xb, xa);  // a in lanes 0-15, b in 16-31
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(_mm512_load_si512(kIdx), reinterpret_cast<const __m512i&>(v)));
  } else {
    interleave16(reinterpret_cast<const uint16_t*>(a), reinterpret_cast<const uint16_t*>(b), dst);
  }
}
#endif

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

// Row block i of n_blocks prefetches its share of the list pf[0 .. npf - 1], so the memory requests of a tile are
// spread over its row blocks (AMX tiles and VDPBF16PS).
inline void prefetch_share(const char* const* pf, int npf, int i, int n_blocks) {
  for (int j = i * npf / n_blocks; j < (i + 1) * npf / n_blocks; ++j) __builtin_prefetch(pf[j], 0, 3);
}

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
  float scale;      // softmax_scale, times k_scale · kCacheUnitInverse for an FP8 cache (scores = (q·k8)·scale)
  float out_scale;  // the output's factor after the softmax: 1, or v_scale · kCacheUnitInverse for an FP8 cache
  float softcap;  // > 0: scores are cap * tanh(s / cap) before the skip test and the softmax
  const float* sinks;  // [Hq] attention-sink logits (scaled-score units, never capped), or null: none
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
  // g: each row's max over the current tile (scores()); g0: each row's reference-max seed (its recent-window max,
  // raised by the anchor and the sink); srun: its running max within the split; sink: each row's head sink (only
  // with sinks); lnl: ln λ [trial][M]; e: each row's gap of the current tile, then its unit's statistic
  // (decide_tile).
  lines<float> q, s, o, mx, l, g0, srun, lnl, kept_g, g, sink, e;
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
  int r_decode;  // the item's first decode row (pos >= prompt_len; rows before it are prompt rows), or its row count
  int k_tile[2];  // AMX: the tile whose K each kpack buffer holds (-1: none)
  // `amx` cache layout: per buffer / slot, the tile's four 16-key K groups and its two 32-key V steps (in the
  // cache, or zeros / a packed copy where keys past kv_len would be read); dim tile stride of each V step.
  const uint16_t* kgrp[2][4];
  const uint16_t* vstep[4][2];  // decode_tiles: four slots
  int64_t vstep_dt[4][2];
  lines<uint16_t> kzero;
};

}  // namespace
