// hipflash — the one place that launches the gfx950 dualwave forward kernel. Included only by
// the generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "gfx950/fwd_dualwave_kernel.hpp"
#include "gpu/launch_fwd.hpp"

namespace hipflash::gpu {

template <class Traits>
void launch_dualwave_fwd(const FwdParams& p, port::stream_t stream) {
  using Cfg = gfx950::DualwaveTile<Traits::kHeadDim>;
  launch_fwd_grid<Cfg, gfx950::fwd_dualwave_kernel<Traits>>(p, stream, "dualwave");
}

}  // namespace hipflash::gpu
