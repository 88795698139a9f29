// The paged decode over an int8 KV cache (engine.kv_cache_dtype: int8; the layout and the store that quantizes:
// kv_int8_store_cpu.cpp), reading the int8 rows in place, and the int8 entry of the prefill kernel.
// Decode: the structure of paged_decode_cpu.cpp (one item per (sequence, kv head), longest first; tiles of 16 keys;
// an online softmax for the `group` query heads of the kv head) with the dequantization folded into the arithmetic:
// a tile's 16 scores are multiplied by its 16 keys' scales once, and each value row's probability by its scale, so
// an int8 row is only widened (keys to int16 for vpdpwssd against an int16 query with AVX512_VNNI; values to fp32),
// never rescaled element by element. Half the bytes of a bf16 row are read. Head dims other than 16-256 in steps of
// 16 take a plain per-key loop.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec16.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTile = 16;
typedef int8_t Byte16 __attribute__((vector_size(16)));

inline Vec16 widen_int8(const int8_t* p) {  // 16 int8 values as fp32: vpmovsxbd, vcvtdq2ps
#ifdef __AVX512F__
  return (Vec16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  Byte16 raw;
  std::memcpy(&raw, p, sizeof raw);
  return __builtin_convertvector(raw, Vec16);
#endif
}

struct Decode {
  const char* q;
  int64_t q_stride0, q_stride1;
  at::ScalarType q_type;
  const int8_t *k, *v;
  const float *k_scale, *v_scale;
  int64_t block_size, kv_heads, dim, group;
  const int32_t *tables, *lens;
  int64_t table_stride;
  float scale;
  int64_t window;  // keys each query sees (itself included); <= 0: the whole context
  void* out;

  int64_t first_key(int64_t seq) const { return window > 0 ? std::max<int64_t>(lens[seq] - window, 0) : 0; }

  int64_t slot(int64_t seq, int64_t head, int64_t pos) const {  // (slot, head) index: scales; x dim: rows
    const int64_t block = tables[seq * table_stride + pos / block_size];
    return (block * block_size + pos % block_size) * kv_heads + head;
  }

  int64_t tile_len(int64_t start, int64_t len) const {
    return std::min({kTile, len - start, block_size - start % block_size});
  }

  float q_at(int64_t seq, int64_t h, int64_t d) const {
    const char* row = q + (seq * q_stride0 + h * q_stride1) * c10::elementSize(q_type);
    if (q_type == at::kFloat) return reinterpret_cast<const float*>(row)[d];
    if (q_type == at::kBFloat16) return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(row)[d]);
    return static_cast<float>(reinterpret_cast<const c10::Half*>(row)[d]);
  }

  void write_out(int64_t seq, int64_t h, const float* acc, float inv) const {
    const int64_t offset = (seq * kv_heads * group + h) * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const float x = acc[d] * inv;
      if (q_type == at::kFloat) static_cast<float*>(out)[offset + d] = x;
      else if (q_type == at::kBFloat16) static_cast<c10::BFloat16*>(out)[offset + d] = c10::BFloat16(x);
      else static_cast<c10::Half*>(out)[offset + d] = c10::Half(x);
    }
  }
};

struct Scratch {
  std::vector<float> q, acc, probs, run_max, run_sum, correction, q_scale;
  std::vector<int16_t> q16;  // the VNNI path's query rows, int16 with a scale each (q_scale)
  std::vector<Vec16> partial;
  Scratch(int64_t group, int64_t dim)
      : q(group * dim), acc(group * dim), probs(group * kTile), run_max(group), run_sum(group), correction(group),
        q_scale(group), q16(group * dim), partial(group * kTile) {}
};

// With AVX512_VNNI, keys are scored by vpdpwssd: the query rows as int16 (round(x * 32767 / absmax): 2^-15 of
// their largest value, far below the keys' int8 rounding), the keys widened to int16, exact int32 sums.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHaveVnni = true;
#else
constexpr bool kHaveVnni = false;
#endif

template <int C>
constexpr int kValueRows = C <= 4 ? 4 : (C <= 5 ? 3 : (C <= 8 ? 2 : 1));

