// hipflash — the NVIDIA sm_80+ atom (used by the generic, decode and sm90 schedules): mma.sync
// m16n8k16 (bf16/f16 in, fp32 accumulate), ldmatrix, cp.async and the swizzled tile loader.
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16"): with g = lane / 4 and
// t = lane % 4,
//   A 16x16: a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)
//   B 16x8:  b0 (k 2t..2t+1, n g)  b1 (k 2t+8.., n g)
//   C 16x8:  c0,c1 (g, 2t..2t+1)  c2,c3 (g+8, 2t..2t+1)
#pragma once

#include <cstdint>

#include "common/element.hpp"
#include "common/kv_source.hpp"
#include "common/swizzle.hpp"
#include "hipflash/port/port.hpp"
#include "hipflash/types.hpp"

namespace hipflash::atom::sm80 {

#if defined(HIPFLASH_HAS_MMA_SYNC)

/// c (row g: c0 c1, row g+8: c2 c3) += a * b. The accumulators are passed one by one so that
/// callers can keep them in [row][col] arrays.
template <DType kDType>
__device__ __forceinline__ void mma(float& c0, float& c1, float& c2, float& c3,
                                    const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kDType == DType::bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    static_assert(kDType == DType::f16, "mma.sync m16n8k16: bf16 or f16 operands");
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// ldmatrix on a 32-bit shared-memory address (cheaper to keep in registers than pointers).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/// 16-byte global -> shared copy; `valid == false` writes zeros and reads nothing.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

using common::pack2;  // two floats -> one register of two 16-bit values

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define HIPFLASH_HAS_E4M3_CVT 1  // cvt.rn.f16x2.e4m3x2 (PTX 7.8, sm_89)
inline constexpr bool kHasE4m3Cvt = true;
#else
inline constexpr bool kHasE4m3Cvt = false;
#endif

/// Four e4m3 bytes -> two f16x2 registers: bytes 0-1 -> lo, bytes 2-3 -> hi (exact; NaN stays
/// NaN). Only kernels instantiated for sm_89+ call it (kHasE4m3Cvt).
__device__ __forceinline__ void e4m3x4_to_f16(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(HIPFLASH_HAS_E4M3_CVT)
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(x));
#else
  lo = hi = x;
  port::trap();  // the callers trap first below sm_89 (kHasE4m3Cvt)
#endif
}

/// An f16x2 register as bf16x2 (exact for every value an e4m3 byte holds; NaN stays NaN).
__device__ __forceinline__ uint32_t f16x2_to_bf16x2(uint32_t h) {
  __half2 v;
  *reinterpret_cast<uint32_t*>(&v) = h;
  return pack2<DType::bf16>(__low2float(v), __high2float(v));
}

/// Rows as their source gives them, at each copy (src.row(j)): nothing to resolve ahead.
struct RowsAsGiven {
  template <class Src>
  __device__ __forceinline__ void fetch(const Src&, int64_t, int64_t) {}
  template <class Src>
  __device__ __forceinline__ auto row(const Src& src, int, int64_t j) const { return src.row(j); }
};

/// The rows one thread copies in load_tile / load_tile_by_runs<Tile, kRows> (chunk i: row
/// (threadIdx.x + i * kThreads) / kChunks), resolved ahead of the copy; row0 a multiple of 16.
/// Contiguous rows need nothing; for a paged KV cache (TileRows<..., PagedRows>) `fetch` reads
/// the block-table entries of a tile one tile early, so that the cp.async issue of that tile
/// does not wait on dependent global loads. The K and V caches share the block table: one fetch
/// serves both tiles of a key block.
template <class Tile, int kRows, class Rows>
struct TileRows : RowsAsGiven {};

template <class Tile, int kRows, class T>
struct TileRows<Tile, kRows, common::PagedRows<T>> {
  /// A thread's chunks lie kRowStep rows apart; every page holds at least kGroup rows
  /// (PagedRows::kMinRows), so rows [16 g, 16 g + 16) of a tile share one entry: a thread reads
  /// kGroups entries per tile, not one per chunk — or, where its chunks lie more than a group
  /// apart (kRowStep > kGroup: short rows, an fp8 tile of head dim 64), one entry per chunk.
  static constexpr int kRowStep = Tile::kThreads / Tile::kChunks;
  static constexpr int kGroup = common::PagedRows<T>::kMinRows;
  static constexpr bool kPerChunk = kRowStep > kGroup;
  static constexpr int kEntries = kPerChunk ? kRows / kRowStep : kRows / kGroup;
  static_assert(kPerChunk ? kRowStep % kGroup == 0 && kRows % kRowStep == 0
                          : kRows % kGroup == 0 && kGroup % kRowStep == 0,
                "a thread's first row lies in group 0 (or each chunk in a group of its own)");
  int32_t page[kEntries];

