// hipflash — division by a run-time constant without a divide instruction (there is none on
// GPUs: a 32-bit `/` is a ~20-instruction sequence, a 64-bit one far more). The host computes a
// multiplier and a shift once per divisor (Granlund & Montgomery, "Division by invariant
// integers using multiplication", 1994: the round-up method); a quotient then costs a high
// multiply, an add and a shift. Exact for dividends below 2^31 and divisors in [1, 2^31).
#pragma once

#include <cstdint>

#include "hipflash/detail/softmax_state.hpp"  // HIPFLASH_HD

namespace hipflash::detail {

struct FastDiv {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;  ///< ceil(2^(32 + shift) / divisor) - 2^32
  uint32_t shift = 0;       ///< ceil(log2(divisor))

  FastDiv() = default;
  /// divisor in [1, 2^31).
  explicit FastDiv(uint32_t d) : divisor(d) {
    while ((uint64_t(1) << shift) < d) ++shift;
    multiplier = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d) / d + 1);
  }

  /// n / divisor for n < 2^31.
  HIPFLASH_HD uint32_t div(uint32_t n) const {
    const uint32_t hi = uint32_t((uint64_t(n) * multiplier) >> 32);
    return (hi + n) >> shift;
  }
  /// n / divisor and n % divisor for n < 2^31.
  HIPFLASH_HD uint32_t divmod(uint32_t n, uint32_t& rem) const {
    const uint32_t q = div(n);
    rem = n - q * divisor;
    return q;
  }
};

}  // namespace hipflash::detail
