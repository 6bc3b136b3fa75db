// hipflash — the Hopper (sm_90a) warpgroup MMA atom: shared-memory matrix descriptors for the
// 128-byte-swizzled tiles the sm90 kernel keeps, and the wgmma fence / commit / wait.
//
// Tile layout ("panelled SW128"): a [rows x D] tile of 16-bit elements is stored as D / 64
// panels of [rows x 64]; a panel row is one 128-byte line whose 16-byte chunk c sits at chunk
// c ^ (row % 8). Panels start at multiples of 1024 bytes, so that pattern is the hardware's
// 128-byte swizzle of the absolute address (PTX ISA, "Shared memory matrix layout").
#pragma once

#include <cstdint>

#include "hipflash/port/port.hpp"

namespace hipflash::atom::sm90 {

/// Byte offset of 16-byte chunk `chunk` (of D / 8) of row `row` in a panelled SW128 tile.
template <int kRows>
__host__ __device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return uint32_t((chunk / 8) * kRows * 128 + row * 128 + ((chunk % 8) ^ (row % 8)) * 16);
}

#if defined(HIPFLASH_HAS_WGMMA)

namespace wgmma {

/// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading- and
/// stride-dimension byte offsets (all >> 4), the swizzle in bits 62-63 (1: 128-byte, 2: 64-byte).
__device__ __forceinline__ uint64_t make_desc(uint32_t smem_addr, uint32_t lbo, uint32_t sbo,
                                              uint32_t swizzle = 1) {
  return uint64_t((smem_addr & 0x3FFFF) >> 4) | uint64_t((lbo & 0x3FFFF) >> 4) << 16 |
         uint64_t((sbo & 0x3FFFF) >> 4) << 32 | uint64_t(swizzle) << 62;
}

/// K-major operand (Q or K: the reduction dim is contiguous): rows at 128 B, 8-row groups at
/// 1024 B; the 16-wide k-step lies inside one 128-byte line (LBO unused).
__device__ __forceinline__ uint64_t desc_k_major(uint32_t addr) { return make_desc(addr, 16, 1024); }

/// The same for rows of kRowBytes (128, or 64 with the 64-byte swizzle: fp8 at head dim 64):
/// 8-row groups 8 kRowBytes apart.
template <int kRowBytes>
__device__ __forceinline__ uint64_t desc_k_major_rows(uint32_t addr) {
  static_assert(kRowBytes == 128 || kRowBytes == 64, "128- or 64-byte swizzled rows");
  return make_desc(addr, 16, 8 * kRowBytes, kRowBytes == 128 ? 1 : 2);
}

/// MN-major operand (V in P V: the output dim is contiguous): 64-wide panels `panel_bytes`
/// apart (LBO), 8-key groups at 1024 B (SBO).
__device__ __forceinline__ uint64_t desc_mn_major(uint32_t addr, uint32_t panel_bytes) {
  return make_desc(addr, panel_bytes, 1024);
}

/// Orders this thread's register writes before the warpgroup's next wgmma reads them.
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/// Keeps the compiler from moving accesses of accumulator registers across wait / issue.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

}  // namespace wgmma

/// stmatrix.x4: four 8 x 8 16-bit matrices into shared memory, a warp's lane l giving the
/// address of row l % 8 of matrix l / 8 (16 bytes) and its register j the pair at row l / 4,
/// columns 2 (l % 4) and + 1 of matrix j — an mma accumulator fragment's layout.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

/// Makes this thread's generic-proxy shared-memory writes (cp.async included, once waited on)
/// visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/// Zeroes rows [first, kRows) of a tile of kPanels panels with 128-byte rows (the TMA's
/// [kRows x 64] boxes of 16-bit elements: a row is 128 contiguous bytes of each panel, whatever
/// the swizzle), shared by kThreads threads, `thread` this one's index among them: the rows a
/// varlen tile's box read from the next sequence, whose Inf or NaN would otherwise reach this
/// one's sums as 0 x Inf. The caller fences (fence_proxy_async) and meets before a wgmma reads
/// the tile.
template <int kRows, int kPanels, int kThreads>
__device__ __forceinline__ void zero_rows(uint32_t tile, int first, int thread) {
  const int lo = first < 0 ? 0 : first;
  const int per_panel = (kRows - lo) * 8;  // 16-byte chunks
  for (int i = thread; i < per_panel * kPanels; i += kThreads) {
    const int panel = i / per_panel, rest = i % per_panel;
    const uint32_t addr = tile + uint32_t(panel * kRows + lo + rest / 8) * 128 +
                          uint32_t(rest % 8) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
  }
}

#endif  // HIPFLASH_HAS_WGMMA

}  // namespace hipflash::atom::sm90
