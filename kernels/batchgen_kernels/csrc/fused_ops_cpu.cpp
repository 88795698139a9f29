// The decoder's elementwise chains as single passes over each token's row, for the CPU: RMSNorm, residual add +
// RMSNorm, RoPE on the q and k parts of the fused qkv projection, and SiLU(gate) * up. In eager torch each chain is
// 5-10 separate ops, each a full pass over memory and a dispatch; here each is one loop per row.
//
// Numerics follow the torch ops they replace (and so transformers): fp32 math, and in a 16-bit dtype the result of
// every op the torch chain rounds is rounded here too (`round_to`). In fp32 only RMSNorm's mean of squares can differ
// from torch (the order of its summation), and SiLU's exp by an ulp. Built without FMA contraction (the pragma below),
// so that `a * b - c * d` rounds as torch's separate ops do: RoPE is bit-exact.
#pragma GCC optimize("fp-contract=off")
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "fast_exp.h"
#include "vec16.h"

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <tuple>

namespace {

// Conversions written as plain bit arithmetic, so that loops over them vectorize (c10::BFloat16's constructor
// branches on NaN). Rounding is to nearest even, as torch's; a NaN stays a NaN.
inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint16_t float_to_bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
}

template <typename T>
inline float load(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16_bits_to_float(p[i].x);
  return static_cast<float>(p[i]);
}
template <typename T>
inline void store(T* p, int64_t i, float v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    p[i].x = float_to_bf16_bits(v);
  } else {
    p[i] = static_cast<T>(v);
  }
}
template <typename T>
inline float round_to(float x) {  // what storing x in T and reading it back gives
  if constexpr (std::is_same_v<T, c10::BFloat16>) return bf16_bits_to_float(float_to_bf16_bits(x));
  return static_cast<float>(static_cast<T>(x));
}

template <typename F>
void dispatch(const at::Tensor& t, const char* op, F&& body) {
  switch (t.scalar_type()) {
    case at::kFloat: body(float{}); break;
    case at::kBFloat16: body(c10::BFloat16{}); break;
    case at::kHalf: body(c10::Half{}); break;
    default: TORCH_CHECK(false, op, ": unsupported dtype ", t.scalar_type());
  }
}

// Rows per parallel task: at least ~32k elements, as torch's own elementwise ops; a decode step's few rows then run
// on the calling thread, with no thread-pool wake-up or barrier.
inline int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, row_elements)); }

// out = weight * (x / sqrt(mean(x^2) + eps)), the normalised row rounded to T before the weight multiplies it.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  constexpr int64_t kLanes = 16;  // independent partial sums, so that the sum of squares vectorizes
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = load(x, i + j);
      lanes[j] += v * v;
    }
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += load(x, i) * load(x, i);
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t k = 0; k < n; ++k) store(out, k, load(w, k) * round_to<T>(load(x, k) * inv));
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), op, ": x must be a contiguous [T, H] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type(), op,
              ": weight must be [H] of x's dtype");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  const int64_t n = x.size(1);
  dispatch(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// hidden = x + residual (rounded to T, as torch's add), normed = rms_norm(hidden).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous, of x's shape and dtype");
  at::Tensor hidden = at::empty_like(x);
  at::Tensor normed = at::empty_like(x);
  const int64_t n = x.size(1);
  dispatch(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* rp = residual.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* hp = hidden.data_ptr<T>();
    T* np = normed.data_ptr<T>();
    at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          store(hp, r * n + i, load(xp, r * n + i) + load(rp, r * n + i));
        }
        rms_norm_row(hp + r * n, wp, np + r * n, n, static_cast<float>(eps));
      }
    });
  });
  return {hidden, normed};
}

// Rotate-half RoPE of `heads` heads of `src` (row stride given) into contiguous `dst` [heads, d]: with the halves
// x1, x2 of each head, (x1 cos - x2 sin, x2 cos + x1 sin); cos and sin rounded to T first, as the model does.
template <typename T>
inline void rope_heads(const T* src, T* dst, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * d;
    T* y = dst + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float c = round_to<T>(cos[i]), s = round_to<T>(sin[i]);
      const float x1 = load(x, i), x2 = load(x, i + half);
      const float a = round_to<T>(x1 * c), b = round_to<T>(x2 * s);
      const float e = round_to<T>(x2 * c), f = round_to<T>(x1 * s);
      store(y, i, a - b);
      store(y, i + half, e + f);
    }
  }
}

