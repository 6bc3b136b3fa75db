// hipflash — the AMD CDNA atom (gfx90a, gfx94x, gfx950; wave64): MFMA 16x16x16 bf16_1k / f16
// with fp32 accumulation, its operand fragments, and the padded-LDS tile loader.
// COMPILE-CHECKED ONLY: no AMD GPU has run it.
//
// MFMA 16x16x16 fragments, lane l = 16 * kg + i (kg = l / 16, i = l % 16):
//   A[16x16]: A[i][4kg .. 4kg+3]   B[16x16]: B[4kg .. 4kg+3][i]   D[16x16]: D[4kg .. 4kg+3][i]
#pragma once

#include <cstdint>

#include "hipflash/port/port.hpp"
#include "hipflash/types.hpp"

namespace hipflash::atom::cdna {

#if defined(HIPFLASH_HAS_MFMA)

using half4 = _Float16 __attribute__((ext_vector_type(4)));
using short4_t = short __attribute__((ext_vector_type(4)));
using float4_t = float __attribute__((ext_vector_type(4)));

/// Four 16-bit elements of one operand fragment, as the MFMA builtin of the dtype wants them.
template <DType kDType>
struct Frag;  // bf16 and f16 only: no default
template <>
struct Frag<DType::f16> {
  using type = half4;
};
template <>
struct Frag<DType::bf16> {
  using type = short4_t;
};

template <DType kDType>
__device__ __forceinline__ float4_t mfma16(const typename Frag<kDType>::type& a,
                                           const typename Frag<kDType>::type& b, float4_t c) {
  if constexpr (kDType == DType::bf16)
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);
  else if constexpr (kDType == DType::f16)
    return __builtin_amdgcn_mfma_f32_16x16x16f16(a, b, c, 0, 0, 0);
  else
    static_assert(unsupported_dtype<kDType>, "MFMA 16x16x16: bf16 or f16 operands");
}

template <DType kDType>
__device__ __forceinline__ typename Frag<kDType>::type load4(const void* p) {
  return *reinterpret_cast<const typename Frag<kDType>::type*>(p);  // 8-byte aligned
}

template <DType kDType>
__device__ __forceinline__ uint16_t to_bits(float x) {
  if constexpr (kDType == DType::bf16) {
    port::bf16_t h = port::from_float<port::bf16_t>(x);
    return *reinterpret_cast<uint16_t*>(&h);
  } else {
    static_assert(kDType == DType::f16, "to_bits: bf16 or f16");
    port::f16_t h = port::from_float<port::f16_t>(x);
    return *reinterpret_cast<uint16_t*>(&h);
  }
}

/// Copies rows [row0, row0 + kRows) of a [len, D] operand into a padded LDS tile, 16 bytes per
/// thread-step; rows >= len and columns >= head_dim are zero.
template <class Tile, int kRows, class T, class Rows>
__device__ __forceinline__ void load_tile(T* lds, const Rows& src, int64_t row0, int64_t len,
                                          int head_dim) {
  for (int idx = int(threadIdx.x); idx < kRows * Tile::kChunks; idx += Tile::kThreads) {
    const int r = idx / Tile::kChunks, c = idx % Tile::kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + r < len && c * 8 < head_dim)
      v = *reinterpret_cast<const uint4*>(src.row(row0 + r) + c * 8);
    *reinterpret_cast<uint4*>(lds + r * Tile::kPitch + c * 8) = v;
  }
}

#endif  // HIPFLASH_HAS_MFMA

}  // namespace hipflash::atom::cdna
