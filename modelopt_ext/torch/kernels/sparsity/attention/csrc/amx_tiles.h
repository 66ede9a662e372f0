// AMX tiles (bf16, Sapphire Rapids and later): the tile configuration, the Q·K and P·V tile products, and the line
// queue decode_tiles (amx_path.h) prefetches with. Whether tiles are used (amx_active) is in common.h.

#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>  // _mm_prefetch (LineQueue); common.h's immintrin.h only comes with AVX
#endif

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------------------------
// AMX bf16 tiles (prefill Q·K and P·V). A tile is 16 rows of 64 bytes; TDPBF16PS adds A[16 x 32 bf16] ·
// B[32 x 16] into C[16 x 16 fp32], with B stored as 16 rows of (16 columns x 2 consecutive k) "VNNI" pairs. vLLM's
// `vec` cache keeps K as [dim][key] and V as [key][dim]: both become B tiles by interleaving two rows (two dims of
// 16 keys for K, two keys of 16 dims for V), one permute per 64 bytes, one pipeline stage before the tile loads
// that read them. Products are exact in fp32 and accumulate in fp32, so scores differ from the vector path only by
// summation order; P enters P·V rounded to bf16 (as in FlashAttention's bf16 kernels; the exp pass writes it as
// bf16 directly), its softmax denominator stays fp32. P·V accumulates onto each row's output in C tiles.
// ---------------------------------------------------------------------------------------------------------------

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

}  // namespace
