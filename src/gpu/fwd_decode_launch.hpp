// hipflash — the one place that launches the decode forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "decode/fwd_decode_kernel.hpp"
#include "gpu/launch_fwd.hpp"
#include "hipflash/detail/selector.hpp"

namespace hipflash::gpu {

/// The decode kernel's launch traits (kPaged: the instantiation reading a paged KV cache).
template <class Traits, bool kPaged>
struct DecodeLaunch : NoPrepare {
  using Tile = decode::TileOf<Traits>;  // K / V of q's dtype or e4m3
  using Scheduler = decode::Scheduler;
  static constexpr auto kKernel = decode::fwd_decode_kernel<Traits, kPaged>;
  static constexpr const char* kName = kPaged ? "decode (paged KV cache)" : "decode";
  static_assert(Tile::kBlockM == kDecodeMaxRows, "the selector's decode bound is the query block");
};

template <class Traits>
void launch_decode_fwd(const FwdParams& p, port::stream_t stream) {
  launch_fwd_paged_or_not<DecodeLaunch, Traits>(p, stream);
}

}  // namespace hipflash::gpu
