// exp(x) in plain arithmetic, so that loops over it vectorize (a libm call does not): 2^(x log2 e) split into an
// integer power (exponent bits) and 2^f, f in [-0.5, 0.5], by a degree-6 polynomial (relative error ~2e-7). x is
// clamped to [-87, 88]: below, the result is ~0 (as a softmax wants); above, fp32 overflows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// 2^f for f in [-0.5, 0.5]: a float, or a GCC vector of floats (paged_prefill_cpu.cpp's 16-lane exp).
template <typename T>
inline T exp2_fraction(T f) {
  T p = T{} + 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6180499e-3f;
  p = p * f + 5.5503406e-2f;
  p = p * f + 2.4022652e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  return p;
}

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float p = exp2_fraction(t - n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