  /// The entries of rows [row0, row0 + kRows); groups at or past len get page 0 (their copies
  /// read nothing), so no table entry past the sequence's pages is read.
  __device__ __forceinline__ void fetch(const common::PagedRows<T>& src, int64_t row0,
                                        int64_t len) {
    const int first = kPerChunk ? int(threadIdx.x) / Tile::kChunks : 0;
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int64_t j = row0 + first + e * (kPerChunk ? kRowStep : kGroup);
      page[e] = j < len ? int32_t(src.page_of(j)) : 0;
    }
  }
  /// Row j = row0 + r of chunk i (r = thread's first row + i * kRowStep).
  __device__ __forceinline__ const T* row(const common::PagedRows<T>& src, int i, int64_t j) const {
    return src.row_in(page[kPerChunk ? i : i * kRowStep / kGroup], j);
  }
};

/// A cache of any page size (common::GatheredRows): every row its own block-table entry, so a
/// thread reads one entry per row it copies (from row threadIdx.x / Tile::kFirstRowThreads on,
/// Tile's kThreads / kChunks rows apart), one tile early, and keeps the page and the row within.
template <class Tile, int kRows, class T>
struct TileRows<Tile, kRows, common::GatheredRows<T>> {
  static constexpr int kRowStep = Tile::kThreads / Tile::kChunks;
  static constexpr int kEntries = kRows / kRowStep;
  static_assert(kRows % kRowStep == 0, "whole rows per thread");
  int32_t page[kEntries];
  int32_t slot[kEntries];

  /// The entries of rows [row0, row0 + kRows); rows at or past len get page 0 (their copies
  /// read nothing), so no table entry past the sequence's pages is read.
  __device__ __forceinline__ void fetch(const common::GatheredRows<T>& src, int64_t row0,
                                        int64_t len) {
    const int first = int(threadIdx.x) / Tile::kFirstRowThreads;
#pragma unroll
    for (int e = 0; e < kEntries; ++e) {
      const int64_t j = row0 + first + e * kRowStep;
      uint32_t s = 0;
      page[e] = j < len ? src.locate(j, s) : 0;
      slot[e] = int32_t(s);
    }
  }
  /// Row j of copy i (the thread's first row + i * kRowStep).
  __device__ __forceinline__ const T* row(const common::GatheredRows<T>& src, int i,
                                          int64_t) const {
    return src.row_in(page[i], slot[i]);
  }
};

/// Copies rows [row0, row0 + kRows) of a [len, D] operand (rows from `src`, a row source of
/// common/kv_source.hpp, at the addresses `rows` resolves: RowsAsGiven, or a TileRows fetched
/// for the same row0 and len) into a swizzled tile; rows >= len and columns >= head_dim are
/// zero-filled (their copies read nothing: the address is only a valid placeholder).
template <class Tile, int kRows, class T, class Rows, class Resolved>
__device__ __forceinline__ void load_tile(T* smem, const Rows& src, const Resolved& rows,
                                          int64_t row0, int64_t len, int head_dim) {
  constexpr int kTotal = kRows * Tile::kChunks;
  constexpr int kE = 16 / int(sizeof(T));  // elements a chunk
  static_assert(kTotal % Tile::kThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int i = 0; i < kTotal / Tile::kThreads; ++i) {
    const int idx = int(threadIdx.x) + i * Tile::kThreads;
    const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
    const bool valid = row0 + r < len && c * kE < head_dim;
    const T* from = valid ? rows.row(src, i, row0 + r) + c * kE : src.base;
    cp_async_16(smem + common::swizzle<Tile::kChunks, kE>(r, c), from, valid);
  }
}

