// Paged-attention decode on the CPU that reads each sequence's K/V in place, once.
//
// One work item per (sequence, kv head): walk the sequence's blocks through its block table, keep an online softmax
// (running max and sum, fp32 accumulators) for the `group` query heads that share the kv head, so each K and V row is
// loaded once and used by all of them. Only positions < seq_len are read: slots past a sequence's end may hold
// anything (NaN included). Registered as torch.ops.batchgen.paged_decode (its fake implementation is in Python).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fast_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 32;  // tokens scored together before one softmax update (fewer rescales of the accumulators)

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  // bf16 is the top half of an fp32: a shift, which vectorizes (the generic conversion may not).
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(raw[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

// Sixteen floats as one value (GCC/Clang vector extension): one zmm register with AVX-512, two ymm with AVX2.
typedef float Vec16 __attribute__((vector_size(64)));
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Halving the vector three times, then four scalars: a short tree rather than a chain of 15 dependent adds.
inline float sum_lanes(Vec16 v) {
  const Vec8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 quarter = __builtin_shufflevector(half, half, 0, 1, 2, 3) + __builtin_shufflevector(half, half, 4, 5, 6, 7);
  return (quarter[0] + quarter[2]) + (quarter[1] + quarter[3]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec16 even = {}, odd = {};  // two accumulators: half the dependent chain of fused multiply-adds
  int64_t d = 0;
  for (; d + 32 <= n; d += 32) {
    even += load16(a + d) * load16(b + d);
    odd += load16(a + d + 16) * load16(b + d + 16);
  }
  if (d + 16 <= n) {
    even += load16(a + d) * load16(b + d);
    d += 16;
  }
  float tail = 0.0f;
  for (; d < n; ++d) tail += a[d] * b[d];
  return sum_lanes(even + odd) + tail;
}

// acc[offset : offset + 16 * C] += sum over the tile's rows t of weights[t] * rows[t][same range], with the
// accumulator slice held in registers across the whole tile (rather than loaded and stored once per row).
template <int C>
inline void accumulate(float* acc, const float* weights, const float* const* rows, int64_t n, int64_t offset) {
  Vec16 sums[C];
  for (int c = 0; c < C; ++c) sums[c] = load16(acc + offset + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    const float w = weights[t];
    for (int c = 0; c < C; ++c) sums[c] += w * load16(rows[t] + offset + 16 * c);
  }
  for (int c = 0; c < C; ++c) std::memcpy(acc + offset + 16 * c, &sums[c], sizeof(Vec16));
}

// acc[0:dim] += sum over t < n of weights[t] * rows[t][0:dim]: four 16-float slices at a time, then single ones,
// then the scalar tail of a head_dim that is not a multiple of 16.
inline void accumulate_tile(float* acc, const float* weights, const float* const* rows, int64_t n, int64_t dim) {
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) accumulate<4>(acc, weights, rows, n, d);
  for (; d + 16 <= dim; d += 16) accumulate<1>(acc, weights, rows, n, d);
  for (; d < dim; ++d)
    for (int64_t t = 0; t < n; ++t) acc[d] += weights[t] * rows[t][d];
}

// Start loading a row of the next tile: the blocks of a sequence lie anywhere in the cache, so the hardware
// prefetchers cannot guess where the next one starts (measured: 2x on contexts far larger than the caches).
// One row requested per row computed spreads the requests out; into L2 (locality 2), a little faster than L1.
template <typename KV>
inline void prefetch_row(const KV* row, int64_t row_bytes) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(bytes + offset, 0, 2);
}

// q: [B, Hq, D] (any strides but the last); out: [B, Hq, D] contiguous; caches contiguous [N, bs, Hkv, D].
template <typename KV>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
            const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), q_heads = q.size(1), dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = q_heads / kv_heads;
  const int64_t table_width = block_tables.size(1), table_stride = block_tables.stride(0);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const KV* k_base = static_cast<const KV*>(k_cache.data_ptr());
  const KV* v_base = static_cast<const KV*>(v_cache.data_ptr());
  const int64_t row_stride = kv_heads * dim;  // between consecutive tokens of one block, for one head
  const at::ScalarType q_type = q.scalar_type();
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(KV));

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), kf(dim), vf(kTile * dim), scores(group * kTile),
        run_max(group), run_sum(group);
    const float* v_rows[kTile];  // the tile's V rows as fp32: in the cache itself, or converted into vf
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads;
      const int64_t len = lens[seq];
      TORCH_CHECK(len >= 0 && len <= table_width * block_size, "paged_decode: seq_lens[", seq, "] = ", len,
                  " does not fit the block table's ", table_width, " blocks of ", block_size);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = head * group + g;
        float* dst = qf.data() + g * dim;
        const void* src = static_cast<const char*>(q.data_ptr()) +
                          (seq * q.stride(0) + h * q.stride(1)) * q.element_size();
        if (q_type == at::kFloat) to_float(static_cast<const float*>(src), dst, dim);
        else if (q_type == at::kBFloat16) to_float(static_cast<const c10::BFloat16*>(src), dst, dim);
        else to_float(static_cast<const c10::Half*>(src), dst, dim);
        for (int64_t d = 0; d < dim; ++d) dst[d] *= static_cast<float>(scale);
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.0f);

      for (int64_t start = 0, n = 0; start < len; start += n) {
        n = std::min({kTile, len - start, block_size - start % block_size});  // a tile never crosses a block
        const int64_t block = tables[seq * table_stride + start / block_size];
        TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode: block id ", block, " out of range");
        const int64_t first = (block * block_size + start % block_size) * row_stride + head * dim;
        const int64_t next = start + n;
        const int64_t next_n = next < len ? std::min({kTile, len - next, block_size - next % block_size}) : 0;
        const int64_t next_first =
            next_n ? (tables[seq * table_stride + next / block_size] * block_size + next % block_size) * row_stride +
                         head * dim
                   : 0;
        for (int64_t t = 0; t < n; ++t) {
          if (t < next_n) prefetch_row(k_base + next_first + t * row_stride, row_bytes);
          const float* k_row;
          if constexpr (std::is_same_v<KV, float>) {
            k_row = k_base + first + t * row_stride;
          } else {
            to_float(k_base + first + t * row_stride, kf.data(), dim);
            k_row = kf.data();
          }
          for (int64_t g = 0; g < group; ++g) scores[g * kTile + t] = dot(qf.data() + g * dim, k_row, dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * kTile;
          float tile_max = run_max[g];
          for (int64_t t = 0; t < n; ++t) tile_max = std::max(tile_max, s[t]);
          const float correction = fast_exp(run_max[g] - tile_max);
          for (int64_t t = 0; t < n; ++t) s[t] = fast_exp(s[t] - tile_max);
          float sum = 0.0f;
          for (int64_t t = 0; t < n; ++t) sum += s[t];
          run_sum[g] = run_sum[g] * correction + sum;
          run_max[g] = tile_max;
          if (correction != 1.0f)
            for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] *= correction;
        }
        for (int64_t t = 0; t < n; ++t) {
          if (t < next_n) prefetch_row(v_base + next_first + t * row_stride, row_bytes);
          if constexpr (std::is_same_v<KV, float>) {
            v_rows[t] = v_base + first + t * row_stride;
          } else {
            to_float(v_base + first + t * row_stride, vf.data() + t * dim, dim);
            v_rows[t] = vf.data() + t * dim;
          }
        }
        for (int64_t g = 0; g < group; ++g)
          accumulate_tile(acc.data() + g * dim, scores.data() + g * kTile, v_rows, n, dim);
      }

      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = head * group + g;
        const float inv = run_sum[g] > 0.0f ? 1.0f / run_sum[g] : 0.0f;  // an empty context gives zeros
        const float* a = acc.data() + g * dim;
        const int64_t offset = (seq * q_heads + h) * dim;
        if (q_type == at::kFloat) {
          float* o = out.data_ptr<float>() + offset;
          for (int64_t d = 0; d < dim; ++d) o[d] = a[d] * inv;
        } else if (q_type == at::kBFloat16) {
          c10::BFloat16* o = out.data_ptr<c10::BFloat16>() + offset;
          for (int64_t d = 0; d < dim; ++d) o[d] = c10::BFloat16(a[d] * inv);
        } else {
          c10::Half* o = out.data_ptr<c10::Half>() + offset;
          for (int64_t d = 0; d < dim; ++d) o[d] = c10::Half(a[d] * inv);
        }
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q must be [B, Hq, D] and the caches [N, bs, Hkv, D]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode: k_cache and v_cache differ");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: the caches must be contiguous");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode: q's heads and head_dim do not match the caches'");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "paged_decode: one block-table row and one seq_len per query row");
  const auto q_type = q.scalar_type();
  TORCH_CHECK(q_type == at::kFloat || q_type == at::kBFloat16 || q_type == at::kHalf,
              "paged_decode: q must be float32, bfloat16 or float16");
  const at::Tensor q_rows = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(c10::MemoryFormat::Contiguous));
  switch (k_cache.scalar_type()) {
    case at::kFloat: decode<float>(q_rows, k_cache, v_cache, tables, lens, scale, out); break;
    case at::kBFloat16: decode<c10::BFloat16>(q_rows, k_cache, v_cache, tables, lens, scale, out); break;
    case at::kHalf: decode<c10::Half>(q_rows, k_cache, v_cache, tables, lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode: the caches must be float32, bfloat16 or float16");
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
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale)"
        " -> Tensor");
  m.def("wide_vectors() -> bool", &wide_vectors);
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("paged_decode", &paged_decode); }
