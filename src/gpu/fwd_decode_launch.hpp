// hipflash — the one place that launches the decode forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "decode/fwd_decode_kernel.hpp"
#include "gpu/launch_fwd.hpp"
#include "hipflash/detail/selector.hpp"

namespace hipflash::gpu {

template <class Traits>
void launch_decode_fwd(const FwdParams& p, port::stream_t stream) {
  using Cfg = decode::DecodeTile<Traits::kHeadDim>;
  static_assert(Cfg::kBlockM == kDecodeMaxRows, "the selector's decode bound is the query block");
  launch_fwd_grid<Cfg, decode::fwd_decode_kernel<Traits>>(p, stream, "decode");
}

}  // namespace hipflash::gpu
