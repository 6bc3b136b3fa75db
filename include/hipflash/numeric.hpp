// hipflash — host-side conversions between float and the 16-bit element types (bf16, f16).
//
// The C++ API takes bf16 and f16 tensors as raw 16-bit words (uint16_t): the IEEE-754 binary16
// bit pattern for DType::f16, the upper half of a float's bit pattern for DType::bf16. These
// functions fill such buffers and read them back:
//
//   std::vector<uint16_t> q = hipflash::float_to_bf16(q_floats);   // whole vectors
//   float x = hipflash::bf16_to_float(out[0]);                       // one value
//
// Narrowing (float -> bf16 / f16) rounds to nearest, ties to even, like the GPUs' conversion
// instructions and PyTorch's .to(torch.bfloat16 / torch.float16):
//   - a NaN gives a quiet NaN of the same sign (bf16 keeps the upper payload bits; f16 gives
//     the canonical 0x7e00 / 0xfe00);
//   - +-inf gives +-inf, and so does a finite value at or beyond the midpoint between the
//     largest finite value and the next power of two (ties go to even, i.e. up): bf16
//     |x| >= 0x1.ffp127 (largest finite 0x1.fep127, about 3.39e38), f16 |x| >= 65520 (largest
//     finite 65504);
//   - values below the smallest normal (bf16 2^-126, f16 2^-14) become subnormals, rounded the
//     same way; at most half the smallest subnormal (bf16 2^-133, f16 2^-24) gives a zero of
//     the same sign.
// Widening (bf16 / f16 -> float) is exact: every value, +-0, +-inf and subnormals included,
// maps to the float of the same value; a NaN stays a NaN of the same sign and payload.
//
// float8 e4m3 (PyTorch's float8_e4m3fn, the fp8 forward's q, k, v) travels as bytes:
// e4m3_to_float is exact, float_to_e4m3 rounds to nearest even and gives NaN (the format has
// no infinity) for NaN and |x| > 464 (464 itself ties to 448), as PyTorch's unsaturated cast.
//
// Host code only: device code uses the vendor intrinsics. The CPU backend, the reference and
// the tests use these same functions (hipflash/detail/host_numeric.hpp builds on them).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace hipflash {

namespace detail {
inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
}  // namespace detail

/// bf16 word -> float. Exact.
inline float bf16_to_float(uint16_t h) { return detail::bits_to_float(uint32_t(h) << 16); }

/// float -> bf16 word, round to nearest even; NaN -> quiet NaN; overflow -> +-inf.
inline uint16_t float_to_bf16(float f) {
  uint32_t u = detail::float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even; carries into the exponent (inf)
  return uint16_t(u >> 16);
}

/// f16 (IEEE binary16) word -> float. Exact.
inline float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    if (man == 0) return detail::bits_to_float(sign);
    float f = float(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
    return sign ? -f : f;
  }
  if (exp == 31) return detail::bits_to_float(sign | 0x7f800000u | (man << 13));  // inf, NaN
  return detail::bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

/// float -> f16 word, round to nearest even; NaN -> quiet NaN; |f| >= 65520 -> +-inf.
inline uint16_t float_to_f16(float f) {
  uint32_t u = detail::float_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u);    // NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);   // 65520 and up (and inf) -> inf
  if (abs < 0x38800000u) {                                   // below 2^-14: subnormal or zero
    float a = detail::bits_to_float(abs) * 16777216.0f;      // in units of 2^-24, exact
    uint32_t r = uint32_t(a);
    float frac = a - float(r);
    if (frac > 0.5f || (frac == 0.5f && (r & 1u))) ++r;      // may carry into 2^-14: still right
    return uint16_t(sign | r);
  }
  uint32_t mant = abs + 0xc8000fffu + ((abs >> 13) & 1u);  // rebias exponent, round to even
  return uint16_t(sign | (mant >> 13));
}

/// float8 e4m3 (OCP FP8 E4M3, PyTorch's float8_e4m3fn: bias 7, no infinities, S.1111.111 NaN,
/// largest finite 448) byte -> float. Exact.
inline float e4m3_to_float(uint8_t b) {
  const bool neg = (b & 0x80u) != 0;
  const int exp = (b >> 3) & 0xf, man = b & 0x7;
  float f;
  if (exp == 15 && man == 7)
    f = detail::bits_to_float(0x7fc00000u);
  else if (exp == 0)
    f = std::ldexp(float(man), -9);  // subnormal: man * 2^-9
  else
    f = std::ldexp(1.f + float(man) / 8.f, exp - 7);
  return neg ? -f : f;
}

/// float -> e4m3 byte, round to nearest even; NaN and |f| > 464 (past 448's rounding interval,
/// whose upper tie goes to 448; the format has no infinity) -> NaN, as PyTorch's unsaturated
/// cast.
inline uint8_t float_to_e4m3(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80u : 0u;
  const float a = std::fabs(f);
  if (!(a <= 464.f)) return uint8_t(sign | 0x7fu);  // NaN, inf, overflow
  if (a < 0.015625f) {                              // below 2^-6: subnormal or zero
    const float units = a * 512.f;                  // in units of 2^-9, exact
    return uint8_t(sign | uint8_t(std::nearbyint(units)));  // 8 carries into 2^-6: still right
  }
  int e;
  const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  int q = int(std::nearbyint((m * 2.f - 1.f) * 8.f));
  int exp = e - 1 + 7;
  if (q == 8) q = 0, ++exp;
  return uint8_t(sign | (exp << 3) | q);
}

/// Whole-buffer forms of the bf16 / f16 conversions above, element by element.
inline std::vector<uint16_t> float_to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = float_to_bf16(x[i]);
  return r;
}
inline std::vector<uint16_t> float_to_f16(const std::vector<float>& x) {
  std::vector<uint16_t> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = float_to_f16(x[i]);
  return r;
}
inline std::vector<float> bf16_to_float(const std::vector<uint16_t>& h) {
  std::vector<float> r(h.size());
  for (size_t i = 0; i < h.size(); ++i) r[i] = bf16_to_float(h[i]);
  return r;
}
inline std::vector<float> f16_to_float(const std::vector<uint16_t>& h) {
  std::vector<float> r(h.size());
  for (size_t i = 0; i < h.size(); ++i) r[i] = f16_to_float(h[i]);
  return r;
}

}  // namespace hipflash
