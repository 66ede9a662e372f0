// Compiled CPU kernel of paged skip-softmax attention (docs/skip_softmax.md, the contract version that
// semantics.CONTRACT_VERSION names; its numbers come from semantics.py at build time: common.h).
//
// One work item is (sequence, KV head, block of query rows[, key split]). Its rows are the (query row, query head)
// pairs of the block that share the KV head (GQA), m = r * group + h; its row blocks are aligned to absolute
// positions in whole decision blocks of 64, so an item holds whole decision units: the prompt rows of an aligned
// 64-position block of one head, and the heads of a decode row's GQA group. For each key tile of 64 keys (aligned to
// absolute positions) the item computes the scores of every row that visits the tile, takes each row's tile max and
// its gap to the reference max (running max within the tile's 2048-key split, seeded with the row's tile 0 and, since
// version 5, with the max of the row's recent-window tiles, scored first: Kernel::window_max), decides
// per unit (the largest effective gap of its members, +inf for a member whose recent window holds the tile, against
// their ln λ: Kernel::decide_tile), and runs the online softmax and P·V only for the rows whose unit keeps the tile:
// a dropped row-tile costs no exp and no P·V, and a tile every unit of the item drops (a decode row's group) costs
// no V load at all.
//
// The cache is read in place through the block table with any strides. The fast path reads K as stored by vLLM's
// CPU backend (keys contiguous per dimension: last-dim stride = page) and V rows (last-dim stride 1); other layouts
// are repacked per tile into a small per-thread buffer. Keys at or past kv_len and past a row's causal limit never
// reach an output or a count: their scores are replaced (not scaled) by -inf, a column block of keys (16, 32 or 64,
// never crossing a page) that starts at or past kv_len is never read, and P·V only reads V rows that some kept row
// can see.
//
// FP8 caches (float8_e4m3fn, float8_e5m2; docs/skip_softmax.md "Inputs") are read in place the same way, in the
// [blocks, page, Hkv, D] views only: a slot's key and value are its byte times k_scale and v_scale. Each K and V
// load converts the bytes through fp16 (common.h, Fp8E4M3 / Fp8E5M2), k_scale is folded into the softmax scale and
// v_scale into the output after the split merge (Params::scale, Params::out_scale); bf16 queries run prefill on the
// packed bf16 pairs of VDPBF16PS (the FP8 tiles converted into them exactly), never on AMX tiles.
//
// Vectors are 16 floats wide where the compiler targets AVX-512 and 8 elsewhere (-march=native); the micro-kernels'
// register blocking follows the width (AVX-512 has twice the registers, so each step keeps more accumulators).
//
// Parallelism: items are sorted by estimated cost and taken dynamically from an atomic counter by the threads of
// torch's intra-op pool (at::parallel_for over thread slots). Sequences with a single row block are also split
// along the key axis at SPLIT_TOKENS boundaries (decode); each split decides exactly as the sequential loop would
// (the reference max restarts at each split, seeded with tile 0 and the window max) and partial softmax states are
// merged at the end.
// Attention sinks (optional, one logit per query head) join every row's reference max and, once (the item holding
// tile 0), its softmax denominator (Kernel::seed_sinks); the merge is unchanged.
//
// Layout of the source: this file holds the work-item scheduling (run), the op (argument checks, dispatch by
// dtype and engine) and its registration; it is the one compiled file. The headers beside it hold, by
// instruction-set path: common.h (what is compiled in and switched on, shared constants, vector primitives,
// parameters and scratch), vector_path.h (AVX2 / AVX-512 fp32 vectors), bf16_dot_path.h (AVX512-BF16
// VDPBF16PS), amx_tiles.h and amx_path.h (AMX tiles), and kernel.h (the per-item driver over them).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "common.h"
#include "vector_path.h"
#include "amx_tiles.h"
#include "bf16_dot_path.h"
#include "kernel.h"
#include "amx_path.h"

