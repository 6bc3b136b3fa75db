// hipflash — shared by every schedule: where an operand's rows live. The tile loaders ask a row
// source for the address of row j instead of computing `base + j * ld` themselves, so that a
// paged K/V cache (a page table: row j of sequence b lives in page table[b][j / page]) is a
// second source type, not a second copy of every loader.
#pragma once

#include <cstdint>

#include "hipflash/detail/fast_div.hpp"
#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD

namespace hipflash::common {

/// Where a kernel instantiation reads K and V from (the launcher picks one per call): rows at
/// a fixed stride (dense, varlen, a contiguous cache), the pages of a paged cache whose page
/// size is a power of two of at least 16 rows (PagedRows: a 16-row group shares a page), or
/// those of any other page size (GatheredRows: each row through the block table on its own).
enum class KvRows { contiguous, pages, gathered };

/// Rows at a fixed stride from row 0: q, k and v of the dense and varlen layouts.
template <class T>
struct ContiguousRows {
  const T* base;  ///< row 0 (of the sequence, batch and head)
  int64_t ld;     ///< elements from one row to the next

  /// Rows from any 16-aligned row on that sit ld apart (every row: the source is one run).
  static constexpr int kRunRows = 1 << 30;

  HIPFLASH_HD const T* row(int64_t j) const { return base + j * ld; }
};

/// Rows of a paged KV cache: row j of the sequence is row j % 2^page_shift of page
/// table[j >> page_shift]; pages are page_stride elements apart, rows ld apart within a page.
/// The table entries a call reaches are checked (in range) before the launch for CPU tensors;
/// a GPU call's table is not copied back to be checked (docs/spec.md §7: an entry out of range
/// is the caller's error). T is const for the loaders, non-const for the cache append.
template <class T>
struct PagedRows {
  T* base;               ///< row 0 of page 0 (the head offset applied)
  const int32_t* table;  ///< this sequence's block-table row
  int64_t page_stride;   ///< elements from one page to the next
  int64_t ld;            ///< elements from one row to the next within a page
  int page_shift;        ///< log2(page size)

  /// The smallest page (hipflash::kGroupedPageSize; the launcher's choice): rows
  /// [16 g, 16 g + 16) of a sequence always share a page, ld apart.
  static constexpr int kMinRows = 16;
  static constexpr int kRunRows = kMinRows;

  /// The page holding row j: one block-table load.
  HIPFLASH_HD int64_t page_of(int64_t j) const { return table[j >> page_shift]; }
  /// Row j, given the page that holds it (page_of(j), possibly read ahead of time).
  HIPFLASH_HD T* row_in(int64_t page, int64_t j) const {
    return base + page * page_stride + (j & ((int64_t(1) << page_shift) - 1)) * ld;
  }
  HIPFLASH_HD T* row(int64_t j) const { return row_in(page_of(j), j); }
};

/// Rows of a paged KV cache of any page size (1 included: SGLang's token-granular cache), from
/// cache row `first` on (FlashAttention's cache_leftpad): row j of the sequence is cache row
/// r = first + j, row r % page of page table[r / page], the quotient by a host-prepared divisor
/// (r < 2^31, checked before the launch). No two rows are assumed to share a page, so the tile
/// loaders resolve every row on its own (kRunRows = 1; TileRows reads each thread's entries a
/// tile ahead).
template <class T>
struct GatheredRows {
  T* base;               ///< row 0 of page 0 (the head offset applied)
  const int32_t* table;  ///< this sequence's block-table row
  int64_t page_stride;   ///< elements from one page to the next
  int64_t ld;            ///< elements from one row to the next within a page
  detail::FastDiv page;  ///< the page size
  int64_t first = 0;     ///< the cache row of the sequence's row 0

  static constexpr int kRunRows = 1;

  /// Row `slot` of page `page_index`.
  HIPFLASH_HD T* row_in(int64_t page_index, int64_t slot) const {
    return base + page_index * page_stride + slot * ld;
  }
  /// The block-table entry of the sequence's row j (one load) and its row in that page.
  HIPFLASH_HD int32_t locate(int64_t j, uint32_t& slot) const {
    return table[page.divmod(uint32_t(first + j), slot)];
  }
  /// Elements from base to row j: one block-table load.
  HIPFLASH_HD int64_t offset(int64_t j) const {
    uint32_t slot;
    const int32_t entry = locate(j, slot);
    return int64_t(entry) * page_stride + int64_t(slot) * ld;
  }
  HIPFLASH_HD T* row(int64_t j) const { return base + offset(j); }
};

}  // namespace hipflash::common