// qkv: [T, (Hq + 2 Hkv) * D], positions: int64 [T], cos/sin: fp32 [max_positions, D / 2]
// → q [T, Hq, D], k [T, Hkv, D], both rotated and contiguous (v stays a view of qkv).
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                           const at::Tensor& sin, int64_t num_q_heads, int64_t num_kv_heads,
                                           int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_qk: qkv must be [T, width] with unit inner stride");
  TORCH_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * head_dim && head_dim % 2 == 0,
              "rope_qk: qkv width does not match the head counts");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == qkv.size(0), "rope_qk: positions int64 [T]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) == head_dim / 2,
              "rope_qk: cos/sin must be contiguous fp32 [max_positions, head_dim / 2]");
  const int64_t tokens = qkv.size(0), row = qkv.stride(0), half = head_dim / 2;
  at::Tensor q = at::empty({tokens, num_q_heads, head_dim}, qkv.options());
  at::Tensor k = at::empty({tokens, num_kv_heads, head_dim}, qkv.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t max_pos = cos.size(0);
  dispatch(qkv, "rope_qk", [&](auto tag) {
    using T = decltype(tag);
    const T* src = qkv.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kp = k.data_ptr<T>();
    at::parallel_for(0, tokens, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = pos[t];
        TORCH_CHECK(p >= 0 && p < max_pos, "rope_qk: position ", p, " outside the RoPE table");
        rope_heads(src + t * row, qp + t * num_q_heads * head_dim, num_q_heads, head_dim, cp + p * half,
                   sp + p * half);
        rope_heads(src + t * row + num_q_heads * head_dim, kp + t * num_kv_heads * head_dim, num_kv_heads, head_dim,
                   cp + p * half, sp + p * half);
      }
    });
  });
  return {q, k};
}

// 16 values of T as floats and back (fp32 and bf16: the dtypes the vector loops below take; fp16 stays scalar).
typedef uint32_t UInt16v __attribute__((vector_size(64)));

template <typename T>
constexpr bool kVec16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

template <typename T>
inline Vec16 load_vec(const T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) return widen_bf16(p);
  else return load16(p);
}

// float_to_bf16_bits on 16 lanes, as the bf16 bits in the top half of each lane (a NaN stays a NaN).
inline UInt16v bf16_bits_vec(Vec16 v) {
  UInt16v bits;
  std::memcpy(&bits, &v, sizeof bits);
  const UInt16v rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return v != v ? UInt16v{} + 0x7FC00000u : rounded;
}

template <typename T>
inline Vec16 round_vec(Vec16 v) {  // round_to<T> on 16 lanes
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const UInt16v bits = bf16_bits_vec(v);
    std::memcpy(&v, &bits, sizeof v);
  }
  return v;
}

template <typename T>
inline void store_vec(T* p, Vec16 v) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const Half16 half = __builtin_convertvector(bf16_bits_vec(v) >> 16, Half16);
    std::memcpy(p, &half, sizeof half);
  } else {
    store16(p, v);
  }
}

// gate_up: [T, 2 I] (gate then up) → silu(gate) * up: [T, I], silu rounded to T before the product. Sixteen lanes
// at a time where T allows: the scalar loop alone did not vectorize (built for AVX2 it ran 2.6x slower than torch's
// two ops); exp16 is fast_exp's arithmetic, so both loops give the same bits.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be a contiguous [T, 2 I] tensor");
  const int64_t tokens = gate_up.size(0), inner = gate_up.size(1) / 2;
  at::Tensor out = at::empty({tokens, inner}, gate_up.options());
  dispatch(gate_up, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = gate_up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, tokens, grain(3 * inner), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* g = src + t * 2 * inner;
        const T* u = g + inner;
        T* y = dst + t * inner;
        int64_t i = 0;
        if constexpr (kVec16<T>) {
          for (; i + 16 <= inner; i += 16) {
            const Vec16 x = load_vec(g + i);
            const Vec16 silu = round_vec<T>(x / (1.f + exp16(-x)));
            store_vec(y + i, silu * load_vec(u + i));
          }
        }
        for (; i < inner; ++i) {
          const float x = load(g, i);
          const float silu = round_to<T>(x / (1.f + fast_exp(-x)));
          store(y, i, silu * load(u, i));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(batchgen, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_qk(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads, "
        "int head_dim) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchgen, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_qk", &rope_qk);
  m.impl("silu_mul", &silu_mul);
}
