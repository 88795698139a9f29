// bf16 paged-attention prefill on AMX tiles: paged_prefill_cpu.cpp's algorithm (the same work items, key ranges,
// causal and window bounds and fp32 online softmax: prefill_common.h) with both products as tile dot products
// (TDPBF16PS, 16 x 16 fp32 results from 16 x 32 bf16 operands) instead of AVX512_BF16 vector dot products.
//
// An item packs the keys its rows can see once, in the layouts the tiles read: K per tile of kTileKeys keys as
// [head_dim / 2][kTileKeys] 32-bit words (a pair of dims of one key: B of Q.K^T), V as [key / 2][head_dim] words (one
// dim of a pair of keys: B of P.V), head_dim padded with zeros to a multiple of 32 (one A tile's row). A query tile's
// rows (kTileRows positions x `group` heads, padded with zero rows to a multiple of 16) are multiplied 32 rows x 32
// keys at a time into the scores; the softmax turns them into probabilities in fp32 (AVX-512), rounds them to bf16 as
// flash attention does, and P.V is added 32 rows x 32 dims at a time onto the fp32 accumulator in memory, which the
// softmax rescales between key tiles.
//
// Built into a library of its own with AMX and AVX-512 flags (kernels/batchgen_kernels/amx.py), and loaded only on a
// CPU with AMX after the kernel has granted the process the tile state. Registered as
// torch.ops.batchgen.paged_prefill_amx_, with paged_prefill_'s arguments. An int8 cache (paged_int8_cpu.cpp's layout,
// torch.ops.batchgen.paged_prefill_amx_int8_) is read the same way, each row dequantized to bf16 as it is packed.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "../prefill_common.h"
#include "../vec16.h"
#include "amx_tiles.h"

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using batchgen_prefill::Item;
using batchgen_prefill::kTileKeys;
using batchgen_prefill::kTileRows;
using batchgen_prefill::window_start;

constexpr int64_t kBlockRows = 2 * amx::kTileRows;  // rows of one 2 x 2 tile block
constexpr int64_t kChunk = 32;                      // bf16 per A tile row: the reduction step of one tile product
constexpr int64_t kPrefetch = 8;                    // keys ahead whose K/V rows pack() requests early

struct Scratch {  // one per thread; the packed K/V grow to the longest key range an item of the thread needs
  std::vector<uint16_t> q, p;  // the query tile and its probabilities, bf16: [rows][padded_dim], [rows][kTileKeys]
  std::vector<uint32_t> kt, v;  // packed K and V (see the file's comment)
  std::vector<float> s, acc;    // scores [rows][kTileKeys], output accumulator [rows][padded_dim]
  batchgen_prefill::SoftmaxBuffers softmax;
  Scratch(int64_t rows, int64_t padded_dim)
      : q(rows * padded_dim), p(rows * kTileKeys), s(rows * kTileKeys), acc(rows * padded_dim), softmax(rows) {}
};

// 16 probabilities in [0, 1] rounded to the nearest bf16 (ties to even), as VCVTNE2PS2BF16 does.
inline void store_bf16(uint16_t* dst, Vec16 x) {
  Int16 bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
  const Half16 halves = __builtin_convertvector(bits, Half16);
  std::memcpy(dst, &halves, sizeof halves);
}

struct PrefillAmx {
  const c10::BFloat16* q;
  int64_t q_stride0, q_stride1;
  const uint16_t *k_base, *v_base;  // bf16 bits
  const int8_t *k8, *v8;  // an int8 cache instead (k_base, v_base null), with a scale per (slot, kv head)
  const float *k_scale, *v_scale;
  int64_t block_size, kv_heads, dim, padded_dim, group;
  const int32_t *tables, *lens, *starts;
  int64_t table_stride;
  float scale;
  int64_t window;  // keys each query sees (itself included); <= 0: the whole context
  c10::BFloat16* out;  // [T, Hq, D] contiguous

