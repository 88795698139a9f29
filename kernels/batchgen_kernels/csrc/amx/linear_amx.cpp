// bf16 Linear (y = x W^T + b) on AMX tiles, for the decode steps' few rows: the weight streamed once per call at
// close to memory bandwidth. oneDNN's packed matmul (models/packed_linear.py) streams it at 15-20 GB/s of ~24 on the
// 1B shapes (docs/performance.md, "Issue 43"); this kernel keeps the rows' A tiles in L1/L2 and reads each weight
// byte once, in the order it lies in memory, with software prefetch ahead.
//
// The weight is packed once (linear_amx_pack) into blocks of kBlockN = 32 output columns, each [Kp / 2][32][2] bf16
// (VNNI: a K pair of one column per 32-bit word, Kp = K rounded up to 32 with zeros): a block's 16 K-pair rows are
// the two B tiles of amx_tiles.h (stride 128 bytes, the second 16 columns 64 bytes on), and the same layout is
// oneDNN's brgemm's VNNI B with ldb = 32, which the many-row calls (prefill) run on: at::native::cpublas::brgemm.
//
// Rows up to `tile_rows` (the caller's crossover): the rows are copied into a zero-padded [Mp][Kp] buffer (Mp: 16s),
// the threads split the column blocks (at::parallel_for), and each block is 2 x 2 tiles (32 rows x 32 columns, 1 x 2
// for a last 16 rows) accumulated over all of K in fp32, then rounded to bf16 (+ bias); the column blocks in chunks
// that stay in L2 while every 32 rows pass over them. A row's result depends neither on the other rows nor on the
// thread count (each of its sums is the same sequence of tile products, whichever thread runs its block): the engine's
// batch-invariant bf16 runs every row count here (models/packed_linear.py). More rows: brgemm per 128 x 32 block, in
// the same chunks.
//
// A library of its own (amx.LINEAR, loaded by amx.load_linear). Outside batch-invariant mode the engine keeps oneDNN
// (docs/performance.md, "Issue 43"): the tile path beats it up to 32 rows, brgemm loses to it on prefills.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "amx_tiles.h"

#include <algorithm>
#include <cstdint>
#include <optional>

namespace {

constexpr int64_t kBlockN = 32, kChunkK = 32, kBlockBytes = 16 * 128;  // one K step of a column block: 2 B tiles
constexpr int64_t kPrefetchBytes = 4 * kBlockBytes;                      // how far ahead the weight is requested
constexpr int64_t kBrgemmRows = 128, kL2Bytes = 1 << 20;                 // many-row path: row block, B bytes in L2

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// fp32 -> bf16 (round to nearest even, as c10::BFloat16) of n <= 32 values, + bias where given.
inline void store_row(c10::BFloat16* dst, const float* src, const c10::BFloat16* bias, int64_t n) {
#ifdef BATCHGEN_AMX_EMULATE
  for (int64_t j = 0; j < n; ++j) dst[j] = c10::BFloat16(src[j] + (bias ? static_cast<float>(bias[j]) : 0.f));
#else
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(mask, src + j);
    if (bias) {
      const __m256i b16 = _mm256_maskz_loadu_epi16(mask, bias + j);
      v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b16), 16)));
    }
    _mm256_mask_storeu_epi16(dst + j, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
#endif
}

inline void prefetch(const uint8_t* p) {
#ifndef BATCHGEN_AMX_EMULATE
  for (int64_t line = 0; line < kBlockBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(p + line), _MM_HINT_T0);
#else
  (void)p;
#endif
}

struct Problem {
  const c10::BFloat16* a;  // [rows][lda]
  int64_t lda;
  const uint8_t* w;  // packed weight
  const c10::BFloat16* bias;
  c10::BFloat16* out;  // [rows][n]
  int64_t rows, n, kp;

  const uint8_t* block(int64_t nb) const { return w + nb * kp * kBlockN * 2; }
  void store(const float* c, int64_t row0, int64_t count, int64_t nb) const {
    const int64_t cols = std::min(kBlockN, n - nb * kBlockN);
    for (int64_t r = 0; r < count; ++r)
      store_row(out + (row0 + r) * n + nb * kBlockN, c + r * kBlockN, bias ? bias + nb * kBlockN : nullptr, cols);
  }
};

// The few-row path: a padded A (rows a multiple of 16, lda = kp) against column blocks [begin, end).
template <bool kTwoRows>
void tile_block(const Problem& p, int64_t row0, int64_t nb, float* c) {
  const uint8_t* a = reinterpret_cast<const uint8_t*>(p.a + row0 * p.lda);
  const uint8_t* b = p.block(nb);
  const int64_t steps = p.kp / kChunkK;
  amx::zero_c<kTwoRows>();
  for (int64_t s = 0; s < steps; ++s) {
    prefetch(b + s * kBlockBytes + kPrefetchBytes);
    amx::multiply<kTwoRows>(a + s * kChunkK * 2, p.lda * 2, b + s * kBlockBytes, 128);
  }
  amx::store_c<kTwoRows>(c, kBlockN * 4);
  amx::memory_barrier();
  p.store(c, row0, std::min<int64_t>(kTwoRows ? 32 : 16, p.rows - row0), nb);
}

