// The public float <-> bf16 / f16 conversions (include/hipflash/numeric.hpp): exact widening,
// round-to-nearest-even narrowing, ties, NaN, inf and overflow, subnormals, signed zero.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "hipflash/detail/fast_div.hpp"
#include "hipflash/detail/host_numeric.hpp"
#include "hipflash/numeric.hpp"

namespace hipflash {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

bool bf16_is_nan(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x007fu) != 0; }
bool f16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }

/// The value of an f16 word from its definition (sign, exponent, mantissa), in double.
double f16_value(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  const double v = exp == 0 ? std::ldexp(double(man), -24) : std::ldexp(double(1024 + man), exp - 25);
  return h & 0x8000u ? -v : v;
}

// ---- Widening is exact -----------------------------------------------------------------------

// detail::FastDiv (the merge kernel's index divisions): exact for every dividend below 2^31.
TEST(FastDiv, MatchesDivisionBelowTwoToThe31) {
  using detail::FastDiv;
  std::mt19937_64 rng(7);
  const uint32_t top = (1u << 31) - 1;
  auto check = [&](uint32_t d, uint32_t n) {
    uint32_t rem = 0;
    const uint32_t q = FastDiv(d).divmod(n, rem);
    ASSERT_EQ(q, n / d) << n << " / " << d;
    ASSERT_EQ(rem, n % d) << n << " % " << d;
  };
  for (uint32_t d = 1; d <= 300; ++d) {
    for (uint32_t n = 0; n < 3000; ++n) check(d, n);
    for (uint32_t n : {top, top - 1, top - d, d * 1000003u % top}) check(d, n);
  }
  for (int k = 0; k < 20000; ++k) {
    const uint32_t d = 1 + uint32_t(rng() % top);
    for (uint32_t n : {0u, d - 1, d, top, uint32_t(rng() % (uint64_t(top) + 1))}) check(d, n);
  }
  for (uint32_t p = 0; p < 31; ++p) check(1u << p, top);  // powers of two: a plain shift
}

TEST(Numeric, Bf16ToFloatIsTheUpperHalfOfTheFloat) {
  for (uint32_t h = 0; h <= 0xffffu; ++h)
    ASSERT_EQ(to_bits(bf16_to_float(uint16_t(h))), h << 16) << std::hex << h;
  EXPECT_EQ(bf16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_float(0xc000), -2.0f);
  EXPECT_EQ(bf16_to_float(0x7f7f), 0x1.fep127f);  // largest finite
  EXPECT_EQ(bf16_to_float(0x0001), 0x1p-133f);    // smallest subnormal
}

TEST(Numeric, F16ToFloatIsExactForEveryWord) {
  for (uint32_t w = 0; w <= 0xffffu; ++w) {
    const auto h = uint16_t(w);
    const float f = f16_to_float(h);
    if (f16_is_nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << w;
      ASSERT_EQ(std::signbit(f), bool(h & 0x8000u)) << std::hex << w;
    } else if ((h & 0x7fffu) == 0x7c00u) {
      ASSERT_EQ(f, h & 0x8000u ? -kInf : kInf);
    } else {
      ASSERT_EQ(double(f), f16_value(h)) << std::hex << w;
      ASSERT_EQ(std::signbit(f), bool(h & 0x8000u)) << std::hex << w;  // -0 too
    }
  }
  EXPECT_EQ(f16_to_float(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_float(0x7bff), 65504.0f);   // largest finite
  EXPECT_EQ(f16_to_float(0x0001), 0x1p-24f);   // smallest subnormal
  EXPECT_EQ(f16_to_float(0x03ff), 0x1.ff8p-15f);  // largest subnormal
  EXPECT_EQ(f16_to_float(0x0400), 0x1p-14f);   // smallest normal
}

// ---- Round trips -----------------------------------------------------------------------------

TEST(Numeric, EveryBf16WordRoundTrips) {
  for (uint32_t w = 0; w <= 0xffffu; ++w) {
    const auto h = uint16_t(w);
    const uint16_t back = float_to_bf16(bf16_to_float(h));
    if (bf16_is_nan(h))
      ASSERT_EQ(back, h | 0x40u) << std::hex << w;  // same NaN, made quiet
    else
      ASSERT_EQ(back, h) << std::hex << w;
  }
}

TEST(Numeric, EveryF16WordRoundTrips) {
  for (uint32_t w = 0; w <= 0xffffu; ++w) {
    const auto h = uint16_t(w);
    const uint16_t back = float_to_f16(f16_to_float(h));
    if (f16_is_nan(h))
      ASSERT_EQ(back, (h & 0x8000u) | 0x7e00u) << std::hex << w;  // the quiet NaN of that sign
    else
      ASSERT_EQ(back, h) << std::hex << w;
  }
}

// ---- Rounding: nearest, ties to even ---------------------------------------------------------

TEST(Numeric, Bf16TiesGoToEven) {
  // 1.0 = 0x3f80; one bf16 step at 1 is 2^-7.
  EXPECT_EQ(float_to_bf16(1.0f + 0x1p-8f), 0x3f80);             // tie, 0x3f80 even: down
  EXPECT_EQ(float_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);         // tie, 0x3f81 odd: up
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + 0x1p-8f, 2.0f)), 0x3f81);  // above the tie
  EXPECT_EQ(float_to_bf16(std::nextafter(1.0f + 3 * 0x1p-8f, 0.0f)), 0x3f81);  // below it
  EXPECT_EQ(float_to_bf16(-(1.0f + 0x1p-8f)), 0xbf80);          // symmetric in the sign
  EXPECT_EQ(float_to_bf16(-(1.0f + 3 * 0x1p-8f)), 0xbf82);
  // Subnormal ties: half the smallest subnormal (2^-134) goes to 0, 1.5 of it to 2.
  EXPECT_EQ(float_to_bf16(0x1p-134f), 0x0000);
  EXPECT_EQ(float_to_bf16(3 * 0x1p-134f), 0x0002);
}

