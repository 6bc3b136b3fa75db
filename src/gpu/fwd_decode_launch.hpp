// hipflash — the one place that launches the decode forward kernel. Included only by the
// generated instantiation TUs (see launch_api.hpp).
#pragma once

#include "decode/fwd_decode_kernel.hpp"
#include "gpu/launch_fwd.hpp"
#include "hipflash/detail/selector.hpp"

namespace hipflash::gpu {

/// The decode kernel's launch traits (kKv: where the instantiation reads K / V).
template <class Traits, common::KvRows kKv>
struct DecodeLaunch : NoPrepare {
  using Tile = decode::TileOf<Traits>;  // K / V of q's dtype or e4m3
  using Scheduler = decode::Scheduler;
  static constexpr auto kKernel = decode::fwd_decode_kernel<Traits, kKv>;
  static constexpr const char* kName =
      kKv == common::KvRows::contiguous ? "decode"
      : kKv == common::KvRows::pages  ? "decode (paged KV cache)"
                                      : "decode (paged KV cache, rows gathered)";
  static_assert(Tile::kBlockM == kDecodeMaxRows, "the selector's decode bound is the query block");
};

template <class Traits>
void launch_decode_fwd(const FwdParams& p, port::stream_t stream) {
  launch_fwd_paged_or_not<DecodeLaunch, Traits>(p, stream);
}

}  // namespace hipflash::gpu
