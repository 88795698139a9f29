// The AMX tile operations paged_prefill_amx.cpp is written in: a 2 x 2 block of 16 x 16 fp32 results (or 1 x 2 where
// only 16 rows are left) accumulated by bf16 tile dot products (TDPBF16PS). Tiles 0-3 hold the results C[i][j] (i:
// rows 0-15 / 16-31, j: columns 0-15 / 16-31), tiles 4-5 the two row halves of A (16 rows x 32 bf16, 64 bytes), tiles
// 6-7 the two column halves of B (16 rows x 16 pairs of bf16 — VNNI layout: B row k holds, for each column n, the
// elements 2k and 2k + 1 of the reduction — the second half 64 bytes after the first). Strides are in bytes.
//
// Built with -DBATCHGEN_AMX_EMULATE the same operations run as scalar C++ on per-thread arrays, bit for bit the
// instructions' layout (the products summed in fp32), so the kernel's packing, tiling and softmax are tested on CPUs
// without AMX (tests/test_cpu_kernels_amx.py). What emulation cannot test is the instructions themselves: those run
// where the CPU has AMX (tests/test_cpu_prefill_amx.py, skipped elsewhere).
#pragma once

#include <cstdint>
#include <cstring>

#ifndef BATCHGEN_AMX_EMULATE
#include <immintrin.h>
#endif

namespace amx {

constexpr int kTileRows = 16, kTileBytes = 64;

struct alignas(64) TileConfig {  // LDTILECFG's 64-byte operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#ifdef BATCHGEN_AMX_EMULATE

constexpr bool kEmulated = true;

struct Tiles {
  alignas(64) uint8_t data[8][kTileRows][kTileBytes];
};
inline thread_local Tiles tiles;

inline void configure() {}
inline void release() {}

inline void zero(int t) { std::memset(tiles.data[t], 0, sizeof tiles.data[t]); }
inline void load(int t, const void* base, int64_t stride) {
  for (int r = 0; r < kTileRows; ++r)
    std::memcpy(tiles.data[t][r], static_cast<const uint8_t*>(base) + r * stride, kTileBytes);
}
inline void store(int t, void* base, int64_t stride) {
  for (int r = 0; r < kTileRows; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, tiles.data[t][r], kTileBytes);
}
inline float bf16_to_float(const uint8_t* p) {  // bf16 is the top half of an fp32
  uint16_t half;
  std::memcpy(&half, p, 2);
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// C[m][n] += sum over k of A[m][2k] * B[k][2n] + A[m][2k + 1] * B[k][2n + 1], in fp32.
inline void dpbf16ps(int c, int a, int b) {
  for (int m = 0; m < kTileRows; ++m)
    for (int n = 0; n < 16; ++n) {
      float sum;
      std::memcpy(&sum, tiles.data[c][m] + 4 * n, 4);
      for (int k = 0; k < 16; ++k) {
        sum += bf16_to_float(tiles.data[a][m] + 4 * k) * bf16_to_float(tiles.data[b][k] + 4 * n);
        sum += bf16_to_float(tiles.data[a][m] + 4 * k + 2) * bf16_to_float(tiles.data[b][k] + 4 * n + 2);
      }
      std::memcpy(tiles.data[c][m] + 4 * n, &sum, 4);
    }
}

inline void memory_barrier() {}

#define AMX_ZERO(t) amx::zero(t)
#define AMX_LOAD(t, base, stride) amx::load(t, base, stride)
#define AMX_STORE(t, base, stride) amx::store(t, base, stride)
#define AMX_DPBF16PS(c, a, b) amx::dpbf16ps(c, a, b)

#else

constexpr bool kEmulated = false;

// Every tile 16 rows x 64 bytes, for both products. Not _tile_loadconfig: GCC's declares only the operand's first 8
// bytes as read, so the compiler may drop the stores of the rest.
inline void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(config));
}
inline void release() { _tile_release(); }

// GCC's tile loads do not declare the memory they read: without this the compiler may move the stores that fill a
// buffer past the load that reads it, or the next stores into it before.
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

// The intrinsics name their tiles by literal numbers (they are pasted into the instruction), hence macros.
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define AMX_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)

#endif

inline const uint8_t* bytes(const void* p, int64_t offset) { return static_cast<const uint8_t*>(p) + offset; }
inline uint8_t* bytes(void* p, int64_t offset) { return static_cast<uint8_t*>(p) + offset; }

template <bool kTwoRows>
inline void zero_c() {
  AMX_ZERO(0);
  AMX_ZERO(1);
  if (kTwoRows) {
    AMX_ZERO(2);
    AMX_ZERO(3);
  }
}

template <bool kTwoRows>
inline void load_c(const float* c, int64_t stride) {
  memory_barrier();
  AMX_LOAD(0, c, stride);
  AMX_LOAD(1, bytes(c, kTileBytes), stride);
  if (kTwoRows) {
    AMX_LOAD(2, bytes(c, kTileRows * stride), stride);
    AMX_LOAD(3, bytes(c, kTileRows * stride + kTileBytes), stride);
  }
  memory_barrier();
}

template <bool kTwoRows>
inline void store_c(float* c, int64_t stride) {
  AMX_STORE(0, c, stride);
  AMX_STORE(1, bytes(c, kTileBytes), stride);
  if (kTwoRows) {
    AMX_STORE(2, bytes(c, kTileRows * stride), stride);
    AMX_STORE(3, bytes(c, kTileRows * stride + kTileBytes), stride);
  }
}

// C += A (16 or 32 rows x 32 bf16 at a) . B (16 rows of 32 columns' pairs at b).
template <bool kTwoRows>
inline void multiply(const void* a, int64_t a_stride, const void* b, int64_t b_stride) {
  memory_barrier();
  AMX_LOAD(4, a, a_stride);
  AMX_LOAD(6, b, b_stride);
  AMX_LOAD(7, bytes(b, kTileBytes), b_stride);
  AMX_DPBF16PS(0, 4, 6);
  AMX_DPBF16PS(1, 4, 7);
  if (kTwoRows) {
    AMX_LOAD(5, bytes(a, kTileRows * a_stride), a_stride);
    AMX_DPBF16PS(2, 5, 6);
    AMX_DPBF16PS(3, 5, 7);
  }
  memory_barrier();
}

}  // namespace amx