TEST(Numeric, F16TiesGoToEven) {
  // 1.0 = 0x3c00; one f16 step at 1 is 2^-10.
  EXPECT_EQ(float_to_f16(1.0f + 0x1p-11f), 0x3c00);
  EXPECT_EQ(float_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);
  EXPECT_EQ(float_to_f16(std::nextafter(1.0f + 0x1p-11f, 2.0f)), 0x3c01);
  EXPECT_EQ(float_to_f16(std::nextafter(1.0f + 3 * 0x1p-11f, 0.0f)), 0x3c01);
  EXPECT_EQ(float_to_f16(-(1.0f + 0x1p-11f)), 0xbc00);
  // Subnormal ties, in units of the smallest subnormal 2^-24: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2.
  EXPECT_EQ(float_to_f16(0.5f * 0x1p-24f), 0x0000);
  EXPECT_EQ(float_to_f16(1.5f * 0x1p-24f), 0x0002);
  EXPECT_EQ(float_to_f16(2.5f * 0x1p-24f), 0x0002);
  EXPECT_EQ(float_to_f16(-1.5f * 0x1p-24f), 0x8002);
  EXPECT_EQ(float_to_f16(std::nextafter(0.5f * 0x1p-24f, 1.0f)), 0x0001);
}

/// For floats spread over the whole range: the result is a nearest representable value, and
/// an even one on a tie. `decode` gives a word's value; `next` steps a word away from zero.
template <class Encode, class Decode>
void check_nearest_even(Encode encode, Decode decode, uint16_t max_finite) {
  for (uint64_t b = 0; b <= 0xffffffffu; b += 0x1003) {  // ~1M floats, every exponent
    const float x = from_bits(uint32_t(b));
    if (std::isnan(x)) continue;
    const uint16_t r = encode(x);
    const uint16_t mag = r & 0x7fffu;
    if (mag > max_finite) continue;  // overflow to inf: checked by its own test
    const double err = std::fabs(double(decode(r)) - double(x));
    const uint16_t sign = r & 0x8000u;
    if (mag < max_finite) {  // the next value away from zero is not closer
      const double up = std::fabs(double(decode(uint16_t(sign | (mag + 1)))) - double(x));
      ASSERT_LE(err, up) << std::hexfloat << x;
      if (err == up) ASSERT_EQ(mag & 1u, 0u) << "tie not to even at " << std::hexfloat << x;
    }
    if (mag > 0) {  // nor the next one towards zero
      const double down = std::fabs(double(decode(uint16_t(sign | (mag - 1)))) - double(x));
      ASSERT_LE(err, down) << std::hexfloat << x;
      if (err == down) ASSERT_EQ(mag & 1u, 0u) << "tie not to even at " << std::hexfloat << x;
    }
  }
}

