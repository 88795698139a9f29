// What the two prefill kernels share: paged_prefill_cpu.cpp (fp32 products, or AVX512_BF16 dot products) and
// amx/paged_prefill_amx.cpp (bf16 AMX tiles, built into its own library). Both check the same inputs, split a step
// into the same work items, and run the same online softmax over each tile of kTileKeys scores per row in fp32.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "vec16.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace batchgen_prefill {

constexpr int64_t kTileRows = 32;  // query positions attended together
constexpr int64_t kTileKeys = 64;  // keys per tile: kTileKeys / 16 vectors of scores per query row

// The first position the query at `pos` sees: the start of its window (window > 0), else 0.
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0;
}

struct Item {
  int32_t seq, head;
  int32_t row_begin, row_end;  // the item's query rows, counted within the sequence's new tokens
  int64_t cost;                // score elements it computes (to hand out the longest first)
};

// One item per (sequence, kv head), its query tiles split into up to `parts` items when there are too few to keep
// every thread busy (one long prompt): each part packs the keys up to its own last row. Longest first.
inline std::vector<Item> prefill_items(const int32_t* lens, const int32_t* starts, int64_t first_seq, int64_t num_seqs,
                                       int64_t kv_heads, int64_t window) {
  const int64_t threads_wanted = at::get_num_threads();
  const int64_t pairs = std::max<int64_t>((num_seqs - first_seq) * kv_heads, 1);
  const int64_t parts = std::max<int64_t>(1, (4 * threads_wanted + pairs - 1) / pairs);
  std::vector<Item> items;
  for (int64_t seq = first_seq; seq < num_seqs; ++seq) {
    const int64_t q_len = starts[seq + 1] - starts[seq], len = lens[seq];
    const int64_t tiles = (q_len + kTileRows - 1) / kTileRows;
    const int64_t split = std::max<int64_t>(1, std::min(parts, tiles)), per_part = (tiles + split - 1) / split;
    for (int64_t tile = 0; tile < tiles; tile += per_part) {
      const int64_t row_begin = tile * kTileRows, row_end = std::min(q_len, (tile + per_part) * kTileRows);
      const int64_t prefix = len - q_len, keys = prefix + (row_begin + row_end) / 2;
      const int64_t cost = (row_end - row_begin) * (window > 0 ? std::min(keys, window) : keys);
      for (int64_t head = 0; head < kv_heads; ++head)
        items.push_back({static_cast<int32_t>(seq), static_cast<int32_t>(head), static_cast<int32_t>(row_begin),
                         static_cast<int32_t>(row_end), cost});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

// One work item of a kernel (its lens, starts, window, pack() and attend()): pack the keys its rows can see, from its
// first row's window start to its last row, then attend its query tiles of kTileRows positions. The packed keys start
// at a multiple of kTileKeys (zeros before the window start, which may lie in a block already freed): a row's key
// tiles are then the same whichever item holds it, so its sums run in the same order however its prompt was chunked
// or split into items (batch_invariant relies on it; a tile wholly before a row's window leaves its softmax as it was).
template <typename Kernel, typename Scratch>
void run_item(const Kernel& kernel, const Item& item, Scratch& w) {
  const int64_t seq = item.seq, head = item.head;
  const int64_t q_len = kernel.starts[seq + 1] - kernel.starts[seq], prefix = kernel.lens[seq] - q_len;
  const int64_t first = window_start(prefix + item.row_begin, kernel.window), base = first / kTileKeys * kTileKeys;
  kernel.pack(seq, head, base, first, prefix + item.row_end, w);
  for (int64_t row = item.row_begin; row < item.row_end; row += kTileRows) kernel.attend(seq, head, row, base, w);
}

// Everything a prefill kernel will read is checked here, before the parallel region (an exception cannot leave one).
inline void check_prefill_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                 const at::Tensor& query_start_loc, int64_t first_seq, int64_t window,
                                 const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_prefill: q must be [T, Hq, D] and the caches [N, bs, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_prefill: k_cache and v_cache differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_prefill: the caches must be contiguous");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_prefill: CPU tensors only");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_prefill: q's heads and head_dim do not match the caches'");
  TORCH_CHECK(q.stride(2) == 1, "paged_prefill: q's last dimension must be contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "paged_prefill: out must be a contiguous tensor of q's shape and dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "paged_prefill: block_tables, seq_lens and query_start_loc must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && seq_lens.is_contiguous() &&
                  query_start_loc.is_contiguous(),
              "paged_prefill: block_tables rows, seq_lens and query_start_loc must be contiguous");
  const int64_t num_seqs = seq_lens.numel();
  TORCH_CHECK(block_tables.size(0) == num_seqs && query_start_loc.numel() == num_seqs + 1,
              "paged_prefill: one block-table row and one seq_len per sequence, num_seqs + 1 query starts");
  TORCH_CHECK(first_seq >= 0 && first_seq <= num_seqs, "paged_prefill: first_seq out of range");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0), width = block_tables.size(1);
  for (int64_t seq = first_seq; seq < num_seqs; ++seq) {
    const int64_t q_len = starts[seq + 1] - starts[seq], len = lens[seq];
    TORCH_CHECK(q_len >= 0 && starts[seq] >= 0 && starts[seq + 1] <= q.size(0),
                "paged_prefill: query rows of sequence ", seq, " fall outside q");
    TORCH_CHECK(q_len <= len && len <= width * block_size, "paged_prefill: sequence ", seq, " has ", q_len,
                " new tokens and a context of ", len, " (block table: ", width, " blocks of ", block_size, ")");
    for (int64_t b = window_start(len - q_len, window) / block_size; b < (len + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[seq * block_tables.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill: block id ", block, " out of range");
    }
  }
}

// The running state of a query tile's online softmax, `rows` rows: the maxima and per-lane sums so far (run_sum: 16
// lanes per row, added up once at the end) and each row's output accumulator (acc_stride floats apart). tile_max
// and correction are scratch padded to a multiple of 16 rows (vector exp).
struct Softmax {
  float *run_max, *run_sum, *tile_max, *correction, *acc;
  int64_t rows, acc_stride;

  // Before the first key tile. run_max starts at lowest, not -inf: a row may see no key of a tile (one before its
  // window), and then its correction exp(max - max) must be 1, not NaN. The first tile a row sees still scales its
  // zeros by exp16's floor, as from -inf.
  void reset() const {
    std::fill(acc, acc + rows * acc_stride, 0.0f);
    std::fill(run_max, run_max + rows, std::numeric_limits<float>::lowest());
    std::fill(run_sum, run_sum + rows * 16, 0.0f);
  }

  // One key tile: s holds each row's n <= kTileKeys raw scores (kTileKeys apart), multiplied by `scale` here. Row m,
  // the query at tile-relative position pos(m) = pos0 + m / group, sees keys [pos - window + 1, pos] of the tile (all
  // up to pos without a window); the others become probability 0. On return s holds the probabilities exp(score -
  // max), run_max/run_sum are updated and each row's acc is rescaled to the new maximum.
  void tile(float* s, int64_t n, int64_t pos0, int64_t group, int64_t window, float scale) const {
    const Vec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const Vec16 minus_inf = Vec16{} - std::numeric_limits<float>::infinity();
    constexpr int kVecs = kTileKeys / 16;
    const auto bounds = [&](int64_t m, float& hidden, float& visible) {  // row m sees keys [hidden, visible)
      const int64_t pos = pos0 + m / group;
      visible = static_cast<float>(std::clamp<int64_t>(pos + 1, 0, n));
      hidden = window > 0 ? static_cast<float>(std::clamp<int64_t>(pos - window + 1, 0, n)) : 0.0f;
    };
    // Each row's new maximum first, then all rows' correction factors 16 at a time (one vector exp rather than a
    // scalar one per row), then the probabilities.
    for (int64_t m = 0; m < rows; ++m) {
      float* row = s + m * kTileKeys;
      float hidden, visible;
      bounds(m, hidden, visible);
      Vec16 high = minus_inf;
      for (int c = 0; c < kVecs; ++c) {
        const Vec16 key = lane + 16.0f * c;
        const Vec16 x = (key < visible) & (key >= hidden) ? load16(row + 16 * c) * scale : minus_inf;
        store16(row + 16 * c, x);
        high = high > x ? high : x;
      }
      tile_max[m] = std::max(run_max[m], max_lanes(high));  // run_max itself where no key is visible
    }
    for (int64_t m = 0; m < rows; m += 16)
      store16(correction + m, exp16(load16(run_max + m) - load16(tile_max + m)));
    for (int64_t m = 0; m < rows; ++m) {
      float* row = s + m * kTileKeys;
      float hidden, visible;
      bounds(m, hidden, visible);
      const float row_max = tile_max[m], factor = correction[m];
      Vec16 total = {};
      for (int c = 0; c < kVecs; ++c) {
        const Vec16 key = lane + 16.0f * c;
        const Vec16 p = (key < visible) & (key >= hidden) ? exp16(load16(row + 16 * c) - row_max) : Vec16{};
        store16(row + 16 * c, p);
        total += p;
      }
      store16(run_sum + m * 16, load16(run_sum + m * 16) * factor + total);
      run_max[m] = row_max;
      if (factor != 1.0f) {
        float* a = acc + m * acc_stride;
        for (int64_t d = 0; d < acc_stride; ++d) a[d] *= factor;
      }
    }
  }

  // 1 / row m's sum of probabilities (>= 1: each row sees itself).
  float inverse_sum(int64_t m) const { return 1.0f / sum_lanes(load16(run_sum + m * 16)); }
};

// A thread's Softmax state for up to `rows` rows.
struct SoftmaxBuffers {
  std::vector<float> run_max, run_sum, tile_max, correction;
  explicit SoftmaxBuffers(int64_t rows)
      : run_max((rows + 15) / 16 * 16), run_sum(rows * 16), tile_max(run_max.size()), correction(run_max.size()) {}
  Softmax over(float* acc, int64_t rows, int64_t acc_stride) {
    return {run_max.data(), run_sum.data(), tile_max.data(), correction.data(), acc, rows, acc_stride};
  }
};

// The packed keys [first, end) (counted from `base`, the item's first packed position) that some row of a query tile
// sees: its `positions` queries start at absolute position first_pos; `first` is the packed key tile holding the
// first row's window start, below which nothing is read.
struct KeyRange {
  int64_t first, end;
};
inline KeyRange visible_keys(int64_t first_pos, int64_t positions, int64_t base, int64_t window) {
  return {(window_start(first_pos, window) - base) / kTileKeys * kTileKeys, first_pos + positions - base};
}

}  // namespace batchgen_prefill
