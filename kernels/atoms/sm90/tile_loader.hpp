// hipflash — the Hopper (sm_90a) cp.async tile loader: [kRows x D] tiles of a [len, D] operand
// into the panelled SW128 layout the wgmma descriptors read (atoms/sm90/wgmma.hpp). Used by the
// cp.async sm90 forward kernel and the sm90 backward.
#pragma once

#include <cstdint>

#include "atoms/sm90/wgmma.hpp"
#include "hipflash/port/port.hpp"

namespace hipflash::atom::sm90 {

#if defined(HIPFLASH_HAS_WGMMA)

/// Copies [kRows x D] tiles of one [len, D] operand (row stride `ld`) into panelled SW128 tiles
/// with cp.async; rows >= len and columns >= head_dim are zero-filled (and never read). Each
/// thread owns one 16-byte column chunk of every kStep-th row, so its source pointer, shared
/// offset and column check are set up once and a tile costs a pointer bump per row.
template <int kRows, int kHeadDim, int kThreads, class T>
struct TileLoader {
  static constexpr int kChunks = kHeadDim / 8, kStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kStep == 0 && kStep % 8 == 0,
                "whole rows per pass; a pass keeps the row's swizzle phase");
  const T* src;      ///< this thread's chunk of row 0
  int64_t ld;
  uint32_t smem_off;  ///< this thread's chunk of row 0 in a tile
  int row;            ///< this thread's first row
  bool col_ok;

  __device__ __forceinline__ TileLoader(const T* gmem, int64_t ld_, int head_dim) : ld(ld_) {
    const int c = int(threadIdx.x) % kChunks;
    row = int(threadIdx.x) / kChunks;
    col_ok = c * 8 < head_dim;
    src = gmem + row * ld + c * 8;
    smem_off = sw128_offset<kRows>(row, c);
  }

  /// Rows [row0, row0 + kRows) into the tile at shared address `dst`.
  __device__ __forceinline__ void load(uint32_t dst, int64_t row0, int64_t len) const {
    const T* s = src + row0 * ld;
#pragma unroll
    for (int i = 0; i < kRows / kStep; ++i) {
      const bool valid = col_ok && row0 + row + i * kStep < len;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                       dst + smem_off + i * kStep * 128),
                   "l"(valid ? s + i * kStep * ld : src), "r"(valid ? 16 : 0));
    }
  }
};

#endif  // HIPFLASH_HAS_WGMMA

}  // namespace hipflash::atom::sm90