  const uint16_t* cache_row(const uint16_t* base, int64_t seq, int64_t head, int64_t pos) const {
    const int64_t block = tables[seq * table_stride + pos / block_size];
    return base + ((block * block_size + pos % block_size) * kv_heads + head) * dim;
  }

  int64_t slot(int64_t seq, int64_t head, int64_t pos) const {  // an int8 cache's (slot, kv head) index
    return (tables[seq * table_stride + pos / block_size] * block_size + pos % block_size) * kv_heads + head;
  }

  void prefetch(const uint16_t* row) const {
    for (int64_t offset = 0; offset < dim * 2; offset += 64) __builtin_prefetch(amx::bytes(row, offset), 0, 3);
  }

  // Keys [base, key_end) of one head, packed key i being position base + i, in whole tiles of kTileKeys: zeros before
  // `first`, past key_end and past dim.
  void pack(int64_t seq, int64_t head, int64_t base, int64_t first, int64_t key_end, Scratch& w) const {
    const int64_t keys = (key_end - base + kTileKeys - 1) / kTileKeys * kTileKeys, pairs = padded_dim / 2;
    if (static_cast<int64_t>(w.kt.size()) < keys * pairs) {
      w.kt.resize(keys * pairs);
      w.v.resize(keys / 2 * padded_dim);
    }
    uint16_t* kt_halves = reinterpret_cast<uint16_t*>(w.kt.data());
    uint16_t* v_halves = reinterpret_cast<uint16_t*>(w.v.data());
    for (int64_t key = 0; key < keys; ++key) {
      // dim d of this key: K's half d % 2 of word [tile][d / 2][key % kTileKeys], V's half key % 2 of [key / 2][d]
      uint16_t* k_dst = kt_halves + 2 * ((key / kTileKeys) * kTileKeys * pairs + key % kTileKeys);
      uint16_t* v_dst = v_halves + 2 * (key / 2) * padded_dim + key % 2;
      const int64_t pos = base + key;
      if (first <= pos + kPrefetch && pos + kPrefetch < key_end) {  // blocks lie anywhere: the hardware prefetchers cannot guess the next one
        if (k8 != nullptr) {
          __builtin_prefetch(k8 + slot(seq, head, pos + kPrefetch) * dim, 0, 3);
          __builtin_prefetch(v8 + slot(seq, head, pos + kPrefetch) * dim, 0, 3);
        } else {
          prefetch(cache_row(k_base, seq, head, pos + kPrefetch));
          prefetch(cache_row(v_base, seq, head, pos + kPrefetch));
        }
      }
      const bool read = first <= pos && pos < key_end;
      if (k8 != nullptr) {
        const int64_t row = read ? slot(seq, head, pos) : 0;
        const float ks = read ? k_scale[row] : 0.0f, vs = read ? v_scale[row] : 0.0f;
        for (int64_t d = 0; d < padded_dim; ++d) {
          const bool real = read && d < dim;
          k_dst[2 * kTileKeys * (d / 2) + d % 2] = real ? c10::BFloat16(k8[row * dim + d] * ks).x : 0;
          v_dst[2 * d] = real ? c10::BFloat16(v8[row * dim + d] * vs).x : 0;
        }
        continue;
      }
      const uint16_t* k_row = read ? cache_row(k_base, seq, head, pos) : nullptr;
      const uint16_t* v_row = read ? cache_row(v_base, seq, head, pos) : nullptr;
      for (int64_t d = 0; d < padded_dim; ++d) {
        const bool real = k_row != nullptr && d < dim;
        k_dst[2 * kTileKeys * (d / 2) + d % 2] = real ? k_row[d] : 0;
        v_dst[2 * d] = real ? v_row[d] : 0;
      }
    }
  }

