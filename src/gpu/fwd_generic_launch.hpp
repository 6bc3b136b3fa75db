// hipflash — the one place that launches the generic forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "generic/fwd_kernel.hpp"
#include "gpu/launch_fwd.hpp"

namespace hipflash::gpu {

/// The generic kernel's launch traits.
template <class Traits>
struct GenericLaunch : NoPrepare {
  using Tile = generic::Tile<Traits::kHeadDim>;
  using Scheduler = generic::Scheduler;
  static constexpr auto kKernel = generic::fwd_generic_kernel<Traits>;
  static constexpr const char* kName = "generic";
};

template <class Traits>
void launch_generic_fwd(const FwdParams& p, port::stream_t stream) {
  launch_fwd<GenericLaunch<Traits>>(p, stream);
}

}  // namespace hipflash::gpu
