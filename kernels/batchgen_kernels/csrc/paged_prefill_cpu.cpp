// Paged-attention prefill on the CPU: every prefill (or prefill chunk) of a step in one call, reading K/V in place
// through the block tables, so a prompt that follows a cached prefix attends to it without a gather copy or a mask.
//
// One work item per (sequence, kv head), or per part of its query rows when there are too few items to keep every
// thread busy: it packs the keys its rows can see (0 .. its last position) once, as fp32 — K transposed in tiles of
// kKeys so that one vector holds 16 keys' scores, V as rows — then takes its queries kRows positions at a time, the
// `group` query heads of the kv head together (each packed K/V tile serves kRows x group rows), flash-attention
// style: scores for a tile by broadcast-multiply-adds over head_dim (as in a GEMM micro-kernel), a causal bound per
// row (query j of a sequence of `len` tokens with `q_len` new ones sits at len - q_len + j), an online softmax, then
// probabilities x V accumulated in registers. With a bf16 query and cache on a CPU with AVX512_BF16 both products
// are bf16 dot products (vdpbf16ps) instead: K and V are packed as raw bf16 pairs (pack_pairs) and the
// probabilities rounded to bf16 before P x V, as flash attention does; sums stay fp32. Only keys at positions <
// seq_len are read. With a sliding window (window > 0) a row sees its last `window` positions: an item packs keys
// from the key tile holding its first row's window start (zeros before that start), a query tile starts at the key
// tile holding its first row's, and each row is masked below too. Items are handed out longest first (dynamic
// schedule): their costs differ by the length of their key range.
// Registered as torch.ops.batchgen.paged_prefill_ (writes into `out`; its fake implementation is in Python).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "as_float.h"
#include "prefill_common.h"
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

using batchgen_prefill::Item;
using batchgen_prefill::window_start;
constexpr int64_t kRows = batchgen_prefill::kTileRows;  // query positions attended together
constexpr int64_t kKeys = batchgen_prefill::kTileKeys;  // keys per tile
constexpr int kVecs = kKeys / 16;
constexpr int64_t kPrefetch = 8;  // keys ahead whose K/V rows pack() requests early

// Rows per register block: AVX-512 has 32 vector registers, AVX2 16 (and a Vec16 takes two of them).
#ifdef __AVX512F__
constexpr int kScoreRows = 6, kValueRows = 4;  // 24 score and 16 value accumulators
#else
constexpr int kScoreRows = 1, kValueRows = 2;
#endif

struct Scratch {  // one per thread; the packed K/V grow to the longest key range an item of the thread needs
  std::vector<float> q, kt, v, s, acc;
  // The bf16 dot-product path's operands, two bf16 values per 32-bit word: the query and keys in pairs of dims,
  // the values and probabilities in pairs of keys.
  std::vector<uint32_t> q_pairs, kt_pairs, v_pairs, p_pairs;
  batchgen_prefill::SoftmaxBuffers softmax;
  Scratch(int64_t rows, int64_t dim, int64_t padded_dim)
      : q(rows * dim), s(rows * kKeys), acc(rows * padded_dim), q_pairs(rows * dim / 2), p_pairs(rows * kKeys / 2),
        softmax(rows) {}
};

