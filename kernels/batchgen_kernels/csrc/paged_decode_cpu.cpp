// Paged-attention decode on the CPU that reads each sequence's K/V in place, once.
//
// One work item per (sequence, kv head), handed out to the threads longest first: walk the sequence's blocks
// through its block table 16 keys at a time (a tile never crosses a block), keeping an online softmax (running max
// and sum, fp32) for the `group` query heads that share the kv head, so each K and V row is loaded once and used by
// all of them. A tile's 16 scores per query head come out as one vector: each key's products with the query are
// summed into a vector of partial sums, and the tile's 16 such vectors are reduced together by a transposing tree
// (vec16.h) rather than by one horizontal sum per key. With a bf16 cache and query on a CPU with AVX512_BF16, the
// products are bf16 dot products (vdpbf16ps: exact products, fp32 sums); V rows are widened to fp32 by a shift.
// Only positions < seq_len are read: slots past a sequence's end may hold anything (NaN included). With a sliding
// window (window > 0) the walk starts at the window's first key, seq_len - window: nothing before it is read.
// Head dims other than 16-128 in steps of 16 and 256, and fp16 caches, take a plain per-key loop instead.
// Registered as torch.ops.batchgen.paged_decode (its fake implementation is in Python).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "as_float.h"
#include "vec16.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 16;  // keys per tile: one vector of scores per query head

// Start loading a row of the next tile: the blocks of a sequence lie anywhere in the cache, so the hardware
// prefetchers cannot guess where the next one starts (measured: 2x on contexts far larger than the caches; still
// ~10% where the blocks are consecutive). One row requested per row computed spreads the requests out; into L2.
template <int64_t kBytes>
inline void prefetch_lines(const void* row) {
  const char* bytes = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < kBytes; offset += 64) __builtin_prefetch(bytes + offset, 0, 2);
}

// The call's inputs, shared by every work item. q: [B, Hq, D] (any strides but the last); out: [B, Hq, D]
// contiguous, q's dtype; caches [N, bs, Hkv, D] with any strides but the last (both caches the same ones): the
// engine's are contiguous; a head-major one ([N, Hkv, bs, D] in memory, viewed transposed) measured no faster
// (docs/performance.md, "Change 9").
struct Decode {
  const char* q;
  int64_t q_stride0, q_stride1;  // in elements
  at::ScalarType q_type;
  const void *k_base, *v_base;
  int64_t block_size, kv_heads, dim, group;
  int64_t block_stride, slot_stride, head_stride;  // the caches' strides, in elements
  const int32_t *tables, *lens;
  int64_t table_stride;
  float scale;
  int64_t window;  // keys each query sees (itself included); <= 0: the whole context
  void* out;

  // The first key sequence `seq` sees: tiles start there, so the keys before it are never read.
  int64_t first_key(int64_t seq) const { return window > 0 ? std::max<int64_t>(lens[seq] - window, 0) : 0; }

  int64_t row(int64_t seq, int64_t head, int64_t pos) const {  // element offset of (pos, head) in either cache
    const int64_t block = tables[seq * table_stride + pos / block_size];
    return block * block_stride + (pos % block_size) * slot_stride + head * head_stride;
  }

  // Keys of a tile starting at `start`: up to kTile, never past the context or the block's end.
  int64_t tile_len(int64_t start, int64_t len) const {
    return std::min({kTile, len - start, block_size - start % block_size});
  }

  const void* q_row(int64_t seq, int64_t h) const {
    return q + (seq * q_stride0 + h * q_stride1) * c10::elementSize(q_type);
  }

  float q_at(const void* row, int64_t d) const {
    if (q_type == at::kFloat) return static_cast<const float*>(row)[d];
    if (q_type == at::kBFloat16) return as_float(static_cast<const c10::BFloat16*>(row)[d]);
    return as_float(static_cast<const c10::Half*>(row)[d]);
  }

  void write_out(int64_t seq, int64_t h, const float* acc, float inv) const {
    const int64_t offset = (seq * kv_heads * group + h) * dim;
    if (q_type == at::kFloat) {
      float* o = static_cast<float*>(out) + offset;
      for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] * inv;
    } else if (q_type == at::kBFloat16) {
      c10::BFloat16* o = static_cast<c10::BFloat16*>(out) + offset;
      for (int64_t d = 0; d < dim; ++d) o[d] = c10::BFloat16(acc[d] * inv);
    } else {
      c10::Half* o = static_cast<c10::Half*>(out) + offset;
      for (int64_t d = 0; d < dim; ++d) o[d] = c10::Half(acc[d] * inv);
    }
  }
};