// R rows' accumulators = acc * correction[r] + sum over the tile's n keys of w[r][t] x V row t (w: probability x
// the row's scale), each int8 row widened once for the R rows.
template <int R, int C>
__attribute__((noinline)) void accumulate_rows(float* acc, const float* w, const float* correction,
                                               const int8_t* const* rows, int64_t n) {
  constexpr int64_t dim = 16 * C;
  Vec16 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = load16(acc + r * dim + 16 * c) * correction[r];
  for (int64_t t = 0; t < n; ++t) {
    Vec16 v[C];
    for (int c = 0; c < C; ++c) {
      v[c] = widen_int8(rows[t] + 16 * c);
      keep_in_register(v[c]);
    }
    for (int r = 0; r < R; ++r) {
      const float x = w[r * kTile + t];
      for (int c = 0; c < C; ++c) sums[r][c] += x * v[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(acc + r * dim + 16 * c, sums[r][c]);
}

template <int C>
void attend(const Decode& d, int64_t seq, int64_t head, Scratch& s) {
  constexpr int64_t dim = 16 * C;
  constexpr bool kVnni = kHaveVnni && C % 2 == 0;
  const int64_t group = d.group, len = d.lens[seq];
  for (int64_t g = 0; g < group; ++g) {
    float absmax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) {
      s.q[g * dim + i] = d.q_at(seq, head * group + g, i) * d.scale;
      absmax = std::max(absmax, std::fabs(s.q[g * dim + i]));
    }
    const float inv = absmax > 0.0f ? 32767.0f / absmax : 0.0f;
    for (int64_t i = 0; i < dim; ++i) s.q16[g * dim + i] = static_cast<int16_t>(std::nearbyint(s.q[g * dim + i] * inv));
    s.q_scale[g] = kVnni ? absmax / 32767.0f : 1.0f;
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.0f);
  std::fill(s.run_max.begin(), s.run_max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.run_sum.begin(), s.run_sum.end(), 0.0f);
  const Vec16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Vec16 minus_inf = Vec16{} - std::numeric_limits<float>::infinity();
  const int8_t* k_rows[kTile];
  const int8_t* v_rows[kTile];
  float k_scales[kTile], v_scales[kTile], w[kTile * 16];  // w: [group <= 16][kTile]
  for (int64_t start = d.first_key(seq), n = 0; start < len; start += n) {
    n = d.tile_len(start, len);
    const int64_t first = d.slot(seq, head, start);  // a tile never crosses a block: its slots are consecutive
    for (int64_t t = 0; t < n; ++t) {
      const int64_t index = first + t * d.kv_heads;
      k_rows[t] = d.k + index * dim;
      v_rows[t] = d.v + index * dim;
      k_scales[t] = d.k_scale[index];
      v_scales[t] = d.v_scale[index];
    }
    if (start + n < len) {  // the next tile's rows, wherever its block lies
      const int64_t next = d.slot(seq, head, start + n);
      for (int64_t t = 0; t < d.tile_len(start + n, len); ++t) {
        __builtin_prefetch(d.k + (next + t * d.kv_heads) * dim, 0, 2);
        __builtin_prefetch(d.v + (next + t * d.kv_heads) * dim, 0, 2);
      }
    }
    for (int64_t t = 0; t < n && kVnni; ++t) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      __m512i k[C / 2];
      for (int c = 0; c < C / 2; ++c)
        k[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k_rows[t] + 32 * c)));
      for (int64_t g = 0; g < group; ++g) {
        __m512i sum = _mm512_setzero_si512();
        for (int c = 0; c < C / 2; ++c)
          sum = _mm512_dpwssd_epi32(sum, _mm512_loadu_si512(s.q16.data() + g * dim + 32 * c), k[c]);
        s.partial[g * kTile + t] = (Vec16)_mm512_cvtepi32_ps(sum);
      }
#endif
    }
    for (int64_t t = 0; t < n && !kVnni; ++t) {
      Vec16 k[C];
      for (int c = 0; c < C; ++c) k[c] = widen_int8(k_rows[t] + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = s.q.data() + g * dim;
        Vec16 sum = load16(q) * k[0];
        for (int c = 1; c < C; ++c) sum += load16(q + 16 * c) * k[c];
        s.partial[g * kTile + t] = sum;
      }
    }
    Vec16 k_scale = Vec16{}, v_scale = Vec16{};
    for (int64_t t = 0; t < n; ++t) k_scale[t] = k_scales[t], v_scale[t] = v_scales[t];
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t t = n; t < kTile; ++t) s.partial[g * kTile + t] = Vec16{};
      Vec16 x = sum_lanes_each(s.partial.data() + g * kTile) * (k_scale * s.q_scale[g]);
      if (n < kTile) x = lane < static_cast<float>(n) ? x : minus_inf;
      const float tile_max = std::max(s.run_max[g], max_lanes(x));
      Vec16 p = exp16(x - tile_max);
      if (n < kTile) p = lane < static_cast<float>(n) ? p : Vec16{};
      s.correction[g] = fast_exp(s.run_max[g] - tile_max);
      s.run_sum[g] = s.run_sum[g] * s.correction[g] + sum_lanes(p);
      s.run_max[g] = tile_max;
      store16(w + g * kTile, p * v_scale);
    }
    for (int64_t g = 0; g < group;) {
      const int64_t r = std::min<int64_t>(kValueRows<C>, group - g);
      float* acc = s.acc.data() + g * dim;
      const float* p = w + g * kTile;
      const float* correction = s.correction.data() + g;
      if (r == 4) accumulate_rows<std::min(4, kValueRows<C>), C>(acc, p, correction, v_rows, n);
      else if (r == 3) accumulate_rows<std::min(3, kValueRows<C>), C>(acc, p, correction, v_rows, n);
      else if (r == 2) accumulate_rows<std::min(2, kValueRows<C>), C>(acc, p, correction, v_rows, n);
      else accumulate_rows<1, C>(acc, p, correction, v_rows, n);
      g += r;
    }
  }
  for (int64_t g = 0; g < group; ++g)
    d.write_out(seq, head * group + g, s.acc.data() + g * dim, s.run_sum[g] > 0.0f ? 1.0f / s.run_sum[g] : 0.0f);
}

