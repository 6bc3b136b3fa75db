// hipflash — host-side f16 / bf16 <-> f32 conversion (round to nearest even), for the CPU
// backend, tests and tools. Device code uses the vendor intrinsics instead.
#pragma once

#include <cstdint>
#include <cstring>

#include "hipflash/types.hpp"

namespace hipflash::detail {

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    float f = float(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
    return sign ? -f : f;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline uint16_t float_to_f16(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);            // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);           // overflow -> inf
  if (abs < 0x38800000u) {                                           // subnormal or zero
    float a = bits_to_float(abs) * 16777216.0f;                      // in units of 2^-24
    uint32_t r = uint32_t(a);
    float frac = a - float(r);
    if (frac > 0.5f || (frac == 0.5f && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t mant = abs + 0xc8000fffu + ((abs >> 13) & 1u);  // rebias exponent, round to even
  return uint16_t(sign | (mant >> 13));
}

inline float load_as_float(const void* base, int64_t idx, DType t) {
  uint16_t h = static_cast<const uint16_t*>(base)[idx];
  return t == DType::bf16 ? bf16_to_float(h) : f16_to_float(h);
}

inline void store_from_float(void* base, int64_t idx, float v, DType t) {
  static_cast<uint16_t*>(base)[idx] = t == DType::bf16 ? float_to_bf16(v) : float_to_f16(v);
}

}  // namespace hipflash::detail
