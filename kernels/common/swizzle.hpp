// hipflash — shared by every schedule: the XOR swizzle of 16-bit tiles in shared memory.
#pragma once

#include "hipflash/port/port.hpp"

namespace hipflash::common {

/// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][kChunks * 8] tile,
/// swizzled per 128-byte line: chunk' = chunk ^ (row % 8). Conflict-free for ldmatrix (8 rows,
/// one chunk) and for 16-byte row-contiguous stores. Since the XOR only touches the low three
/// bits, chunk (2s + x) of a row r maps to byte offset ((32 s) ^ (16 (x ^ r % 8))): the
/// mainloop keeps the per-lane term and XORs in the per-step constant.
template <int kChunks>
__host__ __device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(kChunks % 8 == 0, "rows are whole 128-byte lines");
  return row * kChunks * 8 + (chunk ^ (row & 7)) * 8;
}

}  // namespace hipflash::common