TEST(Numeric, Bf16RoundsToNearestEven) {
  check_nearest_even([](float x) { return float_to_bf16(x); },
                     [](uint16_t h) { return bf16_to_float(h); }, 0x7f7f);
}

TEST(Numeric, F16RoundsToNearestEven) {
  check_nearest_even([](float x) { return float_to_f16(x); },
                     [](uint16_t h) { return f16_to_float(h); }, 0x7bff);
}

// ---- NaN, inf, overflow ----------------------------------------------------------------------

TEST(Numeric, NaNStaysAQuietNaNOfTheSameSign) {
  const float nans[] = {
      std::numeric_limits<float>::quiet_NaN(),
      std::numeric_limits<float>::signaling_NaN(),
      from_bits(0x7f800001u),  // signalling, payload only in the low bits: must not become inf
      from_bits(0x7fffffffu),
  };
  for (float n : nans) {
    for (float x : {n, -n}) {
      const uint16_t b = float_to_bf16(x), h = float_to_f16(x);
      EXPECT_TRUE(bf16_is_nan(b)) << std::hex << to_bits(x) << " -> " << b;
      EXPECT_TRUE(b & 0x40u) << "bf16 NaN not quiet: " << std::hex << b;
      EXPECT_EQ(bool(b & 0x8000u), std::signbit(x));
      EXPECT_TRUE(f16_is_nan(h)) << std::hex << to_bits(x) << " -> " << h;
      EXPECT_TRUE(h & 0x200u) << "f16 NaN not quiet: " << std::hex << h;
      EXPECT_EQ(bool(h & 0x8000u), std::signbit(x));
      EXPECT_TRUE(std::isnan(bf16_to_float(b)));
      EXPECT_TRUE(std::isnan(f16_to_float(h)));
    }
  }
  EXPECT_EQ(float_to_bf16(from_bits(0x7fa12345u)), 0x7fe1);  // bf16 keeps the upper payload
}

TEST(Numeric, InfAndOverflowGiveInf) {
  EXPECT_EQ(float_to_bf16(kInf), 0x7f80);
  EXPECT_EQ(float_to_bf16(-kInf), 0xff80);
  EXPECT_EQ(float_to_f16(kInf), 0x7c00);
  EXPECT_EQ(float_to_f16(-kInf), 0xfc00);
  EXPECT_EQ(bf16_to_float(0x7f80), kInf);
  EXPECT_EQ(f16_to_float(0xfc00), -kInf);

  // bf16: largest finite 0x1.fep127; the midpoint 0x1.ffp127 and above round to inf.
  EXPECT_EQ(float_to_bf16(0x1.fep127f), 0x7f7f);
  EXPECT_EQ(float_to_bf16(std::nextafter(0x1.ffp127f, 0.0f)), 0x7f7f);
  EXPECT_EQ(float_to_bf16(0x1.ffp127f), 0x7f80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::max()), 0xff80);

  // f16: largest finite 65504; 65520 (the midpoint) and above round to inf.
  EXPECT_EQ(float_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16(std::nextafter(65520.0f, 0.0f)), 0x7bff);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_f16(-65520.0f), 0xfc00);
  EXPECT_EQ(float_to_f16(1e6f), 0x7c00);
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::max()), 0x7c00);
}

// ---- Subnormals and zeros --------------------------------------------------------------------

TEST(Numeric, SubnormalsBothWays) {
  // f16: 2^-24 .. 1023 * 2^-24 are subnormal; 2^-14 is the smallest normal.
  EXPECT_EQ(float_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(float_to_f16(-0x1p-24f), 0x8001);
  EXPECT_EQ(float_to_f16(0x1.ff8p-15f), 0x03ff);
  EXPECT_EQ(float_to_f16(0x1p-14f), 0x0400);
  EXPECT_EQ(float_to_f16(std::nextafter(0x1p-14f, 0.0f)), 0x0400);  // rounds up into normal
  EXPECT_EQ(float_to_f16(0x1p-25f), 0x0000);                         // half of 2^-24: tie to 0
  EXPECT_EQ(float_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_f16(-std::numeric_limits<float>::denorm_min()), 0x8000);

  // bf16 has float's exponent range: float subnormals map to bf16 subnormals.
  EXPECT_EQ(float_to_bf16(0x1p-133f), 0x0001);
  EXPECT_EQ(float_to_bf16(0x1p-127f), 0x0040);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::min()), 0x0080);  // 2^-126, normal
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(float_to_bf16(-std::numeric_limits<float>::denorm_min()), 0x8000);
  EXPECT_EQ(bf16_to_float(0x0040), 0x1p-127f);
}

