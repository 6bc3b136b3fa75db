// hipflash — shared by every schedule: where an operand's rows live. The tile loaders ask a row
// source for the address of row j instead of computing `base + j * ld` themselves, so that a
// paged K/V cache (a page table: row j of sequence b lives in page table[b][j / page]) is a
// second source type, not a second copy of every loader.
#pragma once

#include <cstdint>

#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD

namespace hipflash::common {

/// Rows at a fixed stride from row 0: q, k and v of the dense and varlen layouts.
template <class T>
struct ContiguousRows {
  const T* base;  ///< row 0 (of the sequence, batch and head)
  int64_t ld;     ///< elements from one row to the next

  HIPFLASH_HD const T* row(int64_t j) const { return base + j * ld; }
};

}  // namespace hipflash::common
