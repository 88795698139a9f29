// One cache or query element as fp32, for the kernels' scalar paths (an int8 cache's raw value, unscaled).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

template <>
inline float as_float<c10::BFloat16>(c10::BFloat16 x) {  // the top half of an fp32: a shift
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