/// load_tile for row0 a multiple of 16: a thread's chunks — one column, kStep rows apart — are
/// addressed from one resolved row per run of Rows::kRunRows rows at the source's row stride
/// (a contiguous tile is one run; a page table's 16-row groups are runs), not one resolved row
/// per chunk, and the row predicate is a 32-bit compare. The decode kernel's key loop is
/// issue-bound with one block per SM, so its loads use this one.
template <class Tile, int kRows, class T, class Rows, class Resolved>
__device__ __forceinline__ void load_tile_by_runs(T* smem, const Rows& src, const Resolved& rows,
                                                  int64_t row0, int64_t len, int head_dim) {
  constexpr int kStep = Tile::kThreads / Tile::kChunks;  // rows between a thread's chunks
  constexpr int kPerThread = kRows / kStep;
  constexpr int kE = 16 / int(sizeof(T));  // elements a chunk
  static_assert(Tile::kThreads % Tile::kChunks == 0 && kRows % kStep == 0, "whole chunk rows");
  static_assert(Rows::kRunRows % kStep == 0 || kStep % Rows::kRunRows == 0,
                "a thread's first row lies in the first run (or each chunk in a run of its own)");
  // Chunks a resolved row serves: a run's worth, at least one (chunks a run or more apart).
  constexpr int kRunChunks = Rows::kRunRows / kStep < 1          ? 1
                             : Rows::kRunRows / kStep < kPerThread ? Rows::kRunRows / kStep
                                                                   : kPerThread;
  const int r0 = int(threadIdx.x) / Tile::kChunks, c = int(threadIdx.x) % Tile::kChunks;
  const int rows_left = len - row0 < kRows ? int(len - row0) : kRows;
  const bool column = c * kE < head_dim;
  const int64_t step = kStep * src.ld;  // from one of a thread's chunks to the next in a run
  const T* at = nullptr;
  if (rows_left == kRows && head_dim == Tile::kChunks * kE) {  // a whole tile: no predicates
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int r = r0 + i * kStep;
      at = i % kRunChunks == 0 ? rows.row(src, i, row0 + r) + c * kE : at + step;
      cp_async_16(smem + common::swizzle<Tile::kChunks, kE>(r, c), at, true);
    }
    return;
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int r = r0 + i * kStep;
    at = i % kRunChunks == 0 ? rows.row(src, i, row0 + r) + c * kE : at + step;
    const bool valid = column && r < rows_left;  // else the copy reads nothing
    cp_async_16(smem + common::swizzle<Tile::kChunks, kE>(r, c), valid ? at : src.base, valid);
  }
}

/// load_tile with the rows as the source gives them.
template <class Tile, int kRows, class T, class Rows>
__device__ __forceinline__ void load_tile(T* smem, const Rows& src, int64_t row0, int64_t len,
                                          int head_dim) {
  load_tile<Tile, kRows>(smem, src, RowsAsGiven{}, row0, len, head_dim);
}

/// An e4m3 operand (an fp8 KV cache) into a kDT tile of load_tile's layout, in two steps so
/// that the global loads overlap the caller's MMAs: `fetch` reads rows [row0, row0 + kRows)
/// (8 bytes a chunk: the chunk load_tile would copy, in the same thread's hands) into
/// registers, rows >= len and columns >= head_dim as zeros; `store` widens them to kDT —
/// exactly, every e4m3 value is one in f16 and bf16 — into the swizzled tile. The scales stay
/// out (the kernel applies them to the scores and to O). sm_89+ (kHasE4m3Cvt).
template <class Tile, int kRows, DType kDT>
struct Fp8Tile {
  static constexpr int kTotal = kRows * Tile::kChunks;  // chunks of 8 elements
  static constexpr int kPerThread = kTotal / Tile::kThreads;
  static_assert(kTotal % Tile::kThreads == 0, "whole chunks per thread");
  uint2 raw[kPerThread];

  template <class Rows>
  __device__ __forceinline__ void fetch(const Rows& src, int64_t row0, int64_t len,
                                        int head_dim) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = int(threadIdx.x) + i * Tile::kThreads;
      const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
      raw[i] = row0 + r < len && c * 8 < head_dim
                   ? __ldg(reinterpret_cast<const uint2*>(src.row(row0 + r) + c * 8))
                   : make_uint2(0u, 0u);
    }
  }
  template <class T>
  __device__ __forceinline__ void store(T* smem) const {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = int(threadIdx.x) + i * Tile::kThreads;
      const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
      uint4 w;
      e4m3x4_to_f16(raw[i].x, w.x, w.y);
      e4m3x4_to_f16(raw[i].y, w.z, w.w);
      if constexpr (kDT == DType::bf16)
        w = make_uint4(f16x2_to_bf16x2(w.x), f16x2_to_bf16x2(w.y), f16x2_to_bf16x2(w.z),
                       f16x2_to_bf16x2(w.w));
      *reinterpret_cast<uint4*>(smem + common::swizzle<Tile::kChunks, 8>(r, c)) = w;
    }
  }
};

#endif  // HIPFLASH_HAS_MMA_SYNC

}  // namespace hipflash::atom::sm80