  // scores[rows block][32 keys from `key`] = Q . K^T over the padded head dims, the block's 16 or 32 rows.
  template <bool kTwoRows>
  void score_block(const Scratch& w, int64_t block, int64_t start, int64_t key, float* s) const {
    const uint16_t* q_rows = w.q.data() + block * padded_dim;
    const uint32_t* k_tile = w.kt.data() + start * (padded_dim / 2) + key;  // [padded_dim / 2][kTileKeys]
    amx::zero_c<kTwoRows>();
    for (int64_t c = 0; c < padded_dim; c += kChunk)
      amx::multiply<kTwoRows>(q_rows + c, padded_dim * 2, k_tile + c / 2 * kTileKeys, kTileKeys * 4);
    amx::store_c<kTwoRows>(s + block * kTileKeys + key, kTileKeys * 4);
  }

  // acc[rows block][32 dims from `d`] += P . V over the tile's `n` keys (32 at a time).
  template <bool kTwoRows>
  void value_block(Scratch& w, int64_t block, int64_t start, int64_t n, int64_t d) const {
    float* acc = w.acc.data() + block * padded_dim + d;
    amx::load_c<kTwoRows>(acc, padded_dim * 4);
    for (int64_t key = 0; key < n; key += kChunk)
      amx::multiply<kTwoRows>(w.p.data() + block * kTileKeys + key, kTileKeys * 2,
                              w.v.data() + (start + key) / 2 * padded_dim + d, padded_dim * 4);
    amx::store_c<kTwoRows>(acc, padded_dim * 4);
  }

  // The query tile of up to kTileRows positions starting at `first_row` (within the sequence's new tokens), all
  // `group` heads of kv head `head`, against the keys packed from position `base` on.
  void attend(int64_t seq, int64_t head, int64_t first_row, int64_t base, Scratch& w) const {
    const int64_t q_len = starts[seq + 1] - starts[seq], len = lens[seq];
    const int64_t positions = std::min(kTileRows, q_len - first_row);
    const int64_t first_pos = len - q_len + first_row;  // absolute position of the tile's first query
    const int64_t rows = positions * group;             // row m = position (m / group), head (m % group)
    const int64_t tile_rows = (rows + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
    std::fill(w.q.begin(), w.q.begin() + tile_rows * padded_dim, 0);
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t token = starts[seq] + first_row + m / group, h = head * group + m % group;
      std::memcpy(w.q.data() + m * padded_dim, q + token * q_stride0 + h * q_stride1, dim * 2);
    }
    // The padding rows (zero queries) get probabilities 0 and keep a zero accumulator; the softmax skips them.
    std::fill(w.p.begin() + rows * kTileKeys, w.p.begin() + tile_rows * kTileKeys, 0);
    std::fill(w.acc.begin() + rows * padded_dim, w.acc.begin() + tile_rows * padded_dim, 0.0f);
    const batchgen_prefill::Softmax softmax = w.softmax.over(w.acc.data(), rows, padded_dim);
    softmax.reset();
    const batchgen_prefill::KeyRange keys = batchgen_prefill::visible_keys(first_pos, positions, base, window);
    for (int64_t start = keys.first; start < keys.end; start += kTileKeys) {
      const int64_t n = std::min(kTileKeys, keys.end - start);
      for (int64_t block = 0; block < tile_rows; block += kBlockRows)
        for (int64_t key = 0; key < n; key += kChunk) {
          if (block + kBlockRows <= tile_rows) score_block<true>(w, block, start, key, w.s.data());
          else score_block<false>(w, block, start, key, w.s.data());
        }
      // Scores past n (not computed in this tile) are masked with the rest.
      softmax.tile(w.s.data(), n, first_pos - base - start, group, window, scale);
      for (int64_t m = 0; m < rows; ++m)
        for (int64_t c = 0; c < kTileKeys; c += 16)
          store_bf16(w.p.data() + m * kTileKeys + c, load16(w.s.data() + m * kTileKeys + c));
      for (int64_t block = 0; block < tile_rows; block += kBlockRows)
        for (int64_t d = 0; d < padded_dim; d += kChunk) {
          if (block + kBlockRows <= tile_rows) value_block<true>(w, block, start, n, d);
          else value_block<false>(w, block, start, n, d);
        }
    }

    const int64_t q_heads = kv_heads * group;
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t token = starts[seq] + first_row + m / group, h = head * group + m % group;
      const float inv = softmax.inverse_sum(m);
      const float* a = w.acc.data() + m * padded_dim;
      c10::BFloat16* o = out + (token * q_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<c10::BFloat16>(a[d] * inv);
    }
  }
};