// Any head_dim (or a group above 16), one key at a time.
void attend_plain(const Decode& d, int64_t seq, int64_t head, Scratch& s) {
  const int64_t group = d.group, dim = d.dim, len = d.lens[seq];
  for (int64_t g = 0; g < group; ++g) {
    float* q = s.q.data() + g * dim;
    float* acc = s.acc.data() + g * dim;
    for (int64_t i = 0; i < dim; ++i) q[i] = d.q_at(seq, head * group + g, i) * d.scale, acc[i] = 0.0f;
    float run_max = -std::numeric_limits<float>::infinity(), run_sum = 0.0f;
    for (int64_t pos = d.first_key(seq); pos < len; ++pos) {
      const int64_t index = d.slot(seq, head, pos);
      const int8_t *k = d.k + index * dim, *v = d.v + index * dim;
      float score = 0.0f;
      for (int64_t i = 0; i < dim; ++i) score += q[i] * static_cast<float>(k[i]);
      score *= d.k_scale[index];
      const float high = std::max(run_max, score);
      const float correction = fast_exp(run_max - high), p = fast_exp(score - high);
      run_sum = run_sum * correction + p;
      run_max = high;
      const float weight = p * d.v_scale[index];
      for (int64_t i = 0; i < dim; ++i) acc[i] = acc[i] * correction + weight * static_cast<float>(v[i]);
    }
    d.write_out(seq, head * group + g, acc, run_sum > 0.0f ? 1.0f / run_sum : 0.0f);
  }
}

typedef void (*AttendFn)(const Decode&, int64_t, int64_t, Scratch&);

AttendFn choose(int64_t dim, int64_t group) {
  if (dim % 16 != 0 || group > 16) return &attend_plain;
  switch (dim / 16) {
    case 1: return &attend<1>;
    case 2: return &attend<2>;
    case 3: return &attend<3>;
    case 4: return &attend<4>;
    case 5: return &attend<5>;
    case 6: return &attend<6>;
    case 7: return &attend<7>;
    case 8: return &attend<8>;
    case 16: return &attend<16>;
    default: return &attend_plain;
  }
}

