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

// ---- fp8 (e4m3): MFMA 16x16x32 on gfx94x (E4M3 "fnuz") and gfx950 (OCP E4M3) ----------------
//
//   A[16x32]: A[i][8kg .. 8kg+7]   B[32x16]: B[8kg .. 8kg+7][i]   D[16x16]: D[4kg .. 4kg+3][i]
// An operand fragment is eight bytes (one 64-bit register pair).
#if (defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__)) && \
    __has_builtin(__builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8) &&                               \
    __has_builtin(__builtin_amdgcn_cvt_pk_fp8_f32)
#define HIPFLASH_HAS_MFMA_FP8 1
#endif
#if defined(__gfx950__)
/// The MFMA's e4m3 is PyTorch's float8_e4m3fn (OCP): q, k and v go in as they are.
inline constexpr bool kFp8Fnuz = false;
#else
/// gfx94x's e4m3 has exponent bias 8 (float8_e4m3fnuz): an OCP byte read so is half its value,
/// its NaN (0x80) is OCP's -0 and OCP's NaN (0x7f / 0xff) is +-240 there — fnuz_of fixes those.
inline constexpr bool kFp8Fnuz = true;
#endif
/// The factor an fp8 product of two operands read this way is short of (fnuz: 1/2 an operand).
inline constexpr float kFp8OperandScale = kFp8Fnuz ? 2.f : 1.f;

/// Eight OCP e4m3 bytes as the MFMA reads them: on gfx94x each NaN (0x7f / 0xff) becomes the
/// fnuz NaN 0x80 and -0 (0x80) becomes 0, so that no NaN turns finite and no zero NaN; the
/// rest keep their bits (half their value). On gfx950, themselves.
__device__ __forceinline__ uint64_t fnuz_of(uint64_t x) {
  if constexpr (!kFp8Fnuz) {
    return x;
  } else {
    constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7full, kHigh = 0x8080808080808080ull;
    constexpr uint64_t kOnes = 0x0101010101010101ull;
    const uint64_t low = x & kLow7;  // no byte's sum below carries into the next
    const uint64_t nan = ((low + kOnes) & kHigh) >> 7;                // low == 0x7f
    const uint64_t neg_zero = ((~(low + kLow7) & kHigh) & x) >> 7;    // low == 0, sign set
    const uint64_t keep = ~((nan | neg_zero) * 0xff);                 // 0xff a byte kept
    return (x & keep) | (nan << 7);
  }
}

/// Two floats -> two e4m3 bytes of the MFMA's format (low byte a), round to nearest even,
/// saturated (v_cvt_pk_fp8_f32; NaN stays NaN).
__device__ __forceinline__ uint32_t pack2_fp8(float a, float b) {
#if defined(HIPFLASH_HAS_MFMA_FP8)
  return uint32_t(__builtin_amdgcn_cvt_pk_fp8_f32(a, b, 0, false)) & 0xffffu;
#else
  (void)a, (void)b;
  return 0;  // no fp8 here (the kernel body traps before)
#endif
}

/// D += A B, MFMA 16x16x32 with e4m3 operands (this arch's format: fnuz_of).
__device__ __forceinline__ float4_t mfma16_fp8(uint64_t a, uint64_t b, float4_t c) {
#if defined(HIPFLASH_HAS_MFMA_FP8)
  return __builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8(static_cast<long>(a), static_cast<long>(b), c,
                                                     0, 0, 0);
#else
  (void)a, (void)b;
  return c;
#endif
}

#endif  // HIPFLASH_HAS_MFMA

}  // namespace hipflash::atom::cdna