// The column blocks in chunks that stay in L2 while every 32 rows pass over them (a decode step's rows: one pass).
int64_t l2_chunk(const Problem& p) { return std::max<int64_t>(1, kL2Bytes / (p.kp * kBlockN * 2)); }

void tile_gemm(const Problem& p, int64_t padded_rows) {
  const int64_t chunk = l2_chunk(p);
  at::parallel_for(0, round_up(p.n, kBlockN) / kBlockN, 0, [&](int64_t begin, int64_t end) {
    alignas(64) float c[32 * kBlockN];
    amx::configure();
    for (int64_t first = begin; first < end; first += chunk)
      for (int64_t row0 = 0; row0 < padded_rows; row0 += 32)
        for (int64_t nb = first; nb < std::min(end, first + chunk); ++nb) {
          if (padded_rows - row0 >= 32) tile_block<true>(p, row0, nb, c);
          else tile_block<false>(p, row0, nb, c);
        }
    amx::release();
  });
}

// The many-row path: oneDNN's brgemm on the same packed blocks (A unpadded in rows; lda = kp).
void brgemm_gemm(const Problem& p) {
  const int64_t blocks = round_up(p.n, kBlockN) / kBlockN, chunk = l2_chunk(p);
  at::parallel_for(0, blocks, 0, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kBrgemmRows * kBlockN];
    for (int64_t first = begin; first < end; first += chunk)
      for (int64_t row0 = 0; row0 < p.rows; row0 += kBrgemmRows) {
        const int64_t count = std::min(kBrgemmRows, p.rows - row0);
        for (int64_t nb = first; nb < std::min(end, first + chunk); ++nb) {
          at::native::cpublas::brgemm(count, kBlockN, p.kp, p.lda, kBlockN, kBlockN, false, p.a + row0 * p.lda,
                                      reinterpret_cast<const c10::BFloat16*>(p.block(nb)), c);
          p.store(c, row0, count, nb);
        }
      }
    at::native::cpublas::brgemm_release();
  });
}

// weight [N][K] bf16 -> [ceil(N / 32)][Kp / 2][32][2] bf16, zero-padded.
at::Tensor linear_amx_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "linear_amx_pack: a 2-D bf16 weight");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), kp = round_up(k, kChunkK), blocks = round_up(n, kBlockN) / kBlockN;
  at::Tensor packed = at::zeros({blocks, kp / 2, kBlockN, 2}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb)
      for (int64_t j = 0; j < std::min(kBlockN, n - nb * kBlockN); ++j)
        for (int64_t i = 0; i < k; ++i)
          dst[((nb * kp / 2 + i / 2) * kBlockN + j) * 2 + i % 2] = src[(nb * kBlockN + j) * k + i];
  });
  return packed;
}

// x [M][K] bf16 (any leading shape), packed from linear_amx_pack, bias [N] or none -> [M][N] bf16. Rows up to
// tile_rows take the tile kernel, more take brgemm.
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      int64_t n, int64_t tile_rows) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, "linear_amx: bf16 only");
  const int64_t k = x.size(-1), kp = round_up(k, kChunkK), rows = x.numel() / std::max<int64_t>(k, 1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(0) == round_up(n, kBlockN) / kBlockN && packed.size(1) * 2 == kp,
              "linear_amx: packed weight of another shape");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options());
  if (rows == 0) return out;
  at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.numel() == n && b.scalar_type() == at::kBFloat16), "linear_amx: bias [N] bf16");
  at::Tensor a = x.reshape({rows, k});
  const bool tiles = rows <= tile_rows;
  const int64_t padded_rows = tiles ? round_up(rows, 16) : rows;
  if (tiles || kp != k || !a.is_contiguous()) {  // the tiles read whole 16-row tiles; brgemm a K of 32s
    at::Tensor padded = at::empty({padded_rows, kp}, x.options());
    padded.narrow(1, 0, k).narrow(0, 0, rows).copy_(a);
    if (kp != k) padded.narrow(1, k, kp - k).zero_();
    if (padded_rows != rows) padded.narrow(0, rows, padded_rows - rows).zero_();
    a = padded;
  }
  const Problem p{reinterpret_cast<const c10::BFloat16*>(a.data_ptr()), a.size(1),
                  reinterpret_cast<const uint8_t*>(packed.data_ptr()),
                  b.defined() ? reinterpret_cast<const c10::BFloat16*>(b.data_ptr()) : nullptr,
                  reinterpret_cast<c10::BFloat16*>(out.data_ptr()), rows, n, kp};
  if (tiles) tile_gemm(p, padded_rows);
  else brgemm_gemm(p);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("linear_amx_pack(Tensor weight) -> Tensor");
  m.def("linear_amx(Tensor x, Tensor packed, Tensor? bias, int n, int tile_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("linear_amx_pack", &linear_amx_pack);
  m.impl("linear_amx", &linear_amx);
}
