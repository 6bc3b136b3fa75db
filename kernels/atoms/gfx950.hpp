// hipflash — the AMD gfx950 (CDNA4, MI350) atom of the dualwave schedule: MFMA 32x32x16 with
// fp32 accumulation, the transposed LDS read (ds_read_b64_tr_b16), the lane-pair swap
// (v_permlane32_swap) and issue priority. COMPILE-CHECKED ONLY (Debian's clang 22): no AMD GPU
// has run it.
//
// MFMA 32x32x16 (D = A B + C; A 32x16, B 16x32), lane l = 32 g + i (g = l / 32, i = l % 32):
//   a[e] = A[i][8g + e]     b[e] = B[8g + e][i]     d[j] = D[8 (j / 4) + 4 g + j % 4][i]
// Slot (g, e) of A meets slot (g, e) of B, so the k order is the caller's to choose as long as
// both operands use the same one.
#pragma once

#include <cstdint>

#include "hipflash/port/port.hpp"
#include "hipflash/types.hpp"

namespace hipflash::atom::gfx950 {

#if defined(HIPFLASH_IS_GFX950)

using f32x16 = float __attribute__((ext_vector_type(16)));
using u32x2 = unsigned __attribute__((ext_vector_type(2)));

/// Eight 16-bit operand elements of one lane, as the MFMA builtin of the dtype takes them.
template <DType kDType>
struct Frag8;  // bf16 and f16 only: no default
template <>
struct Frag8<DType::bf16> {
  using elem = __bf16;  ///< converts from float with v_cvt_pk_bf16_f32 (round to nearest even)
  using type = __bf16 __attribute__((ext_vector_type(8)));
  using half = __bf16 __attribute__((ext_vector_type(4)));
};
template <>
struct Frag8<DType::f16> {
  using elem = _Float16;
  using type = _Float16 __attribute__((ext_vector_type(8)));
  using half = _Float16 __attribute__((ext_vector_type(4)));
};
template <DType kDType>
using frag8_t = typename Frag8<kDType>::type;
template <DType kDType>
using frag_elem_t = typename Frag8<kDType>::elem;

/// d = a b + d on the 32x32x16 matrix cores (8 passes).
template <DType kDType>
__device__ __forceinline__ f32x16 mfma32(const frag8_t<kDType>& a, const frag8_t<kDType>& b,
                                         f32x16 d) {
  if constexpr (kDType == DType::bf16)
    return __builtin_amdgcn_mfma_f32_32x32x16_bf16(a, b, d, 0, 0, 0);
  else if constexpr (kDType == DType::f16)
    return __builtin_amdgcn_mfma_f32_32x32x16_f16(a, b, d, 0, 0, 0);
  else
    static_assert(unsupported_dtype<kDType>, "MFMA 32x32x16: bf16 or f16 operands");
}

/// 16 bytes of LDS at `p` (16-byte aligned) as one 8-element fragment (ds_read_b128).
template <DType kDType, class T>
__device__ __forceinline__ frag8_t<kDType> lds_frag8(const T* p) {
  return *reinterpret_cast<const frag8_t<kDType>*>(p);
}

/// ds_read_b64_tr_b16: within each 16-lane group, lane i points at 4 consecutive elements of
/// row i / 4 of a 4 x 16 block; lane i receives column i of it (element e from row e).
template <DType kDType, class T>
__device__ __forceinline__ typename Frag8<kDType>::half lds_read_tr(const T* p) {
  using Half = typename Frag8<kDType>::half;
  if constexpr (kDType == DType::bf16) {
    return __builtin_amdgcn_ds_read_tr16_b64_v4bf16(
        (__attribute__((address_space(3))) Half*)(p));
  } else if constexpr (kDType == DType::f16) {
    using Fp16x4 = __fp16 __attribute__((ext_vector_type(4)));  // the builtin's own type
    return __builtin_bit_cast(
        Half, __builtin_amdgcn_ds_read_tr16_b64_v4f16((__attribute__((address_space(3))) Fp16x4*)(p)));
  } else {
    static_assert(unsupported_dtype<kDType>, "ds_read_b64_tr_b16: bf16 or f16");
  }
}

/// The values of `x` in the lane pair (l, l ^ 32), in both lanes: {lower lane's, upper lane's}
/// (v_permlane32_swap, a VALU op: no LDS round trip). Scalars are taken out of the result
/// vector first: clang 22 misreads a bit_cast of a vector element other than 0.
struct LanePair {
  float lo, hi;
};
__device__ __forceinline__ LanePair lane_pair(float x) {
  const unsigned u = __builtin_bit_cast(unsigned, x);
  const u32x2 r = __builtin_amdgcn_permlane32_swap(u, u, false, false);
  const unsigned lo = r.x, hi = r.y;
  return {__builtin_bit_cast(float, lo), __builtin_bit_cast(float, hi)};
}
/// max / sum over the lane pair, the same in both lanes (symmetric: no per-lane select).
__device__ __forceinline__ float pair_max(float x) {
  const LanePair p = lane_pair(x);
  return fmaxf(p.lo, p.hi);
}
__device__ __forceinline__ float pair_sum(float x) {
  const LanePair p = lane_pair(x);
  return p.lo + p.hi;
}

/// Scheduling hints (LLVM's AMDGPU instruction groups): `n` instructions of a class in order.
enum SchedClass : int { kSchedMfma = 0x008, kSchedDsRead = 0x100 };
#define HIPFLASH_SCHED_GROUP(cls, n) __builtin_amdgcn_sched_group_barrier((cls), (n), 0)

#endif  // HIPFLASH_IS_GFX950

}  // namespace hipflash::atom::gfx950
