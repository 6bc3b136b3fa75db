// hipflash — DType -> device element type.
#pragma once

#include "hipflash/port/port.hpp"
#include "hipflash/types.hpp"

namespace hipflash::generic {

template <DType kDType>
struct Element { using type = port::f16_t; };
template <>
struct Element<DType::bf16> { using type = port::bf16_t; };

}  // namespace hipflash::generic