struct Scratch {  // one per thread, for the item it is on; a row per query head of the kv head
  std::vector<float> q, acc, probs, k, run_max, run_sum, correction;
  std::vector<uint16_t> q_bf16;
  std::vector<Vec16> partial;  // [group][kTile]: each key's products with a query head, not yet summed
  Scratch(int64_t group, int64_t dim)
      : q(group * dim), acc(group * dim), probs(group * kTile), k(dim), run_max(group), run_sum(group),
        correction(group), q_bf16(group * dim), partial(group * kTile) {}
};

// Query rows per value micro-kernel call: R x C accumulators and C value vectors within the 32 registers.
template <int C>
constexpr int kValueRows = C <= 4 ? 4 : (C <= 5 ? 3 : (C <= 8 ? 2 : 1));

// Floats 16 c .. 16 c + 15 of a K or V row, as fp32.
template <typename KV, int C>
inline Vec16 row_chunk(const KV* row, int c) {
  if constexpr (std::is_same_v<KV, float>) return load16(row + 16 * c);
  else return widen_bf16(row + 16 * c);
}

// R query rows' accumulators (acc[r][0:16 C], rows dim apart) = acc * correction[r] + sum over the tile's n keys of
// p[r][t] x V row t (values + t * row_stride; bf16 widened as loaded), held in registers for the whole tile.
// Kept out of line: inlined into the item loop it shares that loop's registers and spills.
template <typename KV, int R, int C>
__attribute__((noinline)) void accumulate_rows(float* acc, const float* p, const float* correction, const KV* values,
                                               int64_t row_stride, int64_t n) {
  constexpr int64_t dim = 16 * C;
  Vec16 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = load16(acc + r * dim + 16 * c) * correction[r];
  for (int64_t t = 0; t < n; ++t) {
    const KV* row = values + t * row_stride;
    Vec16 v[C];
    for (int c = 0; c < C; ++c) {
      v[c] = row_chunk<KV, C>(row, c);
      keep_in_register(v[c]);  // loaded once for the R rows, not folded into each of their multiply-adds
    }
    for (int r = 0; r < R; ++r) {
      const float w = p[r * kTile + t];
      for (int c = 0; c < C; ++c) sums[r][c] += w * v[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(acc + r * dim + 16 * c, sums[r][c]);
}

// The vector path for a head_dim of 16 C: kv head `head` of sequence `seq`, query row g = its g-th query head.
// kDot: bf16 query and cache multiplied by vdpbf16ps; otherwise keys are read (fp32 cache) or widened (bf16 cache)
// as fp32 and multiplied by the query in fp32, pre-scaled.
template <typename KV, int C, bool kDot>
void attend(const Decode& d, int64_t seq, int64_t head, Scratch& s) {
  constexpr int64_t dim = 16 * C;
  constexpr int64_t row_bytes = dim * static_cast<int64_t>(sizeof(KV));
  const int64_t group = d.group, len = d.lens[seq], row_stride = d.slot_stride;
  const KV* k_base = static_cast<const KV*>(d.k_base);
  const KV* v_base = static_cast<const KV*>(d.v_base);
  for (int64_t g = 0; g < group; ++g) {
    const void* src = d.q_row(seq, head * group + g);
    if constexpr (kDot) std::memcpy(s.q_bf16.data() + g * dim, src, dim * sizeof(uint16_t));
    else
      for (int64_t i = 0; i < dim; ++i) s.q[g * dim + i] = d.q_at(src, i) * d.scale;
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.run_max.begin(), s.run_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.run_sum.begin(), s.run_sum.end(), 0.0f);
  const Vec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Vec16 minus_inf = Vec16{} - std::numeric_limits<float>::infinity();

  const int64_t begin = d.first_key(seq);
  int64_t first = len ? d.row(seq, head, begin) : 0;
  for (int64_t start = begin, n = 0; start < len; start += n) {
    n = d.tile_len(start, len);
    const int64_t next = start + n, next_n = next < len ? d.tile_len(next, len) : 0;
    const int64_t next_first = next_n ? d.row(seq, head, next) : 0;

    // Scores: partial[g][t] = the products of query head g with key t, as 16 lanes still to be summed.
    for (int64_t t = 0; t < n; ++t) {
      if (t < next_n) prefetch_lines<row_bytes>(k_base + next_first + t * row_stride);
      const KV* key = k_base + first + t * row_stride;
#if defined(__AVX512BF16__)
      if constexpr (kDot) {
        __m512i k[C / 2];
        for (int c = 0; c < C / 2; ++c) k[c] = _mm512_loadu_si512(key + 32 * c);
        for (int64_t g = 0; g < group; ++g) {
          const uint16_t* q = s.q_bf16.data() + g * dim;
          __m512 sum = _mm512_setzero_ps();
          for (int c = 0; c < C / 2; ++c)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + 32 * c), (__m512bh)k[c]);
          s.partial[g * kTile + t] = (Vec16)sum;
        }
      }
#endif
      if constexpr (!kDot) {
        Vec16 k[C];
        for (int c = 0; c < C; ++c) k[c] = row_chunk<KV, C>(key, c);
        for (int64_t g = 0; g < group; ++g) {
          const float* q = s.q.data() + g * dim;
          Vec16 sum = load16(q) * k[0];
          for (int c = 1; c < C; ++c) sum += load16(q + 16 * c) * k[c];
          s.partial[g * kTile + t] = sum;
        }
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t t = n; t < kTile; ++t) s.partial[g * kTile + t] = Vec16{};

    // Online softmax over the tile, per query head.
    for (int64_t g = 0; g < group; ++g) {
      Vec16 x = sum_lanes_each(s.partial.data() + g * kTile);
      if constexpr (kDot) x *= d.scale;
      if (n < kTile) x = lane < static_cast<float>(n) ? x : minus_inf;
      const float tile_max = std::max(s.run_max[g], max_lanes(x));
      Vec16 p = exp16(x - tile_max);
      if (n < kTile) p = lane < static_cast<float>(n) ? p : Vec16{};
      s.correction[g] = fast_exp(s.run_max[g] - tile_max);
      s.run_sum[g] = s.run_sum[g] * s.correction[g] + sum_lanes(p);
      s.run_max[g] = tile_max;
      store16(s.probs.data() + g * kTile, p);
    }

    // Values: acc[g] = acc[g] * correction[g] + sum over t of p[g][t] v[t], a few query heads at a time.
    for (int64_t t = 0; t < std::min(n, next_n); ++t) prefetch_lines<row_bytes>(v_base + next_first + t * row_stride);
    for (int64_t g = 0; g < group;) {
      const int64_t r = std::min<int64_t>(kValueRows<C>, group - g);
      float* acc = s.acc.data() + g * dim;
      const float* p = s.probs.data() + g * kTile;
      const float* correction = s.correction.data() + g;
      const KV* values = v_base + first;
      if (r == 4) accumulate_rows<KV, std::min(4, kValueRows<C>), C>(acc, p, correction, values, row_stride, n);
      else if (r == 3) accumulate_rows<KV, std::min(3, kValueRows<C>), C>(acc, p, correction, values, row_stride, n);
      else if (r == 2) accumulate_rows<KV, std::min(2, kValueRows<C>), C>(acc, p, correction, values, row_stride, n);
      else accumulate_rows<KV, 1, C>(acc, p, correction, values, row_stride, n);
      g += r;
    }
    first = next_first;
  }

  for (int64_t g = 0; g < group; ++g) {
    const float inv = s.run_sum[g] > 0.0f ? 1.0f / s.run_sum[g] : 0.0f;  // an empty context gives zeros
    d.write_out(seq, head * group + g, s.acc.data() + g * dim, inv);
  }
}

// Any head_dim and cache dtype, one key at a time: scores by per-key dot products, rows converted one by one.
template <typename KV>
void attend_plain(const Decode& d, int64_t seq, int64_t head, Scratch& s) {
  const int64_t group = d.group, dim = d.dim, len = d.lens[seq];
  const KV* k_base = static_cast<const KV*>(d.k_base);
  const KV* v_base = static_cast<const KV*>(d.v_base);
  float* k = s.k.data();
  for (int64_t g = 0; g < group; ++g) {
    const void* src = d.q_row(seq, head * group + g);
    for (int64_t i = 0; i < dim; ++i) s.q[g * dim + i] = d.q_at(src, i) * d.scale;
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    float run_max = -std::numeric_limits<float>::infinity(), run_sum = 0.0f;
    float* acc = s.acc.data() + g * dim;
    const float* q = s.q.data() + g * dim;
    for (int64_t pos = d.first_key(seq); pos < len; ++pos) {
      const int64_t row = d.row(seq, head, pos);
      for (int64_t i = 0; i < dim; ++i) k[i] = as_float(k_base[row + i]);
      float score = 0.0f;
      for (int64_t i = 0; i < dim; ++i) score += q[i] * k[i];
      const float high = std::max(run_max, score);
      const float correction = fast_exp(run_max - high), p = fast_exp(score - high);
      run_sum = run_sum * correction + p;
      run_max = high;
      for (int64_t i = 0; i < dim; ++i) acc[i] = acc[i] * correction + p * as_float(v_base[row + i]);
    }
    d.write_out(seq, head * group + g, acc, run_sum > 0.0f ? 1.0f / run_sum : 0.0f);
  }
}

typedef void (*AttendFn)(const Decode&, int64_t seq, int64_t head, Scratch&);

template <typename KV, bool kDot>
AttendFn vector_path(int64_t chunks) {
  switch (chunks) {
    case 1: return kDot ? nullptr : &attend<KV, 1, false>;
    case 2: return &attend<KV, 2, kDot>;
    case 3: return kDot ? nullptr : &attend<KV, 3, false>;
    case 4: return &attend<KV, 4, kDot>;
    case 5: return kDot ? nullptr : &attend<KV, 5, false>;
    case 6: return &attend<KV, 6, kDot>;
    case 7: return kDot ? nullptr : &attend<KV, 7, false>;
    case 8: return &attend<KV, 8, kDot>;
    case 16: return &attend<KV, 16, kDot>;
    default: return nullptr;
  }
}

AttendFn choose(at::ScalarType kv_type, at::ScalarType q_type, int64_t dim) {
  const int64_t chunks = dim % 16 == 0 ? dim / 16 : 0;
  AttendFn fn = nullptr;
  if (kv_type == at::kFloat) fn = vector_path<float, false>(chunks);
#if defined(__AVX512BF16__)
  if (kv_type == at::kBFloat16 && q_type == at::kBFloat16) fn = vector_path<c10::BFloat16, true>(chunks);
#endif
  if (kv_type == at::kBFloat16 && !fn) fn = vector_path<c10::BFloat16, false>(chunks);
  if (fn) return fn;
  if (kv_type == at::kFloat) return &attend_plain<float>;
  if (kv_type == at::kBFloat16) return &attend_plain<c10::BFloat16>;
  return &attend_plain<c10::Half>;
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q must be [B, Hq, D] and the caches [N, bs, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode: k_cache and v_cache differ");
  TORCH_CHECK(k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1,
              "paged_decode: the caches must share strides, with head_dim contiguous");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode: q's heads and head_dim do not match the caches'");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "paged_decode: one block-table row and one seq_len per query row");
  const auto q_type = q.scalar_type(), kv_type = k_cache.scalar_type();
  TORCH_CHECK(q_type == at::kFloat || q_type == at::kBFloat16 || q_type == at::kHalf,
              "paged_decode: q must be float32, bfloat16 or float16");
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf,
              "paged_decode: the caches must be float32, bfloat16 or float16");
  const at::Tensor q_rows = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(c10::MemoryFormat::Contiguous));

  const int64_t batch = q.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0), width = tables.size(1);
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const Decode d{static_cast<const char*>(q_rows.data_ptr()), q_rows.stride(0), q_rows.stride(1), q_type,
                 k_cache.data_ptr(), v_cache.data_ptr(), block_size, kv_heads, dim, q.size(1) / kv_heads,
                 k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), table, len, tables.stride(0),
                 static_cast<float>(scale), window, out.data_ptr()};
  // Everything the items will read is checked here, before the parallel region (an exception cannot leave one).
  for (int64_t seq = 0; seq < batch; ++seq) {
    TORCH_CHECK(len[seq] >= 0 && len[seq] <= width * block_size, "paged_decode: seq_lens[", seq, "] = ", len[seq],
                " does not fit the block table's ", width, " blocks of ", block_size);
    for (int64_t b = d.first_key(seq) / block_size; b < (len[seq] + block_size - 1) / block_size; ++b) {
      const int64_t block = table[seq * tables.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode: block id ", block, " out of range");
    }
  }
  // One item per (sequence, kv head), the most keys first: the dynamic schedule then ends on short items.
  std::vector<int64_t> items(batch * kv_heads);
  for (int64_t i = 0; i < batch * kv_heads; ++i) items[i] = i;
  const auto keys = [&](int64_t item) { return len[item / kv_heads] - d.first_key(item / kv_heads); };
  std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) { return keys(a) > keys(b); });

  const AttendFn fn = choose(kv_type, q_type, dim);
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(count, 1)));
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(d.group, dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) fn(d, items[i] / kv_heads, items[i] % kv_heads, scratch);
  }
  return out;
}

// Whether this build has 16-float vector registers (AVX-512). The kernels' 16-lane vector code is written for them;
// built for AVX2, the compiler splits and spills it and the attention kernels run several times slower than torch's.
bool wide_vectors() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

}  // namespace

// A fragment, not TORCH_LIBRARY: other batchgen ops may define themselves in the same namespace.
TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, "
        "int window) -> Tensor");
  m.def("wide_vectors() -> bool", &wide_vectors);
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("paged_decode", &paged_decode); }
