// hipflash — host-side f16 / bf16 / e4m3 <-> f32 for the CPU backend, the reference, tests and tools.
// The conversions themselves are the public ones of hipflash/numeric.hpp (round to nearest
// even); this header adds the DType-dispatched element access. Device code uses the vendor
// intrinsics instead.
#pragma once

#include <cstdint>

#include "hipflash/numeric.hpp"
#include "hipflash/types.hpp"

namespace hipflash::detail {

using hipflash::bf16_to_float;
using hipflash::f16_to_float;
using hipflash::float_to_bf16;
using hipflash::float_to_f16;

/// Element idx of a bf16 / f16 / e4m3 buffer (idx in elements of t).
inline float load_as_float(const void* base, int64_t idx, DType t) {
  if (t == DType::e4m3) return e4m3_to_float(static_cast<const uint8_t*>(base)[idx]);
  uint16_t h = static_cast<const uint16_t*>(base)[idx];
  return t == DType::bf16 ? bf16_to_float(h) : f16_to_float(h);
}

inline void store_from_float(void* base, int64_t idx, float v, DType t) {
  if (t == DType::e4m3) {
    static_cast<uint8_t*>(base)[idx] = float_to_e4m3(v);
    return;
  }
  static_cast<uint16_t*>(base)[idx] = t == DType::bf16 ? float_to_bf16(v) : float_to_f16(v);
}

}  // namespace hipflash::detail
