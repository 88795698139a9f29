// Sixteen floats as one value (GCC/Clang vector extension: one zmm register with AVX-512, two ymm with AVX2) and
// the few operations on it that the attention kernels share.
#pragma once

#include "fast_exp.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));
typedef uint16_t Half16 __attribute__((vector_size(32)));  // 16 raw 16-bit values (bf16 bit patterns)
typedef float Vec8 __attribute__((vector_size(32)));
typedef float Vec4 __attribute__((vector_size(16)));

inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, Vec16 v) { std::memcpy(p, &v, sizeof v); }

// 16 bf16 values as fp32: bf16 is the top half of an fp32, so a zero-extension and a shift.
inline Vec16 widen_bf16(const void* p) {
  Half16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const Int16 bits = __builtin_convertvector(raw, Int16) << 16;
  Vec16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Makes the compiler materialise `v` in a register here (an empty asm that claims to change it), so that it is
// loaded once rather than folded into every instruction that reads it. Only where a Vec16 fits one register.
inline void keep_in_register(Vec16& v) {
#ifdef __AVX512F__
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// fast_exp.h's arithmetic on 16 lanes at once (round to nearest by the 1.5 * 2^23 trick instead of nearbyint).
inline Vec16 exp16(Vec16 x) {
  x = x < -87.0f ? Vec16{} - 87.0f : x;
  x = x > 88.0f ? Vec16{} + 88.0f : x;
  const Vec16 t = x * 1.44269504088896341f;
  const Vec16 n = (t + 12582912.0f) - 12582912.0f;
  const Vec16 p = exp2_fraction(t - n);
  const Int16 bits = (__builtin_convertvector(n, Int16) + 127) << 23;
  Vec16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Horizontal max and sum by halving the vector: a short tree, not a chain of 15 dependent steps.
inline float max_lanes(Vec16 v) {
  const Vec8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const Vec8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec8 h = a > b ? a : b;
  const Vec4 c = __builtin_shufflevector(h, h, 0, 1, 2, 3), d = __builtin_shufflevector(h, h, 4, 5, 6, 7);
  const Vec4 q = c > d ? c : d;
  return std::max(std::max(q[0], q[1]), std::max(q[2], q[3]));
}

inline float sum_lanes(Vec16 v) {
  const Vec8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const Vec4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
  return (q[0] + q[2]) + (q[1] + q[3]);
}

// Lane j of the result = the sum of v[j]'s lanes, for 16 vectors at once: a transposing tree of two-source shuffles
// and adds (15 steps of two shuffles and an add, against 16 separate horizontal sums of ~7 steps each). Each level
// halves the partial sums per vector and doubles the vectors' count per result.
inline Vec16 sum_lanes_each(const Vec16* v) {
  Vec16 eight[8], four[4], two[2];
  for (int i = 0; i < 8; ++i)  // [8 partials of v[2i] | 8 of v[2i+1]]
    eight[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                       30, 31);
  for (int i = 0; i < 4; ++i)  // [4 partials of each of 4 vectors]
    four[i] = __builtin_shufflevector(eight[2 * i], eight[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24,
                                      25, 26, 27) +
              __builtin_shufflevector(eight[2 * i], eight[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28,
                                      29, 30, 31);
  for (int i = 0; i < 2; ++i)  // [2 partials of each of 8 vectors]
    two[i] = __builtin_shufflevector(four[2 * i], four[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25,
                                     28, 29) +
             __builtin_shufflevector(four[2 * i], four[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                                     30, 31);
  return __builtin_shufflevector(two[0], two[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(two[0], two[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
