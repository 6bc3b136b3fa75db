// hipflash — shared by every schedule: the XOR swizzle of 16-bit tiles in shared memory.
#pragma once

#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD (and port.hpp on a device compiler)

namespace hipflash::common {

/// The XOR a row's 16-byte chunks take in a tile of kChunks chunks a row (swizzle below):
/// row % 8 for rows of whole 128-byte lines; (row / 2) % 4 for 64-byte rows (an fp8 tile of
/// head dim 64), two rows a line, so that 8 consecutive rows at one chunk still fall on 8
/// different 16-byte bank groups.
template <int kChunks>
HIPFLASH_HD int swizzle_xor(int row) {
  static_assert(kChunks % 8 == 0 || kChunks == 4, "rows of whole 128-byte lines, or 64 bytes");
  return kChunks == 4 ? (row >> 1) & 3 : row & 7;
}

/// Element offset of 16-byte chunk `chunk` of row `row` in a [rows][kChunks * kChunkElems]
/// tile (kChunkElems: 8 16-bit or 16 8-bit elements a chunk), swizzled per 128-byte line:
/// chunk' = chunk ^ swizzle_xor(row) (row % 8 for 128-byte rows and longer). Conflict-free for
/// ldmatrix (8 rows, one chunk) and for 16-byte row-contiguous stores. Since the XOR only
/// touches the low three bits, chunk (2s + x) of a row r maps to byte offset
/// ((32 s) ^ (16 (x ^ swizzle_xor(r)))): the mainloop keeps the per-lane term and XORs in the
/// per-step constant.
template <int kChunks, int kChunkElems = 8>
HIPFLASH_HD int swizzle(int row, int chunk) {
  return (row * kChunks + (chunk ^ swizzle_xor<kChunks>(row))) * kChunkElems;
}

/// Element offset of chunk `chunk` of row `row` in a staged output tile: kPanelRows 0 is the
/// row-major tile of swizzle<kChunks>; else the tile is panel-major, kChunks / 8 panels of
/// [kPanelRows][64] elements (128-byte rows, each panel swizzle<8>) — what a TMA box 64 columns
/// wide with the 128-byte swizzle reads, so one bulk tensor store per panel writes it out. With
/// one panel (64 columns) the two layouts are the same.
template <int kChunks, int kPanelRows>
HIPFLASH_HD int staged_swizzle(int row, int chunk) {
  if constexpr (kPanelRows == 0 || kChunks == 8)  // row-major, or one panel
    return swizzle<kChunks>(row, chunk);
  else
    return (chunk >> 3) * (kPanelRows * 64) + swizzle<8>(row, chunk & 7);
}

}  // namespace hipflash::common
