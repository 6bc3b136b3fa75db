// hipflash — shared by every schedule: the device element type of each DType, spelled out per
// dtype (a dtype without a specialisation does not compile: there is no "bf16, else f16"
// default), with its size, which the tiles' byte counts use, and the rounding of two floats
// into one 32-bit register of the type (pack2).
#pragma once

#include <cstdint>

#include "hipflash/port/port.hpp"
#include "hipflash/types.hpp"

namespace hipflash::common {

template <DType kDType>
struct Element;  // no primary definition

template <>
struct Element<DType::f16> {
  using type = port::f16_t;
  static constexpr int kBytes = 2;
};
template <>
struct Element<DType::bf16> {
  using type = port::bf16_t;
  static constexpr int kBytes = 2;
};

template <DType kDType>
using element_t = typename Element<kDType>::type;

#if defined(__CUDACC__) || defined(__HIPCC__)
/// Two floats -> one register of two 16-bit values (low half = x), rounded to nearest even:
/// one conversion instruction on NVIDIA; on AMD the two values' bits.
template <DType kDType>
__device__ __forceinline__ uint32_t pack2(float x, float y) {
#if defined(HIPFLASH_PLATFORM_AMD)
  using T = element_t<kDType>;
  const T lo = port::from_float<T>(x), hi = port::from_float<T>(y);
  return uint32_t(__builtin_bit_cast(uint16_t, lo)) | uint32_t(__builtin_bit_cast(uint16_t, hi)) << 16;
#else
  if constexpr (kDType == DType::bf16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    static_assert(kDType == DType::f16, "pack2: bf16 or f16");
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
#endif
}
#endif  // device compiler

}  // namespace hipflash::common
