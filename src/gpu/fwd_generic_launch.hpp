// hipflash — the one place that launches the generic forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "generic/fwd_kernel.hpp"
#include "gpu/launch_fwd.hpp"

namespace hipflash::gpu {

template <class Traits>
void launch_generic_fwd(const FwdParams& p, port::stream_t stream) {
  using Cfg = generic::Tile<Traits::kHeadDim>;
  launch_fwd_grid<Cfg, generic::fwd_generic_kernel<Traits>>(p, stream, "generic");
}

}  // namespace hipflash::gpu
