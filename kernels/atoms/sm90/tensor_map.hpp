// hipflash — a TMA tensor map as a kernel sees it: the 128 opaque bytes the host encoded
// (CUtensorMap, src/gpu/tma_host.hpp), passed by value in the kernel's parameters
// (__grid_constant__); the device side only names its address (atoms/sm90/tma.hpp).
#pragma once

#include <cstdint>

namespace hipflash::atom::sm90 {

struct alignas(64) TensorMap {
  uint64_t opaque[16];
};

}  // namespace hipflash::atom::sm90
