// hipflash — the one place that launches the sm90 (Hopper, wgmma) forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "sm90/fwd_sm90_kernel.hpp"
#include "gpu/launch_fwd.hpp"

namespace hipflash::gpu {

/// The sm90 kernel's launch traits.
template <class Traits>
struct Sm90Launch : NoPrepare {
  using Tile = sm90::Tile<Traits::kHeadDim>;
  using Scheduler = sm90::Scheduler;
  static constexpr auto kKernel = sm90::fwd_sm90_kernel<Traits>;
  static constexpr const char* kName = "sm90";
};

template <class Traits>
void launch_sm90_fwd(const FwdParams& p, port::stream_t stream) {
  launch_fwd<Sm90Launch<Traits>>(p, stream);
}

}  // namespace hipflash::gpu
