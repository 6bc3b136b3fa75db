// hipflash — the one place that launches the sm90 (Hopper, wgmma) forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "sm90/fwd_sm90_kernel.hpp"
#include "gpu/launch_fwd.hpp"

namespace hipflash::gpu {

template <class Traits>
void launch_sm90_fwd(const FwdParams& p, port::stream_t stream) {
  using Cfg = sm90::Tile<Traits::kHeadDim>;
  launch_fwd_grid<Cfg, sm90::fwd_sm90_kernel<Traits>>(p, stream, "sm90");
}

}  // namespace hipflash::gpu