namespace {

template <typename T, typename C>
void run(const Params& p) {
  Kernel<T, C> kernel(p);
  const int64_t group = p.group;
  // Rows per item: about the target's (row, head) pairs, in whole decision blocks (version 4: a prompt block's rows
  // decide together, so they are held by one item; its heads are the item's KV head's whole GQA group).
  const int64_t target_rows = (p.packed ? kPackedTargetRows : kTargetRows) / group;
  const int64_t rows_per_item = std::max<int64_t>(1, (target_rows + kDecisionRows / 2) / kDecisionRows) * kDecisionRows;
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
    // Row blocks aligned to absolute positions (multiples of rows_per_item, itself a multiple of kDecisionRows), so a
    // row's blocking does not depend on chunking and no decision block is cut in two; a call that starts inside a
    // block gets a shorter first item.
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

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// run<T, C> for queries of type T on a cache of `cache` dtype (T itself, or FP8).
template <typename T>
void run_cache(const Params& p, at::ScalarType cache) {
  switch (cache) {
    case at::kFloat8_e4m3fn: run<T, Fp8E4M3>(p); break;
    case at::kFloat8_e5m2: run<T, Fp8E5M2>(p); break;
    default: run<T, T>(p);
  }
}

at::Tensor skip_softmax_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& cu_seqlens_q,
                                  const at::Tensor& seq_lens_k, double softmax_scale,
                                  const std::optional<at::Tensor>& log_sf, const at::Tensor& gamma,
                                  const at::Tensor& prompt_lens, bool calibrate, at::Tensor out,
                                  const std::optional<at::Tensor>& counts_out,
                                  const std::optional<at::Tensor>& phase_index,
                                  const std::optional<at::Tensor>& phase_totals, double softcap,
                                  const std::optional<at::Tensor>& sinks, double k_scale, double v_scale) {
  TORCH_CHECK(q.device().is_cpu(), "skip_softmax_attention (CPU kernel): q must be a CPU tensor");
  const bool vnni = k_cache.dim() == 6;
  TORCH_CHECK(q.dim() == 3 && (k_cache.dim() == 4 || vnni) && v_cache.dim() == k_cache.dim() && out.dim() == 3,
              "skip_softmax_attention: expected q [total_q, Hq, D], caches [blocks, page, Hkv, D] (or the 6-D views "
              "of vLLM's amx layout), out [N, Hq, D]");
  const bool fp8 = is_fp8(k_cache.scalar_type());
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  (fp8 || k_cache.scalar_type() == q.scalar_type()),
              "skip_softmax_attention: q, caches and out must share one dtype (or the caches be float8_e4m3fn / "
              "float8_e5m2 with q and out in float32, bfloat16 or float16)");
  TORCH_CHECK(!(fp8 && vnni), "skip_softmax_attention: FP8 caches are read as 4-D [blocks, page, Hkv, D] views (the "
              "6-D amx layout is bf16 only)");
  TORCH_CHECK(std::isfinite(k_scale) && k_scale > 0 && std::isfinite(v_scale) && v_scale > 0,
              "skip_softmax_attention: k_scale and v_scale must be finite and > 0");
  TORCH_CHECK(fp8 || (k_scale == 1.0 && v_scale == 1.0),
              "skip_softmax_attention: k_scale and v_scale apply to FP8 caches only (1.0 otherwise)");
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
    // (V) of one [blocks, Hkv, page, 2D] cache (docs/cpu_amx_layout.md); only these exact strides.
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
  const double unit = k_cache.scalar_type() == at::kFloat8_e4m3fn ? kCacheUnitInverse<Fp8E4M3> : 1.0;
  p.scale = static_cast<float>(softmax_scale * k_scale * unit);  // exactly softmax_scale without FP8
  p.out_scale = static_cast<float>(v_scale * unit);
  TORCH_CHECK(softcap >= 0.0, "skip_softmax_attention: softcap must be >= 0 (0: off)");
  p.softcap = static_cast<float>(softcap);
  p.calibrate = calibrate;
  if (sinks.has_value()) {  // as semantics.checked_sinks gives them: no conversion here
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == p.Hq,
                "skip_softmax_attention: sinks must be a contiguous float32 CPU tensor [Hq] (one logit per query "
                "head)");
    p.sinks = sinks->data_ptr<float>();
  }
  p.kc = p.page % 32 == 0 || p.sk1 != 1 ? 32 : 16;
  p.k_direct = !vnni && p.sk1 == 1 && p.page % p.kc == 0;
  p.v_direct = !vnni && p.sv3 == 1;
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  p.tiles = bf16 && !fp8 && p.D % 32 == 0 && amx_active();  // FP8 caches: VDPBF16PS, not AMX tiles (Kernel::kPairs)
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
    case at::kFloat: run_cache<float>(p, k_cache.scalar_type()); break;
    case at::kBFloat16: run_cache<c10::BFloat16>(p, k_cache.scalar_type()); break;
    case at::kHalf: run_cache<c10::Half>(p, k_cache.scalar_type()); break;
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

// The contract this library was built for (the -D defines from semantics.py): version, TILE_K, SPLIT_TOKENS,
// DECISION_BLOCK_ROWS, RECENT_WINDOW.
std::vector<int64_t> contract() {
  return {kContractVersion, kTileK, kSplitTokens, kDecisionRows, kRecentWindow};
}

}  // namespace

TORCH_LIBRARY(modelopt_ext_cpu, m) {
  m.def(
      "skip_softmax_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor cu_seqlens_q, "
      "Tensor seq_lens_k, float softmax_scale, Tensor? log_sf, Tensor gamma, Tensor prompt_lens, bool calibrate, "
      "Tensor(a!) out, Tensor(b!)? counts=None, Tensor? phase_index=None, Tensor(c!)? phase_totals=None, "
      "float softcap=0.0, Tensor? sinks=None, float k_scale=1.0, float v_scale=1.0) -> Tensor");
  m.def("amx_tiles(bool? enable=None) -> bool", &amx_tiles);
  m.def("bf16_dot(bool? enable=None) -> bool", &bf16_dot);
  m.def("contract() -> int[]", &contract);
}

TORCH_LIBRARY_IMPL(modelopt_ext_cpu, CPU, m) { m.impl("skip_softmax_attention", &skip_softmax_attention); }
