// hipflash — the one place that launches the gfx950 dualwave forward kernel. Included only by
// the generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "gfx950/fwd_dualwave_kernel.hpp"
#include "gpu/launch_fwd.hpp"

namespace hipflash::gpu {

/// The dualwave kernel's launch traits.
template <class Traits>
struct DualwaveLaunch : NoPrepare {
  using Tile = gfx950::DualwaveTile<Traits::kHeadDim>;
  using Scheduler = gfx950::Scheduler;
  static constexpr auto kKernel = gfx950::fwd_dualwave_kernel<Traits>;
  static constexpr const char* kName = "dualwave";
};

template <class Traits>
void launch_dualwave_fwd(const FwdParams& p, port::stream_t stream) {
  launch_fwd<DualwaveLaunch<Traits>>(p, stream);
}

}  // namespace hipflash::gpu
