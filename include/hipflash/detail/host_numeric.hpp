// hipflash — host-side f16 / bf16 <-> f32 for the CPU backend, the reference, tests and tools.
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

inline float load_as_float(const void* base, int64_t idx, DType t) {
  uint16_t h = static_cast<const uint16_t*>(base)[idx];
  return t == DType::bf16 ? bf16_to_float(h) : f16_to_float(h);
}

inline void store_from_float(void* base, int64_t idx, float v, DType t) {
  static_cast<uint16_t*>(base)[idx] = t == DType::bf16 ? float_to_bf16(v) : float_to_f16(v);
}

}  // namespace hipflash::detail