// s[r][0:kKeys] = q[r] . keys, for R rows at a time; kt holds the tile's keys transposed, [dim][kKeys].
// The micro-kernels are kept out of line: inlined into the item loop they share its registers and spill.
template <int R>
__attribute__((noinline)) void score_rows(const float* q, const float* kt, float* s, int64_t dim) {
  Vec16 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = Vec16{};
  for (int64_t d = 0; d < dim; ++d) {
    Vec16 k[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      k[c] = load16(kt + d * kKeys + 16 * c);
      keep_in_register(k[c]);  // not folded into (and reloaded by) each row's multiply-add
    }
    for (int r = 0; r < R; ++r) {
      const float x = q[r * dim + d];
      for (int c = 0; c < kVecs; ++c) acc[r][c] += x * k[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) store16(s + r * kKeys + 16 * c, acc[r][c]);
}

#if defined(__AVX512BF16__)
// score_rows with bf16 dot products (vdpbf16ps: exact products, fp32 sums): q holds each row's query as pairs of
// bf16 dims, one 32-bit word per pair; kt the tile's keys as [dim / 2][kKeys] such pairs. Unscaled scores.
template <int R>
__attribute__((noinline)) void score_rows_bf16(const uint32_t* q, const uint32_t* kt, float* s, int64_t dim) {
  const int64_t pairs = dim / 2;
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i k[kVecs];
    for (int c = 0; c < kVecs; ++c) k[c] = _mm512_loadu_si512(kt + i * kKeys + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(q[r * pairs + i]));
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, (__m512bh)k[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(s + r * kKeys + 16 * c, acc[r][c]);
}
#endif

// acc[r][offset : offset + 16 C] += sum over t < n of p[r][t] * v[t][same range], for R rows, in registers.
template <int R, int C>
__attribute__((noinline)) void accumulate_rows(float* acc, const float* p, const float* v, int64_t n, int64_t padded_dim,
                            int64_t offset) {
  Vec16 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = load16(acc + r * padded_dim + offset + 16 * c);
  for (int64_t t = 0; t < n; ++t) {
    Vec16 row[C];
    for (int c = 0; c < C; ++c) {
      row[c] = load16(v + t * padded_dim + offset + 16 * c);
      keep_in_register(row[c]);  // folded into each multiply-add instead, it would be loaded R times
    }
    for (int r = 0; r < R; ++r) {
      const float w = p[r * kKeys + t];
      for (int c = 0; c < C; ++c) sums[r][c] += w * row[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store16(acc + r * padded_dim + offset + 16 * c, sums[r][c]);
}

#if defined(__AVX512BF16__)
// accumulate_rows with bf16 dot products: p holds each row's probabilities as bf16 pairs of keys (kKeys / 2 words
// per row), v the tile's values as [kKeys / 2][padded_dim] words, each the same dim of two consecutive keys.
template <int R, int C>
__attribute__((noinline)) void accumulate_rows_bf16(float* acc, const uint32_t* p, const uint32_t* v, int64_t pairs,
                                                    int64_t padded_dim, int64_t offset) {
  __m512 sums[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) sums[r][c] = _mm512_loadu_ps(acc + r * padded_dim + offset + 16 * c);
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i row[C];
    for (int c = 0; c < C; ++c) row[c] = _mm512_loadu_si512(v + i * padded_dim + offset + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(p[r * (kKeys / 2) + i]));
      for (int c = 0; c < C; ++c) sums[r][c] = _mm512_dpbf16_ps(sums[r][c], w, (__m512bh)row[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * padded_dim + offset + 16 * c, sums[r][c]);
}

template <int R>
inline void accumulate_bf16(float* acc, const uint32_t* p, const uint32_t* v, int64_t n, int64_t padded_dim) {
  const int64_t pairs = (n + 1) / 2;  // an odd tile's last pair has a zero probability beside its key
  int64_t offset = 0;
  for (; offset + 64 <= padded_dim; offset += 64) accumulate_rows_bf16<R, 4>(acc, p, v, pairs, padded_dim, offset);
  for (; offset < padded_dim; offset += 16) accumulate_rows_bf16<R, 1>(acc, p, v, pairs, padded_dim, offset);
}
#endif

template <int R>
inline void accumulate(float* acc, const float* p, const float* v, int64_t n, int64_t padded_dim) {
  int64_t offset = 0;
  for (; offset + 64 <= padded_dim; offset += 64) accumulate_rows<R, 4>(acc, p, v, n, padded_dim, offset);
  for (; offset < padded_dim; offset += 16) accumulate_rows<R, 1>(acc, p, v, n, padded_dim, offset);
}

template <typename QT, typename KV>
struct Prefill {
  const QT* q;
  int64_t q_stride0, q_stride1;
  const KV *k_base, *v_base;
  const float *k_scales, *v_scales;  // an int8 cache's, one per (slot, kv head); null otherwise
  int64_t block_size, kv_heads, dim, padded_dim, group;
  const int32_t *tables, *lens, *starts;
  int64_t table_stride;
  float scale;
  int64_t window;  // keys each query sees (itself included); <= 0: the whole context
  QT* out;  // [T, Hq, D] contiguous

  // Scores by bf16 dot products: a bf16 query and cache, an even head_dim, a CPU with AVX512_BF16.
#if defined(__AVX512BF16__)
  static constexpr bool kBf16 = std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KV, c10::BFloat16>;
#else
  static constexpr bool kBf16 = false;
#endif
  bool dot() const { return kBf16 && dim % 2 == 0; }

  const KV* cache_row(const KV* base, int64_t seq, int64_t head, int64_t pos) const {
    const int64_t block = tables[seq * table_stride + pos / block_size];
    return base + ((block * block_size + pos % block_size) * kv_heads + head) * dim;
  }

  // Keys [base, key_end) of one head as fp32 (packed key i is position base + i), in tiles of kKeys: K transposed
  // (tile t at kt + t * dim * kKeys, [dim][kKeys]) and V as rows (v + i * padded_dim), zeros before `first`, past
  // key_end and past dim. Packed once per item and read by all of its query tiles, from the thread's cache rather than from wherever
  // the blocks lie.
  void prefetch(const KV* row) const {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(KV)); offset += 64)
      __builtin_prefetch(bytes + offset, 0, 3);
  }

  void pack(int64_t seq, int64_t head, int64_t base, int64_t first, int64_t key_end, Scratch& w) const {
    const int64_t tiles = (key_end - base + kKeys - 1) / kKeys, keys = tiles * kKeys;
    if (dot()) return pack_pairs(seq, head, base, first, key_end, keys, w);
    if (static_cast<int64_t>(w.v.size()) < keys * padded_dim) {
      w.kt.resize(keys * dim);
      w.v.resize(keys * padded_dim);
    }
    for (int64_t key = 0; key < keys; ++key) {
      float* kt = w.kt.data() + (key / kKeys) * kKeys * dim + key % kKeys;  // column key % kKeys of its tile
      float* v_dst = w.v.data() + key * padded_dim;
      const int64_t pos = base + key;
      if (first <= pos + kPrefetch && pos + kPrefetch < key_end) {  // blocks lie anywhere: the hardware prefetchers cannot guess the next one
        prefetch(cache_row(k_base, seq, head, pos + kPrefetch));
        prefetch(cache_row(v_base, seq, head, pos + kPrefetch));
      }
      if (first <= pos && pos < key_end) {
        const KV* k_row = cache_row(k_base, seq, head, pos);
        const KV* v_row = cache_row(v_base, seq, head, pos);
        const int64_t slot = (k_row - k_base) / dim;  // an int8 row is dequantized here, in the item's packed copy
        const float ks = k_scales ? k_scales[slot] : 1.0f, vs = v_scales ? v_scales[slot] : 1.0f;
        for (int64_t d = 0; d < dim; ++d) kt[d * kKeys] = as_float(k_row[d]) * ks;
        for (int64_t d = 0; d < dim; ++d) v_dst[d] = as_float(v_row[d]) * vs;
        for (int64_t d = dim; d < padded_dim; ++d) v_dst[d] = 0.0f;
      } else {
        for (int64_t d = 0; d < dim; ++d) kt[d * kKeys] = 0.0f;
        for (int64_t d = 0; d < padded_dim; ++d) v_dst[d] = 0.0f;
      }
    }
  }

  // pack() for the bf16 dot products, moving the raw bf16 bits: K as [tile][dim / 2][kKeys] words (a pair of dims
  // of one key), V as [key / 2][padded_dim] words (one dim of a pair of keys).
  void pack_pairs(int64_t seq, int64_t head, int64_t base, int64_t first, int64_t key_end, int64_t keys,
                  Scratch& w) const {
    const int64_t pairs = dim / 2;
    if (static_cast<int64_t>(w.v_pairs.size()) < keys / 2 * padded_dim) {
      w.kt_pairs.resize(keys * pairs);
      w.v_pairs.resize(keys / 2 * padded_dim);
    }
    uint16_t* v_halves = reinterpret_cast<uint16_t*>(w.v_pairs.data());
    for (int64_t key = 0; key < keys; ++key) {
      uint32_t* kt = w.kt_pairs.data() + (key / kKeys) * kKeys * pairs + key % kKeys;
      uint16_t* v_dst = v_halves + (key / 2) * padded_dim * 2 + key % 2;  // then every other half-word
      const int64_t pos = base + key;
      if (first <= pos + kPrefetch && pos + kPrefetch < key_end) {
        prefetch(cache_row(k_base, seq, head, pos + kPrefetch));
        prefetch(cache_row(v_base, seq, head, pos + kPrefetch));
      }
      if (first <= pos && pos < key_end) {
        const char* k_bytes = reinterpret_cast<const char*>(cache_row(k_base, seq, head, pos));
        const uint16_t* v_row = reinterpret_cast<const uint16_t*>(cache_row(v_base, seq, head, pos));
        for (int64_t i = 0; i < pairs; ++i) std::memcpy(kt + i * kKeys, k_bytes + 4 * i, 4);
        for (int64_t d = 0; d < dim; ++d) v_dst[2 * d] = v_row[d];
        for (int64_t d = dim; d < padded_dim; ++d) v_dst[2 * d] = 0;
      } else {
        for (int64_t i = 0; i < pairs; ++i) kt[i * kKeys] = 0;
        for (int64_t d = 0; d < padded_dim; ++d) v_dst[2 * d] = 0;
      }
    }
  }

  // The query tile of up to kRows positions starting at `first_row` (within the sequence's new tokens), all `group`
  // heads of kv head `head`, against the keys packed from position `base` on.
  void attend(int64_t seq, int64_t head, int64_t first_row, int64_t base, Scratch& w) const {
    const int64_t q_len = starts[seq + 1] - starts[seq], len = lens[seq];
    const int64_t positions = std::min(kRows, q_len - first_row);
    const int64_t first_pos = len - q_len + first_row;  // absolute position of the tile's first query
    const int64_t rows = positions * group;             // row m = position (m / group), head (m % group)
    for (int64_t r = 0; r < positions; ++r)
      for (int64_t g = 0; g < group; ++g) {
        const QT* src = q + (starts[seq] + first_row + r) * q_stride0 + (head * group + g) * q_stride1;
        if (dot()) {
          std::memcpy(w.q_pairs.data() + (r * group + g) * (dim / 2), src, dim * sizeof(QT));
          continue;
        }
        float* dst = w.q.data() + (r * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = as_float(src[d]) * scale;
      }
    const batchgen_prefill::Softmax softmax = w.softmax.over(w.acc.data(), rows, padded_dim);
    softmax.reset();
    const batchgen_prefill::KeyRange keys = batchgen_prefill::visible_keys(first_pos, positions, base, window);
    for (int64_t start = keys.first; start < keys.end; start += kKeys) {
      const int64_t n = std::min(kKeys, keys.end - start);
      const float* kt = dot() ? nullptr : w.kt.data() + start * dim;  // the tile's [dim][kKeys] block
      int64_t m = 0;
      if (dot()) {
#if defined(__AVX512BF16__)
        const uint32_t* kt_pairs = w.kt_pairs.data() + start * (dim / 2);
        for (; m + kScoreRows <= rows; m += kScoreRows)
          score_rows_bf16<kScoreRows>(w.q_pairs.data() + m * (dim / 2), kt_pairs, w.s.data() + m * kKeys, dim);
        for (; m < rows; ++m)
          score_rows_bf16<1>(w.q_pairs.data() + m * (dim / 2), kt_pairs, w.s.data() + m * kKeys, dim);
#endif
      } else {
        for (; m + kScoreRows <= rows; m += kScoreRows)
          score_rows<kScoreRows>(w.q.data() + m * dim, kt, w.s.data() + m * kKeys, dim);
        for (; m < rows; ++m) score_rows<1>(w.q.data() + m * dim, kt, w.s.data() + m * kKeys, dim);
      }
      // The dot path's query is not pre-scaled.
      softmax.tile(w.s.data(), n, first_pos - base - start, group, window, dot() ? scale : 1.0f);
      if (dot()) {
#if defined(__AVX512BF16__)
        for (m = 0; m < rows; ++m) {  // the probabilities as bf16, two keys per word
          const float* p = w.s.data() + m * kKeys;
          for (int c = 0; c < kVecs; c += 2)
            _mm512_storeu_si512(w.p_pairs.data() + m * (kKeys / 2) + 8 * c,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16 * (c + 1)), _mm512_loadu_ps(p + 16 * c)));
        }
        const uint32_t* v_pairs = w.v_pairs.data() + start / 2 * padded_dim;
        for (m = 0; m + kValueRows <= rows; m += kValueRows)
          accumulate_bf16<kValueRows>(w.acc.data() + m * padded_dim, w.p_pairs.data() + m * (kKeys / 2), v_pairs, n,
                                      padded_dim);
        for (; m < rows; ++m)
          accumulate_bf16<1>(w.acc.data() + m * padded_dim, w.p_pairs.data() + m * (kKeys / 2), v_pairs, n,
                             padded_dim);
#endif
      } else {
        const float* v = w.v.data() + start * padded_dim;
        for (m = 0; m + kValueRows <= rows; m += kValueRows)
          accumulate<kValueRows>(w.acc.data() + m * padded_dim, w.s.data() + m * kKeys, v, n, padded_dim);
        for (; m < rows; ++m) accumulate<1>(w.acc.data() + m * padded_dim, w.s.data() + m * kKeys, v, n, padded_dim);
      }
    }

    const int64_t q_heads = kv_heads * group;
    for (int64_t m = 0; m < rows; ++m) {
      const int64_t token = starts[seq] + first_row + m / group, h = head * group + m % group;
      const float inv = softmax.inverse_sum(m);
      const float* a = w.acc.data() + m * padded_dim;
      QT* o = out + (token * q_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<QT>(a[d] * inv);
    }
  }
};

template <typename QT, typename KV>
void prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
             const at::Tensor& lens, const at::Tensor& starts, int64_t first_seq, double scale, int64_t window,
             at::Tensor& out, const float* k_scales = nullptr, const float* v_scales = nullptr) {
  const int64_t kv_heads = k_cache.size(2), dim = k_cache.size(3), group = q.size(1) / kv_heads;
  const int64_t padded_dim = (dim + 15) / 16 * 16;
  const Prefill<QT, KV> p{q.data_ptr<QT>(), q.stride(0), q.stride(1),
                          static_cast<const KV*>(k_cache.data_ptr()), static_cast<const KV*>(v_cache.data_ptr()),
                          k_scales, v_scales, k_cache.size(1), kv_heads, dim, padded_dim, group,
                          tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), starts.data_ptr<int32_t>(),
                          tables.stride(0), static_cast<float>(scale), window, out.data_ptr<QT>()};
  const std::vector<Item> items =
      batchgen_prefill::prefill_items(p.lens, p.starts, first_seq, lens.size(0), kv_heads, window);
  const int64_t count = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(count, 1)));
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch(kRows * group, dim, padded_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) batchgen_prefill::run_item(p, items[i], scratch);
  }
}