TEST(Numeric, SignedZeros) {
  EXPECT_EQ(float_to_bf16(0.0f), 0x0000);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_f16(0.0f), 0x0000);
  EXPECT_EQ(float_to_f16(-0.0f), 0x8000);
  EXPECT_TRUE(std::signbit(bf16_to_float(0x8000)));
  EXPECT_TRUE(std::signbit(f16_to_float(0x8000)));
  EXPECT_EQ(f16_to_float(0x8000), 0.0f);
}

// ---- Buffer forms, and the internal helpers built on the same functions ----------------------

TEST(Numeric, VectorFormsMatchTheScalarOnes) {
  const std::vector<float> x = {0.0f, -0.0f, 1.0f, -2.5f, 0x1p-24f, 65520.0f, 1e-40f, kInf,
                                std::numeric_limits<float>::quiet_NaN(), 3.14159f};
  const std::vector<uint16_t> b = float_to_bf16(x), h = float_to_f16(x);
  ASSERT_EQ(b.size(), x.size());
  ASSERT_EQ(h.size(), x.size());
  const std::vector<float> bf = bf16_to_float(b), hf = f16_to_float(h);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(b[i], float_to_bf16(x[i])) << i;
    EXPECT_EQ(h[i], float_to_f16(x[i])) << i;
    EXPECT_EQ(to_bits(bf[i]), to_bits(bf16_to_float(b[i]))) << i;
    EXPECT_EQ(to_bits(hf[i]), to_bits(f16_to_float(h[i]))) << i;
  }
  EXPECT_TRUE(float_to_bf16(std::vector<float>{}).empty());
}

TEST(Numeric, DetailElementAccessUsesThePublicConversions) {
  uint16_t word = 0;
  for (float x : {1.0f + 0x1p-8f, -3.0e-6f, 70000.0f, 0x1p-25f}) {
    detail::store_from_float(&word, 0, x, DType::bf16);
    EXPECT_EQ(word, float_to_bf16(x));
    EXPECT_EQ(detail::load_as_float(&word, 0, DType::bf16), bf16_to_float(word));
    detail::store_from_float(&word, 0, x, DType::f16);
    EXPECT_EQ(word, float_to_f16(x));
    EXPECT_EQ(detail::load_as_float(&word, 0, DType::f16), f16_to_float(word));
  }
}

// float8 e4m3 (float8_e4m3fn): every byte's value from its fields, every finite byte round-trips,
// ties go to even (464 to 448), and the format's lack of infinity: NaN past 464.
TEST(Numeric, E4m3BytesDecodeFromTheirFields) {
  for (int byte = 0; byte < 256; ++byte) {
    const int exp = (byte >> 3) & 15, man = byte & 7;
    const float sign = byte & 0x80 ? -1.f : 1.f;
    const float x = e4m3_to_float(uint8_t(byte));
    if (exp == 15 && man == 7) {
      EXPECT_TRUE(std::isnan(x)) << byte;
      continue;
    }
    const double want = exp == 0 ? man / 512.0 : (1.0 + man / 8.0) * std::ldexp(1.0, exp - 7);
    EXPECT_EQ(double(x), sign * want) << byte;
    EXPECT_EQ(float_to_e4m3(x), uint8_t(byte)) << byte;  // round trip (-0 included)
  }
  EXPECT_EQ(e4m3_to_float(0x7e), 448.f);  // the largest finite value
}

TEST(Numeric, E4m3RoundsToNearestEvenAndOverflowsToNaN) {
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.0625f)), 1.f);     // tie between 1 and 1.125: even
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.1875f)), 1.25f);   // tie between 1.125 and 1.25
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.07f)), 1.125f);
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(460.f)), 448.f);
  EXPECT_EQ(float_to_e4m3(464.f), 0x7e);  // the tie between 448 and the NaN code: even, 448
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(-0.0009765625f)), -0.f);  // half the smallest: even 0
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(0.0029296875f)), 0.00390625f);  // 1.5 units: 2 units
  for (float big : {464.5f, 479.f, 480.f, 1e6f, std::numeric_limits<float>::infinity()}) {
    EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(big)))) << big;
    EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(-big)))) << -big;
  }
  EXPECT_TRUE(std::isnan(e4m3_to_float(float_to_e4m3(std::nanf("")))));
}

}  // namespace
}  // namespace hipflash