constexpr long kArchGetXcompPerm = 0x1022;
constexpr int kXfeatureXtiledata = 18;

// Whether the kernel has granted this process the AMX tile state (amx.py asks for it before loading this library):
// without it the first tile instruction kills the process.
bool tiles_granted() {
  static const bool granted = [] {
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, kArchGetXcompPerm, &features) == 0 && (features >> kXfeatureXtiledata & 1);
  }();
  return amx::kEmulated || granted;
}

void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t first_seq, double scale,
             int64_t window, at::Tensor& out, const float* k_scale, const float* v_scale) {
  batchgen_prefill::check_prefill_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq,
                                         window, out);
  TORCH_CHECK(tiles_granted(), "paged_prefill_amx_: this process has no AMX tile state (arch_prctl)");
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3), group = q.size(1) / kv_heads;
  const int64_t padded_dim = (dim + kChunk - 1) / kChunk * kChunk;
  const bool int8 = k_scale != nullptr;
  const PrefillAmx p{q.data_ptr<c10::BFloat16>(), q.stride(0), q.stride(1),
                     int8 ? nullptr : static_cast<const uint16_t*>(k_cache.data_ptr()),
                     int8 ? nullptr : static_cast<const uint16_t*>(v_cache.data_ptr()),
                     int8 ? k_cache.const_data_ptr<int8_t>() : nullptr, int8 ? v_cache.const_data_ptr<int8_t>() : nullptr,
                     k_scale, v_scale, k_cache.size(1), kv_heads, dim, padded_dim, group,
                     block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                     query_start_loc.data_ptr<int32_t>(), block_tables.stride(0), static_cast<float>(scale), window,
                     out.data_ptr<c10::BFloat16>()};
  const std::vector<Item> items =
      batchgen_prefill::prefill_items(p.lens, p.starts, first_seq, seq_lens.size(0), kv_heads, window);
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(count, 1)));
  const int64_t rows = (kTileRows * group + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows;
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(rows, padded_dim);
    amx::configure();  // the tile configuration is per thread
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) batchgen_prefill::run_item(p, items[i], scratch);
    amx::release();
  }
}

void paged_prefill_amx_(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                        int64_t first_seq, double scale, int64_t window, at::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16,
              "paged_prefill_amx_: q and the caches must be bfloat16");
  prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale, window, out, nullptr,
          nullptr);
}

void paged_prefill_amx_int8_(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t first_seq,
                             double scale, int64_t window, at::Tensor out) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kChar &&
                  k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.is_contiguous() && v_scale.is_contiguous() &&
                  k_scale.numel() * k_cache.size(3) == k_cache.numel() && v_scale.numel() == k_scale.numel(),
              "paged_prefill_amx_int8_: a bfloat16 q, int8 caches and contiguous float32 scales [N, bs, Hkv]");
  prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale, window, out,
          k_scale.const_data_ptr<float>(), v_scale.const_data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("paged_prefill_amx_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int first_seq, float scale, int window, Tensor(a!) out) -> ()");
  m.def("paged_prefill_amx_int8_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int first_seq, float scale, int window, "
        "Tensor(a!) out) -> ()");
  m.def("amx_tiles_emulated() -> bool", [] { return amx::kEmulated; });  // which build this is (the tests ask)
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("paged_prefill_amx_", &paged_prefill_amx_);
  m.impl("paged_prefill_amx_int8_", &paged_prefill_amx_int8_);
}