void paged_prefill_(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                    int64_t first_seq, double scale, int64_t window, at::Tensor out) {
  batchgen_prefill::check_prefill_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq,
                                         window, out);
  const auto q_type = q.scalar_type(), kv_type = k_cache.scalar_type();
  if (q_type == at::kFloat && kv_type == at::kFloat)
    prefill<float, float>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale, window, out);
  else if (q_type == at::kBFloat16 && kv_type == at::kBFloat16)
    prefill<c10::BFloat16, c10::BFloat16>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq,
                                          scale, window, out);
  else if (q_type == at::kHalf && kv_type == at::kHalf)
    prefill<c10::Half, c10::Half>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, first_seq, scale,
                                  window, out);
  else
    TORCH_CHECK(false, "paged_prefill: q and the caches must share one dtype of float32, bfloat16 or float16");
}

}  // namespace

// An int8 cache (paged_int8_cpu.cpp's layout and checks): its rows are dequantized as an item packs them, into fp32.
void paged_prefill_int8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const float* ks,
                        const float* vs, const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& starts,
                        int64_t first_seq, double scale, int64_t window, at::Tensor& out) {
  batchgen_prefill::check_prefill_inputs(q, k_cache, v_cache, tables, lens, starts, first_seq, window, out);
  if (q.scalar_type() == at::kFloat)
    prefill<float, int8_t>(q, k_cache, v_cache, tables, lens, starts, first_seq, scale, window, out, ks, vs);
  else if (q.scalar_type() == at::kBFloat16)
    prefill<c10::BFloat16, int8_t>(q, k_cache, v_cache, tables, lens, starts, first_seq, scale, window, out, ks, vs);
  else
    prefill<c10::Half, int8_t>(q, k_cache, v_cache, tables, lens, starts, first_seq, scale, window, out, ks, vs);
}

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("paged_prefill_(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int first_seq, float scale, int window, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) { m.impl("paged_prefill_", &paged_prefill_); }
