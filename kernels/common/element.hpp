// hipflash — shared by every schedule: the device element type of each DType, spelled out per
// dtype (a dtype without a specialisation does not compile: there is no "bf16, else f16"
// default), with its size, which the tiles' byte counts use.
#pragma once

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

}  // namespace hipflash::common