at::Tensor paged_decode_int8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode_int8: q must be [B, Hq, D], the caches [N, bs, Hkv, D]");
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_int8: the caches must be contiguous int8 tensors of one shape");
  TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.is_contiguous() && v_scale.is_contiguous() &&
                  k_scale.numel() * k_cache.size(3) == k_cache.numel() && v_scale.numel() == k_scale.numel(),
              "paged_decode_int8: the scales must be contiguous float32 [N, bs, Hkv]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode_int8: CPU tensors only");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "paged_decode_int8: q's heads and head_dim do not match the caches'");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode_int8: block_tables and seq_lens must be int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) && seq_lens.numel() == q.size(0),
              "paged_decode_int8: one block-table row and one seq_len per query row");
  const auto q_type = q.scalar_type();
  TORCH_CHECK(q_type == at::kFloat || q_type == at::kBFloat16 || q_type == at::kHalf,
              "paged_decode_int8: q must be float32, bfloat16 or float16");
  const at::Tensor q_rows = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(c10::MemoryFormat::Contiguous));
  const int64_t batch = q.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0), width = tables.size(1);
  const int32_t* table = tables.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const Decode d{static_cast<const char*>(q_rows.data_ptr()), q_rows.stride(0), q_rows.stride(1), q_type,
                 k_cache.const_data_ptr<int8_t>(), v_cache.const_data_ptr<int8_t>(), k_scale.const_data_ptr<float>(),
                 v_scale.const_data_ptr<float>(), block_size, kv_heads, dim, q.size(1) / kv_heads, table, len,
                 tables.stride(0), static_cast<float>(scale), window, out.data_ptr()};
  for (int64_t seq = 0; seq < batch; ++seq) {  // checked before the parallel region: an exception cannot leave one
    TORCH_CHECK(len[seq] >= 0 && len[seq] <= width * block_size, "paged_decode_int8: seq_lens[", seq, "] = ",
                len[seq], " does not fit the block table's ", width, " blocks of ", block_size);
    for (int64_t b = d.first_key(seq) / block_size; b < (len[seq] + block_size - 1) / block_size; ++b) {
      const int64_t block = table[seq * tables.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_int8: block id ", block, " out of range");
    }
  }
  std::vector<int64_t> items(batch * kv_heads);
  for (int64_t i = 0; i < batch * kv_heads; ++i) items[i] = i;
  const auto keys = [&](int64_t item) { return len[item / kv_heads] - d.first_key(item / kv_heads); };
  std::stable_sort(items.begin(), items.end(), [&](int64_t a, int64_t b) { return keys(a) > keys(b); });
  const AttendFn fn = choose(dim, d.group);
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

}  // namespace

void paged_prefill_int8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const float* ks,
                        const float* vs, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
                        int64_t first_seq, double scale, int64_t window, at::Tensor& out);  // paged_prefill_cpu.cpp

// The prefill kernel's int8 entry: every prefill row of a step, its rows dequantized as each item packs them.
void paged_prefill_int8_(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t first_seq,
                         double scale, int64_t window, at::Tensor out) {
  TORCH_CHECK(k_cache.scalar_type() == at::kChar && v_cache.scalar_type() == at::kChar &&
                  k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat &&
                  k_scale.is_contiguous() && v_scale.is_contiguous() &&
                  k_scale.numel() * k_cache.size(3) == k_cache.numel() && v_scale.numel() == k_scale.numel(),
              "paged_prefill_int8: int8 caches with contiguous float32 scales [N, bs, Hkv]");
  const auto q_type = q.scalar_type();
  TORCH_CHECK(q_type == at::kFloat || q_type == at::kBFloat16 || q_type == at::kHalf,
              "paged_prefill_int8: q must be float32, bfloat16 or float16");
  paged_prefill_int8(q, k_cache, v_cache, k_scale.const_data_ptr<float>(), v_scale.const_data_ptr<float>(),
                     block_tables, seq_lens, query_start_loc, first_seq, scale, window, out);
}

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("paged_decode_int8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window) -> Tensor");
  m.def("paged_prefill_int8_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, int first_seq, float scale, int window, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("paged_decode_int8", &paged_decode_int8);
  m.impl("paged_prefill_int8_", &paged_prefill_int8_);
}
